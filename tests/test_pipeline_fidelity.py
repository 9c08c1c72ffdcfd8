"""Pipeline stages run their intra-op plans: each stage's compiled collectives are the planned ones,
the plan JSON keeps every stage's plan, and the pipeline's prediction lists its collectives."""
from __future__ import annotations

import jax
import pytest

import planner
from planner.cost_model import ring_bytes
from planner.graph.trace import trace
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.emit.pipeline.planned import run_plan
from planner.emit.pipeline.planned import cluster_for, plan_stages, stage_plans_of
from tests.helpers import assert_first_step_close
from xla_hooks.fidelity import check_stage_fidelity
from xla_hooks.inspect import collectives
from zoo import get_model


def test_pipeline_stages_compile_to_their_planned_collectives(gpt_tiny, devices8):
    """gpt-tiny in 2 stages on 1x4 submeshes of 8 devices. The plan records each stage's intra-op
    plan (one microbatch's forward + backward); the plan loaded from JSON runs those plans (every
    planned intermediate pinned, as single-stage emission does), equals the unpipelined step, and
    each stage compiles to the collectives its plan predicts (`check_stage_fidelity`; 1-D meshes,
    where single-stage gpt-tiny plans pass `check_fidelity` too; the stage's programs together, since
    its gradient reduction compiles into its update, once per step). The pipeline's prediction is
    every stage's collectives per microbatch (its gradient reduction once per step) plus the
    stage-to-stage transfers, and splits the step into compute and exposed communication."""
    b, opt, state, batch, ref_state, ref_metrics = gpt_tiny
    options = PlanOptions(hardware="cpu", inter_host_axes=(0,), pipeline=True, num_microbatches=2)
    cluster = cluster_for(MeshSpec((2, 4), ("host", "device")), 8, options)
    graph = trace(b.train_step, state, batch)
    plan, _ = plan_stages(b.train_step, (state, batch), graph, cluster, options, jax.devices(), max_mesh_ndim=1)
    assert len(plan.stages) == 2 and all(st.plan is not None for st in plan.stages)
    B = plan.pipeline.num_microbatches
    loaded = planner.Plan.from_json(plan.to_json())
    runner = run_plan(b.train_step, loaded)
    new_state, metrics = runner(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, batch))
    lowered = runner.lower(*abstract)
    stage_plans = [st.plan for st in lowered]
    # The loaded plan's stages run the intra-op plans the planner recorded (not re-planned ones).
    assert [sp.op_specs for sp in stage_plans] == [sp.op_specs for sp in stage_plans_of(plan)]
    assert all(sp.op_specs for sp in stage_plans)
    pred = plan.prediction
    # Per microbatch, except the data-parallel gradient reduction: once per step on the accumulated
    # gradients, over the axes the runtime reduces them on.
    per_stage = [sum(ring_bytes(c.kind, c.nbytes, c.group_size)
                     * (1 if c.reason == "partial sum" and c.axes and set(c.axes) <= set(st.data_axes) else B)
                     for c in sp.prediction.collectives) for st, sp in zip(lowered, stage_plans)]
    assert sum(per_stage) < sum(sp.prediction.bytes_moved_per_device for sp in stage_plans) * B
    permutes = [c for c in pred.collectives if c.kind == "collective-permute" and "->" in c.axes[0]]
    assert permutes and all(c.nbytes > 0 for c in permutes)
    assert {c.reason for c in permutes} == {"activation", "gradient"}
    # Per device: the stages run on disjoint devices, so the most any one stage's device sends (its
    # collectives and the transfers leaving it: the activation forward, the gradient back).
    for c in permutes:
        sender = int(c.axes[0].split("->")[0].removeprefix("stage"))
        per_stage[sender] += ring_bytes(c.kind, c.nbytes, c.group_size)
    assert pred.bytes_moved_per_device > 0
    assert pred.bytes_moved_per_device == pytest.approx(max(per_stage))
    assert len(pred.collectives) == sum(len(sp.prediction.collectives) for sp in stage_plans) + len(permutes)
    # Compute and exposed communication: the pipeline latency of the stage times less their exposed
    # communication, plus the largest update, is the compute; the rest of the step is communication.
    from planner.stages.dp import pipeline_latency

    stages = plan.stages
    compute = pipeline_latency([st.time_per_microbatch_s - st.exposed_communication_per_microbatch_s
                                for st in stages], B) + max(st.apply_time_s for st in stages)
    assert pred.compute_time_s == pytest.approx(compute, rel=1e-9)
    assert pred.communication_time_s > 0 and all(st.exposed_communication_per_microbatch_s > 0 for st in stages)
    assert pred.compute_time_s + pred.communication_time_s == pytest.approx(pred.step_time_s, rel=1e-12)
    reports = check_stage_fidelity(lowered)
    for st, rep in zip(lowered, reports):
        assert rep.ok, rep.table()
        # Same kinds (the rows already compare a reduce-scatter as the all-reduce CPU XLA makes of it).
        assert {r.kind for r in rep.rows if r.predicted_count} == {r.kind for r in rep.rows if r.measured_count}, \
            rep.table()
        # A stage whose batch is split accumulates gradients per data-parallel replica over the
        # microbatches: its backward reduces none (1-D mesh: every reduction spans the data axis),
        # its update reduces them once per step (tests/test_pipeline_grad_sync.py), and the prediction
        # counts those bytes once. A stage whose
        # batch is not split has no data-parallel reduction and a local update.
        reductions = [c for c in collectives(st.backward.compile()) if c.kind in ("all-reduce", "reduce-scatter")]
        update = collectives(st.update.compile())
        if st.data_axes:  # a split optimizer state: the parameters gathered back in the update too
            kinds = {"all-reduce", "reduce-scatter"} | ({"all-gather"} if st.shards_optimizer else set())
            assert not reductions and update and {c.kind for c in update} <= kinds
        else:
            assert not update
    assert any(st.data_axes for st in lowered)


