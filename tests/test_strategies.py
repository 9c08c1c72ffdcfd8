"""The costs of the ILP's strategies and edges (planner/ilp/strategies.py), against hand computations
and compiled HLO:

- a dot's compute time is priced at the FLOP rate of its operand dtypes, not its accumulator's
  (`rate_dtypes`, `peak_flops`), and the CLI's MFU uses the same rule;
- a gather over several mesh axes moves what one ring all-gather over the combined group moves
  (`reshard_cost`, `edge_time`, `edge_parts`), in the ILP's objective and in the plan's prediction alike.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from planner.cost_model import CostModel, get_hardware, peak_flops, ring_bytes
from planner.graph.ir import Tensor
from planner.graph.trace import trace
from planner.ilp.problem import TIE_BREAK_S_PER_BYTE, build_problem
from planner.ilp.rules import signature
from planner.ilp.cpsat import plan_cost
from planner.ilp.solver import solve
from planner.ilp.strategies import (
    edge_parts,
    edge_time,
    enumerate_strategies,
    part_key,
    part_time,
    rate_dtypes,
    reshard_cost,
)
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.search.mesh_plan import make_plan
from planner.present.report import mfu
from planner.core.sharding import enumerate_specs
from xla_hooks.inspect import collectives

H100 = get_hardware("h100")
MiB = 2**20
N = 4096
BF16_4096 = 737.6e12  # the H100 preset's measured bf16 rate at 4096^3 (planner profile, profile_h100.json)


# --- 1. compute rate by operand dtype ---------------------------------------------------------


def _matmul(dtype, accumulate=None):
    a = jnp.ones((N, N), dtype)
    return trace(lambda x, y: jnp.matmul(x, y, preferred_element_type=accumulate), a, a)


def _replicated_compute_s(graph) -> float:
    op = next(o for o in graph.ops if o.name == "dot_general")
    cost = CostModel.default(MeshSpec((1,), ("x",)), H100)
    ins = [graph.tensors[x] for x in op.inputs]
    outs = [graph.tensors[t] for t in op.outputs]
    (strategy,) = enumerate_strategies(signature(op, graph), ins, outs, cost)
    return strategy.compute_time


@pytest.mark.parametrize("dtype, accumulate, peak", [
    (jnp.bfloat16, jnp.float32, H100.flops_bf16),  # bf16 tensor cores, f32 accumulator: 0.139 ms
    (jnp.bfloat16, None, H100.flops_bf16),
    (jnp.float32, None, H100.flops_f32),  # 2.05 ms
])
def test_matmul_rate_follows_operand_dtype(dtype, accumulate, peak):
    graph = _matmul(dtype, accumulate)
    # compute-bound (128 MiB at 3.35 TB/s is 40 us): 16-bit operands on the preset's measured bf16 curve,
    # float32 ones at the float32 peak times the cited plateau
    rate = BF16_4096 if peak == H100.flops_bf16 else peak * H100.matmul_efficiency
    hand = 2 * N**3 / rate
    assert _replicated_compute_s(graph) == pytest.approx(hand, rel=1e-9)
    plan = make_plan(graph, MeshSpec((1,), ("x",)), PlanOptions(hardware="h100"))
    tie_break = TIE_BREAK_S_PER_BYTE * sum(graph.tensors[t].nbytes for t in graph.inputs)  # the inputs' nodes
    assert plan.prediction.compute_time_s == pytest.approx(hand + tie_break, rel=1e-9)
    assert plan.prediction.step_time_s == pytest.approx(hand + tie_break, rel=1e-9)


def test_bf16_into_f32_matmul_hand_numbers():
    # at the peak: 0.139 ms (bf16) and 2.05 ms (f32); the H100 preset's bf16 4096^3 GEMM runs at its
    # measured 737.6 TFLOP/s, float32 ones at 80.1% of 67 TFLOP/s (the cited plateau): 0.1863 and 2.561 ms
    assert 2 * N**3 / H100.flops_bf16 == pytest.approx(0.139e-3, rel=1e-3)
    assert H100.matmul_efficiency == pytest.approx(792.1 / 989)
    assert _replicated_compute_s(_matmul(jnp.bfloat16, jnp.float32)) == pytest.approx(0.1863e-3, rel=1e-3)
    assert _replicated_compute_s(_matmul(jnp.float32)) == pytest.approx(2.561e-3, rel=1e-3)


def test_one_rate_rule_for_ilp_mfu_and_names():
    """The CLI's MFU prices FLOPs with the same function as the ILP: a bf16 step of one large matmul
    has the MFU of the achieved matmul rate (MFU is against the datasheet peak)."""
    record = {"name": H100.name, "flops_f32": H100.flops_f32, "flops_bf16": H100.flops_bf16}
    flops = 2.0 * N**3
    t = _replicated_compute_s(_matmul(jnp.bfloat16, jnp.float32))
    assert mfu({"bfloat16": flops}, record, t, 1) == pytest.approx(BF16_4096 / H100.flops_bf16)
    assert peak_flops(record, ("bfloat16",)) == peak_flops(H100, (jnp.dtype(jnp.bfloat16),)) == H100.flops_bf16
    assert peak_flops(H100, ("float32",)) == peak_flops(H100, ()) == H100.flops_f32
    assert peak_flops(H100, (jnp.dtype(jnp.bfloat16), np.dtype(np.float32))) == H100.flops_f32  # promoted
    assert peak_flops(H100, ("float16", "int8")) == H100.flops_bf16


def test_elementwise_ops_keep_the_result_rule():
    g = trace(lambda x: x.astype(jnp.bfloat16), jnp.ones((8, 8), jnp.float32))
    op = g.ops[0]
    ins = [g.tensors[x] for x in op.inputs]
    outs = [g.tensors[t] for t in op.outputs]
    assert rate_dtypes(signature(op, g), ins, outs) == (jnp.dtype(jnp.bfloat16),)
    g = trace(lambda x, y: x * y, jnp.ones((8, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16))
    op = g.ops[0]
    assert rate_dtypes(signature(op, g), [g.tensors[x] for x in op.inputs], [g.tensors[op.outputs[0]]]) == \
        (jnp.dtype(jnp.bfloat16),)
    g = _matmul(jnp.bfloat16, jnp.float32)
    op = next(o for o in g.ops if o.name == "dot_general")
    assert rate_dtypes(signature(op, g), [g.tensors[x] for x in op.inputs], [g.tensors[op.outputs[0]]]) == \
        (jnp.dtype(jnp.bfloat16),) * 2


# --- 2. multi-axis gathers --------------------------------------------------------------------

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))
REPLICATED = ((), ())


def _moved(comms, mesh) -> float:
    return sum(ring_bytes(kind, nbytes, mesh.axis_size(axes)) for kind, axes, nbytes in comms)


@pytest.mark.parametrize("shape, full", [((2, 4), 4 * MiB), ((8, 8), 256 * MiB)])
@pytest.mark.parametrize("src", [((0, 1), ()), ((1, 0), ()), ((0,), (1,)), ((1,), (0,))])
def test_replicating_over_both_axes_moves_the_combined_ring_bytes(shape, full, src):
    """(g - 1) / g of the gathered size: 2x4 -> 3.5 MiB of 4 MiB; 8x8 -> 252 of 256 MiB (gathering per
    axis from the shard would count 2.0 and 56)."""
    mesh = MeshSpec(shape, ("x", "y"))
    cost = CostModel.default(mesh)
    t = Tensor((full // 4 // 1024, 1024), np.dtype(np.float32))
    comms, seconds = reshard_cost(t, src, REPLICATED, cost)
    g = mesh.size
    assert _moved(comms, mesh) == pytest.approx((g - 1) / g * full)
    assert _moved(comms, mesh) / MiB == pytest.approx({8: 3.5, 64: 252.0}[g])
    assert {c[0] for c in comms} == {"all-gather"}
    # The time is the ILP's edge cost: the sum of its parts.
    assert seconds == pytest.approx(edge_time(t, src, REPLICATED, cost))
    parts = sum(part_time(t, src, p, part_key(p, REPLICATED), cost) for p in edge_parts(mesh))
    assert seconds == pytest.approx(parts)
    shard = full / g
    link = cost.links
    if src[1] == ():  # one dim split by both: one all-gather over the group (as XLA emits it), a ring of g
        assert len(comms) == 1
        alpha, beta = max(link[a].alpha for a in (0, 1)), max(link[a].beta for a in (0, 1))
        by_hand = (g - 1) * (alpha + shard * beta)
    else:  # two dims: XLA gathers the last dim first, then the other on the larger buffer
        minor, major = src[1][0], src[0][0]
        g_minor, g_major = mesh.shape[minor], mesh.shape[major]
        by_hand = ((g_minor - 1) * (link[minor].alpha + shard * link[minor].beta)
                   + (g_major - 1) * (link[major].alpha + shard * g_minor * link[major].beta))
    assert seconds == pytest.approx(by_hand)


def test_8x8_gather_bytes_by_hand():
    mesh = MeshSpec((8, 8), ("x", "y"))
    t = Tensor((16384, 4096), np.dtype(np.float32))  # 256 MiB; 4 MiB per shard
    comms, _ = reshard_cost(t, ((0, 1), ()), REPLICATED, CostModel.default(mesh))
    assert comms == (("all-gather", (0, 1), 256 * MiB),)
    assert _moved(comms, mesh) == 252 * MiB  # per-axis from the shard: 2 x 7/8 x 32 MiB = 56 MiB


def test_single_axis_gathers_are_unchanged():
    """One axis leaving while the other stays: its gather is of the shard, as before."""
    cost = CostModel.default(MESH_2x4)
    t = Tensor((1024, 1024), np.dtype(np.float32))
    comms, _ = reshard_cost(t, ((0,), (1,)), ((), (1,)), cost)
    assert comms == (("all-gather", (0,), t.nbytes // 4),)
    comms, _ = reshard_cost(t, ((0, 1), ()), ((0,), ()), cost)
    assert comms == (("all-gather", (1,), t.nbytes // 2),)


def test_edge_parts_sum_to_the_exact_gather_cost_for_every_pure_gather():
    """For every pair of layouts where axes only leave, the ILP's parts add up to the collectives'
    time (each gather on its own link, on the buffer the previous ones left)."""
    for shape in ((2, 4), (2, 2, 2)):
        mesh = MeshSpec(shape, tuple("xyz"[: len(shape)]))
        cost = CostModel.default(mesh)
        t = Tensor((16, 16, 8), np.dtype(np.float32))
        specs = list(enumerate_specs(t.shape, mesh))
        for src in specs:
            held = [a for dim in src for a in dim]
            for k in range(len(held) + 1):
                for leaving in itertools.combinations(held, k):
                    dst = tuple(tuple(a for a in dim if a not in leaving) for dim in src)
                    comms, seconds = reshard_cost(t, src, dst, cost)
                    exact = sum(cost.collective_time(kd, b, a) for kd, a, b in comms)
                    g = int(np.prod([mesh.shape[a] for a in leaving])) if leaving else 1
                    ag = [c for c in comms if c[0] == "all-gather"]
                    assert _moved(ag, mesh) == pytest.approx((g - 1) * t.nbytes / mesh.axis_size(held)), (src, dst)
                    assert seconds == pytest.approx(edge_time(t, src, dst, cost))
                    if all(kd == "all-gather" and len(a) == 1 for kd, a, b in comms):  # one part per collective
                        assert seconds == pytest.approx(exact), (src, dst)


@pytest.mark.parametrize("spec, src", [
    (P(("x", "y"), None), ((0, 1), ())),
    (P(("y", "x"), None), ((1, 0), ())),
    (P("x", "y"), ((0,), (1,))),
    (P("y", "x"), ((1,), (0,))),
])
def test_predicted_gather_bytes_equal_compiled(mesh_2x4, spec, src):
    x = jnp.ones((256, 1024), jnp.float32)  # 1 MiB
    f = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh_2x4, spec),
                out_shardings=NamedSharding(mesh_2x4, P()))
    compiled = collectives(f.lower(x).compile())
    comms, _ = reshard_cost(Tensor(x.shape, x.dtype), src, REPLICATED, CostModel.default(MESH_2x4))
    assert [c.kind for c in compiled] == ["all-gather"] * len(compiled)
    assert sum(c.bytes_moved_per_device for c in compiled) == _moved(comms, MESH_2x4) == 7 / 8 * MiB
    # Same collectives: one 8-way gather for one dim split by both axes, one per dim otherwise.
    assert sorted((c.group_size, c.result_bytes) for c in compiled) == \
        sorted((MESH_2x4.axis_size(a), b) for _, a, b in comms)


def _opaque_primitive():
    """A primitive the planner has no rule for: it runs replicated (public JAX extension APIs)."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("opaque_without_rule")
    prim.def_impl(lambda x: x + 1.0)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x + 1.0, multiple_results=False))
    return prim


