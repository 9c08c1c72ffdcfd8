"""Explanations, plan diffs, the per-layer table and logical axis rules (planner/present/explain.py,
report.py, logical_axes.py): the `explain` text (legend, one row per distinct decision, decision
count), `explain_plan` in Python, the pipeline figure and the summary's size units."""
from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import pytest

import planner
from planner import cli
from planner.present.diff import diff
from planner.present.explain import decision_comm, explain, explain_plan, readable_strategy
from planner.present.logical_axes import apply_rules, classify, infer_rules, path_tokens
from planner.present.report import PlanView, collapse_layers, fmt_bytes, fmt_time, format_layer_table, memory_breakdown
from tests.helpers import USER_STEP

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_explain")


def _plan(tmp, *argv) -> PlanView:
    path = tmp / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["plan", "--quiet", "--json", str(path), *argv]) == 0
    return PlanView.load(str(path))


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """mlp-wide (hidden >> batch: weights worth sharding) on 1-D and 2-D meshes, and gpt-tiny."""
    a = _plan(tmp_path_factory.mktemp("a"), "--model", "mlp-wide", "--mesh", "8")
    b = _plan(tmp_path_factory.mktemp("b"), "--model", "mlp-wide", "--mesh", "2x4")
    g = _plan(tmp_path_factory.mktemp("g"), "--model", "gpt-tiny", "--mesh", "8")
    return a, b, g


def test_a_view_made_in_memory_holds_the_plan_its_file_holds(views):
    """`plan_view` makes its view from the plan's JSON form in memory (no text round trip): the plan
    it holds is the one read back from the saved file."""
    for v in views:
        assert PlanView.from_dict(v.plan.to_dict()).plan == v.plan


# ----- logical axes ---------------------------------------------------------------------------
GPT_LEAVES = [
    ("[0]['params']['wte']['embedding']", (512, 64), "float32"),
    ("[0]['params']['wpe']['embedding']", (32, 64), "float32"),
    ("[0]['params']['blocks_0']['ln_1']['scale']", (64,), "float32"),
    ("[0]['params']['blocks_0']['attn']['query']['kernel']", (64, 4, 16), "float32"),
    ("[0]['params']['blocks_0']['attn']['query']['bias']", (4, 16), "float32"),
    ("[0]['params']['blocks_0']['attn']['out']['kernel']", (4, 16, 64), "float32"),
    ("[0]['params']['blocks_0']['mlp']['fc_in']['kernel']", (64, 256), "float32"),
    ("[0]['params']['blocks_0']['mlp']['fc_in']['bias']", (256,), "float32"),
    ("[0]['params']['blocks_0']['mlp']['fc_out']['kernel']", (256, 64), "float32"),
    ("[0]['params']['lm_head']['kernel']", (64, 256), "float32"),  # vocab == mlp width: names decide
    ("[0]['opt_state'][0].mu['blocks_0']['mlp']['fc_in']['kernel']", (64, 256), "float32"),
    ("[0]['opt_state'][0].count", (), "int32"),
    ("[1]['inputs']", (8, 32), "int32"),
]


def test_logical_names_from_paths_and_shapes():
    paths, shapes, dtypes = zip(*GPT_LEAVES)
    specs = [((),) * len(s) for s in shapes]
    leaves = {leaf.path: leaf for leaf in classify(paths, shapes, dtypes, specs)}
    names = {p.split("['params']")[-1].split(".mu")[-1]: leaves[p].names for p in paths}
    assert names["['wte']['embedding']"] == ("vocab", "embed")
    assert names["['wpe']['embedding']"] == ("length", "embed")
    assert names["['blocks_0']['ln_1']['scale']"] == ("embed",)
    assert names["['blocks_0']['attn']['query']['kernel']"] == ("embed", "heads", "kv")
    assert names["['blocks_0']['attn']['query']['bias']"] == ("heads", "kv")
    assert names["['blocks_0']['attn']['out']['kernel']"] == ("heads", "kv", "embed")
    assert names["['blocks_0']['mlp']['fc_in']['kernel']"] == ("embed", "mlp")
    assert names["['blocks_0']['mlp']['fc_in']['bias']"] == ("mlp",)
    assert names["['blocks_0']['mlp']['fc_out']['kernel']"] == ("mlp", "embed")
    assert names["['lm_head']['kernel']"] == ("embed", "vocab")
    mirror = leaves["[0]['opt_state'][0].mu['blocks_0']['mlp']['fc_in']['kernel']"]
    assert mirror.role == "opt_state" and mirror.names == ("embed", "mlp")
    assert leaves["[0]['opt_state'][0].count"].role == "other"
    assert leaves["[1]['inputs']"].role == "data" and leaves["[1]['inputs']"].names == ("batch", "length")


