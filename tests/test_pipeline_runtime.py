"""The pipeline runtime on 8 CPU devices: pipelined train steps equal the unpipelined step."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import planner
from planner.core.errors import InvalidArgumentError
from planner.core.mesh import MeshSpec
from zoo import get_model, make_optimizer
from planner.stages.step import pipelinable
from planner.graph.trace import trace
from planner.emit.pipeline.planned import cluster_for, plan_stages, run_plan
from planner.emit.pipeline.runtime import PipelinedStep, StageLayout, even_layouts, layer_names
from tests.conftest import skip_if_fewer_devices
from tests.helpers import assert_first_step_close, assert_loss_close, assert_sgd_step_close, longest_reduction

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_pipeline_runtime")


@pytest.fixture(scope="module")
def gpt_layers(gpt_tiny):
    """gpt-tiny's layer names, the units the pipeline runtime splits into stages."""
    b = gpt_tiny.bundle
    return layer_names(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())


def _close(b, opt, state, batch, new_state, metrics, ref_state, ref_metrics):
    """Microbatching reorders the gradient sums; the AdamW update is checked on the pipeline's own
    gradients (tests/helpers.py explains the tolerances)."""
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 2)])  # 4 stages: Llama in test_pipeline_e2e.py
def test_pipelined_step_equals_unpipelined(gpt_tiny, gpt_layers, num_stages, num_microbatches, monkeypatch, devices8):
    b, opt, state, batch, ref_state, ref_metrics = gpt_tiny
    names = gpt_layers
    assert names == ("pre", "blocks_0", "blocks_1", "post")
    layouts = even_layouts(names, jax.devices()[:8], num_stages)
    step = PipelinedStep(b.loss_fn, opt, layouts, num_microbatches, "1f1b")
    for schedule in ("1f1b", "gpipe"):
        run = step.with_schedule(schedule)  # same compiled stage programs, other dispatch order
        new_state, metrics = run(state, batch)
        _close(b, opt, state, batch, new_state, metrics, ref_state, ref_metrics)
    # Each stage's parameters live on its own submesh.
    leaf = new_state["params"]["blocks_1"]["mlp"]["fc_in"]["kernel"]
    owner = next(l for l in layouts if "blocks_1" in l.layers)
    assert leaf.sharding.device_set == set(owner.devices)
    # The next step takes the parameters and optimizer state as they came back: none is placed
    # again but the scalars every stage's update holds a copy of (AdamW's step count).
    put, real_put = [], jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: put.append(id(x)) or real_put(x, *a, **k))
    run(new_state, batch)
    monkeypatch.undo()
    leaves = {id(x): x for x in jax.tree.leaves(new_state)}
    assert put and all(leaves[i].ndim == 0 for i in set(put) & set(leaves))


def test_remat_tied_embeddings_and_sgd_gradients():
    skip_if_fewer_devices(8)
    b = get_model("gpt-tiny", tie_embeddings=True)
    sgd = optax.sgd(1.0)
    state = b.init_state(jax.random.key(0))
    params = state["params"]
    batch = b.make_batch(jax.random.key(1))
    names = layer_names(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())
    layouts = [dataclasses.replace(l, remat=True) for l in even_layouts(names, jax.devices()[:8], 2)]
    step = PipelinedStep(b.loss_fn, sgd, layouts, 4, "1f1b")
    new, metrics = step({"params": params, "opt_state": sgd.init(params)}, batch)
    n = longest_reduction(b.train_step, state, batch)
    assert_loss_close(metrics["loss"], jax.jit(b.loss_fn)(params, batch), n)
    # With SGD(lr=1) the update is the gradient: the tied embedding sums both stages' contributions.
    assert_sgd_step_close(b.loss_fn, 1.0, params, batch, new["params"], n=n)


