"""How two plans differ: the text of `planner diff` (headline numbers, shardings, communication,
decisions), compared from the plans' JSON forms."""
from __future__ import annotations

import math
from collections import defaultdict

from planner.configs.pins import path_tokens
from planner.present.explain import collectives_by_kind, shorten, collective_timer, readable_strategy
from planner.present.report import PlanView, collapse_layers, fmt_axes_spec, fmt_bytes, fmt_time, table


def _pct(a: float, b: float) -> str:
    return f"{(b - a) / a:+.1%}" if a else "n/a"


def diff(a: PlanView, b: PlanView, top: int = 20) -> str:
    """The text of `planner diff`: headline numbers, shardings, communication and decisions that differ."""
    out = _headline(a, b) + _input_shardings(a, b, top) + _communication(a, b) + _decisions(a, b, top)
    return "\n".join(out)


def _headline(a: PlanView, b: PlanView) -> list[str]:
    """The meshes, and the predicted step time, compute, communication and memory side by side."""
    pa, pb = a.plan.prediction, b.plan.prediction
    out = [f"A: mesh {a.mesh_text()}  {a.context.get('model', '')}".rstrip(),
           f"B: mesh {b.mesh_text()}  {b.context.get('model', '')}".rstrip(), ""]
    rows = []
    for name, x, y, fmt in (("step time", pa.step_time_s, pb.step_time_s, fmt_time),
                            ("compute", pa.compute_time_s, pb.compute_time_s, fmt_time),
                            ("communication", pa.communication_time_s, pb.communication_time_s, fmt_time),
                            ("memory / device", pa.memory_bytes_per_device, pb.memory_bytes_per_device, fmt_bytes),
                            ("bytes moved / device", pa.bytes_moved_per_device, pb.bytes_moved_per_device, fmt_bytes),
                            ("collectives", len(pa.collectives), len(pb.collectives), str)):
        delta = fmt(y - x) if fmt is not str else f"{y - x:+d}"
        rows.append((name, fmt(x), fmt(y), ("+" if y - x > 0 and fmt is not str else "") + delta, _pct(x, y)))
    out.append(table(("", "A", "B", "B - A", "change"), rows, "lrrrr"))
    if pa.step_time_s != pb.step_time_s:
        faster = "A" if pa.step_time_s < pb.step_time_s else "B"
        out.append(f"  {faster} is faster by {fmt_time(abs(pb.step_time_s - pa.step_time_s))} per step")
    if a.plan.mesh != b.plan.mesh:
        out.append("  the meshes differ; shardings are compared by mesh axis name and by shards per dimension")
    return out


def _input_shardings(a: PlanView, b: PlanView, top: int) -> list[str]:
    """The argument leaves whose shardings differ (not merely their axes' names)."""
    spec_a = dict(zip(a.plan.input_paths, a.specs))
    spec_b = dict(zip(b.plan.input_paths, b.specs))
    size_a = dict(zip(a.axis_names, a.plan.mesh.shape))
    size_b = dict(zip(b.axis_names, b.plan.mesh.shape))

    def splits(spec, sizes):
        return tuple(math.prod(sizes[x] for x in axes) for axes in spec)

    items, renamed = [], 0
    for path in list(a.plan.input_paths) + [p for p in b.plan.input_paths if p not in spec_a]:
        sa, sb = spec_a.get(path), spec_b.get(path)
        if sa == sb:
            continue
        if sa is not None and sb is not None and splits(sa, size_a) == splits(sb, size_b):
            renamed += 1  # the same number of shards per dimension, over differently named axes
            continue
        items.append((tuple(t for t in path_tokens(path, keep_value=True) if not t.isdigit()),
                      ("-" if sa is None else fmt_axes_spec(sa), "-" if sb is None else fmt_axes_spec(sb))))
    out = [""]
    if items:
        rows = [(("/".join((layer, leaf)) if layer != "-" else leaf), f"x{n}" if n > 1 else "", *c)
                for layer, leaf, n, c in collapse_layers(items)]
        out.append(f"Input shardings that differ ({len(items)} of {len(spec_a)} leaves):")
        out.append(table(("leaf", "count", "A", "B"), rows[:top]))
        if len(rows) > top:
            out.append(f"  ... {len(rows) - top} more rows")
    else:
        out.append("Input shardings: identical" if not renamed else "Input shardings: equivalent")
    if renamed:
        out.append(f"  {renamed}{' more' if items else ''} leaves are split into the same number of shards per "
                   "dimension, over differently named mesh axes")
    return out


def _communication(a: PlanView, b: PlanView) -> list[str]:
    """Count, bytes and time of each kind of collective in both plans."""
    pa, pb = a.plan.prediction, b.plan.prediction
    ta, tb = collective_timer(a), collective_timer(b)
    ka, kb = collectives_by_kind(pa.collectives, ta), collectives_by_kind(pb.collectives, tb)
    kinds = sorted(set(ka) | set(kb))
    if not kinds:
        return []
    zero = [0, 0.0, 0.0, 0.0]
    rows = [(k, f"{int(ka.get(k, zero)[0])} -> {int(kb.get(k, zero)[0])}",
             f"{fmt_bytes(ka.get(k, zero)[2])} -> {fmt_bytes(kb.get(k, zero)[2])}",
             f"{fmt_time(ka.get(k, zero)[3])} -> {fmt_time(kb.get(k, zero)[3])}") for k in kinds]
    return ["", "Communication by collective (A -> B):", table(("collective", "count", "sent/device", "time"), rows,
                                                                 "lrrr")]


def _keyed(decisions) -> dict:
    """(label, occurrence of that label) -> decision."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for d in decisions:
        out[(d.label, seen[d.label])] = d
        seen[d.label] += 1
    return out


def _decisions(a: PlanView, b: PlanView, top: int) -> list[str]:
    """The decisions the two plans make differently, the costliest difference first."""
    da, db = _keyed(a.plan.decisions), _keyed(b.plan.decisions)
    changed = []
    for key in da.keys() & db.keys():
        x, y = da[key], db[key]
        cx, cy = readable_strategy(x.chosen, a.axis_names), readable_strategy(y.chosen, b.axis_names)
        if cx != cy:
            changed.append((y.cost_s - x.cost_s, x, y, cx, cy))
    changed.sort(key=lambda r: -abs(r[0]))
    out = [""]
    if changed:
        out.append(f"Decisions that differ ({len(changed)}; local cost = own cost + resharding on its edges):")
        rows = [(shorten(x.label, 56), cx, fmt_time(x.cost_s), cy, fmt_time(y.cost_s), ("+" if dt > 0 else "") + fmt_time(dt))
                for dt, x, y, cx, cy in changed[:top]]
        out.append(table(("decision", "A chose", "A cost", "B chose", "B cost", "B - A"), rows, "llrlrr"))
        if len(changed) > top:
            out.append(f"  ... {len(changed) - top} more")
        same = sum(1 for dt, *_ in changed if abs(dt) <= 1e-12)
        if same:
            out.append(f"  {same} of them cost the same in both plans")
    else:
        out.append("Decisions: the same choices" if da.keys() == db.keys() else "Decisions: not comparable "
                   "(different programs or meshes)")
    only = len(da.keys() ^ db.keys())
    if only and changed:
        out.append(f"  {only} decisions exist in only one plan")
    return out
