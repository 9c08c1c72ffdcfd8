"""Host offload of optimizer state (planned by planner/ilp/offload.py, emitted by planner/emit/offload.py),
on XLA:CPU.

What XLA:CPU shows and what it cannot:
  - Placement: a host-offloaded argument or result carries memory space 5 ("pinned_host") in the
    compiled program's entry layout (`{...:S(5)}`); the bytes so placed are read from it here and
    equal the plan's host bytes exactly.
  - XLA:CPU's `memory_analysis()` keeps host buffers in its argument / output totals (its `host_*`
    fields stay 0), and its buffer assignment ignores memory spaces: temporaries (gradients, their
    all-reduce results) reuse the buffers of host-placed outputs (read from its
    `--xla_dump_to` buffer assignment). So device bytes are measured here as XLA's arguments and
    outputs without the S(5) ones, and the predicted device peak can only be checked from below
    (not under what XLA:CPU places on the device) and where the peak is the arguments and outputs.
  - Only a GPU/TPU checks: real host<->device copies (XLA:CPU compiles none: its fusions read
    host-placed buffers in place), their time over PCIe / NVLink-C2C against
    `Hardware.host_bandwidth`, their overlap with the forward/backward, and a buffer assignment that
    keeps device temporaries out of host buffers (the predicted device peak at 10%).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner.cost_model import PRESETS
from planner.emit.single import jit_planned
from planner.core.errors import InvalidArgumentError
from planner.ilp.offload import unavailable
from tests.helpers import assert_bundle_step_close, assert_first_step_close, concrete
from xla_hooks.inspect import entry_bytes, memory_stats
from zoo import make_optimizer

def _device_bytes(compiled) -> int:
    """XLA's per-device total without the host-placed arguments and results."""
    host_args, _, host_outs, _ = entry_bytes(compiled)
    return memory_stats(compiled).peak_bytes - host_args - host_outs


# A step whose widths no mesh axis of 8 divides: every plan on 1x8 keeps the parameters and Adam
# moments whole, so the memory a budget needs can only come from the host.
_OPT = make_optimizer(1e-3, 0.01)
_DIMS = (36, 60, 60, 12)


def _mlp_loss(params, batch):
    x = batch["x"]
    for i in range(len(_DIMS) - 1):
        x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean((x - batch["y"]) ** 2)


def _mlp_step(state, batch):
    loss, grads = jax.value_and_grad(_mlp_loss)(state["params"], batch)
    updates, opt_state = _OPT.update(grads, state["opt_state"], state["params"])
    return {"params": jax.tree.map(jnp.add, state["params"], updates), "opt_state": opt_state}, {"loss": loss}


def _mlp_args():
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    params = {f"w{i}": normal(_DIMS[i], _DIMS[i + 1]) / _DIMS[i] ** 0.5 for i in range(3)}
    params.update({f"b{i}": jnp.zeros(_DIMS[i + 1]) for i in range(3)})
    batch = {"x": normal(64, _DIMS[0]), "y": normal(64, _DIMS[-1])}
    return {"params": params, "opt_state": _OPT.init(params)}, batch


