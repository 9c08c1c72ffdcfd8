"""`planner explain` and `planner diff`: a saved plan's choices, and where two plans differ."""
from __future__ import annotations

from planner.present.diff import diff
from planner.present.explain import explain
from planner.cli.output import load_plan


def cmd_explain(args, out) -> int:
    print(explain(load_plan(args.plan_file, "explain"), op=args.op, top=args.top), file=out)
    return 0


def cmd_diff(args, out) -> int:
    print(diff(load_plan(args.a, "diff"), load_plan(args.b, "diff"), top=args.top), file=out)
    return 0
