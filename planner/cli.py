"""The `planner` command line: plan a model for a cluster, explain and compare plans, draw them.

    planner plan --model gpt2-small --devices 8                # search mesh shapes, print the best plan
    planner plan --model gpt3-39b --cluster 8x8 --json p.json --html p.html
    planner plan --fn mypkg.train:make_step --mesh 2x4         # your own (train_step, example_args) factory
    planner plan --from p.json                                 # re-print a saved plan
    planner explain p.json [--op fc_in]                        # why each choice, and the runner-up
    planner diff a.json b.json                                 # where two plans differ and what it costs
    planner profile ...                                        # offline profiling (planner.cost_model.profiling)

Planning is abstract: arguments are `jax.ShapeDtypeStruct`s and the target mesh is a description
(`MeshSpec`), so no accelerator (and no device of the planned count) is needed. Results go to
stdout, progress to stderr; bad input exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
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

from planner.cost_model import DEFAULT_HARDWARE, PRESETS, Cluster
from planner.errors import InfeasiblePlanError, PlannerError
from planner.graph import matmul_flops, trace
from planner.mesh import MeshSpec, default_axis_names
from planner.options import PlanOptions
from planner.present.diff import diff
from planner.present.explain import explain
from planner.present.html_report import render_html
from planner.present.ranking import hardware_record, mesh_ranking, pipeline_ranking, plan_view
from planner.present.report import PlanView, fmt_bytes, format_plan
from planner.programs import load_factory, load_model
from planner.search import candidate_meshes, inter_host_axes, search_meshes
from planner.stages import make_cluster, plan_stages
from planner.units import parse_bytes
from zoo import model_names

__all__ = ["CLIError", "build_parser", "inter_host_axes", "main"]

log = logging.getLogger("planner")

_MESH = re.compile(r"^\s*\d+(\s*x\s*\d+)*\s*$")


class CLIError(Exception):
    """A problem with the command line itself; printed as one line, exit status 2."""


# ----- argument parsing ------------------------------------------------------------------------
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
    where.add_argument("--cluster", metavar="HOSTSxDEVICES",
                       help="HOSTS hosts with DEVICES devices each, e.g. 2x8 or 2x8:h100; mesh axes that cross "
                            "hosts use the slower inter-host links")
    opts = p.add_argument_group("options")
    opts.add_argument("--hardware", help="hardware preset of the cost model: "
                      + ", ".join(sorted(PRESETS)) + f" (default {DEFAULT_HARDWARE.name})")
    opts.add_argument("--profile", metavar="FILE", help="profile database written by `planner profile`")
    opts.add_argument("--batch", type=_positive_int, help="override the model's batch size")
    opts.add_argument("--seq", type=_positive_int, help="override the model's sequence length")
    opts.add_argument("--memory-budget", metavar="SIZE",
                      help="per-device memory budget such as 80GB or 40GiB (default: the hardware's memory; "
                           "'none' for no limit)")
    opts.add_argument("--pipeline", choices=("auto", "on", "off"), default=None,
                      help="split the program into pipeline stages (default: the planner's PlanOptions default)")
    opts.add_argument("--microbatches", type=_positive_int, metavar="K", help="microbatches per step when pipelining")
    opts.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                      help="ILP solver time limit per mesh shape (default: the planner's)")
    opts.add_argument("--top", type=_positive_int, default=10, metavar="K", help="rows of the ranked mesh table (default 10)")
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


def candidate_specs(args, num_devices: int):
    """The MeshSpecs to plan: the --mesh one, or every candidate shape of the device count."""
    if args.mesh is not None:
        if not _MESH.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        shape = tuple(int(s) for s in args.mesh.replace(" ", "").split("x"))
        if math.prod(shape) != num_devices:
            raise CLIError(f"--mesh {args.mesh} has {math.prod(shape)} devices but the target has {num_devices}; "
                           f"choose sizes whose product is {num_devices}")
        return [MeshSpec(shape, default_axis_names(len(shape)))]
    return candidate_meshes(num_devices)


def _target(args) -> tuple[int, Cluster | None]:
    given = [n for n, v in (("--devices", args.devices), ("--cluster", args.cluster)) if v is not None]
    if len(given) > 1:
        raise CLIError("give one of --devices N or --cluster HOSTSxDEVICES, not both")
    if args.cluster is not None:
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


def _budget(args, hardware: dict) -> float | None:
    if args.memory_budget is None:
        return float(hardware["memory_bytes"])
    if args.memory_budget.strip().lower() in ("none", "off", "0", "unlimited"):
        return None
    return parse_bytes(args.memory_budget, "--memory-budget")


def _options(args, budget: float | None) -> PlanOptions:
    base = {"memory_budget": budget, "hardware": args.hardware, "profile": args.profile,
            "num_microbatches": args.microbatches}
    if args.pipeline is not None:
        base["pipeline"] = {"auto": "auto", "on": True, "off": False}[args.pipeline]
    if args.time_limit is not None:
        base["solver_time_limit"] = args.time_limit
    return PlanOptions.from_kwargs(base)


def _no_plan(results, budget: float | None) -> Exception:
    over = [r for r in results if r.over_budget]
    if not over:
        return CLIError("no mesh shape could be planned: " + "; ".join(f"{r.mesh}: {r.error}" for r in results))
    need = min((r.min_memory_bytes or math.inf) for r in over)
    return InfeasiblePlanError(
        f"no mesh shape fits the memory budget of {fmt_bytes(budget) if budget else 'no limit'} per device"
        + (f" (the smallest reachable peak is {fmt_bytes(need)})" if need < math.inf else "")
        + "; raise --memory-budget, plan for more devices, or enable --pipeline")


# ----- commands --------------------------------------------------------------------------------
def cmd_plan(args, out) -> int:
    if args.list_models:
        print("\n".join(model_names()), file=out)
        return 0
    if args.from_file is not None:
        if args.model or args.fn:
            raise CLIError("--from FILE re-prints a saved plan; drop --model / --fn")
        view = PlanView.load(args.from_file)
        print(format_plan(view, args.top), file=out)
        _write_outputs(args, view, out)
        return 0
    if bool(args.model) == bool(args.fn):
        raise CLIError("name what to plan: --model NAME (see --list-models) or --fn MODULE:FACTORY, exactly one")
    num_devices, cluster = _target(args)
    pipelined = args.pipeline in ("on", "auto")
    if pipelined and args.mesh is not None:
        raise CLIError("--mesh fixes one logical mesh but --pipeline searches submeshes and their meshes itself; "
                       "drop --mesh or use --pipeline off")
    meshes = [] if pipelined else candidate_specs(args, num_devices)
    try:
        hardware = hardware_record(args.hardware)
    except ValueError as e:
        raise CLIError(f"--hardware {args.hardware!r}: {e}") from None
    budget = _budget(args, hardware)
    if args.profile is not None and not os.path.isfile(args.profile):
        raise CLIError(f"--profile {args.profile!r} does not exist; write one with `planner profile` or drop --profile")
    options = _options(args, budget)

    t0 = time.perf_counter()
    label, step, example = (load_model(args.model, args.batch, args.seq) if args.model
                            else load_factory(args.fn, args.batch, args.seq))
    log.info("tracing %s ...", label)
    graph = trace(step, *example)
    log.info("traced %d ops, %d inputs in %.1fs", len(graph.ops), len(graph.inputs), time.perf_counter() - t0)
    flops = matmul_flops(graph)
    if pipelined:
        hosts, per_host = (cluster.hosts, cluster.devices_per_host) if cluster else (1, num_devices)
        try:
            target = make_cluster(hosts, per_host, args.hardware)
        except (ValueError, PlannerError) as e:
            raise CLIError(f"cannot build the {hosts}x{per_host} cluster: {e}") from None
        log.info("planning pipeline stages on %d host(s) x %d device(s) ...", hosts, per_host)
        t1 = time.perf_counter()
        plan, pp = plan_stages(step, example, graph, target, options)
        ranked = pipeline_ranking(plan, pp, target, flops, hardware, time.perf_counter() - t1)
        log.info("pipeline: %d stage(s), %.4g s/step, planned in %.1fs", pp.num_stages,
                 plan.prediction.step_time_s, time.perf_counter() - t1)
    else:
        results = search_meshes(graph, meshes, options, cluster.devices_per_host if cluster else None)
        if results[0].plan is None:
            raise _no_plan(results, budget)
        ranked = mesh_ranking(results, flops, hardware)
        log.info("planned %d mesh shape(s) in %.1fs", len(meshes), time.perf_counter() - t0)
    view = plan_view(ranked, graph, label, num_devices, cluster, hardware, budget, flops, time.perf_counter() - t0)
    print(format_plan(view, args.top), file=out)
    _write_outputs(args, view, out)
    return 0


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


def cmd_explain(args, out) -> int:
    print(explain(PlanView.load(args.plan_file), op=args.op, top=args.top), file=out)
    return 0


def cmd_diff(args, out) -> int:
    print(diff(PlanView.load(args.a), PlanView.load(args.b), top=args.top), file=out)
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
