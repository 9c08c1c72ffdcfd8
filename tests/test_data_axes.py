"""The axes no plan of a layer can make data axes (`stages.data_axes.never_data`): a step-weighted
layer solve keeps the all-reduces over them whole, as the price does, so its plan is priced as it
was weighed and the layer is not solved again for one microbatch (`layer_cost._cheaper_step`)."""
from __future__ import annotations

import pytest

from planner.core.options import PlanOptions
from planner.stages.clustering import cluster_layers
from planner.stages.data_axes import never_data
from planner.stages.layer_cost import LAYER_GAP, layer_step_cost
from planner.stages.layer_facts import external_inputs, layer_facts
from planner.stages.submesh import logical_meshes, make_cluster, planning_hardware
from tests.helpers import zoo_graph


def _block(batch: int):
    graph = zoo_graph("gpt2-small", batch=batch)
    layers = cluster_layers(graph, num_layers=14)  # embedding, 12 blocks, head and loss
    return graph, layers, layer_facts(graph, layers)


@pytest.mark.parametrize("batch, want", [(1, {0, 1}), (2, {1}), (4, set())])
def test_an_axis_is_never_data_where_no_microbatch_row_count_divides_by_it(batch, want):
    graph, layers, facts = _block(batch)
    f = facts[1]
    ext = external_inputs(graph, f.ops)
    (mesh,) = [m.mesh for m in logical_meshes((2, 4), make_cluster(2, 4, "v100"), max_ndim=2)
               if m.mesh.shape == (2, 4)]
    assert set(never_data(graph, ext, f.param_inputs, mesh)) == want
    # the parameters' leading dims (768, 2304, ...) divide every axis: counted, no axis would be never data
    assert set(never_data(graph, ext, (), mesh)) == set()


def test_one_row_microbatches_are_weighed_as_priced_and_not_solved_again():
    """GPT-2 small at one row per microbatch on 2 hosts x 4 V100s: no axis can split the batch, so
    every all-reduce runs every microbatch; the step-weighted solve (8 microbatches) weighed
    the block's and the head's sequence-split gradient all-reduces at 1/8 and chose plans priced
    above that, then solved each layer again for one microbatch. Now it solves the ILP the price
    prices: one solve, the one-microbatch plan's price (both stop at the layers' gap)."""
    graph, layers, facts = _block(1)
    cluster = make_cluster(2, 4, "v100")
    (lm,) = [m for m in logical_meshes((2, 4), cluster, max_ndim=2) if m.mesh.shape == (2, 4)]
    hw = planning_hardware(cluster)
    for layer in (1, layers.num_layers - 1):
        again: list[int] = []

        def alone(problem, layer=layer, again=again):
            again.append(layer)
            return layer_step_cost(graph, layers, facts[layer], layer, lm, hw, PlanOptions(), problem=problem)[0]

        found, solve = layer_step_cost(graph, layers, facts[layer], layer, lm, hw, PlanOptions(), microbatches=8,
                                       alone=alone)
        assert again == [], f"layer {layer} was solved again for one microbatch"
        assert solve is not None and solve.once_s == 0.0  # nothing weighed down
        one, _ = layer_step_cost(graph, layers, facts[layer], layer, lm, hw, PlanOptions())
        assert 8 * found.time_s + found.sync_s == pytest.approx(8 * one.time_s + one.sync_s, rel=LAYER_GAP)
