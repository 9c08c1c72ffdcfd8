"""Inter-op building blocks: layer clustering, submeshes, the stage DP (against brute force), schedules."""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.graph.trace import trace
from tests.helpers import random_stage_table, tanh_chain_step
from zoo import get_model
from planner.stages.clustering import (
    APPLY,
    BACKWARD,
    FORWARD,
    balanced_cuts,
    cluster_by_flops,
    cluster_layers,
)
from planner.stages.dp import brute_force, bubble_fraction, pipeline_dp, pipeline_latency
from planner.stages.schedule import dispatch_order, peak_inflight, simulate, stage_tasks
from planner.stages.layer_facts import boundary_bytes, layer_facts, subgraph
from planner.stages.submesh import boundary_link, logical_meshes, make_cluster, place_submeshes, submesh_shapes

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_stages")


@pytest.fixture(scope="module")
def tiny_graphs():
    b = get_model("gpt-small-test")
    train = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    loss = trace(b.loss_fn, b.abstract_state()["params"], b.abstract_batch())
    return train, loss


# ----- clustering ---------------------------------------------------------------------------------
def test_module_layers_of_a_gpt(tiny_graphs):
    train, loss = tiny_graphs
    layers = cluster_layers(train)
    assert layers.method == "modules"
    assert layers.names == ("pre", "blocks_0", "blocks_1", "blocks_2", "blocks_3", "post")
    # The repeated blocks are identical (costed once); embedding and head are not.
    assert len(set(layers.keys[1:5])) == 1 and len(set(layers.keys)) == 3
    # Every op of a block's forward, backward and update belongs to that block.
    for op in train.ops:
        if "blocks_2" in op.name_stack:
            assert layers.op_layer[op.index] == 3
    # Parameters and their optimizer state belong to the layer that uses them.
    for path, layer in zip(train.input_paths, layers.input_layer):
        if "['blocks_1']" in path:
            assert layer == 2, path
        if "lm_head" in path or "ln_f" in path:
            assert layer == 5, path
        if "wte" in path:
            assert layer == 0, path
    # Forward ops run through the layers in order; the update comes after the gradient.
    fwd = [layers.op_layer[i] for i, p in enumerate(layers.op_phase) if p == FORWARD]
    assert fwd == sorted(fwd)
    phases = layers.op_phase
    assert phases.index(APPLY) > max(i for i, p in enumerate(phases) if p == BACKWARD)
    # The forward-only loss function clusters into the same layers (the runtime relies on it).
    assert cluster_layers(loss).names == layers.names


def test_balanced_cuts_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(3, 9))
        L = int(rng.integers(1, min(n, 4) + 1))
        flops = rng.uniform(0.5, 2.0, n)
        cuts = rng.uniform(0, 10, n + 1)
        delta = 0.5
        starts = balanced_cuts(flops, cuts, L, delta)
        cap = (1 + delta) * flops.sum() / L
        best = None
        for inner in itertools.combinations(range(1, n), L - 1):
            b = (0,) + inner + (n,)
            if all(flops[b[k]:b[k + 1]].sum() <= cap + 1e-9 for k in range(L)):
                c = sum(cuts[p] for p in inner)
                best = c if best is None else min(best, c)
        got = sum(cuts[p] for p in starts[1:])
        assert best is not None and math.isclose(got, best), (starts, best)
        bounds = list(starts) + [n]
        assert all(flops[bounds[k]:bounds[k + 1]].sum() <= cap + 1e-9 for k in range(L))


def test_flops_clustering_without_module_names():
    ws = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 6
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    layers = cluster_layers(graph, num_layers=3)
    assert layers.method == "flops" and layers.num_layers == 3
    facts = layer_facts(graph, layers)
    dots = [sum(graph.ops[i].name == "dot_general" for i in f.ops) for f in facts]
    # Two matmuls forward and four backward per layer (the first layer computes no input gradient).
    assert dots == [5, 6, 6]
    assert layers.input_layer[:6] == (0, 0, 1, 1, 2, 2)
    assert [len(f.apply_ops) for f in facts] == [4, 4, 4]
    with pytest.raises(InvalidArgumentError):
        balanced_cuts([1.0, 1.0], [0, 0, 0], 3)
    assert cluster_by_flops(graph, 1).num_layers == 1


