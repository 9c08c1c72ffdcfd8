"""Plans as text: the ranked mesh table, the per-layer sharding table, logical axis rules.

Everything here reads the plan's JSON form (`Plan.to_dict()`, optionally with the `context` block
the command line adds: input shapes, model FLOPs, hardware, the mesh ranking), loaded back through
the plan's records (`PlanView.plan`), so a plan printed right after planning and one re-read from a
file with `planner plan --from` look the same.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from planner.configs.pins import path_tokens
from planner.core.errors import InvalidArgumentError
from planner.core.layer_index import split_indexed
from planner.core.pipeline_records import PipelineFacts, stage_way
from planner.core.plan import Plan
from planner.core.plan_records import solver_quality as _solver_quality
from planner.core.units import format_bytes, format_seconds as fmt_time
from planner.cost_model import peak_flops
from planner.ilp.levers import LEVERS
from planner.present.wire_text import wire_line
from planner.present.logical_axes import Axes, AxisRules, Leaf, classify, infer_rules
from planner.present.topology_view import maxtext_mesh, topology_line
from planner.stages.clustering import stacked_note



# ----- numbers ---------------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    """Decimal units, as memory budgets are written (`--memory-budget 80GB`); the same as `Plan.summary`."""
    return format_bytes(n)


def fmt_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def fmt_pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if x >= 0.001 else f"{x * 100:.2g}%"


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def fmt_shape(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def fmt_axes_spec(spec: Sequence[Axes]) -> str:
    """`P(x, None, (x,y))`-style text from mesh axis names per dimension."""
    parts = ["None" if not axes else axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")" for axes in spec]
    return "P(" + ", ".join(parts) + ")"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None, indent: str = "  ") -> str:
    """A plain monospace table; `align` has one 'l' or 'r' per column."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" * len(headers)

    def line(r):
        return indent + "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip()

    out = [line(cells[0]), indent + "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


# ----- the plan record -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanView:
    """A plan's JSON form, checked by `Plan.from_json`, with the derived facts every view needs.

    Attributes:
      data: the JSON dict (plan keys plus an optional `context` block).
      plan: the loaded `Plan`.
      axis_names: mesh axis names in mesh order.
      specs: mesh axis names splitting each dimension of each input leaf.
      leaves: inputs classified with logical names (None when the JSON has no input shapes).
      rules: logical axis rules read off the plan (None without shapes).
    """

    data: Mapping[str, Any]
    plan: Plan
    axis_names: tuple[str, ...]
    specs: tuple[tuple[Axes, ...], ...]
    leaves: tuple[Leaf, ...] | None
    rules: AxisRules | None

    @property
    def context(self) -> Mapping[str, Any]:
        return self.data.get("context") or {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanView:
        plan = Plan.from_dict(data)  # the JSON form itself: `load` reads it from a file, `plan_view` makes it
        names = plan.mesh.axis_names
        specs = tuple(tuple(tuple(names[a] for a in axes) for axes in spec) for spec in plan.input_specs)
        ctx = data.get("context") or {}
        shapes, dtypes = ctx.get("input_shapes"), ctx.get("input_dtypes")
        leaves = rules = None
        if shapes is not None and dtypes is not None and len(shapes) == len(specs):
            leaves = classify(plan.input_paths, [tuple(s) for s in shapes], dtypes, specs)
            rules = infer_rules(leaves)
        return cls(data, plan, names, specs, leaves, rules)

    @classmethod
    def load(cls, path: str) -> PlanView:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read plan file {path!r}: {e.strerror}; pass a file written by "
                                       "`planner plan --json FILE`") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"plan file {path!r} is not JSON ({e.msg} at line {e.lineno}); pass a file "
                                       "written by `planner plan --json FILE`") from None
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"plan file {path!r} holds a {type(data).__name__}, not a plan object")
        return cls.from_dict(data)

    def mesh_text(self) -> str:
        inter = set(self.context.get("inter_host_axes", self.plan.options.inter_host_axes))
        parts = [f"{n}={s}" + ("*" if i in inter else "") for i, (n, s) in enumerate(zip(self.axis_names, self.plan.mesh.shape))]
        return f"{self.plan.mesh} ({', '.join(parts)})"

    def budget(self) -> float | None:
        ctx_budget = self.context.get("memory_budget_bytes")
        return ctx_budget if ctx_budget is not None else self.plan.options.memory_budget


