"""`planner plan`: trace the step, plan it for the target, print the best plans and write them."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from typing import Any

from planner.core.errors import PlannerError, first_line
from planner.core.options import PlanOptions
from planner.cost_model import Cluster, get_hardware, profiled_hardware
from planner.emit.pipeline.planned import plan_stages
from planner.graph.ir import Graph, matmul_flops
from planner.graph.scan_remat import recomputable_scans
from planner.graph.shape_family import MIN_SIZE, ShapeFamily, length_family, trace_family
from planner.graph.trace import trace
from planner.planning.evaluate import pipeline_baseline
from planner.stages.microbatches import PlanningMemo, batch_size, microbatch_args
from planner.present.ranking import hardware_record, mesh_ranking, pipeline_ranking, plan_view
from planner.present.report import format_levers, format_plan
from planner.planning.composition import compose_on_meshes
from planner.cli.configured import configured_results
from planner.cli.errors import CLIError
from planner.cli.options import budget, donated_state, hand_configured, plan_options, pp_baseline, unlimited
from planner.cli.output import check_output_paths, load_plan, print_xla_flags, write_outputs
from planner.cli.sweep import one_shape, plan_sweep, shapes
from planner.cli.target import candidate_specs, pipeline_target, target
from planner.cli.workloads import load_factory, load_model
from zoo import model_names

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class PlanTarget:
    """What `planner plan` plans for, read and checked from the flags before anything is traced."""

    num_devices: int
    cluster: Cluster | None
    pipelined: bool
    meshes: list
    target_hw: Any  # the cost model's `Hardware` (a profile's devices under --profile)
    hardware: dict  # its record, as the plan prints it
    budget: float | None
    options: PlanOptions


@dataclasses.dataclass(frozen=True)
class Traced:
    """The step to plan and its graph; `t0`: when loading it began (the planning time counts from there)."""

    label: str
    step: Any
    example: Any
    graph: Graph
    flops: dict
    t0: float


def cmd_plan(args, out) -> int:
    if args.list_models:
        print("\n".join(model_names()), file=out)
        return 0
    check_output_paths(args)
    if args.from_file is not None:
        return _reprint(args, out)
    if bool(args.model) == bool(args.fn):
        raise CLIError("name what to plan: --model NAME (see --list-models) or --fn MODULE:FACTORY, exactly one")
    if len(shapes(args)) > 1:
        return plan_sweep(args, out, _plan_one)
    _plan_one(one_shape(args, "plan"), out)
    return 0


def _plan_one(args, out, memo: PlanningMemo | None = None):
    """Plans one shape and prints it; returns its `PlanView`. `memo`: what plans of the same step at
    other batch sizes found (a sweep's, `cli.sweep`)."""
    where = _plan_target(args)
    if where.pipelined and memo is None:  # the search's symbolic trace also gives the whole batch's graph
        memo = PlanningMemo()
    traced = _trace_step(args, where, memo)
    options, assumed = donated_state(args, where.options, traced.graph)
    where = dataclasses.replace(where, options=options)
    pp_name, pp_stages = pp_baseline(args)
    ranked, graph, note = _rank(args, where, traced, pp_name, pp_stages, memo)
    view = plan_view(ranked, graph, traced.label, where.num_devices, where.cluster, where.hardware, where.budget,
                     traced.flops, time.perf_counter() - traced.t0)
    _print_plan(args, view, pp_stages, out)
    if note is not None:
        print(f"\nPipeline stages ({where.cluster.hosts} hosts: weighed by default where they can matter; "
              f"--pipeline off / auto to decide): {note}", file=out)
    if assumed:
        print(assumed, file=out)
    return view


def _reprint(args, out) -> int:
    """--from FILE: a saved plan printed (and written) again."""
    if args.model or args.fn:
        raise CLIError("--from FILE re-prints a saved plan; drop --model / --fn")
    view = load_plan(args.from_file, "--from")
    print(format_plan(view, args.top), file=out)
    print_xla_flags(view.plan, out)
    write_outputs(args, view, out)
    return 0


def _plan_target(args) -> PlanTarget:
    """The target, its hardware and budget, and the options, with every flag conflict refused."""
    num_devices, cluster = target(args)
    pipelined = args.pipeline in ("on", "auto")
    if pipelined and args.mesh is not None:
        raise CLIError("--mesh fixes one logical mesh but --pipeline searches submeshes and their meshes itself; "
                       "drop --mesh or use --pipeline off")
    if (pipelined or pp_baseline(args)[1]) and unlimited(args):
        raise CLIError(f"--memory-budget {args.memory_budget} with --pipeline: pipeline stages are planned to fit a "
                       "memory budget (default: the device memory); give a size such as 80GB")
    meshes = [] if pipelined else candidate_specs(args, num_devices, cluster.hosts if cluster is not None else 1)
    if args.profile is not None and not os.path.isfile(args.profile):
        raise CLIError(f"--profile {args.profile!r} does not exist; write one with `planner profile` or drop --profile")
    try:
        # With a profile, the devices it measured: their name, memory and measured peaks.
        target_hw = profiled_hardware(args.profile, args.hardware) if args.profile else get_hardware(args.hardware)
        hardware = hardware_record(target_hw)
    except ValueError as e:
        raise CLIError(f"--hardware {args.hardware!r}: {e}") from None
    limit = budget(args, hardware)
    return PlanTarget(num_devices, cluster, pipelined, meshes, target_hw, hardware, limit,
                      plan_options(args, limit, cluster))


def _trace_step(args, where: PlanTarget, memo: PlanningMemo | None = None) -> Traced:
    """The --model or --fn step, traced; a --fn step that fails to trace is named in one line.

    In a sweep (`cli.sweep`) a zoo model is built once per sequence length (`args.loaded`: its first
    shape's label, step and example) and given the other batch sizes as arguments, so that its
    graph at them is made from the pipeline search's symbolic trace (`memo`) instead of traced;
    what was used is left in `args.loaded`."""
    t0 = time.perf_counter()
    loaded = getattr(args, "loaded", None) if args.model else None
    graph = None if loaded is None or memo is None else memo.graph_at(loaded[1], args.batch)
    if graph is not None:  # the step traced for any batch size: the same step, given this one
        label, step, example = _resized(loaded, args.batch)
    else:
        label, step, example = (load_model(args.model, args.batch, args.seq, args.dtype,
                                           where.target_hw.default_dtype,
                                           pipelined=where.pipelined or bool(pp_baseline(args)[1]))
                                if args.model else load_factory(args.fn, args.batch, args.seq, args.dtype))
    args.loaded = (label, step, example)
    if graph is None and where.pipelined:
        graph = _from_seq_family(args, where, step, memo)
    if graph is not None:
        log.info("%s: made from the symbolic trace of its first %s", label,
                 "batch size" if loaded is not None else "shape (batch size and sequence length symbolic)")
        return Traced(label, step, example, graph, matmul_flops(graph), t0)
    log.info("tracing %s (compute dtype %s) ...", label, args.dtype or
             (where.target_hw.default_dtype if args.model else "the factory's"))
    try:
        graph = _from_family(step, example, memo) if where.pipelined else None
        graph = graph if graph is not None else trace(step, *example)
    except PlannerError:
        raise
    except Exception as e:  # the user's step failed to trace: one line naming it, no traceback
        if not args.fn:
            raise
        raise CLIError(f"--fn {args.fn!r}: tracing the step raised {type(e).__name__}: "
                       f"{first_line(e)}; fix the step") from None
    log.info("traced %d ops, %d inputs in %.1fs", len(graph.ops), len(graph.inputs), time.perf_counter() - t0)
    return Traced(label, step, example, graph, matmul_flops(graph), t0)


def _from_family(step, example, memo: PlanningMemo | None) -> Graph | None:
    """A pipelined plan's whole-batch graph made from the step traced with a symbolic batch size,
    which the pipeline search needs anyway (`memo.family`, left there for it): one trace instead of
    two. None (trace it) when the step cannot be traced so (the search then traces per size and says
    why), or when it has scans: recomputing a scan rewrites the traced jaxpr (`Graph.source`), which
    a graph made from the family does not keep."""
    if memo is None or memo.family is not None:
        return None
    family = trace_family(step, example, (len(example) - 1,))
    memo.family, memo.step = family, step
    if not isinstance(family, ShapeFamily) or recomputable_scans(family.graph):
        return None
    return memo.graph_at(step, batch_size(example))


def _from_seq_family(args, where: PlanTarget, step, memo: PlanningMemo | None) -> Graph | None:
    """In a sweep over sequence lengths (`args.seq_families`, the sweep's), a zoo model's graph at
    this shape made from the one family of every length and batch size: the model built for a
    symbolic length (`shape_family.length_family`) and traced once, at the sweep's first shape. The
    zoo's steps are the same program at every length (tests/test_shape_family.py checks each against
    its traces), so the family stands for `step` without a trace of it. None where the model does not
    trace so (then `_from_family`: the batch-size family of this length), and with scans (the memo
    keeps the family for the pipeline search; the whole batch is traced, as `_from_family` says why).
    A `--fn` factory is traced per length: checking its symbolic build against its step costs the
    trace the family saves (measured, WORKSPACE "A zoo model's sequence lengths traced once")."""
    shared = getattr(args, "seq_families", None)
    if shared is None or memo is None or memo.family is not None or not args.model or (args.seq or 0) < MIN_SIZE:
        return None  # (a one-token length: its unit dimension broadcasts in a trace, `shape_family.MIN_SIZE`)
    if "family" not in shared:
        shared["family"] = _trace_seq_family(args, where)
    family = shared["family"]
    if not isinstance(family, ShapeFamily):
        return None
    memo.family, memo.step = family.with_sizes(s=args.seq), step
    return None if recomputable_scans(family.graph) else memo.graph_at(step, args.batch)


def _trace_seq_family(args, where: PlanTarget) -> ShapeFamily | str:
    """The zoo model traced once with its batch size and sequence length symbolic, or why not."""
    log.info("tracing %s once for every sequence length and batch size ...", args.model)
    family = length_family(lambda s: load_model(args.model, args.batch, s, args.dtype, where.target_hw.default_dtype,
                                                pipelined=True)[1:])
    if isinstance(family, str):
        log.info("each sequence length traced on its own: %s", family)
    return family


def _resized(loaded: tuple, batch: int) -> tuple:
    """A zoo model's (label, step, example) given another batch size: the same step, its batch
    argument's leaves cut or grown to `batch` rows."""
    label, step, example = loaded
    return (re.sub(r"batch=\d+", f"batch={batch}", label) if "batch=" in label else f"{label} batch={batch}",
            step, microbatch_args(example, batch))


def _rank(args, where: PlanTarget, traced: Traced, pp_name, pp_stages, memo: PlanningMemo | None = None):
    """The ranked plans (`present.ranking`) of the way the flags ask to plan, the graph planned, and
    what weighing pipeline stages by default gave (None: not weighed)."""
    if pp_stages:
        return _rank_pipeline_baseline(args, where, traced, pp_name, pp_stages), traced.graph, None
    if where.pipelined:
        return _rank_pipeline(args, where, traced, memo), traced.graph, None
    if hand_configured(args):
        results = configured_results(args, traced.graph, where.meshes, where.options, where.cluster)
        return mesh_ranking(results, traced.flops, where.hardware), traced.graph, None
    stages = _stage_search(args, where, traced, memo)
    composed = compose_on_meshes(traced.step, traced.graph, where.meshes, where.options,
                                 where.cluster.devices_per_host if where.cluster else None, stages)
    log.info("planned %d mesh shape(s) in %.1fs", len(where.meshes), time.perf_counter() - traced.t0)
    if composed.pipelined is not None:
        pp = composed.pipelined.found
        single = composed.plan.pipeline.single_stage_step_time_s
        ranked = pipeline_ranking(composed.plan, dataclasses.replace(pp, single_stage_time_s=single),
                                  pipeline_target(args, where.cluster, where.num_devices), traced.flops,
                                  where.hardware, time.perf_counter() - traced.t0)
        return ranked, traced.graph, composed.pipeline_note
    return mesh_ranking(composed.results, traced.flops, where.hardware), composed.graph, composed.pipeline_note


def _stage_search(args, where: PlanTarget, traced: Traced, memo: PlanningMemo | None):
    """The pipeline stage search weighed by default (`planning.pipeline_lever`) on a --cluster of
    several hosts without --mesh; None elsewhere."""
    if where.cluster is None or where.cluster.hosts < 2 or args.mesh is not None:
        return None
    cluster = pipeline_target(args, where.cluster, where.num_devices)
    shared = memo if memo is not None else PlanningMemo()

    def search(options: PlanOptions, beat: float):
        return plan_stages(traced.step, traced.example, traced.graph, cluster, options, memo=shared, beat=beat)

    return search


def _rank_pipeline_baseline(args, where: PlanTarget, traced: Traced, pp_name: str, pp_stages: int):
    """--baseline NAME+ppN: the configuration in N even pipeline stages."""
    cluster = pipeline_target(args, where.cluster, where.num_devices)
    log.info("evaluating baseline %s on %s ...", args.baseline, cluster)
    t1 = time.perf_counter()
    plan, pp = pipeline_baseline(traced.step, traced.example, traced.graph, pp_name, pp_stages, cluster, where.options)
    return pipeline_ranking(plan, pp, cluster, traced.flops, where.hardware, time.perf_counter() - t1)


def _rank_pipeline(args, where: PlanTarget, traced: Traced, memo: PlanningMemo | None = None):
    """--pipeline on / auto: the stages, their submeshes and their plans."""
    cluster = pipeline_target(args, where.cluster, where.num_devices)
    hosts, per_host = cluster.hosts, cluster.devices_per_host
    log.info("planning pipeline stages on %d host(s) x %d device(s) ...", hosts, per_host)
    t1 = time.perf_counter()
    plan, pp = plan_stages(traced.step, traced.example, traced.graph, cluster, where.options, memo=memo)
    ranked = pipeline_ranking(plan, pp, cluster, traced.flops, where.hardware, time.perf_counter() - t1)
    log.info("pipeline: %d stage(s), %.4g s/step, planned in %.1fs", pp.num_stages,
             plan.prediction.step_time_s, time.perf_counter() - t1)
    return ranked


def _print_plan(args, view, pp_stages, out) -> None:
    """The plan's tables, the user's configuration, the memory levers and XLA flags; then the files."""
    print(format_plan(view, args.top), file=out)
    if hand_configured(args):
        print(_configuration_line(args, view.plan, pp_stages), file=out)
    levers = format_levers(view.plan)
    if levers:
        print("\n" + levers, file=out)
    print_xla_flags(view.plan, out)
    write_outputs(args, view, out)


def _configuration_line(args, plan, pp_stages) -> str:
    """What --pin / --rules / --baseline configured, and what the evaluation approximated."""
    solver = plan.solver
    pinned = (f"{len(plan.stages)} even pipeline stages, {(solver.configuration or '').split('+')[0][9:]} "
              "pins in each" if pp_stages else
              f"{solver.pinned_inputs or 0} argument leaves pinned" + (", the rest planned" if not args.baseline
                                                                      else ""))
    return (f"\nYour configuration: {solver.configuration}, {pinned}"
            + (f"; approximated: {solver.approximation}" if solver.approximation else ""))
