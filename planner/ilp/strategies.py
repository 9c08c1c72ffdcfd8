"""Strategies of one op on an N-D mesh, enumerated from its dimension labels, with their costs."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from planner.cost_model import CostModel
from planner.graph import Tensor
from planner.ilp.rules import OpSig
from planner.mesh import MeshSpec
from planner.sharding import Spec, active_axes, axis_dim, num_shards

# (collective kind, mesh axes, buffer bytes on one device)
Comm = tuple[str, tuple[int, ...], int]


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op: what each operand must look like, what the results look like, what it costs.

    Attributes:
      assignment: label -> mesh axes splitting it (the human-readable essence of the strategy).
      in_specs: required spec per operand (None for literals).
      out_specs: spec per result.
      comms: collectives the op itself performs (partial-sum reductions).
      compute_time: seconds of local compute.
      comm_time: seconds of `comms`.
    """

    assignment: tuple[tuple[str, tuple[int, ...]], ...]
    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    comms: tuple[Comm, ...]
    compute_time: float
    comm_time: float

    @property
    def cost(self) -> float:
        return self.compute_time + self.comm_time

    def describe(self, mesh: MeshSpec) -> str:
        parts = [f"{l}->{'*'.join(mesh.axis_names[a] for a in axes)}" for l, axes in self.assignment if axes]
        for kind, axes, nbytes in self.comms:
            parts.append(f"{kind}[{'*'.join(mesh.axis_names[a] for a in axes)}]({nbytes}B)")
        return ", ".join(parts) or "replicated"


def shard_bytes(t: Tensor, spec: Spec, mesh: MeshSpec) -> int:
    return t.nbytes // num_shards(spec, mesh)


def _spec_of(labels: Sequence[str | None], axes_of: dict[str, tuple[int, ...]]) -> Spec:
    return tuple(axes_of.get(l, ()) if l is not None else () for l in labels)


def _build(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor], axes_of: dict[str, tuple[int, ...]],
           cost: CostModel, combined: bool = False) -> list[Strategy]:
    """Strategies for one label->axes assignment: all-reduce, or reduce-scatter onto a result dim."""
    mesh = cost.mesh
    in_specs = tuple(None if l is None else _spec_of(l, axes_of) for l in sig.inputs)
    base_out = tuple(_spec_of(l, axes_of) for l in sig.outputs)
    partial = tuple(sorted(a for l in sig.sum_labels for a in axes_of.get(l, ())))
    split = math.prod(mesh.axis_size(v) for v in axes_of.values())
    moved = sum(shard_bytes(t, s, mesh) for t, s in zip(ins, in_specs) if t is not None and s is not None)
    moved += sum(shard_bytes(t, s, mesh) for t, s in zip(outs, base_out))
    dtype = outs[0].dtype if outs and isinstance(outs[0].dtype, np.dtype) else None
    compute = cost.compute_time(sig.flops / split, moved, dtype)
    assignment = tuple(sorted(axes_of.items()))
    if not partial:
        return [Strategy(assignment, in_specs, base_out, (), compute, 0.0)]
    result = []
    ar = tuple(("all-reduce", partial, shard_bytes(t, s, mesh)) for t, s in zip(outs, base_out))
    result.append(Strategy(assignment, in_specs, base_out, ar, compute,
                           sum(cost.collective_time(k, b, a, combined) for k, a, b in ar)))
    if len(outs) == 1:
        t, s = outs[0], base_out[0]
        n = mesh.axis_size(partial)
        for d in range(len(t.shape)):
            have = mesh.axis_size(s[d])
            if (t.shape[d] // have) % n == 0:
                new = tuple(tuple(sorted(ax + partial)) if i == d else ax for i, ax in enumerate(s))
                rs = (("reduce-scatter", partial, shard_bytes(t, s, mesh)),)
                result.append(Strategy(assignment, in_specs, (new,), rs, compute,
                                       cost.collective_time("reduce-scatter", rs[0][2], partial, combined)))
    return result


def enumerate_strategies(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor], cost: CostModel,
                         full_split_only: bool = False, combined: bool = False) -> list[Strategy]:
    """Every assignment of active mesh axes to shardable labels that divides evenly.

    Args:
      sig: the op's labels.
      ins / outs: operand types (None for literals) and result types.
      cost: the cost model (mesh, collective and compute times).
      full_split_only: keep only strategies that use every mesh axis when any exist (for heavy ops,
        where leaving an axis idle replicates expensive compute; Alpa makes the same cut).
      combined: the op's reductions can be combined with others (no latency term).
    """
    mesh = cost.mesh
    labels = sig.shardable()
    axes = active_axes(mesh)
    found: dict[tuple, Strategy] = {}
    for choice in itertools.product(range(-1, len(labels)), repeat=len(axes)):
        axes_of: dict[str, tuple[int, ...]] = {}
        for a, c in zip(axes, choice):
            if c >= 0:
                axes_of[labels[c]] = axes_of.get(labels[c], ()) + (a,)
        if any(sig.sizes[l] % mesh.axis_size(v) for l, v in axes_of.items()):
            continue
        for s in _build(sig, ins, outs, axes_of, cost, combined):
            key = (s.in_specs, s.out_specs)
            if key not in found or s.cost < found[key].cost:
                found[key] = s
    strategies = list(found.values())
    if full_split_only:
        full = [s for s in strategies if sum(len(v) for _, v in s.assignment) == len(axes)]
        if full:
            strategies = full
    return strategies