def test_offloaded_state_runs_equal_on_the_host_as_predicted(devices8):
    b, state, batch = concrete("mlp-tiny")
    step = planner.plan_parallel(b.train_step, mesh="1x8", offload="opt-state")
    plan = step.plan(state, batch)
    record = plan.levers.offload
    assert record.candidates == len(record.inputs) == len(record.outputs) > 0
    assert all(".mu[" in p or ".nu[" in p for p in record.paths)  # Adam moments, not params or count
    # The same numbers as the unsharded step; the new moments come back in host memory.
    new_state, metrics = step(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(new_state["opt_state"]) if leaf.ndim}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(new_state["params"])} == {"device"}

    # The update is streamed: each group's copies to the device wait on the previous group.
    assert record.streamed and step.graph(state, batch).update_groups
    lowered = step.lower(state, batch)
    assert "optimization_barrier" in lowered.as_text()

    # Host bytes as predicted; device bytes drop by them against the same plan without offload.
    compiled = lowered.compile()
    host_args, _, host_outs, _ = entry_bytes(compiled)
    assert host_args == host_outs == record.host_bytes_per_device
    plain_plan = dataclasses.replace(plan, levers=dataclasses.replace(plan.levers, offload=None))
    with jax.sharding.set_mesh(plan._mesh()):
        plain = jit_planned(step.graph(state, batch), plain_plan).lower(state, batch).compile()
    assert entry_bytes(plain)[0] == 0
    assert _device_bytes(plain) - _device_bytes(compiled) == 2 * record.host_bytes_per_device
    predicted = plan.prediction.memory_bytes_per_device
    assert predicted < planner.plan(b.train_step, state, batch, mesh="1x8").prediction.memory_bytes_per_device
    assert predicted >= 0.9 * _device_bytes(compiled)  # never under what XLA:CPU keeps on the device

    # Time: the copies in and back at the preset's host link, in the prediction's communication.
    hw = PRESETS["a100-80gb"]  # the default preset
    assert record.copy_in_s == record.copy_back_s == pytest.approx(record.host_bytes_per_device / hw.host_bandwidth)
    p = plan.prediction
    assert 0 <= record.hidden_s <= record.copy_in_s
    transfer = record.copy_in_s + record.copy_back_s
    assert p.communication_time_s + p.hidden_communication_time_s >= transfer
    parts = {item[0]: item for item in plan.solver.step_parts.items}
    assert parts["host offload"][3] == pytest.approx(transfer)
    assert plan.solver.objective_s == pytest.approx(p.step_time_s, rel=1e-6)  # CP-SAT saw the same number


def test_infeasible_with_offload_says_it_was_tried(devices8):
    """The one-line answer for a budget nothing fits, with every optimizer-state leaf on the host:
    host offload is among the levers tried, and its lower bound counts the arguments left on the device."""
    state, batch = _mlp_args()
    with pytest.raises(planner.InfeasiblePlanError) as e:
        planner.plan(_mlp_step, state, batch, mesh="1x8", offload="opt-state", memory_budget="1kB", remat="off",
                     accumulate=1)
    text = str(e.value)
    assert "of device-resident arguments" in text and "Tried: sharding every tensor, host offload" in text
    assert len(text.splitlines()) == 1
    # The mesh search's answer too, where meshes are ruled out by their bound with offload counted.
    with pytest.raises(planner.InfeasiblePlanError) as e:
        planner.plan(_mlp_step, state, batch, offload="auto", memory_budget="1kB", remat="off", accumulate=1)
    assert "Tried: sharding every tensor, host offload" in str(e.value)
    # with every lever (the defaults) each is named as tried, in one line
    with pytest.raises(planner.InfeasiblePlanError) as e:
        planner.plan(_mlp_step, state, batch, mesh="1x8", memory_budget="1kB")
    text = str(e.value)
    assert "\n" not in text and "host offload" in text.split("Tried:")[1].split(".")[0]