def test_layer_subgraph_and_boundaries(tiny_graphs):
    train, _ = tiny_graphs
    layers = cluster_layers(train)
    facts = layer_facts(train, layers)
    block = facts[2]
    assert block.param_grads and all(train.tensors[p] == train.tensors[g] for p, g in block.param_grads)
    sub, ext = subgraph(train, block.ops, "b/", block.param_grads)
    assert len(sub.ops) == len(block.ops) + len(block.param_grads)
    assert set(sub.input_paths) >= {train.input_paths[train.inputs.index(p)] for p, _ in block.param_grads}
    cut = boundary_bytes(train, layers)
    act = 8 * 64 * 128 * 4  # one residual stream [batch, seq, d_model] in float32
    assert cut[1] == cut[2] == cut[3] == act
    assert cut[0] >= act


# ----- submeshes ----------------------------------------------------------------------------------
def test_submesh_shapes_and_placement():
    assert submesh_shapes(8, 8) == ((1, 1), (1, 2), (1, 4), (1, 8)) + tuple((n, 8) for n in range(2, 9))
    assert submesh_shapes(1, 6) == ((1, 1), (1, 2), (1, 4), (1, 6))
    # Many hosts: whole hosts, 2^k of them or a divisor of the host count (even stages; the whole
    # cluster last).
    assert submesh_shapes(24, 8) == tuple((n, 8) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24))
    assert submesh_shapes(128, 8) == tuple((2 ** k, 8) for k in range(8))
    assert (24, 8) in submesh_shapes(192, 8)  # Megatron-LM's 145.6B run: 8 stages of 24 hosts
    cluster = make_cluster(4, 4, "a100", inter_host_gbit=100)
    placed = place_submeshes([(1, 2), (2, 4), (1, 1), (1, 1), (1, 4)], cluster)
    assert placed[1] == tuple(range(0, 8))          # whole hosts first
    assert placed[4] == tuple(range(8, 12))         # then the biggest partial-host piece
    assert sorted(d for p in placed for d in p) == list(range(16))
    with pytest.raises(InfeasiblePlanError):
        place_submeshes([(1, 4), (1, 4)], cluster)
    meshes = logical_meshes((2, 4), cluster)
    assert [m.mesh.shape for m in meshes] == [(2, 4)] and meshes[0].host_axes == (0,)
    assert meshes[0].links[0].beta > meshes[0].links[1].beta  # the host axis is the slow one
    assert [m.mesh.shape for m in logical_meshes((1, 8), cluster, max_ndim=1)] == [(8,)]
    assert math.isclose(cluster.inter_link.bandwidth, 100e9 / 8 / 4)  # per-device share of the host link


# ----- the DP ---------------------------------------------------------------------------------------
def test_dp_matches_brute_force():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(150):
        L = int(rng.integers(1, 6))
        unit = int(rng.choice([1, 1, 8]))  # 8: whole-host submeshes (the DP works in units of their gcd)
        sizes = [unit * z for z in [1, 2, 4][: int(rng.integers(1, 4))]]
        D = unit * int(rng.choice([2, 4, 6, 8]))
        Q, B = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 5, 8, 32, 64]))  # large B: interval pruning
        min_stages = int(rng.integers(1, 3))
        t = random_stage_table(rng, L, sizes, Q)
        got = pipeline_dp(t, sizes, D, B, min_stages=min_stages)
        want = brute_force(t, sizes, D, B, min_stages=min_stages)
        assert (got is None) == (want is None)
        if got is not None:
            checked += 1
            assert math.isclose(got.objective_s, want[0], rel_tol=1e-9)
            assert got.stages[0].first == 0 and got.stages[-1].last == L - 1
            assert sum(sizes[s.submesh] for s in got.stages) == D
            assert math.isclose(pipeline_latency([s.time_s for s in got.stages], B), got.objective_s)
    assert checked > 50


def test_dp_with_a_memo_answers_every_microbatch_count_as_alone(monkeypatch):
    """The memo keeps each table's evaluated bounds and read-back pipelines (they do not depend on the
    microbatch count): the same table at another count gives exactly the DP without it, and at a
    count already asked solves nothing; another table shares nothing."""
    from planner.stages import dp

    solves = []
    real = dp._solve
    monkeypatch.setattr(dp, "_solve", lambda *a, **k: solves.append(1) or real(*a, **k))
    rng = np.random.default_rng(3)
    memo: dict = {}
    for _ in range(20):
        sizes, D = [1, 2, 4], int(rng.choice([4, 6, 8]))
        t = random_stage_table(rng, int(rng.integers(2, 7)), sizes, 2)
        for B in (64, 8, 2):
            got, alone = pipeline_dp(t, sizes, D, B, memo=memo), pipeline_dp(t, sizes, D, B)
            assert (got is None) == (alone is None)
            if alone is not None:
                assert (got.stages, got.objective_s, got.evaluations) == (alone.stages, alone.objective_s,
                                                                          alone.evaluations)
        solves.clear()
        again = pipeline_dp(t, sizes, D, 8, memo=memo)
        assert not solves and (again is None) == (alone is None)
    assert len(memo) == 20


