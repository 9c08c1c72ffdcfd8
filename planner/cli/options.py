"""How `planner plan` plans: the memory budget, the `PlanOptions` and the hand configuration flags."""
from __future__ import annotations

import dataclasses

from planner.configs.baselines import parse_baseline
from planner.core.errors import PlannerError
from planner.core.options import PlanOptions
from planner.core.units import parse_bytes
from planner.cost_model import Cluster, get_hardware
from planner.graph.donation import returns_its_argument
from planner.graph.ir import Graph
from planner.cli.errors import CLIError


def unlimited(args) -> bool:
    """--memory-budget asks for no limit."""
    return args.memory_budget is not None and args.memory_budget.strip().lower() in ("none", "off", "0", "unlimited")


def budget(args, hardware: dict) -> float | None:
    """Bytes per device of --memory-budget (default: the hardware's memory); None for no limit."""
    if args.memory_budget is None:
        return float(hardware["memory_bytes"])
    if unlimited(args):
        return None
    return parse_bytes(args.memory_budget, "--memory-budget")


def hand_configured(args) -> bool:
    """--pin, --rules or --baseline: the user's configuration rather than the planner's search."""
    return bool(getattr(args, "pin", None) or getattr(args, "rules", None) or getattr(args, "baseline", None))


def _levers(args) -> dict:
    """The PlanOptions of --accumulate, --prefetch, --comm-precision, --offload, --donate and --remat."""
    base = {}
    if getattr(args, "accumulate", None) is not None:
        if hand_configured(args):
            raise CLIError("--accumulate is not supported with --pin / --rules / --baseline yet; drop one")
        base["accumulate"] = args.accumulate
        base["unshard"] = getattr(args, "unshard", True)
    if args.time_limit is not None:
        base["solver_time_limit"] = args.time_limit
    if getattr(args, "prefetch", None) in ("on", "off"):
        base["prefetch"] = args.prefetch == "on"
    if getattr(args, "comm_precision", None) is not None:
        base["comm_precision"] = args.comm_precision
    if getattr(args, "offload", None) is not None:
        base["offload"] = args.offload
    if getattr(args, "donate", None) is not None:
        base["donate_argnums"] = args.donate
    if getattr(args, "remat", None) is not None:
        if hand_configured(args):
            raise CLIError("--remat is not supported with --pin / --rules / --baseline yet; drop one")
        base["remat"] = args.remat
    return base


def plan_options(args, budget: float | None, cluster: Cluster | None = None) -> PlanOptions:
    """The `PlanOptions` the flags ask for, under the memory `budget`."""
    base = {"memory_budget": budget, "hardware": args.hardware, "profile": args.profile,
            "num_microbatches": args.microbatches, "inter_host": args.inter_host, "intra_host": args.intra_host}
    if cluster is not None and cluster.topology is not None:
        base["hardware"] = str(cluster)  # each axis priced by the levels it spans (`cost_model.topology`)
    elif cluster is not None and (args.inter_host or args.intra_host):
        # the hosts' network is shared by the cluster's devices per host, not the preset's
        base["hardware"] = f"{cluster.hosts}x{cluster.devices_per_host}:{get_hardware(args.hardware).name}"
    if args.pipeline is not None:
        base["pipeline"] = {"auto": "auto", "on": True, "off": False}[args.pipeline]
    base.update(_levers(args))
    return PlanOptions.from_kwargs(base)


def pp_baseline(args) -> tuple[str | None, int | None]:
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


def donated_state(args, options: PlanOptions, graph: Graph) -> tuple[PlanOptions, str | None]:
    """Without --donate, a step that returns a state like its first argument is planned with that
    argument donated, as a train step runs (`jax.jit(step, donate_argnums=0)`): the options, and the
    line the command prints to say so (None when it assumes nothing)."""
    if args.donate is not None or options.donate_argnums or not returns_its_argument(graph, 0):
        return options, None
    return dataclasses.replace(options, donate_argnums=(0,)), (
        "Assumed donate_argnums=(0,): the step returns a state like its first argument, whose buffers the "
        "compiled step reuses (--donate none plans without).")
