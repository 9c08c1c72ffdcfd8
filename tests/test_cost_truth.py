"""Step times you can trust (issue 11): one number for the ILP objective and the prediction, the
profiled hardware named and used, a kernel launch floor, mixed precision, link speeds as given."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ortools.sat.python import cp_model

import planner
from planner import cli
from planner.cost_model import (
    PRESETS,
    AxisLink,
    CostModel,
    ProfileDB,
    get_hardware,
    hardware_with_links,
    profiled_hardware,
)
from planner.cost_model.collectives import ring_bytes, ring_steps
from planner.core.errors import InvalidArgumentError
from planner.graph.trace import trace
from planner.ilp.problem import build_problem
from planner.ilp.solver import _NS, _Model, plan_cost
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.search.mesh_plan import cost_model_for, make_plan
from planner.core.units import parse_bandwidth, parse_duration, parse_link
from tests.helpers import TALL, assert_bundle_step_close, concrete
from zoo import get_config, get_model, model_names

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))
MESH_8 = MeshSpec((8,), ("x",))


def _graph(name, **overrides):
    b = get_model(name, **overrides)
    return trace(b.train_step, b.abstract_state(), b.abstract_batch())


def _cp_sat_optimum(problem):
    """CP-SAT's own optimum of the planner's model of `problem`: (objective in seconds, the choice,
    the rounding tolerance: each objective term is rounded to one 10 ps tick)."""
    model = _Model(problem)
    model.m.Minimize(model.objective)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 20
    assert solver.Solve(model.m) == cp_model.OPTIMAL
    choice = [next(i for i, v in enumerate(vs) if isinstance(v, int) or solver.BooleanValue(v)) for vs in model.x]
    return solver.ObjectiveValue() / _NS, choice, (len(model.terms) + 1) / _NS


# --- 1. one number ---------------------------------------------------------------------------


def test_solver_objective_progress_line_and_prediction_are_one_number():
    """mlp-tiny on 2x4: the bias gradients are follower reductions of nodes that are not themselves
    combinable (the case that made gpt-tiny's solver line 15x below its mesh line). CP-SAT's own
    objective value, `Solution.objective_s` (the progress line) and the plan's prediction agree."""
    graph = _graph("mlp-tiny")
    options = PlanOptions(solver_time_limit=20)
    plan = make_plan(graph, MESH_2x4, options)
    p = plan.prediction
    assert plan.solver["objective_s"] == pytest.approx(p.step_time_s, rel=1e-12)
    assert p.step_time_s == pytest.approx(p.compute_time_s + p.communication_time_s, rel=1e-12)

    problem = build_problem(graph, cost_model_for(MESH_2x4, options))
    objective, choice, rounding = _cp_sat_optimum(problem)
    assert objective == pytest.approx(plan_cost(problem, choice), abs=rounding)
    assert objective == pytest.approx(p.step_time_s, abs=rounding)  # same optimum


def test_combined_gradient_reductions_pay_one_latency():
    """Batch >> hidden MLP on 8 devices: pure data parallelism, every gradient all-reduced and
    combined by XLA: the prediction is the ring bandwidth of each gradient plus one ring latency,
    by hand from the preset's link figures."""
    graph = _graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    plan = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, overlap=False))
    hw = get_hardware(None)
    reduces = [c for c in plan.prediction.collectives if c.kind == "all-reduce"]
    params = {t.nbytes for t in (graph.tensors[i] for i in graph.inputs)}
    assert reduces and all(c.nbytes in params for c in reduces)  # gradients only: data parallel
    assert not [c for c in plan.prediction.collectives if c.kind != "all-reduce"]
    hand = (sum(ring_bytes("all-reduce", c.nbytes, 8) for c in reduces) / hw.intra_bandwidth
            + ring_steps("all-reduce", 8) * hw.intra_latency)
    assert plan.prediction.communication_time_s == pytest.approx(hand, rel=1e-9)
    assert CostModel.default(MESH_8).collective_latency("all-reduce", (0,)) == pytest.approx(14 * hw.intra_latency)


# --- the profiled devices name the plan, its budget and its MFU ------------------------------------


def _profile(**kw) -> ProfileDB:
    db = ProfileDB.synthetic(MESH_2x4, (AxisLink(10e-6, 1 / 3e9), AxisLink(10e-6, 1 / 3e9)), device_kind="cpu",
                             sizes=(1024, 65536), matmul_flops={"float32": 3e10, "bfloat16": 3e10},
                             memory_bandwidth=5e9)
    return dataclasses.replace(db, **kw)