def test_rules_vote_by_bytes_and_list_exceptions():
    paths, shapes, dtypes = zip(*GPT_LEAVES)
    specs = []
    for p, s in zip(paths, shapes):
        if "fc_in']['kernel" in p:
            specs.append(((), ("y",)))               # Megatron column split
        elif "fc_out']['kernel" in p:
            specs.append((("y",), ()))               # row split
        elif "inputs" in p:
            specs.append((("x",), ()))
        elif "wte" in p:
            specs.append((("y",), ()))               # disagrees with lm_head's replicated vocab: an exception
        else:
            specs.append(((),) * len(s))
    leaves = classify(paths, shapes, dtypes, specs)
    rules = infer_rules(leaves)
    as_dict = dict(rules.rules)
    assert as_dict["batch"] == ("x",) and as_dict["mlp"] == ("y",) and as_dict["embed"] == ()
    assert [n for n, _ in rules.rules][:2] == ["batch", "length"]  # MaxText order
    assert 0.5 < rules.coverage < 1.0
    assert any("wte" in e[0] or "lm_head" in e[0] for e in rules.exceptions)
    assert "('mlp', 'y')" in rules.as_python() and "['mlp', ['y']]" in rules.as_yaml()
    assert "ZeRO" in rules.optimizer or "like the parameters" in rules.optimizer
    # flax semantics: a mesh axis is used once per tensor
    assert apply_rules(("mlp", "mlp"), {"mlp": ("y",)}) == (("y",), ())


@pytest.mark.parametrize("path, shape, expected", [
    # scanned (stacked) layers: a leading `layers` dim
    ("[0]['params']['layers']['attn']['query']['kernel']", (2, 64, 4, 16), ("layers", "embed", "heads", "kv")),
    ("[0]['params']['layers']['mlp']['down']['kernel']", (2, 128, 64), ("layers", "mlp", "embed")),
    ("[0]['params']['layers']['attn_norm']['scale']", (2, 64), ("layers", "embed")),
    # mixture of experts
    ("[0]['params']['blocks_1']['moe']['wi']", (4, 64, 128), ("exp", "embed", "mlp")),
    ("[0]['params']['blocks_1']['moe']['wo']", (4, 128, 64), ("exp", "mlp", "embed")),
    ("[0]['params']['blocks_1']['moe']['gate']", (64, 4), ("embed", "exp")),
    # haiku names and nnx Variables
    ("[0]['params']['hidden']['w']", (64, 256), ("embed", "mlp")),
    ("[0]['params']['fc']['kernel'].value", (256, 64), ("mlp", "embed")),
])
def test_logical_names_of_other_model_families(path, shape, expected):
    context = [("[0]['params']['norm']['scale']", (64,), "float32"), ("[1]['tokens']", (8, 32), "int32"),
               ("[0]['batch_stats']['bn']['mean']", (64,), "float32")]
    if "layers" in path:  # siblings of a stack share its leading dim
        context.append(("[0]['params']['layers']['mlp_norm']['scale']", (2, 64), "float32"))
    paths, shapes, dtypes = zip(*context, (path, shape, "float32"))
    leaves = classify(paths, shapes, dtypes, [((),) * len(s) for s in shapes])
    assert leaves[-1].role == "param" and leaves[-1].names == expected
    assert leaves[1].role == "data" and leaves[2].role == "other"  # batch statistics are model state


def test_path_tokens():
    assert path_tokens("[0]['opt_state'][0].mu['dense_0']['kernel']") == ("0", "opt_state", "0", "mu", "dense_0", "kernel")


# ----- tables ---------------------------------------------------------------------------------
def test_collapse_layers_groups_identical_layers_only():
    rows = []
    for i in range(6):
        spec = "P(None, y)" if i < 4 else "P(y, None)"
        rows.append((("blocks_%d" % i, "mlp", "kernel"), (spec,)))
        rows.append((("blocks_%d" % i, "ln", "scale"), ("P(None)",)))
    rows.append((("lm_head", "kernel"), ("P(None, y)",)))
    out = collapse_layers(rows)
    assert ("blocks_[0-3]", "mlp/kernel", 4, ("P(None, y)",)) in out
    assert ("blocks_[4-5]", "mlp/kernel", 2, ("P(y, None)",)) in out
    assert ("lm_head", "kernel", 1, ("P(None, y)",)) in out
    assert len(out) == 5


def test_layer_table_and_memory(views):
    _, _, g = views
    text = format_layer_table(g)
    assert "blocks_[0-1]" in text and "x2" in text
    mem = memory_breakdown(g)
    assert set(mem) == {"parameters", "optimizer state", "data", "activations and temporaries"}
    assert mem["optimizer state"] == pytest.approx(2 * mem["parameters"], rel=0.01) or mem["optimizer state"] > 0


# ----- explain / diff --------------------------------------------------------------------------
def test_explain_breakdown_and_runner_up(views):
    a, _, _ = views
    text = explain(a)
    assert "predicted step time" in text and "compute" in text
    assert "communication by collective" in text or "no communication" in text
    assert "Decisions, costliest first" in text and "runner-up" in text
    assert "memory: peak" in text and "parameters" in text


