"""The `planner` command line's arguments: the parser of every subcommand and its argument types."""
from __future__ import annotations

import argparse

from planner.core.options import OFFLOAD_MODES
from planner.core.units import positive_int
from planner.cli.sweep import sizes
from planner.cost_model import DEFAULT_HARDWARE, PRESETS

# Printed under `planner --help`.
EXAMPLES = """\
    planner plan --model gpt2-small --devices 8                # search mesh shapes, print the best plan
    planner plan --model gpt3-39b --cluster 8x8 --json p.json --html p.html
    planner plan --fn mypkg.train:make_step --mesh 2x4         # your own (train_step, example_args) factory
    planner plan --from p.json                                 # re-print a saved plan
    planner explain p.json [--op fc_in]                        # why each choice, and the runner-up
    planner diff a.json b.json                                 # where two plans differ and what it costs
    planner plan --model gpt-tiny --mesh 2x4 --pin 'wte/embedding=P((x,y), None)'   # yours, the rest planned
    planner compare --model gpt-tiny --mesh 2x4                # the plan beside dp, fsdp, megatron-tp, ...
    planner compare --model gpt-tiny --mesh 2x4 --html c.html  # ... and the plan's report with that comparison
    planner profile ...                                        # offline profiling (planner.cost_model.profiling)"""


# ----- argument types --------------------------------------------------------------------------
def argnums(text: str) -> tuple[int, ...]:
    if text == "none":
        return ()
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of argument positions") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: argument positions are >= 0")
    return values


def accumulate(text: str):
    if text == "auto":
        return text
    if text == "off":
        return 1
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a positive number of microbatches")
    return k