def test_profiled_hardware_comes_from_the_profile():
    hw = profiled_hardware(_profile(kernel_launch_s=7e-6, device_memory_bytes=2e9))
    assert hw.name == "cpu" and hw.flops_f32 == 3e10 and hw.memory_bandwidth == 5e9
    assert hw.memory_bytes == 2e9 and hw.kernel_launch_s == 7e-6
    cm = CostModel.from_profile(MESH_2x4, _profile(kernel_launch_s=7e-6), device_kind="cpu")
    assert cm.hardware.kernel_launch_s == 7e-6  # the measured launch floor is read and used
    assert cm.compute_time(1.0, 1.0, (np.dtype(np.float32),), kernels=1) == 7e-6
    # without a measured figure: the preset of the device kind; no preset: its kind as the name
    assert profiled_hardware(_profile()).memory_bytes == PRESETS["cpu"].memory_bytes
    assert profiled_hardware(_profile(device_kind="Imaginary X1")).name == "imaginary x1"
    # the host link: measured where the profile has it (GPU), else the preset's figure
    assert profiled_hardware(_profile(host_bandwidth=4e10)).host_bandwidth == 4e10
    assert profiled_hardware(_profile()).host_bandwidth == PRESETS["cpu"].host_bandwidth


def test_cli_plans_for_the_profiled_devices(tmp_path, capsys):
    path = tmp_path / "prof.json"
    _profile(device_memory_bytes=2e9).save(path)
    out_json = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "2x4", "--profile", str(path), "--quiet",
                     "--time-limit", "10", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(cpu)" in out and "a100" not in out
    assert "of 2.00 GB budget" in out
    data = json.loads(out_json.read_text())
    assert data["context"]["hardware"]["name"] == "cpu" and data["context"]["hardware"]["flops_f32"] == 3e10


# --- 2. the launch floor -----------------------------------------------------------------------


def test_gpu_presets_carry_a_launch_floor_and_tiny_dots_pay_it():
    for name in ("h100-sxm", "a100-80gb", "v100-16gb"):
        assert 1e-6 <= PRESETS[name].kernel_launch_s <= 1e-5
    graph = trace(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8)))
    plan = make_plan(graph, MeshSpec((1,), ("x",)), PlanOptions(hardware="h100"))
    tie_break = sum(1e-13 * graph.tensors[t].nbytes for t in graph.inputs)
    assert plan.prediction.compute_time_s == pytest.approx(PRESETS["h100-sxm"].kernel_launch_s + tie_break)


# --- 3. mixed precision ------------------------------------------------------------------------


def test_every_zoo_model_takes_a_dtype():
    for name in model_names():
        for dtype in ("float32", "bfloat16", "float16"):
            assert get_config(name, dtype=dtype).dtype == dtype
    with pytest.raises(ValueError):
        get_config("gpt-tiny", dtype="int8")


def test_bf16_trace_has_2_byte_activations_and_4_byte_state():
    b = get_model("gpt-tiny", dtype="bfloat16")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    floats = [graph.tensors[t] for t, path in zip(graph.inputs, graph.input_paths) if "opt_state" in path
              or "params" in path]
    floats = [t for t in floats if jnp.issubdtype(t.dtype, jnp.floating)]
    assert floats and all(t.dtype == jnp.float32 for t in floats)  # master params and Adam moments
    dots = [op for op in graph.ops if op.name == "dot_general"]
    operand_types = [graph.tensors[x].dtype for op in dots for x in op.inputs if isinstance(x, int)]
    assert sum(d == jnp.bfloat16 for d in operand_types) >= 0.9 * len(operand_types)
    f32 = trace(*(lambda m: (m.train_step, m.abstract_state(), m.abstract_batch()))(get_model("gpt-tiny")))

    def dot_result_bytes(g):
        return sum(g.tensors[op.outputs[0]].nbytes for op in g.ops if op.name == "dot_general")

    assert dot_result_bytes(graph) == pytest.approx(0.5 * dot_result_bytes(f32), rel=0.1)  # 2-byte activations


def test_cli_dtype_defaults_to_what_the_hardware_trains_in(tmp_path, capsys):
    assert (PRESETS["a100-80gb"].default_dtype, PRESETS["v100-16gb"].default_dtype,
            PRESETS["tpu-v5p"].default_dtype, PRESETS["cpu"].default_dtype) == \
        ("bfloat16", "float16", "bfloat16", "float32")
    from planner.cli.workloads import load_model

    _, _, (state, batch) = load_model("mlp-tiny", None, None, None, PRESETS["v100-16gb"].default_dtype)
    assert batch["x"].dtype == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
    label, step, args = load_model("mlp-tiny", None, None, None, "float16")
    assert label == "mlp-tiny"
    assert any(op.name == "dot_general" and graph_dtype == jnp.float16
               for graph in [trace(step, *args)] for op in graph.ops
               for graph_dtype in [graph.tensors[op.outputs[0]].dtype])
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "8", "--quiet", "--time-limit", "5", "--dtype",
                     "float32"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("Plan for mlp-tiny dtype=float32 on 8 devices"), out


