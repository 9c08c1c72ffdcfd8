"""The pipeline runtime on 8 CPU devices: pipelined train steps equal the unpipelined step."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from planner.errors import InvalidArgumentError
from planner.mesh import MeshSpec
from planner.models import get_model, make_optimizer
from planner.options import PlanOptions
from planner.stages.inter_op import plan_pipeline
from planner.stages.runtime import PipelinedStep, StageLayout, even_layouts, layer_names
from planner.stages.submesh import Cluster
from tests.conftest import skip_if_fewer_devices


@pytest.fixture(scope="module")
def gpt():
    skip_if_fewer_devices(8)
    b = get_model("gpt-tiny")
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state = b.init_state(jax.random.key(0))
    batch = b.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    names = layer_names(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())
    return b, opt, state, batch, ref_state, float(ref_metrics["loss"]), names


def _close(new_state, ref_state, loss, ref_loss):
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 2), (2, 8), (4, 4), (4, 8)])
def test_pipelined_step_equals_unpipelined(gpt, num_stages, num_microbatches):
    b, opt, state, batch, ref_state, ref_loss, names = gpt
    assert names == ("pre", "blocks_0", "blocks_1", "post")
    layouts = even_layouts(names, jax.devices()[:8], num_stages)
    step = PipelinedStep(b.loss_fn, opt, layouts, num_microbatches, "1f1b")
    for schedule in ("1f1b", "gpipe"):
        run = step.with_schedule(schedule)  # same compiled stage programs, other dispatch order
        new_state, metrics = run(state, batch)
        _close(new_state, ref_state, metrics["loss"], ref_loss)
    # Each stage's parameters live on its own submesh.
    leaf = new_state["params"]["blocks_1"]["mlp"]["fc_in"]["kernel"]
    owner = next(l for l in layouts if "blocks_1" in l.layers)
    assert leaf.sharding.device_set == set(owner.devices)


def test_planned_pipeline_runs_with_planned_shardings(gpt):
    b, opt, state, batch, ref_state, ref_loss, _ = gpt
    pp = plan_pipeline(b.train_step, (b.abstract_state(), b.abstract_batch()), Cluster.of(2, 4, "cpu"),
                       PlanOptions(pipeline=True, num_microbatches=4), max_mesh_ndim=2)
    assert pp.num_stages >= 2
    step = PipelinedStep.from_plan(b.loss_fn, opt, pp)
    new_state, metrics = step(state, batch)
    _close(new_state, ref_state, metrics["loss"], ref_loss)
    devices = jax.devices()
    for st in pp.stages:
        path = next(p for p in st.specs if "['params']" in p and "kernel" in p)
        leaf = new_state["params"]
        for key in path.split("['params']")[1].strip("[]'").split("']['"):
            leaf = leaf[key]
        assert leaf.sharding.device_set == {devices[i] for i in st.devices}
        assert leaf.sharding.mesh.shape_tuple == tuple(zip(st.mesh.axis_names, st.mesh.shape))
    # Second step: the returned state feeds the next step where it lies.
    again, _ = step(new_state, batch)
    assert np.isfinite(np.asarray(jax.tree.leaves(again)[0])).all()


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
    loss, grads = jax.jit(jax.value_and_grad(b.loss_fn))(params, batch)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    # With SGD(lr=1) the update is the gradient: the tied embedding sums both stages' contributions.
    for p, n, g in zip(jax.tree.leaves(params), jax.tree.leaves(new["params"]), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(p) - np.asarray(n), np.asarray(g), rtol=1e-3, atol=1e-6)


def test_bad_layouts_are_rejected(gpt):
    b, opt, state, batch, _, _, names = gpt
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
