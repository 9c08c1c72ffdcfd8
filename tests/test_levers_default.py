"""The levers on by default, composed in one search (planner/planning/composition.py): the plan of
the defaults is never predicted slower than any lever alone or a hand configuration that fits,
accumulation is weighed only for microbatch-invariant steps, the plan says what each lever bought,
and the decorator says in one line when only donation would make a plan fit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner.core.errors import InfeasiblePlanError
from planner.present.report import format_levers
from tests.helpers import assert_bundle_step_close, concrete

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_levers_default")

# One lever alone (the others off), as a user who knows one flag would plan.
ALONE = {
    "recomputation": dict(remat="auto", offload="off", accumulate=1),
    "host offload": dict(remat="off", offload="auto", accumulate=1),
    "gradient accumulation": dict(remat="off", offload="off", accumulate="auto"),
}
NONE = dict(remat="off", offload="off", accumulate=1)
# CP-SAT proves these small problems optimal, so two searches over the same space agree to the
# float64 rounding of the objective's sum (a relative 1e-9 is far above it, far below any real gap).
SAME = 1e-9


@pytest.fixture(scope="module")
def tight_budgets() -> dict:
    """`_tight_budget`'s answers, kept for the tests of this module that one process runs."""
    return {}


def _tight_budget(known: dict, name: str, b, state, batch, mesh: str) -> int:
    """A budget below what sharding alone can reach (95% of its proven lower bound) for zoo model
    `name` at the shapes of `state` and `batch`."""
    key = (name, mesh, tuple(x.shape for x in jax.tree.leaves((state, batch))))
    if key not in known:
        with pytest.raises(InfeasiblePlanError) as e:
            planner.plan(b.train_step, state, batch, mesh=mesh, memory_budget="1KB", **NONE)
        known[key] = int(0.95 * e.value.lower_bound_bytes)
    return known[key]


@pytest.mark.parametrize("name,shape", [("gpt-tiny", dict(layers=2, batch=16, seq=64)),
                                        ("llama-tiny", dict(batch=16, seq=64))])
def test_the_default_plan_is_never_slower_than_one_lever_alone(name, shape, devices8, tight_budgets):
    b, state, batch = concrete(name, **shape)
    budget = _tight_budget(tight_budgets, name, b, state, batch, "1x8")
    joint = planner.plan(b.train_step, state, batch, mesh="1x8", memory_budget=budget)
    assert joint.prediction.memory_bytes_per_device <= budget
    alone = {}
    for lever, flags in ALONE.items():
        try:
            alone[lever] = planner.plan(b.train_step, state, batch, mesh="1x8", memory_budget=budget, **flags)
        except InfeasiblePlanError:
            continue
    assert alone, "some lever alone fits this budget"
    for lever, plan in alone.items():
        assert joint.prediction.step_time_s <= plan.prediction.step_time_s * (1 + SAME), (lever, joint, plan)
    # the plan names what it uses and what that bought
    text = format_levers(joint)
    used = [k for k in ("remat", "offload", "accumulation") if getattr(joint.levers, k) is not None
            and (k != "remat" or joint.levers.remat.policy != "off")
            and (k != "accumulation" or joint.levers.accumulation.microbatches > 1)]
    assert used and "without it" in text


@pytest.mark.parametrize("baseline", ["dp", "fsdp"])
def test_the_default_plan_is_never_slower_than_a_fitting_hand_configuration(baseline, devices8):
    b, state, batch = concrete("gpt-tiny", layers=2, batch=16, seq=64)
    hand = planner.evaluate(b.train_step, state, batch, mesh="1x8", baseline=baseline)
    budget = hand.prediction.memory_bytes_per_device  # a budget the hand configuration meets
    joint = planner.plan(b.train_step, state, batch, mesh="1x8", memory_budget=budget)
    assert joint.prediction.step_time_s <= hand.prediction.step_time_s * (1 + SAME)


