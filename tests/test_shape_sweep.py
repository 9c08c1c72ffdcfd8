"""Several shapes in one run (`planner plan --batch 8,16`): each shape's plan is the plan made for
it alone, the shapes share the symbolic trace and the layer plans, and a step rebuilt per batch size
that computes something else is traced again instead of reusing the family."""
from __future__ import annotations

import json
import logging
import math

import jax
import pytest
import jax.numpy as jnp

from planner import cli
from planner.core.options import PlanOptions
from planner.graph.shape_family import ShapeFamily, same_program
from planner.graph.trace import trace
from planner.stages.inter_op import plan_pipeline
from planner.stages.microbatches import PlanningMemo
from planner.stages.submesh import make_cluster
from zoo import get_model

_WHERE = ("--model", "gpt-tiny", "--cluster", "1x4:a100", "--pipeline", "on", "--quiet")


def _step_time(path) -> float:
    return json.loads(path.read_text())["predicted"]["step_time_s"]


def test_sweep_plans_each_shape_as_alone(tmp_path, capsys):
    code = cli.main(["plan", *_WHERE, "--batch", "8,16", "--json", str(tmp_path / "sweep.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Shapes planned" in out
    alone = tmp_path / "alone.json"
    assert cli.main(["plan", *_WHERE, "--batch", "16", "--json", str(alone)]) == 0
    capsys.readouterr()
    # The layer plans of batch 16 came from batch 8's where the microbatch sizes coincide; proven
    # optimal each, so the pipeline is as fast as the one planned alone (ties may pick another layout).
    assert math.isclose(_step_time(tmp_path / "sweep.b16.json"), _step_time(alone), rel_tol=1e-9)
    assert (tmp_path / "sweep.b8.json").exists()


def test_a_smaller_batch_takes_the_larger_ones_layer_plans_within_the_gap(tmp_path, capsys, caplog):
    """`--batch 16,8`: batch 8's microbatch counts of the sizes batch 16 planned are smaller, so its
    layers take batch 16's step-weighted plans where those are provably within the layer gap at the
    smaller count (`layer_cost.StepSolve`): fewer ILP solves than planning batch 8 alone, and a
    pipeline no slower than that one's beyond the gap (each layer's plan within it)."""
    from planner.stages.layer_cost import LAYER_GAP

    def solves(args):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="planner"):
            assert cli.main(["plan", *_WHERE, *args]) == 0
        capsys.readouterr()
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("solved:")]

    swept = solves(["--batch", "16,8", "--json", str(tmp_path / "sweep.json")])
    first = solves(["--batch", "16"])
    alone = solves(["--batch", "8", "--json", str(tmp_path / "alone.json")])
    assert len(swept) - len(first) < len(alone)
    assert _step_time(tmp_path / "sweep.b8.json") <= _step_time(tmp_path / "alone.json") * (1 + LAYER_GAP)


def test_a_later_batch_size_solves_the_layer_ilps_the_first_built(capsys, caplog, monkeypatch):
    """`--batch 16,8`: batch 8's microbatch sizes are all batch 16's, so where one of its layers needs
    a solve of its own (here every one: no earlier solve is taken, `reuse` made to refuse) the ILP is
    the one batch 16 built (`PlanningMemo.keep_layer_problems`): none built again before the stage
    programs; a single shape keeps none."""
    import planner.stages.cost_table as cost_table
    from planner.stages.cost_table import LAYER_PROBLEMS
    monkeypatch.setattr(cost_table, "reuse", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="planner"):
        assert cli.main(["plan", *_WHERE, "--batch", "16,8"]) == 0
    capsys.readouterr()
    messages = [r.getMessage() for r in caplog.records]
    start = next(i for i, m in enumerate(messages) if "made from the symbolic trace" in m)
    end = next(i for i, m in enumerate(messages) if i > start and m.startswith("stage programs:"))
    layers = messages[start:end]
    assert sum(m.startswith("solved:") for m in layers) > 0
    assert sum(m.startswith("built ILP") for m in layers) == 0
    base = get_model("gpt-tiny", batch=8)
    memo = PlanningMemo()
    plan_pipeline(base.train_step, (base.abstract_state(), base.abstract_batch()), make_cluster(1, 4, "a100"),
                  PlanOptions(pipeline=True), memo=memo)
    assert memo.layer_plans and LAYER_PROBLEMS not in memo.layer_plans


def test_sweep_bad_sizes_and_commands_that_plan_one_shape(capsys):
    assert cli.main(["plan", *_WHERE, "--batch", "16,x"]) == 2
    assert "comma-separated list" in capsys.readouterr().err
    code = cli.main(["compare", "--model", "gpt-tiny", "--mesh", "2x4", "--batch", "8,16"])
    err = capsys.readouterr().err
    assert code == 2 and "plans one shape" in err and len(err.strip().splitlines()) == 1


def test_sweep_shape_without_a_plan_is_a_row_and_exit_2(capsys):
    code = cli.main(["plan", *_WHERE, "--batch", "16,32", "--memory-budget", "1kB"])
    out = capsys.readouterr().out
    assert code == 2
    assert out.count("no plan (") == 2


def test_memo_family_is_checked_against_the_step_of_each_size(caplog):
    """A step whose program depends on the batch size beyond its shapes (a factory that closes over
    it) is traced again for the second size; the same step reuses the family."""
    base = get_model("gpt-tiny", batch=8)
    args8 = (base.abstract_state(), base.abstract_batch())
    args16 = (base.abstract_state(), get_model("gpt-tiny", batch=16).abstract_batch())
    cluster, options = make_cluster(1, 2, "a100"), PlanOptions(pipeline=True)
    memo = PlanningMemo()
    plan_pipeline(base.train_step, args8, cluster, options, max_mesh_ndim=1, memo=memo,
                  full_graph=trace(base.train_step, *args8))
    assert isinstance(memo.family, ShapeFamily) and memo.layer_plans
    family = memo.family

    def scaled(state, batch, n=16):  # closes over its batch size
        return jax_tree_scale(base.train_step(state, batch), 1.0 / n)

    with caplog.at_level(logging.INFO, logger="planner"):
        plan_pipeline(base.train_step, args16, cluster, options, max_mesh_ndim=1, memo=memo,
                      full_graph=trace(base.train_step, *args16))
        assert memo.family is family and "traced again" not in caplog.text
        plan_pipeline(scaled, args16, cluster, options, max_mesh_ndim=1, memo=memo, full_graph=trace(scaled, *args16))
    assert "traced again" in caplog.text and memo.family is not family


def jax_tree_scale(tree, factor):
    return jax.tree.map(lambda x: x * jnp.asarray(factor, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def test_pipelined_plan_traces_the_step_once(monkeypatch, tmp_path, capsys):
    """`planner plan --pipeline` makes the whole batch's graph from the symbolic trace the pipeline
    search needs anyway: the step is traced once (symbolically), and the plan is the one planned
    from a concrete trace of the whole batch."""
    import planner.cli.plan as cli_plan
    calls = []
    real = cli_plan.trace
    monkeypatch.setattr(cli_plan, "trace", lambda *a, **k: calls.append(1) or real(*a, **k))
    once = tmp_path / "once.json"
    assert cli.main(["plan", *_WHERE, "--batch", "8", "--json", str(once)]) == 0
    assert calls == []
    memo = PlanningMemo()
    bundle = get_model("gpt-tiny", batch=8)
    args = (bundle.abstract_state(), bundle.abstract_batch())
    graph = cli_plan._from_family(bundle.train_step, args, memo)
    assert isinstance(memo.family, ShapeFamily) and memo.step is bundle.train_step
    assert same_program(graph, trace(bundle.train_step, *args))
    # Without the family (a step with scans keeps its traced jaxpr) the CLI traces the whole batch.
    monkeypatch.setattr(cli_plan, "_from_family", lambda *a: None)
    traced = tmp_path / "traced.json"
    assert cli.main(["plan", *_WHERE, "--batch", "8", "--json", str(traced)]) == 0
    capsys.readouterr()
    assert calls == [1]
    assert math.isclose(_step_time(once), _step_time(traced), rel_tol=1e-9)


def test_scanned_step_keeps_its_traced_graph():
    """A step with scans is traced whole (recomputing a scan rewrites its traced jaxpr, which a
    graph made from the family does not keep); the family is still left for the search."""
    import planner.cli.plan as cli_plan
    bundle = get_model("llama-tiny", batch=8)
    memo = PlanningMemo()
    assert cli_plan._from_family(bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch()), memo) is None
    assert isinstance(memo.family, ShapeFamily)


def test_the_single_stages_memory_bounds_shrink_no_faster_than_the_batch():
    """What `single_stage.floor_from_larger_batch` relies on, on the zoo's GPT and Llama: for b
    dividing B, each bound of the single stage's mesh search (arguments and outputs, the values
    live at the fullest point, a mesh's memory lower bound) at b rows is at least its value at B
    times b / B."""
    from planner.core.mesh import MeshSpec
    from planner.ilp.memory_bounds import liveness_floor, memory_floor, memory_lower_bound
    from planner.search.mesh_plan import plan_problem

    for name in ("gpt-tiny", "llama-tiny"):
        bundle = get_model(name)
        family = trace_family_of(bundle)
        for B, b in ((16, 8), (16, 2), (8, 4)):
            big, small = family.at(B), family.at(b)
            assert memory_floor(small, 8) >= memory_floor(big, 8) * b / B
            for mesh in (MeshSpec((8,), ("x",)), MeshSpec((2, 4), ("x", "y"))):
                pB, pb = (plan_problem(g, mesh, PlanOptions(hardware="a100")) for g in (big, small))
                assert liveness_floor(pb) >= liveness_floor(pB) * b / B
                assert memory_lower_bound(pb).max() >= memory_lower_bound(pB).max() * b / B


def trace_family_of(bundle):
    from planner.graph.shape_family import trace_family

    family = trace_family(bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch()), (1,))
    assert isinstance(family, ShapeFamily), family
    return family


def test_a_single_stage_over_every_meshs_bound_is_not_planned_again_at_a_batch_dividing_it():
    """`floor_from_larger_batch`: batch B's single stage over the budget on every mesh by bounds
    whose least is F; at a batch b dividing B whose scaled bound F * b / B is over the budget too,
    the single stage is not planned (the reason says the bound); not where b does not divide B,
    where the scaled bound fits, for other options, or without a symbolic trace."""
    import dataclasses
    import types

    from planner.stages.single_stage import _floor_key, floor_from_larger_batch

    options = PlanOptions(hardware="a100")
    cluster = make_cluster(2, 4, "a100")

    def space(batch, family=ShapeFamily(None, (), ()), opts=options):
        return types.SimpleNamespace(batch=batch, budget=40e9, cluster=cluster, options=opts,
                                     graphs=types.SimpleNamespace(family=family), single_floors=floors)

    floors = {}
    floors[_floor_key(space(16))] = [(16, 100e9)]
    said = floor_from_larger_batch(space(8))
    assert said is not None and "needs >= 50.00 GB/device" in said and "batch 16" in said
    assert floor_from_larger_batch(space(4)) is None  # 25 GB fits the 40 GB budget
    assert floor_from_larger_batch(space(12)) is None  # does not divide 16
    assert floor_from_larger_batch(space(16)) is None  # not a larger batch
    assert floor_from_larger_batch(space(8, opts=dataclasses.replace(options, donate_argnums=(0,)))) is None
    assert floor_from_larger_batch(space(8, family="traced per size")) is None


def _records(plans, counts, gap):
    """`StepSolve`s of a layer whose plans' weighed objectives are `plans` ((a, w): a + w * share), as
    solves at `counts` that stop `gap` short of proving their optimum (count 1: the plain solve,
    whose objective is at most the weighed one, bounded alike)."""
    from planner.stages.layer_cost import LayerCost, StepSolve
    out = []
    for count in counts:
        share = 1.0 / count
        a, w = min(plans, key=lambda p: p[0] + p[1] * share)
        v = a + w * share
        found = LayerCost(a, 0.0, 0.0, 0.0, 0.0, sync_s=w)  # priced as weighed: 1 s a microbatch, w once
        out.append(StepSolve(count, v, v * (1 - gap), w if count > 1 else None, found))
    return out


def test_step_bound_never_exceeds_the_least_objective():
    """Every plan's weighed objective is affine in the share and non-decreasing: a solve's bound holds
    at larger shares, and two solves' bounds bound the shares between them by their chord."""
    import random

    from planner.stages.layer_cost import step_bound
    rng = random.Random(0)
    for _ in range(200):
        plans = [(rng.uniform(0.5, 2.0), rng.uniform(0.0, 3.0)) for _ in range(rng.randint(1, 6))]
        records = _records(plans, rng.sample([1, 2, 4, 8, 16, 64, 256, 1024], 3), rng.uniform(0.0, 0.02))
        for count in (1, 2, 3, 4, 8, 12, 32, 100, 512, 1024, 4096):
            share = 1.0 / count
            least = min(a + w * share for a, w in plans)
            bound = step_bound(records, share)
            assert bound is None or bound <= least * (1 + 1e-12)
            if any(r.share <= share for r in records):
                assert bound is not None


def test_a_count_between_two_solves_takes_a_plan_the_larger_count_alone_could_not_prove():
    """One plan (1 s a microbatch, 1 s once a step): solved at 100 microbatches 1.9% short of its
    proof, its objective at 50 is 2.9% over that solve's bound, but the one-microbatch solve's bound
    lifts the chord to within the 2% gap: reused, where the larger count's bound alone would not do."""
    from planner.stages.layer_cost import LAYER_GAP, reuse, step_bound
    weighed, one = _records([(1.0, 1.0)], [100, 1], 0.019)
    found = reuse([weighed, one], 50, lambda: pytest.fail("the one-microbatch plan is not asked for"))
    assert found is weighed.found
    objective = 1.0 + 1.0 / 50
    assert objective - weighed.bound_s > LAYER_GAP * objective
    assert objective - step_bound([weighed, one], 1 / 50) <= LAYER_GAP * objective
    assert reuse([weighed], 50, lambda: pytest.fail("not asked")) is None


def test_a_sweep_over_lengths_traces_the_model_once(monkeypatch, tmp_path, capsys):
    """`--seq 32,64`: one symbolic trace of the zoo model for both lengths (and no concrete trace),
    each length's plan the plan made for it alone."""
    calls = _counted(monkeypatch)
    code = cli.main(["plan", *_WHERE, "--batch", "8", "--seq", "32,64", "--json", str(tmp_path / "sweep.json")])
    capsys.readouterr()
    assert code == 0
    assert calls == {"length_family": 1, "trace_family": 0, "trace": 0}
    for seq in (32, 64):
        alone = tmp_path / f"alone{seq}.json"
        assert cli.main(["plan", *_WHERE, "--batch", "8", "--seq", str(seq), "--json", str(alone)]) == 0
        capsys.readouterr()
        assert math.isclose(_step_time(tmp_path / f"sweep.b8.s{seq}.json"), _step_time(alone), rel_tol=1e-9)


def _counted(monkeypatch) -> dict[str, int]:
    """How often `planner plan` traces: a family of lengths, a batch-size family, a concrete trace."""
    import planner.cli.plan as cli_plan
    calls = {"length_family": 0, "trace_family": 0, "trace": 0}
    for name in calls:
        monkeypatch.setattr(cli_plan, name, lambda *a, _n=name, _f=getattr(cli_plan, name), **k:
                            calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **k))
    return calls


