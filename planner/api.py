"""Public entry points: `plan_parallel` (function wrapper / decorator) and `plan`."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
from jax.sharding import PartitionSpec

from planner.emit import offload as offload_emit
from planner.ilp import offload
from planner.emit.accumulate import jit_accumulated
from planner.levers.accumulate import micro_options, plan_accumulation
from planner.core.compat import USER_CONSTRAINTS, user_sharding
from planner.emit.single import jit_on_mesh, jit_planned, on_mesh
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.graph.trace import Graph, trace
from planner.core.mesh import MeshSpec, context_mesh, default_axis_names, parse_mesh
from planner.core.options import PlanOptions
from planner.configs.pins import (check_stage_pins, intermediate_patterns, logical_names, pin_intermediates,
                          resolve as resolve_pins, rules_to_pins, stage_pins)
from planner.core.plan import Plan
from planner.search.mesh_plan import check_options, make_plan
from planner.levers.remat import plan_remat, record as remat_record
from planner.core.sharding import to_partition_spec
from planner.core.static_args import StaticResults, array_function, split
from planner.search.meshes import best_plan, candidate_meshes, default_mesh_ndim, search_meshes
from planner.emit.pipeline.planned import plan_with_stages
from planner.core.units import format_bytes

__all__ = ["PlannedFunction", "candidate_meshes", "plan", "plan_parallel"]


def _signature(args: tuple[Any, ...], leaves: list[Any] | None = None, tree: Any = None) -> tuple:
    """The abstract signature of `args` (`leaves` and `tree`: them flattened already)."""
    if leaves is None:
        leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(getattr(x, "shape", ())), getattr(x, "dtype", type(x))) for x in leaves))


def _placed(args: tuple[Any, ...], targets: Sequence[Any]) -> tuple[Any, ...]:
    """`args` placed with `targets` (one sharding per leaf, None: as it is); only the leaves without
    their sharding move (a new batch; not the new state a step hands back). `jax.device_put` of a
    whole state of a thousand leaves costs tens of milliseconds of host time even when it moves
    nothing: measured on one H200, gpt2-medium's planned step took 134.8 ms when it placed every
    argument each call, and `jax.jit` of the step 80.7 ms."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    move = [i for i, (x, s) in enumerate(zip(leaves, targets))
            if s is not None and getattr(x, "sharding", None) != s]
    if not move:
        return args
    moved = jax.device_put([leaves[i] for i in move], [targets[i] for i in move])
    for i, x in zip(move, moved):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(tree, leaves)


