"""Pipeline stages reduce their data-parallel gradients once per step, not once per microbatch
(planner/stages/layer_cost.py `grad_sync`, planner/stages/candidate.py `once_per_step_max`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planner.planning.evaluate import evaluate
from planner.stages.dp import pipeline_latency
from planner.emit.pipeline import opt_state
from planner.emit.pipeline.runtime import PipelinedStep, even_layouts, layer_names
from tests.conftest import skip_if_fewer_devices
from tests.helpers import assert_first_step_close
from xla_hooks.inspect import collectives
from zoo import get_model, make_optimizer

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_pipeline_grad_sync")


def _stages(plan) -> list:
    return list(plan.stages)


@pytest.fixture(scope="module")
def dp_pp2():
    """gpt-tiny as dp+pp2 on 4 hosts of one A100 (abstract): each stage two hosts, data
    parallelism across them, at 2 and 4 microbatches of one batch."""
    b = get_model("gpt-tiny", batch=8)
    return {B: evaluate(b.train_step, b.abstract_state(), b.abstract_batch(), baseline="dp+pp2",
                        cluster="4x1:a100-80gb", num_microbatches=B) for B in (2, 4)}


def test_gradient_sync_is_charged_once_per_step(dp_pp2):
    """Hand check of the step time: pipeline latency over the per-microbatch stage times, plus the
    largest stage's gradient sync + update, once. The sync term barely changes from 2 to 4
    microbatches (the gradients do not grow with B; only the plans of the smaller microbatch may
    differ a little), so step(4) - step(2) is the latency difference and holds no extra gradient
    syncs."""
    once = {}
    for B, plan in dp_pp2.items():
        stages = _stages(plan)
        assert len(stages) == 2 and plan.pipeline.num_microbatches == B
        assert all(s.grad_sync_time_s > 0 for s in stages)  # the stages are data parallel
        latency = pipeline_latency([s.time_per_microbatch_s for s in stages], B)
        once[B] = max(s.grad_sync_time_s + s.apply_time_s for s in stages)
        assert plan.prediction.step_time_s == pytest.approx(latency + once[B], rel=1e-9)
    step2, step4 = dp_pp2[2].prediction.step_time_s, dp_pp2[4].prediction.step_time_s
    lat2 = pipeline_latency([s.time_per_microbatch_s for s in _stages(dp_pp2[2])], 2)
    lat4 = pipeline_latency([s.time_per_microbatch_s for s in _stages(dp_pp2[4])], 4)
    sync = max(s.grad_sync_time_s for s in _stages(dp_pp2[4]))
    assert step4 - step2 == pytest.approx(lat4 - lat2 + once[4] - once[2], rel=1e-9)
    assert abs(once[4] - once[2]) < 0.1 * sync  # paying it per microbatch would add 2 * sync


def _reductions(lowered) -> list:
    return [c for c in collectives(lowered.compile()) if c.kind in ("all-reduce", "reduce-scatter")]


def _tiny_two_stages(dtype: str = "float32"):
    """A small gpt-tiny (computing in `dtype`), its optimizer, first state and batch, the unsharded
    step's result on them, and 2 even stages of 4 CPU devices each (data parallel inside them)."""
    b = get_model("gpt-tiny", layers=1, batch=8, seq=8, d_model=32, vocab=64, dtype=dtype)
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    names = layer_names(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())
    return b, opt, state, batch, ref_state, ref_metrics, even_layouts(names, jax.devices()[:8], 2)


def test_stage_backward_accumulates_gradients_per_replica():
    """A small gpt-tiny in 2 stages of 4 CPU devices, the batch split 4 ways on each (data parallel
    inside the stages), 2 microbatches: the step equals the unsharded one, and each stage's
    compiled per-microbatch backward has no all-reduce (its parameter gradients stay per replica)
    while its update reduces them once per step; with `replica_grads=False` the backward reduces
    them (what the check would catch)."""
    skip_if_fewer_devices(8)
    b, opt, state, batch, ref_state, ref_metrics, layouts = _tiny_two_stages()
    step = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b")
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state["params"], state["opt_state"], batch))
    lowered = step.lower(*abstract)
    for st in lowered:
        assert st.mesh.devices.size == 4
        assert not _reductions(st.backward)
        upd = _reductions(st.update)
        assert upd and all(c.group_size == 4 for c in upd)
    per_microbatch = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b", stage_plans=[st.plan for st in lowered],
                                   replica_grads=False)
    assert _reductions(per_microbatch.lower(*abstract)[0].backward)


