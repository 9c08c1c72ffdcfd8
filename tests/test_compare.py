"""The plan beside hand configurations: `planner.compare`, logical-axis rules in, and the CLI's
--pin / --rules / --baseline / compare (planner/planning/evaluate.py, planner/present/compare.py)."""
from __future__ import annotations

import base64
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner import cli
from planner.core.plan import Plan
from planner.present.compare import differences, format_comparison
from planner.present.logical_axes import read_rules
from zoo import get_model

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_compare")


@pytest.fixture(scope="module")
def mlp_comparison():
    b = get_model("mlp-tiny")
    args = (b.abstract_state(), b.abstract_batch())
    return b, args, planner.compare(b.train_step, *args, mesh="2x4", baselines=("dp", "fsdp"),
                                    pins={"dense_0/kernel": P("x", None)})


def test_compare_api_and_table(mlp_comparison):
    b, args, c = mlp_comparison
    assert [n for n, _ in c.others] == ["dp", "fsdp", "yours"]
    for _, p in c.others:  # the plan is the ILP's optimum; each configuration is one of its points
        assert p.prediction.step_time_s >= c.plan.prediction.step_time_s * (1 - 1e-9)
    text = format_comparison(c.plan, c.others, c.skipped, budget=1e5)
    assert "configuration" in text and "exposed comm" in text and "bytes moved" in text
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["planner", "dp", "fsdp"]
    with pytest.raises(planner.InvalidArgumentError, match="unknown baseline 'tp'"):
        planner.compare(b.train_step, *args, mesh="2x4", baselines=("tp",))


def test_differences_account_for_the_step_time_gap(mlp_comparison):
    _, _, c = mlp_comparison
    parts = c.plan.solver.step_parts  # the plan's step time, split by where it is paid
    total = (sum(sum(item[2:]) for item in parts.items) + sum(t for *_, t in parts.combined_latency)
             - parts.hidden_s)
    assert total == pytest.approx(c.plan.prediction.step_time_s, rel=1e-9)
    for name, p in c.others:
        gap = p.prediction.step_time_s - c.plan.prediction.step_time_s
        assert gap > 0, name
        every = differences(c.plan, p, None)  # arguments, ops, latency groups, overlap: the whole gap
        assert sum(d.extra_s for d in every) == pytest.approx(gap, rel=1e-6), name
        top = differences(c.plan, p, 3)
        assert len(top) <= 3 and all(d.extra_s > 0 for d in top)
        assert sum(d.extra_s for d in top) >= 0.5 * gap, (name, top)
    fsdp = dict(c.others)["fsdp"]
    changed = [d for d in differences(c.plan, fsdp, 3) if d.plan_layout != d.other_layout]
    assert changed  # the places that cost fsdp more are where its layouts differ from the plan's
    text = format_comparison(c.plan, c.others, c.skipped)
    assert "where fsdp pays more than the plan" in text and "instead of" in text


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
    page, saved, again = tmp_path / "cmp.html", tmp_path / "cmp.json", tmp_path / "again.html"
    assert cli.main(["compare", "--model", "mlp-tiny", "--mesh", "2x4", "-q", "--baselines", "dp,zero1",
                     "--html", str(page), "--json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "planner" in out and "zero1" in out and "vs plan" in out
    # The HTML report carries the same comparison beside the plan, self-contained (as test_html checks).
    assert cli.main(["plan", "--from", str(saved), "--html", str(again), "-q"]) == 0
    capsys.readouterr()
    for text in (page.read_text(), again.read_text()):
        assert text.startswith("<!DOCTYPE html>") and not re.search(r'(src|href)="(https?:)?//', text)
        for data in re.findall(r'src="data:image/png;base64,([^"]+)"', text):
            assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
        table_html = re.search(r'<table class="comparison">(.*?)</table>', text, re.S).group(1)
        cells = [re.findall(r"<t[dh]>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", table_html)]
        assert cells[0] == ["configuration", "step time", "vs plan", "step vs plan", "exposed comm", "memory",
                            "memory vs plan", "bytes moved", "bytes vs plan", "fits"]
        assert [r[0] for r in cells[1:]] == ["planner", "dp", "zero1"]
        assert [r[3][0] for r in cells[2:]] == ["+", "+"]  # each baseline is slower than the plan
        assert "where zero1 pays more than the plan" in text and "Per-layer shardings" in text
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


@pytest.mark.parametrize("lever, flags", [("remat", ["--remat", "full"]), ("accumulation", ["--accumulate", "2"])])
def test_compare_plans_with_the_levers_the_flags_ask_for(tmp_path, capsys, lever, flags):
    """`planner compare`'s planner row is the plan `planner plan --mesh` makes with the same flags
    (one composition of the single-stage levers, `planning.composition`), not a plan without them."""
    compared, planned = tmp_path / "compared.json", tmp_path / "planned.json"
    common = ["--model", "gpt-tiny", "--mesh", "2x4", "-q", *flags]
    assert cli.main(["compare", *common, "--baselines", "dp", "--json", str(compared)]) == 0
    assert cli.main(["plan", *common, "--json", str(planned)]) == 0
    capsys.readouterr()
    a, b = Plan.from_json(compared.read_text()), Plan.from_json(planned.read_text())
    assert getattr(a.levers, lever) is not None and a.levers == b.levers
    assert a.prediction.step_time_s == pytest.approx(b.prediction.step_time_s, rel=1e-9)
