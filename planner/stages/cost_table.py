"""The layer cost table: every layer on every logical mesh, planned once per distinct layer.

Layers with equal `Layers.keys` are identical (same ops, same shapes), so each distinct layer is
planned once per logical mesh (`layer_cost`): for a GPT that is three ILPs per logical mesh
(embedding, one block, head and loss), whatever the depth: GPT-39B's 48 blocks cost one block's plan.

Each layer's plan also chooses the layouts its inputs are read in and its outputs made in; where
one layer of a stage makes a value in another layout than a later layer of the same stage reads it
in, the stage pays the resharding, forward and backward (`LayerCostTable.inner`, priced by the
ILP's `reshard_cost`).

The per-layer ILP plans for time alone, so each layer's plan is the fastest and, where memory
binds, often not the leanest: a stage of Megatron-style tensor-parallel layers, or of fully
sharded (ZeRO-3) ones, can fit where the fastest plans only fit with recomputation or more stages.
So the table holds, besides each layer's own plan, *variants*: the layer planned again with the
program inputs it reads (parameters, optimizer state, the batch) pinned to a hand layout
(`LayerCostTable.variants`, `LAYER_VARIANTS`: the named baselines `megatron-tp` and `fsdp`,
`planner.configs.baselines`), everything else still chosen by the ILP. Every variant of a stage
runs in each of the stage's ways (`stage_cost`), and the DP picks among all of them
(`StageOption.variant`). Those hand layouts are then points of the search: a `NAME+ppN` baseline
(`fixed_pipeline.fixed_pipeline`) is one of the pipelines the DP prices.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from planner.core.options import PlanOptions
from planner.core.sharding import Spec
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.ilp.problem import Problem
from planner.ilp.strategies import reshard_cost
from planner.search.cores import idle_cores
from planner.stages.clustering import Layers
from planner.stages.layer_cost import LayerCost, layer_step_cost, reuse
from planner.stages.layer_facts import LayerFacts, external_inputs, layer_edges, layer_facts
from planner.stages.submesh import LogicalMesh, effective_hardware, planning_hardware


# The key in `LayerCostTable.cache` under which the step-weighted solves are kept (by the layer's
# key without its microbatch count), for other counts to take plans from (`LayerCostTable._solve`).
STEP_SOLVES = "step solves"


# The key in `LayerCostTable.cache` under which the layer ILPs are kept for later batch sizes, where
# the cache's owner asks for them (`PlanningMemo.keep_layer_problems`: a sweep of batch sizes; a
# layer at one microbatch size is the same ILP at every count, only the share it weighs moves).
LAYER_PROBLEMS = "layer problems"


# The key in `LayerCostTable.cache` of the layer ILPs' cost models by mesh and options
# (`mesh_plan.cost_model_for(memo=)`): the tables sharing the cache price their ILPs with one model
# per mesh, whose resharding times (`CostModel.part_times`) every layer, count and variant reuses.
COST_MODELS = "cost models"


def planned_layers(cache: Mapping) -> int:
    """How many layer costs a table's `cache` holds (its solves', ILPs' and cost models' entries not counted)."""
    return len(cache) - sum(k in cache for k in (STEP_SOLVES, LAYER_PROBLEMS, COST_MODELS))


class SameCosts:
    """Every layer's cost on one mesh in one variant, equal to another only where each layer's cost
    is the very same object: tables of other counts sharing a cache hold the same objects where a
    layer took an earlier solve's plan (`layer_cost.reuse`, the one-microbatch cost), so what is
    computed from the costs alone is shared between them (it holds them: identities stay unique)."""

    __slots__ = ("costs", "_hash")

    def __init__(self, costs: Sequence[LayerCost]):
        self.costs = tuple(costs)
        self._hash = hash(tuple(map(id, self.costs)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SameCosts) and len(self.costs) == len(other.costs) and all(
            a is b for a, b in zip(self.costs, other.costs))


# The hand layouts each layer is also planned in (`LayerCostTable.variants`; see the module docstring).
LAYER_VARIANTS = ("megatron-tp", "fsdp")


@dataclasses.dataclass(slots=True)
class LayerCostTable:
    """Costs of every layer on every logical mesh, planned once per distinct layer.

    `cost(layer, mesh_index)` is a LayerCost; `cache` maps (layer key, mesh shape, links, pinned
    specs) to it and may be shared between tables (e.g. for several microbatch sizes whose layers
    coincide). `pins(logical_mesh)`, when given, fixes the sharding of program inputs on that mesh
    ({tensor id: Spec}, e.g. a baseline's or the user's pins): each layer's ILP is planned with the
    pinned inputs it reads fixed, so a stage holding a pinned parameter keeps it as pinned; an
    exception in place of a Spec (a pin that mesh cannot take) makes the layers reading that input
    infeasible on that mesh.

    `microbatches`: the microbatches per step the table prices (`layer_cost`: each layer's ILP
    chooses its layout for the step, its gradient reductions paid once); part of the cache key.

    `variants` names further per-layer plans: name -> `pins(logical_mesh)` in the form above,
    each layer on that mesh planned again with the inputs it reads pinned so (`cost(layer, mesh_index,
    variant)`; "" is the layer's own plan, pinned by `pins` only). A variant whose pins map is empty on
    a mesh is not planned there (`has_variant`).
    """

    graph: Graph
    layers: Layers
    meshes: tuple[LogicalMesh, ...]
    cluster: Cluster
    options: PlanOptions
    cache: dict = dataclasses.field(default_factory=dict)
    facts: tuple[LayerFacts, ...] = ()
    solves: int = 0
    reused: int = 0  # costs taken from another count's step-weighted solve (`_solve`)
    pins: Callable[[LogicalMesh], Mapping[int, Spec]] | None = None
    variants: Mapping[str, Callable[[LogicalMesh], Mapping[int, Spec]]] = dataclasses.field(default_factory=dict)
    _pinned: dict = dataclasses.field(default_factory=dict)
    _inner: dict = dataclasses.field(default_factory=dict)
    _edges: tuple | None = None
    _inputs: dict = dataclasses.field(default_factory=dict)  # layer -> its `external_inputs`
    _rows: dict = dataclasses.field(default_factory=dict)  # (mesh index, variant) -> every layer's cost
    ranges: dict = dataclasses.field(default_factory=dict)  # `stage_cost.stage_ranges`'s, shared like `cache`
    microbatches: int = 1  # per step: each layer's ILP weighs its gradient reductions at 1/microbatches

    def __post_init__(self):
        if not self.facts:
            self.facts = self.graph.cached(("layer_facts", self.layers), lambda: layer_facts(self.graph, self.layers))

    def inner(self, mesh_index: int, variant: str = "") -> np.ndarray:
        """`out[k, i]`: seconds per microbatch spent resharding values passed between layers k..i
        when they run in one stage on that mesh (meaningful for i >= k).

        Each layer's plan chooses the layout it reads its inputs in and the layout it makes its
        outputs in; where a value made by layer l is read by a later layer c of the same stage in
        another layout, the stage reshards it in the forward and its gradient (the same bytes, the
        other way) in the backward: twice `reshard_cost` of the value on the stage's logical mesh
        (the one pricing of resharding the intra-op ILP uses). Values crossing a stage boundary are
        the send's business (`stage_ranges`)."""
        if (mesh_index, variant) in self._inner:
            return self._inner[mesh_index, variant]
        if self._edges is None:
            self._edges = layer_edges(self.graph, self.layers, self.facts)
        L = self.layers.num_layers
        pair = np.zeros((L, L))
        cost = self.meshes[mesh_index].cost_model(effective_hardware(self.cluster))
        for l, key, c, j, t in self._edges:
            made, read = self.cost(l, mesh_index, variant), self.cost(c, mesh_index, variant)
            src = made.produced_specs.get(key)
            dst = read.input_specs[j] if j < len(read.input_specs) else None
            if src is None or dst is None or src == dst:
                continue
            pair[l, c] += 2 * reshard_cost(self.graph.tensors[t], src, dst, cost)[1]
        # out[k, i] = sum over k <= l < c <= i of pair[l, c]
        out = np.flip(np.cumsum(np.flip(np.cumsum(pair, axis=1), axis=0), axis=0), axis=0)
        self._inner[mesh_index, variant] = out
        return out

    def _pins_on(self, mesh_index: int, variant: str) -> Mapping[int, Spec]:
        if (variant, mesh_index) not in self._pinned:
            source = self.pins if not variant else self.variants[variant]
            self._pinned[variant, mesh_index] = {} if source is None else dict(source(self.meshes[mesh_index]))
        return self._pinned[variant, mesh_index]

    def has_variant(self, variant: str, mesh_index: int) -> bool:
        """Whether the variant is planned on that mesh ("": always; a named one: its pins say something)."""
        return not variant or bool(self._pins_on(mesh_index, variant))

    def pinned(self, layer: int, mesh_index: int, variant: str = "") -> tuple[Mapping[int, Spec], tuple]:
        """The pinned inputs the layer reads on that mesh ({tensor id: Spec}) and their specs in the
        layer's input order (part of the cache key: identical layers pinned alike share a plan)."""
        if self.pins is None and not variant:
            return {}, ()
        by_tensor = self._pins_on(mesh_index, variant)
        ext = self._inputs.get(layer)
        if ext is None:  # looked up on every `cost` of a pinned or variant layer
            ext = self._inputs[layer] = external_inputs(self.graph, self.facts[layer].ops)
        key = tuple(str(v) if isinstance(v, Exception) else by_tensor.get(t)
                    for t in ext for v in (by_tensor.get(t),))
        return by_tensor, (() if all(k is None for k in key) else key)

    def _key(self, layer: int, mesh_index: int, variant: str = "") -> tuple[tuple, Mapping[int, Spec]]:
        lm = self.meshes[mesh_index]
        pinned, pin_key = self.pinned(layer, mesh_index, variant)
        return (self.layers.keys[layer], lm.mesh.shape, lm.links, self.cluster.hardware.name, pin_key,
                self.microbatches), pinned

    def _solve(self, layer: int, mesh_index: int, pinned: Mapping[int, Spec], key: tuple) -> LayerCost:
        """The layer's cost: from the solves of the same layer at the same microbatch size for other
        counts (other batch sizes sharing `cache`; the one-microbatch solve bounds them too,
        `layer_cost.reuse`) where one of their plans is provably within the gap here, else solved
        (and its `StepSolve` kept for the other counts)."""
        solves = self.cache.setdefault(STEP_SOLVES, {}).setdefault(key[:-1], [])
        kept = self.cache.get(LAYER_PROBLEMS)  # the layer's ILP, under its key without the count, where kept
        models = self.cache.setdefault(COST_MODELS, {})

        def keep(make: Callable[[], Problem]) -> Problem:
            if key[:-1] not in kept:
                kept[key[:-1]] = make()
            return kept[key[:-1]]

        def alone(problem=None) -> LayerCost:  # the one-microbatch cost, kept as a one-microbatch table keeps it
            one = key[:-1] + (1,)
            if one not in self.cache:
                self.cache[one], solve = layer_step_cost(self.graph, self.layers, self.facts[layer], layer,
                                                         self.meshes[mesh_index], planning_hardware(self.cluster),
                                                         self.options, pinned, problem=problem,
                                                         keep=None if kept is None else keep, cost_models=models)
                if solve is not None:
                    solves.append(solve)
            return self.cache[one]

        if self.microbatches > 1:
            found = reuse(list(solves), self.microbatches, alone)
            if found is not None:
                self.reused += 1
                return found
        found, solve = layer_step_cost(self.graph, self.layers, self.facts[layer], layer, self.meshes[mesh_index],
                                       planning_hardware(self.cluster), self.options, pinned, self.microbatches,
                                       alone if self.microbatches > 1 else None,
                                       keep=None if kept is None else keep, cost_models=models)
        if solve is not None:
            solves.append(solve)
        return found

    def same_rows(self, mesh_index: int, variant: str = "") -> SameCosts:
        """`rows` as a key for what is computed from them alone (`stage_cost.stage_ranges`)."""
        key = ("same", mesh_index, variant)
        hit = self._rows.get(key)
        if hit is None:
            hit = self._rows[key] = SameCosts(self.rows(mesh_index, variant))
        return hit

    def rows(self, mesh_index: int, variant: str = "") -> tuple[LayerCost, ...]:
        """Every layer's cost on that mesh in that variant, in layer order (looked up once: the
        stage tables read them per way and submesh)."""
        hit = self._rows.get((mesh_index, variant))
        if hit is None:
            hit = self._rows[mesh_index, variant] = tuple(self.cost(l, mesh_index, variant)
                                                          for l in range(self.layers.num_layers))
        return hit

    def cost(self, layer: int, mesh_index: int, variant: str = "") -> LayerCost:
        key, pinned = self._key(layer, mesh_index, variant)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._solve(layer, mesh_index, pinned, key)
            self.solves += 1
        return hit

    def fill(self, mesh_indices: Sequence[int], threads: int | None = None, variants: Sequence[str] = ("",)) -> None:
        """Plans every distinct layer on each of `mesh_indices` (in each of `variants` the mesh has,
        `has_variant`) not planned yet, `threads` at once
        (None: the idle cores, `search.cores.idle_cores`, divided by `options.solver_workers`). CP-SAT
        releases the GIL while it searches, so the solves run side by side; each is planned alone (one
        CP-SAT worker, deterministic limits), so the table is the one `cost` fills one by one."""
        todo: dict[tuple, tuple[int, int, Mapping[int, Spec]]] = {}
        for variant in variants:
            for mi in mesh_indices:
                if not self.has_variant(variant, mi):
                    continue
                for layer in range(self.layers.num_layers):
                    key, pinned = self._key(layer, mi, variant)
                    if key not in self.cache and key not in todo:
                        todo[key] = (layer, mi, pinned)
        if threads is None:
            threads = idle_cores() // max(1, self.options.solver_workers)
        threads = max(1, min(threads, len(todo)))
        if threads == 1:
            for key, (layer, mi, pinned) in todo.items():
                self.cache[key] = self._solve(layer, mi, pinned, key)
                self.solves += 1
            return
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            # the likely longest first (`_solve_order`), so that no long solve starts last on one thread
            futures = {key: pool.submit(self._solve, *todo[key], key) for key in self._solve_order(todo)}
            for key in todo:  # in `todo`'s order: the cache's order is the serial one's
                self.cache[key] = futures[key].result()
                self.solves += 1

    def _solve_order(self, todo: Mapping[tuple, tuple[int, int, Mapping[int, Spec]]]) -> list[tuple]:
        """`todo`'s keys, the likely longest solve first, so that no long solve starts last on one
        thread. The guess: the square of the layer's op count, four times more on a mesh of two or
        more split axes than on one, twice as much for the layer's own plan as for a pinned one (GPT-39B
        at 1-8 rows per microbatch, this machine: its ~300-op block ~1.1 s on a 2-D mesh unpinned,
        ~0.6 s pinned, ~0.1 s on a 1-D mesh; its ~130-op head ~0.15 s on a 2-D mesh). Each solve is
        planned alone, so the order changes when the threads finish, not what they find."""
        def guess(key: tuple) -> float:
            layer, mi, pinned = todo[key]
            split = sum(1 for n in self.meshes[mi].mesh.shape if n > 1)
            return len(self.facts[layer].ops) ** 2 * (4.0 if split >= 2 else 0.5) * (1.0 if pinned else 2.0)
        return sorted(todo, key=guess, reverse=True)
