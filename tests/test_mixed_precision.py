"""Mixed precision: every zoo model takes a dtype; a bf16 step keeps float32 master weights and Adam
moments with 2-byte activations; the CLI's default dtype is what the hardware trains in; a planned
bf16 step equals the unsharded one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import planner
from planner import cli
from planner.cost_model import PRESETS
from planner.graph.trace import trace
from tests.helpers import assert_bundle_step_close, concrete, zoo_graph
from zoo import get_config, model_names


def test_every_zoo_model_takes_a_dtype():
    for name in model_names():
        for dtype in ("float32", "bfloat16", "float16"):
            assert get_config(name, dtype=dtype).dtype == dtype
    with pytest.raises(ValueError):
        get_config("gpt-tiny", dtype="int8")


def test_bf16_trace_has_2_byte_activations_and_4_byte_state():
    graph = zoo_graph("gpt-tiny", dtype="bfloat16")
    floats = [graph.tensors[t] for t, path in zip(graph.inputs, graph.input_paths) if "opt_state" in path
              or "params" in path]
    floats = [t for t in floats if jnp.issubdtype(t.dtype, jnp.floating)]
    assert floats and all(t.dtype == jnp.float32 for t in floats)  # master params and Adam moments
    dots = [op for op in graph.ops if op.name == "dot_general"]
    operand_types = [graph.tensors[x].dtype for op in dots for x in op.inputs if isinstance(x, int)]
    assert sum(d == jnp.bfloat16 for d in operand_types) >= 0.9 * len(operand_types)
    f32 = zoo_graph("gpt-tiny")

    def dot_result_bytes(g):
        return sum(g.tensors[op.outputs[0]].nbytes for op in g.ops if op.name == "dot_general")

    assert dot_result_bytes(graph) == pytest.approx(0.5 * dot_result_bytes(f32), rel=0.1)  # 2-byte activations


def test_cli_dtype_defaults_to_what_the_hardware_trains_in(tmp_path, capsys):
    assert (PRESETS["a100-80gb"].default_dtype, PRESETS["v100-16gb"].default_dtype,
            PRESETS["tpu-v5p"].default_dtype, PRESETS["cpu"].default_dtype) == \
        ("bfloat16", "float16", "bfloat16", "float32")
    from planner.cli.workloads import load_model

    _, _, (state, batch) = load_model("mlp-tiny", None, None, None, PRESETS["v100-16gb"].default_dtype)
    assert batch["x"].dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
    label, step, args = load_model("mlp-tiny", None, None, None, "float16")
    assert label == "mlp-tiny"
    assert any(op.name == "dot_general" and graph_dtype == jnp.float16
               for graph in [trace(step, *args)] for op in graph.ops
               for graph_dtype in [graph.tensors[op.outputs[0]].dtype])
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "8", "--quiet", "--time-limit", "5", "--dtype",
                     "float32"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("Plan for mlp-tiny dtype=float32 on 8 devices"), out


def test_bf16_zoo_step_matches_unsharded(devices8):
    """A bf16 train step (fp32 master weights, fp32 Adam moments) planned on 2x4 equals the
    unsharded one within the summation bound at bfloat16's unit roundoff (tests/helpers.py)."""
    b, state, batch = concrete("mlp-tiny", dtype="bfloat16")
    floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
    assert all(x.dtype == jnp.float32 for x in floats(state))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = planner.plan_parallel(b.train_step, mesh="2x4")(state, batch)
    assert all(x.dtype == jnp.float32 for x in floats(new_state))
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)

