"""The plan beside hand configurations: `planner.compare`, logical-axis rules in, and the CLI's
--pin / --rules / --baseline / compare (planner/evaluation.py, planner/present/compare.py)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner import cli
from planner.present.compare import format_comparison
from planner.present.logical_axes import read_rules
from zoo import get_model


def test_compare_api_and_table():
    b = get_model("mlp-tiny")
    args = (b.abstract_state(), b.abstract_batch())
    c = planner.compare(b.train_step, *args, mesh="2x4", baselines=("dp", "fsdp"),
                        pins={"dense_0/kernel": P("x", None)})
    assert [n for n, _ in c.others] == ["dp", "fsdp", "yours"]
    for _, p in c.others:  # the plan is the ILP's optimum; each configuration is one of its points
        assert p.prediction.step_time_s >= c.plan.prediction.step_time_s * (1 - 1e-9)
    text = format_comparison(c.plan, c.others, c.skipped, budget=1e5)
    assert "configuration" in text and "exposed comm" in text and "bytes moved" in text
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["planner", "dp", "fsdp"]
    with pytest.raises(planner.InvalidArgumentError, match="unknown baseline 'tp'"):
        planner.compare(b.train_step, *args, mesh="2x4", baselines=("tp",))


class _Annotated(nn.Module):
    """A two-layer MLP with flax logical partitioning metadata."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")), name="up")(x)
        return nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")), name="down")(nn.relu(h))


def test_rules_apply_to_flax_logical_metadata():
    model, opt = _Annotated(), optax.sgd(0.1)
    x = jnp.ones((16, 32))
    boxed = model.init(jax.random.key(0), x)
    params = nn.unbox(boxed)["params"]

    def step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    logical = (nn.get_partition_spec(boxed)["params"], P("batch", None))
    rules = [("batch", "x"), ("embed", None), ("mlp", "y")]
    plan = planner.plan(step, params, x, mesh="2x4", rules=rules, logical=logical)
    spec = dict(zip(plan.input_paths, plan.input_specs))
    assert spec["[0]['up']['kernel']"] == ((), (1,)) and spec["[0]['down']['kernel']"] == ((1,), ())
    assert spec["[1]"] == ((0,), ()) and spec["[0]['up']['bias']"] == ((),)  # unannotated: P()
    ev = planner.evaluate(step, params, x, mesh="2x4", rules=rules, logical=logical)
    assert ev.input_specs == plan.input_specs and ev.prediction.step_time_s == plan.prediction.step_time_s
    with pytest.raises(planner.InvalidArgumentError, match=r"rule for logical axis 'heads': the model uses no such "
                                                           r"axis \(its axes: batch, embed, mlp\)"):
        planner.plan(step, params, x, mesh="2x4", rules=rules + [("heads", "y")], logical=logical)
    with pytest.raises(planner.InvalidArgumentError, match="names mesh axis 'model'"):
        planner.plan(step, params, x, mesh="2x4", rules=[("mlp", "model")], logical=logical)
    with pytest.raises(planner.InvalidArgumentError, match="carry no flax logical partitioning metadata"):
        planner.plan(step, params, x, mesh="2x4", rules=rules)


def test_printed_rules_read_back():
    t5x = "logical_axis_rules = [\n    ('batch', ('x', 'y')),\n    ('embed', None),\n]"
    assert read_rules(t5x) == [("batch", ("x", "y")), ("embed", None)]
    assert read_rules("logical_axis_rules: [['batch', ['x']], ['mlp', []]]") == [["batch", ["x"]], ["mlp", []]]


def test_cli_pin_rules_baseline_and_compare(tmp_path, capsys):
    rules = tmp_path / "rules.py"
    rules.write_text("logical_axis_rules = [('batch', ('x', 'y')), ('mlp', None)]\n")
    assert cli.main(["plan", "--model", "mlp-tiny", "--mesh", "2x4", "-q", "--pin", "dense_0/kernel=P(None, y)",
                     "--rules", str(rules)]) == 0
    out = capsys.readouterr().out
    assert "P(None, y)" in out
    assert cli.main(["compare", "--model", "mlp-tiny", "--mesh", "2x4", "-q", "--baselines", "dp,zero1"]) == 0
    out = capsys.readouterr().out
    assert "planner" in out and "zero1" in out and "vs plan" in out
    for argv, message in (
        (["compare", "--model", "mlp-tiny", "--mesh", "2x4", "--baselines", "dp,ddp"], "unknown baseline 'ddp'"),
        (["plan", "--model", "mlp-tiny", "--mesh", "2x4", "--baseline", "ddp"], "unknown baseline 'ddp'"),
        (["plan", "--model", "mlp-tiny", "--devices", "8", "--pin", "x=P()"], "give the mesh with --mesh"),
        (["plan", "--model", "mlp-tiny", "--mesh", "2x4", "--pin", "dense_0/kernel"], "is not PATTERN=SPEC"),
        (["plan", "--model", "mlp-tiny", "--mesh", "2x4", "--pin", "dense_0/kernel=P(z)"], "names mesh axis 'z'"),
    ):
        assert cli.main(argv + ["-q"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