def test_dp_gap_bound_and_pruning():
    rng = np.random.default_rng(2)
    for _ in range(30):
        t = random_stage_table(rng, 6, [1, 2, 4], 2)
        exact = pipeline_dp(t, [1, 2, 4], 8, 16)
        approx = pipeline_dp(t, [1, 2, 4], 8, 16, rel_gap=0.05)
        if exact is None:
            assert approx is None
            continue
        assert approx.objective_s <= exact.objective_s * (1 + 0.05) + 1e-12  # the documented bound: rel_gap x T
        # Pruning: far fewer bounds tried than distinct stage latencies.
        assert exact.evaluations < np.isfinite(t).sum()


def test_dp_memory_by_position():
    # Two layers, two single-device submeshes; the first stage holds 2 microbatches under 1F1B.
    # Layer range [0] fits only with one microbatch in flight, so layer 0 cannot go first alone...
    t = np.full((2, 2, 2, 1), np.inf)
    t[0, 0, 0, 0], t[0, 1, 1, 0], t[0, 0, 1, 0] = 1.0, 1.0, 2.5
    t[1, 1, 1, 0], t[1, 0, 1, 0] = 1.0, 2.5   # q=1 (2 in flight): [0] does not fit
    res = pipeline_dp(t, [1], 2, 4)
    assert res is None  # two stages need [0] first, which cannot hold 2 microbatches
    res = pipeline_dp(t, [1], 1, 4)
    assert [(s.first, s.last) for s in res.stages] == [(0, 1)]
    assert bubble_fraction([1.0, 1.0], 4) == pytest.approx(1 / 5)


# ----- schedules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,B", [(2, 2), (4, 8), (4, 2), (3, 5)])
def test_schedules(schedule, S, B):
    tasks = stage_tasks(schedule, S, B)
    assert all(sorted(t) == sorted([("F", i) for i in range(B)] + [("B", i) for i in range(B)]) for t in tasks)
    makespan, _ = simulate(tasks, [1.0] * S, [2.0] * S)
    assert makespan == pytest.approx((B + S - 1) * 3.0)  # the bubble (S-1)/(S+B-1) of both schedules
    inflight = [peak_inflight(t) for t in tasks]
    assert inflight == ([min(S - s, B) for s in range(S)] if schedule == "1f1b" else [B] * S)
    order = dispatch_order(tasks)
    seen = set()
    for s, kind, i in order:
        if kind == "F" and s > 0:
            assert (s - 1, "F", i) in seen
        if kind == "B":
            assert (s, "F", i) in seen and (s == S - 1 or (s + 1, "B", i) in seen)
        seen.add((s, kind, i))
    with pytest.raises(InvalidArgumentError):
        stage_tasks("interleaved", S, B)