def test_runtime_takes_the_plans_data_axes():
    """The runtime accumulates gradients per replica over the axes the plan priced as data-parallel
    (`StagePlan.data_axes`, the layers' row-split axes), not only over those splitting the stage's
    batch leaves: moe-tiny's first stage on 2x4 reads the token ids replicated (beside its
    vocabulary-split embedding) and splits its activations by rows over x; the runtime took that
    stage as replicated and reduced its gradients in every microbatch's backward, while the
    prediction charged them once per step."""
    skip_if_fewer_devices(8)
    import planner

    b = get_model("moe-tiny", batch=16, seq=8, group_size=32)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    plan = planner.plan(b.train_step, state, batch, mesh=(2, 4), hardware="cpu", pipeline=True)
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    step = PipelinedStep.from_plan(b.loss_fn, opt, plan, jax.devices()[:8])
    _, stages, *_ = step._layout(state["params"], batch)
    planned = [tuple(sorted(s.data_axes)) for s in plan.stages]
    assert any(planned)  # some stage is data-parallel
    assert [tuple(st.layout.mesh.axis_names[a] for a in st.axes) for st in stages] == planned


def test_sharded_optimizer_stages_reduce_scatter_and_keep_a_shard_of_the_optimizer_state():
    """The sharded-optimizer state layout (`StageLayout.shard_optimizer`; Megatron-LM's distributed
    optimizer): gpt-tiny in 2 stages of 4 CPU devices, data parallel inside them, 2 microbatches.
    The step equals the unsharded one (the first AdamW step's bounds, as every pipelined step);
    each stage's compiled update reduce-scatters the replicas' gradients over the 4 devices and
    all-gathers the parameters back (no all-reduce of a gradient); the optimizer moments the step
    returns are split 4 ways where the parameters are whole, and the update's compiled arguments
    hold less than the same stages' in the plan layout (XLA's `memory_analysis`)."""
    skip_if_fewer_devices(8)
    import dataclasses

    b, opt, state, batch, ref_state, ref_metrics, plain = _tiny_two_stages()
    layouts = tuple(dataclasses.replace(lay, shard_optimizer=True) for lay in plain)
    step = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b")
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
    mu = new_state["opt_state"][0].mu
    split = 0
    for (path, m), p in zip(jax.tree_util.tree_leaves_with_path(mu), jax.tree.leaves(new_state["params"])):
        if p.addressable_shards[0].data.size == p.size and max(m.shape, default=1) >= 4:  # a whole parameter
            assert m.addressable_shards[0].data.size * 4 == m.size, jax.tree_util.keystr(path)
            split += 1
    assert split >= len(jax.tree.leaves(mu)) // 2, split
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state["params"], state["opt_state"], batch))
    lowered, before = step.lower(*abstract), PipelinedStep(b.loss_fn, opt, plain, 2, "1f1b").lower(*abstract)
    for st, was in zip(lowered, before):
        kinds = {c.kind for c in collectives(st.update.compile())}
        assert "reduce-scatter" in kinds and "all-gather" in kinds and "all-reduce" not in kinds, kinds
        sharded, whole = st.update.compile().memory_analysis(), was.update.compile().memory_analysis()
        assert sharded.argument_size_in_bytes < whole.argument_size_in_bytes


def test_a_plans_sharded_optimizer_stage_runs_as_planned():
    """A plan's stage recorded in the sharded-optimizer layout (`PipelineStage.state_layout`) runs
    so from the plan (`PipelinedStep.from_plan`): gpt-tiny pipelined on 2x4 CPU devices, its
    data-parallel stages switched to that layout, gives the unsharded step, and their optimizer
    moments come back split over the stage's data axes."""
    skip_if_fewer_devices(8)
    import dataclasses

    import planner

    b = get_model("gpt-tiny", layers=2, batch=16, seq=8, d_model=32, vocab=64)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    plan = planner.plan(b.train_step, state, batch, mesh=(2, 4), hardware="cpu", pipeline=True)
    stages = tuple(dataclasses.replace(s, state_layout="sharded-optimizer") if s.data_axes else s for s in plan.stages)
    assert any(s.state_layout == "sharded-optimizer" for s in stages)
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    step = PipelinedStep.from_plan(b.loss_fn, opt, dataclasses.replace(plan, stages=stages), jax.devices()[:8])
    assert [lay.shard_optimizer for lay in step.layouts] == [s.state_layout == "sharded-optimizer" for s in stages]
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
    mu, params = jax.tree.leaves(new_state["opt_state"][0].mu), jax.tree.leaves(new_state["params"])
    assert any(m.addressable_shards[0].data.size < p.addressable_shards[0].data.size for m, p in zip(mu, params))


