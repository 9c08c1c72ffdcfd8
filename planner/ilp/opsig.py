"""The dimension labels of one op (`OpSig`) and the helpers every sharding rule builds them with.

See `rules.py` for what the labels mean and the registry of rules.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from planner.graph.ir import Graph, Literal, Op, Tensor

Labels = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OpSig:
    """Dimension labels of one op.

    Attributes:
      inputs: labels per operand dimension; `None` for a literal operand.
      outputs: labels per result dimension.
      sizes: extent of each label (for reshape merges, the extent that a split must divide).
      sum_labels: contracted labels whose split yields partial results.
      flops: floating-point operations of the op (for the compute model).
      known: False when produced by the replicated fallback.
      pinned: label -> mesh axis names: the only sharding these labels may take (the user's own
        sharding constraints, shard_map boundaries); labels not listed are free. None: no pins.
      where: what the pins come from, for error messages.
      rate_dtypes: the dtypes whose precision sets the op's FLOP rate when its operands do not
        say it (a fused kernel: its body's matmul operands, not its float32 statistics); () to
        read them from the operands (`strategies.rate_dtypes`).
      fallback: with `known` False, why the op is planned replicated and what the user can do, in
        a few words (a kernel the planner could not see into); "" for a primitive with no rule.
      accumulates: the dtype a contraction accumulates its result in where that is wider than the
        result ("float32" for a bf16 dot, `planner.ilp.wire.accumulates`): split over a mesh axis,
        its partial sums are exact only in it. "" otherwise.
    """

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    sizes: Mapping[str, int]
    sum_labels: frozenset[str] = frozenset()
    flops: float = 0.0
    known: bool = True
    pinned: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    where: str = ""
    rate_dtypes: tuple[str, ...] = ()
    fallback: str = ""
    accumulates: str = ""

    def shardable(self) -> tuple[str, ...]:
        """Labels a mesh axis may be assigned to, in a fixed order."""
        out_labels = {l for labels in self.outputs for l in labels if l is not None}
        return tuple(sorted(l for l in self.sizes if l in out_labels or l in self.sum_labels))


Rule = Callable[[Op, Graph], OpSig]


def tensor_of(graph: Graph, x: int | Literal) -> Tensor:
    return x.tensor if isinstance(x, Literal) else graph.tensors[x]


def dim_labels(prefix: str, shape: tuple[int, ...]) -> tuple[Labels, dict[str, int]]:
    labels = tuple(f"{prefix}{i}" for i in range(len(shape)))
    return labels, {l: s for l, s in zip(labels, shape)}
