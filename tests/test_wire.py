"""Wire formats (`PlanOptions.comm_precision`, `planner.ilp.wire`, `planner.emit.wire`): split
contractions' partial sums reduced in float32 by default and rounded once, as the unsharded
contraction rounds; weights gathered as int8 with block scales under "int8", the compiled program's
all-gathers carrying s8; both priced by the cost model."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner import cli
from planner.core.errors import InvalidArgumentError
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.emit.wire import dequantize, quantize, reduce_replicas
from planner.graph.trace import trace
from planner.ilp.strategies import Quantized, edge_time
from planner.ilp.wire import block_for, wire_tensor
from planner.search.mesh_plan import plan_problem
from tests.helpers import assert_loss_close, longest_reduction, unit_roundoff

# a newcomer's step: odd vocabulary, int token and label inputs, a bool mask, bf16 compute over
# float32 master weights
V, D, H, B, S = 37, 64, 256, 8, 12


def _params(key=0):
    k = jax.random.split(jax.random.key(key), 4)
    return {"emb": jax.random.normal(k[0], (V, D)) * 0.1, "w1": jax.random.normal(k[1], (D, H)) * D ** -0.5,
            "w2": jax.random.normal(k[2], (H, D)) * H ** -0.5, "out": jax.random.normal(k[3], (D, V)) * D ** -0.5}


def _batch():
    r = np.random.default_rng(0)
    return (jnp.asarray(r.integers(0, V, (B, S)), jnp.int32), jnp.asarray(r.integers(0, V, (B, S)), jnp.int32),
            jnp.asarray(r.random((B, S)) > 0.2))


def _loss(dtype):
    def loss(p, batch):
        tokens, labels, mask = batch
        c = jax.tree.map(lambda x: x.astype(dtype), p)
        x = c["emb"][tokens]
        x = x + jax.nn.gelu(x @ c["w1"]) @ c["w2"]
        logp = jax.nn.log_softmax((x @ c["out"]).astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(mask.sum(), 1)
    return loss


def _sgd(loss):
    def step(p, batch):
        value, g = jax.value_and_grad(loss)(p, batch)
        return jax.tree.map(lambda a, b: a - b, p, g), value
    return step


def test_exact_partial_sums_round_once(devices8):
    """The newcomer's step on 2x4. Under "exact" (the default) a split contraction's float32 partial sums are reduced, then
    rounded to bf16 once: its result equals the unsharded one except where the two float32 sums
    of the same terms in another order straddle a bf16 rounding boundary. The chance of a straddle
    is about the float32 error over the bf16 spacing, n u32 / u_bf16 = 96 * 2^-24 / 2^-9 < 0.3%
    per element for the longest sum here (n = B*S, the weight gradients'), so at most 1% of the
    elements may differ. Where the straddle is in the gradient's own contraction it differs by one
    bf16 spacing; where it is upstream (an activation or cotangent one bf16 spacing off, itself
    a split contraction's result), one term of the gradient's sum moves by a spacing of that term,
    which can be several spacings of a sum that cancels, so only the count is bounded (seen: one
    element of w1's 16384 at 3.7 spacings). Under "bf16" every device rounds its share first, and
    most elements differ."""
    p, batch = _params(), _batch()
    step = _sgd(_loss(jnp.bfloat16))
    want, _ = jax.jit(step)(p, batch)
    differing = {}
    for precision in ("exact", "bf16"):
        f = planner.plan_parallel(step, mesh="2x4", comm_precision=precision)
        got, _ = f(p, batch)
        plan = f.plan(p, batch)
        if precision == "exact":
            assert {w.kind for w in plan.wire} == {"partial-sum"} and all(w.dtype == "float32" for w in plan.wire)
            assert Plan.from_json(plan.to_json()).wire == plan.wire
        else:
            assert plan.wire == ()
        count = 0
        for name in ("w1", "w2", "out"):  # gradients made by contractions (emb's: a scatter-add, bf16 either way)
            g_got = np.asarray(p[name] - got[name], np.float64)
            g_want = np.asarray(p[name] - want[name], np.float64)
            count += int(np.count_nonzero(g_got != g_want))
        differing[precision] = count
    total = sum(p[n].size for n in ("w1", "w2", "out"))
    assert differing["exact"] <= 0.01 * total, differing
    assert differing["bf16"] >= 0.1 * total, differing  # the rounding the default avoids is there


def test_quantize_round_trip_error():
    """int8 blocks with a bf16 scale s = bf16(absmax / 127): each element is off by at most s / 2
    from the rounding, plus the scale's own rounding (relative u_bf16) times 127 s."""
    x = jax.random.normal(jax.random.key(1), (6, 96)) * jnp.linspace(0.01, 3.0, 96)
    block = 32
    back = dequantize(quantize(x, block), block, x.shape, x.dtype)
    blocks = np.asarray(x).reshape(6, 3, block)
    absmax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    bound = absmax / 127 / 2 * (1 + 2 * unit_roundoff(jnp.bfloat16)) + absmax * unit_roundoff(jnp.bfloat16)
    err = np.abs(np.asarray(back).reshape(6, 3, block) - blocks)
    assert np.all(err <= bound * (1 + 1e-6))
    assert quantize(x, block).dtype == jnp.int8 and quantize(x, block).shape == (6, 3, block + 2)


def test_int8_weight_gathers_compile_to_s8(devices8):
    """Weights pinned fully sharded (FSDP) and the batch split: under "int8" the weights are gathered
    as int8 with block scales; the compiled program's all-gathers carry s8; the step's loss (its
    forward: no gradient reduction in it) equals the unsharded program's with the same reads
    quantised, within the float32 summation bound."""
    p, batch = _params(), _batch()
    loss = _loss(jnp.float32)
    step = _sgd(loss)
    pins = {"1/0": P("x"), "1/1": P("x"), "1/2": P("x"), "emb": P(None, "x"), "w1": P(None, "x"),
            "w2": P("x", None), "out": P("x", None)}
    f = planner.plan_parallel(step, mesh="8", pins=pins, comm_precision="int8")
    _, got = f(p, batch)
    plan = f.plan(p, batch)
    gathers = {(w.op, w.pos): w.block for w in plan.wire if w.kind == "gather"}
    assert gathers and all(w.dtype == "int8" for w in plan.wire if w.kind == "gather")
    hlo = f.lower(p, batch).compile().as_text()
    assert re.search(r"= s8\[[^\]]*\][^ ]* all-gather\(", hlo), "no s8 all-gather in the compiled program"
    exact = planner.plan_parallel(step, mesh="8", pins=pins).plan(p, batch)
    assert plan.prediction.bytes_moved_per_device < exact.prediction.bytes_moved_per_device

    graph = trace(step, p, batch)

    def quantized_reads(op, operands):
        return [dequantize(quantize(v, gathers[(op.index, k)]), gathers[(op.index, k)], v.shape, v.dtype)
                if (op.index, k) in gathers else v for k, v in enumerate(operands)]

    flat = jax.tree_util.tree_leaves((p, batch))
    _, want = jax.tree_util.tree_unflatten(graph.out_tree, jax.jit(
        lambda *xs: graph.evaluate(list(xs), before_op=quantized_reads))(*flat))
    _, plain = jax.jit(step)(p, batch)
    n = longest_reduction(loss, p, batch)
    assert_loss_close(got, want, n)
    assert float(got) != float(plain)  # the quantised weights are what the planned step computed with


def test_wire_pricing():
    """On the cost model: a bf16 contraction's partial sums cost float32 bytes under "exact" and
    bf16 bytes under "bf16"; an int8 gather of a weight moves about half its bf16 bytes."""
    x = jnp.zeros((64, 512), jnp.bfloat16)
    w = jnp.zeros((512, 256), jnp.bfloat16)
    graph = trace(lambda a, b: a @ b, x, w)
    mesh = MeshSpec((8,), ("x",))
    nbytes = {}
    for precision in ("exact", "bf16"):
        problem = plan_problem(graph, mesh, PlanOptions(comm_precision=precision, hardware="a100-80gb"))
        dot = next(n for n in problem.nodes if n.label.startswith("dot_general"))
        nbytes[precision] = {b for comms in dot.comms for kind, _, b in comms if kind == "all-reduce"}
    assert nbytes["exact"] == {2 * b for b in nbytes["bf16"]} and nbytes["bf16"]
    cost = plan_problem(graph, mesh, PlanOptions(hardware="a100-80gb")).cost
    t = graph.tensors[graph.inputs[1]]
    q = Quantized(t, wire_tensor(t, 8))
    assert wire_tensor(t, 8).nbytes == 512 * (256 + 2 * 256 // block_for(t, 8))
    src, dst = ((0,), ()), ((), ())
    assert edge_time(q, src, dst, cost) < edge_time(t, src, dst, cost)


def test_comm_precision_errors_and_cli(capsys):
    with pytest.raises(InvalidArgumentError, match="comm_precision='fp8' must be one of"):
        PlanOptions(comm_precision="fp8")
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "8", "--quiet", "--time-limit", "5",
                     "--dtype", "bfloat16", "--comm-precision", "bf16"])
    out = capsys.readouterr().out
    assert code == 0 and "on the wire           bf16" in out, out


def test_int8_gradient_reductions(devices8):
    """Data parallelism on 8 devices (parameters replicated, one example per device) under "int8":
    the weight gradients' partial sums are exchanged as int8 chunks (ZeRO++'s qgZ): the compiled
    program's all-to-alls carry s8. Each device's partial sum is quantised once (error at most
    (1/254 + u_bf16) of its largest element: half an int8 step, and the bf16 scale's rounding) and
    the reduced chunk once more for the all-gather, so a gradient is off by at most
    (1/254 + u_bf16) (sum over devices of max |partial| + max |gradient|), plus the float32
    summation bound."""
    p, batch = _params(), _batch()
    loss = _loss(jnp.float32)
    step = _sgd(loss)
    # the axis priced as a slow network: at these sizes int8 pays only where bytes are dear
    f = planner.plan_parallel(step, mesh="8", pins={"*": P()}, comm_precision="int8", hardware="v100",
                              inter_host_axes=(0,), inter_host="1Gbit")
    got, _ = f(p, batch)
    plan = f.plan(p, batch)
    reduced = {w.op for w in plan.wire if w.kind == "reduce"}
    assert reduced and all(w.dtype == "int8" for w in plan.wire if w.kind == "reduce")
    hlo = f.lower(p, batch).compile().as_text()
    assert re.search(r"s8\[[^\]]*\][^=]*all-to-all\(", hlo), "no s8 all-to-all in the compiled program"
    tokens, labels, mask = batch
    count = jnp.maximum(mask.sum(), 1)

    def device_loss(params, b):  # device b's share of the mean: its example's terms over the global count
        one = jax.tree.map(lambda x: x[b:b + 1], batch)
        return loss(params, one) * jnp.maximum(one[2].sum(), 1) / count

    partials = [jax.jit(jax.grad(device_loss), static_argnums=1)(p, b) for b in range(B)]
    want = jax.jit(jax.grad(loss))(p, batch)
    u = unit_roundoff(np.float32)
    n = longest_reduction(jax.grad(loss), p, batch)
    per_int8 = 1 / 254 + unit_roundoff(jnp.bfloat16)
    for name in ("w1", "w2", "out"):  # made by contractions (emb's gradient: a scatter-add, reduced as float32)
        spread = sum(float(np.max(np.abs(np.asarray(g[name])))) for g in partials)
        top = float(np.max(np.abs(np.asarray(want[name]))))
        tol = per_int8 * (spread + top) * (1 + 1e-3) + 2 * n * u * spread + 2 * u * float(np.max(np.abs(p[name])))
        err = float(np.max(np.abs(np.asarray(p[name] - got[name]) - np.asarray(want[name]))))
        assert err <= tol, (name, err, tol)


def test_replica_gradients_reduced_as_int8(devices8):
    """A pipeline stage's data-parallel replicas accumulate their gradients apart and reduce them
    once per step (`planner.emit.pipeline.programs`); under "int8" the reduction the stage's plan
    priced as int8 runs as qgZ: the per-replica float32 accumulators cut into one chunk per
    replica, int8 all-to-all, float32 sum, int8 all-gather. Each replica's accumulator is
    quantised once and the reduced chunk once more, so the sum is off by at most
    (1/254 + u_bf16) (sum over replicas of max |acc_r| + max |sum|) (see
    test_int8_gradient_reductions) plus float32 summation of 2 terms."""
    mesh = jax.sharding.Mesh(np.asarray(devices8).reshape(2, 4), ("x", "y"))
    acc = jax.random.normal(jax.random.key(3), (2, 64, 96), jnp.float32) * jnp.arange(1, 97) / 96
    sharding = jax.sharding.NamedSharding(mesh, P(None, "y"))
    acc = jax.device_put(acc, jax.sharding.NamedSharding(mesh, P("x", None, "y")))
    f = jax.jit(lambda a: reduce_replicas(a, "int8", sharding, ("x",)), out_shardings=sharding)
    got = np.asarray(f(acc))
    want = np.asarray(acc, np.float64).sum(0)
    spread = sum(float(np.max(np.abs(np.asarray(acc[r])))) for r in range(2))
    per_int8 = 1 / 254 + unit_roundoff(jnp.bfloat16)
    tol = per_int8 * (spread + float(np.max(np.abs(want)))) * (1 + 1e-3) + 2 * unit_roundoff(np.float32) * spread
    assert float(np.max(np.abs(got - want))) <= tol
    hlo = f.lower(acc).compile().as_text()
    assert re.search(r"s8\[[^\]]*\][^=]*all-to-all\(", hlo) and re.search(r"s8\[[^\]]*\][^=]*all-gather\(", hlo)
    # the other formats: float32 as accumulated, or the named dtype
    assert np.array_equal(np.asarray(jax.jit(lambda a: reduce_replicas(a, "float32", sharding, ("x",)))(acc)),
                          np.asarray(jnp.sum(acc, axis=0)))


def test_pipeline_stage_reduces_replicas_as_planned(devices8):
    """gpt-tiny pipelined on 2x4 (links priced at 1 Gbit/s, where int8 pays) under "int8": a
    data-parallel stage whose plan exchanges gradients as int8 over its replica axis reduces them
    once per step that way in its compiled update (s8 all-to-all), and the step runs."""
    from planner.emit.pipeline.runtime import PipelinedStep
    from zoo import get_model, make_optimizer

    # 32 rows: the last stage's batch split over its replica axis. The layout is a close call: with
    # 16 rows its layer plans (planned for the step's 2 microbatches) split the vocabulary instead,
    # with 64 the layers weighed below their price per step (`layer_cost._discounted_per_microbatch`)
    # keep their one-microbatch plans, and no stage exchanges gradients over a data axis either way
    b = get_model("gpt-tiny", layers=2, batch=32, seq=8, d_model=64, vocab=64, dtype="bfloat16")
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    plan = planner.plan(b.train_step, state, batch, mesh=(2, 4), hardware="v100", pipeline=True,
                        num_microbatches=2, comm_precision="int8", inter_host_axes=(0,), inter_host="1Gbit",
                        intra_host="1Gbit")
    int8_stages = {s for s, st in enumerate(plan.stages) if st.data_axes and any(
        w.kind == "reduce" and {st.plan.mesh.axis_names[a] for a in w.axes} & set(st.data_axes) for w in st.plan.wire)}
    assert int8_stages
    step = PipelinedStep.from_plan(b.loss_fn, make_optimizer(b.config.learning_rate, b.config.weight_decay),
                                   plan, devices8)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (state["params"], state["opt_state"], batch))
    for s, st in enumerate(step.lower(*abstract)):
        found = re.search(r"s8\[[^\]]*\][^=]*all-to-all\(", st.update.compile().as_text())
        assert bool(found) == (s in int8_stages), s
    _, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