# ----- per-device memory by kind of leaf --------------------------------------------------------
def leaf_bytes_per_device(leaf: Leaf, mesh_sizes: Mapping[str, int]) -> float:
    """A leaf's bytes on one device: its bytes (from its dtype's name) over its shards, unrounded."""
    shards = math.prod(mesh_sizes[a] for axes in leaf.spec for a in axes)
    return leaf.nbytes / shards


def memory_breakdown(view: PlanView) -> dict[str, float] | None:
    """Per-device bytes of parameters, optimizer state and data, and the rest of the predicted peak."""
    if view.leaves is None:
        return None
    sizes = dict(zip(view.axis_names, view.plan.mesh.shape))
    out = {"parameters": 0.0, "optimizer state": 0.0, "data": 0.0}
    for leaf in view.leaves:
        kind = {"param": "parameters", "data": "data"}.get(leaf.role, "optimizer state")
        out[kind] += leaf_bytes_per_device(leaf, sizes)
    peak = view.plan.prediction.memory_bytes_per_device
    out["activations and temporaries"] = max(0.0, peak - sum(out.values()))
    return out


def display_tokens(leaf: Leaf) -> tuple[str, ...]:
    """Path tokens to show: the parameter path, `data/...`, `opt_state/mu/...`, without argument indices."""
    if leaf.role == "param":
        return leaf.key
    tokens = tuple(t for t in path_tokens(leaf.path, keep_value=True) if not t.isdigit())
    return ("data",) + tokens if leaf.role == "data" else tokens


# ----- per-layer table -------------------------------------------------------------------------
def _ranges(indices: Sequence[int]) -> str:
    out, start, prev = [], None, None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def collapse_layers(items: Sequence[tuple[tuple[str, ...], tuple[str, ...]]]) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """Collapses repeated identical layers.

    Args:
      items: (path tokens, row cells) per leaf, in order.

    Returns:
      (layer label, leaf label, layer count, cells) rows. Layers are the first path token of the
      form `name_N`; layers with the same set of (leaf, cells) rows become one row group labelled
      `name_[0-11]` with a count.
    """
    groups: dict[tuple, dict[int, list]] = {}
    singles: list = []
    order: list = []
    for tokens, cells in items:
        at = next((i for i, t in enumerate(tokens) if split_indexed(t)), None)
        if at is None:
            label = "/".join(tokens[:-1]) or "-"
            order.append(("single", len(singles)))
            singles.append((label, tokens[-1] if tokens else "-", 1, cells))
            continue
        base, index = split_indexed(tokens[at])
        key = (tokens[:at], base)
        if key not in groups:
            groups[key] = {}
            order.append(("group", key))
        groups[key].setdefault(index, []).append(("/".join(tokens[at + 1:]), cells))
    rows = []
    for kind, ref in order:
        if kind == "single":
            rows.append(singles[ref])
            continue
        prefix, base = ref
        by_sig: dict[tuple, list[int]] = {}
        for idx, members in groups[ref].items():
            by_sig.setdefault(tuple(members), []).append(idx)
        for sig, idxs in sorted(by_sig.items(), key=lambda kv: min(kv[1])):
            label = "/".join(prefix + (f"{base}_{idxs[0]}" if len(idxs) == 1 else f"{base}_[{_ranges(idxs)}]",))
            for leaf, cells in sig:
                rows.append((label, leaf, len(idxs), cells))
    return rows