def test_a_model_that_does_not_build_for_a_symbolic_length_is_traced_per_length(caplog):
    """The MoE's token groups must divide batch x length at build time: no family of lengths, said
    in one line; the sweep then traces each length on its own."""
    import types

    import planner.cli.plan as cli_plan
    args = types.SimpleNamespace(model="moe-tiny", batch=8, seq=32, dtype=None)
    where = types.SimpleNamespace(target_hw=types.SimpleNamespace(default_dtype="float32"))
    with caplog.at_level(logging.INFO, logger="planner"):
        family = cli_plan._trace_seq_family(args, where)
    assert isinstance(family, str) and "does not build for a symbolic sequence length" in family
    assert "each sequence length traced on its own" in caplog.text


def test_a_one_token_length_is_traced_on_its_own():
    """A length of 1 is below what a family holds (its unit dimension broadcasts in a trace,
    `shape_family.MIN_SIZE`): that length takes no family of lengths (and traces none for it); a
    sweep's other lengths still share one."""
    import types

    import planner.cli.plan as cli_plan
    shared: dict = {}
    args = types.SimpleNamespace(model="gpt-tiny", batch=8, seq=1, dtype=None, seq_families=shared)
    where = types.SimpleNamespace(target_hw=types.SimpleNamespace(default_dtype="float32"))
    memo = PlanningMemo()
    assert cli_plan._from_seq_family(args, where, object(), memo) is None
    assert memo.family is None and shared == {}
