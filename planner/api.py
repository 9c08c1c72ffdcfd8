"""Public entry points: `plan_parallel` (function wrapper / decorator) and `plan`."""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from planner.core.errors import InvalidArgumentError
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.core.static_args import StaticResults, array_function, split
from planner.emit import offload as offload_emit
from planner.emit.single import jit_on_mesh, jit_planned, on_mesh
from planner.graph.ir import Graph
from planner.planning.buckets import SHAPE_MODES, bucket_key, reuse_problem
from planner.planning.step import StepPlanner, check_step
from planner.search.candidates import candidate_meshes

__all__ = ["PlannedFunction", "candidate_meshes", "plan", "plan_parallel"]

log = logging.getLogger("planner")


def _signature(args: tuple[Any, ...], leaves: list[Any] | None = None, tree: Any = None) -> tuple:
    """The abstract signature of `args` (`leaves` and `tree`: them flattened already)."""
    if leaves is None:
        leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(getattr(x, "shape", ())), getattr(x, "dtype", type(x))) for x in leaves))


def _placed(args: tuple[Any, ...], targets: Sequence[Any]) -> tuple[Any, ...]:
    """`args` placed with `targets` (one sharding per leaf, None: as it is); only the leaves without
    their sharding move (a new batch; not the new state a step hands back): `jax.device_put` of a
    whole state costs host time per leaf even when it moves nothing, which a step of a model with
    many leaves would pay on every call."""
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
    `jax.ShapeDtypeStruct` pytrees, so large models plan without allocating. Planning itself is
    `planner.planning.step.StepPlanner`'s; this wrapper keeps the per-signature cache, the static
    (non-array) arguments, and calls and lowers the planned program on the user's mesh.
    """

    def __init__(self, fn: Callable[..., Any], mesh: Any = None, devices=None,
                 donate_argnums: int | tuple[int, ...] = (), pins: Mapping[str, Any] | None = None,
                 unpinned: str = "plan", rules: Any = None, logical: Any = None, shapes: str = "exact",
                 **options: Any):
        check_step(fn)
        if shapes not in SHAPE_MODES:
            raise InvalidArgumentError(f"shapes={shapes!r}: choose one of {', '.join(SHAPE_MODES)}")
        self.fn = fn
        self.shapes = shapes
        self._buckets: dict[tuple, tuple] = {}  # bucket key -> the (graph, plan) planned for it
        self.donate_argnums = donate_argnums
        self._planner = StepPlanner.create(mesh=mesh, devices=devices, donate_argnums=donate_argnums, pins=pins,
                                           unpinned=unpinned, rules=rules, logical=logical, **options)
        # The user's mesh, as given or from `jax.set_mesh`: the step is traced under it (so its own
        # `reshard`/`shard_map` calls see it) and results are handed back on it.
        self._user_mesh = self._planner.user_mesh
        self._cache: dict[tuple, tuple[Graph, Plan, Any]] = {}
        self._targets: dict[tuple, list] = {}  # signature -> each argument leaf's planned sharding
        self._on_user_mesh: dict[tuple, Any] = {}  # signature -> `emit.single.jit_on_mesh`'s program (None: none)
        self._static: dict[tuple, tuple] = {}  # key -> (the step over its array leaves, its static results)
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "planned")
        self.__doc__ = getattr(fn, "__doc__", None)

    @property
    def options(self) -> PlanOptions:
        """The checked planning options."""
        return self._planner.options

    @property
    def devices(self) -> tuple[Any, ...]:
        """The devices the step is planned for."""
        return self._planner.devices

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
        if hit is None:
            fn = self._static[key][0] if key in self._static else self.fn
            bucket = bucket_key(key, args) if self.shapes == "bucketed" else None
            hit = self._cache[key] = self._bucketed(fn, args, bucket) or self._planner.plan(fn, args)
            if bucket is not None:
                self._buckets.setdefault(bucket, hit[:2])
        return hit

    def _bucketed(self, fn: Callable[..., Any], args: tuple[Any, ...], bucket: tuple | None) -> tuple | None:
        """With `shapes="bucketed"` (`bucket`: these arguments' bucket key): (graph, plan, program) of
        these arguments from the plan of their bucket (`planning.buckets`), the step traced and
        compiled at their shapes, not planned; None when there is none or it does not apply (logged)."""
        if bucket not in self._buckets:
            return None
        planned, plan = self._buckets[bucket]
        graph = self._planner.program(fn, args)
        why = reuse_problem(plan, planned, graph)
        if why is not None:
            log.info("planning this batch size on its own: its bucket's plan does not apply (%s)", why)
            return None
        log.info("batch size in a planned bucket: its plan reused, the step recompiled for these shapes")
        return graph, plan, jit_planned(graph, plan, self.donate_argnums)

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
        _, plan, jitted = self._entry(args, key)
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
        arguments and results on that mesh (`emit.single.jit_on_mesh`), so the state a step hands back goes
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
        if on_user:  # the user's Explicit mesh in and out (`emit.single.jit_on_mesh`)
            with jax.sharding.set_mesh(user):
                return on_user(*placed)
        with jax.sharding.set_mesh(plan._mesh()):
            outs = jitted(*placed)
        if isinstance(user, jax.sharding.Mesh) and user is not plan._mesh():
            outs = jax.device_put(outs, on_mesh(offload_emit.out_shardings(plan), user))
        return outs



def plan_parallel(fn: Callable[..., Any] | None = None, *, mesh: Any = None,
                  donate_argnums: int | tuple[int, ...] = (), pins: Mapping[str, Any] | None = None,
                  rules: Any = None, logical: Any = None, shapes: str = "exact", **options: Any):
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
      shapes: "exact" (a plan per argument signature: a new batch size is planned anew) or
        "bucketed": one plan per bucket of batch sizes (the batch: the last positional argument;
        buckets: powers of two, 33..64 is one), a new size in a planned bucket traced and
        compiled with that plan, not planned, where the plan applies to it
        (`planner.planning.buckets`: same program, every sharding divides the new shapes, no
        lever that rewrote the program); otherwise planned on its own.
      **options: `PlanOptions` fields (memory_budget, hardware, solver_time_limit, ...);
        `user_constraints="pin"` (default: the step's own `with_sharding_constraint` / `reshard`
        and nested jit in/out shardings fix those values' sharding) or `"hint"` (the planner may
        choose another); `Plan.user_constraints` records which were kept.
        The memory levers are on by default and composed in one search (`planner.planning.composition`),
        each tried only where the budget needs it: `remat="auto"` (repeated or scanned layers'
        forward recomputed in the backward, `planner.levers.remat`; "off", "full", "dots",
        "dots_no_batch" force a policy), `offload=None` ("auto" when nothing fits without it: Adam
        moments, then master parameters, in host memory between steps, `planner.ilp.offload`;
        "off", "opt-state", "opt-state+params" force it), `accumulate=None` (gradient accumulation
        weighed when the step is microbatch-invariant and a lever is needed; 1: off, k or "auto":
        always, `planner.levers.accumulate`). `plan.levers` records each lever used, what it
        bought and the plan it was weighed against; the planned and emitted graph (`.graph(...)`)
        is the rewritten one (the microbatch trace under accumulation). `donate_argnums` stays as
        given (jax.jit's default: nothing donated); a budget that only a donated state meets says so.

    Returns:
      A `PlannedFunction` (or a decorator making one).
    """
    if fn is None:
        return lambda f: PlannedFunction(f, mesh=mesh, donate_argnums=donate_argnums, pins=pins, rules=rules,
                                         logical=logical, shapes=shapes, **options)
    return PlannedFunction(fn, mesh=mesh, donate_argnums=donate_argnums, pins=pins, rules=rules, logical=logical,
                           shapes=shapes, **options)


def plan(fn: Callable[..., Any], *args: Any, mesh: Any = None, pins: Mapping[str, Any] | None = None,
         rules: Any = None, logical: Any = None, **options: Any) -> Plan:
    """Same as `plan_parallel(fn, mesh=mesh, pins=pins, rules=rules, logical=logical, **options).plan(*args)`."""
    return PlannedFunction(fn, mesh=mesh, pins=pins, rules=rules, logical=logical, **options).plan(*args)
