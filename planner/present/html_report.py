"""A plan as one self-contained HTML page: mesh diagram, pipeline timeline, memory, communication.

Pictures are drawn with matplotlib's object API (`matplotlib.figure.Figure`, no pyplot state) and
embedded as base64 PNGs, styles are inline, so the page opens anywhere without a network.
"""
from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from planner.cost_model import ring_bytes
from planner.core.layer_index import split_indexed
from planner.core.pipeline_records import PipelineFacts, PipelineStage
from planner.present.compare import HEADERS, record_cells
from planner.present.explain import cost_breakdown
from planner.present.report import (
    PlanView,
    fmt_bytes,
    fmt_pct,
    fmt_time,
    format_header,
    format_levers,
    format_layer_table,
    format_ranking,
    format_rules,
    memory_breakdown,
    mfu,
)
from planner.stages.schedule import simulate as simulate_schedule
from planner.stages.schedule import stage_tasks

_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
_KIND_COLORS = {"all-reduce": "#C44E52", "all-gather": "#4C72B0", "reduce-scatter": "#55A868",
                "all-to-all": "#8172B3", "collective-permute": "#937860"}


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _axis_roles(view: PlanView) -> dict[str, str]:
    """Mesh axis -> what it splits: logical names of parameter / data dims, then optimizer state."""
    from collections import Counter

    used: dict[str, Counter] = {n: Counter() for n in view.axis_names}
    opt: dict[str, Counter] = {n: Counter() for n in view.axis_names}
    for leaf in view.leaves or ():
        if leaf.role not in ("param", "data", "opt_state"):
            continue
        for name, axes in zip(leaf.names, leaf.spec):
            for a in axes:
                (opt if leaf.role == "opt_state" else used)[a][name or "unnamed dims"] += leaf.nbytes
    out = {}
    for a in view.axis_names:
        text = ", ".join(n for n, _ in used[a].most_common(4))
        extra = [n for n, _ in opt[a].most_common(4) if n not in used[a]]
        if extra:
            text += ("; " if text else "") + "optimizer state (" + ", ".join(extra) + ")"
        out[a] = text or ("activations only" if view.leaves is not None else "?")
    return out


# ----- pictures --------------------------------------------------------------------------------
def mesh_figure(view: PlanView):
    """Devices on the logical mesh, coloured by host, with each axis's size and logical names."""
    shape = tuple(view.plan.mesh.shape)
    n = math.prod(shape)
    if len(shape) == 1:
        cols = min(n, 16)
        rows = math.ceil(n / cols)
    else:
        rows, cols = shape[0], n // shape[0]
    cluster = view.context.get("cluster") or {}
    per_host = cluster.get("devices_per_host") or n
    roles = _axis_roles(view)
    inter = set(view.context.get("inter_host_axes", ()))
    cell = 0.55 if cols <= 16 else 0.35
    fig = _figure(min(11.5, 2.5 + cols * cell), 1.9 + rows * cell)
    ax = fig.add_subplot()
    for d in range(n):
        r, c = divmod(d, cols)
        host = d // per_host
        ax.add_patch(_rect(c, rows - 1 - r, _COLORS[host % len(_COLORS)]))
        if cols <= 32:
            ax.text(c + 0.5, rows - 0.5 - r, str(d), ha="center", va="center", fontsize=7 if cols > 16 else 9,
                    color="white")
    ax.set_xlim(-0.2, cols + 0.2)
    ax.set_ylim(-0.9, rows + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    names = view.axis_names

    def label(i: int) -> str:
        role = roles.get(names[i], "?")
        return f"{names[i]} = {shape[i]}" + (" (crosses hosts)" if i in inter else "") + f": {role}"

    if len(shape) == 1:
        ax.annotate("", (cols, -0.45), (0, -0.45), arrowprops={"arrowstyle": "->"})
        ax.text(cols / 2, -0.8, label(0), ha="center", va="center", fontsize=10)
    else:
        ax.annotate("", (cols, -0.45), (0, -0.45), arrowprops={"arrowstyle": "->"})
        minor = "; ".join(label(i) for i in range(1, len(shape)))
        ax.text(cols / 2, -0.8, minor, ha="center", va="center", fontsize=10)
        ax.set_title(f"rows: {label(0)}", fontsize=10, loc="left")
    hosts = math.ceil(n / per_host)
    ax.set_xlabel("")
    fig.suptitle(f"mesh {view.plan.mesh}: {n} devices" + (f" on {hosts} hosts (colour = host)" if hosts > 1 else ""),
                 fontsize=11)
    return fig


def _rect(x: float, y: float, color: str):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x + 0.06, y + 0.06), 0.88, 0.88, boxstyle="round,pad=0,rounding_size=0.12",
                          facecolor=color, edgecolor="white")


