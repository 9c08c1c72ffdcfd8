"""Gradient accumulation in single-stage plans (planner.levers.accumulate): k microbatches inside one step.

Numerics: accumulation regroups the same n terms of every batch sum (n = the full step's longest
sum) into k partial sums added in float32, i.e. one more summation order of the same terms, so the
derived bound of tests/helpers.py (2 n u sum|x_i|) holds unchanged; dividing by k (a power of two
here) is exact. Memory: the compiled program's `memory_analysis()` peak must not exceed the
prediction (the memory tests' criterion: a plan under a budget fits it as XLA measures it), and
both the prediction and the measured peak must drop against k = 1. The zoo's GPT and Llama at
k = 2 and 4 (numerics and memory) are checked by experiments/check_accumulation.py (too slow here).
"""
from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from tests.helpers import assert_bundle_step_close, concrete
from xla_hooks.inspect import memory_stats


def _peak(step, state, batch) -> int:
    return memory_stats(step.lower(state, batch).compile()).peak_bytes


def test_microbatches_save_activation_memory_as_predicted_and_match_the_unsharded_step():
    b, state, batch = concrete("mlp-tall")
    one = jax.devices()[:1]
    plain = planner.plan_parallel(b.train_step, mesh="1", devices=one)
    acc = planner.plan_parallel(b.train_step, mesh="1", devices=one, accumulate=2)
    plan = acc.plan(state, batch)
    record = plan.levers.accumulation
    assert record.microbatches == 2 and record.microbatch_rows == b.config.batch // 2
    compiled = acc.lower(state, batch).compile()
    measured, measured_plain = memory_stats(compiled).peak_bytes, _peak(plain, state, batch)
    # The prediction holds as XLA measures it; predicted and measured both drop against k = 1
    # (activations of one of two microbatches are live at once).
    assert measured <= plan.prediction.memory_bytes_per_device
    assert plan.prediction.memory_bytes_per_device < plain.plan(state, batch).prediction.memory_bytes_per_device
    assert measured < measured_plain
    assert "while" in compiled.as_text()  # the microbatch loop is in the program
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = compiled(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_donated_state_with_accumulation_stays_within_the_prediction(devices8):
    """With the train state donated (as training loops do), the accumulated program's peak as XLA
    measures it stays within the prediction (`levers.accumulate.micro_options`: modelling the donation in
    the microbatch plan put the prediction at 0.84x of this peak)."""
    b, state, batch = concrete("gpt-tiny")
    donated = planner.plan_parallel(b.train_step, mesh="1x8", accumulate=2, donate_argnums=0)
    stats = memory_stats(donated.lower(state, batch).compile())
    assert stats.alias_bytes > 0
    assert stats.peak_bytes <= donated.plan(state, batch).prediction.memory_bytes_per_device


def test_sharded_accumulation_matches_the_unsharded_step(devices8):
    b, state, batch = concrete("mlp-tiny")
    step = planner.plan_parallel(b.train_step, mesh="2x4", accumulate=2)
    plan = step.plan(state, batch)
    assert plan.levers.accumulation.microbatches == 2
    # Costed from the microbatch plan: forward/backward twice, the update once.
    record = plan.levers.accumulation
    assert plan.prediction.step_time_s == pytest.approx(
        2 * record.microbatch_step_time_s - record.update_time_s)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def _kernel_gathers(compiled) -> tuple[int, int]:
    """(inside the microbatch loop's body, elsewhere): all-gathers of a whole MLP kernel."""
    text = compiled.as_text()
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    inside = outside = 0
    for comp in re.split(r"\n(?=\S)", text):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", comp)
        n = len(re.findall(r"f32\[(?:64,256|256,64)\]\{1,0\} all-gather\(", comp))
        if name and name.group(1) in bodies:
            inside += n
        else:
            outside += n
    return inside, outside


def test_selective_unsharding_gathers_invariant_parameters_once_per_step(devices8):
    """MLP kernels pinned ZeRO-3 style (split over all 8 devices, the batch too): each microbatch's
    dots need them whole. With unsharding (the default) the 4 all-gathers run once, before the
    loop, predicted (k - 1) x their time faster and holding the gathered copies; without it they
    run in every microbatch (XLA would hoist them by itself: the emitted loop stops it). Both
    match the unsharded step."""
    b, state, batch = concrete("gpt-tiny", batch=64)
    pins = {"params/**/mlp/**/kernel": P("y", None), "inputs": P("y"), "targets": P("y")}
    steps = {on: planner.plan_parallel(b.train_step, mesh="1x8", accumulate=4, pins=pins, unshard=on)
             for on in (True, False)}
    on, off = (steps[x].plan(state, batch) for x in (True, False))
    graph = steps[True].graph(state, batch)
    kernels = {t for t, path in zip(graph.inputs, graph.input_paths)
               if "['params']" in path and "['mlp']" in path and path.endswith("['kernel']")}
    record = on.levers.accumulation
    assert {h.tensor for h in record.unsharded} == kernels and record.resharded_per_microbatch == ()
    assert off.levers.accumulation.unsharded == ()
    assert set(off.levers.accumulation.resharded_per_microbatch) == kernels
    gathers = sum(r.seconds for r in off.solver.argument_reshards if r.tensor in kernels)
    assert off.prediction.step_time_s - on.prediction.step_time_s == pytest.approx(3 * gathers, rel=1e-9)
    assert (on.prediction.memory_bytes_per_device - off.prediction.memory_bytes_per_device
            == sum(h.bytes for h in record.unsharded))
    compiled = {x: steps[x].lower(state, batch).compile() for x in (True, False)}
    assert _kernel_gathers(compiled[True]) == (0, 4) and _kernel_gathers(compiled[False]) == (4, 0)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    for x in (True, False):
        new_state, metrics = compiled[x](state, batch)
        assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    # under a budget between the two, only what fits is gathered once
    budget = (on.prediction.memory_bytes_per_device + off.prediction.memory_bytes_per_device) // 2
    part = planner.plan(b.train_step, state, batch, mesh="1x8", accumulate=4, pins=pins, memory_budget=budget)
    record = part.levers.accumulation
    assert 0 < len(record.unsharded) < len(kernels) and part.prediction.memory_bytes_per_device <= budget


def test_auto_chooses_microbatches_that_fit_the_budget():
    b, state, batch = concrete("mlp-tall")
    one = jax.devices()[:1]
    full = planner.plan(b.train_step, state, batch, mesh="1", devices=one).prediction.memory_bytes_per_device
    budget = int(0.8 * full)
    step = planner.plan_parallel(b.train_step, mesh="1", devices=one, accumulate="auto", memory_budget=budget)
    plan = step.plan(state, batch)
    k = plan.levers.accumulation.microbatches
    assert k > 1 and plan.prediction.memory_bytes_per_device <= budget
    assert _peak(step, state, batch) <= budget
    with pytest.raises(InfeasiblePlanError, match=r"gradient accumulation over \d+ microbatch count") as e:
        planner.plan(b.train_step, state, batch, mesh="1", devices=one, accumulate="auto", memory_budget="100KB")
    assert e.value.min_memory_bytes is not None and e.value.min_memory_bytes > 100e3


def test_accumulation_options_are_checked():
    b = concrete("mlp-tiny")[0]
    args = (b.abstract_state(), b.abstract_batch())
    with pytest.raises(InvalidArgumentError, match="does not divide the batch of 64 rows"):
        planner.plan(b.train_step, *args, mesh="1", devices=jax.devices()[:1], accumulate=3)
    for bad in (0, "yes", True):
        with pytest.raises(InvalidArgumentError, match="accumulate="):
            planner.plan_parallel(b.train_step, accumulate=bad)
    with pytest.raises(InvalidArgumentError, match="single-stage"):
        planner.plan_parallel(b.train_step, accumulate=2, pipeline="auto")

    def no_grad(state, batch):
        return state, {"loss": batch["x"].sum()}

    with pytest.raises(InvalidArgumentError, match="cannot accumulate gradients over this train step"):
        planner.plan(no_grad, *args, mesh="1", devices=jax.devices()[:1], accumulate=2)


def test_cli_accumulate_flag(capsys, tmp_path):
    from planner import cli

    page, saved = tmp_path / "plan.html", tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "1x8", "--accumulate", "2", "-q", "--html", str(page),
                     "--json", str(saved)])
    out = capsys.readouterr().out
    assert code == 0 and "Gradient accumulation: 2 microbatches of 32 rows per step" in out
    text = page.read_text()  # the report and explain show the levers too
    assert "<h2>Memory levers</h2>" in text and "Gradient accumulation: 2 microbatches" in text
    assert cli.main(["explain", str(saved)]) == 0
    assert "Memory levers:\nGradient accumulation: 2 microbatches" in capsys.readouterr().out
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "1x8", "--accumulate", "0"])
    assert code == 2 and "'0' is not 'auto' or a positive number of microbatches" in capsys.readouterr().err


def test_a_count_no_faster_than_the_ceiling_ends_the_weighing():
    """`plan_accumulation(ceiling=)`: weighed against a plan found without accumulation, the first
    microbatch count that fits but is no faster than it ends the search (the composition weighs
    accumulation so); without a ceiling the next count is planned too."""
    from planner.core.mesh import MeshSpec
    from planner.core.options import PlanOptions
    from planner.graph.trace import trace
    from planner.levers.accumulate import plan_accumulation
    from planner.search.mesh_plan import make_plan

    b, state, batch = concrete("mlp-tall")
    mesh = MeshSpec((1,), ("x",))
    planned = []  # one microbatch step per count weighed

    def plan_micro(g, budget):
        planned.append(g)
        return g, make_plan(g, mesh, PlanOptions(hardware="cpu", memory_budget=budget))

    graph = trace(b.train_step, state, batch)
    free = plan_accumulation(b.train_step, graph, "auto", None, plan_micro, mesh, smallest=2)
    weighed = len(planned)
    planned.clear()
    capped = plan_accumulation(b.train_step, graph, "auto", None, plan_micro, mesh, smallest=2, ceiling=0.0)
    assert weighed >= 2 and len(planned) == 1
    assert capped.k == 2 and free.k >= 2
