"""The `planner` command line, run in-process through `main([...])` plus one real console-script run;
its errors are one line with exit status 2 (broken --fn steps, output paths refused before planning,
a profile database given where a plan is expected)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

import planner
from planner import Plan, cli
from tests.helpers import USER_STEP

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_cli")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    """mlp-tiny searched over the mesh shapes of 8 devices, saved with --json and --html."""
    d = tmp_path_factory.mktemp("mlp")
    path, page = d / "plan.json", d / "plan.html"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["plan", "--model", "mlp-tiny", "--devices", "8", "--json", str(path), "--html", str(page)])
    assert code == 0, err.getvalue()
    return path, page, out.getvalue(), err.getvalue()


def test_plan_prints_ranking_layers_and_rules(mlp_plan):
    _, _, out, err = mlp_plan
    assert "Mesh shapes, best first:" in out
    for header in ("mesh", "stages", "step time", "memory/dev", "of budget", "moved/dev", "MFU"):
        assert header in out
    for mesh in ("8", "2x4", "4x2"):
        assert f"  {mesh} " in out
    assert "Best plan:" in out and "Per-layer shardings" in out
    assert "logical_axis_rules = [" in out and "('batch'," in out
    assert "logical_axis_rules: [['batch'" in out  # MaxText form
    # progress on stderr: tracing, ILP, per mesh
    assert "tracing mlp-tiny" in err and "planning mesh 2x4" in err and "solved" in err
    # 4x2 is 2x4 with its axes swapped (one host, same links): listed, not planned again
    assert "planning mesh 4x2" not in err and "same: the problem of mesh 2x4" in out


def test_permuted_mesh_is_the_same_problem():
    """What lets the search skip 4x2 after 2x4: both predict the same optimum."""
    from planner.graph.trace import trace
    from planner.core.mesh import MeshSpec
    from planner.core.options import PlanOptions
    from planner.search.mesh_plan import make_plan
    from planner.search.candidates import mirror_key
    from zoo import get_model
    assert mirror_key(MeshSpec((2, 4), ("x", "y")), ()) == mirror_key(MeshSpec((4, 2), ("x", "y")), ())
    assert mirror_key(MeshSpec((2, 4), ("x", "y")), (0,)) != mirror_key(MeshSpec((4, 2), ("x", "y")), (0,))
    b = get_model("mlp-tiny")
    g = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    a, c = (make_plan(g, MeshSpec(shape, ("x", "y")), PlanOptions(solver_time_limit=20)) for shape in ((2, 4), (4, 2)))
    assert a.solver.status == c.solver.status == "optimal"
    assert a.prediction.step_time_s == pytest.approx(c.prediction.step_time_s, rel=1e-9)


def test_json_has_the_documented_keys(mlp_plan):
    path, _, _, _ = mlp_plan
    d = json.loads(path.read_text())
    assert isinstance(d["mesh"], dict) and all(isinstance(v, int) for v in d["mesh"].values())
    assert d["stages"] and {"layers", "submesh", "mesh"} <= set(d["stages"][0])
    assert "[1]['x']" in d["shardings"]
    assert {"step_time_s", "memory_bytes_per_device", "bytes_moved_per_device"} <= set(d["predicted"])
    assert d["options"]["memory_budget"] == 80e9  # the hardware's memory when no budget is given
    ctx = d["context"]
    assert ctx["model"] == "mlp-tiny" and len(ctx["ranking"]) == 3
    assert ctx["logical_axis_rules"]["rules"][0][0] == "batch"
    plan = Plan.from_json(path.read_text())  # the extra context block does not disturb loading
    assert plan.mesh.size == 8


def test_from_reprints_the_saved_plan(mlp_plan, capsys):
    path, _, out, _ = mlp_plan
    code, again, err = run(capsys, "plan", "--from", str(path), "--quiet")
    assert code == 0 and err == ""
    best = out[out.index("Best plan:"):out.index("plan written")].strip()
    assert best in again


def test_quiet_silences_progress(capsys):
    code, out, err = run(capsys, "plan", "--model", "mlp-tiny", "--mesh", "8", "--quiet")
    assert code == 0 and err == ""
    assert out.startswith("Plan for mlp-tiny on 8 devices") and "Mesh shapes" not in out  # one mesh: no ranking


def test_repeated_layers_collapse_and_logical_names(capsys, tmp_path):
    path = tmp_path / "gpt.json"
    code, out, _ = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "8", "--batch", "8", "--seq", "16",
                       "--quiet", "--json", str(path))
    assert code == 0
    rows = [line for line in out.splitlines() if "attn/query/kernel" in line]
    assert len(rows) == 1 and "blocks_[0-1]" in rows[0] and "x2" in rows[0]
    assert "embed, heads, kv" in rows[0]
    assert "vocab, embed" in out and "embed, mlp" in out and "batch, length" in out
    d = json.loads(path.read_text())
    assert d["context"]["model"] == "gpt-tiny batch=8 seq=16"
    assert d["context"]["input_shapes"][d["inputs"].index(next(x for x in d["inputs"] if x["path"] == "[1]['inputs']"))] == [8, 16]


def test_cluster_marks_inter_host_axes(capsys, tmp_path):
    path = tmp_path / "c.json"
    code, out, _ = run(capsys, "plan", "--model", "mlp-tiny", "--cluster", "2x4", "--mesh", "2x4", "--quiet",
                       "--json", str(path))
    assert code == 0
    d = json.loads(path.read_text())
    assert d["options"]["inter_host_axes"] == [0]
    assert "x=2*" in out and "crosses hosts" in out
    assert "2 hosts x 4 devices" in out


@pytest.mark.parametrize("shape, per_host, expected", [
    ((2, 4), 4, (0,)), ((8,), 4, (0,)), ((4, 2), 4, (0,)), ((1, 16), 8, (1,)), ((2, 8), 8, (0,)),
    ((2, 4), 8, ()), ((4, 4), 2, (0, 1)),
])
def test_inter_host_axes(shape, per_host, expected):
    from planner.search.candidates import inter_host_axes
    assert inter_host_axes(shape, per_host) == expected


@pytest.mark.parametrize("argv, needle", [
    (["--model", "gpt5", "--devices", "8"], "unknown model 'gpt5'"),
    (["--model", "mlp-tiny", "--cluster", "2by8"], "--cluster '2by8' is not HOSTSxDEVICES"),
    (["--model", "mlp-tiny", "--cluster", "0x8"], "is not HOSTSxDEVICES"),
    (["--model", "mlp-tiny", "--mesh", "8", "--memory-budget", "1kB"], "memory budget"),
    (["--model", "mlp-tiny", "--mesh", "8", "--memory-budget", "lots"], "is not a size"),
    (["--model", "mlp-tiny", "--mesh", "3x3", "--devices", "8"], "has 9 devices"),
    (["--model", "mlp-tiny", "--devices", "8", "--hardware", "abacus"], "unknown hardware"),
    (["--model", "mlp-tiny"], "--devices N, --mesh 2x4 or --cluster"),
    (["--devices", "8"], "--model NAME"),
    (["--model", "mlp-tiny", "--mesh", "8", "--seq", "4"], "does not accept"),
    (["--fn", "no_such_module_xyz:make", "--mesh", "8"], "cannot import 'no_such_module_xyz'"),
    (["--fn", "json:no_such_factory", "--mesh", "8"], "has no callable 'no_such_factory'"),
    (["--fn", "json", "--mesh", "8"], "is not MODULE:FACTORY"),
    (["--fn", "json:dumps", "--mesh", "8"], "dumps() raised TypeError"),
    (["--model", "mlp-tiny", "--mesh", "8", "--profile", "/nonexistent/db.json"], "does not exist"),
    (["--model", "mlp-tiny", "--devices", "8", "--pipeline", "auto", "--memory-budget", "none"],
     "pipeline stages are planned to fit a memory budget"),
])
def test_errors_are_one_line_with_status_2(capsys, argv, needle):
    code, out, err = run(capsys, "plan", "--quiet", *argv)
    assert code == 2
    assert needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("planner: error: ")


def test_infeasible_budget_names_the_fix(capsys):
    code, _, err = run(capsys, "plan", "--model", "mlp-tiny", "--mesh", "8", "--memory-budget", "1kB", "--quiet")
    assert code == 2 and "--memory-budget" in err


def test_argparse_errors_exit_2(capsys):
    code, _, err = run(capsys, "plan", "--model", "mlp-tiny", "--devices", "zero")
    assert code == 2 and "not an integer" in err
    code, _, err = run(capsys, "plan", "--model", "mlp-tiny", "--devices", "8", "--donate", "state")
    assert code == 2 and "not a comma-separated list of argument positions" in err


def test_donate_reaches_the_plan(capsys, tmp_path):
    """--donate sets the plan's donate_argnums (the memory model's effect: tests/test_memory.py)."""
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "--model", "mlp-tiny", "--mesh", "8", "--donate", "0", "--quiet",
                       "--json", str(path))
    assert code == 0 and "argument(s) 0 donated" in out
    assert Plan.from_json(path.read_text()).options.donate_argnums == (0,)
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "--help")[0] == 0


def test_offload_of_master_parameters_reaches_the_plan(capsys, tmp_path):
    """--offload opt-state+params: the bf16 step's cast weights join the moments on the host, and
    the report says how many; an unknown mode exits 2 naming the choices."""
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "1x8", "--dtype", "bfloat16",
                         "--offload", "opt-state+params", "--quiet", "--json", str(path))
    assert code == 0, err
    record = Plan.from_json(path.read_text()).levers.offload
    assert record.mode == "opt-state+params" and record.params > 0
    assert f"({record.params} master parameters, copied in for their casts too)" in out
    code, _, err = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "1x8", "--offload", "params")
    assert code == 2 and "opt-state+params" in err


def test_fn_factory_from_file_and_module(capsys, tmp_path, monkeypatch):
    src = textwrap.dedent("""
        import jax, jax.numpy as jnp

        def make(batch=16):
            def step(params, x):
                h = x @ params["w1"]
                loss = jnp.mean(jnp.tanh(h) @ params["w2"])
                grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]))(params)
                return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss
            params = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
                      "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
            return step, (params, jax.ShapeDtypeStruct((batch, 32), jnp.float32))

        def broken():
            return 42
    """)
    (tmp_path / "userstep.py").write_text(src)
    code, out, err = run(capsys, "plan", "--fn", f"{tmp_path / 'userstep.py'}:make", "--mesh", "2x4", "--batch", "32",
                         "--quiet")
    assert code == 0, err
    assert "Plan for" in out and "userstep.py:make" in out
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "plan", "--fn", "userstep:make", "--mesh", "8", "--quiet")
    assert code == 0, err
    code, _, err = run(capsys, "plan", "--fn", "userstep:broken", "--mesh", "8", "--quiet")
    assert code == 2 and "not (train_step, example_args)" in err
    code, _, err = run(capsys, "plan", "--fn", "userstep:broken", "--mesh", "8", "--batch", "4", "--quiet")
    assert code == 2 and "takes no batch argument" in err


def test_list_models(capsys):
    code, out, _ = run(capsys, "plan", "--list-models")
    assert code == 0 and "gpt2-small" in out.split()


def test_explain_and_diff_commands(mlp_plan, capsys, tmp_path):
    path, _, _, _ = mlp_plan
    code, out, _ = run(capsys, "explain", str(path))
    assert code == 0
    assert "Cost breakdown:" in out and "runner-up" in out and "communication by collective" in out
    code, out, _ = run(capsys, "explain", str(path), "--op", "dense_0")
    assert code == 0 and "Decisions matching 'dense_0'" in out and "chosen" in out
    other = tmp_path / "other.json"
    assert run(capsys, "plan", "--model", "mlp-tiny", "--mesh", "2x4", "--quiet", "--json", str(other))[0] == 0
    code, out, _ = run(capsys, "diff", str(path), str(other))
    assert code == 0 and "step time" in out and "A:" in out and "B:" in out
    code, _, err = run(capsys, "explain", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read plan file" in err
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run(capsys, "diff", str(path), str(tmp_path / "bad.json"))
    assert code == 2 and "is not JSON" in err


def test_pipeline_on_plans_stages(capsys, tmp_path):
    path = tmp_path / "pp.json"
    code, out, err = run(capsys, "plan", "--model", "gpt-tiny", "--cluster", "2x4:cpu", "--pipeline", "on",
                         "--microbatches", "2", "--quiet", "--json", str(path))
    assert code == 0, err
    assert err == ""
    assert "Pipeline plans, best first:" in out and "Pipeline stages:" in out
    assert "submesh" in out and "time/microbatch" in out and "2 microbatches" in out and "bubble" in out
    d = json.loads(path.read_text())
    assert len(d["stages"]) >= 2
    assert all({"layers", "submesh", "mesh"} <= set(st) and st["layers"] for st in d["stages"])
    assert d["pipeline"]["num_microbatches"] == 2 and d["pipeline"]["num_stages"] == len(d["stages"])
    assert d["context"]["ranking"][0]["stages"] == len(d["stages"])
    code, again, _ = run(capsys, "plan", "--from", str(path), "--quiet")
    assert code == 0 and "Pipeline stages:" in again
    # (a pipeline plan loaded from its JSON runs equal to the unsharded step: tests/test_pp_baselines.py)
    code, _, err = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "2x4", "--pipeline", "on", "--quiet")
    assert code == 2 and "--mesh" in err and len(err.strip().splitlines()) == 1


def test_profile_subcommand(capsys, monkeypatch):
    from planner.cli import profile as commands
    monkeypatch.setattr(commands, "_profiling_module", lambda: None)
    code, _, err = run(capsys, "profile", "--out", "db.json")
    assert code == 2 and "planner profile" in err and "not available" in err
    calls = []
    fake = types.SimpleNamespace(
        add_arguments=lambda p: p.add_argument("--out"),
        run=lambda args: calls.append(args.out) or 0)
    monkeypatch.setattr(commands, "_profiling_module", lambda: fake)
    code, _, _ = run(capsys, "profile", "--out", "db.json")
    assert code == 0 and calls == ["db.json"]


def test_console_script_subprocess():
    exe = os.path.join(os.path.dirname(sys.executable), "planner")
    proc = subprocess.run([exe, "plan", "--model", "mlp-tiny", "--devices", "8", "--quiet"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Best plan:" in proc.stdout and "logical_axis_rules" in proc.stdout
    assert "[planner" not in proc.stderr  # --quiet: no progress lines


def test_pipeline_of_a_scanned_model_says_its_weights_stay_on_one_stage(capsys, tmp_path):
    """`planner plan --pipeline on` of the user's scanned model (--fn) prints which leaves a stage
    cannot split and what to do; the zoo's own Llama is built unrolled for pipelining instead."""
    factory = tmp_path / "scanned_step.py"
    factory.write_text("from zoo import get_model\n\n\ndef make():\n    b = get_model('llama-tiny')\n"
                       "    return b.train_step, (b.abstract_state(), b.abstract_batch())\n")
    code = cli.main(["plan", "--fn", f"{factory}:make", "--cluster", "1x2:cpu", "--pipeline", "on"])
    out = capsys.readouterr().out
    assert code == 0
    note = [line for line in out.splitlines() if line.strip().startswith("note:")]
    assert len(note) == 1 and "9 parameter leaves are stacked over layers by a scan" in note[0]
    assert "scan_layers=False" in note[0]
    code = cli.main(["plan", "--model", "llama-tiny", "--cluster", "1x2:cpu", "--pipeline", "on"])
    out = capsys.readouterr().out
    assert code == 0
    assert "layers unrolled for pipelining" in out
    assert not [line for line in out.splitlines() if line.strip().startswith("note:")]