def follow(sig: OpSig, operand: int, spec: Spec, ins: Sequence[Tensor | None], outs: Sequence[Tensor],
           cost: CostModel, combined: bool = False) -> tuple[Strategy, tuple[Comm, ...]]:
    """The strategy of a one-operand op that keeps its operand's sharding as far as the op allows.

    Axes that split an operand dimension the op cannot keep split are gathered first (returned as
    the extra collectives); partial sums are all-reduced.
    """
    mesh = cost.mesh
    labels = sig.inputs[operand]
    assert labels is not None
    axes_of: dict[str, tuple[int, ...]] = {}
    gathered: list[int] = []
    for d, axes in enumerate(spec):
        lab = labels[d]
        if not axes:
            continue
        if lab is None or sig.sizes[lab] % mesh.axis_size(axes):
            gathered.extend(axes)
        else:
            axes_of[lab] = axes
    pre: tuple[Comm, ...] = ()
    if gathered:
        kept = tuple(tuple(a for a in axes if a not in gathered) for axes in spec)
        t = ins[operand]
        assert t is not None
        pre = (("all-gather", tuple(sorted(gathered)), shard_bytes(t, kept, mesh)),)
    strategy = _build(sig, ins, outs, axes_of, cost, combined)[0]
    return strategy, pre


def reshard_axis_cost(t: Tensor, src: Spec, axis: int, to_dim: int | None, cost: CostModel) -> tuple[Comm | None, float]:
    """Cost of changing what mesh `axis` splits, from its dim in `src` to `to_dim` (None = no dim).

    Resharding is costed axis by axis: an axis that stops splitting the tensor is an all-gather,
    one that moves to another dimension is an all-to-all, one that starts splitting is a free slice.
    """
    mesh = cost.mesh
    frm = axis_dim(src, axis)
    if frm is None or frm == to_dim:
        return None, 0.0
    nbytes = shard_bytes(t, src, mesh)
    # Taking a major axis out of a dim split by several leaves the minor axes' blocks out of order:
    # XLA first permutes the shards (collective-permute), then gathers. Assumes the minor axes stay.
    reorder = cost.collective_time("collective-permute", nbytes, (axis,)) if src[frm][-1] != axis else 0.0
    if to_dim is None:
        gathered = nbytes * mesh.shape[axis]
        return ("all-gather", (axis,), gathered), cost.collective_time("all-gather", gathered, (axis,)) + reorder
    return ("all-to-all", (axis,), nbytes), cost.collective_time("all-to-all", nbytes, (axis,)) + reorder


def edge_time(t: Tensor, src: Spec, dst: Spec, cost: CostModel) -> float:
    """The ILP's resharding time from `src` to `dst`: the sum of `reshard_axis_cost` over mesh axes."""
    return sum(reshard_axis_cost(t, src, a, axis_dim(dst, a), cost)[1] for a in active_axes(cost.mesh))


def reshard_cost(t: Tensor, src: Spec, dst: Spec, cost: CostModel) -> tuple[tuple[Comm, ...], float]:
    """Total resharding collectives and time from `src` to `dst`.

    Per mesh axis as in `reshard_axis_cost`, except that the shard reordering is predicted exactly:
    one collective-permute per dim whose kept axes are not a prefix of its source axes.
    """
    comms, total = [], 0.0
    mesh = cost.mesh
    for d, (s_axes, d_axes) in enumerate(zip(src, dst)):
        kept = [a for a in s_axes if a in d_axes]
        if kept and tuple(kept) != s_axes[: len(kept)]:
            nbytes = shard_bytes(t, src, mesh)
            moved = tuple(a for a in s_axes[: s_axes.index(kept[-1])] if a not in kept)
            comms.append(("collective-permute", moved, nbytes))
            total += cost.collective_time("collective-permute", nbytes, moved)
    for a in active_axes(mesh):
        frm, to = axis_dim(src, a), axis_dim(dst, a)
        if frm is None or frm == to:
            continue
        nbytes = shard_bytes(t, src, mesh)
        if to is None:
            c = ("all-gather", (a,), nbytes * mesh.shape[a])
        else:
            c = ("all-to-all", (a,), nbytes)
        comms.append(c)
        total += cost.collective_time(c[0], c[2], c[1])
    return tuple(comms), total