def test_resharding_between_layers_of_one_stage_is_costed():
    """A value one layer makes in one layout and the next layer reads in another is resharded inside
    the stage, forward and (its gradient) backward: the stage's time per microbatch grows by twice
    the resharding time the intra-op ILP prices, and by nothing when the layouts agree."""
    from planner.ilp.strategies import reshard_cost
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.layer_facts import layer_edges
    from planner.stages.stage_cost import StageOption, stage_ranges

    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((2048, 256), jnp.float32))
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(1, 8, "a100")
    meshes = logical_meshes((1, 8), cluster, max_ndim=1)
    w0, w1, x = graph.inputs[:3]
    column, replicated = ((), (0,)), ((), ())  # layer 0 Megatron column split, layer 1 replicated
    # Both data parallel: the batch pinned split too (with weights alone pinned replicated, layer 0's
    # output is column- or row-split at the same price, a tie the layer's own ILP breaks either way:
    # jax 0.10 and 0.12 break it differently).
    for pins, resharded in ((lambda m: {w0: column, w1: replicated}, True),
                            (lambda m: {w0: replicated, w1: replicated, x: ((0,), ())}, False)):
        table = LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), pins=pins)
        (edge,) = [e for e in layer_edges(graph, layers, table.facts) if e[:1] == (0,) and e[2] == 1]
        l, key, c, j, t = edge
        src, dst = table.cost(0, 0).produced_specs[key], table.cost(1, 0).input_specs[j]
        assert (src != dst) == resharded
        expected = 2 * reshard_cost(graph.tensors[t], src, dst, meshes[0].cost_model(cluster.hardware))[1]
        assert (expected > 0) == resharded
        inner = table.inner(0)
        assert inner[0, 1] == pytest.approx(expected) and inner[0, 0] == inner[1, 1] == 0
        boundary = boundary_bytes(graph, layers)
        t_range, _, _ = stage_ranges(table, StageOption(0, "plan", False), 8, boundary, boundary_link(cluster))
        rows = (table.cost(0, 0), table.cost(1, 0))
        layer_sum = rows[0].time_s + rows[1].time_s
        # a parameter split over the other layer's data axis: the runtime reduces every microbatch
        split = bool((rows[0].param_axes | rows[1].param_axes) & (rows[0].data_axes | rows[1].data_axes))
        assert split == resharded  # the column split's axis is the data-parallel layer's batch axis
        assert t_range[0, 1] == pytest.approx(layer_sum + expected + (sum(r.sync_s for r in rows) if split else 0.0))


def test_scanned_weights_are_named_when_pipelining():
    """A scan's stacked weights cannot follow their layers to their stages: the pipeline plan says
    so (which leaves, and what to do), and an unrolled model gets no such note."""
    from planner.cost_model.cluster import Cluster
    from planner.graph.trace import trace
    from planner.core.options import PlanOptions
    from planner.stages.clustering import cluster_layers, stacked_inputs
    from planner.stages.inter_op import plan_pipeline
    from zoo import get_model

    for scan in (True, False):
        b = get_model("llama-tiny", batch=4, seq=8, d_model=32, mlp_dim=64, scan_layers=scan)
        args = (b.abstract_state(), b.abstract_batch())
        g = trace(b.train_step, *args)
        paths = [g.input_paths[i] for i in stacked_inputs(g, cluster_layers(g, None))]
        # the scanned model's per-layer weights, all of them (their moments are read whole by the update)
        assert paths == ([p for p in g.input_paths if p.startswith("[0]['params']['layers']")] if scan else [])
        assert not scan or len(paths) == 9
        pp = plan_pipeline(b.train_step, args, Cluster.parse("1x2:cpu"), PlanOptions(pipeline=True),
                           microbatch_limit=1)
        assert ("stacked over layers" in pp.summary()) == scan
        assert list(pp.planning.stacked_params or ()) == paths


def test_layer_tables_filled_in_parallel_equal_the_serial_ones():
    """`LayerCostTable.fill` with two threads gives every layer on every logical mesh exactly the
    cost the one-by-one fill gives (each ILP solved alone, deterministic limits)."""
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable, planned_layers

    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((2048, 256), jnp.float32))
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(2, 4, "a100")
    meshes = tuple(m for shape in ((1, 2), (1, 4), (2, 4)) for m in logical_meshes(shape, cluster, max_ndim=2))
    tables = []
    for threads in (1, 2):
        table = LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), {})
        table.fill(range(len(meshes)), threads=threads)
        assert table.solves == planned_layers(table.cache) > len(meshes)
        tables.append(table)
    costs = [[k for k in t.cache if isinstance(k, tuple)] for t in tables]  # the solves' records aside
    assert costs[0] == costs[1] and len(costs[0]) == tables[0].solves
    assert all(tables[0].cache[k] == tables[1].cache[k] for k in costs[0])
    solves = tables[1].solves
    assert [tables[1].cost(l, m) for l in range(2) for m in range(len(meshes))] and tables[1].solves == solves


