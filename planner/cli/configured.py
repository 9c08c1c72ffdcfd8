"""The user's own configuration on one mesh: --pin, --rules and --baseline as pins, and its plan."""
from __future__ import annotations

import dataclasses
import logging
import time

from planner.configs.baselines import baseline_pins
from planner.configs.pins import parse_spec_text, resolve as resolve_pins
from planner.core.mesh import MeshSpec
from planner.planning.evaluate import labelled
from planner.present.logical_axes import rules_file_pins
from planner.search.mesh_plan import make_plan
from planner.search.candidates import inter_host_axes
from planner.search.results import MeshResult
from planner.cli.errors import CLIError

log = logging.getLogger("planner")


def cli_pins(args, graph, mesh: MeshSpec) -> dict:
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


def configured_results(args, graph, meshes, options, cluster):
    """The plan of one mesh with the configuration pinned (a --baseline pins every argument leaf)."""
    if args.mesh is None or len(meshes) != 1:
        raise CLIError("--pin / --rules / --baseline name mesh axes: give the mesh with --mesh, e.g. --mesh 2x4")
    mesh = meshes[0]
    pinned = resolve_pins(cli_pins(args, graph, mesh), graph.input_paths,
                          [graph.tensors[t].shape for t in graph.inputs], mesh, complete=bool(args.baseline))
    inter = inter_host_axes(mesh.shape, cluster.devices_per_host) if cluster else options.inter_host_axes
    if args.baseline:
        options = dataclasses.replace(options, memory_budget=None)  # evaluated as it is; the table shows the fit
    t0 = time.perf_counter()
    plan = make_plan(graph, mesh, dataclasses.replace(options, inter_host_axes=inter), pins=pinned)
    what = [f"baseline {args.baseline}"] if args.baseline else []
    what += ["--pin"] * bool(args.pin) + ["--rules"] * bool(args.rules)
    plan = labelled(plan, " + ".join(what))
    log.info("%s: %d of %d argument leaves pinned", plan.solver.configuration, len(pinned), len(graph.inputs))
    return (MeshResult(mesh, plan, None, inter, time.perf_counter() - t0),)
