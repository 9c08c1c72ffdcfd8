"""Pins: argument shardings fixed by the user, the rest planned (planner/configs/pins.py, ILP restriction)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner.graph.trace import trace
from planner.ilp.problem import build_problem
from planner.core.mesh import parse_mesh
from planner.core.options import PlanOptions
from planner.configs.pins import matches, parse_spec_text, resolve
from planner.search.mesh_plan import cost_model_for
from tests.helpers import assert_bundle_step_close, concrete
from zoo import get_model

MU = "[0]['opt_state'][0].mu['wte']['embedding']"
PARAM = "[0]['params']['wte']['embedding']"


def test_spec_text_as_tables_print_it():
    assert parse_spec_text("P((x,y), None)") == P(("x", "y"), None)
    assert parse_spec_text("P(x, None, 'y')") == P("x", None, "y")
    assert parse_spec_text("P()") == P()
    for bad in ("P(x", "Q(x)", "P((x,(y)))", "P(x,,y)"):
        with pytest.raises(planner.InvalidArgumentError, match="not of the form"):
            parse_spec_text(bad)


def test_patterns_match_paths_as_tables_print_them():
    assert matches("wte/embedding", PARAM) and matches("wte/embedding", MU)
    assert matches("params/wte/embedding", PARAM) and not matches("params/wte/embedding", MU)
    assert matches("opt_state/mu/*", MU) and matches("0/params/*", PARAM) and not matches("1/*", PARAM)
    assert not matches("te/embedding", PARAM)  # whole path components only


def test_first_matches_picks_the_first_pattern_matches_accepts():
    """`resolve` looks wildcard-free patterns up instead of globbing each against each leaf
    (`first_matches`); per leaf it picks the first pattern `matches` accepts, for literal, escaped
    and glob patterns mixed in any order."""
    import random

    from planner.configs.pins import exact_pattern, first_matches
    b = get_model("gpt-tiny")
    paths = trace(b.train_step, b.abstract_state(), b.abstract_batch()).input_paths
    patterns = ["wte/embedding", "mu/*", "blocks_0/*/kernel", exact_pattern(PARAM), "params/wte/embedding",
                "/blocks_1/ln_1/scale/", "bl?cks_0/ln_1/scale", "0/params/wpe/embedding", "[ab]c",
                "wte/emb[*]dding", "nope"]
    rng = random.Random(0)
    for _ in range(100):
        order = rng.sample(patterns, len(patterns))
        expected = [next((k for k, p in enumerate(order) if matches(p, path)), None) for path in paths]
        assert first_matches(order, paths) == expected
    assert len(paths) > 20


def _mlp():
    b = get_model("mlp-tiny")
    return b, b.abstract_state(), b.abstract_batch()


@pytest.mark.parametrize("pins, message", [
    ({"nothing/here": P()}, r"pin 'nothing/here' matches no argument path"),
    ({"dense_0/kernel": P(None, "model")}, r"dense_0/kernel \(shape \(32, 64\)\): spec P\(None, model\) names mesh axis 'model'"),
    ({"params/dense_0/kernel": P(None, ("x", "y"), None)}, r"has 3 entries but the leaf has rank 2"),
    ({"1/x": P(None, "y")}, None),
])
def test_bad_pins_are_one_line_errors(pins, message):
    b, state, batch = _mlp()
    if message is None:  # x is [64, 32]: y (4) divides 32; make one that does not
        b = get_model("mlp-tiny", in_dim=30)
        state, batch = b.abstract_state(), b.abstract_batch()
        message = r"pin '1/x' on x \(shape \(64, 30\)\): spec P\(None, y\) splits dim 1 of size 30 over 4 devices"
    with pytest.raises(planner.InvalidArgumentError, match=message) as e:
        planner.plan(b.train_step, state, batch, mesh="2x4", pins=pins)
    assert "\n" not in str(e.value)


def test_pin_needs_a_mesh():
    b, state, batch = _mlp()
    with pytest.raises(planner.InvalidArgumentError, match="pins need a mesh"):
        planner.plan(b.train_step, state, batch, pins={"dense_0/kernel": P()})


def test_plan_honours_pins_and_plans_the_rest(devices8):
    b, state, batch = concrete("mlp-tiny")
    free = planner.plan(b.train_step, state, batch, mesh="2x4")
    paths = list(free.input_paths)
    k0 = paths.index("[0]['params']['dense_0']['kernel']")
    assert free.input_specs[k0] != ((0,), ())  # the pin below is not what the planner picks anyway
    step = planner.plan_parallel(b.train_step, mesh="2x4", pins={"dense_0/kernel": "P(x, None)"})
    plan = step.plan(state, batch)
    for i, p in enumerate(paths):
        if p.endswith("['dense_0']['kernel']"):  # the parameter and its Adam moments
            assert plan.input_specs[i] == ((0,), ()), p
    assert plan.solver.pinned_inputs == 3
    assert plan.prediction.step_time_s >= free.prediction.step_time_s
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_pin_on_one_layer_is_neither_lost_nor_spread_across_shared_layers():
    """Layer sharing merges blocks_0 and blocks_1; a pin on blocks_0 alone leaves blocks_1 free."""
    b = get_model("gpt-tiny")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    mesh, _ = parse_mesh("2x4")
    cost = cost_model_for(mesh, PlanOptions())
    shapes = [graph.tensors[t].shape for t in graph.inputs]

    def nodes_of(pins):
        pinned = resolve(pins, graph.input_paths, shapes, mesh)
        problem = build_problem(graph, cost, pins={graph.inputs[i]: s for i, s in pinned.items()})
        out = {}
        for layer in (0, 1):
            i = graph.input_paths.index(f"[0]['params']['blocks_{layer}']['mlp']['fc_in']['kernel']")
            n = problem.owner[graph.inputs[i]]
            out[layer] = (problem.nodes[n].size, problem.rep[n], problem.nodes[n].owned[graph.inputs[i]])
        return out

    one = nodes_of({"params/blocks_0/mlp/fc_in/kernel": P(None, "y")})
    assert one[0][0] == 1 and one[0][2] == [((), (1,))]
    assert one[1][0] > 1 and one[1][1] != one[0][1]  # blocks_1 keeps its own, unpinned decision
    both = resolve({"params/blocks_*/mlp/fc_in/kernel": P(None, "y")}, graph.input_paths, shapes, mesh)
    assert sorted(graph.input_paths[i] for i in both) == [
        f"[0]['params']['blocks_{i}']['mlp']['fc_in']['kernel']" for i in (0, 1)]


def test_rules_pin_an_nnx_models_sharding_annotations(devices8):
    from flax import nnx

    from tests.helpers import assert_sgd_step_close

    class Annotated(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    with nnx.use_eager_sharding(False):  # annotations only; the planner places the arrays
        graphdef, params = nnx.split(Annotated(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (16, 32))

    def loss_fn(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

    def step(params, x):
        loss, g = jax.value_and_grad(loss_fn)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    rules = [("embed", None), ("mlp", "y")]
    planned = planner.plan_parallel(step, mesh="2x4", rules=rules)  # names read off the nnx.State itself
    plan = planned.plan(params, x)
    spec = {p.removesuffix(".value"): s for p, s in zip(plan.input_paths, plan.input_specs)}
    assert spec["[0]['up']['kernel']"] == ((), (1,)) and spec["[0]['down']['kernel']"] == ((1,), ())
    assert spec["[0]['up']['bias']"] == ((),)  # not annotated: P(), as nnx.get_partition_spec says
    same = planner.plan(step, params, x, mesh="2x4", rules=rules, logical=(nnx.get_partition_spec(params), None))
    assert same.input_specs == plan.input_specs
    new_params, loss = planned(params, x)
    assert_sgd_step_close(loss_fn, 0.1, params, x, new_params)