def test_sharded_state_stages_list_their_parameter_gathers():
    """A stage in the sharded-state layout gathers each parameter it stores split over every axis,
    forward and backward (`LayerCost.zero_extra_s` prices them): the stage's collectives
    (`stage_cost.stage_collectives`, what a pipeline plan lists) carry those gathers beside its
    layers' planned collectives, each priced as `zero_extra_s` prices it; the "plan" layout lists
    the layers' collectives alone."""
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.stage_cost import StageOption, stage_collectives
    from planner.stages.submesh import effective_hardware

    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((2048, 256), jnp.float32))
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(2, 4, "a100")
    meshes = logical_meshes((1, 4), cluster, max_ndim=2)
    table = LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), {})
    sharded, planned = StageOption(0, "sharded-state", False), StageOption(0, "plan", False)
    gathers = [c for c in stage_collectives(table, 0, 1, sharded) if c.reason == "sharded state"]
    assert gathers and all(c.kind == "all-gather" and c.group_size > 1 for c in gathers)
    assert [c for c in stage_collectives(table, 0, 1, sharded) if c.reason != "sharded state"] == \
        list(stage_collectives(table, 0, 1, planned))
    cost = meshes[0].cost_model(effective_hardware(cluster))
    names = list(meshes[0].mesh.axis_names)
    for layer in range(2):
        lc = table.cost(layer, 0)
        priced = sum(cost.collective_time(c.kind, c.nbytes, tuple(names.index(a) for a in c.axes))
                     for c in lc.zero_collectives)
        assert priced == pytest.approx(lc.zero_extra_s, rel=1e-12)
        wheres = [c.where for c in lc.zero_collectives]
        assert all(wheres.count(w) == 2 for w in wheres)  # forward and backward


def test_sharded_state_stages_reduce_gradients_every_microbatch():
    """In the sharded-state layout a stage's parameters are split over its data axes too, so the
    pipeline runtime reduces their gradients every microbatch (`stage_records.set_replicas`):
    the stage tables price that reduction in the stage time per microbatch and not once per step;
    the "plan" layout keeps it once per step unless a layer's plan splits a parameter over a data
    axis of the stage, where the runtime reduces every microbatch too (`stage_columns.split_ranges`)."""
    from planner.core.options import PlanOptions
    from planner.stages.candidate import once_per_step as _once_per_step
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.stage_columns import layer_columns
    from planner.stages.stage_cost import StageOption, stage_ranges

    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((2048, 256), jnp.float32))
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(2, 4, "a100")
    table = LayerCostTable(graph, layers, logical_meshes((1, 4), cluster, max_ndim=2), cluster, PlanOptions(), {})
    sharded, planned = StageOption(0, "sharded-state", False), StageOption(0, "plan", False)
    rows = [table.cost(l, 0) for l in range(2)]
    assert any(r.data_axes and r.sync_s > 0 for r in rows)  # a data-parallel layer: its gradient reduction
    split = bool(frozenset().union(*(r.param_axes for r in rows)) & frozenset().union(*(r.data_axes for r in rows)))
    for option in (sharded, planned):
        time = layer_columns(table, option)["time"]
        every = [option is sharded and bool(r.data_axes) and r.sync_s > 0 for r in rows]
        for l, r in enumerate(rows):
            gathers = r.zero_extra_s if option is sharded else 0.0
            assert time[l] == pytest.approx(r.time_s + gathers + (r.sync_s if every[l] else 0.0), rel=1e-12)
        once = _once_per_step(table, option, 0, 1)[0]
        kept = 0.0 if split else sum(r.sync_s for r, e in zip(rows, every) if not e)
        assert once == pytest.approx(kept, abs=1e-15)
        assert (once < sum(r.sync_s for r in rows)) == (option is sharded or split)
        moved = _once_per_step(table, option, 0, 0)[0] + _once_per_step(table, option, 1, 1)[0] - once
        t, _, _ = stage_ranges(table, option, 4, np.zeros(2), boundary_link(cluster))
        assert t[0, 1] - t[0, 0] - t[1, 1] == pytest.approx(table.inner(0)[0, 1] + (moved if split else 0.0),
                                                          rel=1e-9, abs=1e-15)


def test_int8_gradient_exchange_is_quantised_once_per_step():
    """A data-parallel layer on 4 hosts at 1 Gbit/s: under "int8" its gradient exchange is int8
    (less to send once per step than under "exact"), and the quantisation moves with it to the
    once-per-step sync (the runtime quantises each replica's accumulated gradient once,
    `emit.wire.reduce_replicas`): the layer's time per microbatch equals the exact plan's, whose
    microbatch does the same work."""
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable

    ws = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((2048, 256), jnp.float32))
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(4, 1, "v100", inter_host_gbit=1)
    meshes = logical_meshes((4, 1), cluster, max_ndim=1)
    costs = {p: LayerCostTable(graph, layers, meshes, cluster, PlanOptions(comm_precision=p), {}).cost(1, 0)
             for p in ("exact", "int8")}
    assert costs["int8"].input_specs == costs["exact"].input_specs and costs["int8"].data_axes == {"x"}
    assert costs["int8"].sync_s < costs["exact"].sync_s / 2
    assert costs["int8"].time_s == pytest.approx(costs["exact"].time_s, rel=1e-9)


