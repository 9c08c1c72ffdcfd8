"""The memory levers a single-stage plan has (`LEVERS`), as the message of a budget no plan fits
names them."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.ilp.problem import Problem


@dataclasses.dataclass(frozen=True, slots=True)
class Lever:
    """A way to need less memory per device, as the message of a budget no plan fits names it.

    Attributes:
      name: what it is ("host offload").
      state: "tried" (the plans searched use it), "option" (the user can turn it on, `how`) or
        "missing" (not available in single-stage plans yet).
      how: for an option, how to turn it on (API and CLI).
    """

    name: str
    state: str
    how: str = ""


# The levers an infeasible single-stage budget reports, in the order the message lists them. A new
# lever is one more entry here (or an entry's state changed to "tried").
LEVERS: tuple[Lever, ...] = (
    Lever("sharding every tensor", "tried"),
    Lever("gradient accumulation", "option", "accumulate='auto' (--accumulate auto)"),
    Lever("pipeline stages with recomputation", "option", "pipeline='auto' (--pipeline auto)"),
    Lever("rematerialisation", "option", "remat='auto' (--remat auto)"),
    Lever("host offload", "option", "offload='auto' (--offload auto)"),
    Lever("donating the train state", "option", "plan_parallel(donate_argnums=0) (--donate 0)"),
)


# How every "does not fit" answer ends.
RAISE = "Raise the memory budget (memory_budget, --memory-budget) or use more devices"


def marked_tried(levers: Sequence[Lever], names: Sequence[str]) -> tuple[Lever, ...]:
    """`levers` with those named `names` marked tried."""
    return tuple(dataclasses.replace(v, state="tried") if v.name in names else v for v in levers)


def levers_of(problem: Problem, levers: Sequence[Lever] = LEVERS) -> tuple[Lever, ...]:
    """`levers` with those `problem` uses marked tried: host offload, donated arguments."""
    used = {"host offload": bool(problem.offloaded), "donating the train state": bool(problem.donated)}
    return tuple(dataclasses.replace(v, state="tried") if used.get(v.name) else v for v in levers)


def levers_text(levers: Sequence[Lever] = LEVERS) -> str:
    """The levers as one sentence group: tried, other options (how), not available yet."""
    tried = [v.name for v in levers if v.state == "tried"]
    options = [f"{v.name}: {v.how}" if v.how else v.name for v in levers if v.state == "option"]
    missing = [v.name for v in levers if v.state == "missing"]
    parts = [f"Tried: {', '.join(tried) or 'nothing'}"]
    if options:
        parts.append(f"Other levers: {'; '.join(options)}")
    if missing:
        parts.append(f"Not available in single-stage plans yet: {', '.join(missing)}")
    return ". ".join(parts)