class PlannedFunction:
    """A train step planned (and compiled) once per abstract signature of its arguments.

    Call it like the original function; `.plan(*args)` and `.lower(*args)` accept
    `jax.ShapeDtypeStruct` pytrees, so large models plan without allocating.
    """

    def __init__(self, fn: Callable[..., Any], mesh: Any = None, devices=None,
                 donate_argnums: int | tuple[int, ...] = (), pins: Mapping[str, Any] | None = None,
                 unpinned: str = "plan", rules: Any = None, logical: Any = None, **options: Any):
        if not callable(fn):
            raise InvalidArgumentError(f"plan_parallel needs a callable train step, got {type(fn).__name__}")
        if unpinned not in ("plan", "replicate"):
            raise InvalidArgumentError(f"unpinned={unpinned!r} must be 'plan' or 'replicate'")
        if pins is not None and not isinstance(pins, Mapping) and not callable(pins):
            raise InvalidArgumentError(f"pins must map path patterns to PartitionSpecs, got {type(pins).__name__}")
        self.fn = fn
        self.donate_argnums = donate_argnums
        self.pins = pins if callable(pins) else dict(pins) if pins else None
        self.unpinned = unpinned
        self.rules, self.logical = rules, logical
        self.options = check_options(PlanOptions.from_kwargs({**options, "donate_argnums": donate_argnums}))
        self.devices = list(devices) if devices is not None else jax.devices()
        # The user's mesh, as given or from `jax.set_mesh`: the step is traced under it (so its own
        # `reshard`/`shard_map` calls see it) and results are handed back on it.
        self._user_mesh = mesh = context_mesh() if mesh is None else mesh
        if mesh is None:
            self._mesh_spec, self._jax_mesh = None, None
        else:
            self._mesh_spec, self._jax_mesh = parse_mesh(mesh, len(self.devices))
            if self._jax_mesh is None:
                self._jax_mesh = self._mesh_spec.to_jax_mesh(self.devices)
            elif self._jax_mesh.devices.size != len(self.devices) and devices is None:
                self.devices = list(self._jax_mesh.devices.flat)
        self._cache: dict[tuple, tuple[Graph, Plan, Any]] = {}
        self._targets: dict[tuple, list] = {}  # signature -> each argument leaf's planned sharding
        self._on_user_mesh: dict[tuple, Any] = {}  # signature -> `emit.jit_on_mesh`'s program (None: none)
        self._static: dict[tuple, tuple] = {}  # key -> (the step over its array leaves, its static results)
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "planned")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple]:
        """(the array part of `args`, the cache key: the arrays' signature and the static leaves'
        values, `planner.core.static_args`)."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        dyn, static = split(args, leaves, tree)
        if static is None:  # the common case: every leaf an array, flattened once per call
            return args, _signature(args, leaves, tree)
        key = (_signature(dyn), static.key())
        if key not in self._static:
            results = StaticResults()
            self._static[key] = (array_function(self.fn, static, results), results)
        return dyn, key

    def _entry(self, args: tuple[Any, ...], key: tuple | None = None) -> tuple[Graph, Plan, Any]:
        """(graph, plan, jitted program) of the array arguments `args` (`_split`) under `key`."""
        key = _signature(args) if key is None else key
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        fn = self._static[key][0] if key in self._static else self.fn
        with self._user_context():
            graph = trace(fn, *args, user_constraints=self.options.user_constraints)
        if isinstance(self.pins, Mapping) and self._mesh_spec is not None and not self.options.pipeline:
            graph = pin_intermediates(graph, self.pins, self._mesh_spec)  # pins on checkpoint_name values
        if self.options.pipeline:
            plan, runner = plan_with_stages(fn, args, graph, self._mesh_spec, self.devices, self.options,
                                            **self._stage_pins(graph))
            self._cache[key] = (graph, plan, runner)
            return self._cache[key]
        pinned = self._pinned(graph, args)
        if self.options.accumulate not in (None, 1):
            self._cache[key] = self._accumulated(fn, graph, args)
            return self._cache[key]
        def plan_graph(g: Graph, search: bool) -> Plan:
            if self.options.offload != "off":  # a streamed optimizer update (`offload.streamed`)
                g = offload.streamed(g)
            if self._mesh_spec is not None:
                return make_plan(g, self._mesh_spec, self.options, self._jax_mesh, pins=pinned, min_peak_search=search)
            return self._choose_mesh(g)

        traced = graph  # recomputation (`planner.levers.remat`): the planned and emitted graph is the rewritten one
        graph, plan, policy = plan_remat(graph, self.options.remat, self.options.memory_budget, plan_graph,
                                         lambda p: p)
        if self.options.remat != "off":
            plan = remat_record(plan, traced, graph, policy)
        graph = offload.graph_for(graph, plan)
        plan = _record_user_constraints(graph, plan)
        entry = (graph, plan, jit_planned(graph, plan, self.donate_argnums))
        self._cache[key] = entry
        return entry

    def _pinned(self, graph: Graph, args: tuple[Any, ...]) -> dict[int, Any] | None:
        """Input position -> pinned spec (`planner.configs.pins`), or None without pins."""
        if self.pins is None and self.rules is None and self.unpinned == "plan":
            return None
        if self._mesh_spec is None:
            raise InvalidArgumentError("pins need a mesh (their specs name its axes): pass mesh=")
        shapes = [graph.tensors[t].shape for t in graph.inputs]
        pins = self.pins(graph.input_paths, shapes, self._mesh_spec) if callable(self.pins) else self.pins
        if pins:  # patterns naming intermediates were applied to the graph (`pin_intermediates`)
            inner = intermediate_patterns(pins, graph)
            pins = {k: v for k, v in pins.items() if str(k) not in inner}
        if self.rules is not None:
            named = logical_names(args if self.logical is None else self.logical)
            if not named:
                raise InvalidArgumentError("rules need logical axis names: the arguments carry no flax logical "
                                           "partitioning metadata; pass logical=(nn.get_partition_spec(state), None)")
            pins = {**(pins or {}), **rules_to_pins(self.rules, named, self._mesh_spec)}
        return resolve_pins(pins, graph.input_paths, shapes, self._mesh_spec,
                            complete=self.unpinned == "replicate")

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

    def _user_context(self):
        """The user's mesh as the context mesh (tracing), or nothing when no JAX mesh was given."""
        m = self._user_mesh
        if isinstance(m, jax.sharding.Mesh):
            return jax.sharding.set_mesh(m)
        if isinstance(m, jax.sharding.AbstractMesh):
            return jax.sharding.use_abstract_mesh(m)
        return contextlib.nullcontext()

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Keyword arguments bound to their positions (as `jax.jit` accepts them)."""
        if not kwargs:
            return args
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"arguments do not match {self.__name__}'s signature: {e}") from None
        if bound.kwargs:
            raise InvalidArgumentError(f"keyword-only arguments {sorted(bound.kwargs)} of {self.__name__} are not "
                                       "supported; make them positional or close over them")
        return tuple(bound.args)

    def _accumulated(self, fn: Callable[..., Any], graph: Graph, args: tuple[Any, ...]) -> tuple[Graph, Plan, Any]:
        """Gradient accumulation (`planner.levers.accumulate`): the microbatch step planned as any step
        (on the mesh, or by the mesh search), k chosen or given; the entry holds the microbatch trace."""
        def plan_micro(g: Graph, budget: float | None) -> Plan:
            options = micro_options(self.options, budget)
            if self._mesh_spec is not None:
                return make_plan(g, self._mesh_spec, options, self._jax_mesh, pins=self._pinned(g, args))
            results = search_meshes(g, self._candidate_meshes(), options, devices=self.devices)
            over = [r.min_memory_bytes for r in results if r.over_budget and r.min_memory_bytes is not None]
            if results[0].plan is None and over:
                raise InfeasiblePlanError(f"no mesh shape fits {format_bytes(budget)} per device", min(over))
            return best_plan(results)

        bounds = self._mesh_spec or MeshSpec((len(self.devices),), default_axis_names(1))
        acc = plan_accumulation(fn, graph, self.options.accumulate, self.options.memory_budget, plan_micro,
                                bounds, self.options.unshard)
        plan = dataclasses.replace(_record_user_constraints(acc.graph, acc.plan),
                                   options={**acc.plan.options, "accumulate": self.options.accumulate})
        acc = dataclasses.replace(acc, plan=plan)
        jitted = jit_accumulated(acc, self.donate_argnums) if acc.k > 1 else jit_planned(acc.graph, plan,
                                                                                           self.donate_argnums)
        return acc.graph, plan, jitted

    def _candidate_meshes(self) -> list:
        """The mesh search's candidates for these devices (3-D ones when they span several processes,
        `search.default_mesh_ndim`)."""
        hosts = len({getattr(d, "process_index", 0) for d in self.devices})
        return candidate_meshes(len(self.devices), default_mesh_ndim(self.options.mesh_ndim, hosts))

    def _choose_mesh(self, graph: Graph) -> Plan:
        return best_plan(search_meshes(graph, self._candidate_meshes(), self.options, devices=self.devices),
                         self.options.memory_budget)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStructs; other leaves are static, as
        `equinox.filter_jit` takes them); planned once per signature."""
        return self._entry(*self._split(self._positional(args, kwargs)))[1]

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        return self._entry(*self._split(self._positional(args, kwargs)))[0]

    def jitted(self, *args: Any, **kwargs: Any):
        """The `jax.jit`-wrapped planned program for these arguments (call it under
        `jax.set_mesh(plan.jax_mesh)` when the user's mesh is not all Auto). It takes the array
        leaves only: non-array leaves replaced by None (`planner.core.static_args.split`)."""
        return self._entry(*self._split(self._positional(args, kwargs)))[2]

    def lower(self, *args: Any, **kwargs: Any):
        """The `jax.stages.Lowered` planned program; for a multi-stage pipeline plan, one
        `planner.emit.pipeline.runtime.StageLowered` per stage (its forward, backward and update programs)."""
        args, key = self._split(self._positional(args, kwargs))
        graph, plan, jitted = self._entry(args, key)
        if plan.stages:
            return jitted.lower(*args)
        if offload_emit.positions(plan)[0]:  # host-offloaded arguments lower in their host shardings
            args = offload_emit.abstract_args(plan, args)
        with jax.sharding.set_mesh(plan._mesh()):
            return jitted.lower(*args)

    def __call__(self, *args: Any, **kwargs: Any):
        """Runs the planned step. Meshes of any axis types are planned and emitted on their Auto
        view (`planner.core.mesh.auto_view`: same devices, names and sizes); results come back placed with
        the planned specs on the user's own mesh (Explicit axes included), as `jax.jit` on it would:
        on a mesh with Explicit axes the program runs inside `jax.sharding.auto_axes` with its
        arguments and results on that mesh (`emit.jit_on_mesh`), so the state a step hands back goes
        into the next one as it is; a plan that offloads runs on the Auto view and its results are
        placed on the user's mesh after it."""
        args, key = self._split(self._positional(args, kwargs))
        graph, plan, jitted = self._entry(args, key)
        static = self._static[key][1] if key in self._static else None
        outs = self._run(args, key, graph, plan, jitted)
        return outs if static is None else static.restore(outs)

    def _run(self, args: tuple[Any, ...], key: tuple, graph: Graph, plan: Plan, jitted: Any):
        if plan.stages:
            return jitted(*args)  # a pipeline: stages place their own inputs
        user = self._user_mesh
        on_user = self._on_user_mesh.get(key, False)
        if on_user is False and isinstance(user, jax.sharding.Mesh) and user is not plan._mesh():
            on_user = self._on_user_mesh[key] = jit_on_mesh(graph, plan, user, self.donate_argnums)
        targets = self._targets.get(key)
        if targets is None:  # one sharding per argument leaf, offloaded ones in host memory
            shardings = on_mesh(plan.in_shardings, user) if on_user else offload_emit.in_shardings(plan)
            try:  # the plan's shardings mirror the arguments' tree (a None argument: no leaf)
                targets = jax.tree_util.tree_structure(args).flatten_up_to(shardings)
            except (ValueError, TypeError):  # a prefix of it: placed whole, as jax.device_put takes it
                targets = shardings
            self._targets[key] = targets
        placed = _placed(args, targets) if isinstance(targets, list) else jax.device_put(args, targets)
        if on_user:  # the user's Explicit mesh in and out (`emit.jit_on_mesh`)
            with jax.sharding.set_mesh(user):
                return on_user(*placed)
        with jax.sharding.set_mesh(plan._mesh()):
            outs = jitted(*placed)
        if isinstance(user, jax.sharding.Mesh) and user is not plan._mesh():
            outs = jax.device_put(outs, on_mesh(offload_emit.out_shardings(plan), user))
        return outs