def test_a_layer_is_planned_for_the_steps_microbatches():
    """A GPT block shaped as Megatron-LM's 145.6B row (hidden 12288) in its Megatron layout on a
    24-host x 8 A100 stage mesh, under float32 partial sums (the exact default): planned for one
    microbatch, its ILP trades the gradient reduction (paid once per step in a pipeline) for
    per-microbatch collectives over the data axis; planned for the step's 16 microbatches
    (`LayerCostTable(microbatches=16)`), it keeps the reduction and the step costs no more than the
    one-microbatch plan's, up to the layer ILP's relative gap."""
    from planner.configs.baselines import layer_variant_pins
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.layer_cost import LAYER_GAP

    B = 16
    b = get_model("gpt3-1.3b", batch=24, seq=2048, vocab=51200, d_model=12288, heads=96, layers=2, dtype="bfloat16")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(24, 8, "a100-80gb")
    meshes = tuple(m for m in logical_meshes((24, 8), cluster, max_ndim=2) if m.mesh.shape == (24, 8))
    pins = layer_variant_pins("megatron-tp")
    block = layers.names.index("blocks_0")
    cost = {k: LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), pins=lambda m: pins(graph, m),
                              microbatches=k).cost(block, 0) for k in (1, B)}
    data = meshes[0].mesh.axis_names[0]

    def per_microbatch_over_data(c):
        return [x for x in c.collectives if data in x.axes and x.reason != "partial sum"]

    assert cost[1].data_axes == cost[B].data_axes == {data}
    assert per_microbatch_over_data(cost[1])  # the one-microbatch optimum's trade
    assert not per_microbatch_over_data(cost[B])
    step = {k: B * c.time_s + c.sync_s for k, c in cost.items()}
    assert step[B] <= step[1] * (1 + LAYER_GAP)


def test_a_layer_whose_step_plan_splits_a_parameter_over_a_data_axis_keeps_the_cheaper_plan():
    """The embedding layer of a GPT shaped as Megatron-LM's 3.6B row (hidden 3072) in its Megatron
    layout on 8 hosts x 8 A100s seen as (data 32, tensor 2): weighing its gradient reductions at
    1/16, its ILP splits a parameter over a data axis, where the runtime reduces it every
    microbatch; so the layer is planned for one microbatch too and the step pays no more than that
    plan's, up to the layer ILP's relative gap."""
    from planner.configs.baselines import layer_variant_pins
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.layer_cost import LAYER_GAP
    from planner.stages.submesh import tensor_parallel_mesh

    B = 16
    b = get_model("gpt3-1.3b", batch=32, seq=2048, vocab=51200, d_model=3072, heads=32, layers=2, dtype="bfloat16")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph, num_layers=2)
    cluster = make_cluster(8, 8, "a100-80gb")
    meshes = (tensor_parallel_mesh((8, 8), cluster, 2),)
    pins = layer_variant_pins("megatron-tp")
    pre = layers.names.index("pre")
    cost = {k: LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), pins=lambda m: pins(graph, m),
                              microbatches=k).cost(pre, 0) for k in (1, B)}
    step = {k: B * c.time_s + c.sync_s for k, c in cost.items()}
    assert step[B] <= step[1] * (1 + LAYER_GAP)