def test_bf16_zoo_step_matches_unsharded(devices8):
    """A bf16 train step (fp32 master weights, fp32 Adam moments) planned on 2x4 equals the
    unsharded one within the summation bound at bfloat16's unit roundoff (tests/helpers.py)."""
    b, state, batch = concrete("mlp-tiny", dtype="bfloat16")
    floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
    assert all(x.dtype == jnp.float32 for x in floats(state))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = planner.plan_parallel(b.train_step, mesh="2x4")(state, batch)
    assert all(x.dtype == jnp.float32 for x in floats(new_state))
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


# --- 4. the cluster as it is ---------------------------------------------------------------------


def test_units_of_links():
    assert parse_bandwidth("25Gbit") == parse_bandwidth("25Gbps") == parse_bandwidth("3.125GB/s") == 3.125e9
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_duration("10us") == pytest.approx(1e-5) and parse_duration("2ms") == pytest.approx(2e-3)
    assert parse_link("100Gbit,5us") == (12.5e9, pytest.approx(5e-6))
    for bad in ("fast", "25G", "0Gbit", "-1GB/s"):
        with pytest.raises(InvalidArgumentError):
            parse_bandwidth(bad)


def test_alpa_cluster_links_reach_the_cost_model():
    """8 V100 per host on 25 Gbit/s (Alpa's testbed): 0.39 GB/s per device between hosts."""
    hw = hardware_with_links("v100", inter_host="25Gbit")
    assert hw.inter_bandwidth == pytest.approx(25e9 / 8 / 8)
    mesh = MeshSpec((8, 8), ("x", "y"))
    cm = cost_model_for(mesh, PlanOptions(hardware="8x8:v100", inter_host="25Gbit,20us", intra_host="100GB/s"))
    assert cm.links[0] == AxisLink(pytest.approx(20e-6), pytest.approx(8 * 8 / 25e9))
    assert cm.links[1] == AxisLink(PRESETS["v100-16gb"].intra_latency, pytest.approx(1 / 100e9))
    with pytest.raises(InvalidArgumentError):
        PlanOptions(inter_host="a lot")


@pytest.mark.parametrize("extra, needle", [
    (["--inter-host", "fast"], "is not a bandwidth"),
    (["--intra-host", "10GB/s,soon"], "is not a duration"),
    (["--inter-host", "25Gbit,0us"], "latency must be positive"),
])
def test_bad_link_flags_are_one_line_exit_2(capsys, extra, needle):
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", "2x4:v100", "--quiet"] + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_cluster_file_and_flags(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"hosts": 2, "devices_per_host": 4, "hardware": "v100", "inter_host": "10Gbit"}))
    out_json = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", str(path), "--mesh", "2x4", "--quiet",
                     "--time-limit", "5", "--json", str(out_json)])
    assert code == 0, capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["options"]["inter_host"] == "10Gbit"
    assert data["options"]["hardware"] == "2x4:v100-16gb"
    path.write_text(json.dumps({"hosts": 2}))
    assert cli.main(["plan", "--model", "mlp-tiny", "--cluster", str(path), "--quiet"]) == 2
    assert "devices_per_host" in capsys.readouterr().err
    assert math.isclose(hardware_with_links("v100", "10Gbit", None, 4).inter_bandwidth, 10e9 / 8 / 4)


# --- 5. overlap ------------------------------------------------------------------------------------


def test_gradient_all_reduce_hides_behind_the_backward_and_the_flags_say_so():
    """Data-parallel MLP (batch >> hidden) on 8 A100s: the second layer's gradient all-reduce runs
    while the first layer's backward computes. Predicted faster than with overlap off, by the hidden
    time exactly; the plan carries the latency-hiding scheduler flags; on XLA:CPU nothing overlaps."""
    graph = _graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    on = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20))
    off = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, overlap=False))
    assert on.input_specs == off.input_specs  # the same data-parallel plan
    p, q = on.prediction, off.prediction
    assert p.hidden_communication_time_s > 0 and q.hidden_communication_time_s == 0
    assert p.step_time_s < q.step_time_s
    assert p.step_time_s == pytest.approx(q.step_time_s - p.hidden_communication_time_s, rel=1e-9)
    assert p.communication_time_s + p.hidden_communication_time_s == pytest.approx(q.communication_time_s, rel=1e-9)
    assert on.solver["objective_s"] == pytest.approx(p.step_time_s, rel=1e-12)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in on.xla_flags() and off.xla_flags() == []
    back = type(on).from_json(on.to_json())
    assert back.xla_flags() == on.xla_flags()
    assert back.prediction.hidden_communication_time_s == p.hidden_communication_time_s
    cpu = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, hardware="cpu"))
    assert cpu.prediction.hidden_communication_time_s == 0 and cpu.xla_flags() == []