def test_offloaded_optimizer_stages_keep_the_optimizer_state_in_host_memory(monkeypatch):
    """The offloaded-optimizer state layout (`StageLayout.offload_optimizer`): gpt-tiny in 2 stages of
    4 CPU devices, 2 microbatches, two steps: the first equals the unsharded step (the first AdamW
    step's bounds), the optimizer moments come back in host memory (`pinned_host`), split over the
    stage's data axes, the parameters on the devices; the second step takes that state as it is
    and equals a second unsharded step within the same bounds. Where the state lives (an
    `eval_shape` of the optimizer's init per stage and per streamed parameter,
    `opt_state.state_layouts`) is found once per argument signature, not on every step."""
    skip_if_fewer_devices(8)
    import dataclasses

    b, opt, state, batch, ref_state, ref_metrics, plain = _tiny_two_stages()
    layouts = tuple(dataclasses.replace(lay, shard_optimizer=True, offload_optimizer=True) for lay in plain)
    from planner.emit.pipeline import runtime

    found = []
    monkeypatch.setattr(runtime, "state_layouts", lambda *a: found.append(a) or opt_state.state_layouts(*a))
    step = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b")
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
    mu, nu = jax.tree.leaves(new_state["opt_state"][0].mu), jax.tree.leaves(new_state["opt_state"][0].nu)
    assert all(m.sharding.memory_kind == "pinned_host" for m in mu + nu)
    assert all(p.sharding.memory_kind == "device" for p in jax.tree.leaves(new_state["params"]))
    assert any(m.addressable_shards[0].data.size * 4 == m.size for m in mu)
    # a second step from the state as it came back: its first moments carry the first step's
    # (0.9 of them); a state lost between the steps would leave only 0.1 of the new gradient, about
    # half of the leaf (the two steps' gradients nearly equal): the rounding differences of the two
    # runs are many orders below that, so a leaf within a quarter of its size has carried it (leaves
    # whose gradient is zero but for roundings, the attention key's bias, are left out)
    again, _ = step(new_state, batch)
    assert len(found) == 1 and len(found[0][4]) == len(layouts)  # once, with every stage streamed
    want, _ = jax.jit(b.train_step)(ref_state, batch)
    pairs = [(np.asarray(jax.device_get(g)), np.asarray(r))
             for g, r in zip(jax.tree.leaves(again["opt_state"][0].mu), jax.tree.leaves(want["opt_state"][0].mu))]
    top = max(np.abs(r).max() for _, r in pairs)
    for got, ref in pairs:
        if np.abs(ref).max() > 1e-6 * top:
            assert np.abs(got - ref).max() <= 0.25 * np.abs(ref).max()


def test_offloaded_optimizer_stages_update_one_parameter_at_a_time():
    """The offloaded-optimizer layout's update runs one program per parameter the stage owns (the
    step runs them in order, so a device holds one parameter's state copied in, not the stage's):
    XLA's accounting of each program's arguments holds that parameter, its gradient and its state
    (with the shared step count) alone, and together the programs take every argument of the whole
    update once, the count once each; the step matches the unsharded one (the test above)."""
    skip_if_fewer_devices(8)
    import dataclasses

    b, opt, state, batch, _, _, plain = _tiny_two_stages()
    layouts = tuple(dataclasses.replace(lay, shard_optimizer=True, offload_optimizer=True) for lay in plain)
    step = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state["params"], state["opt_state"], batch))
    count = jax.tree.leaves(state["opt_state"][0].count)[0]
    for st in step.lower(*abstract):
        whole = st.update.compile().memory_analysis().argument_size_in_bytes
        groups = [(k, low.compile().memory_analysis().argument_size_in_bytes) for k, low in st.streamed_updates]
        assert len(groups) > 2 and len({k for k, _ in groups}) == len(groups)
        assert max(size for _, size in groups) < whole / 2
        shared = count.dtype.itemsize  # the step count (sizes are per device; it is replicated)
        assert sum(size for _, size in groups) == whole + (len(groups) - 1) * shared


