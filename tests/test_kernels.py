"""Fused kernels: Pallas calls read from their grid, kernels declared with `planner.register_kernel`,
grouped matmuls (`jax.lax.ragged_dot`): sharded, priced, emitted on their shards, checked against
the plain jitted step on 8 CPU devices (the Pallas kernels in interpret mode)."""
from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import attention
from jax.sharding import PartitionSpec as P

import planner
from planner.ilp.rules import signature
from tests.helpers import assert_loss_close, assert_sgd_step_close, assert_trees_close, longest_reduction

B, S, DM, H, DH = 4, 128, 32, 4, 8
BLOCK = 64
LR = 0.1
BLOCKS = attention.BlockSizes(block_q=BLOCK, block_k=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
                              block_q_dq=BLOCK, block_kv_dq=BLOCK)


def _attention_loss(packed: bool):
    def loss(p, batch):
        x = batch["x"]
        rows = x.shape[0]  # the test helpers take per-example gradients
        q, k, v = [(x @ p[n]).reshape(rows, S, H, DH) for n in ("wq", "wk", "wv")]
        o = attention.mha(q, k, v, batch["segments"] if packed else None, causal=True, block_sizes=BLOCKS,
                          interpret=True)
        return jnp.mean((o.reshape(rows, S, H * DH) @ p["wo"] - batch["y"]) ** 2)
    return loss


def _sgd(loss):
    def step(p, batch):
        value, g = jax.value_and_grad(loss)(p, batch)
        return jax.tree.map(lambda a, b: a - LR * b, p, g), value
    return step