def test_explain_one_op(views):
    a, _, _ = views
    text = explain(a, op="DENSE_1")
    assert "Decisions matching 'DENSE_1'" in text
    assert text.count("chosen") >= 1 and text.count("runner-up") >= 1
    assert "cost" in text
    assert "no decision or collective matches" in explain(a, op="no-such-op")


def test_diff_of_a_plan_with_itself_is_empty(views):
    a, _, _ = views
    text = diff(a, a)
    assert "Input shardings: identical" in text and "Decisions: the same choices" in text


def test_diff_shows_what_changes(views):
    a, b, _ = views
    text = diff(a, b)
    assert "step time" in text and "memory / device" in text
    assert "A: mesh 8" in text and "B: mesh 2x4" in text
    assert "the meshes differ" in text
    if a.specs != b.specs:
        assert "Input shardings that differ" in text or "differently named mesh axes" in text


def test_readable_strategies():
    assert readable_strategy("((0,), ())", ("x", "y")) == "P(x, None)"
    assert readable_strategy("((0, 1),)", ("x", "y")) == "P((x,y))"
    assert readable_strategy("m0->x*y", ("x", "y")) == "m0->x*y"
    items = decision_comm((("all-reduce", ("x", "y"), 8192, 1e-6),), ops=3)
    assert items == [f"all-reduce over x*y of {fmt_bytes(8192)} ({fmt_time(1e-6)} per op, x3 ops)"]


def test_loading_rejects_non_plans(tmp_path):
    from planner.core.errors import InvalidArgumentError

    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(InvalidArgumentError, match="not a plan object"):
        PlanView.load(str(tmp_path / "list.json"))
    (tmp_path / "partial.json").write_text(json.dumps({"format_version": 1, "mesh": {"x": 2}}))
    with pytest.raises(InvalidArgumentError, match="not a valid plan JSON"):
        PlanView.load(str(tmp_path / "partial.json"))


def test_plans_saved_by_the_api_work_without_context(tmp_path, capsys):
    """A plan written with `Plan.to_json()` (no CLI context: no shapes) still prints, explains and diffs."""
    import planner
    from zoo import get_model
    from planner.search.mesh_plan import make_plan

    bundle = get_model("mlp-tiny")
    graph = planner.trace(bundle.train_step, bundle.abstract_state(), bundle.abstract_batch())
    plan = make_plan(graph, planner.MeshSpec((2, 4), ("x", "y")), planner.PlanOptions())
    path = tmp_path / "api.json"
    path.write_text(plan.to_json())
    assert cli.main(["plan", "--from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Plan:" in out and "dense_" in out and "need the input shapes" in out
    assert cli.main(["explain", str(path)]) == 0 and "Cost breakdown" in capsys.readouterr().out
    assert cli.main(["diff", str(path), str(path)]) == 0 and "identical" in capsys.readouterr().out


def test_diff_lists_a_changed_leaf(views):
    a, _, _ = views
    data = json.loads(json.dumps(a.data))
    entry = next(x for x in data["inputs"] if x["path"] == "[1]['x']")
    entry["spec"] = [[], []] if entry["spec"][0] else [[0], []]
    changed = PlanView.from_dict(data)
    text = diff(a, changed)
    assert "Input shardings that differ (1 of" in text and "x" in text.split("Input shardings that differ")[1]


def test_decision_records_carry_their_collectives(views):
    """The collectives `explain` lists for a decision are the ones the planner costed (plan JSON, not text)."""
    plans = [v.plan for v in views]
    with_comm = [d for p in plans for d in p.decisions if d.collectives]
    assert with_comm, "mlp-wide on 8 devices splits its weights: some decision must communicate"
    for d in with_comm:
        # communication_s sums the same costs over the ops sharing the decision
        assert d.communication_s == pytest.approx(d.ops * sum(c[3] for c in d.collectives), rel=1e-9)
        for kind, axes, nbytes, seconds in d.collectives:
            assert kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
            assert axes and nbytes > 0 and seconds > 0
    for d in (d for p in plans for d in p.decisions if not d.collectives):
        assert d.communication_s == 0.0
    d = with_comm[0]
    label = d.label.split()[-1]
    text = explain(views[0] if d in plans[0].decisions else views[1] if d in plans[1].decisions else views[2],
                   op=label)
    kind, axes, nbytes, _ = d.collectives[0]
    assert f"{kind} over {'*'.join(axes)}" in text


# --- a user's --fn step, planned and explained through the CLI -----------------------------------


@pytest.fixture(scope="module")
def mlp_plan_and_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_step") / "userstep.py"
    path.write_text(USER_STEP)
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
    assert plan.user_constraints and all(c.kept for c in plan.user_constraints)
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
