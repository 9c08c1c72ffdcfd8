"""The records a `Plan` keeps beside its shardings: how the solve went (`SolverStats`), the memory
levers it uses (`Levers`) and the step's own sharding constraints (`UserConstraint`), each with its
one JSON form (`to_json` / `from_json`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from planner.core.json_form import JsonRecord, fields_json, from_fields
from planner.core.pipeline_records import PipelinePlanning
from planner.core.sharding import Spec


# ----- the solver ------------------------------------------------------------------------------
class StepPart(NamedTuple):
    """The step time paid at one node label (an argument's "input PATH" or an op), by kind."""

    label: str
    layout: str
    compute_s: float
    collectives_s: float
    resharding_s: float


class CombinedLatency(NamedTuple):
    """The one latency a group of combined collectives pays."""

    kind: str
    axes: tuple[str, ...]
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class StepTimeParts(JsonRecord):
    """The step time split by where it is paid (`planner.ilp.objective.step_parts`): the items'
    parts plus the latencies minus `hidden_s` (communication hidden behind compute) sum to it."""

    items: tuple[StepPart, ...]
    combined_latency: tuple[CombinedLatency, ...]
    hidden_s: float

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StepTimeParts:
        return cls(tuple(StepPart(*item) for item in d["items"]),
                   tuple(CombinedLatency(kind, tuple(axes), s) for kind, axes, s in d["combined_latency"]),
                   d["hidden_s"])


class ArgumentReshard(NamedTuple):
    """A resharding that takes an argument (or a value computed from it alone) to the layout an op
    reads it in: the op and operand position, the tensor, its time in the objective and the bytes
    it moves per device."""

    op: int
    position: int
    tensor: int
    seconds: float
    bytes_moved: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unbudgeted(JsonRecord):
    """The first solver round's plan, before any constraint on live memory: its step time, peak, and
    the strategies the memory lower bound ruled out."""

    step_time_s: float
    peak_bytes: int
    strategies_ruled_out: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Unbudgeted:
        return cls(d["step_time_s"], d["peak_bytes"], d["strategies_ruled_out"])


@dataclasses.dataclass(frozen=True, slots=True)
class SolverStats(JsonRecord):
    """How the plan was found (`Plan.solver`); a fact its maker does not record is None (its key
    absent from the JSON form).

    Attributes:
      status, solve_time_s, planning_time_s, rounds, deterministic_time: how the solve went:
        "optimal" / "feasible" ..., "pipeline" (a multi-stage plan) or "replicated" (a stage that
        splits nothing), its seconds, and the solver's rounds and CP-SAT deterministic units.
      objective_s, optimal, gap, limit: the ILP's answer: its objective, whether proven optimal,
        the gap to the best bound and the limit that stopped it (an ILP solve writes the last three
        together, gap and limit None when there are none).
      ops, decisions, variables_shared, edges: the problem's size (a pipeline's: the per-layer ILPs
        solved and the distinct layers).
      step_parts, argument_reshards, unbudgeted, pinned_inputs: the step time split by where it is
        paid, the arguments' reshardings (without prefetch), what fitting the memory budget cost
        (when it bound), and how many arguments were pinned.
      configuration, approximation: what `planner.evaluate` evaluated and what it approximates.
      weighed_once_s: a plan for one of several microbatches (`make_plan(microbatches=B)`): the
        full seconds of what its solve weighed at 1/B in the chosen strategies (all-reduces and
        their int8 quantisation): the plan's objective at B' microbatches is `objective_s` +
        (1/B' - 1/B) * this.
      planning: a pipeline plan's planning facts (`PipelinePlanning`), written among these keys.
    """

    status: str | None = None
    solve_time_s: float | None = None
    planning_time_s: float | None = None
    rounds: int | None = None
    ops: int | None = None
    decisions: int | None = None
    variables_shared: int | None = None
    edges: int | None = None
    objective_s: float | None = None
    optimal: bool | None = None
    gap: float | None = None
    deterministic_time: float | None = None
    limit: str | None = None
    unbudgeted: Unbudgeted | None = None
    pinned_inputs: int | None = None
    step_parts: StepTimeParts | None = None
    argument_reshards: tuple[ArgumentReshard, ...] | None = None
    configuration: str | None = None
    approximation: str | None = None
    weighed_once_s: float | None = None
    planning: PipelinePlanning | None = None

    def to_json(self) -> dict:
        d = fields_json(self, skip=("gap", "limit", "planning"))
        if self.optimal is not None:
            d["gap"], d["limit"] = self.gap, self.limit
        if self.planning is not None:
            d.update(self.planning.to_json())
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SolverStats:
        stats = from_fields(cls, d, skip=("planning",), unbudgeted=Unbudgeted.from_json,
                            step_parts=StepTimeParts.from_json,
                            argument_reshards=lambda rows: tuple(ArgumentReshard(*r) for r in rows))
        if d.get("status") == "pipeline":
            stats = dataclasses.replace(stats, planning=PipelinePlanning.from_json(d))
        return stats


def solver_quality(solver: SolverStats) -> str:
    """How good the solver's answer is, in words: "; proven optimal", "; gap 3.2% to the best
    bound (deterministic limit reached)", or "" for a record without these fields."""
    if solver.optimal:
        return "; proven optimal"
    if solver.optimal is None:
        return ""
    gap, limit = solver.gap, solver.limit
    text = "; not proven optimal, gap " + ("unknown" if gap is None else f"{gap:.2%}") + " to the best bound"
    return text + (f" ({limit} limit reached)" if limit else "")


# ----- the memory levers -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class UnshardedValue(JsonRecord):
    """A loop-invariant value selective unsharding reshards once before the microbatch loop: its
    tensor and name, its layout, the ops computing it, the seconds saved and the bytes held."""

    tensor: int
    value: str
    spec: Spec
    ops: tuple[int, ...]
    saved_s: float
    bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class AccumulationRecord(JsonRecord):
    """Gradient accumulation (`planner.levers.accumulate`).

    Attributes:
      microbatches, microbatch_rows: k and the rows of one microbatch.
      microbatch_step_time_s, update_time_s, microbatch_memory_bytes, accumulator_bytes,
        batch_bytes, collectives: with k > 1, the microbatch plan's own figures and what the
        k-microbatch step adds.
      unsharded, resharded_per_microbatch: with selective unsharding candidates, the values
        resharded once before the loop and the arguments resharded in every microbatch.
    """

    microbatches: int
    microbatch_rows: int
    microbatch_step_time_s: float | None = None
    update_time_s: float | None = None
    microbatch_memory_bytes: int | None = None
    accumulator_bytes: int | None = None
    batch_bytes: int | None = None
    collectives: str | None = None
    unsharded: tuple[UnshardedValue, ...] | None = None
    resharded_per_microbatch: tuple[int, ...] | None = None
    without_fits: bool | None = None  # the single-step plan the planner weighed it against, as in OffloadRecord
    without_step_time_s: float | None = None
    without_memory_bytes: int | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AccumulationRecord:
        return from_fields(cls, d, unsharded=lambda hs: tuple(UnshardedValue.from_json(h) for h in hs))


@dataclasses.dataclass(frozen=True, slots=True)
class RematRecord(JsonRecord):
    """Recomputation (`planner.levers.remat`): the policy ("off" alone when the plan fits without
    it), the layers recomputed, how many could be, the ops added and the scanned stacks recomputed;
    with remat="auto", the plan
    without recomputation it was weighed against: whether it fits the budget, its step time (when
    it fits) and its peak (the smallest found when it does not)."""

    policy: str
    layers: tuple[str, ...] | None = None
    recomputable: int | None = None
    recomputed_ops: int | None = None
    without_fits: bool | None = None
    without_step_time_s: float | None = None
    without_memory_bytes: int | None = None
    scans: int | None = None  # scanned stacks recomputed (`planner.graph.scan_remat`)
    scan_layers: int | None = None  # the first layers of each such stack recomputed (None: all)


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadRecord(JsonRecord):
    """Host offload (`planner.ilp.offload.record`).

    Attributes:
      mode, streamed: the offload mode and whether the optimizer update is streamed.
      inputs, outputs, paths, host_reads: the argument and output positions on the host (emission
        reads them), the arguments' paths, and the ops reading an offloaded argument before the update.
      params, candidates, host_bytes_per_device: master parameters offloaded, leaves that could be,
        and the bytes per device held on the host.
      copy_in_s, copy_back_s, hidden_s: the copies' times as the objective counts them.
      without_fits, without_step_time_s, without_memory_bytes: the plan without offload the
        planner weighed it against (whether it fits, its step time, its peak or the smallest found).
    """

    mode: str
    streamed: bool
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    paths: tuple[str, ...]
    params: int
    host_reads: tuple[int, ...]
    candidates: int
    host_bytes_per_device: int
    copy_in_s: float
    copy_back_s: float
    hidden_s: float
    without_fits: bool | None = None  # the plan without offload (`planning.composition`): fits the budget?
    without_step_time_s: float | None = None
    without_memory_bytes: int | None = None  # its peak, or the smallest peak found when it does not fit


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchRecord(JsonRecord):
    """Prefetched argument reshardings (`PlanOptions.prefetch` None, weighed by
    `planner.planning.composition`): the plan prices each parameter all-gather as issued ahead of
    its use, behind earlier compute, and was faster so than the plan without it on the same mesh
    (its step time and peak; `without_fits` as in the other records: that plan fits the budget)."""

    without_fits: bool | None = None
    without_step_time_s: float | None = None
    without_memory_bytes: int | None = None


# `Plan.levers` keys (plans saved before the field kept these records in "solver").
LEVER_NAMES = ("accumulation", "remat", "offload", "prefetch")


@dataclasses.dataclass(frozen=True, slots=True)
class Levers(JsonRecord):
    """The memory levers a plan uses, each None when it does not (emission reads them, so they take
    part in the plan's equality)."""

    accumulation: AccumulationRecord | None = None
    remat: RematRecord | None = None
    offload: OffloadRecord | None = None
    prefetch: PrefetchRecord | None = None

    def names(self) -> frozenset[str]:
        """The levers with a record."""
        return frozenset(n for n in LEVER_NAMES if getattr(self, n) is not None)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Levers:
        return from_fields(cls, d, accumulation=AccumulationRecord.from_json, remat=RematRecord.from_json,
                           offload=OffloadRecord.from_json, prefetch=PrefetchRecord.from_json)


# ----- the step's own constraints ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class UserConstraint(JsonRecord):
    """One of the step's own sharding constraints (`with_sharding_constraint`, `reshard`): where it
    is, the user's spec and the planned one, whether they agree, and the mode ("pin" / "hint")."""

    where: str
    user_spec: str
    planned_spec: str
    kept: bool
    mode: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UserConstraint:
        return cls(d["where"], d["user_spec"], d["planned_spec"], d["kept"], d["mode"])