def test_bad_layouts_are_rejected(gpt_tiny, gpt_layers, devices8):
    b, opt, state, batch, _, _ = gpt_tiny
    names = gpt_layers
    devs = jax.devices()
    partial = [StageLayout(("pre", "blocks_0"), tuple(devs[:4]), MeshSpec((4,), ("x",)))]
    with pytest.raises(InvalidArgumentError, match="belong to no stage"):
        PipelinedStep(b.loss_fn, opt, partial, 2)(state, batch)
    with pytest.raises(InvalidArgumentError, match="divisible"):
        PipelinedStep(b.loss_fn, opt, even_layouts(names, devs[:8], 2), 3)(state, batch)
    backwards = even_layouts(names[::-1], devs[:8], 2)
    with pytest.raises(InvalidArgumentError, match="later"):
        PipelinedStep(b.loss_fn, opt, backwards, 2)(state, batch)
    with pytest.raises(InvalidArgumentError, match="needs 4 devices"):
        StageLayout(("pre",), tuple(devs[:2]), MeshSpec((4,), ("x",)))


def test_plan_parallel_with_pipeline(gpt_tiny, devices8):
    """The public API end to end: plan stages on 2 hosts x 4 devices, run them, reload the plan."""
    b, opt, state, batch, ref_state, ref_metrics = gpt_tiny
    train_step = pipelinable(b.loss_fn, opt)
    step = planner.plan_parallel(train_step, mesh=(2, 4), inter_host_axes=(0,), hardware="cpu", pipeline=True,
                                 num_microbatches=2, schedule="gpipe")
    plan = step.plan(state, batch)
    assert len(plan.stages) >= 2
    assert plan.pipeline.num_microbatches == 2 and plan.pipeline.schedule == "gpipe"
    assert 0 < plan.pipeline.bubble_fraction < 1
    assert all(None not in (st.layers, st.submesh, st.mesh, st.devices, st.shardings) for st in plan.stages)
    assert "pipeline" in plan.summary() and "stage 1" in plan.summary()
    new_state, metrics = step(state, batch)
    _close(b, opt, state, batch, new_state, metrics, ref_state, ref_metrics)
    # Each stage's parameters live on its submesh, laid out as the stage's intra-op plan says (a
    # split one where the plan splits any; a stage may keep all of its parameters whole).
    devices = jax.devices()
    for st in plan.stages:
        params = [(p, spec) for p, spec in st.shardings if "['params']" in p]
        path, spec = next(((p, spec) for p, spec in params if any(spec)), params[0])
        leaf = new_state["params"]
        for key in path.split("['params']")[1].strip("[]'").split("']['"):
            leaf = leaf[key]
        assert leaf.sharding.device_set == {devices[i] for i in st.devices}
        assert dict(leaf.sharding.mesh.shape) == dict(zip(st.mesh.axis_names, st.mesh.shape))
        names = [tuple(st.mesh.axis_names[a] for a in axes) or None for axes in spec]
        assert tuple(leaf.sharding.spec) + (None,) * (len(names) - len(leaf.sharding.spec)) == tuple(
            None if a is None else a[0] if len(a) == 1 else a for a in names)
    again, _ = step(new_state, batch)  # the returned state feeds the next step where it lies
    assert np.isfinite(np.asarray(jax.tree.leaves(again)[0])).all()
    # The JSON form carries everything needed to run the pipeline again.
    loaded = planner.Plan.from_json(plan.to_json())
    assert loaded.pipeline.num_microbatches == 2
    assert planner.Plan.from_json(loaded.to_json()).to_dict() == loaded.to_dict()
    rebuilt = PipelinedStep.from_plan(b.loss_fn, opt, loaded)
    assert rebuilt.layouts == step.jitted(state, batch)._runtime().layouts
    assert (rebuilt.num_microbatches, rebuilt.schedule) == (2, "gpipe")
    lowered = step.lower(state, batch)  # one StageLowered per stage: forward, backward, update
    assert [set(st.programs()) for st in lowered] == [{"forward", "backward", "update"}] * len(plan.stages)
    # A saved plan runs again from its JSON form alone.
    runner = run_plan(train_step, loaded)
    again_state, again_metrics = runner(state, batch)
    _close(b, opt, state, batch, again_state, again_metrics, ref_state, ref_metrics)


