"""Public API contract: plan_parallel (call and decorator), plan, caching, lowering, JSON, errors, donation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from zoo import get_model
from tests.helpers import assert_bundle_step_close, concrete

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_api")


@pytest.fixture(scope="module")
def mlp():
    return concrete("mlp-tiny")


def test_decorator_form_and_plan_cache(mlp, devices8):
    b, state, batch = mlp

    @planner.plan_parallel(mesh=(2, 4))
    def step(s, x):
        return b.train_step(s, x)

    new_state, metrics = step(state, batch)
    assert jnp.isfinite(metrics["loss"])
    p1 = step.plan(state, batch)
    assert step.plan(b.abstract_state(), b.abstract_batch()) is p1  # same abstract signature -> cached
    assert isinstance(step.lower(state, batch), jax.stages.Lowered)
    p2 = step.plan(state, b.make_batch(jax.random.key(3)))
    assert p2 is p1


def test_mesh_forms_are_equivalent(mlp, mesh_2x4):
    b, state, batch = mlp
    plans = [planner.plan(b.train_step, state, batch, mesh=m) for m in (mesh_2x4, (2, 4), "2x4")]
    assert plans[0] == plans[1] == plans[2]
    shardings = jax.tree_util.tree_leaves(plans[0].in_shardings)
    assert all(isinstance(s, jax.sharding.NamedSharding) for s in shardings)
    assert len(shardings) == len(jax.tree_util.tree_leaves((state, batch)))


def test_json_round_trip_and_determinism(devices8):
    b = get_model("gpt-tiny")
    args = (b.abstract_state(), b.abstract_batch())
    p1 = planner.plan(b.train_step, *args, mesh="2x4")
    p2 = planner.plan(b.train_step, *args, mesh="2x4")
    assert p1 == p2  # same inputs -> identical plan
    text = p1.to_json()
    loaded = planner.Plan.from_json(text)
    assert loaded == p1 and loaded.to_json() == text
    assert set(("mesh", "stages", "shardings", "predicted", "options")) <= set(__import__("json").loads(text))
    with pytest.raises(planner.InvalidArgumentError, match="pytree structure"):
        loaded.in_shardings
    bound = loaded.bind(*args)
    assert jax.tree_util.tree_structure(bound.in_shardings) == jax.tree_util.tree_structure(args)
    assert "Plan on mesh 2x4" in p1.summary()
    # Each decision's cost is split exactly into compute, its own collectives and resharding.
    assert p1.decisions
    for d in p1.decisions:
        assert d.compute_s + d.communication_s + d.resharding_s == pytest.approx(d.cost_s, rel=1e-9, abs=1e-15)
        assert d.runner_up_delta_s >= -1e-9  # locally optimal too (up to the ILP's 10 ps rounding)


def test_mesh_chosen_when_omitted(mlp, devices8):
    b, state, batch = mlp
    plan = planner.plan(b.train_step, state, batch)
    assert plan.mesh.size == 8


def test_corrupt_plan_json():
    with pytest.raises(planner.InvalidArgumentError, match="not a valid plan JSON"):
        planner.Plan.from_json("{not json")


@pytest.mark.parametrize(
    "mesh, error, pattern",
    [
        ((2, 2), planner.MeshError, r"has 4 devices but 8 devices are available"),
        ("3x3", planner.MeshError, r"has 9 devices"),
        ("2by4", planner.MeshError, r"not of the form '2x4'"),
        ([1.5, 2], planner.MeshError, r"not understood"),
    ],
)
def test_bad_mesh(mlp, mesh, error, pattern, devices8):
    b = mlp[0]
    with pytest.raises(error, match=pattern):
        planner.plan_parallel(b.train_step, mesh=mesh)


def test_mesh_axis_that_divides_nothing(devices8):
    def f(x):
        return (x * 2).sum()

    with pytest.raises(planner.MeshError, match=r"axis 'x' of size 8 divides no dimension"):
        planner.plan(f, jnp.ones((3, 5)), mesh=(8,))


def test_unknown_option_and_bad_values(mlp):
    b = mlp[0]
    with pytest.raises(planner.InvalidArgumentError, match=r"unknown planner option\(s\) 'memory_budjet'.*valid options"):
        planner.plan_parallel(b.train_step, mesh=(8,), memory_budjet="1GB")
    with pytest.raises(planner.InvalidArgumentError, match=r"memory_budget='lots' is not a size"):
        planner.plan_parallel(b.train_step, mesh=(8,), memory_budget="lots")
    with pytest.raises(planner.InvalidArgumentError, match="solver_time_limit"):
        planner.plan_parallel(b.train_step, mesh=(8,), solver_time_limit=-1)
    with pytest.raises(planner.InvalidArgumentError, match="unknown hardware"):
        planner.plan_parallel(b.train_step, mesh=(8,), hardware="abacus")


def test_non_array_leaves_are_static_and_part_of_the_cache_key(mlp, devices8):
    """As `equinox.filter_jit` takes them: a string in the batch is closed over (not traced), handed
    back as it came in, and a new value plans again."""
    b, state, batch = mlp
    seen = []

    def step(state, batch):
        seen.append(batch["note"])
        new_state, metrics = b.train_step(state, {k: v for k, v in batch.items() if k != "note"})
        return new_state, {**metrics, "note": batch["note"] + "!"}

    planned = planner.plan_parallel(step, mesh=(8,))
    _, metrics = planned(state, {**batch, "note": "hello"})
    assert metrics["note"] == "hello!" and seen == ["hello"]
    planned(state, {**batch, "note": "hello"})
    assert seen == ["hello"]  # the same static value: the same plan, not traced again
    planned(state, {**batch, "note": "again"})
    assert seen == ["hello", "again"]


def test_equinox_module_step_matches_filter_jit(devices8):
    """A step written as Equinox users write it (the whole module in, `eqx.filter_value_and_grad`,
    the module out) plans on 8 devices and computes `eqx.filter_jit`'s step."""
    import equinox as eqx
    import optax

    from tests.helpers import assert_loss_close, assert_sgd_step_close, longest_reduction

    model = eqx.nn.MLP(16, 8, 32, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    lr = 0.1
    opt = optax.sgd(lr)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    batch = (jax.random.normal(jax.random.key(1), (64, 16)), jax.random.normal(jax.random.key(2), (64, 8)))

    def loss(m, xy):
        return jnp.mean(jnp.sum((jax.vmap(m)(xy[0]) - xy[1]) ** 2, axis=-1))

    def step(model, opt_state, xy):
        value, grads = eqx.filter_value_and_grad(loss)(model, xy)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    planned = planner.plan_parallel(step, mesh="2x4")
    new_model, _, value = planned(model, opt_state, batch)
    ref_model, _, ref_value = eqx.filter_jit(step)(model, opt_state, batch)
    assert isinstance(new_model, eqx.nn.MLP) and new_model.activation is jax.nn.gelu
    params, static = eqx.partition(model, eqx.is_array)

    def loss_of(p, xy):
        return loss(eqx.combine(p, static), xy)

    n = longest_reduction(jax.grad(loss_of), params, batch)
    assert_loss_close(value, ref_value, n)
    for got in (new_model, ref_model):  # both within the summation-order bound of the same gradient
        assert_sgd_step_close(loss_of, lr, params, batch, eqx.filter(got, eqx.is_array), n=n)
    assert planned.plan(model, opt_state, batch).mesh.shape == (2, 4)


def test_a_step_moves_only_the_arguments_not_yet_where_the_plan_puts_them(devices8, monkeypatch):
    """The state a step hands back goes into the next step as it is (placing a whole state with
    `jax.device_put` each call cost tens of milliseconds of host time per step); a new batch moves
    to its planned sharding."""
    from planner.api import _placed
    from planner.emit.offload import in_shardings

    b, state, batch = concrete("gpt-tiny")
    step = planner.plan_parallel(b.train_step, mesh="2x4")
    new_state, _ = step(state, batch)
    plan = step.plan(state, batch)
    args = (new_state, b.make_batch(jax.random.key(7)))
    targets = jax.tree.leaves(jax.tree.broadcast(in_shardings(plan), args, is_leaf=lambda x: x is None),
                              is_leaf=lambda x: x is None)
    placed = _placed(args, targets)
    assert all(x is y for x, y in zip(jax.tree.leaves(placed[0]), jax.tree.leaves(new_state)))
    assert [x.sharding for x in jax.tree.leaves(placed)] == targets
    moved = [x is not y for x, y in zip(jax.tree.leaves(placed[1]), jax.tree.leaves(args[1]))]
    assert any(moved)  # the batch is split over the data axis, not on one device as made
    assert _placed(placed, targets) is placed
    # a call hands jax.device_put the batch's leaves only, and runs as on placed arguments
    put = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put",
                        lambda x, *a, **k: put.append(len(jax.tree.leaves(x))) or real_put(x, *a, **k))
    _, metrics = step(*args)
    monkeypatch.undo()
    assert put == [len(jax.tree.leaves(args[1]))]
    _, ref_metrics = step(*placed)
    assert float(metrics["loss"]) == float(ref_metrics["loss"])


