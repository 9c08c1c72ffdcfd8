"""Does the compiled program communicate the way the plan said it would?

Compares the plan's predicted collectives with those read from the compiled HLO, per collective
kind, by count and by bytes moved per device (ring formulas on both sides). Two XLA behaviours
are accounted for rather than reported as mismatches:

- combiners merge independent collectives of one kind (gradient all-reduces become one), so the
  measured count may be lower than predicted, never higher;
- on CPU, XLA lowers a reduce-scatter to an all-reduce followed by a local slice, so when the
  compiled program has no reduce-scatter the predicted ones are compared as all-reduces.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from planner.cost_model import ring_bytes
from planner.core.plan import Plan, PredictedCollective
from xla_hooks.inspect import Collective, collectives


@dataclasses.dataclass(frozen=True, slots=True)
class KindRow:
    kind: str
    predicted_count: int
    measured_count: int
    predicted_bytes: float
    measured_bytes: float


@dataclasses.dataclass(frozen=True, slots=True)
class FidelityReport:
    """Predicted vs measured communication, with the rows that disagree."""

    rows: tuple[KindRow, ...]
    tolerance: float
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        lines = [f"{'collective':<20}{'pred #':>8}{'meas #':>8}{'pred bytes':>16}{'meas bytes':>16}"]
        for r in self.rows:
            lines.append(f"{r.kind:<20}{r.predicted_count:>8}{r.measured_count:>8}"
                         f"{r.predicted_bytes:>16,.0f}{r.measured_bytes:>16,.0f}")
        lines.append("fidelity: OK" if self.ok else "fidelity: MISMATCH\n  " + "\n  ".join(self.problems))
        return "\n".join(lines)


def check_fidelity(plan: Plan, compiled_or_hlo, tolerance: float = 0.10, min_bytes: float = 4096) -> FidelityReport:
    """Compares `plan.prediction.collectives` with the collectives of the compiled program.

    Args:
      plan: the plan the program was compiled from.
      compiled_or_hlo: a `jax.stages.Compiled` or its HLO text.
      tolerance: allowed relative difference of bytes moved per device, per collective kind.
      min_bytes: absolute slack in bytes (scalar reductions and the like are not worth a mismatch).

    Returns:
      A `FidelityReport`; `.ok` is False when a kind's bytes differ by more than the tolerance,
      XLA emits more collectives of a kind than predicted, or a predicted kind is missing.
    """
    return compare(plan.prediction.collectives, collectives(compiled_or_hlo), tolerance, min_bytes)


def check_stage_fidelity(stages: Sequence[Any], tolerance: float = 0.10,
                         min_bytes: float = 4096) -> tuple[FidelityReport, ...]:
    """Per pipeline stage, `check_fidelity` of its intra-op plan against its compiled programs.

    Args:
      stages: what `.lower()` of a pipelined plan returns (`planner.emit.pipeline.runtime.StageLowered`):
        per stage its `plan` (one microbatch's forward + backward) and `programs()` (forward,
        backward, update as `jax.stages.Lowered`); the collectives of all its programs together
        are compared with the plan's (the update is planned to communicate nothing). A remat
        stage's backward recomputes the forward, so its forward collectives compile twice and
        show as more than predicted.
      tolerance, min_bytes: as for `check_fidelity`.
    """
    out = []
    for st in stages:
        if st.plan is None:
            raise ValueError(f"stage {st.index} carries no intra-op plan to compare with")
        measured = [c for lowered in st.programs().values() for c in collectives(lowered.compile())]
        out.append(compare(stage_collectives(st), measured, tolerance, min_bytes))
    return tuple(out)


def stage_collectives(st: Any) -> list:
    """A lowered stage's predicted collectives: its plan's, where the stage splits its optimizer
    state (`StageLowered.shards_optimizer`) each gradient all-reduce over its data axes (a "partial
    sum" over them, as `stages.layer_cost.grad_sync` finds them) as the reduce-scatter and the
    parameter all-gather its update runs instead (the same bytes each, half the ring's all-reduce);
    a scalar's (the loss mean's partial sum, not a parameter gradient) stays an all-reduce."""
    predicted = list(st.plan.prediction.collectives)
    if not getattr(st, "shards_optimizer", False):
        return predicted
    data = set(st.data_axes)
    out = []
    for c in predicted:
        if c.kind == "all-reduce" and c.reason == "partial sum" and c.axes and set(c.axes) <= data and c.nbytes > 8:
            out += [dataclasses.replace(c, kind="reduce-scatter"), dataclasses.replace(c, kind="all-gather")]
        else:
            out.append(c)
    return out


def compare(predicted: Sequence[PredictedCollective], measured: Sequence[Collective], tolerance: float = 0.10,
            min_bytes: float = 4096) -> FidelityReport:
    """Predicted vs measured collectives, per kind (see `check_fidelity`)."""
    has_rs = any(c.kind == "reduce-scatter" for c in measured)
    pred_count: dict[str, int] = {}
    pred_bytes: dict[str, float] = {}
    for c in predicted:
        kind = c.kind if (c.kind != "reduce-scatter" or has_rs) else "all-reduce"
        pred_count[kind] = pred_count.get(kind, 0) + 1
        pred_bytes[kind] = pred_bytes.get(kind, 0.0) + ring_bytes(kind, c.nbytes, c.group_size)
    meas_count: dict[str, int] = {}
    meas_bytes: dict[str, float] = {}
    for c in measured:
        if c.group_size <= 1:
            continue
        meas_count[c.kind] = meas_count.get(c.kind, 0) + 1
        meas_bytes[c.kind] = meas_bytes.get(c.kind, 0.0) + c.bytes_moved_per_device
    rows, problems = [], []
    for kind in sorted(set(pred_count) | set(meas_count)):
        pc, mc = pred_count.get(kind, 0), meas_count.get(kind, 0)
        pb, mb = pred_bytes.get(kind, 0.0), meas_bytes.get(kind, 0.0)
        rows.append(KindRow(kind, pc, mc, pb, mb))
        if abs(pb - mb) > tolerance * max(pb, mb) + min_bytes:
            problems.append(f"{kind}: predicted {pb:,.0f} bytes moved per device, XLA emits {mb:,.0f}")
        if mc > pc and mb > min_bytes:
            problems.append(f"{kind}: XLA emits {mc} collectives, the plan predicted {pc}")
        if pc and not mc and pb > min_bytes:
            problems.append(f"{kind}: predicted {pc} collectives, XLA emits none")
    return FidelityReport(tuple(rows), tolerance, tuple(problems))