def test_auto_offloads_only_the_overflow_and_fits(devices8):
    state, batch = _mlp_args()
    plain = planner.plan_parallel(_mlp_step, mesh="1x8")
    all_host = planner.plan(_mlp_step, state, batch, mesh="1x8", offload="opt-state")
    budget = plain.plan(state, batch).prediction.memory_bytes_per_device
    budget -= (budget - all_host.prediction.memory_bytes_per_device) // 3
    with pytest.raises(planner.InfeasiblePlanError, match="host offload: offload='auto'"):
        planner.plan(_mlp_step, state, batch, mesh="1x8", memory_budget=budget, offload="off", accumulate=1)
    # by default (every lever auto) a lever makes it fit
    assert planner.plan(_mlp_step, state, batch, mesh="1x8",
                        memory_budget=budget).prediction.memory_bytes_per_device <= budget

    step = planner.plan_parallel(_mlp_step, mesh="1x8", offload="auto", memory_budget=budget)
    plan = step.plan(state, batch)
    record = plan.levers.offload
    assert 0 < len(record.inputs) < record.candidates
    assert record.paths[0] == "[0]['opt_state'][0].mu['w1']"  # the largest leaf first
    assert plan.prediction.memory_bytes_per_device <= budget
    # Without a budget problem, auto keeps everything on the device: no offload is planned at all.
    assert planner.plan(_mlp_step, state, batch, mesh="1x8", offload="auto").levers.offload is None
    assert record.without_fits is False and record.without_memory_bytes > budget  # what it was weighed against

    compiled = step.lower(state, batch).compile()
    host_args, _, host_outs, _ = entry_bytes(compiled)
    assert host_args == host_outs == record.host_bytes_per_device
    # The predicted peak falls by the offloaded arguments, and by their new values' buffers less what
    # those buffers held before they were written (`liveness._borrowed`: temporaries that fit, which
    # now count): between once and twice the offloaded bytes. XLA:CPU's device bytes fall by at
    # least twice that (jax 0.10: exactly; jax 0.12's buffer assignment also drops a temporary of the
    # update fusion that reads the host-placed moments: 2880 B more here): the prediction is on the
    # safe side.
    drop = _device_bytes(plain.lower(state, batch).compile()) - _device_bytes(compiled)
    predicted_drop = (plain.plan(state, batch).prediction.memory_bytes_per_device
                      - plan.prediction.memory_bytes_per_device)
    host = record.host_bytes_per_device
    assert host <= predicted_drop <= 2 * host <= drop
    new_state, metrics = step(state, batch)
    ref_state, ref_metrics = jax.jit(_mlp_step)(state, batch)
    assert_first_step_close(_mlp_loss, _OPT, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=_mlp_step)


def test_offload_is_unavailable_in_one_line():
    b = concrete("mlp-tiny")[0]
    with pytest.raises(planner.InvalidArgumentError, match=r"^offload='opt-state' is unavailable: hardware 'tpu-v4' "
                                                           r"has no host link bandwidth[^\n]*$"):
        planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh=(2, 4), hardware="tpu-v4",
                     offload="opt-state")

    @dataclasses.dataclass
    class Memory:
        kind: str

    class Device:  # a backend with device memory only
        platform = "fake"

        def addressable_memories(self):
            return [Memory("device")]

    why = unavailable(PRESETS["h100-sxm"], [Device()])
    assert why is not None and "no 'pinned_host' memory" in why and "\n" not in why
    assert unavailable(PRESETS["cpu"], jax.devices()[:1]) is None  # XLA:CPU has pinned_host
    with pytest.raises(planner.InvalidArgumentError, match="single-stage"):
        planner.plan_parallel(b.train_step, mesh=(2, 4), offload="opt-state", pipeline="auto")
    # "auto" (the default) is accepted with pipeline stages, which plan without offload
    planner.plan_parallel(b.train_step, mesh=(2, 4), offload="auto", pipeline="auto")


def test_streamed_update_groups_each_parameters_state():
    """`ilp.offload.streamed`: one contiguous group per parameter (its two Adam moments meet in its
    update), the ops a topological permutation of the traced ones, the results bit-identical."""
    from planner.graph.trace import trace
    from planner.ilp.offload import streamed

    state, batch = _mlp_args()
    graph = trace(_mlp_step, state, batch)
    s = streamed(graph)
    assert sorted(op.name for op in s.ops) == sorted(op.name for op in graph.ops)
    seen = set(s.inputs) | set(s.consts)
    for k, op in enumerate(s.ops):
        assert op.index == k and all(x in seen for x in op.tensor_inputs)
        seen.update(op.outputs)
    paths = dict(zip(s.inputs, s.input_paths))
    assert len(s.update_groups) == len(state["params"])
    for a, b in s.update_groups:
        read = {paths[x] for op in s.ops[a:b] for x in op.tensor_inputs if ".mu[" in paths.get(x, "")
                or ".nu[" in paths.get(x, "")}
        names = {p.split("[")[-1] for p in read}
        assert len(read) == 2 and len(names) == 1  # mu[w] and nu[w] of one parameter
    leaves = jax.tree.leaves((state, batch))
    for x, y in zip(jax.jit(graph.evaluate)(leaves), jax.jit(s.evaluate)(leaves)):
        assert (np.asarray(x) == np.asarray(y)).all()
    with pytest.raises(InvalidArgumentError, match="graph_for"):
        plan = planner.plan(_mlp_step, state, batch, mesh="1x8", offload="opt-state")
        jit_planned(graph, plan)