# ----- `plan` and `compare` ---------------------------------------------------------------------
def _add_what(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", help="a model of the zoo (see --list-models)")
    what.add_argument("--fn", metavar="MODULE:FACTORY",
                      help="import FACTORY from MODULE (a module name or a .py path); FACTORY() returns "
                           "(train_step, example_args) with arrays or jax.ShapeDtypeStruct leaves")
    what.add_argument("--from", dest="from_file", metavar="FILE", help="re-print a plan saved with --json")
    what.add_argument("--list-models", action="store_true", help="print the zoo's model names and exit")


def _add_where(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("the target (one of; --mesh may combine with --cluster)")
    where.add_argument("--devices", type=positive_int, metavar="N", help="N devices on one host; search mesh shapes")
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


def _add_cost_model(opts) -> None:
    """The hardware and network the cost model prices, and the model's shapes."""
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
    opts.add_argument("--batch", type=sizes, help="override the model's batch size; `plan` takes several, "
                                                 "e.g. 256,512,1024: one plan per shape, in one run")
    opts.add_argument("--seq", type=sizes, help="override the model's sequence length (several: as --batch)")
    opts.add_argument("--memory-budget", metavar="SIZE",
                      help="per-device memory budget such as 80GB or 40GiB (default: the hardware's memory; "
                           "'none' for no limit)")


def _add_levers(opts) -> None:
    """Pipelining and the memory levers."""
    opts.add_argument("--pipeline", choices=("auto", "on", "off"), default=None,
                      help="split the program into pipeline stages (default: the planner's PlanOptions default)")
    opts.add_argument("--microbatches", type=positive_int, metavar="K", help="microbatches per step when pipelining")
    opts.add_argument("--accumulate", type=accumulate, default=None, metavar="auto|K|off",
                      help="gradient accumulation without pipelining: K microbatches per step (a loop inside the "
                           "step, one update), 'auto' for the fastest K that fits the memory budget, or 'off' "
                           "(default: weighed when no plan fits without a memory lever and the step is "
                           "microbatch-invariant)")
    opts.add_argument("--no-unshard", dest="unshard", action="store_false", default=True,
                      help="with --accumulate: reshard loop-invariant values (a sharded parameter's all-gather) "
                           "in every microbatch instead of once before the loop while memory allows (selective "
                           "unsharding, the default)")
    opts.add_argument("--offload", choices=OFFLOAD_MODES, default=None,
                      help="host offload of optimizer state in single-stage plans: 'opt-state' keeps all of it in "
                           "host memory between steps, 'opt-state+params' the float32 master parameters too, "
                           "'auto' (the default) only the part that does not fit the memory budget")
    opts.add_argument("--remat", choices=("off", "auto", "dots", "dots_no_batch", "full"), default=None,
                      help="recompute repeated layers' forward in the backward (single-stage plans): 'full' keeps "
                           "only each layer's inputs, 'dots' keeps matmul results, 'dots_no_batch' those without batch "
                           "dimensions (projections, not attention scores), 'auto' (the default) recomputes only "
                           "when the plan does not fit the memory budget, and only the first layers it needs")
    opts.add_argument("--donate", type=argnums, default=None, metavar="I[,J]",
                      help="argument positions whose buffers the step reuses, as jax.jit(donate_argnums=...), "
                           "or 'none'; default: 0 when the step returns a state like its first argument (a train "
                           "step: the new state is written over the old one), else none")


def _add_search(opts) -> None:
    """How the planner searches, and how much of it is printed."""
    opts.add_argument("--prefetch", nargs="?", const="on", choices=("auto", "on", "off"), default=None,
                      help="parameter all-gathers (ZeRO-3/FSDP) priced as issued ahead of their use, hidden behind "
                           "earlier compute: auto (default) weighs it on the chosen mesh of a single-stage plan and "
                           "keeps the faster plan; on (or --prefetch alone) on every mesh (a harder ILP: slower "
                           "planning); off never")
    opts.add_argument("--comm-precision", choices=("exact", "bf16", "int8"), default=None,
                      help="wire formats of collectives: exact (default: split contractions' partial sums reduced "
                           "in float32, as they accumulate unsharded), bf16 (in their results' dtype: half the "
                           "bytes) or int8 (as bf16, weights gathered and gradients reduced as int8 with block "
                           "scales)")
    opts.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                      help="ILP solver time limit per mesh shape (default: the planner's)")
    opts.add_argument("--top", type=positive_int, default=10, metavar="K", help="rows of the ranked mesh table (default 10)")


def _add_hand(p: argparse.ArgumentParser) -> None:
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


def _add_output(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the best plan as JSON")
    out.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    out.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `plan` and `compare` share, in their help groups."""
    _add_what(p)
    _add_where(p)
    opts = p.add_argument_group("options")
    _add_cost_model(opts)
    _add_levers(opts)
    _add_search(opts)
    _add_hand(p)
    _add_output(p)


# ----- the parser -------------------------------------------------------------------------------
def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan a model for a mesh or cluster and print the best plans",
                       description="Plan a model for a mesh or a cluster (abstractly: no accelerator needed).")
    add_plan_arguments(p)


def _add_explain_and_diff(sub) -> None:
    e = sub.add_parser("explain", help="explain a saved plan: costs per choice and the runner-up",
                       description="Explain a plan saved with `planner plan --json`.")
    e.add_argument("plan_file", metavar="PLAN.json")
    e.add_argument("--op", metavar="NAME", help="only decisions and collectives whose name contains NAME")
    e.add_argument("--top", type=positive_int, default=15, metavar="K", help="rows per section (default 15)")
    d = sub.add_parser("diff", help="compare two saved plans", description="Where two plans differ and what it costs.")
    d.add_argument("a", metavar="A.json")
    d.add_argument("b", metavar="B.json")
    d.add_argument("--top", type=positive_int, default=20, metavar="K", help="rows per section (default 20)")


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="the planner's plan beside named baselines (and your pins/rules)",
                       description="Plan a model on one mesh and evaluate hand configurations under the same cost "
                                   "model: step time, exposed communication, memory, bytes moved, and the places "
                                   "that make the difference; --html / --json write the plan's report with the "
                                   "comparison beside it.")
    add_plan_arguments(c)
    c.add_argument("--baselines", default=None, metavar="A,B,...",
                   help="baselines to compare (default: all of planner.configs.baselines.NAMES); NAME+ppN adds N even "
                        "pipeline stages, e.g. dp,megatron-tp,megatron-tp+pp2")


def _add_profile(sub, profile_arguments) -> None:
    pr = sub.add_parser("profile", help="measure collectives and write the cost-model database",
                        description="Offline profiling job (planner.cost_model.profiling).")
    if profile_arguments is not None:
        profile_arguments(pr)
    else:
        pr.add_argument("profile_args", nargs=argparse.REMAINDER)


def build_parser(profile_arguments=None) -> argparse.ArgumentParser:
    """The argument parser; `profile_arguments(parser)` fills the `profile` subcommand when available."""
    parser = argparse.ArgumentParser(
        prog="planner", description="Plan, explain and compare sharding plans for JAX train steps.",
        epilog="examples:\n" + EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_plan(sub)
    _add_explain_and_diff(sub)
    _add_compare(sub)
    _add_profile(sub, profile_arguments)
    return parser
