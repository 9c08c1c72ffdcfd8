"""Microbatches: the counts to try, the arguments cut to one microbatch, and the step traced on it.

The batch is the last positional argument (or the `batch_argnum` ones); every leaf of it is split
along axis 0. A step that does not trace on some microbatch size drops that count from the search
(`UntraceableMicrobatches`) instead of stopping it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from planner.core.errors import InvalidArgumentError, PlannerError, first_line
from planner.graph.ir import Graph
from planner.graph.shape_family import MIN_SIZE, ShapeFamily, trace_family
from planner.graph.trace import trace
from planner.stages.clustering import Layers, cluster_by_modules, cluster_layers

log = logging.getLogger("planner")


def batch_argnums(batch_argnum: int | tuple[int, ...]) -> tuple[int, ...]:
    """The batch argument position(s) as a tuple."""
    return (batch_argnum,) if isinstance(batch_argnum, int) else tuple(batch_argnum)


def batch_size(args: tuple[Any, ...], batch_argnum: int | tuple[int, ...] = -1) -> int:
    """The leading dimension shared by every leaf of the batch argument(s)."""
    leaves = jax.tree_util.tree_leaves([args[a] for a in batch_argnums(batch_argnum)])
    sizes = {int(np.shape(x)[0]) for x in leaves if np.ndim(x) >= 1}
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"the batch argument (position {batch_argnum}) must have leaves with one common leading dimension "
            f"to split into microbatches; found leading dimensions {sorted(sizes)}")
    return sizes.pop()


def microbatch_args(args: tuple[Any, ...], microbatch: int,
                    batch_argnum: int | tuple[int, ...] = -1) -> tuple[Any, ...]:
    """`args` as ShapeDtypeStructs with the batch argument(s)' leaves cut to `microbatch` rows."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    out = list(abstract)
    for a in batch_argnums(batch_argnum):
        out[a] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((microbatch,) + tuple(x.shape[1:]), x.dtype),
                              abstract[a])
    return tuple(out)


class UntraceableMicrobatches(InvalidArgumentError):
    """The step does not trace on microbatches of some size (`trace_microbatch`); out of
    `plan_pipeline` / `fixed_pipeline` when no count tried traces (`none_traces`). A caller that
    knows why the step cannot be split (`stages.derived`) says that instead
    (`planned.plan_with_stages`)."""


def none_traces(untraceable: Sequence[str], counts: Sequence[int]) -> UntraceableMicrobatches:
    """The one-line error when no microbatch count traces: the first count's reason."""
    return UntraceableMicrobatches(f"{untraceable[0]}; no microbatch count tried traces "
                                   f"({', '.join(map(str, counts))})")


def trace_microbatch(fn: Callable, args: Sequence[Any], count: int, rows: int, replicas: int = 1) -> Graph:
    """`fn` traced on one microbatch (`args` cut to `rows // replicas` rows: one of `replicas`
    data-parallel replicas' share of it when more than one); a step that cannot run on them (it
    traced on the whole batch: the caller's graph) raises `UntraceableMicrobatches` with the step's
    own error in one line, so the pipeline search drops that microbatch count instead of stopping.
    Found on gshard-moe-1.3b at 1024 microbatches: one 1024-token sequence per microbatch, and its
    experts route tokens in groups of 2048 (a reshape to (0, 2048, 768))."""
    try:
        return trace(fn, *args)
    except PlannerError:
        raise
    except Exception as e:  # the user's step, not the planner: its message, first line
        share = f" split {replicas} ways ({rows // replicas} per data-parallel replica)" if replicas > 1 else ""
        raise UntraceableMicrobatches(f"the step does not trace on {count} microbatches of {rows} rows{share} "
                                      f"({type(e).__name__}: {first_line(e)})") from None


