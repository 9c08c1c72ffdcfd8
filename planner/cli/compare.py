"""`planner compare`: the planner's plan beside named hand configurations on one mesh.

Where a pipeline baseline (`NAME+ppN`) is compared on a --cluster of several hosts, the planner's
row weighs pipeline stages on that cluster too (`planning.pipeline_lever`, as `planner plan
--cluster` without --mesh does), so that it is never a single-mesh plan beside pipelines it could
have been: the row is the faster of its single-step plan on --mesh and its stage search."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from planner.configs.baselines import NAMES as BASELINES, parse_baseline
from planner.configs.pins import resolve as resolve_pins
from planner.core.errors import PlannerError
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.cost_model import Cluster, get_hardware
from planner.emit.pipeline.planned import plan_stages
from planner.graph.ir import matmul_flops
from planner.graph.trace import trace
from planner.planning.evaluate import pipeline_baseline
from planner.planning.composition import compose_on_meshes
from planner.present.compare import comparison_record, format_record
from planner.present.ranking import hardware_record, mesh_ranking, pipeline_ranking, plan_view
from planner.search.mesh_plan import make_plan
from planner.search.results import MeshResult
from planner.stages.microbatches import PlanningMemo
from planner.cli.configured import cli_pins, configured_results
from planner.cli.errors import CLIError, one_line
from planner.cli.options import budget, donated_state, plan_options
from planner.cli.output import check_output_paths, write_outputs
from planner.cli.sweep import one_shape
from planner.cli.target import MESH_SHAPE, candidate_specs, pipeline_target, target
from planner.cli.workloads import load_factory, load_model
from zoo import model_names


@dataclasses.dataclass(frozen=True)
class CompareTarget:
    """The one mesh every row is planned or evaluated on, and the options they share."""

    num_devices: int
    cluster: Cluster | None
    mesh: MeshSpec
    hardware: dict
    budget: float | None
    options: PlanOptions


def cmd_compare(args, out) -> int:
    """The planner's plan and the baselines (and --pin / --rules as "yours") on one mesh."""
    if args.list_models:
        print("\n".join(model_names()), file=out)
        return 0
    if bool(args.model) == bool(args.fn):
        raise CLIError("name what to compare: --model NAME or --fn MODULE:FACTORY, exactly one")
    if args.mesh is None or not MESH_SHAPE.match(args.mesh):
        raise CLIError("compare needs one mesh: --mesh 2x4")
    check_output_paths(args)
    args = one_shape(args, "compare")
    names = _baseline_names(args)
    where = _compare_target(args)
    staged = any(parse_baseline(n)[1] for n in names)  # a pipeline baseline: every row on the same (unrolled) model
    label, step, example = (load_model(args.model, args.batch, args.seq, args.dtype,
                                       get_hardware(args.hardware).default_dtype, pipelined=staged)
                            if args.model else load_factory(args.fn, args.batch, args.seq, args.dtype))
    t0 = time.perf_counter()
    traced = trace(step, *example)
    options, assumed = donated_state(args, where.options, traced)
    where = dataclasses.replace(where, options=options)
    # the planner's row: planned as `planner plan --mesh` plans it, with the levers the flags ask for,
    # and beside pipeline baselines on several hosts its stage search weighed too
    composed = compose_on_meshes(step, traced, [where.mesh], where.options,
                                 where.cluster.devices_per_host if where.cluster else None,
                                 _stage_search(args, where, step, example, traced) if staged else None)
    graph, plan = composed.graph, composed.plan
    planned_s = time.perf_counter() - t0
    rows = _rows(args, names, where, step, example, traced)
    others = [(n, p) for n, p in rows if not isinstance(p, str)]
    skipped = [(n, p) for n, p in rows if isinstance(p, str)]
    print(f"{label} on mesh {where.mesh}: the planner's plan beside hand configurations", file=out)
    record = comparison_record(plan, others, skipped, where.budget)
    print(format_record(record), file=out)
    if composed.pipeline_note is not None:
        print(f"Pipeline stages of the planner's row ({where.cluster.hosts} hosts, beside pipeline baselines): "
              f"{composed.pipeline_note}", file=out)
    if assumed:
        print(assumed, file=out)
    if args.json or args.html:  # the plan's report, with the comparison beside it
        _write_report(args, where, label, graph, composed, planned_s, record, out)
    return 0


