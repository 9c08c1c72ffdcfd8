"""The planner's plan beside hand configurations (`planner.planning.evaluate.compare`): one table, then the
places that make the difference: each plan's step time split by argument, op, latency group and
overlap (`Plan.solver.step_parts`), so the differences add up to the step-time gap."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.core.layer_index import star_indices
from planner.core.plan import Plan
from planner.present.explain import readable_strategy, shorten
from planner.present.report import fmt_bytes, fmt_time, table


@dataclasses.dataclass(frozen=True, slots=True)
class Difference:
    """One place where a configuration's predicted step time differs from the plan's.

    Attributes:
      what: an argument ("input PATH"), an op (name and module path), "combined KIND latency over
        AXES" (one latency per group of combined collectives) or "overlap" (communication hidden
        behind compute).
      plan_layout / other_layout: the layout there in the plan and in the configuration ("" where
        the item has none).
      extra_s: seconds the configuration pays there beyond the plan (negative: it pays less).
      parts: the extra seconds split into compute, own collectives, resharding (on edges), latency
        and hidden.
      layers: how many layers repeat it (`what` then names them `blocks_*`); the figures are summed.
    """

    what: str
    plan_layout: str
    other_layout: str
    extra_s: float
    parts: tuple[tuple[str, float], ...]
    layers: int = 1


_PARTS = ("compute", "collectives", "resharding")


def _ledger(plan: Plan) -> dict[str, tuple[str, dict[str, float]]] | None:
    """what -> (layout, {part: seconds}) from the plan's recorded step parts (None: not recorded)."""
    rec = plan.solver.step_parts
    if rec is None:
        return None
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for label, layout, *seconds in rec.items:
        out[label] = (layout, dict(zip(_PARTS, map(float, seconds))))
    for kind, axes, seconds in rec.combined_latency:
        out[f"combined {kind} latency over {','.join(axes)}"] = ("", {"latency": float(seconds)})
    out["overlap (communication hidden behind compute)"] = ("", {"hidden": -float(rec.hidden_s)})
    return out


def differences(plan: Plan, other: Plan, top: int | None = 3) -> list[Difference]:
    """Where `other`'s predicted step time differs from the plan's, largest extra cost first.

    The plan records its step time split by argument, op, combined-collective latency group and
    overlap (`planner.ilp.objective.step_parts`); every item's difference is taken, so the items
    sum to the step-time gap. `top` keeps the first `top` items where `other` pays more (None:
    every nonzero item, both signs). Plans without the record (older JSON) are matched by decision
    label only.
    """
    mine, theirs = _ledger(plan), _ledger(other)
    if mine is None or theirs is None:
        by_label = {d.label: d for d in plan.decisions}
        out = [Difference(d.label, by_label[d.label].chosen, d.chosen, d.cost_s - by_label[d.label].cost_s, ())
               for d in other.decisions if d.label in by_label and by_label[d.label].chosen != d.chosen]
    else:
        out = []
        for what in [*mine, *(k for k in theirs if k not in mine)]:
            a_layout, a = mine.get(what, ("", {}))
            b_layout, b = theirs.get(what, ("", {}))
            parts = tuple((k, b.get(k, 0.0) - a.get(k, 0.0)) for k in dict.fromkeys([*a, *b]))
            extra = sum(v for _, v in parts)
            if extra:
                out.append(Difference(what, a_layout, b_layout, extra, parts))
        out = _merge_layers(out)
    out.sort(key=lambda d: -d.extra_s)
    if top is None:
        return out
    return [d for d in out if d.extra_s > 0][:top]


def _merge_layers(items: list[Difference]) -> list[Difference]:
    """Items that differ only in a layer index (`blocks_0`, `blocks_1`) and have the same layouts in
    both plans are one decision repeated per layer: one item, `blocks_*`, summed."""
    groups: dict[tuple[str, str, str], list[Difference]] = {}
    for d in items:
        groups.setdefault((star_indices(d.what), d.plan_layout, d.other_layout), []).append(d)
    out = []
    for (what, a, b), ds in groups.items():
        if len(ds) == 1:
            out.append(ds[0])
            continue
        parts: dict[str, float] = {}
        for d in ds:
            for k, v in d.parts:
                parts[k] = parts.get(k, 0.0) + v
        out.append(Difference(what, a, b, sum(d.extra_s for d in ds), tuple(parts.items()), len(ds)))
    return out