@dataclasses.dataclass
class MicrobatchGraphs:
    """The step's graph at each microbatch size, from one trace: the step traced once with a
    symbolic batch size (`shape_family`) and made concrete per size (one row: the symbolic program
    at one row, `ShapeFamily.program_at`); traced per size where that cannot be (a step whose
    shapes are not linear in the batch, ...: the reason is logged once).

    Attributes:
      fn, args, batch_argnum: the step, its arguments and where the batch is.
      full_graph: the step traced on the whole batch, when the caller has it (one microbatch).
      family: the symbolic trace, or why there is none (made on the first size that needs it).
      traced: the graphs made so far, by rows (one object per size: what is computed from a graph
        once, `Graph.cached`, is computed once per size).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    batch_argnum: int | tuple[int, ...] = -1
    full_graph: Graph | None = None
    family: ShapeFamily | str | None = None
    traced: dict = dataclasses.field(default_factory=dict)  # rows -> the step's graph on them

    @property
    def family_note(self) -> str | None:
        """How the sizes were traced, for the plan's planning facts (None: only traced whole)."""
        if self.family is None:
            return None
        return "traced once" if isinstance(self.family, ShapeFamily) else f"traced per size: {self.family}"

    def at(self, count: int, rows: int) -> Graph:
        """The step's graph on one of `count` microbatches of `rows` rows.

        Raises:
          UntraceableMicrobatches: the step does not trace on microbatches of that size.
        """
        if count == 1 and self.full_graph is not None:
            return self.full_graph
        if rows not in self.traced:
            if self.family is None:
                self.family = trace_family(self.fn, self.args, batch_argnums(self.batch_argnum))
                if isinstance(self.family, str):
                    log.info("tracing the step once per microbatch size: %s", self.family)
            # one-row microbatches too: the symbolic program at one row (`ShapeFamily.program_at`)
            self.traced[rows] = (self.family.program_at(rows) if isinstance(self.family, ShapeFamily)
                                 else trace_microbatch(self.fn, microbatch_args(self.args, rows, self.batch_argnum),
                                                       count, rows))
        return self.traced[rows]

    def layers_at(self, count: int, rows: int, num_layers: int | None) -> Layers:
        """`cluster_layers` of `at(count, rows)`, once per graph. A graph the symbolic trace made
        holds the same ops at every size, so where the model's repeated modules define its layers
        their partition is found once, on the symbolic graph (GPT-39B unrolled: ~1.7 s a size), and
        a layer's key is its symbolic layer's at this size (equal keys: identical layers here)."""
        graph = self.at(count, rows)

        def make() -> Layers:
            if isinstance(self.family, ShapeFamily) and self.traced.get(rows) is graph:
                sym = self.family.graph.cached(("module layers",), lambda: cluster_by_modules(self.family.graph))
                if sym is not None:
                    return dataclasses.replace(sym, keys=tuple(f"{k}@{rows}{self.family.tag}" for k in sym.keys))
            return cluster_layers(graph, num_layers)
        return graph.cached(("layers", num_layers), make)


