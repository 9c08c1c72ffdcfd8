"""Which pipeline stage runs each op, owns each parameter, and needs each value another made.

Ops follow their layer's stage (a `cond` or `while_loop` region runs whole on one stage); a
parameter belongs to the first stage that reads it (the stage of its layer when none does);
values cross stages only forwards in program order.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence

from planner.core.errors import InvalidArgumentError
from planner.graph.ir import Graph, Region
from planner.stages.clustering import cluster_layers
from planner.emit.pipeline.layout import StageLayout


@dataclasses.dataclass(frozen=True)
class Partition:
    """The stages of one traced `loss_fn`.

    Attributes:
      op_stage: stage of each op, in `graph.ops` order.
      param_owner: flat parameter index -> the stage that owns (and updates) it.
      producer: tensor -> the stage that makes it (parameters: their owner).
      needed_by: tensor -> the other stages that read it (batch leaves excluded: each stage reads its own).
      reads: per op, the tensors it reads, its regions' operands included (`op_reads`).
      op_layer: per op, the name of its layer as the stage layouts name it.
    """

    op_stage: tuple[int, ...]
    param_owner: Mapping[int, int]
    producer: Mapping[int, int]
    needed_by: Mapping[int, set[int]]
    reads: tuple[tuple[int, ...], ...] = ()
    op_layer: tuple[str, ...] = ()


def runs_whole(region: Region) -> bool:
    """A branch, a loop of unknown trip count or a custom-derivative call runs whole on one stage;
    a scan's iterations (scanned layers) may be split between stages and run unrolled."""
    return region.kind != "scan" and region.end > region.start


def op_reads(graph: Graph, op_stage: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """The tensors each op reads, where the operands of a region that runs as its control flow count
    as read by its first op: a `while`'s predicate constants (its trip count), a carry its body
    never reads or a constant a scan's body closes over but never uses are read by no op of the
    planning expansion, but the stage that runs the region binds them all. A region runs so when
    it runs whole (`runs_whole`), or, given `op_stage`, when all its ops are on one stage (a scan
    split between stages runs op by op, reading only what its ops read)."""
    reads = [list(op.tensor_inputs) for op in graph.ops]
    for start, regions in graph.regions.items():
        for r in regions:
            one_stage = op_stage is not None and r.end > r.start and len(set(op_stage[r.start:r.end])) == 1
            if runs_whole(r) or one_stage:
                reads[r.start].extend(t for t in r.operands if isinstance(t, int) and t not in reads[r.start])
    return tuple(tuple(r) for r in reads)


def partition(graph: Graph, layouts: Sequence[StageLayout], n_params: int) -> Partition:
    """Assigns the ops and parameters of `graph` (a `loss_fn` whose first `n_params` inputs are
    parameters) to the stages of `layouts`, by layer name.

    Raises:
      InvalidArgumentError: a layer belongs to no stage, a stage reads a value made on a later
        one, or the loss is not computed on the last stage.
    """
    named = [name for lay in layouts for name in lay.layers]
    layers = cluster_layers(graph, num_layers=len(named))
    stage_of_layer = {}
    name_of = list(layers.names)
    for s, lay in enumerate(layouts):
        for name in lay.layers:
            stage_of_layer[name] = s
    if layers.method == "flops" and len(named) == layers.num_layers and set(named) != set(layers.names):
        # Balanced clustering names layers by op ranges of the graph it ran on; match by position.
        stage_of_layer = {new: stage_of_layer[old] for new, old in zip(layers.names, named)}
        name_of = list(named)
    missing = [n for n in layers.names if n not in stage_of_layer]
    if missing:
        raise InvalidArgumentError(
            f"layers {missing} of loss_fn belong to no stage; the stages name {sorted(stage_of_layer)} "
            f"(loss_fn's layers are {list(layers.names)})")
    op_stage = [stage_of_layer[layers.names[l]] for l in layers.op_layer]
    for regions in graph.regions.values():
        for r in regions:
            if runs_whole(r):
                # A branch or a loop of unknown trip count runs whole on one stage: the last its ops
                # were clustered into (earlier stages made its operands; later ones read its results).
                last = max(op_stage[r.start:r.end])
                op_stage[r.start:r.end] = [last] * (r.end - r.start)
    producer: dict[int, int] = {}
    param_owner: dict[int, int] = {}
    consumers = graph.consumers()
    for k, t in enumerate(graph.inputs[:n_params]):
        users = [op_stage[i] for i, _ in consumers.get(t, ())]
        param_owner[k] = min(users) if users else stage_of_layer[layers.names[layers.input_layer[k]]]
        producer[t] = param_owner[k]
    reads = op_reads(graph, op_stage)
    for op in graph.ops:
        for t in reads[op.index]:
            src = producer.get(t)
            if src is not None and src > op_stage[op.index]:
                raise InvalidArgumentError(
                    f"op {op.name} ({op.name_stack}) on stage {op_stage[op.index]} reads a value made on later "
                    f"stage {src}; stages must follow the program order of the layers")
        for t in op.outputs:
            producer[t] = op_stage[op.index]
    loss = graph.outputs[0]
    if producer.get(loss) != len(layouts) - 1:
        raise InvalidArgumentError("the loss must be computed on the last stage")
    batch_ids = set(graph.inputs[n_params:])
    needed_by: dict[int, set[int]] = defaultdict(set)
    for op in graph.ops:
        for t in reads[op.index]:
            if t in producer and producer[t] != op_stage[op.index] and t not in batch_ids:
                needed_by[t].add(op_stage[op.index])
    return Partition(tuple(op_stage), param_owner, producer, needed_by, reads,
                     tuple(name_of[l] for l in layers.op_layer))