def test_a_layer_whose_step_plan_is_weighed_below_its_price_keeps_the_cheaper_plan():
    """A Llama-2-70B-shaped block (hidden 8192) in its Megatron layout on 8 hosts x 8 H100s, 16-row
    microbatches of a 128-microbatch step: weighing every combinable all-reduce at 1/128, its ILP
    split the sequence over the tensor axis and all-reduced weight-gradient partial sums over it,
    which the runtime pays every microbatch (0.01986 s per microbatch against 0.0173 s planned for
    one microbatch); with the tensor axis kept whole its plan is still priced above what its solve
    weighed (0.01806 s: the price lets the deferred reductions hide first). So the layer is planned
    for one microbatch too and the step pays no more than that plan's, up to the layer ILP's
    relative gap."""
    from planner.configs.baselines import layer_variant_pins
    from planner.core.options import PlanOptions
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.layer_cost import LAYER_GAP

    B = 128
    b = get_model("llama-70b", batch=16, seq=4096, layers=2, scan_layers=False, dtype="bfloat16")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph)
    cluster = make_cluster(8, 8, "h100")
    meshes = tuple(m for m in logical_meshes((8, 8), cluster, max_ndim=2) if m.mesh.shape == (8, 8))
    pins = layer_variant_pins("megatron-tp")
    block = next(i for i, n in enumerate(layers.names) if n not in ("pre", "post"))
    cost = {k: LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), pins=lambda m: pins(graph, m),
                              microbatches=k).cost(block, 0) for k in (1, B)}
    step = {k: B * c.time_s + c.sync_s for k, c in cost.items()}
    assert step[B] <= step[1] * (1 + LAYER_GAP), step


def test_sharded_optimizer_stages_keep_a_shard_of_the_optimizer_state():
    """The sharded-optimizer state layout (`layer_cost.optimizer_layout`): gpt-tiny's data-parallel
    blocks on a 2x2 logical mesh hold less state (their AdamW moments split over the data axes),
    take as long per microbatch as in the plan layout, exchange their gradients once per step in a
    reduce-scatter and an all-gather (on the cost model's ring the bytes of the all-reduce, one
    latency more: rel 1e-3) and update on the shards; a stage holding the embedding (its plan
    splits a parameter over a data axis: the runtime reduces every microbatch) does not run so;
    and where the budget sits between the two layouts' memory the stage table takes this one."""
    from planner.core.options import PlanOptions
    from planner.stages.candidate import once_per_step as _once_per_step
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.stage_cost import StageOption, stage_ranges, stage_times
    from zoo import get_model

    b = get_model("gpt-tiny", layers=2, batch=64)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph)
    cluster = make_cluster(2, 4, "a100")
    table = LayerCostTable(graph, layers, logical_meshes((1, 4), cluster, max_ndim=2), cluster, PlanOptions(), {})
    L = layers.num_layers
    rows = [table.cost(l, 0) for l in range(L)]
    dp = [l for l, r in enumerate(rows) if r.data_axes and not r.param_axes & r.data_axes]
    assert dp == list(range(1, L)), [(r.data_axes, r.param_axes) for r in rows]
    for l, r in enumerate(rows):
        if l in dp:
            assert r.opt_state_bytes < r.state_bytes and r.opt_apply_s < r.apply_s
            assert r.opt_sync_s == pytest.approx(r.sync_s, rel=1e-3)
        else:
            assert (r.opt_state_bytes, r.opt_apply_s) == (r.state_bytes, r.apply_s)
    planned, sharded = StageOption(0, "plan", False), StageOption(0, "sharded-optimizer", False)
    link, boundary = boundary_link(cluster), np.zeros(L)
    t_plan, fixed_plan, per_plan = stage_ranges(table, planned, 4, boundary, link)
    t_opt, fixed_opt, per_opt = stage_ranges(table, sharded, 4, boundary, link)
    first, last = 1, L - 1
    assert t_opt[first, last] == t_plan[first, last] and per_opt[first, last] == per_plan[first, last]
    saved = sum(rows[l].state_bytes - rows[l].opt_state_bytes for l in range(first, last + 1))
    assert fixed_plan[first, last] - fixed_opt[first, last] == pytest.approx(saved, rel=1e-12)
    assert np.isinf(t_opt[0, last]) and np.isfinite(t_plan[0, last])  # the embedding's stage
    once, once_plan = _once_per_step(table, sharded, first, last), _once_per_step(table, planned, first, last)
    assert once == (sum(rows[l].opt_sync_s for l in range(first, last + 1)),
                    sum(rows[l].opt_apply_s for l in range(first, last + 1)))
    assert once[1] < once_plan[1]
    budget = fixed_opt[first, last] + per_opt[first, last] + saved / 2  # one microbatch in flight
    st = stage_times(table, [(1, 4)], [[0]], 1, "gpipe", budget, boundary, variants=("",))
    chosen = st.options[0][int(st.option[0, first, last, 0])]
    assert (chosen.layout, chosen.remat) == ("sharded-optimizer", False)
    assert st.times[0, first, last, 0] == t_plan[first, last]


