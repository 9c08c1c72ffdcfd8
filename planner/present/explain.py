"""Why a plan is what it is: the text of `planner explain`.

Explanations are computed from the plan's JSON form alone: the predicted collectives (kind, axes,
bytes, where, reason), the per-decision records (chosen strategy, its local cost split, its own
collectives as the planner costed them, the runner-up with its extra cost and collectives) and, with the command line's context block, the input shapes. Collective times are
re-costed with the same cost model the plan was made with (`search.mesh_plan.cost_model_for`), so the
breakdown adds up to the planner's own numbers up to the latency the collective combiner saves.
"""
from __future__ import annotations

import ast
import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable, Sequence

from planner.cost_model import CostModel, ring_bytes
from planner.core.plan import Decision, Plan, PredictedCollective
from planner.search.mesh_plan import cost_model_for
from planner.present.report import (PlanView, fmt_axes_spec, fmt_bytes, fmt_time, format_levers, memory_breakdown,
                                     table)

_REASONS = {
    "partial sum": "partial sums (a split contraction is reduced)",
    "reshard": "resharding (producer and consumer disagree)",
    "follow": "follow (an op that cannot keep its operand's split)",
}

Timer = Callable[..., float]  # (kind, nbytes, axis names, combined=False) -> seconds


def collective_timer(view: PlanView) -> Timer:
    """(kind, nbytes, axis names) -> seconds under the plan's own cost model (hardware, inter-host axes)."""
    options = view.plan.options
    try:
        if not (isinstance(options.profile, str) and os.path.isfile(options.profile)):
            options = dataclasses.replace(options, profile=None)  # a plan read elsewhere: the analytic model
        cost = cost_model_for(view.plan.mesh, options)
    except (TypeError, ValueError):  # PlannerError subclasses these: unknown preset, unreadable profile
        cost = CostModel.default(view.plan.mesh)
    index = {n: i for i, n in enumerate(view.axis_names)}

    def timer(kind: str, nbytes: float, axes: Sequence[str], combined: bool = False) -> float:
        return cost.collective_time(kind, nbytes, tuple(index[a] for a in axes if a in index), combined=combined)

    return timer


def shorten(label: str, width: int = 64) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]


def readable_strategy(text: str, axis_names: Sequence[str]) -> str:
    """A raw spec tuple such as `((0,), ())` becomes `P(x, None)`; strategy descriptions pass through."""
    if text.startswith("(("):
        try:
            spec = ast.literal_eval(text)
            return fmt_axes_spec([tuple(axis_names[a] for a in axes) for axes in spec])
        except (ValueError, SyntaxError, IndexError, TypeError):
            return text
    return text


def decision_comm(collectives, ops: int = 1) -> list[str]:
    """A decision's own collectives as readable lines (from the plan's decision record, as costed)."""
    return [f"{kind} over {'*'.join(axes) or '-'} of {fmt_bytes(nbytes)} ({fmt_time(seconds)}"
            + (f" per op, x{ops} ops)" if ops > 1 else ")")
            for kind, axes, nbytes, seconds in collectives]


def collectives_by_kind(collectives: Sequence[PredictedCollective], timer: Timer) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for c in collectives:
        row = out[c.kind]
        row[0] += 1
        row[1] += c.nbytes
        row[2] += ring_bytes(c.kind, c.nbytes, c.group_size)
        row[3] += timer(c.kind, c.nbytes, c.axes)
    return dict(out)


