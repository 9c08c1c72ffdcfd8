"""Pipeline stages as a lever weighed by default (`PlanOptions.pipeline=None`).

After the single-step levers (`planning.composition`), a caller that can plan stages for its
target gives `compose` a `StageSearch`; the stage search (`stages.inter_op.plan_pipeline`, at least
two stages) is then weighed against the single-step plan, the faster kept, when:

- the target has several hosts (the caller's test: a caller gives no `StageSearch` on one host).
  Within a host the devices' links are fast enough for tensor and data parallelism, and pipelines
  pay for their bubble; Megatron-LM's rule is the same (Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 3.3, takeaway 1:
  tensor parallelism up to the GPUs of a server, pipeline parallelism across servers);
- (without a memory budget the stages are planned to fit the device memory, as
  `stages.inter_op.plan_pipeline` does; the single-step plan keeps none);
- no single-stage lever was asked for explicitly (a recomputation policy, host offload of named
  state, accumulation: the stages take none of these);
- the step is proven microbatch-invariant (`levers.accumulate.why_microbatch_variant`): a pipeline
  splits the batch into microbatches, which changes a step that mixes examples;
- its layers are not scanned over stacked parameters (a stage holds whole parameter leaves, so a
  scanned stack cannot be split into stages; scanned llama-70b on 8x8: 272 s/step against 16.1 s
  unrolled). `planner plan --pipeline auto` builds a zoo model with its layers unrolled.

No step-time bound prunes the search further: a pipeline can only gain what the single-step plan
loses to communication and recomputation, but the bound that follows from compute alone (the
step's FLOPs at the devices' peak) is below every multi-host single-step plan measured, so it
would prune nothing. The stage search is given the single-step plan's time instead (`beat`): a
microbatch count is priced in the hand layouts only where its pipeline ignoring memory can beat it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from planner.core.errors import InfeasiblePlanError, PlannerError, first_line
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.core.units import format_seconds
from planner.graph.ir import Graph
from planner.levers.accumulate import why_microbatch_variant

log = logging.getLogger("planner")

# (options with pipeline=True, the single-step plan's step time to beat: inf when none fits)
# -> (the pipeline's Plan, the caller's own result: the `PipelinePlan`, or the runner)
StageSearch = Callable[[PlanOptions, float], tuple[Plan, Any]]


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """A pipeline that beat the single-step plan: its `Plan` (its `pipeline` facts give the
    single-step plan's time as `single_stage_step_time_s`) and what the caller's `StageSearch`
    returned with it."""

    plan: Plan
    found: Any


@dataclasses.dataclass(frozen=True)
class Weighed:
    """What weighing pipeline stages gave: the pipeline when it won, and one line saying what was
    weighed and why it was (not) kept, or why it was not weighed."""

    pipelined: Pipelined | None
    note: str


def why_not_weighed(graph: Graph, options: PlanOptions) -> str | None:
    """None when the stage search is weighed for `graph` under `options` (module docstring);
    otherwise why not, in words."""
    if options.pipeline is not None:
        return f"pipeline={options.pipeline!r} was asked for"
    if options.accumulate is not None:
        return f"accumulate={options.accumulate!r} was asked for"
    if options.offload not in (None, "off", "auto"):
        return (f"offload={options.offload!r} was asked for (stages offload only their optimizer state, chosen "
                "per stage under offload='auto')")
    if options.remat not in ("off", "auto"):
        return f"remat={options.remat!r} was asked for (stages choose their own recomputation)"
    stacked = stacked_scan_input(graph)
    if stacked is not None:
        return (f"the step scans its layers over stacked parameters (e.g. {stacked}): a stage holds whole "
                "leaves; build it with its layers unrolled to weigh stages")
    variant = why_microbatch_variant(graph)
    if variant is not None:
        return f"the step is not proven microbatch-invariant: {variant}"
    return None


def stacked_scan_input(graph: Graph) -> str | None:
    """The path of a step argument leaf that a scan of two or more iterations reads whole, its
    leading axis the scan's length (a scanned layer stack's parameters), or None."""
    inputs = {t: pos for pos, t in enumerate(graph.inputs)}
    for regions in graph.regions.values():
        for r in regions:
            n = r.params.get("length") if r.kind == "scan" else None
            if not n or n < 2:
                continue
            for t in r.operands:
                if isinstance(t, int) and t in inputs and graph.tensors[t].shape[:1] == (n,):
                    return graph.input_paths[inputs[t]]
    return None


class PipelineWeighing:
    """The stage search of one `compose` call, run at most once: as soon as a single-step lever
    needs its step time (`time`: gradient accumulation takes it as its ceiling, so that a count no
    faster than the pipeline ends the weighing), or at the end (`verdict`) against the single-step
    plan `compose` found."""

    def __init__(self, options: PlanOptions, stages: StageSearch):
        self._options, self._stages = options, stages
        self._result: tuple[Plan, Any] | str | None = None  # (plan, the caller's result), or why none

    def time(self, single_s: float) -> float:
        """The pipeline's step time (inf when none fits), searched with `single_s` to beat when not
        yet searched."""
        self._search(single_s)
        return self._result[0].prediction.step_time_s if isinstance(self._result, tuple) else math.inf

    def verdict(self, single_s: float) -> Weighed:
        """The pipeline against the single-step plan of `single_s` s/step (inf: none fits): kept
        when faster."""
        self._search(single_s)
        if not isinstance(self._result, tuple):
            return Weighed(None, f"weighed: {self._result}")
        plan, found = self._result
        t = plan.prediction.step_time_s
        facts = plan.pipeline
        shape = f"{facts.num_stages} stages x {facts.num_microbatches} microbatches" if facts is not None else "stages"
        if t >= single_s:
            slower = f"at best {shape}, {format_seconds(t)}/step, not faster than this plan"
            log.info("pipeline stages: %s", slower)
            return Weighed(None, f"weighed: {slower}")
        if facts is not None and math.isfinite(single_s):
            plan = dataclasses.replace(plan, pipeline=dataclasses.replace(facts, single_stage_step_time_s=single_s))
        kept = f"{shape}, {format_seconds(t)}/step" + (
            "" if math.isinf(single_s) else f" against {format_seconds(single_s)}/step in one stage ({single_s / t:.2f}x)")
        log.info("pipeline stages: %s: kept", kept)
        return Weighed(Pipelined(plan, found), f"used: {kept}")

    def _search(self, single_s: float) -> None:
        if self._result is not None:
            return
        against = "no single-step plan fits" if math.isinf(single_s) else \
            f"the single-step plan's {format_seconds(single_s)}/step"
        log.info("weighing pipeline stages against %s ...", against)
        try:
            self._result = self._stages(dataclasses.replace(self._options, pipeline=True), single_s)
        except InfeasiblePlanError as e:
            log.info("pipeline stages: %s", first_line(e))
            self._result = "no pipeline fits the memory budget"
        except PlannerError as e:
            log.info("pipeline stages: %s", first_line(e))
            self._result = first_line(e)