def _adamw_step(loss):
    """The train step of `loss(params, batch)` with `_OPT`: (state, batch) -> (new state, loss)."""
    def step(state, batch):
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt_state = _OPT.update(grads, state["opt_state"], state["params"])
        return {"params": jax.tree.map(jnp.add, state["params"], updates), "opt_state": opt_state}, value

    return step


def _state_heavy_step(dtype):
    """(step, state, batch) of a 4-layer tanh MLP whose memory is its state: widths no axis of 8
    divides, batch 8, float32 parameters and AdamW moments; its layers compute in `dtype` (a cast
    of each parameter before its matmul when it is not float32)."""
    dims = (36, 180, 180, 180, 36)
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((dims[i], dims[i + 1])), jnp.float32) for i in range(4)}

    def loss(params, batch):
        x = batch["x"].astype(dtype)
        for i in range(4):
            x = jnp.tanh(x @ params[f"w{i}"].astype(dtype))
        return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)

    step = _adamw_step(loss)
    state = {"params": params, "opt_state": _OPT.init(params)}
    return step, state, {"x": jnp.ones((8, dims[0])), "y": jnp.zeros((8, dims[-1]))}


def test_streamed_offload_keeps_one_groups_state_on_the_device():
    """A step whose memory is its state (wide layers no axis of 8 divides, batch 8), planned for
    H100s: with every moment offloaded, the unstreamed order holds every leaf's new first moment
    until the second moments' pass reads it (half the host bytes at once); the streamed order one
    group's. So the streamed peak is lower by at least that half less the largest leaf's moment,
    and its copies in are exposed (each group waits for the one before)."""
    from planner.graph.trace import trace
    from planner.core.mesh import MeshSpec
    from planner.ilp.offload import streamed
    from planner.core.options import PlanOptions
    from planner.search.mesh_plan import make_plan

    step, state, batch = _state_heavy_step(jnp.float32)
    params = state["params"]
    graph = trace(step, state, batch)
    options = PlanOptions(hardware="h100", offload="opt-state", donate_argnums=(0,))
    mesh = MeshSpec((1, 8), ("x", "y"))
    plain, stream = make_plan(graph, mesh, options), make_plan(streamed(graph), mesh, options)
    rec = stream.levers.offload
    assert rec.streamed and not plain.levers.offload.streamed
    assert rec.host_bytes_per_device == plain.levers.offload.host_bytes_per_device
    largest = max(w.size for w in params.values()) * 4
    drop = plain.prediction.memory_bytes_per_device - stream.prediction.memory_bytes_per_device
    assert drop >= rec.host_bytes_per_device / 2 - largest
    assert rec.hidden_s == 0 < plain.levers.offload.hidden_s


def test_auto_narrows_the_doubling_to_the_fewest_leaves_that_fit():
    """"auto" offloads the fewest leaves (largest first) whose solved plan fits: from the lower
    bound's count it doubles until a plan fits, then halves the overshoot. Scripted solves: a plan
    fits with 5 or more leaves on the host; the doubling (1, 2, 4: no; 8: fits) stops at 8, the
    halvings find 6 and then 5 (it once kept 8: Llama-70B on 1x8 H100 kept 824 leaves where 463 fit)."""
    from planner.cost_model import CostModel
    from planner.core.errors import InfeasiblePlanError
    from planner.graph.trace import trace
    from planner.ilp.problem import build_problem
    from planner.ilp.solver import Solution
    from planner.core.mesh import MeshSpec
    from planner.ilp.offload import plan_offload, state_pairs

    state, batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _mlp_args())
    problem = build_problem(trace(_mlp_step, state, batch), CostModel.build(MeshSpec((1, 8), ("x", "y")), "h100-sxm"))
    assert len(state_pairs(problem)) >= 8
    tried = []

    def solve(p, search):
        tried.append(len(p.offloaded))
        if len(p.offloaded) < 5:
            raise InfeasiblePlanError("does not fit")
        return Solution(choice=(0,) * len(p.nodes), objective_s=float(len(p.offloaded)), status="optimal",
                        solve_time_s=0.0, peak_memory_bytes=0, rounds=1)

    offloaded, solution = plan_offload(problem, "auto", budget=1e15, devices=(), solve=solve)
    assert tried == [0, 1, 2, 4, 8, 6, 5]
    assert len(offloaded.offloaded) == 5 and solution.objective_s == 5.0


