"""Why a plan is what it is: the text of `planner explain`.

Explanations are computed from the plan's JSON form alone: the predicted collectives (kind, axes,
bytes, where, reason), the per-decision records (chosen strategy, its local cost, the runner-up and
its extra cost) and, with the command line's context block, the input shapes. Collective times are
re-costed with the same cost model the plan was made with (`planning.cost_model_for`), so the
breakdown adds up to the planner's own numbers up to the latency the collective combiner saves.
"""
from __future__ import annotations

import ast
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence

from planner.cost_model import CostModel, ring_bytes
from planner.options import PlanOptions
from planner.plan import Decision, PredictedCollective
from planner.planning import cost_model_for
from planner.present.report import PlanView, fmt_axes_spec, fmt_bytes, fmt_time, memory_breakdown, table

_COLLECTIVE_IN_TEXT = re.compile(
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\[([^\]]*)\]\((\d+)B\)")
_REASONS = {
    "partial sum": "partial sums (a split contraction is reduced)",
    "reshard": "resharding (producer and consumer disagree)",
    "follow": "follow (an op that cannot keep its operand's split)",
}

Timer = Callable[..., float]  # (kind, nbytes, axis names, combined=False) -> seconds


def collective_timer(view: PlanView) -> Timer:
    """(kind, nbytes, axis names) -> seconds under the plan's own cost model (hardware, inter-host axes)."""
    options = dict(view.plan.options)
    try:
        fields = set(PlanOptions.__dataclass_fields__)
        kwargs = {k: v for k, v in options.items() if k in fields}
        if not (isinstance(kwargs.get("profile"), str) and os.path.isfile(kwargs["profile"])):
            kwargs.pop("profile", None)  # a plan read elsewhere: fall back to the analytic model
        cost = cost_model_for(view.plan.mesh, PlanOptions.from_kwargs(kwargs))
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


def strategy_comm(text: str, timer: Timer, cost_s: float | None = None) -> tuple[float, list[str]]:
    """Communication a strategy description names (`all-reduce[x*y](8192B)`): seconds and readable items.

    The planner costs gradient reductions as combined (XLA merges them, so their latency is paid once);
    when the full times exceed the strategy's cost, the combined (bandwidth-only) times are the ones it used.
    """
    found = [(kind, tuple(a for a in re.split(r"[*,\s]+", axes) if a), float(nbytes))
             for kind, axes, nbytes in _COLLECTIVE_IN_TEXT.findall(text)]
    full = [timer(k, b, names) for k, names, b in found]
    combined = cost_s is not None and sum(full) > cost_s * 1.0001
    times = [timer(k, b, names, combined=True) for k, names, b in found] if combined else full
    items = [f"{k} over {'*'.join(names)} of {fmt_bytes(b)} ({fmt_time(t)}"
             + (", combined with other reductions: latency not counted)" if combined else ")")
             for (k, names, b), t in zip(found, times)]
    return sum(times), items


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


def _decision_rows(decisions: Sequence[Decision], names: Sequence[str]) -> list[tuple]:
    return [(shorten(d.label), d.ops, readable_strategy(d.chosen, names), fmt_time(d.cost_s),
             readable_strategy(d.runner_up, names), "+" + fmt_time(d.runner_up_delta_s)) for d in decisions]


def _relative(base: float, delta: float) -> str:
    if base <= 0:
        return ""
    ratio = delta / base
    return f", {ratio:.0%} more" if ratio < 10 else f", {1 + ratio:.0f}x the chosen cost"


def _explain_decision(d: Decision, view: PlanView, timer: Timer) -> str:
    names = view.axis_names
    comm, items = strategy_comm(d.chosen, timer, d.cost_s)
    if d.compute_s or d.communication_s or d.resharding_s:  # exact split recorded by the planner
        comm = d.communication_s
    _, alt_items = strategy_comm(d.runner_up, timer, d.cost_s + d.runner_up_delta_s)
    lines = [f"  {d.label}" + (f"   ({d.ops} ops share this decision)" if d.ops > 1 else "")]
    lines.append(f"    chosen     {readable_strategy(d.chosen, names)}")
    if d.compute_s or d.communication_s or d.resharding_s:
        lines.append(f"               cost {fmt_time(d.cost_s)} = compute {fmt_time(d.compute_s)} + own communication "
                     f"{fmt_time(d.communication_s)} + resharding on its edges {fmt_time(d.resharding_s)}")
    else:  # a plan saved before the split was recorded
        lines.append(f"               cost {fmt_time(d.cost_s)} = own communication {fmt_time(comm)} + compute and "
                     f"resharding on its edges {fmt_time(max(0.0, d.cost_s - comm))}")
    lines += [f"               {item}" for item in items]
    lines.append(f"    runner-up  {readable_strategy(d.runner_up, names)}")
    lines.append(f"               cost {fmt_time(d.cost_s + d.runner_up_delta_s)} (+{fmt_time(d.runner_up_delta_s)}"
                 + _relative(d.cost_s, d.runner_up_delta_s) + ")")
    lines += [f"               {item}" for item in alt_items]
    return "\n".join(lines)


def explain(view: PlanView, op: str | None = None, top: int = 15) -> str:
    """The text of `planner explain`: cost breakdown, the costliest sites, and each decision's runner-up.

    Args:
      view: the plan.
      op: only decisions and collectives whose label contains this text (case-insensitive).
      top: rows per section.
    """
    timer = collective_timer(view)
    plan = view.plan
    out = [f"Plan on mesh {view.mesh_text()}, {len(view.data.get('stages') or []) or 1} stage(s)"]
    if op is None:
        out += ["", "Cost breakdown:", cost_breakdown(view, timer)]
        sites = _sites(plan.prediction.collectives, timer)
        if sites:
            out += ["", f"Where the communication happens (top {min(top, len(sites))} of {len(sites)} ops):"]
            out.append(table(("op", "collectives", "sent/device", "time"),
                             [(shorten(w), n, fmt_bytes(b), fmt_time(t)) for w, n, b, t in sites[:top]], "lrrr"))
        ds = sorted(plan.decisions, key=lambda d: -d.cost_s)
        out += ["", f"Decisions, costliest first ({len(ds)} decisions; cost = own cost + resharding on its edges):"]
        out.append(table(("decision", "ops", "chosen", "cost", "runner-up", "extra"),
                         _decision_rows(ds[:top], view.axis_names), "lrlrlr"))
        close = sorted((d for d in plan.decisions if d.runner_up_delta_s > 0), key=lambda d: d.runner_up_delta_s)
        if close:
            out += ["", "Closest calls (the runner-up was almost as good):"]
            out.append(table(("decision", "ops", "chosen", "cost", "runner-up", "extra"),
                             _decision_rows(close[: min(top, 8)], view.axis_names), "lrlrlr"))
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
    out += [_explain_decision(d, view, timer) for d in ds[: top * 4]]
    if len(ds) > top * 4:
        out.append(f"  ... {len(ds) - top * 4} more (raise --top)")
    if cs:
        out += ["", f"Collectives at ops matching {op!r} ({len(cs)}):"]
        rows = [(shorten(c.where, 56), c.kind, "*".join(c.axes), fmt_bytes(c.nbytes), c.reason,
                 fmt_time(timer(c.kind, c.nbytes, c.axes))) for c in cs[: top * 4]]
        out.append(table(("op", "collective", "axes", "buffer", "reason", "time"), rows, "lllrlr"))
    return "\n".join(out)
