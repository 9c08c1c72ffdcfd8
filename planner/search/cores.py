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
    return spare_cores(cores, load, _own_load())


def spare_cores(cores: int, load: float, own: float = 1.0) -> int:
    """`cores` less the 1-minute `load` average that is not this process's own: the caller runs on
    one core while it asks (tracing, building the problems), and that thread is part of the load
    average, so up to one unit of it is ours (else an idle machine busy only with the planner itself
    would solve its independent problems one at a time); `own`, the cores this process kept busy on
    average (its CPU time over its age), when more: its own solver threads raise the load average
    too (a pipeline search that solved on both cores of a 2-core machine saw a load near 2 and went
    on with one thread)."""
    others = max(0.0, load - max(1.0, own))
    return max(1, min(cores, int(cores - others + 0.5)))


def _own_load() -> float:
    """This process's CPU seconds over its age in seconds (Linux: `/proc`); 1.0 where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        cpu = sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        return 1.0
    return cpu / age if age > 1.0 else 1.0


def solve_threads(candidates: int, solver_workers: int, threads: int | None) -> int:
    """Meshes solved at once: `threads`, else the idle cores over each solve's CP-SAT workers
    (`idle_cores`); at least one, at most one per mesh to solve."""
    return max(1, min(candidates, idle_cores() // max(1, solver_workers) if threads is None else threads))