def test_master_parameters_offload_runs_equal_and_leaves_the_device(devices8):
    """offload="opt-state+params": the float32 master parameters the bf16 step reads only through
    their casts live on the host too (their new values come back there); the step runs equal to the
    unsharded one; XLA places exactly the planned bytes on the host, and the device holds the
    moments-only plan's bytes less the parameters and their new values."""
    b, state, batch = concrete("gpt-tiny", dtype="bfloat16")
    both = planner.plan_parallel(b.train_step, mesh="1x8", offload="opt-state+params")
    plan = both.plan(state, batch)
    record = plan.levers.offload
    params = [p for p in record.paths if "['params']" in p and "opt_state" not in p]
    assert record.params == len(params) > 0 and record.host_reads
    # the weights and embeddings the bf16 layers cast; not the layer norms' (read in float32)
    assert not any("['ln_" in p for p in params) and any(p.endswith("['kernel']") for p in params)
    new_state, metrics = both(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    kinds = [leaf.sharding.memory_kind for leaf in jax.tree.leaves(new_state["params"])]
    assert kinds.count("pinned_host") == len(params) and "device" in kinds

    compiled = both.lower(state, batch).compile()
    host_args, _, host_outs, _ = entry_bytes(compiled)
    assert host_args == host_outs == record.host_bytes_per_device
    moments = planner.plan_parallel(b.train_step, mesh="1x8", offload="opt-state")
    moments_host = moments.plan(state, batch).levers.offload.host_bytes_per_device
    params_host = record.host_bytes_per_device - moments_host
    assert params_host > 0
    assert _device_bytes(moments.lower(state, batch).compile()) - _device_bytes(compiled) == 2 * params_host


def test_master_parameters_on_the_host_are_copied_in_for_each_cast_and_for_the_update():
    """Planned for H100s (XLA:GPU copies host buffers in): an offloaded master parameter is on the
    device only while its cast runs (`Problem.host_reads`) and from its first read in the update;
    the copies in are the moments plus twice the parameters (cast and update), the copies back the
    moments and the parameters. A step whose memory is its state (layers no axis of 8 divides):
    the predicted peak falls by the parameters but the two largest."""
    from planner.graph.trace import trace
    from planner.core.mesh import MeshSpec
    from planner.ilp.offload import streamed
    from planner.core.options import PlanOptions
    from planner.cost_model.hardware import get_hardware
    from planner.search.mesh_plan import make_plan

    step, state, batch = _state_heavy_step(jnp.bfloat16)
    params = state["params"]
    graph = streamed(trace(step, state, batch))
    mesh = MeshSpec((1, 8), ("x", "y"))
    plans = {mode: make_plan(graph, mesh, PlanOptions(hardware="h100", offload=mode, donate_argnums=(0,)))
             for mode in ("opt-state", "opt-state+params")}
    moments, both = (plans[m].levers.offload for m in ("opt-state", "opt-state+params"))
    param_bytes = sum(w.size * 4 for w in params.values())
    assert both.params == 4 and len(both.host_reads) == 4  # one cast per weight
    assert both.host_bytes_per_device == moments.host_bytes_per_device + param_bytes
    link = get_hardware("h100").host_bandwidth
    assert both.copy_in_s == pytest.approx((moments.host_bytes_per_device + 2 * param_bytes) / link)
    assert both.copy_back_s == pytest.approx((moments.host_bytes_per_device + param_bytes) / link)
    two_largest = sum(sorted(w.size * 4 for w in params.values())[-2:])
    drop = (plans["opt-state"].prediction.memory_bytes_per_device
            - plans["opt-state+params"].prediction.memory_bytes_per_device)
    assert drop >= param_bytes - two_largest
    assert plans["opt-state+params"].solver.objective_s == pytest.approx(
        plans["opt-state+params"].prediction.step_time_s, rel=1e-6)  # CP-SAT saw the same copies


def test_offloaded_state_must_fit_the_hosts_memory():
    """The state a plan keeps in host memory fits the device's share of its host's memory
    (`Hardware.host_memory_per_device`): a host a little larger than the offloaded bytes per device
    plans the same offload; one a little smaller is a one-line "does not fit" naming the host."""
    from planner.core.errors import InfeasiblePlanError
    from planner.core.mesh import MeshSpec
    from planner.core.options import PlanOptions
    from planner.cost_model.hardware import get_hardware
    from planner.graph.trace import trace
    from planner.ilp.offload import streamed
    from planner.search.mesh_plan import make_plan

    step, state, batch = _state_heavy_step(jnp.bfloat16)
    graph, mesh = streamed(trace(step, state, batch)), MeshSpec((1, 8), ("x", "y"))
    h100 = get_hardware("h100")

    def plan_on(host_per_device):
        hw = h100 if host_per_device is None else dataclasses.replace(
            h100, host_memory_bytes=host_per_device * h100.devices_per_host)
        return make_plan(graph, mesh, PlanOptions(hardware=hw, offload="opt-state", donate_argnums=(0,)))

    need = plan_on(None).levers.offload.host_bytes_per_device
    assert need > 0 and plan_on(need * 1.01).levers.offload.host_bytes_per_device == need
    with pytest.raises(InfeasiblePlanError, match=r"^the state offloaded to host memory needs .* per device, more "
                                                  r"than a h100-sxm host holds per device") as e:
        plan_on(need * 0.99)
    assert "\n" not in str(e.value)


def test_master_parameters_of_a_float32_step_do_not_qualify_and_the_plan_says_so(devices8, caplog):
    """A float32 step reads its parameters in their own dtype (no casts): none can live on the host,
    the moments go alone, and one warning line says why."""
    b, state, batch = concrete("mlp-tiny")
    with caplog.at_level("WARNING", logger="planner"):
        plan = planner.plan(b.train_step, state, batch, mesh="1x8", offload="opt-state+params")
    record = plan.levers.offload
    assert record.params == 0 and len(record.inputs) == record.candidates > 0
    assert any("no master parameter qualifies" in r.getMessage() for r in caplog.records)


def _scanned_state_heavy_step():
    """(step, state, batch) of `_state_heavy_step`'s kind as a scanned stack: 3 layers of four
    180x180 float32 weights stacked on a leading layer axis (no axis of 8 divides 3 or 180), each
    iteration casting its own layer's slices to bfloat16, AdamW moments, batch 8."""
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((3, 180, 180)) / 14, jnp.float32) for i in range(4)}

    def loss(params, batch):
        def layer(x, w):
            for i in range(4):
                x = jnp.tanh(x @ w[f"w{i}"].astype(jnp.bfloat16))
            return x, None

        x, _ = jax.lax.scan(layer, batch["x"].astype(jnp.bfloat16), params)
        return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)

    step = _adamw_step(loss)
    state = {"params": params, "opt_state": _OPT.init(params)}
    return step, state, {"x": jnp.ones((8, 180)), "y": jnp.zeros((8, 180))}


