"""The resharding times a cost model memoises (`CostModel.part_times`) and the one cost model per mesh
that a stage table's layer ILPs share (`cost_table.COST_MODELS`): the same answers as without them."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.graph.ir import Tensor
from planner.graph.trace import trace
from planner.ilp.strategies import _part_time, edge_parts, part_key, part_time
from planner.search.mesh_plan import cost_model_for
from planner.stages.clustering import cluster_layers
from planner.stages.cost_table import COST_MODELS, LayerCostTable, planned_layers
from planner.stages.layer_cost import LayerCost, layer_step_cost
from planner.stages.submesh import logical_meshes, make_cluster, planning_hardware
from tests.helpers import tanh_chain_step


def test_part_time_answers_as_computed_and_a_replaced_model_starts_without_them():
    cost = cost_model_for(MeshSpec((2, 4), ("x", "y")), PlanOptions(hardware="a100"))
    t = Tensor((64, 128), jnp.dtype(jnp.bfloat16))
    specs = [((), ()), (("x",), ()), ((), ("y",)), (("x", "y"), ()), (("y",), ("x",))]
    specs = [tuple(tuple({"x": 0, "y": 1}[a] for a in dim) for dim in s) for s in specs]
    for src in specs:
        for dst in specs:
            for part in edge_parts(cost.mesh):
                key = part_key(part, dst)
                assert part_time(t, src, part, key, cost) == _part_time(t, src, part, key, cost)
    assert cost.part_times  # the answers are kept on the model
    filled = dict(cost.part_times)
    other = dataclasses.replace(cost, comm_precision="int8")
    assert other.part_times == {} and other.part_times is not cost.part_times
    assert dataclasses.replace(cost) == cost and hash(dataclasses.replace(cost)) == hash(cost)  # not part of its value
    assert cost.part_times == filled


def test_cost_model_for_makes_one_model_per_mesh_and_options():
    memo: dict = {}
    mesh = MeshSpec((2, 4), ("x", "y"))
    a = cost_model_for(mesh, PlanOptions(hardware="a100"), memo=memo)
    assert cost_model_for(mesh, PlanOptions(hardware="a100"), memo=memo) is a
    assert cost_model_for(mesh, PlanOptions(hardware="h100-sxm"), memo=memo) is not a
    assert a == cost_model_for(mesh, PlanOptions(hardware="a100"))  # the model made without a memo
    assert len(memo) == 2


def test_a_tables_layers_share_one_cost_model_per_mesh_and_plan_as_with_their_own():
    ws = [jax.ShapeDtypeStruct((128, 128), jnp.float32)] * 3
    graph = trace(tanh_chain_step, ws, jax.ShapeDtypeStruct((256, 128), jnp.float32))
    layers = cluster_layers(graph, num_layers=3)
    cluster = make_cluster(2, 4, "a100")
    meshes = logical_meshes((1, 4), cluster, max_ndim=2)
    table = LayerCostTable(graph, layers, meshes, cluster, PlanOptions(), {}, microbatches=4)
    table.fill(range(len(meshes)), threads=1)
    models = table.cache[COST_MODELS]
    assert 1 <= len(models) <= len(meshes)  # one per logical mesh the layers' ILPs were built on
    assert {m.mesh for m in models.values()} <= {lm.mesh for lm in meshes}
    assert all(m.part_times and m.answers["build_problem"][2] for m in models.values())  # and the enumerations
    costs = {k: v for k, v in table.cache.items() if isinstance(v, LayerCost)}
    assert planned_layers(table.cache) == len(costs) > 0
    for mi, lm in enumerate(meshes):
        for l in range(layers.num_layers):
            alone, _ = layer_step_cost(graph, layers, table.facts[l], l, lm, planning_hardware(cluster),
                                       PlanOptions(), microbatches=4)  # its own cost model
            assert table.cost(l, mi) == alone
