"""Planning one step: (the step, its array arguments, the mesh, devices, pins or rules, options)
-> (graph, plan, compiled program or pipeline runner); the one place where the levers compose."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from planner.configs.pins import (check_stage_pins, intermediate_patterns, logical_names, pin_intermediates,
                                  resolve as resolve_pins, rules_to_pins, stage_pins)
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.core.units import format_bytes
from planner.cost_model import Cluster, Hardware, get_hardware
from planner.cost_model.topology import device_order, from_devices
from planner.core.mesh import MeshSpec, context_mesh, default_axis_names, parse_mesh
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.core.static_args import StaticResults, array_function, split
from planner.emit.accumulate import jit_accumulated
from planner.emit.pipeline.planned import pipeline_cluster, plan_with_stages
from planner.emit.single import jit_planned
from planner.graph.donation import returns_its_argument
from planner.graph.ir import Graph
from planner.graph.trace import trace
from planner.planning.composition import compose
from planner.planning.hosts import check_stages_can_run, live_hosts, process_cluster, process_count, stages_can_run
from planner.planning.user_constraints import record_user_constraints
from planner.search.candidates import candidate_meshes, default_mesh_ndim
from planner.search.mesh_plan import check_options, make_plan
from planner.search.meshes import search_meshes
from planner.search.results import MeshResult

Entry = tuple[Graph, Plan, Any]  # (the planned graph, its plan, the jitted program or pipeline runner)


def check_step(fn: Any) -> None:
    """Raises InvalidArgumentError unless `fn` is callable."""
    if not callable(fn):
        raise InvalidArgumentError(f"plan_parallel needs a callable train step, got {type(fn).__name__}")


def live_topology(options: PlanOptions, devices: list[Any]) -> tuple[PlanOptions, list[Any]]:
    """On devices that carry their place in a torus (TPU `coords`, `slice_index`), the options priced
    on that topology (`cost_model.topology.from_devices`) and the devices in the order its pricing
    lays meshes out; unchanged where the devices carry none (GPU, CPU) or the options name a cluster."""
    if Cluster.is_cluster(options.hardware) or isinstance(options.hardware, Hardware) or options.profile is not None:
        return options, devices
    found = from_devices(devices)
    if found is None:
        return options, devices
    topology, hw = found
    if options.hardware is not None and get_hardware(options.hardware).name != hw.name:
        return options, devices
    return dataclasses.replace(options, hardware=str(topology)), device_order(devices, topology)


@dataclasses.dataclass(frozen=True)
class StepPlanner:
    """What a step is planned with (`create` checks and normalises it); `plan` plans one.

    Attributes:
      options: the checked options (`donate_argnums` among them).
      devices: the devices planned for.
      mesh: the logical mesh, or None: the planner chooses the mesh shape as well.
      jax_mesh: `mesh` bound to `devices` (the Auto view of the user's mesh), or None.
      user_mesh: the user's mesh as given or from `jax.set_mesh` (the step is traced under it), or None.
      pins: {path pattern: spec}, a function (paths, shapes, mesh) -> such a mapping, or None.
      unpinned: "plan", or "replicate": the leaves no pin names are pinned replicated.
      rules: logical-axis rules (`planner.configs.pins.rules_to_pins`), or None.
      logical: the arguments' logical PartitionSpecs for `rules` (None: read off the arguments).
      donate_argnums: arguments whose buffers the program may reuse (as in `jax.jit`).
      stages_beside_mesh: with a `mesh`, the pipeline stages of the options' cluster of several hosts
        are weighed beside the plan on that mesh, the faster kept (`compare`'s planner row beside
        pipeline baselines); the decorator keeps the mesh it is given.
      devices_per_host: without a `mesh`, on devices of several processes, the devices of each
        (the mesh search prices the axes that span processes on the inter-host link,
        `planning.hosts`); None otherwise.
    """

    options: PlanOptions
    devices: tuple[Any, ...]
    mesh: MeshSpec | None
    jax_mesh: jax.sharding.Mesh | None
    user_mesh: Any
    pins: Any = None
    unpinned: str = "plan"
    rules: Any = None
    logical: Any = None
    donate_argnums: int | tuple[int, ...] = ()
    stages_beside_mesh: bool = False
    devices_per_host: int | None = None

    @classmethod
    def create(cls, mesh: Any = None, devices=None, donate_argnums: int | tuple[int, ...] = (),
               pins: Mapping[str, Any] | None = None, unpinned: str = "plan", rules: Any = None,
               logical: Any = None, stages_beside_mesh: bool = False, **options: Any) -> StepPlanner:
        """The planner of `plan_parallel`'s arguments (see there; `stages_beside_mesh`: the attribute).

        Raises:
          InvalidArgumentError: a bad `unpinned`, `pins` or option; MeshError: a mesh the devices do not fill.
        """
        if unpinned not in ("plan", "replicate"):
            raise InvalidArgumentError(f"unpinned={unpinned!r} must be 'plan' or 'replicate'")
        if pins is not None and not isinstance(pins, Mapping) and not callable(pins):
            raise InvalidArgumentError(f"pins must map path patterns to PartitionSpecs, got {type(pins).__name__}")
        checked = check_options(PlanOptions.from_kwargs({**options, "donate_argnums": donate_argnums}))
        found = list(devices) if devices is not None else jax.devices()
        user_mesh = context_mesh() if mesh is None else mesh
        if user_mesh is None:
            checked, found = live_topology(checked, found)
        spec, jax_mesh = None, None
        if user_mesh is not None:
            spec, jax_mesh = parse_mesh(user_mesh, len(found))
            if jax_mesh is None:
                jax_mesh = spec.to_jax_mesh(found)
            elif jax_mesh.devices.size != len(found) and devices is None:
                found = list(jax_mesh.devices.flat)
        live = live_hosts(checked, found, jax_mesh)
        return cls(live.options, live.devices, spec, jax_mesh, user_mesh,
                   pins if callable(pins) else dict(pins) if pins else None, unpinned, rules, logical, donate_argnums,
                   stages_beside_mesh, live.devices_per_host)

    def plan(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Entry:
        """(graph, plan, program) of `fn` on its array arguments `args`: traced, its pins applied,
        then planned in pipeline stages, or on one mesh with the levers of `planning.composition`
        (recomputation, host offload, gradient accumulation); the step's own sharding constraints
        recorded."""
        if self.options.pipeline:
            check_stages_can_run(self.devices, f"pipeline={self.options.pipeline!r}")
        graph = self.trace(fn, args)
        if self.options.pipeline:
            return self._pipelined(fn, args, graph)
        graph = self._pin_intermediates(graph)
        self.pinned(graph, args)  # checks the pins before anything is planned
        bounds = self.mesh or MeshSpec((len(self.devices),), default_axis_names(1))
        try:
            composed = compose(fn, graph, self.options, self._searcher(args), bounds, self._stage_search(fn, args, graph))
        except InfeasiblePlanError as e:
            raise self._donation_hint(fn, graph, args, bounds, e) from None
        if composed.pipelined is not None:
            return graph, composed.plan, composed.pipelined.found
        plan = record_user_constraints(composed.graph, composed.plan)
        if composed.accumulated is not None:
            acc = dataclasses.replace(composed.accumulated, plan=plan)
            return acc.graph, plan, jit_accumulated(acc, self.donate_argnums)
        return composed.graph, plan, jit_planned(composed.graph, plan, self.donate_argnums)

    def _stage_search(self, fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph):
        """The pipeline stage search `compose` weighs by default (`planning.pipeline_lever`): on a
        cluster of several hosts (`options.hardware` naming one, e.g. "2x4:v100", or devices of several
        processes, `planning.hosts`), without a mesh
        (unless `stages_beside_mesh`), pins or rules from the user (they fix one mesh), on devices
        whose stages can run (`planning.hosts.stages_can_run`); None elsewhere."""
        if (self.options.pipeline is not None or (self.mesh is not None and not self.stages_beside_mesh)
                or self.pins is not None or not stages_can_run(self.devices)
                or self.rules is not None or self.unpinned != "plan"
                or pipeline_cluster(None, len(self.devices), self._on_hosts(self.options)).hosts < 2):
            return None

        def search(options: PlanOptions, beat: float) -> tuple[Plan, Any]:
            return plan_with_stages(fn, args, graph, None, self.devices, self._on_hosts(options), beat=beat)

        return search

    def _donation_hint(self, fn: Callable[..., Any], graph: Graph, args: tuple[Any, ...], bounds: MeshSpec,
                       e: InfeasiblePlanError) -> InfeasiblePlanError:
        """`e`, saying in the same line when a plan would fit with the train state donated: the step
        donates nothing (`jax.jit`'s default, kept) and returns a state like its first argument."""
        if self.options.donate_argnums or not returns_its_argument(graph):
            return e
        donated = dataclasses.replace(self.options, donate_argnums=(0,))
        search = self._searcher(args)
        try:  # whether a plan fits, not the smallest peak of none fitting: no min-peak search
            plan = compose(fn, graph, donated, lambda g, o, smallest, only=None, beat=math.inf:
                           search(g, o, False, only, beat), bounds).plan
        except InfeasiblePlanError:
            return e
        peak = format_bytes(plan.prediction.memory_bytes_per_device)
        return e.reworded(f"{e}; with the train state donated a plan fits ({peak} per device): "
                          "plan_parallel(..., donate_argnums=0)")

    def _searcher(self, args: tuple[Any, ...]) -> Callable[..., Sequence[MeshResult]]:
        """The composition's `Search` for this planner and the step's arguments `args`."""
        return lambda g, o, smallest, only=None, beat=math.inf: self._search(g, o, smallest, args, only, beat)

    def _search(self, g: Graph, options: PlanOptions, smallest: bool, args: tuple[Any, ...],
                only: MeshSpec | None = None, beat: float = math.inf) -> Sequence[MeshResult]:
        """`g` planned on the mesh with its pins (`smallest`: search for the smallest peak when nothing
        fits; raises make_plan's one-line answer then), or by the mesh search over the devices (or
        on `only`, one of their meshes)."""
        if self.mesh is not None:
            plan = make_plan(g, self.mesh, options, self.jax_mesh, pins=self.pinned(g, args), min_peak_search=smallest)
            return (MeshResult(self.mesh, plan, None, options.inter_host_axes, 0.0),)
        meshes = [only] if only is not None else self._candidate_meshes()
        return search_meshes(g, meshes, options, devices=self.devices, min_peak_search=smallest, beat=beat,
                             devices_per_host=self.devices_per_host)

    def program(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Graph:
        """The graph a one-mesh plan of `fn` on `args` is made on: traced, its pinned intermediates
        constrained (`plan` before the levers)."""
        return self._pin_intermediates(self.trace(fn, args))

    def trace(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Graph:
        """The step's graph, traced under the user's mesh (its own `reshard`/`shard_map` calls see it)."""
        with self._user_context():
            return trace(fn, *args, user_constraints=self.options.user_constraints)

    def _user_context(self):
        """The user's mesh as the context mesh (tracing), or nothing when no JAX mesh was given."""
        m = self.user_mesh
        if isinstance(m, jax.sharding.Mesh):
            return jax.sharding.set_mesh(m)
        if isinstance(m, jax.sharding.AbstractMesh):
            return jax.sharding.use_abstract_mesh(m)
        return contextlib.nullcontext()

    def _pin_intermediates(self, graph: Graph) -> Graph:
        """Pins on `checkpoint_name` values (`planner.configs.pins.pin_intermediates`)."""
        if isinstance(self.pins, Mapping) and self.mesh is not None:
            return pin_intermediates(graph, self.pins, self.mesh)
        return graph

    def pinned(self, graph: Graph, args: tuple[Any, ...]) -> dict[int, Any] | None:
        """Input position -> pinned spec (`planner.configs.pins`), or None without pins."""
        if self.pins is None and self.rules is None and self.unpinned == "plan":
            return None
        if self.mesh is None:
            raise InvalidArgumentError("pins need a mesh (their specs name its axes): pass mesh=")
        shapes = [graph.tensors[t].shape for t in graph.inputs]
        pins = self.pins(graph.input_paths, shapes, self.mesh) if callable(self.pins) else self.pins
        if pins:  # patterns naming intermediates were applied to the graph (`pin_intermediates`)
            inner = intermediate_patterns(pins, graph)
            pins = {k: v for k, v in pins.items() if str(k) not in inner}
        if self.rules is not None:
            named = logical_names(args if self.logical is None else self.logical)
            if not named:
                raise InvalidArgumentError("rules need logical axis names: the arguments carry no flax logical "
                                           "partitioning metadata; pass logical=(nn.get_partition_spec(state), None)")
            pins = {**(pins or {}), **rules_to_pins(self.rules, named, self.mesh)}
        return resolve_pins(pins, graph.input_paths, shapes, self.mesh, complete=self.unpinned == "replicate")

    def _pipelined(self, fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph) -> Entry:
        """Pipeline stages (`planner.emit.pipeline.planned.plan_with_stages`): the plan and its runner."""
        plan, runner = plan_with_stages(fn, args, graph, self.mesh, self.devices, self._on_hosts(self.options),
                                        **self._stage_pins(graph))
        return graph, plan, runner

    def _on_hosts(self, options: PlanOptions) -> PlanOptions:
        """`options` naming the cluster of the devices' processes for a stage search without a mesh
        (`planning.hosts.process_cluster`)."""
        return process_cluster(options, self.devices, self.devices_per_host)

    def _stage_pins(self, graph: Graph) -> dict[str, Any]:
        """Pins with pipeline stages (`planner.configs.pins.stage_pins`): each pin applies on the stage that
        holds the pinned leaf, naming that stage mesh's axes (x, y)."""
        if self.rules is not None:
            raise InvalidArgumentError("logical-axis rules are not supported with pipeline stages yet: pass pins= "
                                       "or pipeline=False")
        if self.pins is None:
            return {}
        if not callable(self.pins):
            check_stage_pins(self.pins, graph.input_paths)
        return {"pins": stage_pins(self.pins)}

    def _candidate_meshes(self) -> list:
        """The mesh search's candidates for these devices (3-D ones when they span several processes,
        `search.candidates.default_mesh_ndim`)."""
        return candidate_meshes(len(self.devices), default_mesh_ndim(self.options.mesh_ndim, process_count(self.devices)))


def array_step(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """(the step over its arguments' array leaves, those arguments: non-array leaves None), as a
    planned step takes non-array leaves (`planner.core.static_args`); (fn, args) when all are arrays."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    dyn, static = split(args, leaves, tree)
    if static is None:
        return fn, args
    return array_function(fn, static, StaticResults()), dyn


def plan_step(fn: Callable[..., Any], *args: Any, mesh: Any = None, pins: Mapping[str, Any] | None = None,
              unpinned: str = "plan", rules: Any = None, logical: Any = None, stages_beside_mesh: bool = False,
              **options: Any) -> Plan:
    """The plan `plan_parallel(fn, mesh=mesh, pins=pins, ...).plan(*args)` makes, without the wrapper
    and its cache (`evaluate` and `compare` plan this way); `stages_beside_mesh`: see `StepPlanner`."""
    check_step(fn)
    planner = StepPlanner.create(mesh=mesh, pins=pins, unpinned=unpinned, rules=rules, logical=logical,
                                 stages_beside_mesh=stages_beside_mesh, **options)
    return planner.plan(*array_step(fn, args))[1]