def test_the_default_plan_runs_as_the_unsharded_step(devices8, tight_budgets):
    """A plan the defaults made with a lever (here under a tight budget) computes the step."""
    b, state, batch = concrete("llama-tiny", batch=16, seq=64)
    budget = _tight_budget(tight_budgets, "llama-tiny", b, state, batch, "1x8")
    step = planner.plan_parallel(b.train_step, mesh="1x8", memory_budget=budget)
    plan = step.plan(state, batch)
    assert plan.levers.remat.policy != "off" or plan.levers.accumulation is not None or plan.levers.offload
    new_state, metrics = step(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def _sgd(loss, params):
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def _bn_step(params, x):
    """A step whose loss normalises with the batch's own statistics (BatchNorm in training mode):
    microbatches would compute another step."""
    def loss(w):
        h = jnp.tanh(x @ w[0])
        h = (h - h.mean(0)) / (h.std(0) + 1e-5)
        return jnp.mean((h @ w[1]) ** 2)

    return _sgd(loss, params)


def _mlp_step(params, x):
    def loss(w):
        return jnp.mean((jnp.tanh(x @ w[0]) @ w[1]) ** 2)

    return _sgd(loss, params)


def test_accumulation_is_weighed_by_default_only_for_microbatch_invariant_steps(devices8):
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(64, 512)), jnp.float32),
              jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)]
    x = jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)
    for step, invariant in ((_mlp_step, True), (_bn_step, False)):
        with pytest.raises(InfeasiblePlanError) as e:
            planner.plan(step, params, x, mesh="1x8", memory_budget="1KB", **NONE)
        budget = int(0.97 * e.value.lower_bound_bytes)
        if invariant:
            plan = planner.plan(step, params, x, mesh="1x8", memory_budget=budget)
            assert plan.levers.accumulation.microbatches > 1 and plan.levers.accumulation.without_fits is False
            assert plan.prediction.memory_bytes_per_device <= budget
        else:
            with pytest.raises(InfeasiblePlanError) as no:
                planner.plan(step, params, x, mesh="1x8", memory_budget=budget)
            assert "\n" not in str(no.value) and "gradient accumulation: accumulate='auto'" in str(no.value)


def test_the_decorator_says_when_only_donation_would_fit(devices8):
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(256, 256)), jnp.float32) for _ in range(2)]
    x = jnp.asarray(rng.normal(size=(8, 256)), jnp.float32)

    step = _mlp_step
    donated = planner.plan(step, params, x, mesh="1x8", donate_argnums=0, **NONE)
    kept = planner.plan(step, params, x, mesh="1x8", **NONE)
    assert donated.prediction.memory_bytes_per_device < kept.prediction.memory_bytes_per_device
    budget = (donated.prediction.memory_bytes_per_device + kept.prediction.memory_bytes_per_device) // 2
    with pytest.raises(InfeasiblePlanError) as e:
        # no other lever helps a step whose memory is its parameters and their new values
        planner.plan_parallel(step, mesh="1x8", memory_budget=budget, remat="off", offload="off",
                              accumulate=1).plan(params, x)
    assert "with the train state donated a plan fits" in str(e.value) and "\n" not in str(e.value)


def test_prefetch_is_weighed_on_the_chosen_mesh_and_kept_only_when_faster(devices8):
    """Prefetch (the default, `prefetch=None`) plans the chosen mesh again with parameter gathers
    issued ahead of their use; the plan keeps it only when that is faster, says so and what the plan
    without it took, and runs as the unsharded step. A GPT whose width (512) outweighs its batch
    (8 x 32 tokens) on an H100-priced 1x8 mesh: sharded weights gathered behind earlier compute beat
    replicated ones. Not weighed on XLA:CPU's preset (synchronous collectives) nor where the memory
    budget binds (the prefetched buffers are not in the memory model)."""
    b, state, batch = concrete("gpt-tiny", d_model=512, layers=2, batch=8, seq=32)
    off = planner.plan(b.train_step, state, batch, mesh="1x8", hardware="h100", prefetch=False)
    step = planner.plan_parallel(b.train_step, mesh="1x8", hardware="h100")
    plan = step.plan(state, batch)
    record = plan.levers.prefetch
    assert record is not None and plan.options.prefetch is True and off.levers.prefetch is None
    assert plan.prediction.step_time_s < off.prediction.step_time_s
    assert record.without_step_time_s == pytest.approx(off.prediction.step_time_s, rel=SAME)
    text = format_levers(plan)
    assert "Prefetch:" in text and "without it" in text
    assert planner.Plan.from_json(plan.to_json()) == plan
    new_state, metrics = step(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    on_cpu = planner.plan(b.train_step, state, batch, mesh="1x8", hardware="cpu")
    assert on_cpu.levers.prefetch is None and on_cpu.options.prefetch is None
    bound = planner.plan(b.train_step, state, batch, mesh="1x8", hardware="h100",
                         memory_budget=int(0.8 * off.prediction.memory_bytes_per_device), remat="off", accumulate=1)
    assert bound.solver.unbudgeted is not None and bound.levers.prefetch is None


def test_the_command_line_leaves_prefetch_to_the_planner_unless_told():
    """`--prefetch` alone (as before) or `--prefetch on` prices prefetch on every mesh, `off` never,
    no flag or `auto` leaves it weighed (`PlanOptions.prefetch` None)."""
    from planner.cli.args import build_parser
    from planner.cli.options import plan_options

    parser = build_parser()
    for flags, want in (([], None), (["--prefetch", "auto"], None), (["--prefetch"], True),
                        (["--prefetch", "on"], True), (["--prefetch", "off"], False)):
        args = parser.parse_args(["plan", "--model", "gpt-tiny", "--mesh", "2x4", *flags])
        assert plan_options(args, None).prefetch is want, flags
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--model", "gpt-tiny", "--prefetch", "sometimes"])
