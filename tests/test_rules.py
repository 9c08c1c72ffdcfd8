"""Sharding rules: labels per primitive, strategy enumeration on N-D meshes, the replicated fallback."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

import planner
from planner.cost_model import CostModel
from planner.graph.trace import trace
from planner.ilp.rules import _reshape_groups, signature
from planner.ilp.strategies import enumerate_strategies, reshard_cost
from planner.core.mesh import MeshSpec
from planner.core.sharding import enumerate_specs, is_valid


def _op(fn, *args, name):
    g = trace(fn, *args)
    return g, next(op for op in g.ops if op.name == name)


def test_dot_general_labels_batch_contract_free():
    g, op = _op(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), jnp.ones((2, 4, 6)), jnp.ones((2, 6, 8)),
                name="dot_general")
    sig = signature(op, g)
    assert sig.inputs[0] == ("b0", "m1", "k0") and sig.inputs[1] == ("b0", "k0", "n2")
    assert sig.outputs == (("b0", "m1", "n2"),)
    assert sig.sum_labels == {"k0"}
    assert sig.flops == 2 * 2 * 4 * 6 * 8


def test_reshape_keeps_major_dim_of_each_group():
    assert _reshape_groups((4, 6, 8), (24, 8)) == [([0, 1], [0]), ([2], [1])]
    g, op = _op(lambda x: x.reshape(24, 8), jnp.ones((4, 6, 8)), name="reshape")
    sig = signature(op, g)
    assert sig.inputs[0][1] is None  # the minor dim of a merge cannot stay split
    assert sig.inputs[0][0] == sig.outputs[0][0] and sig.inputs[0][2] == sig.outputs[0][1]


def test_elementwise_broadcasts_size_one_dims():
    g, op = _op(lambda x, b: x + b, jnp.ones((8, 4)), jnp.ones((1, 4)), name="add")
    sig = signature(op, g)
    assert sig.inputs[1][0] is None and sig.inputs[1][1] == sig.outputs[0][1]


def test_strategies_on_3d_mesh_divide_evenly():
    mesh = MeshSpec((2, 2, 2), ("a", "b", "c"))
    g, op = _op(lambda a, b: a @ b, jnp.ones((4, 6)), jnp.ones((6, 8)), name="dot_general")
    sig = signature(op, g)
    strategies = enumerate_strategies(sig, [g.tensors[i] for i in op.inputs], [g.tensors[op.outputs[0]]],
                                      CostModel.default(mesh))
    assert strategies
    for s in strategies:
        assert is_valid((4, 6), s.in_specs[0], mesh) and is_valid((6, 8), s.in_specs[1], mesh)
    # A split contraction yields a partial sum: all-reduce or reduce-scatter.
    kinds = {c[0] for s in strategies for c in s.comms}
    assert kinds == {"all-reduce", "reduce-scatter"}
    # 6 is not divisible by 4: no strategy splits the contraction over two axes.
    assert not any(len(axes) == 2 for s in strategies for lab, axes in s.assignment if lab == "k0")


def test_enumerate_specs_counts():
    mesh = MeshSpec((2, 4), ("x", "y"))
    assert len(list(enumerate_specs((8, 8), mesh))) == 9
    assert len(list(enumerate_specs((3, 8), mesh))) == 4  # dim 0 can never be split


def test_reshard_cost_per_axis():
    mesh = MeshSpec((2, 4), ("x", "y"))
    cm = CostModel.default(mesh)
    t = planner.graph.ir.Tensor((8, 16), jnp.dtype("float32"))
    comms, time = reshard_cost(t, ((0,), (1,)), ((), (1,)), cm)
    assert [c[0] for c in comms] == ["all-gather"] and time > 0
    comms, _ = reshard_cost(t, ((1,), ()), ((), (1,)), cm)
    assert [c[0] for c in comms] == ["all-to-all"]
    assert reshard_cost(t, ((), ()), ((0,), (1,)), cm) == ((), 0.0)  # slicing is free


def _mystery_primitive():
    """A primitive the planner has never heard of (built with public JAX extension APIs)."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("mystery_scale")
    prim.def_impl(lambda x: x * 3.0)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 3.0, multiple_results=False))
    return prim


def test_unknown_primitive_is_planned_replicated_with_a_warning(caplog):
    prim = _mystery_primitive()

    def f(x, w):
        return prim.bind(x @ w).sum()

    x, w = jnp.arange(64.0).reshape(8, 8) / 64, jnp.ones((8, 8))
    with caplog.at_level(logging.WARNING, logger="planner"):
        step = planner.plan_parallel(f, mesh=(1, 8))
        p = step.plan(x, w)
    assert p.fallback_primitives == ("mystery_scale",)
    assert any("mystery_scale" in r.message and "replicated" in r.message for r in caplog.records)
    assert float(step(x, w)) == pytest.approx(float(jax.jit(f)(x, w)), rel=1e-6)