def test_offloaded_optimizer_stages_hold_the_optimizer_state_only_during_the_update():
    """The offloaded-optimizer layout: gpt-tiny's data-parallel blocks on 2x2 hold their
    parameters and gradients on the devices through the microbatches and the optimizer state
    (split as the sharded-optimizer layout splits it) only during the update, when no activations
    are live, one parameter's at a time (`stage_cost.update_peak`); once per step it crosses the host link both ways
    (`Hardware.host_bandwidth`, PCIe 4 on the A100 preset). Where the budget sits below the
    sharded-optimizer layout's need but above both phases of this one, the stage table takes it;
    with offload="off" or on hardware without a known host link it is not offered."""
    import dataclasses

    from planner.core.options import PlanOptions
    from planner.stages.candidate import once_per_step as _once_per_step
    from planner.stages.cost_table import LayerCostTable
    from planner.stages.stage_cost import StageOption, offload_layouts, stage_ranges, stage_times, update_peak
    from zoo import get_model

    b = get_model("gpt-tiny", layers=2, batch=64)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph)
    cluster = make_cluster(2, 4, "a100")
    table = LayerCostTable(graph, layers, logical_meshes((1, 4), cluster, max_ndim=2), cluster, PlanOptions(), {})
    L, first = layers.num_layers, 1
    last = L - 1
    rows = [table.cost(l, 0) for l in range(L)]
    link, boundary = boundary_link(cluster), np.zeros(L)
    sharded, offloaded = StageOption(0, "sharded-optimizer", False), StageOption(0, "offloaded-optimizer", False)
    t_s, fixed_s, per_s = stage_ranges(table, sharded, 4, boundary, link)
    t_o, fixed_o, per_o = stage_ranges(table, offloaded, 4, boundary, link)
    hosted = sum(rows[l].opt_host_bytes for l in range(first, last + 1))
    assert hosted > 0 and t_o[first, last] == t_s[first, last] and per_o[first, last] == per_s[first, last]
    assert fixed_s[first, last] - fixed_o[first, last] == pytest.approx(hosted, rel=1e-12)
    peak = update_peak(table, offloaded)[first, last]
    # the update streams one parameter's state at a time (copied in, its new value going out)
    largest = max(rows[l].opt_host_leaf_bytes for l in range(first, last + 1))
    assert 0 < largest < hosted / 2
    assert peak == pytest.approx(sum(rows[l].opt_state_bytes - rows[l].opt_host_bytes for l in range(first, last + 1))
                                 + 2 * largest, rel=1e-12)
    assert peak < sum(rows[l].opt_state_bytes for l in range(first, last + 1))
    assert not update_peak(table, sharded).any()
    host = cluster.hardware.host_bandwidth
    once_s, once_o = _once_per_step(table, sharded, first, last), _once_per_step(table, offloaded, first, last)
    assert once_o[0] == pytest.approx(once_s[0] + 2 * hosted / host, rel=1e-12) and once_o[1] == once_s[1]
    need_s = fixed_s[first, last] + per_s[first, last]
    budget = max(fixed_o[first, last] + per_o[first, last], peak) + 1.0
    assert budget < need_s
    st = stage_times(table, [(1, 4)], [[0]], 1, "gpipe", budget, boundary, variants=("",))
    chosen = st.options[0][int(st.option[0, first, last, 0])]
    assert (chosen.layout, chosen.remat) == ("offloaded-optimizer", False)
    # the stage table weighs each way with its once-per-step term as the chosen stage is priced
    from planner.stages.stage_cost import LAYOUTS, once_per_step_ranges
    for layout in LAYOUTS:
        opt = StageOption(0, layout, False)
        ranges = once_per_step_ranges(table, opt)
        for k in range(L):
            for i in range(k, L):
                assert ranges[k, i] == pytest.approx(sum(_once_per_step(table, opt, k, i)), rel=1e-12, abs=1e-18)
    off = dataclasses.replace(table, options=PlanOptions(offload="off"))
    assert "offloaded-optimizer" not in offload_layouts(off, ("plan", "offloaded-optimizer"))
    unknown = dataclasses.replace(table, cluster=dataclasses.replace(
        cluster, hardware=dataclasses.replace(cluster.hardware, host_bandwidth=None)))
    assert "offloaded-optimizer" not in offload_layouts(unknown, ("plan", "offloaded-optimizer"))
