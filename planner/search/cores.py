"""The idle cores a search may solve on, and how many meshes it solves at once by threads."""
from __future__ import annotations

import os


def idle_cores() -> int:
    """The idle cores this process may run on: its cores less the load the rest of the machine puts
    on them, at least one. Solves on busy cores would only share them, and reach CP-SAT's
    wall-clock cap sooner (a plan stopped by it depends on the load, `cpsat.WALL_CAP_FACTOR`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        load = 0.0
    return spare_cores(cores, load)


def spare_cores(cores: int, load: float) -> int:
    """`cores` less the 1-minute `load` average that is not this process's own: the caller runs on
    one core while it asks (tracing, building the problems), and that thread is part of the load
    average, so up to one unit of it is ours (else an idle machine busy only with the planner itself
    would solve its independent problems one at a time)."""
    others = max(0.0, load - 1.0)
    return max(1, min(cores, int(cores - others + 0.5)))


def solve_threads(candidates: int, solver_workers: int, threads: int | None) -> int:
    """Meshes solved at once: `threads`, else the idle cores over each solve's CP-SAT workers
    (`idle_cores`); at least one, at most one per mesh to solve."""
    return max(1, min(candidates, idle_cores() // max(1, solver_workers) if threads is None else threads))