def test_pipeline_of_a_step_the_runtime_cannot_split_still_lists_its_communication():
    """A train step whose stage programs cannot be built (wresnet-tiny returns batch-norm statistics
    beside the new state) used to predict 0 B moved and no collectives for a 3-stage pipeline:
    now its prediction lists each stage's layers' planned collectives per microbatch (their
    data-parallel gradient reductions once per step) and the stage-to-stage transfers of the
    activations the stage tables priced, forward and back."""
    b = get_model("wresnet-tiny")
    args = (b.abstract_state(), b.abstract_batch())
    graph = trace(b.train_step, *args)
    options = PlanOptions(hardware="a100-80gb", pipeline=True)
    cluster = cluster_for(MeshSpec((2, 4), ("host", "device")), 8, options)
    plan, pp = plan_stages(b.train_step, args, graph, cluster, options)
    assert len(pp.stages) > 1 and all(st.plan is None for st in plan.stages)  # no stage programs
    B, pred = pp.num_microbatches, plan.prediction
    per_stage = []
    for s, st in enumerate(pp.stages):
        sent = st.send_bytes + (pp.stages[s - 1].send_bytes if s else 0.0)  # activations on, gradients back
        assert st.collectives or sent > 0  # every stage communicates
        per_stage.append(sum(ring_bytes(c.kind, c.nbytes, c.group_size)
                             * (1 if c.reason == "partial sum" and c.axes and set(c.axes) <= st.data_axes else B)
                             for c in st.collectives) + ring_bytes("collective-permute", int(sent * B), 2))
    permutes = [c for c in pred.collectives if "->" in c.axes[0]]
    assert [(c.axes[0], c.nbytes) for c in permutes] == [
        (f"stage{s}->stage{s + 1}" if k == 0 else f"stage{s + 1}->stage{s}", int(st.send_bytes * B))
        for s, st in enumerate(pp.stages[:-1]) for k in range(2)]
    assert len(pred.collectives) == sum(len(st.collectives) for st in pp.stages) + len(permutes)
    assert pred.bytes_moved_per_device > 0
    assert pred.bytes_moved_per_device == pytest.approx(max(per_stage))