def test_exposed_communication_is_the_fifo_backlog():
    """`hidden_time` against a hand schedule: compute c = (5, 1, 1) in program order, async
    collectives a = (0, 4, 3) issued after nodes 2 and 3. The stream runs 4 from t=6 to 10 and 3
    from 10 to 13; compute ends at 7: 6 exposed, 1 hidden."""
    from planner.ilp.objective import hidden_time

    @dataclasses.dataclass
    class N:
        ops: list
        costs: list
        comm_s: list
        async_s: list
        index: int

    nodes = [N([0], [5.0], [0.0], [0.0], 0), N([1], [5.0], [4.0], [4.0], 1), N([2], [4.0], [3.0], [3.0], 2)]

    @dataclasses.dataclass
    class P:  # the fields of `Problem` that `hidden_time` reads
        nodes: list
        overlap: bool = True
        prefetch: bool = False
        offloaded: tuple = ()

    assert hidden_time(P(nodes), [0, 0, 0]) == pytest.approx(1.0)
    assert hidden_time(P(nodes, overlap=False), [0, 0, 0]) == 0.0


def test_parameter_all_gathers_are_prefetched_behind_earlier_compute():
    """ZeRO-3 layout by pins: both weights stored split over 8 A100s, the batch-split matmuls read
    them whole, so each is all-gathered where it is read. The first gather has nothing to hide
    behind; the later ones are issued with it at the start of the step and hide behind the compute
    before their consumers when that is longer (a hand schedule on one link). The plan is predicted
    faster than with overlap off by exactly the hidden part; CP-SAT's objective, with the prefetch
    in max-plus form, is the same number."""
    from planner.ilp.objective import prefetch_hidden, prefetched, step_time
    from planner.ilp.solver import solve

    d, batch = 1024, 65536

    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
    graph = trace(step, w, w, jax.ShapeDtypeStruct((batch, d), jnp.bfloat16))
    zero3 = {0: ((0,), ()), 1: ((0,), ())}
    options = PlanOptions(solver_time_limit=20, hardware="a100", prefetch=True)
    on = make_plan(graph, MESH_8, options, pins=zero3)
    off = make_plan(graph, MESH_8, dataclasses.replace(options, overlap=False), pins=zero3)
    problem = build_problem(graph, cost_model_for(MESH_8, options), pins={graph.inputs[i]: s for i, s in zero3.items()})
    problem = dataclasses.replace(problem, prefetch=True)
    assert prefetch_hidden(dataclasses.replace(problem, prefetch=False), (0,) * len(problem.nodes)) == 0.0
    choice = solve(problem, None, 20.0).choice
    # The hand schedule: gathers (seconds) in order of their consumers, compute before each.
    gathers = sorted((problem.nodes[e.dst].ops[0], problem.edge_time(e.tensor, e.src_specs[choice[e.src]],
                                                                     e.dst_specs[choice[e.dst]]))
                     for e in problem.edges if prefetched(problem, e))
    gathers = [(k, g) for k, g in gathers if g > 0]
    weights = {e.tensor for e in problem.edges if prefetched(problem, e) and e.tensor in graph.inputs[:2]
               and problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]]) > 0}
    assert len(weights) == 2, "the plan reads both weights gathered"

    def compute_before(k):
        return sum(n.costs[choice[n.index]] - n.comm_s[choice[n.index]] for n in problem.nodes if n.ops and n.ops[0] < k)

    first = gathers[0][0]
    stall = sum(g for k, g in gathers if k == first)  # what the first consumer waits for
    assert compute_before(first) == 0
    assert all(sum(g for _, g in gathers[: j + 1]) - compute_before(k) <= stall for j, (k, _) in enumerate(gathers))
    assert stall < 0.5 * sum(g for _, g in gathers)
    total = sum(g for _, g in gathers)
    assert prefetch_hidden(problem, choice) == pytest.approx(total - stall, rel=1e-9)
    assert step_time(problem, choice).hidden_s >= total - stall
    p, q = on.prediction, off.prediction
    assert p.step_time_s < q.step_time_s
    assert p.step_time_s == pytest.approx(step_time(problem, choice).total_s, rel=1e-12)
    serial = step_time(dataclasses.replace(problem, overlap=False), choice)  # the same plan, nothing hidden
    assert serial.total_s - p.step_time_s == pytest.approx(p.hidden_communication_time_s, rel=1e-9)
    assert p.hidden_communication_time_s >= (total - stall) * (1 - 1e-9)
    objective, _, rounding = _cp_sat_optimum(problem)
    assert objective == pytest.approx(p.step_time_s, abs=rounding)