@dataclasses.dataclass
class PlanningMemo:
    """What plans of one step at several batch sizes share (`plan_pipeline(memo=...)`): its trace
    with a symbolic batch size and the per-layer plans (keyed by the layer's ops and shapes, the
    mesh, its links and pins: a layer at the same microbatch size is the same whatever the batch).
    For one sequence length: another makes other programs. Filled by each plan that uses it.

    Attributes:
      family: the step traced with a symbolic batch size, or why it cannot be (None: not yet).
      layer_plans: the layer cost tables' shared cache (`LayerCostTable.cache`).
      traced: the graphs by microbatch rows (`MicrobatchGraphs.traced`).
      step: the step function the family was traced from: the same function at another batch size
        needs no check against it; pins and stage plans are shared only then.
      pins: the hand layouts' pins per (layout, microbatch rows, logical mesh) (`search_space`).
      stage_plans: the stage programs' plans per (microbatch rows, stages) (`planned.plan_stages`).
      ranges: the layer ranges' times and memory per stage way (`stage_cost.stage_ranges`).
      dp: the pipeline DP's evaluations per stage latency table (`dp.pipeline_dp(memo=...)`): a
        microbatch size's tables are the same at every batch size that has it, only the count differs.
      stage_traces: the stage programs' traces by program (`emit.pipeline.stage_reuse.StageGraphs`):
        stages of other cuts that are the same program (three blocks at the same rows) take them.
      stage_solved: the stage programs' intra-op plans by program, mesh, pins and options
        (`stage_records.stage_plans(solved=...)`).
      single_floors: per (devices, options) the batch sizes whose single stage fit no mesh, and the
        least memory bound of its meshes there (`single_stage.floor_from_larger_batch`).
      keep_layer_problems: keep every layer ILP built (in `layer_plans`, `cost_table.LAYER_PROBLEMS`)
        for the batch sizes planned later, which solve them at their own counts where the earlier
        solves do not bound them (`layer_cost.reuse`): a sweep's, not a single shape's (one ILP per
        layer, mesh and pins; GPT-39B on 8x8 V100s: ~180 MB).
    """

    family: ShapeFamily | str | None = None
    layer_plans: dict = dataclasses.field(default_factory=dict)
    traced: dict = dataclasses.field(default_factory=dict)
    step: Any = None
    pins: dict = dataclasses.field(default_factory=dict)
    stage_plans: dict = dataclasses.field(default_factory=dict)
    ranges: dict = dataclasses.field(default_factory=dict)
    dp: dict = dataclasses.field(default_factory=dict)
    stage_traces: dict = dataclasses.field(default_factory=dict)
    stage_solved: dict = dataclasses.field(default_factory=dict)
    single_floors: dict = dataclasses.field(default_factory=dict)
    keep_layer_problems: bool = False

    def graph_at(self, step: Callable[..., Any], batch: int | None) -> Graph | None:
        """`step`'s graph at batch size `batch` made from the family, when the family was traced from
        this very step function (no trace and no check needed); None otherwise."""
        if self.step is step and isinstance(self.family, ShapeFamily) and (batch or 0) >= MIN_SIZE:
            return self.family.at(batch)
        return None


def trace_replica(fn: Callable, args: tuple[Any, ...], count: int, rows: int, replicas: int,
                  batch_argnum: int | tuple[int, ...] = -1) -> None:
    """Raises `UntraceableMicrobatches` (`trace_microbatch`) unless `fn` traces on one of
    `replicas` data-parallel replicas' share of a microbatch of `rows` rows, as the pipeline runtime
    traces the loss to accumulate gradients per replica (`stage_records.set_replicas`). The
    whole microbatch tracing does not imply it: gshard-moe-1.3b as megatron-tp+pp2 on 128x8 at 16
    microbatches of 64 rows has one 1024-token row per replica of 64, under its 2048-token routing
    groups."""
    if replicas > 1 and rows % replicas == 0:
        trace_microbatch(fn, microbatch_args(args, rows // replicas, batch_argnum), count, rows, replicas)


def microbatch_counts(batch: int, requested: int | None, limit: int | None = None) -> tuple[int, ...]:
    """Microbatch counts to try: the requested one, else every count >= 2 dividing the batch, largest
    first; with a `limit`, that many of them spread evenly in log scale from the largest count
    (microbatches of one sample: the smallest bubble) to the smallest (the most data parallelism
    inside a stage)."""
    if requested is not None:
        if batch % requested:
            raise InvalidArgumentError(
                f"num_microbatches={requested} does not divide the batch size {batch}; choose a divisor of {batch}")
        return (requested,)
    counts = [b for b in range(batch, 1, -1) if batch % b == 0]
    if limit is None or limit >= len(counts):
        return tuple(counts)
    if limit <= 1:
        return tuple(counts[:limit])
    logs = np.log([float(b) for b in counts])
    picked = {int(np.argmin(np.abs(logs - x))) for x in np.linspace(logs[0], logs[-1], limit)}
    return tuple(counts[i] for i in sorted(picked))