def _difference_line(d: Difference, names: Sequence[str]) -> str:
    sign = "+" if d.extra_s >= 0 else "-"
    head = f"{shorten(d.what, 60)}: {sign}{fmt_time(abs(d.extra_s))}"
    if d.layers > 1:
        head += f" in {d.layers} layers"
    split = ", ".join(f"{k} {'+' if v >= 0 else '-'}{fmt_time(abs(v))}" for k, v in d.parts if abs(v) > 1e-12)
    if split and len(d.parts) > 1:
        head += f" ({split})"
    if d.plan_layout != d.other_layout:
        head += (f"; layout {readable_strategy(d.other_layout, names) or '-'} instead of "
                 f"{readable_strategy(d.plan_layout, names) or '-'}")
    return head


HEADERS = ("configuration", "step time", "vs plan", "exposed comm", "memory", "bytes moved", "fits")


def comparison_record(plan: Plan, others: Sequence[tuple[str, Plan]], skipped: Sequence[tuple[str, str]] = (),
                      budget: float | None = None, top: int = 3) -> dict:
    """The comparison as JSON-ready data (what the text and the HTML report print; `--json` keeps
    it in the plan's context): per configuration its predicted figures and their differences from
    the plan, then the notes (skipped configurations, approximations, and per configuration the
    `top` places where it pays more than the plan and the largest offsets)."""
    names = plan.mesh.axis_names
    base = plan.prediction
    rows = []
    for name, p in [("planner", plan), *others]:
        pr = p.prediction
        rows.append({"name": name, "step_time_s": pr.step_time_s, "exposed_communication_s": pr.communication_time_s,
                     "hidden_communication_s": pr.hidden_communication_time_s,
                     "memory_bytes_per_device": pr.memory_bytes_per_device,
                     "bytes_moved_per_device": pr.bytes_moved_per_device,
                     "fits": None if budget is None else bool(pr.memory_bytes_per_device <= budget),
                     "step_time_vs_plan_s": pr.step_time_s - base.step_time_s,
                     "memory_vs_plan_bytes": pr.memory_bytes_per_device - base.memory_bytes_per_device,
                     "bytes_moved_vs_plan": pr.bytes_moved_per_device - base.bytes_moved_per_device})
    notes = [f"{name}: not evaluated: {reason}" for name, reason in skipped]
    notes += [f"{name} is approximated: {p.solver.approximation}" for name, p in others if p.solver.approximation]
    for name, p in others:
        diffs = differences(plan, p, top)
        if not diffs:
            continue
        gap = p.prediction.step_time_s - base.step_time_s
        share = (f"; these {len(diffs)} sum to {sum(d.extra_s for d in diffs) / gap:.0%} of it"
                 if gap > 0 and diffs[0].parts else "")
        notes.append(f"where {name} pays more than the plan (step {'+' if gap >= 0 else '-'}"
                     f"{fmt_time(abs(gap))}{share}):")
        notes += [f"  {_difference_line(d, names)}" for d in diffs]
        offsets = [d for d in differences(plan, p, None) if d.extra_s < 0][-1:-3:-1] if diffs[0].parts else []
        if offsets:
            notes.append(f"  offset where {name} pays less:")
            notes += [f"    {_difference_line(d, names)}" for d in offsets]
    return {"mesh": str(plan.mesh), "axis_names": list(names), "budget_bytes": budget, "rows": rows,
            "notes": notes}


def record_cells(record: dict) -> list[tuple[str, ...]]:
    """The table's cells (`HEADERS`), one tuple per configuration."""
    base = record["rows"][0]["step_time_s"]
    return [(r["name"], fmt_time(r["step_time_s"]), f"{r['step_time_s'] / base:.2f}x" if base > 0 else "-",
             fmt_time(r["exposed_communication_s"]), fmt_bytes(r["memory_bytes_per_device"]),
             fmt_bytes(r["bytes_moved_per_device"]), "-" if r["fits"] is None else ("yes" if r["fits"] else "no"))
            for r in record["rows"]]


def format_record(record: dict) -> str:
    """`comparison_record` as text: the table, then the notes."""
    lines = [f"  mesh {record['mesh']} ({', '.join(record['axis_names'])}); one cost model for every row "
             "(predicted, per device)", table(HEADERS, record_cells(record), "lrrrrrl")]
    return "\n".join(lines + [f"  {n}" for n in record["notes"]])


def format_comparison(plan: Plan, others: Sequence[tuple[str, Plan]], skipped: Sequence[tuple[str, str]] = (),
                      budget: float | None = None, top: int = 3) -> str:
    """The table (predicted step time, exposed communication, memory and bytes moved per device),
    then per configuration the top places where it pays more than the plan (they sum to its share
    of the step-time gap) and where it pays less."""
    return format_record(comparison_record(plan, others, skipped, budget, top))
