"""The planner's plan beside hand configurations (`planner.evaluation.compare`): one table, then the
decisions that make the difference."""
from __future__ import annotations

from collections.abc import Sequence

from planner.plan import Plan
from planner.present.explain import readable_strategy, shorten
from planner.present.report import fmt_bytes, fmt_time, table


def differences(plan: Plan, other: Plan, top: int = 3) -> list[tuple[str, str, str, float]]:
    """The `top` decisions (matched by label) where `other` chose differently and pays most over
    the plan: (label, plan's choice, other's choice, extra seconds the other pays there)."""
    mine = {d.label: d for d in plan.decisions}
    out = []
    for d in other.decisions:
        m = mine.get(d.label)
        if m is not None and m.chosen != d.chosen:
            out.append((d.label, m.chosen, d.chosen, d.cost_s - m.cost_s))
    out.sort(key=lambda r: -r[3])
    return out[:top]


def format_comparison(plan: Plan, others: Sequence[tuple[str, Plan]], skipped: Sequence[tuple[str, str]] = (),
                      budget: float | None = None, top: int = 3) -> str:
    """The table (predicted step time, exposed communication, memory and bytes moved per device),
    then per configuration the top decisions where it pays more than the plan."""
    names = plan.mesh.axis_names
    base = plan.prediction.step_time_s
    rows = []
    for name, p in [("planner", plan), *others]:
        pr = p.prediction
        fits = "-" if budget is None else ("yes" if pr.memory_bytes_per_device <= budget else "no")
        rows.append((name, fmt_time(pr.step_time_s), f"{pr.step_time_s / base:.2f}x" if base > 0 else "-",
                     fmt_time(pr.communication_time_s), fmt_bytes(pr.memory_bytes_per_device),
                     fmt_bytes(pr.bytes_moved_per_device), fits))
    lines = [f"  mesh {plan.mesh} ({', '.join(names)}); one cost model for every row (predicted, per device)",
             table(("configuration", "step time", "vs plan", "exposed comm", "memory", "bytes moved", "fits"),
                   rows, "lrrrrrl")]
    for name, reason in skipped:
        lines.append(f"  {name}: not evaluated: {reason}")
    for name, p in others:
        note = p.solver.get("approximation")
        if note:
            lines.append(f"  {name} is approximated: {note}")
    for name, p in others:
        diffs = differences(plan, p, top)
        if not diffs:
            continue
        lines.append(f"  where {name} pays more than the plan:")
        for label, mine, theirs, extra in diffs:
            lines.append(f"    {shorten(label, 56)}: {readable_strategy(theirs, names)} instead of "
                         f"{readable_strategy(mine, names)} ({'+' if extra >= 0 else ''}{fmt_time(extra)})")
    return "\n".join(lines)