def _attention_args(packed: bool):
    ks = jax.random.split(jax.random.key(0), 6)
    p = {n: jax.random.normal(ks[i], (DM, H * DH)) * 0.2 for i, n in enumerate(("wq", "wk", "wv"))}
    p["wo"] = jax.random.normal(ks[3], (H * DH, DM)) * 0.2
    batch = {"x": jax.random.normal(ks[4], (B, S, DM)), "y": jax.random.normal(ks[5], (B, S, DM))}
    if packed:  # two sequences packed in each row
        batch["segments"] = jnp.concatenate([jnp.zeros((B, S // 2), jnp.int32), jnp.ones((B, S // 2), jnp.int32)], 1)
    return p, batch


def _kernels(graph):
    return [op for op in graph.ops if op.name == "pallas_call"]


def test_mha_grid_read_as_batch_and_heads_parallel_with_causal_flops():
    p, batch = _attention_args(True)
    graph = planner.trace(_sgd(_attention_loss(True)), p, batch)
    sigs = {op.params["name"]: signature(op, graph) for op in _kernels(graph)}
    assert set(sigs) == {"mha_forward", "mha_preprocess_backward", "mha_backward"}
    fwd = sigs["mha_forward"]
    assert fwd.known
    # q, k, v [batch, seq, heads, head_dim]: batch and heads split together; seq whole (the causal
    # mask reads the query block's program id), head_dim whole (one block)
    q_labels = fwd.inputs[0]
    assert q_labels[0] is not None and q_labels[2] is not None and q_labels[1] is None and q_labels[3] is None
    assert fwd.inputs[3] == (q_labels[0], None)  # segment ids follow the batch
    assert fwd.outputs[0] == q_labels
    bwd = sigs["mha_backward"].inputs[0]
    assert sigs["mha_backward"].known and None not in (bwd[0], bwd[2]) and bwd[1] is None and bwd[3] is None
    # causal: query block i visits i + 1 key blocks, each two [64 x 8] x [8 x 64]-sized matmuls
    nq = S // BLOCK
    trips = nq * (nq + 1) // 2
    assert fwd.flops == B * H * trips * 2 * (2 * BLOCK * BLOCK * DH)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "segment-ids"])
def test_flash_attention_step_plans_kernel_on_shards(packed, devices8):
    loss = _attention_loss(packed)
    step = _sgd(loss)
    p, batch = _attention_args(packed)
    planned = planner.plan_parallel(step, mesh="2x4", hardware="h100")
    plan = planned.plan(p, batch)
    assert "pallas_call" not in plan.fallback_primitives
    graph = planner.trace(step, p, batch)
    kernels = {op.index for op in _kernels(graph)}
    split = {op for op, _, spec in plan.op_specs if op in kernels and any(spec)}
    assert split == kernels, "every attention kernel runs on shards"

    new_p, value = planned(p, batch)
    ref_p, ref_value = jax.jit(step)(p, batch)
    assert_loss_close(value, ref_value, B * S * DM)
    assert_sgd_step_close(loss, LR, p, batch, new_p, n=longest_reduction(jax.grad(loss), p, batch))

    # the compiled kernels loop over the shard's blocks only: no grid loop carries a whole q/k/v
    text = planned.lower(p, batch).compile().as_text()
    loops = [line for line in text.splitlines() if " while(" in line and "shard_map" in line]
    assert loops
    whole = f"f32[{B},{S},{H},{DH}]"
    assert not any(whole in line.split(" while(")[0] for line in loops)
    heads = {int(m) for line in loops for m in re.findall(rf"f32\[\d+,{S},(\d+),{DH}\]", line.split(" while(")[0])}
    assert heads and max(heads) < H


def _gelu_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = x * jax.nn.sigmoid(1.702 * x)


@jax.custom_vjp
def _fused_gelu(x):
    """A kernel with no grid: one program over the whole array (the planner cannot see it is
    row-parallel)."""
    return pl.pallas_call(_gelu_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _gelu_fwd(x):
    return _fused_gelu(x), x


def _gelu_bwd(x, g):
    s = jax.nn.sigmoid(1.702 * x)
    return (g * (s + 1.702 * x * s * (1 - s)),)


_fused_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _mlp_loss(act):
    def loss(p, batch):
        return jnp.mean((act(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)
    return loss


def _mlp_args():
    ks = jax.random.split(jax.random.key(1), 4)
    p = {"w1": jax.random.normal(ks[0], (32, 64)) * 0.2, "w2": jax.random.normal(ks[1], (64, 32)) * 0.2}
    return p, {"x": jax.random.normal(ks[2], (16, 32)), "y": jax.random.normal(ks[3], (16, 32))}


def test_unreadable_kernel_warns_and_register_kernel_shards_it(devices8, caplog):
    p, batch = _mlp_args()
    with caplog.at_level(logging.WARNING, logger="planner"):
        plan = planner.plan(_sgd(_mlp_loss(_fused_gelu)), p, batch, mesh="2x4")
    assert plan.fallback_primitives == ("pallas_call",)
    warned = [r.getMessage() for r in caplog.records if "pallas_call" in r.getMessage()]
    assert len(warned) == 1 and "'_gelu_kernel (test_kernels.py:" in warned[0] and "planner.register_kernel" in warned[0]

    gelu = planner.register_kernel(_fused_gelu, in_axes=(("rows", "features"),), out_axes=("rows", "features"))
    loss = _mlp_loss(gelu)
    step = _sgd(loss)
    planned = planner.plan_parallel(step, mesh="2x4", pins={"w1": P(None, ("x", "y"))})
    plan = planned.plan(p, batch)
    assert plan.fallback_primitives == ()
    new_p, value = planned(p, batch)
    ref_p, ref_value = jax.jit(_sgd(_mlp_loss(_fused_gelu)))(p, batch)
    assert_loss_close(value, ref_value, 16 * 32)
    assert_sgd_step_close(_mlp_loss(_fused_gelu), LR, p, batch, new_p)
    # the declared call runs on each device's [16, 64 / 8] columns
    text = planned.lower(p, batch).compile().as_text()
    calls = [line for line in text.splitlines() if "custom_partitioning" in line and " = f32[" in line]
    assert calls and all("f32[16,64]" not in line.split("=")[1][:20] for line in calls)
    assert any("f32[16,8]" in line.split("=")[1][:20] for line in calls)


def test_register_kernel_bad_input():
    with pytest.raises(planner.InvalidArgumentError, match="tuple of axis names"):
        planner.register_kernel(_fused_gelu, in_axes=("rows",), out_axes=("rows", None))
    gelu = planner.register_kernel(_fused_gelu, in_axes=(("rows",),), out_axes=("rows",))
    with pytest.raises(planner.InvalidArgumentError, match="operand 0 has rank 2, declared 1"):
        jax.make_jaxpr(gelu)(jnp.ones((4, 4)))


E, T, D, F = 4, 64, 32, 64


def _moe_loss(p, batch, weights=None):
    h = jax.nn.relu(jax.lax.ragged_dot(batch["x"], p["w1"], batch["groups"]))  # tokens sorted by expert
    err = (jax.lax.ragged_dot(h, p["w2"], batch["groups"]) - batch["y"]) ** 2
    return jnp.mean(err if weights is None else weights[:, None] * err)


def _assert_moe_step_close(p, batch, new_p, ref_p):
    """Both SGD steps within the summation bound of their gradients, 2 n u sum_t |g_t| per element
    (g_t: token t's term, the loss being a sum over independent token rows), times the learning
    rate, plus the roundings of p - lr g in each program."""
    u = float(jnp.finfo(jnp.float32).eps) / 2
    n = longest_reduction(jax.grad(_moe_loss), p, batch)
    grad = jax.jit(lambda w: jax.grad(_moe_loss)(p, batch, w))  # (ragged_dot has no vmap over tokens here)
    terms = {name: 0.0 for name in p}
    for t in range(T):
        g = grad(jnp.zeros((T,)).at[t].set(1.0))
        terms = {name: terms[name] + np.abs(np.asarray(g[name], np.float64)) for name in p}
    for name in p:
        tol = LR * 2 * 2 * n * u * terms[name] + 4 * u * np.abs(np.asarray(ref_p[name]))
        assert np.all(np.abs(np.asarray(new_p[name], np.float64) - np.asarray(ref_p[name])) <= tol), name


def test_ragged_dot_splits_features_never_groups(devices8):
    ks = jax.random.split(jax.random.key(2), 4)
    p = {"w1": jax.random.normal(ks[0], (E, D, F)) * 0.2, "w2": jax.random.normal(ks[1], (E, F, D)) * 0.2}
    batch = {"x": jax.random.normal(ks[2], (T, D)), "y": jax.random.normal(ks[3], (T, D)),
             "groups": jnp.array([10, 20, 30, 4], jnp.int32)}
    step = _sgd(_moe_loss)
    graph = planner.trace(step, p, batch)
    fwd = next(op for op in graph.ops if op.name == "ragged_dot_general")
    sig = signature(fwd, graph)
    assert sig.known and sig.inputs[0][0] is None and sig.inputs[1][0] is None  # rows and groups whole
    assert sig.inputs[1][2] is not None and sig.inputs[0][1] in sig.sum_labels  # features; contraction
    assert sig.flops == 2 * T * D * F
    # features and the contraction split (pinned: at this size the model keeps it on one device)
    planned = planner.plan_parallel(step, mesh="2x4", pins={"w1": P(None, None, "y"), "w2": P(None, "y", None),
                                                            "x": P(None, "x")})
    assert planned.plan(p, batch).fallback_primitives == ()
    new_p, value = planned(p, batch)
    ref_p, ref_value = jax.jit(step)(p, batch)
    assert_loss_close(value, ref_value, T * D)
    _assert_moe_step_close(p, batch, new_p, ref_p)


def test_zoo_llama_with_fused_attention_plans_and_matches(devices8):
    """The zoo's Llama with `attention="fused"` (the Pallas GPU flash kernel, interpreted here):
    planned on 2x4 with every attention kernel on shards, its first AdamW step matches the
    unsharded one, and the step stays microbatch-invariant (the kernel is independent along the
    batch), so accumulation and pipelines may split it."""
    from planner.levers.accumulate import step_mixing
    from planner.stages.derived import split_step
    from tests.helpers import assert_bundle_step_close, concrete

    b, state, batch = concrete("llama-tiny", attention="fused")
    planned = planner.plan_parallel(b.train_step, mesh="2x4", hardware="h100")
    plan = planned.plan(state, batch)
    assert "pallas_call" not in plan.fallback_primitives
    graph = planner.trace(b.train_step, state, batch)
    kernels = {op.index for op in _kernels(graph)}
    assert kernels and {op for op, _, spec in plan.op_specs if op in kernels and any(spec)} == kernels
    new_state, metrics = planned(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    assert not step_mixing(graph, split_step(graph))


def test_kernel_priced_at_its_matmuls_rate_not_its_float32_statistics():
    """mha's backward reads float32 statistics (lse, delta) beside bf16 blocks; its matmuls are
    bf16 x bf16, so it runs at the bf16 rate, as a bf16 dot would."""
    from planner.cost_model.model import CostModel
    from planner.cost_model.hardware import get_hardware
    from planner.core.mesh import MeshSpec
    from planner.ilp.strategies import enumerate_strategies

    qkv = jax.ShapeDtypeStruct((16, 4096, 32, 128), jnp.bfloat16)  # Llama-2-7B's attention, abstract
    sizes = attention.BlockSizes(block_q=128, block_k=128, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                                 block_kv_dq=64)

    def loss(q, k, v):
        return attention.mha(q, k, v, None, causal=True, block_sizes=sizes).astype(jnp.float32).sum()

    graph = planner.trace(jax.grad(loss, argnums=(0, 1, 2)), qkv, qkv, qkv)
    op = next(op for op in _kernels(graph) if op.params["name"] == "mha_backward")
    sig = signature(op, graph)
    assert sig.rate_dtypes == ("bfloat16",)
    assert any(graph.tensors[x].dtype == np.float32 for x in op.inputs)
    cost = CostModel.default(MeshSpec((8,), ("x",)), get_hardware("h100-sxm"))
    ins = [graph.tensors[x] for x in op.inputs]
    outs = [graph.tensors[t] for t in op.outputs]
    fastest = min(s.compute_time for s in enumerate_strategies(sig, ins, outs, cost))
    f32 = min(s.compute_time for s in enumerate_strategies(dataclasses.replace(sig, rate_dtypes=("float32",)), ins, outs,
                                                      cost))
    assert fastest < f32


def test_dot_product_attention_priced_as_the_fused_kernel_on_gpu_targets():
    """`jax.nn.dot_product_attention` traced on CPU becomes XLA's attention program; for a GPU or TPU
    target each call's forward and backward are one fused kernel each: no score or probability in
    memory, causal matmuls at half, the backward recomputing the scores, at the compute dtype's rate."""
    from planner.core.mesh import MeshSpec
    from planner.core.options import PlanOptions
    from planner.graph.fusion import attention_calls, attention_groups, attention_internal, fusions
    from planner.search.mesh_plan import make_plan
    from zoo import get_model

    seq = 256
    dpa = get_model("llama-tiny", attention="dpa", dtype="bfloat16", seq=seq)
    graph = planner.trace(dpa.train_step, dpa.abstract_state(), dpa.abstract_batch())
    calls, groups = attention_calls(graph), attention_groups(graph)
    assert len(set(groups.values())) == 4  # 2 layers x (forward, backward)
    internal = attention_internal(graph, "gpu")
    scores = {t for i in calls for t in graph.ops[i].outputs if graph.tensors[t].shape[-2:] == (seq, seq)}
    assert scores and scores <= internal and not attention_internal(graph, "cpu")
    gpu, cpu = fusions(graph, "gpu"), fusions(graph, "cpu")
    dots = [i for i in calls if graph.ops[i].name == "dot_general"]
    backward = {i for i in dots if "transpose(" in graph.ops[i].name_stack}
    assert len(dots) == 12 and len(backward) == 8  # per layer 2 forward matmuls, 4 backward
    assert all(gpu[i].flop_scale == (0.5 * 5 / 4 if i in backward else 0.5) for i in dots)
    assert all(gpu[i].rate_dtype == "bfloat16" for i in dots)
    assert any(graph.tensors[x].dtype == np.float32 for i in backward for x in graph.ops[i].inputs[:2])
    assert all(cpu[i].flop_scale == 1.0 and cpu[i].rate_dtype is None for i in dots)

    # planned for 8 H100s: less memory and time than the same model with its scores materialised
    mesh, options = MeshSpec((8,), ("x",)), PlanOptions(hardware="h100-sxm")
    plan = make_plan(graph, mesh, options)
    xla = get_model("llama-tiny", attention="xla", dtype="bfloat16", seq=seq)
    materialised = make_plan(planner.trace(xla.train_step, xla.abstract_state(), xla.abstract_batch()), mesh, options)
    assert plan.prediction.memory_bytes_per_device < materialised.prediction.memory_bytes_per_device
    assert plan.prediction.step_time_s < materialised.prediction.step_time_s
    assert any("cuDNN" in k for k in plan.kernels) and not materialised.kernels
    cpu_plan = make_plan(graph, mesh, PlanOptions(hardware="cpu"))
    assert any("materialised" in k for k in cpu_plan.kernels)


def test_zoo_llama_with_dot_product_attention_plans_and_matches(devices8):
    """The attention marks change only pricing: the dpa Llama planned on 2x4 for an H100 target
    runs on CPU and its first AdamW step matches the unsharded one."""
    from tests.helpers import assert_bundle_step_close, concrete

    b, state, batch = concrete("llama-tiny", attention="dpa")
    planned = planner.plan_parallel(b.train_step, mesh="2x4", hardware="h100")
    new_state, metrics = planned(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_long_sequence_attention_splits_the_queries_over_the_sequence(devices8):
    """Context parallelism: one sequence with two heads on 8 devices cannot be split by batch or
    heads; the plan splits jax.nn.dot_product_attention's queries over the sequence (each device
    with every key and value: here computed from the replicated input), priced as the fused
    kernel's share per device, and matches the unsharded step."""
    seq, d, heads, hd = 512, 32, 2, 16

    def loss(p, batch):
        x = batch["x"]
        rows = x.shape[0]
        q, k, v = [(x @ p[n]).reshape(rows, seq, heads, hd) for n in ("wq", "wk", "wv")]
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.mean((o.reshape(rows, seq, heads * hd) @ p["wo"] - batch["y"]) ** 2)

    ks = jax.random.split(jax.random.key(3), 6)
    p = {n: jax.random.normal(ks[i], (d, heads * hd)) * 0.2 for i, n in enumerate(("wq", "wk", "wv"))}
    p["wo"] = jax.random.normal(ks[3], (heads * hd, d)) * 0.2
    batch = {"x": jax.random.normal(ks[4], (1, seq, d)), "y": jax.random.normal(ks[5], (1, seq, d))}
    step = _sgd(loss)
    planned = planner.plan_parallel(step, mesh="8", hardware="h100")
    plan = planned.plan(p, batch)
    graph = planner.trace(step, p, batch)
    scores = next(op for op in graph.ops if op.name == "dot_general" and "fused_attention" in op.name_stack)
    (spec,) = [s for op, _, s in plan.op_specs if op == scores.index]
    t = graph.tensors[scores.outputs[0]].shape.index(seq)  # the queries' dimension of the scores
    assert spec[t], f"queries not split over the sequence: {spec}"
    new_p, value = planned(p, batch)
    ref_p, ref_value = jax.jit(step)(p, batch)
    assert_loss_close(value, ref_value, seq * d)
    assert_sgd_step_close(loss, LR, p, batch, new_p)
    # each device holds scores for its 64 queries against all 512 keys, never the whole [512, 512]
    text = planned.lower(p, batch).compile().as_text()
    assert re.search(rf"f32\[(?:\d+,)*{seq // 8},(?:\d+,)*{seq}\]", text)
    assert not re.search(rf"f32\[(?:\d+,)*{seq},(?:\d+,)*{seq}\]", text)


def test_megablox_gmm_moe_plans_its_kernels_on_shards(devices8):
    """megablox's grouped matmul (`ops.gmm`, its forward and both backward kernels; TPU kernels,
    interpreted here): each is split along its "parallel" grid axis (the features), the rows and
    groups steered by scalar-prefetched group offsets stay whole; the planned step matches."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

    e, t, d, f = 4, 256, 256, 256  # two 128-wide tiles along each feature dimension

    def loss(p, batch):
        h = jax.nn.relu(ops.gmm(batch["x"], p["w1"], batch["groups"], tiling=(128, 128, 128), interpret=True))
        return jnp.mean((ops.gmm(h, p["w2"], batch["groups"], tiling=(128, 128, 128), interpret=True)
                         - batch["y"]) ** 2)

    ks = jax.random.split(jax.random.key(4), 4)
    p = {"w1": jax.random.normal(ks[0], (e, d, f)) * 0.1, "w2": jax.random.normal(ks[1], (e, f, d)) * 0.1}
    batch = {"x": jax.random.normal(ks[2], (t, d)), "y": jax.random.normal(ks[3], (t, d)),
             "groups": jnp.array([64, 32, 96, 64], jnp.int32)}
    step = _sgd(loss)
    graph = planner.trace(step, p, batch)
    kernels = _kernels(graph)
    assert len(kernels) == 6 and all(signature(op, graph).known for op in kernels)  # 2 forward, 4 backward
    # the weights split by their output features, as expert-parallel trainers keep them (at this size
    # the model would rather not split at all)
    planned = planner.plan_parallel(step, mesh="2x4", hardware="h100",
                                    pins={"w1": P(None, None, "x"), "w2": P(None, None, "x")})
    plan = planned.plan(p, batch)
    assert "pallas_call" not in plan.fallback_primitives
    split = {op for op, _, spec in plan.op_specs if op in {k.index for k in kernels} and any(spec)}
    assert split, "grouped matmuls run on shards (here the backward ones, reading the split weights)"
    new_p, value = planned(p, batch)
    ref_p, ref_value = jax.jit(step)(p, batch)
    assert_loss_close(value, ref_value, t * d)
    assert_trees_close(new_p, ref_p, rtol=0, atol=0)  # each output tile's sums are the kernel's own


def test_custom_partitioning_rules_as_users_state_them():
    """A user's own `custom_partitioning` call: its rule as an einsum-like string, or as a function of
    the operand types (how jax's cuDNN attention states its rule), read factor by factor; a rule
    that does not name one factor per dimension is planned replicated, saying so."""
    from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning

    def body(x, w):
        return jnp.tanh(x) * w

    def partition(mesh, args, result):
        return mesh, body, result.sharding, tuple(a.sharding for a in args)

    by_string = custom_partitioning(body)
    by_string.def_partition(partition=partition, sharding_rule="b s, b s -> b s")
    by_function = custom_partitioning(body)
    by_function.def_partition(partition=partition, sharding_rule=lambda mesh, ins, outs: SdyShardingRule(
        (("rows", "cols"), ("rows", "cols")), (("rows", "cols"),)))
    placeholder = custom_partitioning(body)
    placeholder.def_partition(partition=partition, sharding_rule=lambda mesh, ins, outs: SdyShardingRule(
        (("rows", "cols"), ("all",)), (("rows", "cols"),)))
    x = jnp.ones((8, 16))
    for call, want in ((by_string, ("b", "s")), (by_function, ("rows", "cols"))):
        graph = planner.trace(call, x, x)
        sig = signature(graph.ops[0], graph)
        assert sig.known and sig.inputs == (want, want) and sig.outputs == (want,)
    graph = planner.trace(placeholder, x, x)
    sig = signature(graph.ops[0], graph)
    assert not sig.known and "one factor per dimension" in sig.fallback


def test_causal_attention_split_along_its_sequences_prices_the_busiest_device():
    """A fused causal attention skips the key blocks above the diagonal, so split along its query
    (or key) sequence the device with the last queries does the most: (2n - 1) / n of an equal
    share for n contiguous blocks of one sequence, 2 for 2 x 2 blocks (the full block below the
    diagonal), 1 unsplit. `jax.nn.dot_product_attention`'s matmuls (Llama-2-7B's attention shape)
    carry their scores' lengths; a strategy splitting the queries of the forward score matmul 8
    ways is priced 15/8 of the equal share, one splitting heads or batch is not."""
    from planner.cost_model.hardware import get_hardware
    from planner.cost_model.model import CostModel
    from planner.core.mesh import MeshSpec
    from planner.graph.fusion import attention_calls, fusions
    from planner.ilp.strategies import causal_block_share, enumerate_strategies

    assert [causal_block_share(*n) for n in ((1, 1), (2, 1), (1, 8), (8, 1), (2, 2))] == \
        pytest.approx([1.0, 1.5, 15 / 8, 15 / 8, 2.0], rel=1e-12)
    seq = 4096
    qkv = jax.ShapeDtypeStruct((16, seq, 32, 128), jnp.bfloat16)

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()

    graph = planner.trace(jax.grad(loss, argnums=(0, 1, 2)), qkv, qkv, qkv)
    gpu = fusions(graph, "gpu")
    dots = [i for i in attention_calls(graph) if graph.ops[i].name == "dot_general"]
    assert dots and all(gpu[i].causal == (seq, seq) for i in dots)
    op = graph.ops[min(dots)]  # the forward scores: queries x keys
    sig = signature(op, graph)
    cost = CostModel.default(MeshSpec((8,), ("x",)), get_hardware("h100-sxm"))
    ins, outs = [graph.tensors[x] for x in op.inputs], [graph.tensors[t] for t in op.outputs]

    def by_split(traffic):
        return {s.in_specs: s.compute_time for s in enumerate_strategies(sig, ins, outs, cost, traffic=traffic)}

    causal, balanced = by_split(gpu[op.index].charged), by_split(gpu[op.index].charged[:4] + ((),))
    seq_dims = [[d for d, n in enumerate(t.shape) if n == seq] for t in ins]
    q_split = [s for s in causal if any(s[0][d] for d in seq_dims[0])]
    unsplit = [s for s in causal if not any(s[k][d] for k in range(2) for d in seq_dims[k])]
    assert q_split and unsplit
    for s in q_split:
        assert causal[s] > balanced[s]
    for s in unsplit:
        assert causal[s] == balanced[s]