def format_layer_table(view: PlanView, max_rows: int = 60) -> str:
    """Per-layer PartitionSpecs of the parameters (and of data and diverging optimizer state)."""
    lines = []
    if view.leaves is None:
        items = [(path_tokens(p, keep_value=True), (fmt_axes_spec(s),))
                 for p, s in zip(view.plan.input_paths, view.specs)]
        rows = collapse_layers(items)
        body = [(layer, leaf, f"x{n}" if n > 1 else "", *cells) for layer, leaf, n, cells in rows]
        lines.append(table(("layer", "leaf", "count", "spec"), body[:max_rows]))
        if len(body) > max_rows:
            lines.append(f"  ... {len(body) - max_rows} more rows")
        return "\n".join(lines)

    def rows_for(leaves: Sequence[Leaf], tokens_of) -> list:
        items = [(tokens_of(leaf), (fmt_shape(leaf.shape), ", ".join(n or "-" for n in leaf.names),
                                    fmt_axes_spec(leaf.spec))) for leaf in leaves]
        return [(layer, leaf, f"x{n}" if n > 1 else "", *cells) for layer, leaf, n, cells in collapse_layers(items)]

    headers = ("layer", "parameter", "count", "shape", "logical", "spec")
    params = [leaf for leaf in view.leaves if leaf.role == "param"]
    body = rows_for(params, display_tokens)
    data = [leaf for leaf in view.leaves if leaf.role == "data"]
    body += rows_for(data, display_tokens)
    param_spec = {leaf.key: leaf.spec for leaf in params}
    differ = [leaf for leaf in view.leaves if leaf.role == "opt_state" and param_spec.get(leaf.key) != leaf.spec]
    body += rows_for(differ, display_tokens)
    lines.append(table(headers, body[:max_rows], "lllrll"))
    if len(body) > max_rows:
        lines.append(f"  ... {len(body) - max_rows} more rows (all leaves: --json FILE)")
    if view.rules is not None:
        lines.append(f"  optimizer state: {view.rules.optimizer}")
    return "\n".join(lines)


def format_rules(view: PlanView, max_exceptions: int = 8) -> str:
    """The plan as logical axis rules, ready to paste into a t5x / flax or MaxText config."""
    if view.rules is None:
        return "  (logical axis rules need the input shapes; re-plan with `planner plan --json FILE`)"
    r = view.rules
    mesh = ", ".join(f"{n!r}" for n in view.axis_names)
    shape = ", ".join(str(s) for s in view.plan.mesh.shape)
    lines = [f"  # mesh_axes = [{mesh}]  with sizes ({shape})", "  # t5x / flax (nn.logical_axis_rules):"]
    lines += ["  " + line for line in r.as_python().splitlines()]
    lines += ["  # MaxText (YAML):", "  " + r.as_yaml()]
    lines.append(f"  the rules reproduce the planned spec of {r.coverage:.0%} of parameter and data bytes")
    if r.exceptions:
        by_path = {leaf.path: leaf for leaf in view.leaves or ()}
        items = [(display_tokens(by_path[p]) if p in by_path else path_tokens(p, keep_value=True),
                  (", ".join(n or "-" for n in names), fmt_axes_spec(s), fmt_axes_spec(b)))
                 for p, names, s, b in r.exceptions]
        rows = [(("/".join((layer, leaf)) if layer != "-" else leaf), f"x{n}" if n > 1 else "", *c)
                for layer, leaf, n, c in collapse_layers(items)]
        lines.append("  exceptions (override these explicitly):")
        lines.append(table(("leaf", "count", "logical", "planned", "rules give"), rows[:max_exceptions], indent="    "))
        if len(rows) > max_exceptions:
            lines.append(f"    ... {len(rows) - max_exceptions} more")
    return "\n".join(lines)


# ----- the ranking and the header ---------------------------------------------------------------
def mfu(model_flops: Mapping[str, float] | None, hardware: Mapping[str, float] | None, step_time_s: float,
        devices: int) -> float | None:
    """Model FLOP utilisation: ideal time of the model's matmul FLOPs at peak over the predicted time.

    `model_flops` maps operand dtype name -> FLOPs per step, priced at `cost_model.peak_flops` (the
    rule the plan's prediction uses).
    """
    if not model_flops or not hardware or step_time_s <= 0:
        return None
    ideal = sum(f / peak_flops(hardware, (dt,)) for dt, f in model_flops.items())
    return ideal / (step_time_s * devices)