def _stage_search(args, where: CompareTarget, step, example, graph):
    """The planner row's stage search (`planning.pipeline_lever.StageSearch`) on the --cluster of
    several hosts the pipeline baselines run on; None on one host."""
    if where.cluster is None or where.cluster.hosts < 2:
        return None
    cluster = pipeline_target(args, where.cluster, where.num_devices)
    memo = PlanningMemo()

    def search(options: PlanOptions, beat: float):
        return plan_stages(step, example, graph, cluster, options, memo=memo, beat=beat)

    return search


def _baseline_names(args) -> list[str]:
    """--baselines (default: every named baseline), each checked."""
    names = [n.strip() for n in args.baselines.split(",")] if args.baselines else list(BASELINES)
    for n in names:
        try:
            parse_baseline(n)
        except PlannerError as e:
            raise CLIError(str(e)) from None
    return names


def _compare_target(args) -> CompareTarget:
    num_devices, cluster = target(args)
    mesh = candidate_specs(args, num_devices)[0]
    hardware = hardware_record(get_hardware(args.hardware))
    limit = budget(args, hardware)
    return CompareTarget(num_devices, cluster, mesh, hardware, limit, plan_options(args, limit, cluster))


def _rows(args, names, where: CompareTarget, step, example, graph) -> list[tuple[str, Any]]:
    """(name, plan) per baseline, then "yours" for --pin / --rules; (name, reason) where one cannot be made."""
    rows = []
    for n in names:
        base, stages = parse_baseline(n)
        if stages:  # hand-chosen pipeline stages on the target (--cluster, or the mesh's devices as one host)
            try:
                rows.append((n, pipeline_baseline(step, example, graph, base, stages,
                                                  pipeline_target(args, where.cluster, where.num_devices),
                                                  where.options)[0]))
            except PlannerError as e:
                rows.append((n, one_line(e)))
            continue
        args.baseline, saved = n, (args.pin, args.rules)
        args.pin, args.rules = [], None
        try:
            rows.append((n, configured_results(args, graph, [where.mesh], where.options, where.cluster)[0].plan))
        except PlannerError as e:
            rows.append((n, one_line(e)))
        args.pin, args.rules = saved
    args.baseline = None
    if args.pin or args.rules:
        pinned = resolve_pins(cli_pins(args, graph, where.mesh), graph.input_paths,
                              [graph.tensors[t].shape for t in graph.inputs], where.mesh)
        rows.append(("yours", make_plan(graph, where.mesh, dataclasses.replace(where.options, memory_budget=None),
                                        pins=pinned)))
    return rows


def _write_report(args, where: CompareTarget, label, graph, composed, planned_s, record, out) -> None:
    """--json / --html: the plan's report, with the comparison beside it."""
    inter = where.options.inter_host_axes
    flops = matmul_flops(graph)
    if composed.pipelined is not None:  # the planner's row is its stage search's pipeline
        pp = dataclasses.replace(composed.pipelined.found,
                                 single_stage_time_s=composed.plan.pipeline.single_stage_step_time_s)
        ranked = pipeline_ranking(composed.plan, pp, pipeline_target(args, where.cluster, where.num_devices), flops,
                                  where.hardware, planned_s)
    else:
        ranked = mesh_ranking([MeshResult(where.mesh, composed.plan, None, inter, planned_s)], flops, where.hardware)
    view = plan_view(ranked, graph, label, where.num_devices, where.cluster, where.hardware, where.budget, flops,
                     planned_s)
    view = dataclasses.replace(view, data={**view.data, "context": {**view.context, "comparison": record}})
    write_outputs(args, view, out)