def test_a_scanned_stacks_master_parameters_are_copied_in_a_layer_at_a_time():
    """Planned for H100s: a stacked float32 parameter whose scan casts one layer's slice per
    iteration can live on the host; each cast copies in that slice alone (a third of the stack
    here), so each scan reading the stack copies it in once, and the update once more. The
    predicted peak falls by the parameters but the two largest (the update streams one group at a
    time); CP-SAT prices the same copies the record reports."""
    from planner.core.mesh import MeshSpec
    from planner.core.options import PlanOptions
    from planner.cost_model.hardware import get_hardware
    from planner.graph.trace import trace
    from planner.ilp.offload import host_reads, param_pairs, streamed
    from planner.ilp.problem import build_problem
    from planner.cost_model import CostModel
    from planner.search.mesh_plan import make_plan

    step, state, batch = _scanned_state_heavy_step()
    graph = streamed(trace(step, state, batch))
    mesh = MeshSpec((1, 8), ("x", "y"))
    problem = build_problem(graph, CostModel.build(mesh, "h100"))
    pairs = param_pairs(problem)
    assert len(pairs) == 4  # every stacked weight qualifies
    scans = {tin: sum(1 for rs in graph.regions.values() for r in rs if r.kind == "scan" and tin in r.operands)
             for tin, _ in pairs}
    reads = host_reads(graph, problem.combinable, pairs)
    for tin, _ in pairs:
        shares = [share for t, _, share in reads if t == tin]
        assert shares and all(s == pytest.approx(1 / 3) for s in shares)
        assert sum(shares) == pytest.approx(scans[tin]) and scans[tin] >= 1

    plans = {mode: make_plan(graph, mesh, PlanOptions(hardware="h100", offload=mode, donate_argnums=(0,)))
             for mode in ("opt-state", "opt-state+params")}
    moments, both = (plans[m].levers.offload for m in ("opt-state", "opt-state+params"))
    sizes = {tin: graph.tensors[tin].nbytes for tin, _ in pairs}
    param_bytes = sum(sizes.values())
    assert both.params == 4 and both.host_bytes_per_device == moments.host_bytes_per_device + param_bytes
    link = get_hardware("h100").host_bandwidth
    copied = sum(b * (1 + scans[tin]) for tin, b in sizes.items())
    assert both.copy_in_s == pytest.approx((moments.host_bytes_per_device + copied) / link)
    assert both.copy_back_s == pytest.approx((moments.host_bytes_per_device + param_bytes) / link)
    drop = (plans["opt-state"].prediction.memory_bytes_per_device
            - plans["opt-state+params"].prediction.memory_bytes_per_device)
    assert drop >= param_bytes - 2 * max(sizes.values())
    assert plans["opt-state+params"].solver.objective_s == pytest.approx(
        plans["opt-state+params"].prediction.step_time_s, rel=1e-6)