def format_ranking(rows: Sequence[Mapping[str, Any]], budget: float | None, top: int | None = None) -> str:
    """The ranked table of candidate meshes (rows as stored in the plan's context)."""
    shown = list(rows)[:top] if top else list(rows)
    body = []
    rank = 0
    for r in shown:
        if r["status"] != "ok":
            body.append(("-", r["mesh"], r.get("axes", ""), "-", "-",
                         "-" if r.get("memory_bytes_per_device") is None else fmt_bytes(r["memory_bytes_per_device"]),
                         "-", "-", "-", r["status"] + (f": {r['note']}" if r.get("note") else "")))
            continue
        rank += 1
        mem = r["memory_bytes_per_device"]
        frac = f"{mem / budget:.0%}" if budget else "-"
        body.append((rank, r["mesh"], r.get("axes", ""), r.get("stages", 1), fmt_time(r["step_time_s"]), fmt_bytes(mem),
                     frac, fmt_bytes(r["bytes_moved_per_device"]),
                     fmt_pct(r.get("mfu")), r.get("note", "")))
    out = table(("#", "mesh", "axes", "stages", "step time", "memory/dev", "of budget", "moved/dev", "MFU", "note"),
                body, "rllrrrrrrl")
    if top and len(rows) > top:
        out += f"\n  ... {len(rows) - top} more (--top {len(rows)})"
    return out


# The single-stage levers (`ilp.levers.LEVERS`) by their plan.levers key ("donate": the options'
# donate_argnums); pipeline stages are another search (`--pipeline`).
_LEVER_KEYS = {"rematerialisation": "remat", "host offload": "offload", "gradient accumulation": "accumulation",
               "donating the train state": "donate"}


def _automatic(options) -> set[str]:
    """The plan.levers keys of the levers `options` leave to the planner (`planning.composition`)."""
    out = set()
    if options.remat == "auto":
        out.add("remat")
    if options.offload in (None, "auto"):
        out.add("offload")
    if options.accumulate is None or options.accumulate == "auto":
        out.add("accumulation")
    return out


def format_budget_cost(plan) -> str:
    """What fitting the memory budget cost, when it bound the solve: the first solver round's plan
    (no constraint on live memory, though without the strategies the memory bound rules out, said
    when there are some: its step time and peak) against the plan, and the levers not tried (a
    lever with a record in `plan.levers` was, whether or not the plan uses it); empty otherwise."""
    record = plan.solver.unbudgeted
    if record is None:
        return ""
    tried = set(plan.levers.names()) | ({"donate"} if plan.options.donate_argnums else set())
    step = plan.prediction.step_time_s
    ruled_out = record.strategies_ruled_out
    before = (f"With the {ruled_out} strategies that cannot fit it ruled out (the memory lower bound) but no "
              "constraint on live memory yet" if ruled_out else "Before any memory constraint")
    text = (f"Memory budget: it binds. {before}, the solver's plan took {fmt_time(record.step_time_s)}/step "
            f"with a {fmt_bytes(record.peak_bytes)} peak; fitting the budget makes the step "
            f"{step / record.step_time_s:.3g}x that ({fmt_time(step)}).")
    auto = _automatic(plan.options)  # levers the planner weighs itself: not "not tried" when it did not need them
    untried = [f"{v.name}: {v.how}" for v in LEVERS
               if v.name in _LEVER_KEYS and _LEVER_KEYS[v.name] not in tried and _LEVER_KEYS[v.name] not in auto]
    if untried:
        text += f" Levers not tried: {'; '.join(untried)}."
    return text


def _without(record) -> str:
    """What a lever buys: the plan without it that the planner weighed (`without_*` of its record;
    empty when none was)."""
    if record.without_fits is None:
        return ""
    if not record.without_fits:
        return "; without it no plan fits the budget" + (
            f" (smallest peak found {fmt_bytes(record.without_memory_bytes)})" if record.without_memory_bytes else "")
    return (f"; without it: {record.without_step_time_s:.4g} s/step at "
            f"{fmt_bytes(record.without_memory_bytes)}/device (slower)")