# --- a broken --fn step, unwritable outputs, a profile given as a plan: one line, exit 2 ----------


@pytest.fixture
def user_module(tmp_path):
    path = tmp_path / "userstep.py"
    path.write_text(USER_STEP)
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


def test_a_train_step_is_planned_with_its_state_donated(tmp_path, capsys):
    """Without --donate the CLI plans a step that returns a state like its first argument with that
    argument donated (as a train step runs) and says so; --donate none plans without."""
    assumed, plain = tmp_path / "assumed.json", tmp_path / "plain.json"
    code, out, _ = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "2x4", "--quiet", "--json", str(assumed))
    assert code == 0 and out.startswith("Plan for gpt-tiny") and "Assumed donate_argnums=(0,)" in out
    code, out, _ = run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "2x4", "--quiet", "--donate", "none",
                       "--json", str(plain))
    assert code == 0 and "Assumed donate_argnums" not in out
    a, b = Plan.from_json(assumed.read_text()), Plan.from_json(plain.read_text())
    assert a.options.donate_argnums == (0,) and b.options.donate_argnums == ()
    assert a.prediction.memory_bytes_per_device < b.prediction.memory_bytes_per_device


def test_which_argument_a_step_returns():
    import jax.numpy as jnp

    from planner.graph.donation import returns_its_argument

    state = {"w": jnp.ones((4, 4)), "step": jnp.zeros((), jnp.int32)}
    x = jnp.ones((2, 4))

    def train_step(s, batch):
        return {"w": s["w"] - 0.1 * (batch @ s["w"]).sum(), "step": s["step"] + 1}, (batch @ s["w"]).mean()

    def loss_only(s, batch):
        return (batch @ s["w"]).mean()

    def recast(s, batch):
        return {"w": s["w"].astype(jnp.bfloat16), "step": s["step"]}, batch.sum()

    assert returns_its_argument(planner.trace(train_step, state, x), 0)
    assert not returns_its_argument(planner.trace(train_step, state, x), 1)  # the batch is not handed back
    assert not returns_its_argument(planner.trace(loss_only, state, x), 0)
    assert not returns_its_argument(planner.trace(recast, state, x), 0)
