"""Planner options: one frozen record of plain data, filled from keyword arguments with defaults.

Values that need the cost model to check (the hardware preset, the profile) are validated where
the cost model is built (`search.mesh_plan.check_options`), so this record depends on nothing above it."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from planner.core.errors import InvalidArgumentError
from planner.core.units import parse_bytes, parse_link

REMAT = ("off", "full", "dots", "dots_no_batch", "auto")  # recomputation choices (`planner.levers.remat`)
OFFLOAD_MODES = ("off", "auto", "opt-state", "opt-state+params")  # host offload choices (`planner.ilp.offload`)
COMM_PRECISIONS = ("exact", "bf16", "int8")  # wire formats allowed (`planner.ilp.wire`)


@dataclasses.dataclass(frozen=True, slots=True)
class PlanOptions:
    """Options of one planning run.

    Attributes:
      memory_budget: per-device bytes the plan must fit (liveness peak), or None for no limit.
      hardware: hardware preset name, cluster ("4x8:h100") or `cost_model.Hardware` record for the
        analytic cost model.
      solver_time_limit: the ILP solver's limit, in CP-SAT deterministic units (about one second of
        one idle core each, `planner.ilp.solver`), so the same inputs give the same plan on a loaded
        machine; a wall-clock cap (4x as long + 10 s) stops it on an overloaded one. When the limit is hit the
        best plan found is used; `plan.solver` records "optimal" (proven) and "gap" (to the best bound).
      solver_workers: CP-SAT worker threads (1 keeps plans bit-for-bit deterministic).
      tie_outputs: outputs whose pytree path and type equal an input's (the new train state) get
        that input's sharding, so the next step needs no resharding.
      share_layers: repeated layers share one decision: by module names (`name_0 ... name_N`), else
        by structure (repeated runs of the same primitives and strategies, `ilp.layer_sharing.structural_representatives`).
      constrain_intermediates: emit `with_sharding_constraint` on every planned intermediate.
      inter_host_axes: mesh axes whose links cross hosts (slower links in the cost model).
      profile: path of a profile database written by `planner profile` (measured collective
        times replace the analytic ones where samples exist), or a loaded database object.
      pipeline: whether to split the program into pipeline stages: True (at least two stages),
        "auto" (the stage search, a single stage on the whole cluster competing), False (never), or
        None, the default: weighed by `planner.planning.pipeline_lever` after the single-step
        levers where it can matter (several hosts, a memory budget, a step proven
        microbatch-invariant whose layers are not scanned over stacked parameters), the faster kept.
      num_microbatches: microbatches per step for pipelining (None: the planner chooses).
      schedule: pipeline schedule, "1f1b" or "gpipe".
      inter_host: the network between hosts as it is: one host's bandwidth, shared by its devices
        (bytes/s, or "25Gbit", "12.5GB/s"), optionally with a latency ("25Gbit,10us"); None: the
        hardware preset's (`cost_model.hardware_with_links`).
      intra_host: one device's link to the other devices of its host, same forms; None: the preset's.
      overlap: gradient reductions run beside later backward compute (XLA's latency-hiding
        scheduler; the plan carries the flags, `Plan.xla_flags()`); False prices every collective
        on the critical path. Never assumed on XLA:CPU, whose collectives are synchronous.
      prefetch: with overlap, resharding of program arguments (ZeRO-3 / FSDP parameter
        all-gathers) is issued ahead of its consumers and hides behind earlier compute
        (`planner.ilp.objective.prefetch_hidden`). True or False; None (the default): the
        composition of the levers (`planner.planning.composition`) weighs it on the chosen mesh of
        a single-step plan and keeps the faster plan; a single `make_plan` plans without it
        (`planned_prefetch`). Not searched on every mesh: it makes some ILPs markedly harder
        (moe-tiny on 2x4: 5.8 -> 19 CP-SAT deterministic units, same optimum).
      user_constraints: "pin": the step's own `with_sharding_constraint` / `jax.sharding.reshard`
        fix their results' sharding; "hint": the planner may choose another.
      accumulate: gradient accumulation in a single-stage plan (`planner.levers.accumulate`): 1 (off),
        an int k (k microbatches per step, a `lax.scan` inside the step, one update), "auto" (the
        planner chooses the fastest k that fits `memory_budget`), or None (the default: the planner
        weighs k >= 2 when no plan fits without a memory lever and the step is microbatch-invariant,
        `planning.composition`). Each microbatch step is planned with `remat`.
      offload: host offload of optimizer state in a single-stage plan (`planner.ilp.offload`): "off",
        "opt-state" (every optimizer-state leaf lives in the host's memory between steps),
        "opt-state+params" (the float32 master parameters too, where the step reads them before the
        update only to cast them to the compute dtype), "auto" (the leaves a plan needs off the
        device to fit `memory_budget`: moments first, then master parameters, largest first), or
        None (the default): "auto" where the levers are composed (`planning.composition`: tried
        only when no plan fits without it; nothing where the devices have no host memory or the
        hardware no host link figure, nor with pipeline stages or gradient accumulation), "off" for
        a single `make_plan` (`planned_offload`).
      remat: recomputation of repeated layers in a single-stage plan (`planner.levers.remat`, default
        "auto"; with pipeline stages only "auto", the stages choosing recomputation themselves): "off",
        "full" (each layer keeps only its inputs), "dots" (keeps matmul results,
        `jax.checkpoint_policies.dots_saveable`), "dots_no_batch" (keeps the results of matmuls
        without batch dimensions: projections, not attention scores), or "auto" (off when the plan
        without it fits `memory_budget` unconstrained, else the fastest of off / each policy that fits).
      donate_argnums: arguments whose buffers the step may reuse (as `jax.jit(donate_argnums=...)`,
        typically the train state): the memory model frees each leaf at its last use and lets its
        new value take the buffer (`planner.ilp.live_ranges.live_ranges`); `plan_parallel` passes its
        own `donate_argnums` here and emits them donated.
      unshard: with `accumulate` > 1, selective unsharding (`planner.levers.accumulate.unshard`): values the
        microbatch loop would reshard from the arguments in every microbatch (a ZeRO-3 parameter's
        all-gather) are resharded once before the loop while `memory_budget` allows; False: every
        microbatch reshards them.
      mesh_ndim: the most axes of the logical meshes searched when no mesh is given (1, 2 or 3;
        None: 3 when the devices span several hosts, else 2, `search.candidates.default_mesh_ndim`): 3 adds the
        3-D factorisations (e.g. data x fsdp x tensor) that refine the mesh of the fastest 2-D plan,
        each searched near that plan: its shardings and those with one mesh axis moved
        (`search.meshes.search_meshes`, `search.refinement.neighbourhood`). A 3-D mesh given explicitly is searched whole.
      comm_precision: the wire formats collectives may use (`planner.ilp.wire`): "exact" (the
        default: the partial sums of a split contraction whose result is narrower than float32 are
        reduced in float32, as the unsharded contraction accumulates, and rounded once after;
        everything else in its own dtype), "bf16" (those partial sums in the result's dtype, bf16 or
        fp16: half the bytes, each device's share rounded before the sum) or "int8" (as "bf16",
        and weights gathered for a contraction as int8 with a scale per block where that is faster
        on the mesh, and gradients, the partial sums of contractions that feed no matmul, exchanged
        as int8 chunks and summed in float32, as DeepSpeed ZeRO++'s qwZ and qgZ do).
    """

    memory_budget: float | None = None
    hardware: Any = None
    solver_time_limit: float = 30.0
    solver_workers: int = 1
    tie_outputs: bool = True
    share_layers: bool = True
    constrain_intermediates: bool = True
    inter_host_axes: tuple[int, ...] = ()
    profile: Any = None
    pipeline: bool | str | None = None
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    inter_host: Any = None
    intra_host: Any = None
    overlap: bool = True
    prefetch: bool | None = None
    user_constraints: str = "pin"
    accumulate: int | str | None = None
    offload: str | None = None
    remat: str = "auto"
    donate_argnums: tuple[int, ...] = ()
    mesh_ndim: int | None = None
    unshard: bool = True
    comm_precision: str = "exact"

    def __post_init__(self):
        if self.comm_precision not in COMM_PRECISIONS:
            raise InvalidArgumentError(f"comm_precision={self.comm_precision!r} must be one of "
                                       f"{', '.join(map(repr, COMM_PRECISIONS))}")
        if not isinstance(self.unshard, bool):
            raise InvalidArgumentError(f"unshard={self.unshard!r} must be True or False")
        if self.mesh_ndim not in (None, 1, 2, 3) or isinstance(self.mesh_ndim, bool):
            raise InvalidArgumentError(f"mesh_ndim={self.mesh_ndim!r} must be None, 1, 2 or 3")
        if not (isinstance(self.donate_argnums, tuple)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.donate_argnums)):
            raise InvalidArgumentError(f"donate_argnums={self.donate_argnums!r} must be argument positions (ints >= 0)")
        if not isinstance(self.overlap, bool):
            raise InvalidArgumentError(f"overlap={self.overlap!r} must be True or False")
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise InvalidArgumentError(f"prefetch={self.prefetch!r} must be True, False or None (weighed by the planner)")
        for name in ("inter_host", "intra_host"):
            if getattr(self, name) is not None:
                parse_link(getattr(self, name), name)
        if self.user_constraints not in ("pin", "hint"):
            raise InvalidArgumentError(f"user_constraints={self.user_constraints!r} must be 'pin' or 'hint'")
        if not (self.accumulate is None or self.accumulate == "auto"
                or (isinstance(self.accumulate, int) and not isinstance(self.accumulate, bool) and self.accumulate >= 1)):
            raise InvalidArgumentError(f"accumulate={self.accumulate!r} must be None, an int >= 1 or 'auto'")
        if self.accumulate not in (None, 1) and self.pipeline:
            raise InvalidArgumentError("accumulate= is for single-stage plans; a pipeline splits the batch into "
                                       "microbatches itself (num_microbatches=)")
        if self.offload is not None and self.offload not in OFFLOAD_MODES:
            raise InvalidArgumentError(f"offload={self.offload!r} must be one of {', '.join(map(repr, OFFLOAD_MODES))}")
        if self.offload not in (None, "off", "auto") and (self.pipeline or self.accumulate not in (None, 1)):
            raise InvalidArgumentError(f"offload={self.offload!r} is for single-stage plans without gradient "
                                       "accumulation; drop pipeline= / accumulate= or use offload='auto'")
        if not isinstance(self.remat, str) or self.remat not in REMAT:
            raise InvalidArgumentError(f"remat={self.remat!r} must be one of {', '.join(map(repr, REMAT))}")
        if self.remat not in ("off", "auto") and self.pipeline:
            raise InvalidArgumentError(f"remat={self.remat!r} is for single-stage plans (pipeline stages choose "
                                       "recomputation themselves); drop pipeline= or use remat='auto'")
        if self.pipeline is not None and self.pipeline not in (True, False, "auto"):
            raise InvalidArgumentError(f"pipeline={self.pipeline!r} must be True, False, 'auto' or None (weighed)")
        if self.schedule not in ("1f1b", "gpipe"):
            raise InvalidArgumentError(f"schedule={self.schedule!r} must be '1f1b' or 'gpipe'")
        if self.num_microbatches is not None and not (isinstance(self.num_microbatches, int) and self.num_microbatches >= 1):
            raise InvalidArgumentError(f"num_microbatches={self.num_microbatches!r} must be an int >= 1")
        if not (isinstance(self.solver_time_limit, (int, float)) and self.solver_time_limit > 0):
            raise InvalidArgumentError(f"solver_time_limit={self.solver_time_limit!r} must be a positive number of seconds")
        if not (isinstance(self.solver_workers, int) and self.solver_workers >= 1):
            raise InvalidArgumentError(f"solver_workers={self.solver_workers!r} must be an int >= 1")

    @property
    def planned_prefetch(self) -> bool:
        """Whether one mesh's problem prices prefetched argument reshardings: the option, False for
        None (the composition of the levers weighs it itself)."""
        return bool(self.prefetch)

    @property
    def planned_offload(self) -> str:
        """The offload mode one mesh's problem is planned with (`search.mesh_plan.make_plan`): the
        option, "off" for None (the composition of the levers resolves None itself)."""
        return self.offload or "off"

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> PlanOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidArgumentError(
                f"unknown planner option(s) {', '.join(map(repr, unknown))}; valid options: {', '.join(sorted(names))}"
            )
        values = dict(kwargs)
        if "memory_budget" in values:
            values["memory_budget"] = parse_bytes(values["memory_budget"])
        if "inter_host_axes" in values:
            values["inter_host_axes"] = tuple(values["inter_host_axes"])
        if isinstance(values.get("donate_argnums"), int):
            values["donate_argnums"] = (values["donate_argnums"],)
        elif isinstance(values.get("donate_argnums"), list):
            values["donate_argnums"] = tuple(values["donate_argnums"])
        return cls(**values)

    def recorded(self) -> PlanOptions:
        """These options as a plan records them (`Plan.options`): the hardware and the profile by
        name, as their JSON form keeps them, so a plan and its reloaded copy compare equal."""
        return PlanOptions.from_json(self.to_json())

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PlanOptions:
        """Options of their JSON form (`to_json`); keys that are no option (any more) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["hardware"] = getattr(self.hardware, "name", self.hardware)  # a `Hardware` record by its preset name
        d["inter_host_axes"] = list(self.inter_host_axes)
        d["donate_argnums"] = list(self.donate_argnums)
        d["profile"] = self.profile if isinstance(self.profile, (str, type(None))) else getattr(self.profile, "path", "<in memory>")
        return d