def schedule(stages: int, microbatches: int, kind: str = "1f1b") -> list[list[tuple[str, int]]]:
    """Per stage, the order of ("F" | "B", microbatch) a 1F1B or GPipe pipeline runs (`stage_tasks`)."""
    return [list(tasks) for tasks in stage_tasks(kind, stages, microbatches)]


def simulate(order: Sequence[Sequence[tuple[str, int]]], forward_s: Sequence[float]) -> list[list[tuple[str, int, float, float]]]:
    """Per stage, (kind, microbatch, start, end) of every task, as the runtime's schedule simulation
    starts them; a backward takes twice its forward."""
    backward_s = [2 * t for t in forward_s]
    _, events = simulate_schedule(order, forward_s, backward_s)
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in order]
    for start, s, (kind, m) in events:
        out[s].append((kind, m, start, start + (forward_s[s] if kind == "F" else backward_s[s])))
    return out


def _time_unit(seconds: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return scale, unit
    return 1e-9, "ns"


def pipeline_figure(view: PlanView):
    """Timeline of one step: a 1F1B / GPipe Gantt chart over the stages, or compute then communication."""
    p = view.plan.prediction
    stages = view.plan.stages
    if len(stages) <= 1:
        fig = _figure(11, 2.2)
        ax = fig.add_subplot()
        scale, unit = _time_unit(max(p.step_time_s, 1e-12))
        ax.barh(0, p.compute_time_s / scale, color="#4C72B0", label=f"compute {fmt_time(p.compute_time_s)}")
        ax.barh(0, p.communication_time_s / scale, left=p.compute_time_s / scale, color="#DD8452",
                label=f"communication {fmt_time(p.communication_time_s)}")
        ax.set_yticks([0], ["stage 0\n(whole mesh)"])
        ax.set_xlabel(unit)
        fig.legend(loc="outside lower center", ncol=2, fontsize=9, frameon=False)
        ax.set_title(f"one step, no pipeline: {fmt_time(p.step_time_s)}", fontsize=11)
        return fig
    options, chosen = view.plan.options, view.plan.pipeline or PipelineFacts()
    # the microbatch count the plan chose (options hold only a user's fixed count, None for "choose")
    k = int(chosen.num_microbatches or options.num_microbatches or 2 * len(stages))
    kind = chosen.schedule or options.schedule
    # the stages drawn equally long: the step's time over the schedule's k + S - 1 slots of forward + backward
    times = [p.step_time_s / (3 * (k + len(stages) - 1))] * len(stages)
    tasks = simulate(schedule(len(stages), k, kind), times)
    fig = _figure(11, 1.2 + 0.5 * len(stages))
    ax = fig.add_subplot()
    scale, unit = _time_unit(max(end for row in tasks for *_, end in row))
    for s, row in enumerate(tasks):
        for what, m, start, end in row:
            start, end = start / scale, end / scale
            ax.barh(s, end - start, left=start, color=_COLORS[m % len(_COLORS)],
                    alpha=1.0 if what == "F" else 0.55, edgecolor="white")
            if len(tasks[0]) <= 48:
                ax.text((start + end) / 2, s, f"{what}{m}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(stages)), [f"stage {i}\n{_submesh_text(st)}" for i, st in enumerate(stages)])
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} (F = forward, B = backward, colour = microbatch)")
    ax.set_title(f"{kind} schedule, {len(stages)} stages x {k} microbatches", fontsize=11)
    return fig


def _submesh_text(stage: PipelineStage) -> str:
    return "x".join(str(x) for x in stage.submesh) if stage.submesh is not None else ""


def memory_figure(view: PlanView):
    """Per-device memory (per stage where the plan has stages) as stacked bars against the budget."""
    budget = view.budget()
    parts = memory_breakdown(view)
    stages = view.plan.stages
    rows: list[tuple[str, dict[str, float]]] = []
    if len(stages) > 1:
        for i, st in enumerate(stages):
            m = st.memory_bytes_per_device
            rows.append((f"stage {i}", {"peak": float(m if m is not None else view.plan.prediction.memory_bytes_per_device)}))
    else:
        rows.append(("every device", parts or {"peak": float(view.plan.prediction.memory_bytes_per_device)}))
    fig = _figure(11, 1.7 + 0.55 * len(rows))
    ax = fig.add_subplot()
    colors = {"parameters": "#4C72B0", "optimizer state": "#8172B3", "data": "#55A868",
              "activations and temporaries": "#DD8452", "peak": "#4C72B0"}
    seen = set()
    for y, (name, comp) in enumerate(rows):
        left = 0.0
        for k, v in comp.items():
            ax.barh(y, v / 1e9, left=left / 1e9, color=colors.get(k, "#8C8C8C"), label=None if k in seen else k)
            seen.add(k)
            left += v
        share = f" ({left / budget:.2g} of the budget)" if budget and left < 0.1 * budget else ""
        ax.text(left / 1e9, y, f" {fmt_bytes(left)}{share}", va="center", fontsize=9)
    if budget:
        ax.axvline(budget / 1e9, color="#C44E52", linestyle="--", label=f"budget {fmt_bytes(budget)}")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("GB per device")
    fig.legend(loc="outside lower center", ncol=5, fontsize=9, frameon=False)
    ax.set_title("per-device memory (predicted peak) against the budget", fontsize=11)
    return fig


def layer_of(where: str) -> str:
    """The layer of an op label such as `dot_general transpose(jvp(GPT))/blocks_3/mlp/fc_in` -> `blocks_3`."""
    stack = where.split(" ", 1)[1] if " " in where else where
    tokens = [t for t in stack.split("/")[1:] if t]
    for t in tokens:
        if split_indexed(t):
            return t
    return tokens[0] if tokens else "(no module)"


def _layer_sort_key(name: str):
    m = split_indexed(name)
    return (0, *m) if m else (1, name, 0)


def communication_by_layer(view: PlanView) -> dict[str, dict[str, float]]:
    """Layer -> collective kind -> bytes each device sends per step."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in view.plan.prediction.collectives:
        out[layer_of(c.where)][c.kind] += ring_bytes(c.kind, c.nbytes, c.group_size)
    return {k: dict(v) for k, v in sorted(out.items(), key=lambda kv: _layer_sort_key(kv[0]))}


def communication_figure(view: PlanView):
    by_layer = communication_by_layer(view)
    fig = _figure(11, 3.6)
    ax = fig.add_subplot()
    if not by_layer:
        ax.text(0.5, 0.5, "no communication: every op runs on local shards", ha="center", va="center", fontsize=12)
        ax.axis("off")
        return fig
    layers = list(by_layer)
    kinds = sorted({k for v in by_layer.values() for k in v})
    bottom = [0.0] * len(layers)
    for kind in kinds:
        vals = [by_layer[layer].get(kind, 0.0) / 1e6 for layer in layers]
        ax.bar(range(len(layers)), vals, bottom=bottom, color=_KIND_COLORS.get(kind, "#8C8C8C"), label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(layers)), layers, rotation=60 if len(layers) > 8 else 0, ha="right" if len(layers) > 8 else "center",
                  fontsize=8)
    ax.set_ylabel("MB sent per device")
    ax.legend(fontsize=9)
    ax.set_title("communication per layer and step (forward and backward)", fontsize=11)
    return fig


# ----- the page --------------------------------------------------------------------------------
_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222;
       background: #fff; max-width: 1150px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin-top: 0; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin: 16px 0; }
.card { background: #f3f6fb; border-left: 4px solid #4C72B0; padding: 10px 14px; min-width: 150px; }
.card .v { font-size: 20px; font-weight: 600; } .card .k { font-size: 12px; color: #555; }
pre { background: #f7f7f7; padding: 10px; overflow-x: auto; font-size: 12px; line-height: 1.35; }
img { max-width: 100%; border: 1px solid #eee; }
table.comparison { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
table.comparison caption { text-align: left; color: #555; padding-bottom: 4px; }
table.comparison th, table.comparison td { border: 1px solid #ddd; padding: 4px 8px; text-align: right; }
table.comparison td:first-child, table.comparison th:first-child { text-align: left; }
"""


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{html.escape(value)}</div><div class="k">{html.escape(key)}</div></div>'


def _signed(value: float, fmt) -> str:
    return ("+" if value > 0 else "-" if value < 0 else "") + fmt(abs(value))


def comparison_html(record: Mapping[str, Any]) -> str:
    """`planner compare`'s table (`present.compare.comparison_record`) as an HTML table with the
    differences from the plan beside each figure, then the places that make the difference."""
    head = (*HEADERS[:3], "step vs plan", *HEADERS[3:5], "memory vs plan", HEADERS[5], "bytes vs plan", HEADERS[6])
    rows = []
    for cells, r in zip(record_cells(record), record["rows"]):
        dt, dm, db = r["step_time_vs_plan_s"], r["memory_vs_plan_bytes"], r["bytes_moved_vs_plan"]
        row = (*cells[:3], _signed(dt, fmt_time), *cells[3:5], _signed(dm, fmt_bytes), cells[5],
               _signed(db, fmt_bytes), cells[6])
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    caption = (f"mesh {record['mesh']} ({', '.join(record['axis_names'])}); one cost model for every row "
               "(predicted, per device)")
    return (f'<table class="comparison"><caption>{html.escape(caption)}</caption><tr>'
            + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
            + f"<pre>{html.escape(chr(10).join(record['notes']))}</pre>")


def render_html(view: PlanView) -> str:
    """The whole page as one string."""
    p, ctx = view.plan.prediction, view.context
    budget = view.budget()
    title = f"Plan for {ctx.get('model', 'program')} on {ctx.get('cluster_text') or str(view.plan.mesh.size) + ' devices'}"
    m = mfu(ctx.get("model_flops"), ctx.get("hardware"), p.step_time_s, view.plan.mesh.size)
    cards = [
        _card(str(view.plan.mesh), "mesh " + ", ".join(f"{n}={s}" for n, s in zip(view.axis_names, view.plan.mesh.shape))),
        _card(fmt_time(p.step_time_s), "predicted step time"),
        _card(fmt_bytes(p.memory_bytes_per_device), "memory per device" + (f" of {fmt_bytes(budget)}" if budget else "")),
        _card(fmt_bytes(p.bytes_moved_per_device), "sent per device per step"),
    ]
    if m is not None:
        cards.append(_card(fmt_pct(m), "model FLOP utilisation"))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">hardware {html.escape(str((ctx.get("hardware") or {}).get("name", "default")))}; '
        f"planned by the JAX auto-parallel planner</p>",
        '<div class="cards">' + "".join(cards) + "</div>",
    ]
    figures = (("Mesh and axis assignments", mesh_figure), ("Pipeline schedule", pipeline_figure),
               ("Memory per device", memory_figure), ("Communication per layer", communication_figure))
    for heading, draw in figures:
        fig = draw(view)
        parts.append(f"<h2>{heading}</h2>")
        parts.append(f'<img alt="{html.escape(heading)}" src="data:image/png;base64,{_png(fig)}">')
    comparison = ctx.get("comparison")
    if comparison:
        parts += ["<h2>Beside hand configurations</h2>", comparison_html(comparison)]
    ranking = ctx.get("ranking") or []
    if len(ranking) > 1:
        parts += ["<h2>Mesh shapes, best first</h2>", f"<pre>{html.escape(format_ranking(ranking, budget))}</pre>"]
    levers = format_levers(view.plan)
    if levers:
        parts += ["<h2>Memory levers</h2>", f"<pre>{html.escape(levers)}</pre>"]
    parts += ["<h2>Plan</h2>", f"<pre>{html.escape(format_header(view))}</pre>",
              "<h2>Where the time goes</h2>", f"<pre>{html.escape(cost_breakdown(view))}</pre>",
              "<h2>Per-layer shardings</h2>", f"<pre>{html.escape(format_layer_table(view))}</pre>",
              "<h2>Logical axis rules (t5x / MaxText)</h2>", f"<pre>{html.escape(format_rules(view))}</pre>",
              "</body></html>"]
    return "\n".join(parts)