def _by(key: Callable[[PredictedCollective], str], collectives: Sequence[PredictedCollective],
        timer: Timer) -> dict[str, list[float]]:
    """key -> [count, bytes sent per device, time] over the collectives."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in collectives:
        row = out[key(c)]
        row[0] += 1
        row[1] += ring_bytes(c.kind, c.nbytes, c.group_size)
        row[2] += timer(c.kind, c.nbytes, c.axes)
    return dict(out)


def cost_breakdown(view: PlanView, timer: Timer | None = None) -> str:
    """Step time split into compute and communication (by collective and by reason), and memory."""
    timer = timer or collective_timer(view)
    p = view.plan.prediction
    lines = [f"  predicted step time {fmt_time(p.step_time_s)} = compute {fmt_time(p.compute_time_s)} "
             f"+ communication {fmt_time(p.communication_time_s)}"]
    kinds = collectives_by_kind(p.collectives, timer)
    if kinds:
        lines.append("  communication by collective (times re-costed one by one; the planner merges gradient "
                     "reductions, so its total can be lower):")
        rows = [(k, int(n), fmt_bytes(b), fmt_bytes(m), fmt_time(t)) for k, (n, b, m, t) in
                sorted(kinds.items(), key=lambda kv: -kv[1][3])]
        lines.append(table(("collective", "count", "buffers", "sent/device", "time"), rows, "lrrrr", "    "))
        reasons = _by(lambda c: c.reason, p.collectives, timer)
        rows = [(_REASONS.get(r, r), int(n), fmt_bytes(m), fmt_time(t)) for r, (n, m, t) in
                sorted(reasons.items(), key=lambda kv: -kv[1][2])]
        lines.append("  communication by reason:")
        lines.append(table(("reason", "count", "sent/device", "time"), rows, "lrrr", "    "))
    else:
        lines.append("  no communication: every op runs on local shards")
    budget = view.budget()
    mem = memory_breakdown(view)
    lines.append(f"  memory: peak {fmt_bytes(p.memory_bytes_per_device)} per device"
                 + (f" of a {fmt_bytes(budget)} budget ({p.memory_bytes_per_device / budget:.0%})" if budget else ""))
    if mem:
        lines.append("    " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items()))
    return "\n".join(lines)


def _sites(collectives: Sequence[PredictedCollective], timer: Timer) -> list[tuple[str, int, float, float]]:
    acc = _by(lambda c: c.where, collectives, timer)
    return sorted(((w, int(n), b, t) for w, (n, b, t) in acc.items()), key=lambda r: -r[3])


def _decision_rows(decisions: Sequence[Decision], names: Sequence[str], top: int | None = None) -> list[tuple]:
    """One row per distinct (label, choice, cost, runner-up) in order: identical decisions (the same
    op in several places) are one row whose `ops` adds theirs; at most `top` rows."""
    rows: dict[tuple, int] = {}
    for d in decisions:
        key = (shorten(d.label), readable_strategy(d.chosen, names), fmt_time(d.cost_s),
               readable_strategy(d.runner_up, names), "+" + fmt_time(d.runner_up_delta_s))
        if key not in rows and top is not None and len(rows) >= top:
            continue
        rows[key] = rows.get(key, 0) + d.ops
    return [(k[0], n) + k[1:] for k, n in rows.items()]


def _decision_count(plan: Plan, shown: int) -> str:
    """How many decisions the plan made and how many of them `explain` lists (those with a choice)."""
    total = plan.solver.variables_shared
    if not isinstance(total, int) or total <= shown:
        return f"{shown} decisions"
    return (f"{shown} of the plan's {total} decisions after layer sharing; the other {total - shown} "
            "had a single option")


def _relative(base: float, delta: float) -> str:
    if base <= 0:
        return ""
    ratio = delta / base
    return f", {ratio:.0%} more" if ratio < 10 else f", {1 + ratio:.0f}x the chosen cost"


def _explain_decision(d: Decision, view: PlanView) -> str:
    names = view.axis_names
    lines = [f"  {d.label}" + (f"   ({d.ops} ops share this decision)" if d.ops > 1 else "")]
    lines.append(f"    chosen     {readable_strategy(d.chosen, names)}")
    lines.append(f"               cost {fmt_time(d.cost_s)} = compute {fmt_time(d.compute_s)} + own communication "
                 f"{fmt_time(d.communication_s)} + resharding on its edges {fmt_time(d.resharding_s)}")
    lines += [f"               {item}" for item in decision_comm(d.collectives, d.ops)]
    lines.append(f"    runner-up  {readable_strategy(d.runner_up, names)}")
    lines.append(f"               cost {fmt_time(d.cost_s + d.runner_up_delta_s)} (+{fmt_time(d.runner_up_delta_s)}"
                 + _relative(d.cost_s, d.runner_up_delta_s) + ")")
    lines += [f"               {item}" for item in decision_comm(d.runner_up_collectives, d.ops)]
    return "\n".join(lines)


def user_constraint_lines(plan) -> list[str]:
    """The step's own sharding constraints: which the plan kept (pins always are), which it overrode."""
    cs = plan.user_constraints
    if not cs:
        return []
    kept = sum(bool(c.kept) for c in cs)
    mode = cs[0].mode
    head = (f"Your sharding constraints ({kept} of {len(cs)} kept; "
            + ("pinned: the planner plans around them)" if mode == "pin"
               else "hints: the planner may override them; user_constraints='pin' keeps them all)"))
    rows = [(shorten(c.where, 56), c.user_spec, c.planned_spec, "kept" if c.kept else "overridden") for c in cs]
    return ["", head, table(("op", "yours", "planned", ""), rows, "llll")]


