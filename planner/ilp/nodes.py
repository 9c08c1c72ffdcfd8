"""The ILP's records: a decision (`Node`, one strategy to pick) and a resharding edge (`Edge`)."""
from __future__ import annotations

import dataclasses

from planner.core.sharding import Spec
from planner.ilp.strategies import Comm


@dataclasses.dataclass(slots=True)
class Node:
    """One decision of the ILP: pick one of `costs` (one entry per strategy).

    Attributes:
      index: position in `Problem.nodes`.
      label: what the node is (input path or op name and module path).
      costs: seconds per strategy (own compute + own collectives + those of its followers).
      comms: collectives per strategy (for predictions and explanations).
      owned: tensor id -> spec per strategy, for every tensor whose sharding this node decides.
      requires: (tensor id, required spec per strategy, operand position) for each array operand of
        the root op.
      ops: op indices decided by this node (root op first, then followers).
      descriptions: per strategy, the root op's strategy in words.
      free_requires: (free tensor id, spec per strategy) wanted of free operands (iotas, masks), so
        emission can materialise them directly in the layout their consumers use.
      comm_s: per strategy, the seconds of `costs` that are its own collectives (the rest is compute).
      comm_times: per strategy, the seconds of each entry of `comms` as `costs` counts it (they sum
        to `comm_s`); decision records carry them.
      combined: per strategy, the (kind, axes) groups its combinable collectives join; each group's
        latency is paid once per step (`ilp.objective`), not per collective.
      async_s: per strategy, the seconds of `comm_s` that XLA's latency-hiding scheduler can run
        beside later compute (the combinable collectives: gradient reductions).
      comm_ops: per strategy, the op index that performs each entry of `comms` (the memory model
        places a reduction's buffers at its op, `ilp.liveness.memory_profile`).
      quantise_s: per strategy, the seconds of its compute that quantise an int8 gradient exchange
        (paid with the exchange: once per step where the exchange is, `mesh_plan.reductions_weighed`).
    """

    index: int
    label: str
    costs: list[float]
    comms: list[list[Comm]]
    owned: dict[int, list[Spec]]
    requires: list[tuple[int, list[Spec], int]]
    ops: list[int]
    descriptions: list[str]
    free_requires: list[tuple[int, list[Spec]]] = dataclasses.field(default_factory=list)
    comm_s: list[float] = dataclasses.field(default_factory=list)
    combined: list[frozenset[tuple[str, tuple[int, ...]]]] = dataclasses.field(default_factory=list)
    comm_times: list[list[float]] = dataclasses.field(default_factory=list)
    async_s: list[float] = dataclasses.field(default_factory=list)
    comm_ops: list[list[int]] = dataclasses.field(default_factory=list)
    quantise_s: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.quantise_s:
            self.quantise_s = [0.0] * len(self.costs)
        if not self.comm_ops:
            self.comm_ops = [[self.ops[0] if self.ops else -1] * len(c) for c in self.comms]
        if not self.async_s:
            self.async_s = [0.0] * len(self.costs)
        if not self.comm_times:
            self.comm_times = [[0.0] * len(c) for c in self.comms]
        if not self.comm_s:
            self.comm_s = [0.0] * len(self.costs)
        if not self.combined:
            self.combined = [frozenset()] * len(self.costs)

    @property
    def size(self) -> int:
        return len(self.costs)


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
    """Tensor `tensor` produced under node `src`'s choice and read as operand `pos` of op `op` under
    node `dst`'s choice (op -1: a pinned output handed back in the layout of input node `dst`)."""

    src: int
    dst: int
    tensor: int
    src_specs: tuple[Spec, ...]
    dst_specs: tuple[Spec, ...]
    op: int = -1
    pos: int = -1