def test_plan_gathering_both_axes_predicts_the_compiled_bytes(mesh_2x4):
    """End to end: the memory budget keeps a 16 MiB input split over all 8 devices; an op without a
    rule needs it whole; the plan's predicted gather bytes equal the compiled program's."""
    import planner
    from xla_hooks.fidelity import check_fidelity

    opaque = _opaque_primitive()

    def f(x):
        return opaque.bind(jnp.tanh(x)).sum()

    x = jnp.ones((2048, 2048), jnp.float32)
    planned = planner.plan_parallel(f, mesh=mesh_2x4, memory_budget=21 * MiB)
    plan = planned.plan(x)
    spec = plan.input_specs[0]
    assert sorted(a for dim in spec for a in dim) == [0, 1], plan.input_specs
    gathers = [c for c in plan.prediction.collectives if c.kind == "all-gather"]
    predicted = sum(ring_bytes(c.kind, c.nbytes, c.group_size) for c in gathers)
    assert predicted == 7 / 8 * x.nbytes
    compiled = planned.lower(x).compile()
    measured = [c for c in collectives(compiled) if c.kind == "all-gather"]
    assert sum(c.bytes_moved_per_device for c in measured) == predicted
    report = check_fidelity(plan, compiled, tolerance=0.0)
    assert report.ok, report.table()


def test_ilp_with_multi_axis_gathers_matches_brute_force():
    """The CP-SAT model's per-part linearisation is exact: its optimum is the brute-force optimum of
    `plan_cost` (which sums `edge_time`) on a 2-D mesh."""
    def f(x, w):
        return jnp.tanh(x).sum(axis=1) @ w

    problem = build_problem(trace(f, jnp.ones((64, 64, 32)), jnp.ones((32, 8))), CostModel.default(MESH_2x4))
    sizes = [n.size for n in problem.nodes]
    assert np.prod(sizes) <= 200_000
    best = min(plan_cost(problem, c) for c in itertools.product(*(range(s) for s in sizes))
               if all(c[i] == c[r] for i, r in enumerate(problem.rep))
               and all(problem.spec(a, c) == problem.spec(b, c) for a, b in problem.ties))
    sol = solve(problem)
    assert sol.status == "optimal"
    assert sol.objective_s == pytest.approx(best, rel=1e-6, abs=1e-12)
