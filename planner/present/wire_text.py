"""The plan's wire formats in one line (`Plan.wire`, `planner.ilp.wire`)."""
from __future__ import annotations

from planner.core.plan import Plan


def wire_line(plan: Plan) -> str | None:
    """What the plan's collectives carry, for the report's header; None when every collective
    carries its value's own dtype under the default ("exact") and nothing is quantised."""
    records = list(plan.wire) + [w for st in plan.stages if st.plan is not None for w in st.plan.wire]
    precision = plan.options.comm_precision
    partial = sum(w.kind == "partial-sum" for w in records)
    gathers = [w for w in records if w.kind == "gather"]
    if not records and precision == "exact":
        return None
    parts = [precision]
    if partial:
        parts.append(f"partial sums of {partial} split contraction(s) reduced in float32, rounded once after "
                     "(as the unsharded contractions accumulate); other reductions in their values' dtype")
    elif precision != "exact":
        parts.append("partial sums of split contractions in their results' dtype (each device's share rounded "
                     "before the sum)")
    reduces = sum(w.kind == "reduce" for w in records)
    if reduces:
        parts.append(f"{reduces} gradient reduction(s) exchanged as int8 chunks and summed in float32")
    if gathers:
        blocks = sorted({w.block for w in gathers})
        parts.append(f"{len(gathers)} weight read(s) gathered as int8 with a bf16 scale per "
                     f"{'/'.join(map(str, blocks))} elements")
    elif precision == "int8":
        parts.append("no weight gather is faster as int8 on this mesh")
    return "; ".join(parts)