def explain_plan(plan: Plan, op: str | None = None, top: int = 15) -> str:
    """`planner explain` for a `Plan` in hand (`planner.present.explain.explain_plan(step.plan(*args))`).

    The presentation layer sits above the core, so `Plan` itself has no `explain` method."""
    return explain(PlanView.from_dict(plan.to_dict()), op=op, top=top)


LEGEND = ("  notation: P(x, None) = a PartitionSpec (dim 0 split over mesh axis x, dim 1 whole); "
          "d1->x = the op's dimension labelled d1 split over x (labels: d<i> dim i, b batch, m/n rows/columns, "
          "k contracted, v looked-up vocabulary); all-reduce[y](N B) = a collective the op itself performs; "
          "replicated = nothing split")


def explain(view: PlanView, op: str | None = None, top: int = 15) -> str:
    """The text of `planner explain`: cost breakdown, the costliest sites, and each decision's runner-up.

    Args:
      view: the plan.
      op: only decisions and collectives whose label contains this text (case-insensitive).
      top: rows per section.
    """
    timer = collective_timer(view)
    plan = view.plan
    out = [f"Plan on mesh {view.mesh_text()}, {len(plan.stages) or 1} stage(s)"]
    if op is None:
        out += ["", "Cost breakdown:", cost_breakdown(view, timer)]
        levers = format_levers(plan)
        if levers:
            out += ["", "Memory levers:", levers]
        sites = _sites(plan.prediction.collectives, timer)
        if sites:
            out += ["", f"Where the communication happens (top {min(top, len(sites))} of {len(sites)} ops):"]
            out.append(table(("op", "collectives", "sent/device", "time"),
                             [(shorten(w), n, fmt_bytes(b), fmt_time(t)) for w, n, b, t in sites[:top]], "lrrr"))
        ds = sorted(plan.decisions, key=lambda d: -d.cost_s)
        out += ["", f"Decisions, costliest first ({_decision_count(plan, len(ds))}; "
                    "cost = own cost + resharding on its edges; identical decisions are one row):", LEGEND]
        out.append(table(("decision", "ops", "chosen", "cost", "runner-up", "extra"),
                         _decision_rows(ds, view.axis_names, top), "lrlrlr"))
        close = sorted((d for d in plan.decisions if d.runner_up_delta_s > 0), key=lambda d: d.runner_up_delta_s)
        if close:
            out += ["", "Closest calls (the runner-up was almost as good):"]
            out.append(table(("decision", "ops", "chosen", "cost", "runner-up", "extra"),
                             _decision_rows(close, view.axis_names, min(top, 8)), "lrlrlr"))
        out += user_constraint_lines(plan)
        out += ["", "Details of one op: planner explain PLAN.json --op NAME"]
        return "\n".join(out)
    needle = op.lower()
    ds = [d for d in plan.decisions if needle in d.label.lower()]
    cs = [c for c in plan.prediction.collectives if needle in c.where.lower()]
    if not ds and not cs:
        labels = sorted({d.label.split()[0] for d in plan.decisions})
        return "\n".join(out + [f"no decision or collective matches {op!r}; decisions are labelled by primitive and "
                                f"module path (primitives here: {', '.join(labels[:12])}), inputs as 'input PATH'"])
    out += ["", f"Decisions matching {op!r} ({len(ds)}):"]
    out += [_explain_decision(d, view) for d in ds[: top * 4]]
    if len(ds) > top * 4:
        out.append(f"  ... {len(ds) - top * 4} more (raise --top)")
    if cs:
        out += ["", f"Collectives at ops matching {op!r} ({len(cs)}):"]
        rows = [(shorten(c.where, 56), c.kind, "*".join(c.axes), fmt_bytes(c.nbytes), c.reason,
                 fmt_time(timer(c.kind, c.nbytes, c.axes))) for c in cs[: top * 4]]
        out.append(table(("op", "collective", "axes", "buffer", "reason", "time"), rows, "lllrlr"))
    return "\n".join(out)
