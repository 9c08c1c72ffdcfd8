"""Fusion-aware memory traffic (planner/fusion.py) against XLA's compiled programs and by hand."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from planner.cost_model import CostModel
from planner.fusion import fusions, memory_traffic_bytes
from planner.graph import trace
from planner.ilp.problem import TIE_BREAK_S_PER_BYTE
from planner.mesh import MeshSpec
from planner.options import PlanOptions
from planner.planning import make_plan
from xla_hooks.inspect import report
from zoo import get_model

# The model's stated approximations (a value read by two fusions is written once and read twice;
# XLA may instead duplicate a cheap producer; sibling reductions are not merged) are of the order
# of a few large tensors in a whole train step; the project's accuracy goal for predictions is 10%.
GOAL = 0.10


@pytest.mark.parametrize("name", ["gpt-tiny"])
def test_fused_traffic_matches_compiled_bytes_accessed(name):
    """XLA's cost analysis counts each fusion's operands and results once: the bytes the grouping
    predicts for the unsharded step are within the goal of it, while per-op counting is 2x off."""
    b = get_model(name, layers=1)
    state, batch = b.abstract_state(), b.abstract_batch()
    graph = trace(b.train_step, state, batch)
    xla = report(jax.jit(b.train_step).lower(state, batch).compile()).bytes_accessed
    fused = memory_traffic_bytes(graph)
    unfused = sum(sum(graph.tensors[x].nbytes for x in op.tensor_inputs) +
                  sum(graph.tensors[t].nbytes for t in op.outputs) for op in graph.ops)
    assert fused == pytest.approx(xla, rel=GOAL)
    assert unfused > 2 * xla  # what the cost model charged before fusion grouping


def test_grouping_by_hand():
    def f(x, w, c):
        h = jnp.tanh(x @ w) * 2.0 + c  # dot alone; tanh, mul, add fuse into one loop fusion
        return jnp.sum(jnp.exp(h - 1.0)), h  # exp and sub fuse into the reduction (input fusion)

    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    c = jnp.ones((64, 16), jnp.float32)
    g = trace(f, x, w, c)
    fz = fusions(g)
    by_name = {}
    for op in g.ops:
        by_name.setdefault(op.name, []).append(fz[op.index])
    dot, = by_name["dot_general"]
    tanh, = by_name["tanh"]
    red, = by_name["reduce_sum"]
    exp, = by_name["exp"]
    assert dot.reads == (True, True) and dot.writes == (True,)  # a kernel of its own
    assert tanh.fusion != dot.fusion and tanh.reads == (True,) and tanh.writes == (False,)
    add = next(t for t in by_name["add"] if t.fusion == tanh.fusion)
    assert add.writes == (True,)  # h is a program output and feeds the reduction's fusion
    assert exp.fusion == red.fusion != tanh.fusion
    # dot: x, w in, y out; loop fusion: y, c in, h out; reduction: h in, scalar out
    nbytes = 4 * (64 * 32 + 32 * 16 + 64 * 16) + 4 * (64 * 16 * 3) + 4 * (64 * 16 + 1)
    assert memory_traffic_bytes(g) == nbytes


def test_an_elementwise_chain_is_priced_as_one_pass_over_memory():
    """Ten (sin, mul) pairs on a 64 MiB array read and write it once: against one pair, the other
    eighteen ops add only their FLOP time (one FLOP per element at the float32 peak), no memory."""
    def chain(n):
        def f(x):
            for k in range(n):
                x = jnp.sin(x) * (1.0 + k)
            return x
        return f

    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    mesh, options = MeshSpec((1,), ("x",)), PlanOptions(hardware="a100-80gb")
    one, ten = (make_plan(trace(chain(n), x), mesh, options).prediction.compute_time_s for n in (1, 10))
    hw = CostModel.build(mesh, "a100-80gb").hardware
    assert ten - one == pytest.approx(18 * 4096 * 4096 / hw.flops_f32, rel=1e-6)
    # one pair: the sin reads the array, the mul writes it (each op's time is the larger of its FLOP and
    # memory times), plus the input's tie-break, which is reported as compute
    sin = max(4096 * 4096 / hw.flops_f32, 4096 * 4096 * 4 / hw.memory_bandwidth)
    hand = 2 * sin + TIE_BREAK_S_PER_BYTE * 4096 * 4096 * 4
    assert one == pytest.approx(hand, rel=1e-6)