def format_levers(plan) -> str:
    """The levers the plan uses (gradient accumulation and selective unsharding, recomputation,
    host offload, prefetch), a paragraph each, after what the budget cost when it bound
    (`format_budget_cost`); empty when neither applies."""
    paras = [cost] if (cost := format_budget_cost(plan)) else []
    record = plan.levers.accumulation
    if record is not None and record.microbatches > 1:
        lines = [f"Gradient accumulation: {record.microbatches} microbatches of {record.microbatch_rows} rows "
                 "per step (the planned shapes are one microbatch's)" + _without(record)]
        once, every = record.unsharded or (), record.resharded_per_microbatch or ()
        if once or every:
            lines.append(f"Selective unsharding: {len(once)} value(s) resharded once per step before the microbatch "
                         f"loop ({fmt_bytes(sum(h.bytes for h in once))}/device held, "
                         f"{sum(h.saved_s for h in once):.4g} s/step saved), {len(every)} argument(s) resharded "
                         "in every microbatch")
            lines += [f"  once: {h.value}  ({fmt_bytes(h.bytes)}, {h.saved_s:.3g} s saved)" for h in once[:8]]
            if len(once) > 8:
                lines.append(f"  ... and {len(once) - 8} more")
        paras.append("\n".join(lines))
    remat = plan.levers.remat
    if remat is not None and (remat.policy != "off" or remat.without_fits is not None):
        layers = remat.layers
        paras.append(f"Recomputation: {remat.policy}" + (
            f", {len(layers)} of {len(layers) if remat.recomputable is None else remat.recomputable} layers "
            f"({'..'.join(dict.fromkeys((layers[0], layers[-1])))}), "
            f"{remat.recomputed_ops} ops recomputed in the backward" if layers else
            f", {remat.scans} scanned stack(s) of layers recomputed in the backward scan"
            + (f" (the first {remat.scan_layers} layers of each)" if remat.scan_layers else "") if remat.scans else
            " (the plan fits without it)") + _without(remat))
    offload = plan.levers.offload
    if offload is not None:
        paras.append(f"Host offload ({offload.mode}): {len(offload.inputs)} of {offload.candidates} "
                     f"optimizer-state leaves in host memory"
                     + (f" ({offload.params} master parameters, copied in for their casts too)"
                        if offload.params else "")
                     + f", {fmt_bytes(offload.host_bytes_per_device)}/device; "
                     f"copies in {offload.copy_in_s:.3g} s ({offload.hidden_s:.3g} s hidden), back "
                     f"{offload.copy_back_s:.3g} s" + _without(offload))
    prefetch = plan.levers.prefetch
    if prefetch is not None:
        paras.append("Prefetch: parameter all-gathers (argument reshardings) issued ahead of their use, behind "
                     "earlier compute (XLA's latency-hiding scheduler, `Plan.xla_flags()`)" + _without(prefetch))
    return "\n\n".join(paras)


def format_header(view: PlanView) -> str:
    p, ctx = view.plan.prediction, view.context
    budget = view.budget()
    hw = ctx.get("hardware") or {}
    solver = view.plan.solver
    m = mfu(ctx.get("model_flops"), hw, p.step_time_s, view.plan.mesh.size)
    lines = [
        f"  mesh                  {view.mesh_text()}" + ("   (* axis crosses hosts)" if "*" in view.mesh_text() else ""),
        f"  pipeline stages       {len(view.plan.stages) or 1}",
        f"  predicted step time   {fmt_time(p.step_time_s)}  (compute {fmt_time(p.compute_time_s)}, "
        f"communication {fmt_time(p.communication_time_s)}"
        + (f" exposed + {fmt_time(p.hidden_communication_time_s)} hidden behind compute"
           if p.hidden_communication_time_s > 0 else "") + ")",
        f"  memory per device     {fmt_bytes(p.memory_bytes_per_device)}"
        + (f" of {fmt_bytes(budget)} budget ({p.memory_bytes_per_device / budget:.0%})" if budget else "")
        + (f"; argument(s) {', '.join(map(str, donated))} donated" if (donated := view.plan.options.donate_argnums)
           else ""),
        f"  bytes moved / device  {fmt_bytes(p.bytes_moved_per_device)} in {len(p.collectives)} collectives",
    ]
    if m is not None:
        lines.append(f"  model FLOP util.      {fmt_pct(m)} of {hw.get('name', '?')} peak "
                     f"({sum(ctx['model_flops'].values()):.3g} model FLOPs per step)")
    if hw.get("rates_source"):
        lines.append(f"  achieved rates        {hw['rates_source']}")
    if solver.status is not None:
        lines.append(f"  solver                {solver.status} in {solver.solve_time_s or 0:.2f} s "
                     f"({solver.decisions} decisions, {solver.variables_shared} after layer sharing)"
                     + _solver_quality(solver))
    if view.plan.fallback_primitives:
        lines.append(f"  replicated (no rule)  {', '.join(view.plan.fallback_primitives)}")
    lines += [f"  kernels               {k}" for k in view.plan.kernels]
    if (wire := wire_line(view.plan)) is not None:
        lines.append(f"  on the wire           {wire}")
    topo = ctx.get("topology")
    if topo and not (view.plan.pipeline and len(view.plan.stages) > 1):
        lines += [f"  on the topology       {topology_line(view, topo)}",
                  f"  as MaxText sets it    {maxtext_mesh(view, topo)}"]
    return "\n".join(lines)