def test_a_step_on_an_explicit_mesh_takes_and_hands_back_its_arrays_as_they_are(devices8, monkeypatch):
    """On a mesh of Explicit axes (`jax.make_mesh`'s default) the planned program runs inside
    `jax.sharding.auto_axes` (the plan is made on the mesh's Auto view) with its arguments and
    results on the user's mesh (`emit.single.jit_on_mesh`): the next step takes the state as it came back
    and only the new batch is placed, with the state donated as a training loop does. It computes
    what the plan's Auto-view program computes, bit for bit."""
    b, state, batch = concrete("gpt-tiny")
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    step = planner.plan_parallel(b.train_step, mesh=mesh, donate_argnums=(0,))
    s1, _ = step(jax.tree.map(jnp.copy, state), batch)
    assert {leaf.sharding.mesh.axis_types for leaf in jax.tree.leaves(s1)} == {mesh.axis_types}
    on_host = jax.tree.map(lambda x: np.array(x, copy=True), s1)  # copies: no host view pins a buffer
    put = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put",
                        lambda x, *a, **k: put.append(len(jax.tree.leaves(x))) or real_put(x, *a, **k))
    s2, metrics = step(s1, batch)
    monkeypatch.undo()
    assert put == [len(jax.tree.leaves(batch))]  # the batch in; nothing else placed either way
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(s1))  # donated, as asked
    assert {leaf.sharding.mesh.axis_types for leaf in jax.tree.leaves(s2)} == {mesh.axis_types}
    plan = step.plan(state, batch)
    with jax.sharding.set_mesh(plan.jax_mesh):  # the Auto-view program of the same plan
        auto_state, auto_metrics = step.jitted(state, batch)(*jax.device_put((on_host, batch), plan.in_shardings))
    assert float(metrics["loss"]) == float(auto_metrics["loss"])
    assert all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(s2), jax.tree.leaves(auto_state)))


def test_donated_state(devices8):
    b, state, batch = concrete("mlp-tiny")
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    step = planner.plan_parallel(b.train_step, mesh="2x4", donate_argnums=0)
    copy = jax.tree_util.tree_map(lambda x: x.copy(), state)  # donation consumes the buffers
    placed = jax.device_put(copy, step.plan(state, batch).in_shardings[0])
    new_state, metrics = step(placed, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    leaf = jax.tree_util.tree_leaves(placed)[0]
    assert leaf.is_deleted()  # the old state's buffers went to the new state
