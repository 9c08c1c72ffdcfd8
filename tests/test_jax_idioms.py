"""JAX idioms as users write them: meshes of every axis type (passed in or from `jax.set_mesh`),
`shard_map` regions, the step's own sharding constraints (pinned or hints), keyword arguments."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import planner
from planner.core.sharding import to_partition_spec
from tests.helpers import assert_loss_close, assert_sgd_step_close, longest_reduction

LR = 0.1
NAMES = ("data", "model")


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 8)) * 0.3}


def _batch():
    return jax.random.normal(jax.random.key(1), (16, 16))


def _loss(params, x, constrain=lambda h: h):
    h = constrain(jnp.tanh(x @ params["w1"]))
    return jnp.mean((h @ params["w2"]) ** 2)


def _sgd(loss):
    def step(params, x):
        value, g = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), value
    return step


def _check(step_loss, planned, *, mesh_ctx=None, same_loss=None):
    """The planned SGD step equals the plain jitted one within the derived bounds; `same_loss`: a
    plain-JAX loss equal to `step_loss` for the per-example bound (one a vmap can batch)."""
    params, x = _params(), _batch()
    with contextlib.nullcontext() if mesh_ctx is None else jax.set_mesh(mesh_ctx):
        new, value = planned(params, x)
        n = longest_reduction(jax.grad(same_loss or step_loss), params, x)
        assert_loss_close(value, jax.jit(step_loss)(params, x), n)
        assert_sgd_step_close(same_loss or step_loss, LR, params, x, new, n=n)
    return new


def _mesh(types):
    return jax.make_mesh((2, 4), NAMES, axis_types=types, devices=jax.devices()[:8])


@pytest.mark.parametrize("types", [(AxisType.Explicit,) * 2, (AxisType.Auto,) * 2,
                                   (AxisType.Explicit, AxisType.Auto)], ids=["explicit", "auto", "mixed"])
def test_mesh_of_every_axis_type(types, devices8):
    mesh = _mesh(types)
    new = _check(_loss, planner.plan_parallel(_sgd(_loss), mesh=mesh))
    # results come back on the user's own mesh (its axis types included)
    assert all(leaf.sharding.mesh == mesh for leaf in jax.tree.leaves(new))


def test_mesh_from_set_mesh_context(devices8):
    mesh = _mesh((AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        planned = planner.plan_parallel(_sgd(_loss))
    assert planned.plan(_params(), _batch()).mesh.axis_names == NAMES
    _check(_loss, planned, mesh_ctx=mesh)


def test_abstract_mesh_plans(devices8):
    abstract = jax.sharding.AbstractMesh((2, 4), NAMES, axis_types=(AxisType.Explicit,) * 2)
    plan = planner.plan(_sgd(_loss), _params(), _batch(), mesh=abstract)
    assert plan.mesh.shape == (2, 4) and plan.mesh.axis_names == NAMES
    args = jax.eval_shape(lambda: (_params(), _batch()))
    with jax.sharding.use_abstract_mesh(abstract):  # the abstract context mesh, mesh=None
        assert planner.plan(_sgd(_loss), *args).mesh.axis_names == NAMES


def _constraint_spec(planned, args, prim):
    graph, plan = planned.graph(*args), planned.plan(*args)
    ops = [op.index for op in graph.ops if op.name == prim]
    specs = {op: spec for op, k, spec in plan.op_specs}
    return [to_partition_spec(specs[i], plan.mesh) for i in ops if i in specs]


def test_with_sharding_constraint_is_pinned_and_hint_is_free(devices8):
    mesh = _mesh((AxisType.Auto,) * 2)
    want = P(None, "model")

    def loss(params, x):
        return _loss(params, x, lambda h: jax.lax.with_sharding_constraint(h, NamedSharding(mesh, want)))

    planned = planner.plan_parallel(_sgd(loss), mesh=mesh)
    got = _constraint_spec(planned, (_params(), _batch()), "sharding_constraint")
    assert got and all(s == want for s in got)
    _check(loss, planned)
    assert all(c.kept and c.mode == "pin" for c in planned.plan(_params(), _batch()).user_constraints)
    hinted = planner.plan_parallel(_sgd(loss), mesh=mesh, user_constraints="hint")
    assert {c.mode for c in hinted.plan(_params(), _batch()).user_constraints} == {"hint"}
    _check(loss, hinted)


def test_reshard_on_explicit_mesh_is_pinned(devices8):
    mesh = _mesh((AxisType.Explicit,) * 2)
    want = P(None, "model")

    def loss(params, x):
        return _loss(params, x, lambda h: jax.sharding.reshard(h, want))

    planned = planner.plan_parallel(_sgd(loss), mesh=mesh)
    with jax.set_mesh(mesh):
        got = _constraint_spec(planned, (_params(), _batch()), "reshard")
    assert want in got
    _check(loss, planned, mesh_ctx=mesh)


def test_constraint_that_cannot_hold_is_one_line(devices8):
    mesh = _mesh((AxisType.Auto,) * 2)
    other = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])

    def loss(params, x):
        return _loss(params, x, lambda h: jax.lax.with_sharding_constraint(h, NamedSharding(other, P("seq"))))

    with pytest.raises(planner.MeshError, match="names mesh axis 'seq'") as e:
        planner.plan(_sgd(loss), _params(), _batch(), mesh=mesh)
    assert "\n" not in str(e.value)


def test_shard_map_region_with_psum(devices8):
    mesh = _mesh((AxisType.Auto,) * 2)

    def loss(params, x):
        h = jnp.tanh(x @ params["w1"])
        partial = jax.shard_map(lambda a, w: jax.lax.psum(jnp.sum((a @ w) ** 2), "data"), mesh=mesh,
                                in_specs=(P("data", None), P()), out_specs=P())
        return partial(h, params["w2"]) / h.shape[0]

    planned = planner.plan_parallel(_sgd(loss), mesh=mesh)
    graph = planned.graph(_params(), _batch())
    assert any(op.name == "shard_map" for op in graph.ops)
    assert "shard_map" not in planned.plan(_params(), _batch()).fallback_primitives
    _check(loss, planned, same_loss=lambda p, x: jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2) / x.shape[0])


def test_keyword_arguments_as_jax_jit(devices8):
    planned = planner.plan_parallel(_sgd(_loss), mesh=(2, 4))
    params, x = _params(), _batch()
    a = planned(params, x=x)
    b = jax.jit(_sgd(_loss))(params, x=x)
    np.testing.assert_array_equal(np.asarray(a[1]).shape, np.asarray(b[1]).shape)
    assert planned.plan(params, x=x) is planned.plan(params, x)
    with pytest.raises(planner.InvalidArgumentError):
        planned(params, y=x)


def test_nested_jit_shardings_pin_its_boundary(devices8):
    mesh = _mesh((AxisType.Auto,) * 2)
    inner = jax.jit(lambda h, w: jnp.tanh(h @ w), in_shardings=(NamedSharding(mesh, P("data", None)), None),
                    out_shardings=NamedSharding(mesh, P(None, "model")))

    def loss(params, x):
        return jnp.mean((inner(x, params["w1"]) @ params["w2"]) ** 2)

    planned = planner.plan_parallel(_sgd(loss), mesh=mesh)
    record = planned.plan(_params(), _batch()).user_constraints
    assert {c.user_spec for c in record} >= {str(P("data", None)), str(P(None, "model"))}
    assert all(c.kept for c in record)
    _check(loss, planned, same_loss=_loss)
