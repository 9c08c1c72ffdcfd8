"""Choosing the pipeline among the candidates, each priced as the pipeline runtime will run it.

The stage tables charge a data-parallel stage's gradient reduction once per step; the runtime
reduces once per step only where each replica's share of a microbatch traces and no parameter is
split over a data axis, and every microbatch elsewhere (`_replica_fallback`). `cheapest_as_run`
re-prices the candidates so, cheapest first, until none left can win.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from planner.core.sharding import spec_axes
from planner.stages.candidate import Candidate
from planner.stages.dp import pipeline_latency
from planner.stages.microbatches import UntraceableMicrobatches, batch_argnums, trace_replica
from planner.stages.pipeline_plan import StagePlan

log = logging.getLogger("planner")


def cheapest_as_run(fn: Callable, args: tuple[Any, ...], feasible: Sequence[Candidate], key: Callable,
                    stage_plans_of: Callable, batch: int, batch_argnum: int | tuple[int, ...]
                    ) -> tuple[tuple[StagePlan, ...], Candidate, list[str]]:
    """The candidate first by `key` (which grows with `step_s`) once priced as the runtime runs it
    (`_replica_fallback`, which only adds time): candidates are re-priced in `key` order until the
    next one cannot beat the best re-priced one. Returns its stage plans, itself re-priced and the
    stages it re-priced (with a warning when there are any)."""
    chosen = None
    for c in sorted(feasible, key=key):
        if chosen is not None and key(c) >= key(chosen[1]):
            break
        found = _replica_fallback(fn, args, c, stage_plans_of(c), batch, batch_argnum)
        if chosen is None or key(found[1]) < key(chosen[1]):
            chosen = found
    if chosen[2]:
        log.warning("the pipeline's data-parallel stages will reduce gradients every microbatch, not once per step "
                    "(%s): predicted %.4g s/step with that", "; ".join(chosen[2]), chosen[1].step_s)
    return chosen


def _replica_fallback(fn: Callable, args: tuple[Any, ...], best: Candidate, stages: tuple[StagePlan, ...],
                      batch: int, batch_argnum: int | tuple[int, ...]
                      ) -> tuple[tuple[StagePlan, ...], Candidate, list[str]]:
    """A candidate pipeline priced as the runtime will run it. A data-parallel stage reduces its
    gradients once per step only when each of its replicas' share of a microbatch is whole rows, the
    loss traces on it and no parameter (a program input outside the batch arguments and the
    optimizer state) is split over a data axis (`stage_records.set_replicas`); the stage
    tables price that once per step. For a stage where it does not hold, the runtime reduces every
    microbatch: its reduction moves into its per-microbatch time and exposed communication, and the
    step time follows (the pipeline latency of the new stage times, the once-per-step part without
    it). Returns the stages, the candidate with that step time and one line per stage so priced;
    never faster than before (`cheapest_as_run` relies on it)."""
    rows = batch // best.B
    batch_args = tuple(f"[{a % len(args)}]" for a in batch_argnums(batch_argnum))
    traces: dict[int, str | None] = {}  # replica count -> why the share does not trace (None: it does)
    new, why = [], []
    for k, st in enumerate(stages):
        axes = {st.mesh.axis_names.index(a) for a in st.data_axes}
        ways = st.mesh.axis_size(tuple(axes))
        if ways <= 1 or not st.grad_sync_s:
            new.append(st)
            continue
        split = [path for path, spec in st.specs.items() if not path.startswith(batch_args)
                 and "opt_state" not in path and axes & spec_axes(spec)]
        if split:
            reason = f"parameter {split[0]} is split over a data axis"
        elif rows % ways:
            reason = f"{rows} rows per microbatch do not split {ways} ways"
        else:
            if ways not in traces:
                try:
                    trace_replica(fn, args, best.B, rows, ways, batch_argnum)
                    traces[ways] = None
                except UntraceableMicrobatches as e:
                    traces[ways] = str(e)
            reason = traces[ways]
        if reason is None:
            new.append(st)
            continue
        why.append(f"stage {k}: {reason}")
        new.append(dataclasses.replace(st, time_s=st.time_s + st.grad_sync_s, comm_s=st.comm_s + st.grad_sync_s,
                                       grad_sync_s=0.0))
    if not why:
        return stages, best, []
    B = best.B
    step = (best.step_s + pipeline_latency([s.time_s for s in new], B) - pipeline_latency([s.time_s for s in stages], B)
            + max(s.grad_sync_s + s.apply_s for s in new) - max(s.grad_sync_s + s.apply_s for s in stages))
    return tuple(new), dataclasses.replace(best, step_s=step), why