def _axes(entry, mesh) -> tuple[str, ...]:
    """A PartitionSpec entry as the mesh axes (of more than one device) that split the dim."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(n for n in names if n not in mesh.axis_names or mesh.shape[mesh.axis_names.index(n)] > 1)


def _record_user_constraints(graph: Graph, plan: Plan) -> Plan:
    """The plan with its record of the step's own sharding constraints: the user's spec, the
    planned one, and whether they agree (always, when pinned)."""
    planned = {op: spec for op, k, spec in plan.op_specs if k == 0}
    out = []
    for op in graph.ops:
        if op.name not in USER_CONSTRAINTS or op.index not in planned:
            continue
        user = user_sharding(op.params).spec
        got = to_partition_spec(planned[op.index], plan.mesh)
        rank = len(graph.tensors[op.outputs[0]].shape)
        pad = lambda p: tuple(p) + (None,) * (rank - len(p))  # noqa: E731
        kept = all(u is PartitionSpec.UNCONSTRAINED or _axes(u, plan.mesh) == _axes(g, plan.mesh)
                   for u, g in zip(pad(user), pad(got)))
        out.append(MappingProxyType({
            "where": f"{op.name} {op.name_stack}".strip(), "user_spec": str(user),
            "planned_spec": str(PartitionSpec(*pad(got))), "kept": kept, "mode": graph.user_constraints}))
    return dataclasses.replace(plan, user_constraints=tuple(out)) if out else plan


def plan_parallel(fn: Callable[..., Any] | None = None, *, mesh: Any = None,
                  donate_argnums: int | tuple[int, ...] = (), pins: Mapping[str, Any] | None = None,
                  rules: Any = None, logical: Any = None, **options: Any):
    """Wraps a train step so that it runs auto-sharded on `mesh`.

    Usable directly (`plan_parallel(step, mesh=(2, 4))`) or as a decorator
    (`@plan_parallel(mesh="2x4")`).

    Args:
      fn: the train step.
      mesh: a `jax.sharding.Mesh` or `AbstractMesh` with Explicit (`jax.make_mesh`'s default), Auto
        or mixed axis types, a shape like `(2, 4)`, a string like `"2x4"`, or None: the mesh of
        `jax.set_mesh` / `jax.sharding.use_abstract_mesh` when one is set, else the planner chooses the
        mesh shape as well. Plans are emitted on the Auto view of the same devices (only
        `with_sharding_constraint` needed); results come back with the planned specs on your mesh.
      donate_argnums: arguments whose buffers the step may reuse (as in `jax.jit`), typically the
        train state: the new state then takes the old one's memory.
      pins: {path pattern: PartitionSpec} fixing the sharding of the argument leaves the glob
        patterns match (`planner.configs.pins`: paths as the plan tables print them, `params/wte/embedding`;
        first match wins); the planner plans everything else around them. Needs `mesh`. A pattern
        matching no argument may name a `jax.ad_checkpoint.checkpoint_name` value by its module
        path and name (`blocks_0/attn/attn_out`, or just `attn_out`): that intermediate is pinned.
        With `pipeline=`, each pin applies on the stage holding the leaf and names the stage
        meshes' axes `x` (across hosts when the stage spans hosts) and `y`.
      rules: logical-axis rules in the MaxText / t5x form the planner prints
        (`[('batch', 'x'), ('embed', 'y'), ...]`), applied to flax logical partitioning metadata:
        `nn.LogicallyPartitioned` leaves of the arguments, or `logical`; they pin the annotated
        leaves (explicit `pins` win).
      logical: the arguments' logical PartitionSpecs, shaped like the argument tuple (prefixes and
        None allowed), e.g. `(nn.get_partition_spec(state), None)` or `nnx.get_partition_spec`'s.
      **options: `PlanOptions` fields (memory_budget, hardware, solver_time_limit, ...);
        `user_constraints="pin"` (default: the step's own `with_sharding_constraint` / `reshard`
        and nested jit in/out shardings fix those values' sharding) or `"hint"` (the planner may
        choose another); `Plan.user_constraints` records which were kept. `accumulate=k` or
        `"auto"`: gradient accumulation over k microbatches inside the step (`planner.levers.accumulate`;
        `plan.levers["accumulation"]` records k); the planned graph is then the microbatch trace.
        `offload="opt-state"` or `"auto"`: Adam moments (optimizer state) kept in host memory
        between steps, all of them or only what `memory_budget` needs (`planner.ilp.offload`;
        `plan.levers["offload"]` records which, their bytes and copy times).
        `remat="full"`, `"dots"` or `"auto"`: repeated layers' forward recomputed in the backward
        (`planner.levers.remat`; `plan.levers["remat"]` records the policy and layers); the planned and
        emitted graph (`.graph(...)`) is then the rewritten one.

    Returns:
      A `PlannedFunction` (or a decorator making one).
    """
    if fn is None:
        return lambda f: PlannedFunction(f, mesh=mesh, donate_argnums=donate_argnums, pins=pins, rules=rules,
                                         logical=logical, **options)
    return PlannedFunction(fn, mesh=mesh, donate_argnums=donate_argnums, pins=pins, rules=rules, logical=logical,
                           **options)


def plan(fn: Callable[..., Any], *args: Any, mesh: Any = None, pins: Mapping[str, Any] | None = None,
         rules: Any = None, logical: Any = None, **options: Any) -> Plan:
    """Same as `plan_parallel(fn, mesh=mesh, pins=pins, rules=rules, logical=logical, **options).plan(*args)`."""
    return PlannedFunction(fn, mesh=mesh, pins=pins, rules=rules, logical=logical, **options).plan(*args)