def test_auto_pipeline_on_one_device_is_the_intra_op_plan(gpt_tiny, devices8):
    b, _, state, batch, _, _ = gpt_tiny
    step = planner.plan_parallel(b.train_step, mesh=(1,), devices=jax.devices()[:1], pipeline="auto")
    plan = step.plan(b.abstract_state(), b.abstract_batch())
    assert plan.stages == () and plan.pipeline.num_stages == 1
    assert plan.pipeline.bubble_fraction == 0.0
    # The single-stage plan the search priced is the one returned, bound to the devices: one solve.
    args = (b.abstract_state(), b.abstract_batch())
    one = jax.devices()[:1]
    options = planner.PlanOptions(pipeline="auto")
    again, pp = plan_stages(b.train_step, args, trace(b.train_step, *args), cluster_for(MeshSpec((1,), ("x",)), 1, options),
                            options, one)
    assert pp.num_stages == 1 and again.solver is pp.single_stage_plan[0].solver
    assert again.jax_mesh is not None and list(again.jax_mesh.devices.flat) == one
    assert again.prediction == plan.prediction


def test_model_without_module_names_splits_by_balanced_layers():
    skip_if_fewer_devices(8)

    def loss_fn(ws, batch):
        h = batch["x"]
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - batch["y"]) ** 2)

    ws = [jax.random.normal(jax.random.key(i), (16, 16)) * 0.3 for i in range(6)]
    batch = {"x": jax.random.normal(jax.random.key(9), (8, 16)), "y": jnp.zeros((8, 16))}
    sgd = optax.sgd(0.1)
    # Layers named by the planner's balanced clustering are matched to the stages by position.
    layouts = even_layouts([f"layer{i}" for i in range(4)], jax.devices()[:8], 2)
    new, metrics = PipelinedStep(loss_fn, sgd, layouts, 4)({"params": ws, "opt_state": sgd.init(ws)}, batch)
    n = longest_reduction(jax.value_and_grad(loss_fn), ws, batch)
    assert_loss_close(metrics["loss"], jax.jit(loss_fn)(ws, batch), n)
    assert_sgd_step_close(loss_fn, 0.1, ws, batch, new["params"], n=n)


def test_replica_share_that_does_not_trace_reduces_every_microbatch(caplog):
    """Data-parallel stages accumulate gradients per replica, tracing the loss on one replica's
    share of a microbatch. An MoE routing 32-token groups traces on a microbatch of 8 rows of 8
    tokens but not on a quarter of it (2 rows, 16 tokens): the runtime stopped there with the
    model's own traceback; now those stages reduce gradients every microbatch, with a warning: the
    step is the one without per-replica accumulation (`replica_grads=False`, checked against the
    unsharded step elsewhere), bit for bit, and its loss is the unsharded step's."""
    import logging

    skip_if_fewer_devices(8)
    b = get_model("moe-tiny", batch=16, seq=8, group_size=32)
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    names = layer_names(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())
    step = PipelinedStep(b.loss_fn, opt, even_layouts(names, jax.devices()[:8], 2), 2, "1f1b")
    with caplog.at_level(logging.WARNING, logger="planner"):
        new_state, metrics = step(state, batch)
    warned = [r.getMessage() for r in caplog.records if "data-parallel replicas' share" in r.getMessage()]
    assert len(warned) == 1 and "2 of 8 rows" in warned[0] and "every microbatch" in warned[0]
    plain = PipelinedStep(b.loss_fn, opt, even_layouts(names, jax.devices()[:8], 2), 2, "1f1b", replica_grads=False)
    want_state, want_metrics = plain(state, batch)
    for got, want in zip(jax.tree.leaves((new_state, metrics)), jax.tree.leaves((want_state, want_metrics))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_loss_close(metrics["loss"], ref_metrics["loss"], longest_reduction(b.train_step, state, batch))
