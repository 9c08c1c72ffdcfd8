"""Rough edges a newcomer meets: one-line CLI errors (exit 2) for broken --fn steps, unwritable
output paths (refused before planning) and profile databases given where a plan is expected; the
`explain` text (legend, one row per distinct decision, decision count) and `explain_plan` in Python."""
from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import pytest

import planner
from planner import cli
from planner.present.explain import explain_plan

STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def make(batch=16):
        def step(params, x):
            loss = lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
            value, g = jax.value_and_grad(loss)(params)
            return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value
        params = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
                  "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
        return step, (params, jax.ShapeDtypeStruct((batch, 32), jnp.float32))

    def bad_trace():
        def step(params, x):
            return x @ params["w1"].T  # shapes do not match
        return step, ({"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32)}, jax.ShapeDtypeStruct((16, 32), jnp.float32))

    def raises():
        raise RuntimeError("no data\\nsecond line")
""")


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def user_module(tmp_path):
    path = tmp_path / "userstep.py"
    path.write_text(STEP)
    return path


def _one_line_exit_2(code, err, needle):
    assert code == 2, err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("factory,needle", [("bad_trace", "tracing the step raised"),
                                            ("raises", "raises() raised RuntimeError")])
def test_fn_that_fails_to_trace_or_run_is_one_line(capsys, user_module, factory, needle):
    code, _, err = run(capsys, "plan", "--fn", f"{user_module}:{factory}", "--mesh", "8", "--quiet")
    _one_line_exit_2(code, err, needle)


@pytest.mark.parametrize("flag", ["--json", "--html"])
def test_output_paths_checked_before_planning(capsys, user_module, tmp_path, flag):
    # bad_trace would fail while tracing: the path error comes first, so nothing was planned
    code, _, err = run(capsys, "plan", "--fn", f"{user_module}:bad_trace", "--mesh", "8", "--quiet",
                       flag, str(tmp_path / "missing" / "out"))
    _one_line_exit_2(code, err, "does not exist")
    code, _, err = run(capsys, "plan", "--fn", f"{user_module}:bad_trace", "--mesh", "8", "--quiet",
                       flag, str(tmp_path))
    _one_line_exit_2(code, err, "is a directory")


def test_profile_database_where_a_plan_is_expected(capsys, tmp_path):
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"format": "planner-profile", "version": 1, "collectives": []}))
    for argv in (["explain", str(prof)], ["diff", str(prof), str(prof)], ["plan", "--from", str(prof)]):
        code, _, err = run(capsys, *argv)
        _one_line_exit_2(code, err, "is a profile database")


@pytest.fixture(scope="module")
def mlp_plan_and_text(tmp_path_factory):
    import io, contextlib
    path = tmp_path_factory.mktemp("edges") / "userstep.py"
    path.write_text(STEP)
    plan_file = path.parent / "plan.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["plan", "--fn", f"{path}:make", "--mesh", "2x4", "--quiet", "--json", str(plan_file)]) == 0
        out.truncate(0)
        assert cli.main(["explain", str(plan_file)]) == 0
    return json.loads(plan_file.read_text()), out.getvalue()


def test_explain_legend_rows_and_count(mlp_plan_and_text):
    data, text = mlp_plan_and_text
    assert "notation:" in text
    for section in text.split("\n\n"):  # no table repeats a row
        rows = [l for l in section.splitlines()[3:] if l.startswith("  ")]
        assert len(rows) == len(set(rows)), section
    decided = len(data["decisions"])
    shared = data["solver"]["variables_shared"]
    assert (f"{decided} of the plan's {shared} decisions" in text
            or (decided == shared and f"{decided} decisions" in text))


def test_explain_plan_in_python_shows_kept_constraints(devices8):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def step(w, x):
        def loss(w):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec("data", None)))
            return jnp.mean(h ** 2)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    plan = planner.plan(step, *args, mesh=mesh)
    assert plan.user_constraints and all(c["kept"] for c in plan.user_constraints)
    assert planner.Plan.from_json(plan.to_json()).user_constraints == plan.user_constraints
    text = explain_plan(plan)
    n = len(plan.user_constraints)  # the constraint and its transpose in the backward pass
    assert f"Your sharding constraints ({n} of {n} kept; pinned" in text


def test_pipeline_figure_draws_the_chosen_microbatch_count(mlp_plan_and_text):
    from planner.present.html_report import pipeline_figure
    from planner.present.report import PlanView
    data = json.loads(json.dumps(mlp_plan_and_text[0]))
    data["stages"] = [{"layers": [f"blocks_{i}"], "submesh": [1, 2], "mesh": {"x": 2}} for i in range(3)]
    data["options"]["num_microbatches"] = None  # "choose": the plan's pipeline record holds the choice
    data["pipeline"] = {"num_microbatches": 4, "num_stages": 3, "schedule": "1f1b"}
    fig = pipeline_figure(PlanView.from_dict(data))
    assert "3 stages x 4 microbatches" in fig.axes[0].get_title()


def test_summary_and_cli_print_sizes_in_the_same_units(mlp_plan_and_text):
    from planner.present.report import fmt_bytes
    plan = planner.Plan.from_json(json.dumps(mlp_plan_and_text[0]))
    memory = plan.prediction.memory_bytes_per_device
    assert fmt_bytes(memory) in plan.summary()