def test_a_scanned_stacks_master_parameters_offloaded_run_equal(devices8):
    """The scanned Llama (nn.scan over stacked layers, bf16 compute, float32 parameters) with
    offload="opt-state+params": the stacked weights go to the host with the moments, each scan
    iteration copies its layer's slice in, and the step runs equal to the unsharded one; XLA
    places exactly the planned bytes on the host and hands the new stacked weights back there."""
    b, state, batch = concrete("llama-tiny", dtype="bfloat16", remat=True)
    both = planner.plan_parallel(b.train_step, mesh="1x8", offload="opt-state+params")
    record = both.plan(state, batch).levers.offload
    stacked = [p for p in record.paths if "['params']['layers']" in p and "opt_state" not in p]
    assert len(stacked) == 7  # the attention and MLP kernels; not the norms' scales (read in float32)
    new_state, metrics = both(state, batch)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    layers = new_state["params"]["layers"]
    kinds = {k: leaf.sharding.memory_kind for k, leaf in jax.tree_util.tree_leaves_with_path(layers)}
    assert sum(kind == "pinned_host" for kind in kinds.values()) == len(stacked)
    host_args, _, host_outs, _ = entry_bytes(both.lower(state, batch).compile())
    assert host_args == host_outs == record.host_bytes_per_device


def test_a_stacked_parameter_the_step_slices_itself_stays_on_the_device():
    """The same stacked weights indexed by a Python loop (`w[i]`: the same slice, squeeze and cast
    as a scan's indexing, but run by the step on the argument itself, where the emitted program
    would copy the whole stack in) are not master parameters that can live on the host."""
    from planner.cost_model import CostModel
    from planner.core.mesh import MeshSpec
    from planner.graph.trace import trace
    from planner.ilp.offload import param_pairs
    from planner.ilp.problem import build_problem

    _, state, batch = _scanned_state_heavy_step()

    def loss(params, batch):
        x = batch["x"].astype(jnp.bfloat16)
        for layer in range(3):
            for i in range(4):
                x = jnp.tanh(x @ params[f"w{i}"][layer].astype(jnp.bfloat16))
        return jnp.mean((x.astype(jnp.float32) - batch["y"]) ** 2)

    graph = trace(_adamw_step(loss), state, batch)
    assert any(op.name == "slice" for op in graph.ops)  # the reads are the scan's kind of slice
    problem = build_problem(graph, CostModel.build(MeshSpec((1, 8), ("x", "y")), "h100"))
    assert param_pairs(problem) == ()
