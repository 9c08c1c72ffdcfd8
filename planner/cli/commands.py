"""The `planner` command line: plan a model for a cluster, explain and compare plans, draw them.

    planner plan --model gpt2-small --devices 8                # search mesh shapes, print the best plan
    planner plan --model gpt3-39b --cluster 8x8 --json p.json --html p.html
    planner plan --fn mypkg.train:make_step --mesh 2x4         # your own (train_step, example_args) factory
    planner plan --from p.json                                 # re-print a saved plan
    planner explain p.json [--op fc_in]                        # why each choice, and the runner-up
    planner diff a.json b.json                                 # where two plans differ and what it costs
    planner plan --model gpt-tiny --mesh 2x4 --pin 'wte/embedding=P((x,y), None)'   # yours, the rest planned
    planner compare --model gpt-tiny --mesh 2x4                # the plan beside dp, fsdp, megatron-tp, ...
    planner compare --model gpt-tiny --mesh 2x4 --html c.html  # ... and the plan's report with that comparison
    planner profile ...                                        # offline profiling (planner.cost_model.profiling)

Planning is abstract: arguments are `jax.ShapeDtypeStruct`s and the target mesh is a description
(`MeshSpec`), so no accelerator (and no device of the planned count) is needed. Results go to
stdout, progress to stderr; bad input exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence

from planner.cost_model import (
    DEFAULT_HARDWARE,
    PRESETS,
    Cluster,
    get_hardware,
    hardware_with_links,
    profiled_hardware,
)
from planner.core.errors import InfeasiblePlanError, PlannerError, first_line
from planner.graph.trace import matmul_flops, trace
from planner.core.mesh import MeshSpec, default_axis_names
from planner.core.options import OFFLOAD_MODES, PlanOptions
from planner.levers.accumulate import micro_options, plan_accumulation
from planner.configs.baselines import NAMES as BASELINES, baseline_pins, parse_baseline
from planner.planning.evaluate import labelled, pipeline_baseline
from planner.configs.pins import parse_spec_text, resolve as resolve_pins
from planner.ilp.offload import streamed as offload_streamed
from planner.search.mesh_plan import make_plan
from planner.present.compare import comparison_record, format_record
from planner.present.diff import diff
from planner.present.logical_axes import rules_file_pins
from planner.present.explain import explain
from planner.present.html_report import render_html
from planner.present.ranking import hardware_record, mesh_ranking, pipeline_ranking, plan_view
from planner.present.report import PlanView, fmt_bytes, format_levers, format_plan
from planner.cli.workloads import load_factory, load_model
from planner.levers.remat import plan_remat, record as remat_record
from planner.search.meshes import (MeshResult, candidate_meshes, default_mesh_ndim, inter_host_axes, no_fit_error,
                            search_meshes)
from planner.stages.submesh import make_cluster
from planner.emit.pipeline.planned import plan_stages
from planner.core.units import parse_bytes
from zoo import model_names

__all__ = ["CLIError", "build_parser", "inter_host_axes", "main"]

log = logging.getLogger("planner")

_MESH = re.compile(r"^\s*\d+(\s*x\s*\d+)*\s*$")


class CLIError(Exception):
    """A problem with the command line itself; printed as one line, exit status 2."""


# ----- argument parsing ------------------------------------------------------------------------
def _argnums(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of argument positions") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: argument positions are >= 0")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", help="a model of the zoo (see --list-models)")
    what.add_argument("--fn", metavar="MODULE:FACTORY",
                      help="import FACTORY from MODULE (a module name or a .py path); FACTORY() returns "
                           "(train_step, example_args) with arrays or jax.ShapeDtypeStruct leaves")
    what.add_argument("--from", dest="from_file", metavar="FILE", help="re-print a plan saved with --json")
    what.add_argument("--list-models", action="store_true", help="print the zoo's model names and exit")
    where = p.add_argument_group("the target (one of; --mesh may combine with --cluster)")
    where.add_argument("--devices", type=_positive_int, metavar="N", help="N devices on one host; search mesh shapes")
    where.add_argument("--mesh", metavar="AxB", help="a fixed logical mesh shape, e.g. 2x4 (axes named x, y, ...)")
    where.add_argument("--mesh-ndim", type=int, choices=(1, 2, 3), default=None,
                       help="without --mesh: search logical meshes of up to this many axes (3 adds e.g. "
                            "data x fsdp x tensor meshes refining the best 2-D plan's mesh, searched near that plan; "
                            "default: 3 for a cluster of several hosts, else 2)")
    where.add_argument("--cluster", metavar="HOSTSxDEVICES",
                       help="HOSTS hosts with DEVICES devices each, e.g. 2x8 or 2x8:h100; mesh axes that cross "
                            "hosts use the slower inter-host links. Or a cluster file (JSON): {\"hosts\": 8, "
                            "\"devices_per_host\": 8, \"hardware\": \"v100\", \"inter_host\": \"25Gbit\", "
                            "\"intra_host\": \"150GB/s\"}")
    opts = p.add_argument_group("options")
    opts.add_argument("--hardware", help="hardware preset of the cost model: "
                      + ", ".join(sorted(PRESETS)) + f" (default {DEFAULT_HARDWARE.name})")
    opts.add_argument("--profile", metavar="FILE", help="profile database written by `planner profile`; the "
                      "plan then names the profiled devices, and their memory and measured peaks set the default "
                      "budget and the MFU")
    opts.add_argument("--inter-host", metavar="BANDWIDTH[,LATENCY]",
                      help="network between hosts as it is: one host's bandwidth, shared by its devices, e.g. "
                           "25Gbit, 100Gbit,5us or 12.5GB/s (default: the hardware preset's)")
    opts.add_argument("--intra-host", metavar="BANDWIDTH[,LATENCY]",
                      help="one device's link to the other devices of its host, e.g. 150GB/s (default: the preset's)")
    opts.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="compute dtype of the model (parameters and optimizer state stay float32); default: "
                           "what the hardware trains in (bfloat16 on A100/H100/TPU, float16 on V100, float32 on CPU)")
    opts.add_argument("--batch", type=_positive_int, help="override the model's batch size")
    opts.add_argument("--seq", type=_positive_int, help="override the model's sequence length")
    opts.add_argument("--memory-budget", metavar="SIZE",
                      help="per-device memory budget such as 80GB or 40GiB (default: the hardware's memory; "
                           "'none' for no limit)")
    opts.add_argument("--pipeline", choices=("auto", "on", "off"), default=None,
                      help="split the program into pipeline stages (default: the planner's PlanOptions default)")
    opts.add_argument("--microbatches", type=_positive_int, metavar="K", help="microbatches per step when pipelining")
    opts.add_argument("--accumulate", type=_accumulate, default=None, metavar="auto|K",
                      help="gradient accumulation without pipelining: K microbatches per step (a loop inside the "
                           "step, one update), or 'auto' for the fastest K that fits the memory budget")
    opts.add_argument("--no-unshard", dest="unshard", action="store_false", default=True,
                      help="with --accumulate: reshard loop-invariant values (a sharded parameter's all-gather) "
                           "in every microbatch instead of once before the loop while memory allows (selective "
                           "unsharding, the default)")
    opts.add_argument("--offload", choices=OFFLOAD_MODES, default=None,
                      help="host offload of optimizer state in single-stage plans: 'opt-state' keeps all of it in "
                           "host memory between steps, 'opt-state+params' the float32 master parameters too, "
                           "'auto' only the part that does not fit the memory budget")
    opts.add_argument("--remat", choices=("off", "auto", "dots", "full"), default=None,
                      help="recompute repeated layers' forward in the backward (single-stage plans): 'full' keeps "
                           "only each layer's inputs, 'dots' keeps matmul results, 'auto' recomputes only when the "
                           "plan does not fit the memory budget, and only the first layers it needs")
    opts.add_argument("--donate", type=_argnums, default=None, metavar="I[,J]",
                      help="argument positions whose buffers the step reuses, as jax.jit(donate_argnums=...): "
                           "typically 0, the train state (its new value is written over the old one)")
    opts.add_argument("--prefetch", action="store_true",
                      help="price parameter all-gathers (ZeRO-3/FSDP) as issued ahead of their use, hidden behind "
                           "earlier compute (a harder ILP: slower planning)")
    opts.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                      help="ILP solver time limit per mesh shape (default: the planner's)")
    opts.add_argument("--top", type=_positive_int, default=10, metavar="K", help="rows of the ranked mesh table (default 10)")
    hand = p.add_argument_group("your configuration (needs --mesh; planner.configs.pins)")
    hand.add_argument("--pin", action="append", default=[], metavar="PATTERN=SPEC",
                      help="fix the sharding of the argument leaves the glob PATTERN matches (paths as the tables "
                           "print them), e.g. 'wte/embedding=P((x,y), None)'; repeatable, first match wins; the "
                           "rest is planned")
    hand.add_argument("--rules", metavar="FILE", help="logical-axis rules as the plan prints them (t5x list or "
                      "MaxText YAML line), applied to the logical names the planner infers for the model's leaves")
    hand.add_argument("--baseline", metavar="NAME", help="evaluate a named hand configuration instead of planning: "
                      "dp, zero1, zero2, fsdp, megatron-tp, megatron-tp-sp, dp-tp (planner.configs.baselines); NAME+ppN puts "
                      "it in N even pipeline stages (e.g. megatron-tp+pp2 with --cluster 4x8: tensor parallel "
                      "inside a host, data parallel across; --microbatches B)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the best plan as JSON")
    out.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    out.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")


def build_parser(profile_arguments=None) -> argparse.ArgumentParser:
    """The argument parser; `profile_arguments(parser)` fills the `profile` subcommand when available."""
    parser = argparse.ArgumentParser(
        prog="planner", description="Plan, explain and compare sharding plans for JAX train steps.",
        epilog="examples:\n" + __doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("plan", help="plan a model for a mesh or cluster and print the best plans",
                       description="Plan a model for a mesh or a cluster (abstractly: no accelerator needed).")
    _add_plan_arguments(p)
    e = sub.add_parser("explain", help="explain a saved plan: costs per choice and the runner-up",
                       description="Explain a plan saved with `planner plan --json`.")
    e.add_argument("plan_file", metavar="PLAN.json")
    e.add_argument("--op", metavar="NAME", help="only decisions and collectives whose name contains NAME")
    e.add_argument("--top", type=_positive_int, default=15, metavar="K", help="rows per section (default 15)")
    d = sub.add_parser("diff", help="compare two saved plans", description="Where two plans differ and what it costs.")
    d.add_argument("a", metavar="A.json")
    d.add_argument("b", metavar="B.json")
    d.add_argument("--top", type=_positive_int, default=20, metavar="K", help="rows per section (default 20)")
    c = sub.add_parser("compare", help="the planner's plan beside named baselines (and your pins/rules)",
                       description="Plan a model on one mesh and evaluate hand configurations under the same cost "
                                   "model: step time, exposed communication, memory, bytes moved, and the places "
                                   "that make the difference; --html / --json write the plan's report with the "
                                   "comparison beside it.")
    _add_plan_arguments(c)
    c.add_argument("--baselines", default=None, metavar="A,B,...",
                   help="baselines to compare (default: all of planner.configs.baselines.NAMES); NAME+ppN adds N even "
                        "pipeline stages, e.g. dp,megatron-tp,megatron-tp+pp2")
    pr = sub.add_parser("profile", help="measure collectives and write the cost-model database",
                        description="Offline profiling job (planner.cost_model.profiling).")
    if profile_arguments is not None:
        profile_arguments(pr)
    else:
        pr.add_argument("profile_args", nargs=argparse.REMAINDER)
    return parser


def _profiling_module():
    """planner.cost_model.profiling, imported only for `planner profile` (it may be missing)."""
    if importlib.util.find_spec("planner.cost_model.profiling") is None:
        return None
    return importlib.import_module("planner.cost_model.profiling")


# ----- targets ---------------------------------------------------------------------------------
def parse_cluster(text: str) -> Cluster:
    """The hosts x devices of `"2x8"` or `"2x8:h100"` (the preset, if any, becomes `--hardware`)."""
    try:
        if not Cluster.is_cluster(text):
            raise ValueError("not of the form HOSTSxDEVICES[:PRESET]")
        return Cluster.parse(text.partition(":")[0])
    except ValueError as e:
        raise CLIError(f"--cluster {text!r} is not HOSTSxDEVICES ({e}); write e.g. --cluster 2x8 for 2 hosts with "
                       "8 devices each (optionally 2x8:h100 to name the hardware)") from None


def candidate_specs(args, num_devices: int, hosts: int = 1):
    """The MeshSpecs to plan: the --mesh one, or every candidate shape of the device count (on
    `hosts` hosts: `search.default_mesh_ndim`)."""
    if args.mesh is not None:
        if not _MESH.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        shape = tuple(int(s) for s in args.mesh.replace(" ", "").split("x"))
        if math.prod(shape) != num_devices:
            raise CLIError(f"--mesh {args.mesh} has {math.prod(shape)} devices but the target has {num_devices}; "
                           f"choose sizes whose product is {num_devices}")
        return [MeshSpec(shape, default_axis_names(len(shape)))]
    return candidate_meshes(num_devices, default_mesh_ndim(getattr(args, "mesh_ndim", None), hosts))


_CLUSTER_FILE_KEYS = ("hosts", "devices_per_host", "hardware", "inter_host", "intra_host")


def read_cluster_file(args) -> None:
    """Reads `--cluster FILE` (JSON) into args.cluster ("HOSTSxDEVICES[:PRESET]") and the link flags
    (a flag given on the command line wins over the file)."""
    path = args.cluster
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise CLIError(f"--cluster {path!r}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CLIError(f"--cluster {path!r} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not {"hosts", "devices_per_host"} <= set(data):
        raise CLIError(f"--cluster {path!r}: expected a JSON object with hosts and devices_per_host (and optionally "
                       "hardware, inter_host, intra_host)")
    unknown = sorted(set(data) - set(_CLUSTER_FILE_KEYS))
    if unknown:
        raise CLIError(f"--cluster {path!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_CLUSTER_FILE_KEYS)}")
    hosts, per_host = data["hosts"], data["devices_per_host"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (hosts, per_host)):
        raise CLIError(f"--cluster {path!r}: hosts={hosts!r} and devices_per_host={per_host!r} must be integers >= 1")
    args.cluster = f"{hosts}x{per_host}" + (f":{data['hardware']}" if data.get("hardware") else "")
    for key in ("inter_host", "intra_host"):
        if getattr(args, key) is None and data.get(key) is not None:
            setattr(args, key, data[key])


def _target(args) -> tuple[int, Cluster | None]:
    given = [n for n, v in (("--devices", args.devices), ("--cluster", args.cluster)) if v is not None]
    if len(given) > 1:
        raise CLIError("give one of --devices N or --cluster HOSTSxDEVICES, not both")
    if args.cluster is not None:
        if args.cluster.strip().lower().endswith(".json") or os.path.isfile(args.cluster):
            read_cluster_file(args)
        cluster = parse_cluster(args.cluster)
        preset = args.cluster.partition(":")[2].strip() or None
        if preset is not None:
            if args.hardware is not None and args.hardware.lower() != preset.lower():
                raise CLIError(f"--cluster {args.cluster} names hardware {preset!r} but --hardware is "
                               f"{args.hardware!r}; give it once")
            args.hardware = preset
        return cluster.num_devices, cluster
    if args.devices is not None:
        return args.devices, None
    if args.mesh is not None:
        if not _MESH.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        return math.prod(int(s) for s in args.mesh.replace(" ", "").split("x")), None
    raise CLIError("say where to plan for: --devices N, --mesh 2x4 or --cluster HOSTSxDEVICES")


def _unlimited(args) -> bool:
    """--memory-budget asks for no limit."""
    return args.memory_budget is not None and args.memory_budget.strip().lower() in ("none", "off", "0", "unlimited")


def _budget(args, hardware: dict) -> float | None:
    if args.memory_budget is None:
        return float(hardware["memory_bytes"])
    if _unlimited(args):
        return None
    return parse_bytes(args.memory_budget, "--memory-budget")


def _options(args, budget: float | None, cluster: Cluster | None = None) -> PlanOptions:
    base = {"memory_budget": budget, "hardware": args.hardware, "profile": args.profile,
            "num_microbatches": args.microbatches, "inter_host": args.inter_host, "intra_host": args.intra_host}
    if cluster is not None and (args.inter_host or args.intra_host):
        # the hosts' network is shared by the cluster's devices per host, not the preset's
        base["hardware"] = f"{cluster.hosts}x{cluster.devices_per_host}:{get_hardware(args.hardware).name}"
    if args.pipeline is not None:
        base["pipeline"] = {"auto": "auto", "on": True, "off": False}[args.pipeline]
    if getattr(args, "accumulate", None) is not None:
        if _hand_configured(args):
            raise CLIError("--accumulate is not supported with --pin / --rules / --baseline yet; drop one")
        base["accumulate"] = args.accumulate
        base["unshard"] = getattr(args, "unshard", True)
    if args.time_limit is not None:
        base["solver_time_limit"] = args.time_limit
    if getattr(args, "prefetch", False):
        base["prefetch"] = True
    if getattr(args, "offload", None) is not None:
        base["offload"] = args.offload
    if getattr(args, "donate", None) is not None:
        base["donate_argnums"] = args.donate
    if getattr(args, "remat", None) is not None:
        if _hand_configured(args):
            raise CLIError("--remat is not supported with --pin / --rules / --baseline yet; drop one")
        base["remat"] = args.remat
    return PlanOptions.from_kwargs(base)


def _no_plan(results, budget: float | None, accumulated: bool = False) -> Exception:
    over = [r for r in results if r.over_budget]
    if not over:
        return CLIError("no mesh shape could be planned: " + "; ".join(f"{r.mesh}: {r.error}" for r in results))
    if not accumulated:
        return no_fit_error(results, budget)
    need = min((r.min_memory_bytes or math.inf) for r in over)
    floor = min((getattr(r.error, "lower_bound_bytes", None) or math.inf) for r in over)
    return InfeasiblePlanError(
        f"no mesh shape fits the memory budget of {fmt_bytes(budget) if budget else 'no limit'} per device"
        + (f" (the smallest reachable peak is {fmt_bytes(need)}" if need < math.inf else "")
        + (f"; no plan goes below {fmt_bytes(floor)}" if floor < math.inf else "")
        + (")" if need < math.inf else "")
        + "; tried: sharding" + (", gradient accumulation" if accumulated else "")
        + "; not available in single-stage plans yet: rematerialisation, host offload"
        + ("" if accumulated else "; try --accumulate auto (gradient accumulation)")
        + "; raise --memory-budget, plan for more devices, or enable --pipeline (recompute)")


# ----- commands --------------------------------------------------------------------------------
def cmd_plan(args, out) -> int:
    if args.list_models:
        print("\n".join(model_names()), file=out)
        return 0
    _check_output_paths(args)
    if args.from_file is not None:
        if args.model or args.fn:
            raise CLIError("--from FILE re-prints a saved plan; drop --model / --fn")
        view = _load_plan(args.from_file, "--from")
        print(format_plan(view, args.top), file=out)
        _print_xla_flags(view.plan, out)
        _write_outputs(args, view, out)
        return 0
    if bool(args.model) == bool(args.fn):
        raise CLIError("name what to plan: --model NAME (see --list-models) or --fn MODULE:FACTORY, exactly one")
    num_devices, cluster = _target(args)
    pipelined = args.pipeline in ("on", "auto")
    if pipelined and args.mesh is not None:
        raise CLIError("--mesh fixes one logical mesh but --pipeline searches submeshes and their meshes itself; "
                       "drop --mesh or use --pipeline off")
    if (pipelined or _pp_baseline(args)[1]) and _unlimited(args):
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
    budget = _budget(args, hardware)
    options = _options(args, budget, cluster)

    t0 = time.perf_counter()
    label, step, example = (load_model(args.model, args.batch, args.seq, args.dtype, target_hw.default_dtype,
                                       pipelined=pipelined)
                            if args.model else load_factory(args.fn, args.batch, args.seq, args.dtype))
    log.info("tracing %s (compute dtype %s) ...", label, args.dtype or
             (target_hw.default_dtype if args.model else "the factory's"))
    try:
        graph = trace(step, *example)
    except PlannerError:
        raise
    except Exception as e:  # the user's step failed to trace: one line naming it, no traceback
        if not args.fn:
            raise
        raise CLIError(f"--fn {args.fn!r}: tracing the step raised {type(e).__name__}: "
                       f"{first_line(e)}; fix the step") from None
    log.info("traced %d ops, %d inputs in %.1fs", len(graph.ops), len(graph.inputs), time.perf_counter() - t0)
    flops = matmul_flops(graph)
    pp_name, pp_stages = _pp_baseline(args)
    if pp_stages:
        target = _pipeline_target(args, cluster, num_devices)
        log.info("evaluating baseline %s on %s ...", args.baseline, target)
        t1 = time.perf_counter()
        plan, pp = pipeline_baseline(step, example, graph, pp_name, pp_stages, target, options)
        ranked = pipeline_ranking(plan, pp, target, flops, hardware, time.perf_counter() - t1)
    elif pipelined:
        target = _pipeline_target(args, cluster, num_devices)
        hosts, per_host = target.hosts, target.devices_per_host
        log.info("planning pipeline stages on %d host(s) x %d device(s) ...", hosts, per_host)
        t1 = time.perf_counter()
        plan, pp = plan_stages(step, example, graph, target, options)
        ranked = pipeline_ranking(plan, pp, target, flops, hardware, time.perf_counter() - t1)
        log.info("pipeline: %d stage(s), %.4g s/step, planned in %.1fs", pp.num_stages,
                 plan.prediction.step_time_s, time.perf_counter() - t1)
    elif _hand_configured(args):
        ranked = mesh_ranking(_configured_results(args, graph, meshes, options, cluster), flops, hardware)
    elif options.accumulate not in (None, 1):
        results, graph = _accumulated_results(step, graph, meshes, options, cluster, budget)
        ranked = mesh_ranking(results, flops, hardware)
    else:
        def search(g, smallest_peak: bool):
            if options.offload != "off":  # a streamed optimizer update (`offload.streamed`)
                g = offload_streamed(g)
            found = search_meshes(g, meshes, options, cluster.devices_per_host if cluster else None,
                                  min_peak_search=smallest_peak)
            if found[0].plan is None:
                raise _no_plan(found, budget)
            return found

        traced = graph  # --remat: the graph planned is the one with recomputation (`planner.levers.remat`)
        graph, results, policy = plan_remat(graph, options.remat, budget, search, lambda found: found[0].plan)
        if options.remat != "off":
            results = [dataclasses.replace(r, plan=remat_record(r.plan, traced, graph, policy)) if r.plan else r
                       for r in results]
        if options.offload != "off":
            graph = offload_streamed(graph)
        ranked = mesh_ranking(results, flops, hardware)
        log.info("planned %d mesh shape(s) in %.1fs", len(meshes), time.perf_counter() - t0)
    view = plan_view(ranked, graph, label, num_devices, cluster, hardware, budget, flops, time.perf_counter() - t0)
    print(format_plan(view, args.top), file=out)
    if _hand_configured(args):
        solver = view.plan.solver
        pinned = (f"{len(view.plan.stages)} even pipeline stages, {solver.get('configuration', '').split('+')[0][9:]} "
                  "pins in each" if pp_stages else
                  f"{solver.get('pinned_inputs', 0)} argument leaves pinned" + (", the rest planned" if not args.baseline
                                                                               else ""))
        print(f"\nYour configuration: {solver.get('configuration')}, {pinned}"
              + (f"; approximated: {solver['approximation']}" if solver.get("approximation") else ""), file=out)
    levers = format_levers(view.plan)
    if levers:
        print("\n" + levers, file=out)
    _print_xla_flags(view.plan, out)
    _write_outputs(args, view, out)
    return 0


def _pipeline_target(args, cluster: Cluster | None, num_devices: int) -> Cluster:
    """The cluster pipelines are planned for: --cluster (or --devices as one host) with the links
    --inter-host / --intra-host give."""
    hosts, per_host = (cluster.hosts, cluster.devices_per_host) if cluster else (1, num_devices)
    try:
        linked = hardware_with_links(args.hardware, args.inter_host, args.intra_host, per_host)
        return make_cluster(hosts, per_host, linked)
    except (ValueError, PlannerError) as e:
        raise CLIError(f"cannot build the {hosts}x{per_host} cluster: {e}") from None


def _pp_baseline(args) -> tuple[str | None, int | None]:
    """(baseline name, pipeline stages) of --baseline NAME+ppN; (name or None, None) otherwise."""
    if not getattr(args, "baseline", None):
        return None, None
    try:
        name, stages = parse_baseline(args.baseline)
    except PlannerError as e:
        raise CLIError(str(e)) from None
    if stages and (args.pin or args.rules):
        raise CLIError(f"--baseline {args.baseline} is a whole configuration with pipeline stages; drop --pin / --rules")
    if stages and getattr(args, "pipeline", None) == "off":
        raise CLIError(f"--baseline {args.baseline} has pipeline stages but --pipeline off was given; drop one")
    return name, stages


def _accumulate(text: str):
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a positive number of microbatches")
    return k


def _accumulated_results(step, graph, meshes, options, cluster, budget):
    """--accumulate: the microbatch step planned on every mesh (`search_meshes`), k chosen by
    `planner.levers.accumulate`; the best plan as the one ranked row, with the microbatch trace."""
    per_host = cluster.devices_per_host if cluster else None
    seen: list = []

    def plan_micro(g, inner):
        results = search_meshes(g, meshes, micro_options(options, inner), per_host)
        seen.append(results)
        if results[0].plan is None:
            over = [r for r in results if r.over_budget]
            if not over:
                raise CLIError("no mesh shape could be planned: " + "; ".join(f"{r.mesh}: {r.error}" for r in results))
            need = [r.min_memory_bytes for r in over if r.min_memory_bytes is not None]
            floor = [r.error.lower_bound_bytes for r in over if r.error.lower_bound_bytes is not None]
            raise InfeasiblePlanError(str(_no_plan(results, inner, accumulated=True)), min(need, default=None),
                                      min(floor, default=None))
        return results[0].plan

    bounds = MeshSpec((meshes[0].size,), default_axis_names(1))
    t0 = time.perf_counter()
    acc = plan_accumulation(step, graph, options.accumulate, budget, plan_micro, bounds, options.unshard)
    plan = dataclasses.replace(acc.plan, options={**acc.plan.options, "accumulate": options.accumulate})
    record = plan.levers["accumulation"]
    log.info("gradient accumulation: %d microbatch(es) of %d rows", record["microbatches"], record["microbatch_rows"])
    inter = next((r.inter_host_axes for rs in seen for r in rs if r.plan is not None and r.mesh == plan.mesh), ())
    return (MeshResult(plan.mesh, plan, None, inter, time.perf_counter() - t0),), acc.graph


def _hand_configured(args) -> bool:
    return bool(getattr(args, "pin", None) or getattr(args, "rules", None) or getattr(args, "baseline", None))


def _cli_pins(args, graph, mesh: MeshSpec) -> dict:
    """--pin / --rules / --baseline as one pins mapping (explicit pins first, then rules, then the baseline)."""
    pins: dict = {}
    for item in args.pin:
        pattern, eq, spec = item.partition("=")
        if not eq or not pattern.strip():
            raise CLIError(f"--pin {item!r} is not PATTERN=SPEC; write e.g. --pin 'wte/embedding=P((x,y), None)'")
        pins[pattern.strip()] = parse_spec_text(spec)
    if args.rules:
        pins.update(rules_file_pins(args.rules, graph, mesh))
    if args.baseline:
        shapes = [graph.tensors[t].shape for t in graph.inputs]
        for k, v in baseline_pins(args.baseline)(graph.input_paths, shapes, mesh).items():
            pins.setdefault(k, v)
    return pins


def _configured_results(args, graph, meshes, options, cluster):
    """The plan of one mesh with the configuration pinned (a --baseline pins every argument leaf)."""
    if args.mesh is None or len(meshes) != 1:
        raise CLIError("--pin / --rules / --baseline name mesh axes: give the mesh with --mesh, e.g. --mesh 2x4")
    mesh = meshes[0]
    pinned = resolve_pins(_cli_pins(args, graph, mesh), graph.input_paths,
                          [graph.tensors[t].shape for t in graph.inputs], mesh, complete=bool(args.baseline))
    inter = inter_host_axes(mesh.shape, cluster.devices_per_host) if cluster else options.inter_host_axes
    if args.baseline:
        options = dataclasses.replace(options, memory_budget=None)  # evaluated as it is; the table shows the fit
    t0 = time.perf_counter()
    plan = make_plan(graph, mesh, dataclasses.replace(options, inter_host_axes=inter), pins=pinned)
    what = [f"baseline {args.baseline}"] if args.baseline else []
    what += ["--pin"] * bool(args.pin) + ["--rules"] * bool(args.rules)
    plan = labelled(plan, " + ".join(what))
    log.info("%s: %d of %d argument leaves pinned", plan.solver["configuration"], len(pinned), len(graph.inputs))
    return (MeshResult(mesh, plan, None, inter, time.perf_counter() - t0),)


def _print_xla_flags(plan, out) -> None:
    """The XLA flags the prediction assumes (`Plan.xla_flags()`), ready to export."""
    flags = plan.xla_flags()
    if flags:
        print("\nXLA flags this prediction assumes (overlapped gradient reductions):\n"
              f"  XLA_FLAGS=\"{' '.join(flags)}\"", file=out)


def _check_output_paths(args) -> None:
    """--json / --html paths that cannot be written are refused before any planning."""
    for flag, path in (("--json", getattr(args, "json", None)), ("--html", getattr(args, "html", None))):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise CLIError(f"{flag} {path!r} is a directory; name a file")
        if not os.path.isdir(folder):
            raise CLIError(f"{flag} {path!r}: directory {folder!r} does not exist; create it or choose another path")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise CLIError(f"{flag} {path!r}: not writable; choose a writable path")


def _load_plan(path: str, flag: str) -> PlanView:
    """A saved plan; a profile database given instead is named as such (one line)."""
    try:
        with open(path) as f:
            head = json.load(f)
    except (OSError, ValueError):
        head = None  # PlanView.load says what is wrong with the file
    if isinstance(head, dict) and head.get("format") == "planner-profile":
        raise CLIError(f"{flag} {path!r} is a profile database (written by `planner profile`), not a plan; pass a "
                       "plan written by `planner plan --json FILE` (a profile goes to `planner plan --profile`)")
    return PlanView.load(path)


def _write_outputs(args, view, out) -> None:
    if getattr(args, "json", None):
        text = json.dumps(view.data, indent=1, sort_keys=True, default=_json_default)
        _write(args.json, text, "--json")
        print(f"\nplan written to {args.json}", file=out)
    if getattr(args, "html", None):
        _write(args.html, render_html(view), "--html")
        print(f"report written to {args.html}", file=out)


def _json_default(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "items"):
        return dict(value.items())
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write(path: str, text: str, flag: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"{flag} {path!r}: cannot write ({e.strerror}); choose a writable path") from None


def cmd_compare(args, out) -> int:
    """The planner's plan and the baselines (and --pin / --rules as "yours") on one mesh."""
    if args.list_models:
        print("\n".join(model_names()), file=out)
        return 0
    if bool(args.model) == bool(args.fn):
        raise CLIError("name what to compare: --model NAME or --fn MODULE:FACTORY, exactly one")
    if args.mesh is None or not _MESH.match(args.mesh):
        raise CLIError("compare needs one mesh: --mesh 2x4")
    _check_output_paths(args)
    names = [n.strip() for n in args.baselines.split(",")] if args.baselines else list(BASELINES)
    for n in names:
        try:
            parse_baseline(n)
        except PlannerError as e:
            raise CLIError(str(e)) from None
    num_devices, cluster = _target(args)
    mesh = candidate_specs(args, num_devices)[0]
    hardware = hardware_record(get_hardware(args.hardware))
    budget = _budget(args, hardware)
    options = _options(args, budget, cluster)
    staged = any(parse_baseline(n)[1] for n in names)  # a pipeline baseline: every row on the same (unrolled) model
    label, step, example = (load_model(args.model, args.batch, args.seq, args.dtype,
                                       get_hardware(args.hardware).default_dtype, pipelined=staged)
                            if args.model else load_factory(args.fn, args.batch, args.seq, args.dtype))
    t0 = time.perf_counter()
    graph = trace(step, *example)
    rows = []
    plan = make_plan(graph, mesh, options)
    planned_s = time.perf_counter() - t0
    for n in names:
        base, stages = parse_baseline(n)
        if stages:  # hand-chosen pipeline stages on the target (--cluster, or the mesh's devices as one host)
            try:
                rows.append((n, pipeline_baseline(step, example, graph, base, stages,
                                                  _pipeline_target(args, cluster, num_devices), options)[0]))
            except PlannerError as e:
                rows.append((n, _one_line(e)))
            continue
        args.baseline, saved = n, (args.pin, args.rules)
        args.pin, args.rules = [], None
        try:
            rows.append((n, _configured_results(args, graph, [mesh], options, cluster)[0].plan))
        except PlannerError as e:
            rows.append((n, _one_line(e)))
        args.pin, args.rules = saved
    args.baseline = None
    if args.pin or args.rules:
        pinned = resolve_pins(_cli_pins(args, graph, mesh), graph.input_paths,
                              [graph.tensors[t].shape for t in graph.inputs], mesh)
        rows.append(("yours", make_plan(graph, mesh, dataclasses.replace(options, memory_budget=None), pins=pinned)))
    others = [(n, p) for n, p in rows if not isinstance(p, str)]
    skipped = [(n, p) for n, p in rows if isinstance(p, str)]
    print(f"{label} on mesh {mesh}: the planner's plan beside hand configurations", file=out)
    record = comparison_record(plan, others, skipped, budget)
    print(format_record(record), file=out)
    if args.json or args.html:  # the plan's report, with the comparison beside it
        inter = options.inter_host_axes
        flops = matmul_flops(graph)
        ranked = mesh_ranking([MeshResult(mesh, plan, None, inter, planned_s)], flops, hardware)
        view = plan_view(ranked, graph, label, num_devices, cluster, hardware, budget, flops, planned_s)
        view = dataclasses.replace(view, data={**view.data, "context": {**view.context, "comparison": record}})
        _write_outputs(args, view, out)
    return 0


