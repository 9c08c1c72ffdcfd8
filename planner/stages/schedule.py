"""Pipeline schedules as data: each stage's task order, and one global order to dispatch them in.

A task is ("F", i) or ("B", i): the forward or backward of microbatch i on one stage. GPipe runs
every forward, then every backward; 1F1B (PipeDream-flush) runs `S - s - 1` warm-up forwards on
stage s, then alternates one forward and one backward, then drains the backwards, so stage s
holds at most `S - s` microbatches of activations instead of `B`.

The runtime dispatches tasks from one Python thread; JAX's asynchronous dispatch lets each
submesh run its queue while the host moves on. `dispatch_order` lists the tasks in the order a
unit-time simulation of the schedule starts them, which respects every dependency (forward of a
microbatch after its forward on the previous stage, backward after the next stage's backward) and
each stage's own order.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from planner.core.errors import InvalidArgumentError

Task = tuple[str, int]
SCHEDULES = ("1f1b", "gpipe")


def stage_tasks(schedule: str, num_stages: int, num_microbatches: int) -> tuple[tuple[Task, ...], ...]:
    """Per stage, its tasks in execution order."""
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    S, B = num_stages, num_microbatches
    out = []
    for s in range(S):
        if schedule == "gpipe":
            order = [("F", i) for i in range(B)] + [("B", i) for i in range(B)]
        else:
            warm = min(S - s - 1, B)
            order = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while f < B:
                order.append(("F", f))
                f += 1
                order.append(("B", b))
                b += 1
            order.extend(("B", i) for i in range(b, B))
        out.append(tuple(order))
    return tuple(out)


def simulate(tasks: Sequence[Sequence[Task]], t_fwd: Sequence[float], t_bwd: Sequence[float],
             comm: float = 0.0) -> tuple[float, list[tuple[float, int, Task]]]:
    """Runs the per-stage orders with the given task times; returns the makespan and the start events.

    Stage s may start its next task once its previous task ended and the task's inputs exist:
    F(s, i) needs F(s - 1, i) done (plus `comm`), B(s, i) needs F(s, i) and B(s + 1, i) (plus `comm`).
    """
    S = len(tasks)
    done: dict[tuple[int, str, int], float] = {}
    pos = [0] * S
    free = [0.0] * S
    events: list[tuple[float, int, Task]] = []
    remaining = sum(len(t) for t in tasks)
    while remaining:
        progressed = False
        ready = []
        for s in range(S):
            if pos[s] >= len(tasks[s]):
                continue
            kind, i = tasks[s][pos[s]]
            deps = []
            if kind == "F" and s > 0:
                deps.append(("F", s - 1, i))
            if kind == "B":
                deps.append(("F", s, i))
                if s < S - 1:
                    deps.append(("B", s + 1, i))
            times = []
            for k, st, j in deps:
                key = (st, k, j)
                if key not in done:
                    break
                times.append(done[key] + (comm if st != s else 0.0))
            else:
                heapq.heappush(ready, (max([free[s]] + times), s))
        while ready:
            start, s = heapq.heappop(ready)
            kind, i = tasks[s][pos[s]]
            end = start + (t_fwd[s] if kind == "F" else t_bwd[s])
            done[(s, kind, i)] = end
            free[s] = end
            pos[s] += 1
            remaining -= 1
            events.append((start, s, (kind, i)))
            progressed = True
        if not progressed:
            raise InvalidArgumentError(f"schedule deadlocks; per-stage orders {tasks}")
    return max(free), sorted(events)


def dispatch_order(tasks: Sequence[Sequence[Task]]) -> tuple[tuple[int, str, int], ...]:
    """All tasks as (stage, kind, microbatch), in a dependency-respecting order (see module doc)."""
    _, events = simulate(tasks, [1.0] * len(tasks), [2.0] * len(tasks))
    return tuple((s, kind, i) for _, s, (kind, i) in events)


def peak_inflight(tasks: Sequence[Task]) -> int:
    """The most microbatches a stage holds activations for at once under its order."""
    live = peak = 0
    for kind, _ in tasks:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
