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
import inspect
import io
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from planner.cost_model import DEFAULT_HARDWARE, PRESETS

log = logging.getLogger("planner")

_CLUSTER = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*([\w.-]+))?\s*$")
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


# ----- programs --------------------------------------------------------------------------------
def load_model(name: str, batch: int | None, seq: int | None):
    """(label, train_step, example_args) of a zoo model, abstract (ShapeDtypeStruct leaves)."""
    from planner.models import UnknownModelError, get_model, model_names

    overrides = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
    try:
        bundle = get_model(name, **overrides)
    except UnknownModelError:
        raise CLIError(f"unknown model {name!r}; choose one of {', '.join(model_names())} "
                       "or pass your own with --fn MODULE:FACTORY") from None
    except (TypeError, ValueError) as e:
        raise CLIError(f"model {name!r} does not accept {overrides}: {e}") from None
    label = name + "".join(f" {k}={v}" for k, v in overrides.items())
    return label, bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch())


def load_factory(spec: str, batch: int | None, seq: int | None):
    """(label, train_step, example_args) from a user factory `MODULE:FACTORY`."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"--fn {spec!r} is not MODULE:FACTORY; write e.g. --fn mypkg.train:make_step "
                       "or --fn path/to/train.py:make_step")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise CLIError(f"--fn {spec!r}: file {module_name!r} does not exist; check the path")
            mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0],
                                                              module_name)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except CLIError:
        raise
    except ImportError as e:
        raise CLIError(f"--fn {spec!r}: cannot import {module_name!r} ({e}); run from the directory that holds it "
                       "or set PYTHONPATH") from None
    except Exception as e:  # the user's module failed while loading: name it, no traceback
        raise CLIError(f"--fn {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}; fix the module") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"--fn {spec!r}: module {module_name!r} has no callable {attr!r}; name a function that "
                       "returns (train_step, example_args)")
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
    try:
        if kwargs:
            inspect.signature(factory).bind(**kwargs)
    except TypeError:
        raise CLIError(f"--fn {spec!r}: {attr}() takes no {', '.join(kwargs)} argument; drop "
                       f"{' '.join('--' + k for k in kwargs)} or add the parameter to the factory") from None
    except ValueError:
        pass
    try:
        result = factory(**kwargs)
    except Exception as e:
        raise CLIError(f"--fn {spec!r}: {attr}() raised {type(e).__name__}: {e}; fix the factory") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[0])):
        raise CLIError(f"--fn {spec!r}: {attr}() returned {type(result).__name__}, not (train_step, example_args); "
                       "return the step function and a tuple of its example arguments")
    step, args = result
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    return spec, step, args


# ----- targets ---------------------------------------------------------------------------------
def parse_cluster(text: str) -> tuple[int, int, str | None]:
    """`"2x8"` or `"2x8:h100"` -> (hosts, devices per host, hardware preset or None)."""
    m = _CLUSTER.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise CLIError(f"--cluster {text!r} is not HOSTSxDEVICES; write e.g. --cluster 2x8 for 2 hosts with "
                       "8 devices each (optionally 2x8:h100 to name the hardware)")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def inter_host_axes(shape: Sequence[int], devices_per_host: int) -> tuple[int, ...]:
    """Mesh axes whose device groups span more than one host.

    Devices are numbered host-major (host h owns devices h*D ... h*D+D-1) and laid out row-major on
    the mesh, as `jax.make_mesh` does for a uniform cluster.
    """
    import numpy as np

    hosts = (np.arange(math.prod(shape)) // devices_per_host).reshape(tuple(shape))
    out = []
    for a in range(len(shape)):
        moved = np.moveaxis(hosts, a, -1)
        if shape[a] > 1 and np.any(moved != moved[..., :1]):
            out.append(a)
    return tuple(out)


def candidate_specs(args, num_devices: int):
    """The MeshSpecs to plan: the --mesh one, or every candidate shape of the device count."""
    from planner import MeshSpec, candidate_meshes
    from planner.mesh import default_axis_names

    if args.mesh is not None:
        if not _MESH.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        shape = tuple(int(s) for s in args.mesh.replace(" ", "").split("x"))
        if math.prod(shape) != num_devices:
            raise CLIError(f"--mesh {args.mesh} has {math.prod(shape)} devices but the target has {num_devices}; "
                           f"choose sizes whose product is {num_devices}")
        return [MeshSpec(shape, default_axis_names(len(shape)))]
    return candidate_meshes(num_devices)


def _target(args) -> tuple[int, tuple[int, int] | None]:
    given = [n for n, v in (("--devices", args.devices), ("--cluster", args.cluster)) if v is not None]
    if len(given) > 1:
        raise CLIError("give one of --devices N or --cluster HOSTSxDEVICES, not both")
    if args.cluster is not None:
        hosts, per_host, preset = parse_cluster(args.cluster)
        if preset is not None:
            if args.hardware is not None and args.hardware.lower() != preset.lower():
                raise CLIError(f"--cluster {args.cluster} names hardware {preset!r} but --hardware is "
                               f"{args.hardware!r}; give it once")
            args.hardware = preset
        return hosts * per_host, (hosts, per_host)
    if args.devices is not None:
        return args.devices, None
    if args.mesh is not None:
        if not _MESH.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        return math.prod(int(s) for s in args.mesh.replace(" ", "").split("x")), None
    raise CLIError("say where to plan for: --devices N, --mesh 2x4 or --cluster HOSTSxDEVICES")


# ----- facts about the program -----------------------------------------------------------------
def model_flops(graph) -> dict[str, float]:
    """Matmul FLOPs per step by dtype: 2 x output size x contracted size of every dot_general."""
    out: dict[str, float] = {}
    for op in graph.ops:
        if op.name != "dot_general":
            continue
        (lhs_contract, _), _ = op.params["dimension_numbers"]
        lhs = graph.tensors[op.inputs[0]] if isinstance(op.inputs[0], int) else op.inputs[0].tensor
        res = graph.tensors[op.outputs[0]]
        flops = 2.0 * res.size * math.prod(lhs.shape[d] for d in lhs_contract)
        key = str(lhs.dtype)
        out[key] = out.get(key, 0.0) + flops
    return out


def _hardware_record(name) -> dict:
    from planner.cost_model import get_hardware

    hw = get_hardware(name)
    return {"name": hw.name, "flops_f32": hw.flops_f32, "flops_bf16": hw.flops_bf16, "memory_bytes": hw.memory_bytes}


def _budget(args, hardware: dict) -> float | None:
    from planner.options import parse_bytes

    if args.memory_budget is None:
        return float(hardware["memory_bytes"])
    if args.memory_budget.strip().lower() in ("none", "off", "0", "unlimited"):
        return None
    return parse_bytes(args.memory_budget, "--memory-budget")


# ----- commands --------------------------------------------------------------------------------
def cmd_plan(args, out) -> int:
    from planner.report import PlanView, format_plan

    if args.list_models:
        from planner.models import model_names

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
    specs = [] if pipelined else candidate_specs(args, num_devices)
    try:
        hardware = _hardware_record(args.hardware)
    except ValueError as e:
        raise CLIError(f"--hardware {args.hardware!r}: {e}") from None
    budget = _budget(args, hardware)
    if args.profile is not None and not os.path.isfile(args.profile):
        raise CLIError(f"--profile {args.profile!r} does not exist; write one with `planner profile` or drop --profile")

    import planner

    t0 = time.perf_counter()
    label, step, example = (load_model(args.model, args.batch, args.seq) if args.model
                            else load_factory(args.fn, args.batch, args.seq))
    log.info("tracing %s ...", label)
    graph = planner.trace(step, *example)
    log.info("traced %d ops, %d inputs in %.1fs", len(graph.ops), len(graph.inputs), time.perf_counter() - t0)
    base = {"memory_budget": budget, "hardware": args.hardware, "profile": args.profile,
            "num_microbatches": args.microbatches}
    if args.pipeline is not None:
        base["pipeline"] = {"auto": "auto", "on": True, "off": False}[args.pipeline]
    if args.time_limit is not None:
        base["solver_time_limit"] = args.time_limit
    flops = model_flops(graph)
    if pipelined:
        ranked = plan_stages(step, example, graph, base, cluster or (1, num_devices), args.hardware, flops, hardware)
    else:
        ranked = plan_meshes(graph, specs, base, cluster, flops, hardware)
    best = ranked[0][1]
    data = best.to_dict()
    multi_stage = bool(best.pipeline) and len(best.stages) > 1
    data["context"] = {
        "model": label,
        "devices": num_devices,
        "cluster": None if cluster is None else {"hosts": cluster[0], "devices_per_host": cluster[1]},
        "cluster_text": (f"{cluster[0]} hosts x {cluster[1]} devices" if cluster else f"{num_devices} devices"),
        "inter_host_axes": ([0] if multi_stage and best.mesh.ndim > 1 else
                            list(best.options.get("inter_host_axes", ()))),
        "hardware": hardware,
        "memory_budget_bytes": budget,
        "input_shapes": [list(graph.tensors[t].shape) for t in graph.inputs],
        "input_dtypes": [str(graph.tensors[t].dtype) for t in graph.inputs],
        "model_flops": flops,
        "params": sum(graph.tensors[t].size for t, p in zip(graph.inputs, graph.input_paths) if "['params']" in p),
        "ranking": [row for row, _ in ranked],
        "planning_time_s": round(time.perf_counter() - t0, 2),
    }
    view = PlanView.from_dict(data)
    if view.rules is not None and not multi_stage:  # a multi-stage plan's top-level specs are placeholders
        data["context"]["logical_axis_rules"] = view.rules.to_dict()
    if pipelined:
        log.info("planned the pipeline in %.1fs", time.perf_counter() - t0)
    else:
        log.info("planned %d mesh shape(s) in %.1fs", len(specs), time.perf_counter() - t0)
    print(format_plan(view, args.top), file=out)
    _write_outputs(args, view, out)
    return 0


def plan_meshes(graph, specs, base: dict, cluster, flops, hardware) -> list[tuple[dict, Any]]:
    """Plans `graph` on every mesh of `specs`; (ranking row, Plan or None), best first, failures last.

    Raises:
      InfeasiblePlanError: no mesh fits the memory budget.
      CLIError: no mesh could be planned for another reason.
    """
    import planner
    from planner.planning import make_plan
    from planner.report import mfu

    done, failed = [], []
    for k, spec in enumerate(specs, 1):
        inter = inter_host_axes(spec.shape, cluster[1]) if cluster else ()
        options = planner.PlanOptions.from_kwargs({**base, "inter_host_axes": inter})
        axes_text = ", ".join(f"{n}={s}" + ("*" if i in inter else "") for i, (n, s) in
                              enumerate(zip(spec.axis_names, spec.shape)))
        row = {"mesh": str(spec), "axes": axes_text, "inter_host_axes": list(inter)}
        log.info("planning mesh %s (%d/%d) ...", spec, k, len(specs))
        t1 = time.perf_counter()
        try:
            plan = make_plan(graph, spec, options)
        except planner.InfeasiblePlanError as e:
            row.update(status="over budget", memory_bytes_per_device=e.min_memory_bytes,
                       note=f"needs >= {_short_bytes(e.min_memory_bytes)}" if e.min_memory_bytes else "")
            failed.append((row, str(e)))
            log.info("mesh %s: no plan fits the budget", spec)
            continue
        except planner.MeshError as e:
            row.update(status="unusable", note=str(e).split(";")[0])
            failed.append((row, str(e)))
            log.info("mesh %s: %s", spec, e)
            continue
        p = plan.prediction
        row.update(status="ok", stages=max(1, len(plan.stages)), step_time_s=p.step_time_s,
                   memory_bytes_per_device=p.memory_bytes_per_device, bytes_moved_per_device=p.bytes_moved_per_device,
                   mfu=mfu(flops, hardware, p.step_time_s, spec.size), plan_time_s=round(time.perf_counter() - t1, 2))
        done.append((row, plan))
        log.info("mesh %s: %.4g s/step, %s/device, planned in %.1fs", spec, p.step_time_s,
                 _short_bytes(p.memory_bytes_per_device), time.perf_counter() - t1)
    if not done:
        over = [row for row, _ in failed if row["status"] == "over budget"]
        if over:
            need = min((row.get("memory_bytes_per_device") or math.inf) for row in over)
            raise planner.InfeasiblePlanError(
                f"no mesh shape fits the memory budget of {_short_bytes(base['memory_budget'])} per device"
                + (f" (the smallest reachable peak is {_short_bytes(need)})" if need < math.inf else "")
                + "; raise --memory-budget, plan for more devices, or enable --pipeline")
        raise CLIError("no mesh shape could be planned: " + "; ".join(f"{row['mesh']}: {e}" for row, e in failed))
    done.sort(key=lambda r: r[1].prediction.step_time_s)
    failed.sort(key=lambda r: (r[0]["status"] != "over budget", r[0].get("memory_bytes_per_device") or 0))
    return done + [(row, None) for row, _ in failed]


def plan_stages(step, example, graph, base: dict, cluster: tuple[int, int], hardware_name, flops,
                hardware) -> list[tuple[dict, Any]]:
    """Plans pipeline stages on the cluster (the planner searches submeshes and logical meshes).

    Returns:
      [(ranking row, Plan)] with the chosen plan first; under --pipeline auto, when several stages
      win, a second informational row gives the best single-stage step time.
    """
    import dataclasses
    from types import MappingProxyType

    import planner
    from planner.planning import make_plan
    from planner.report import fmt_time, mfu
    from planner.stages import make_cluster, plan_pipeline, to_plan

    hosts, per_host = cluster
    try:
        target = make_cluster(hosts, per_host, hardware_name)
    except (ValueError, planner.PlannerError) as e:
        raise CLIError(f"cannot build the {hosts}x{per_host} cluster: {e}") from None
    options = planner.PlanOptions.from_kwargs(base)
    log.info("planning pipeline stages on %d host(s) x %d device(s) ...", hosts, per_host)
    t1 = time.perf_counter()
    pp = plan_pipeline(step, example, target, options, full_graph=graph)
    if pp.num_stages == 1:  # --pipeline auto chose no pipelining: the intra-op plan on the chosen mesh
        st = pp.stages[0]
        plan = make_plan(graph, st.mesh, dataclasses.replace(options, inter_host_axes=st.host_axes))
        plan = dataclasses.replace(plan, pipeline=MappingProxyType(pp.to_dict()))
        mesh_text, inter = str(st.mesh), list(st.host_axes)
        axes = ", ".join(f"{n}={s}" + ("*" if i in inter else "")
                         for i, (n, s) in enumerate(zip(st.mesh.axis_names, st.mesh.shape)))
        note = "single stage"
    else:
        plan = to_plan(pp, graph, target, options)
        mesh_text = f"{hosts}x{per_host}" if hosts > 1 else str(per_host)
        axes = f"{pp.num_stages} stages on submeshes " + ", ".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in pp.stages)
        inter = []
        note = f"{pp.schedule}, {pp.num_microbatches} microbatches, bubble {pp.bubble_fraction:.1%}"
    p = plan.prediction
    row = {"mesh": mesh_text, "axes": axes, "inter_host_axes": inter, "status": "ok", "stages": pp.num_stages,
           "step_time_s": p.step_time_s, "memory_bytes_per_device": p.memory_bytes_per_device,
           "bytes_moved_per_device": p.bytes_moved_per_device,
           "mfu": mfu(flops, hardware, p.step_time_s, hosts * per_host), "note": note,
           "plan_time_s": round(time.perf_counter() - t1, 2)}
    out: list[tuple[dict, Any]] = [(row, plan)]
    single = pp.single_stage_time_s
    if pp.num_stages > 1 and single is not None:
        out.append(({"mesh": mesh_text, "axes": "whole cluster, no microbatching", "status": "single stage",
                     "note": f"{fmt_time(single)}/step" if math.isfinite(single) else "does not fit the budget"}, None))
    log.info("pipeline: %d stage(s), %.4g s/step, planned in %.1fs", pp.num_stages, p.step_time_s,
             time.perf_counter() - t1)
    return out


def _short_bytes(n) -> str:
    from planner.report import fmt_bytes

    return fmt_bytes(n) if n is not None else "no limit"


def _write_outputs(args, view, out) -> None:
    if getattr(args, "json", None):
        text = json.dumps(view.data, indent=1, sort_keys=True, default=_json_default)
        _write(args.json, text, "--json")
        print(f"\nplan written to {args.json}", file=out)
    if getattr(args, "html", None):
        from planner.html_report import render_html

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
    from planner.explain import explain
    from planner.report import PlanView

    print(explain(PlanView.load(args.plan_file), op=args.op, top=args.top), file=out)
    return 0


def cmd_diff(args, out) -> int:
    from planner.explain import diff
    from planner.report import PlanView

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
    from planner.errors import PlannerError

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