def format_plan(view: PlanView, top: int | None = None) -> str:
    """The whole text report: ranking (when a search ran), the best plan, its layers and rules."""
    ctx = view.context
    out = []
    title = ctx.get("model", "program")
    where = ctx.get("cluster_text") or (f"{ctx['devices']} devices" if "devices" in ctx else f"{view.plan.mesh.size} devices")
    hw = (ctx.get("hardware") or {}).get("name")
    out.append(f"Plan for {title} on {where}" + (f" ({hw})" if hw else ""))
    if ctx.get("params"):
        out[-1] += f", {fmt_count(ctx['params'])} parameters"
    ranking = ctx.get("ranking") or []
    pipeline = view.plan.pipeline
    if len(ranking) > 1 or pipeline:
        title = "Pipeline plans, best first:" if pipeline else "Mesh shapes, best first:"
        out += ["", title, format_ranking(ranking, view.budget(), top)]
    out += ["", "Best plan:" if len(ranking) > 1 or pipeline else "Plan:", format_header(view)]
    if pipeline and len(view.plan.stages) > 1:
        out += ["", "Pipeline stages:", format_stages(view)]
        out += ["", "  per-stage shardings: stages[i].shardings in the --json file (each on its stage's mesh)"]
        return "\n".join(out)
    out += ["", "Per-layer shardings (repeated identical layers collapsed):", format_layer_table(view)]
    out += ["", "Logical axis rules:", format_rules(view)]
    return "\n".join(out)


def format_stages(view: PlanView) -> str:
    """The pipeline's stages (layers, submesh, logical mesh, predicted time) and its schedule."""
    pipe = view.plan.pipeline or PipelineFacts()
    rows = []
    for k, st in enumerate(view.plan.stages):
        layers = st.layers or ()
        names = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]} ({len(layers)})" if layers else "-"
        mesh = zip(st.mesh.axis_names, st.mesh.shape) if st.mesh is not None else ()
        host = set(st.host_axes or ())
        mesh_text = ", ".join(f"{n}={s}" + ("*" if n in host else "") for n, s in mesh) or "-"
        sub = st.submesh or ()
        devices = st.devices or ()
        layout = stage_way(st)
        rows.append((k, names, "x".join(map(str, sub)) or "-", mesh_text, _ranges(devices) if devices else "-",
                     layout, fmt_time(st.time_per_microbatch_s), fmt_bytes(st.memory_bytes_per_device)))
    out = [table(("stage", "layers", "submesh", "mesh", "devices", "layout", "time/microbatch", "memory/dev"),
                 rows, "rllllrrr")]
    out.append(f"  schedule {_or_dash(pipe.schedule)}, {_or_dash(pipe.num_microbatches)} microbatches, "
               f"bubble {fmt_pct(pipe.bubble_fraction)}, pipeline time {fmt_time(pipe.pipeline_time_s)}")
    single = pipe.single_stage_step_time_s
    if single is not None:
        out.append(f"  best single stage {fmt_time(single)}/step (whole cluster, one stage)")
    stacked = pipe.planning.stacked_params if pipe.planning is not None else None
    if stacked:
        out.append(f"  note: {stacked_note(stacked)}")
    return "\n".join(out)
