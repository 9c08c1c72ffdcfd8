"""Named baselines as pins (planner/configs/baselines.py) and `evaluate` (planner/planning/evaluate.py)."""
from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import planner
from planner.configs.baselines import NAMES, baseline_pins, baseline_specs
from planner.planning.evaluate import evaluate
from planner.core.mesh import parse_mesh
from zoo import get_model


def _leaves(name, **overrides):
    b = get_model(name, **overrides)
    args = (b.abstract_state(), b.abstract_batch())
    flat = jax.tree_util.tree_flatten_with_path(args)[0]
    return b, args, [jax.tree_util.keystr(p) for p, _ in flat], [x.shape for _, x in flat]


def _by_suffix(paths, specs, suffix):
    return [s for p, s in zip(paths, specs) if p.endswith(suffix)]


def test_baseline_layouts_gpt():
    _, _, paths, shapes = _leaves("gpt-tiny", heads=8)
    mesh, _ = parse_mesh("2x4")
    spec = {n: baseline_specs(n, paths, shapes, mesh) for n in NAMES}
    q = "['params']['blocks_0']['attn']['query']['kernel']"
    assert _by_suffix(paths, spec["megatron-tp"], q) == [P(None, ("x", "y"), None)]  # column: heads
    assert _by_suffix(paths, spec["dp-tp"], q) == [P(None, "y", None)]
    assert _by_suffix(paths, spec["dp-tp"], "['params']['blocks_0']['attn']['out']['kernel']") == [P("y", None, None)]
    assert _by_suffix(paths, spec["dp-tp"], "['params']['blocks_1']['mlp']['fc_out']['kernel']") == [P("y", None)]
    assert _by_suffix(paths, spec["dp-tp"], "['params']['wte']['embedding']") == [P("y", None)]  # vocab
    assert _by_suffix(paths, spec["dp-tp"], "['params']['lm_head']['kernel']") == [P(None, "y")]
    assert _by_suffix(paths, spec["dp-tp"], "['ln_f']['scale']") == [P()] * 3
    assert _by_suffix(paths, spec["dp-tp"], "[1]['inputs']") == [P("x", None)]
    assert _by_suffix(paths, spec["megatron-tp"], "[1]['inputs']") == [P()]
    assert _by_suffix(paths, spec["megatron-tp-sp"], "[1]['inputs']") == [P(None, ("x", "y"))]
    assert _by_suffix(paths, spec["dp"], "[1]['inputs']") == [P(("x", "y"), None)]
    fc = "['blocks_0']['mlp']['fc_in']['kernel']"  # [64, 256]: ZeRO splits the larger dim
    assert _by_suffix(paths, spec["fsdp"], fc) == [P(None, ("x", "y"))] * 3
    assert _by_suffix(paths, spec["zero1"], fc) == [P(None, ("x", "y"))] * 2 + [P()]  # mu, nu; params last
    assert spec["zero2"] == spec["zero1"]  # approximated (planner.configs.baselines.APPROXIMATIONS)
    assert _by_suffix(paths, spec["fsdp"], "['opt_state'][0].count") == [P()]


def test_baseline_layouts_llama_scanned_and_gqa():
    _, _, paths, shapes = _leaves("llama-tiny")  # 4 q heads, 2 kv heads, layers stacked on dim 0
    mesh, _ = parse_mesh("2x4")
    spec = baseline_specs("dp-tp", paths, shapes, mesh)
    assert _by_suffix(paths, spec, "['params']['layers']['attn']['query']['kernel']") == [P(None, None, "y", None)]
    assert _by_suffix(paths, spec, "['params']['layers']['attn']['key']['kernel']") == [P()]  # 2 kv heads on 4
    assert _by_suffix(paths, spec, "['params']['layers']['mlp']['down']['kernel']") == [P(None, "y", None)]
    assert _by_suffix(paths, spec, "['params']['embed']['embedding']") == [P("y", None)]


def test_unknown_baseline_is_a_one_line_error():
    b, args, _, _ = _leaves("mlp-tiny")
    with pytest.raises(planner.InvalidArgumentError, match=r"unknown baseline 'megatron'; known: dp, zero1"):
        evaluate(b.train_step, *args, mesh="2x4", baseline="megatron")
    with pytest.raises(planner.InvalidArgumentError, match="exactly one of"):
        evaluate(b.train_step, *args, mesh="2x4", baseline="dp", pins={"x": P()})


def test_pinned_plan_predicts_what_evaluate_predicts(mesh_2x4):
    """One code path: a plan with every argument pinned to a baseline (written as a user would,
    as jit in_shardings) predicts exactly the baseline's evaluation."""
    b, args, paths, shapes = _leaves("mlp-tiny")
    spec, _ = parse_mesh(mesh_2x4)
    for name in ("fsdp", "zero1"):
        ev = evaluate(b.train_step, *args, mesh=mesh_2x4, baseline=name)
        assert ev.solver.configuration == f"baseline {name}"
        specs = baseline_specs(name, paths, shapes, spec)
        tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args),
                                            [NamedSharding(mesh_2x4, s) for s in specs])
        by_jit = evaluate(b.train_step, *args, mesh=mesh_2x4, shardings=tree)
        by_pins = planner.plan(b.train_step, *args, mesh=mesh_2x4, pins=baseline_pins(name)(paths, shapes, spec))
        assert by_jit.prediction.step_time_s == ev.prediction.step_time_s == by_pins.prediction.step_time_s
        assert by_pins.input_specs == ev.input_specs
    dp = evaluate(b.train_step, *args, mesh=mesh_2x4, baseline="dp")
    assert dp.prediction.memory_bytes_per_device > ev.prediction.memory_bytes_per_device  # zero1 shards Adam state