def test_offloaded_master_parameters_wait_in_host_memory_and_the_step_is_unchanged():
    """Mixed precision (bfloat16 compute, float32 parameters): with `offload_params` a stage keeps
    the master parameters it reads only by casts in host memory with their optimizer state; the
    microbatches read cast copies made one parameter at a time. The casts then change nothing and
    the backward's cast of the cotangent gives the same float32 gradient, so the step is the same:
    within the first-step bounds of the unsharded step, and equal to the same pipeline keeping
    the masters on the devices up to the order of its sums (bit for bit here: the same programs
    on the same values). The masters come back in `pinned_host`, the others on the devices, and a
    second step runs from that state; the lowered forward reads the bfloat16 copies."""
    skip_if_fewer_devices(8)
    import dataclasses

    b, opt, state, batch, ref_state, ref_metrics, plain = _tiny_two_stages("bfloat16")
    kept = tuple(dataclasses.replace(lay, shard_optimizer=True, offload_optimizer=True) for lay in plain)
    hosted = tuple(dataclasses.replace(lay, offload_params=True) for lay in kept)
    step = PipelinedStep(b.loss_fn, opt, hosted, 2, "1f1b")
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step, dtype=jnp.bfloat16)
    same, same_metrics = PipelinedStep(b.loss_fn, opt, kept, 2, "1f1b")(state, batch)
    for x, y in zip(jax.tree.leaves((new_state, metrics)), jax.tree.leaves((same, same_metrics))):
        np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))
    kinds = [p.sharding.memory_kind for p in jax.tree.leaves(new_state["params"])]
    assert kinds.count("pinned_host") >= len(kinds) // 2 and "device" in kinds  # kernels; not the embedding
    again, _ = step(new_state, batch)
    assert all(np.isfinite(np.asarray(jax.device_get(x))).all() for x in jax.tree.leaves(again["params"]))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state["params"], state["opt_state"], batch))
    read_low = sum(a.dtype == jnp.bfloat16 for st in step.lower(*abstract)
                   for a in jax.tree.leaves(st.forward.in_avals[0][0]))
    assert read_low == kinds.count("pinned_host")  # the forwards read the copies of exactly the masters kept away


def test_master_parameters_kept_away_combine_with_offloaded_activations_and_recomputation():
    """The stage levers compose: a stage keeping its masters in host memory whose saved activations
    wait there too, and one whose masters wait there while its backward recomputes the forward,
    give the step of the same stages with the masters on the devices (bit for bit: the same
    programs on the same values), within the unsharded step's first-step bounds."""
    skip_if_fewer_devices(8)
    import dataclasses

    b, opt, state, batch, ref_state, ref_metrics, plain = _tiny_two_stages("bfloat16")
    levers = ({"offload_activations": True}, {"remat": True})
    kept = tuple(dataclasses.replace(lay, shard_optimizer=True, offload_optimizer=True, **more)
                 for lay, more in zip(plain, levers))
    hosted = tuple(dataclasses.replace(lay, offload_params=True) for lay in kept)
    new_state, metrics = PipelinedStep(b.loss_fn, opt, hosted, 2, "1f1b")(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step, dtype=jnp.bfloat16)
    same, same_metrics = PipelinedStep(b.loss_fn, opt, kept, 2, "1f1b")(state, batch)
    for x, y in zip(jax.tree.leaves((new_state, metrics)), jax.tree.leaves((same, same_metrics))):
        np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))
    assert "pinned_host" in [p.sharding.memory_kind for p in jax.tree.leaves(new_state["params"])]


def test_bfloat16_stages_with_one_row_replicas_run_equal_to_the_unsharded_step():
    """Mixed precision, 2 stages of 4 data-parallel replicas, 2 microbatches of 4 rows: each
    replica's program is traced at one row, where JAX's trace is not the full program op for op
    (`Replica.planned` False). The plan's float32 partial sums are keyed by the full program's
    ops, so they must not be applied to the replica's (they once were: a reshape rebound with a
    matmul's `preferred_element_type`, a TypeError in every bfloat16 pipeline of such stages)."""
    skip_if_fewer_devices(8)
    b, opt, state, batch, ref_state, ref_metrics, layouts = _tiny_two_stages("bfloat16")
    step = PipelinedStep(b.loss_fn, opt, layouts, 2, "1f1b")
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step, dtype=jnp.bfloat16)