def cmd_explain(args, out) -> int:
    print(explain(_load_plan(args.plan_file, "explain"), op=args.op, top=args.top), file=out)
    return 0


def cmd_diff(args, out) -> int:
    print(diff(_load_plan(args.a, "diff"), _load_plan(args.b, "diff"), top=args.top), file=out)
    return 0


_PROFILE_MISSING = ("`planner profile` is not available in this installation (planner.cost_model.profiling is "
                    "missing); update the planner, or plan with the analytic cost model (omit --profile)")


def cmd_profile(args, profiling) -> int:
    if profiling is None:
        raise CLIError(_PROFILE_MISSING)
    return int(profiling.run(args) or 0)


# ----- entry point -----------------------------------------------------------------------------
class _Elapsed(logging.Formatter):
    def __init__(self, start: float):
        super().__init__("[planner %(elapsed)6.1fs] %(message)s")
        self.start = start

    def format(self, record):
        record.elapsed = record.created - self.start
        return super().format(record)


def _provide_cpu_devices(argv: Sequence[str]) -> None:
    """Lets a --fn factory build a jax Mesh of the planned size on a CPU-only machine.

    Planning itself never needs devices; this only helps user factories that call `jax.devices()`.
    It must run before JAX initialises its backends, so only the console-script entry point does it.
    """
    n = 0
    for flag, value in zip(argv, list(argv[1:]) + [""]):
        if flag == "--devices" and value.isdigit():
            n = int(value)
        elif flag in ("--mesh", "--cluster") and _MESH.match(value):
            n = math.prod(int(s) for s in value.replace(" ", "").split("x"))
    if n <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already up (an embedding program started JAX first): planning does not need them


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 bad input)."""
    console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    profiling = None
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "profile":
        try:
            profiling = _profiling_module()
        except Exception as e:  # a broken profiling module must not take the other commands down
            print(f"planner: error: cannot load planner.cost_model.profiling ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        if profiling is None and not {"-h", "--help"} & set(argv):
            print(f"planner: error: {_PROFILE_MISSING}", file=sys.stderr)
            return 2
    parser = build_parser(getattr(profiling, "add_arguments", None))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if console:
        _provide_cpu_devices(argv)
    handler = None
    if not getattr(args, "quiet", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Elapsed(time.time()))
        log.addHandler(handler)
    old_level = log.level
    if handler is not None:
        log.setLevel(logging.INFO)
    try:
        if args.command == "plan":
            return cmd_plan(args, sys.stdout)
        if args.command == "explain":
            return cmd_explain(args, sys.stdout)
        if args.command == "compare":
            return cmd_compare(args, sys.stdout)
        if args.command == "diff":
            return cmd_diff(args, sys.stdout)
        return cmd_profile(args, profiling)
    except (CLIError, PlannerError) as e:
        print(f"planner: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`planner plan ... | head`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
        return 0
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(old_level)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
