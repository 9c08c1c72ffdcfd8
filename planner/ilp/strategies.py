"""Strategies of one op on an N-D mesh, enumerated from its dimension labels, with their costs."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from planner.cost_model import CostModel
from planner.core.errors import MeshError
from planner.graph.ir import Graph, Tensor
from planner.ilp.rules import OpSig
from planner.ilp.wire import (BLOCK, MIN_BLOCK, SCALE_BYTES, block_for, gradient_chunks, partial_sum_itemsize,
                               weight_reads, wire_tensor)
from planner.core.mesh import MeshSpec
from planner.core.sharding import Spec, active_axes, axis_dim, num_shards

# (collective kind, mesh axes, buffer bytes on one device)
Comm = tuple[str, tuple[int, ...], int]
# (reads, writes, FLOP share, kernel dtype): how many times an op reads each operand from device
# memory (once per fusion it runs in; 0 when the value is made inside; a slice its window's share),
# which results it writes there, the share of its FLOPs it runs and the dtype they run at inside a
# fused kernel (None: its operands'), after fusion (`planner.graph.fusion.Traffic.charged`).
Traffic = tuple[tuple[float, ...], tuple[bool, ...], float, "str | None"]


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
      quantise_time: seconds of `compute_time` that quantise an int8 gradient exchange (`int8_reduction`).
    """

    assignment: tuple[tuple[str, tuple[int, ...]], ...]
    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    comms: tuple[Comm, ...]
    compute_time: float
    comm_time: float
    quantise_time: float = 0.0

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


@dataclasses.dataclass(frozen=True, slots=True)
class Quantized:
    """A weight gathered as int8 with block scales (`planner.ilp.wire`): `native` is its type, `wire`
    the int8 payload its gathers carry (`wire.wire_tensor`). Permutes and all-to-alls move it as it
    is; each gather adds the quantisation's memory traffic (`quantize_time`)."""

    native: Tensor
    wire: Tensor


def quantize_time(t: Quantized, src: Spec, dst: Spec, cost: CostModel) -> float:
    """Quantising the source shard (read it, write int8) and dequantising what the gather brought
    (read int8, write the weight's dtype): memory-bound elementwise work on one device."""
    mesh = cost.mesh
    moved = (shard_bytes(t.native, src, mesh) + shard_bytes(t.wire, src, mesh)
             + shard_bytes(t.wire, dst, mesh) + shard_bytes(t.native, dst, mesh))
    return cost.compute_time(0.0, moved)


def _spec_of(labels: Sequence[str | None], axes_of: dict[str, tuple[int, ...]]) -> Spec:
    return tuple(axes_of.get(l, ()) if l is not None else () for l in labels)


def rate_dtypes(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor]) -> tuple[np.dtype, ...]:
    """The values whose precision sets an op's FLOP rate (`cost_model.peak_flops`).

    A contraction (dot, convolution) runs at the rate of its operands, whatever it accumulates into;
    other ops at the rate of their results; a fused kernel at its body's matmuls' (`OpSig.rate_dtypes`).
    A contraction is recognised from its signature: two or
    more array operands and at least one multiply-add (2 FLOPs) per result element; the rules count
    one FLOP per element for elementwise ops and reductions.
    """
    if sig.rate_dtypes:
        return tuple(np.dtype(d) for d in sig.rate_dtypes)
    arrays = [t for t in ins if t is not None]
    return tuple(t.dtype for t in (arrays if is_contraction(sig, ins, outs) else outs) if isinstance(t.dtype, np.dtype))


def is_contraction(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor]) -> bool:
    """A dot or convolution, recognised from its signature (see `rate_dtypes`): one kernel of its own
    (XLA fuses elementwise neighbours into it, never another contraction), so it pays the launch floor."""
    arrays = [t for t in ins if t is not None]
    return len(arrays) >= 2 and sig.flops > 0 and sig.flops >= 2 * sum(t.size for t in outs)


def gemm_narrow_dim(sig: OpSig, axes_of: dict[str, tuple[int, ...]], mesh: MeshSpec) -> int | None:
    """The narrowest dimension of one batch element of a batched contraction, per device, for the
    attention-shape rate (`cost_model.hardware.matmul_rate`); None when the op is not a batched contraction.

    Read from the labels alone: labels in both operands and the result are batch dimensions, labels
    in both operands and contracted are the contracted length K, labels in one operand and the
    result are that operand's rows M (first operand) or columns N (second). A split label counts its
    per-device share.
    """
    if len(sig.inputs) != 2 or any(l is None for l in sig.inputs) or len(sig.outputs) != 1:
        return None
    lhs = {l for l in sig.inputs[0] if l is not None}
    rhs = {l for l in sig.inputs[1] if l is not None}
    out = {l for l in sig.outputs[0] if l is not None}
    if not lhs & rhs & out:
        return None

    def extent(labels) -> int:
        return math.prod(sig.sizes[l] // mesh.axis_size(axes_of.get(l, ())) for l in labels)

    return min(extent(lhs & rhs & sig.sum_labels), extent((lhs - rhs) & out), extent((rhs - lhs) & out))


def causal_imbalance(sig: OpSig, axes_of: dict[str, tuple[int, ...]], mesh: MeshSpec,
                     lengths: tuple[int, ...]) -> float:
    """How much more than an equal share of a fused causal attention matmul's work the busiest
    device does when the plan splits the scores' query and key sequences into n_q x n_k contiguous
    blocks: the kernel skips the key blocks above the diagonal, so the device holding the last
    queries (or the first keys) has the most to do. The largest block's area under the diagonal over
    an equal share of the triangle (`causal_block_share`): (2n - 1) / n for one sequence split n
    ways, 2 for both split in two. The two sequence labels are the matmul's non-batch labels of the
    scores' lengths (queries and keys of equal length; 1 where they cannot be told from the head
    dimension, which then has the same length, or the lengths differ)."""
    if len(lengths) != 2 or lengths[0] != lengths[1] or len(sig.inputs) != 2 or any(l is None for l in sig.inputs):
        return 1.0
    lhs, rhs = set(sig.inputs[0]), set(sig.inputs[1])
    out = {l for labels in sig.outputs for l in labels}
    seq = [l for l in sorted((lhs | rhs) - (lhs & rhs & out)) if sig.sizes[l] == lengths[0]]
    if len(seq) != 2:
        return 1.0
    return causal_block_share(*(mesh.axis_size(axes_of.get(l, ())) for l in seq))


def causal_block_share(n_rows: int, n_cols: int) -> float:
    """The largest of n_rows x n_cols equal blocks of the unit square's lower triangle {col <= row}
    (area 1/2), over an equal share of it: 1 / (2 n_rows n_cols)."""
    def area(r0: float, r1: float, c0: float, c1: float) -> float:
        # integral over rows r in [r0, r1] of |[c0, c1] & [0, r]| = clamp(r - c0, 0, c1 - c0)
        def f(r: float) -> float:  # antiderivative of clamp(r - c0, 0, w), w = c1 - c0
            w = c1 - c0
            if r <= c0:
                return 0.0
            if r <= c1:
                return (r - c0) ** 2 / 2
            return w * w / 2 + w * (r - c1)
        return f(r1) - f(r0)

    largest = max(area(i / n_rows, (i + 1) / n_rows, j / n_cols, (j + 1) / n_cols)
                  for i in range(n_rows) for j in range(n_cols))
    return largest * 2 * n_rows * n_cols


def _build(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor], axes_of: dict[str, tuple[int, ...]],
           cost: CostModel, combined: bool = False, traffic: Traffic | None = None) -> list[Strategy]:
    """Strategies for one label->axes assignment: all-reduce, or reduce-scatter onto a result dim.

    `traffic`: (reads, writes, FLOP share, kernel dtype): `planner.graph.fusion.Traffic.charged`: each
    operand is charged memory time as many times as the op reads it from device memory, each result
    when it is written there, its FLOPs times the share it runs, at the kernel dtype's rate when
    given (None: every operand once, every result, every FLOP, at its operands' rate)."""
    mesh = cost.mesh
    in_specs = tuple(None if l is None else _spec_of(l, axes_of) for l in sig.inputs)
    base_out = tuple(_spec_of(l, axes_of) for l in sig.outputs)
    partial = tuple(sorted(a for l in sig.sum_labels for a in axes_of.get(l, ())))
    split = math.prod(mesh.axis_size(v) for v in axes_of.values())
    reads, writes, share, kernel_dtype, causal = traffic if traffic is not None else (
        (1,) * len(ins), (True,) * len(outs), 1.0, None, ())
    if causal:  # a fused causal attention's matmul split along its sequences: the busiest device's share
        share *= causal_imbalance(sig, axes_of, mesh, causal)
    moved = sum(shard_bytes(t, s, mesh) * r for t, s, r in zip(ins, in_specs, reads)
                if r and t is not None and s is not None)
    moved += sum(shard_bytes(t, s, mesh) for t, s, w in zip(outs, base_out, writes) if w)
    contraction = is_contraction(sig, ins, outs)
    dtypes = (np.dtype(kernel_dtype),) if kernel_dtype else rate_dtypes(sig, ins, outs)
    compute = cost.compute_time(sig.flops * share / split, moved, dtypes, kernels=int(contraction),
                                narrow=gemm_narrow_dim(sig, axes_of, mesh) if contraction and not kernel_dtype else None)
    assignment = tuple(sorted(axes_of.items()))
    if not partial:
        return [Strategy(assignment, in_specs, base_out, (), compute, 0.0)]
    result = []
    # the partial sums' bytes on the wire: float32 where the contraction accumulates in it and the
    # plan keeps it exact (`planner.ilp.wire`), else the result's own dtype
    wide = [shard_bytes(t, s, mesh) * partial_sum_itemsize(sig.accumulates, t, cost.comm_precision)
            // t.dtype.itemsize for t, s in zip(outs, base_out)]
    n = mesh.axis_size(partial)
    # gradients exchanged as int8 (ZeRO++'s qgZ, `planner.ilp.wire`): a contraction's partial sums
    # that feed no matmul, under comm_precision "int8"
    qgz = cost.comm_precision == "int8" and combined and bool(sig.accumulates) and len(outs) == 1
    ar = tuple(("all-reduce", partial, b) for b in wide)
    result.append(Strategy(assignment, in_specs, base_out, ar, compute,
                           sum(cost.collective_time(k, b, a, combined) for k, a, b in ar)))
    if qgz and gradient_chunks(outs[0].shape, base_out[0], n) is not None:  # beside it (`enumerate_strategies`)
        ar8, extra = int8_reduction("all-reduce", outs[0], base_out[0], partial, cost)
        result.append(Strategy(assignment, in_specs, base_out, ar8, compute + extra,
                               sum(cost.collective_time(k, b, a, combined) for k, a, b in ar8), extra))
    if len(outs) == 1:
        t, s = outs[0], base_out[0]
        for d in range(len(t.shape)):
            have = mesh.axis_size(s[d])
            if (t.shape[d] // have) % n == 0:
                new = tuple(tuple(sorted(ax + partial)) if i == d else ax for i, ax in enumerate(s))
                variants = [((("reduce-scatter", partial, wide[0]),), 0.0)]  # both kept (`enumerate_strategies`)
                if qgz and gradient_chunks(t.shape, s, n, d) == d:
                    variants.append(int8_reduction("reduce-scatter", t, s, partial, cost))
                for rs, extra in variants:
                    result.append(Strategy(assignment, in_specs, (new,), rs, compute + extra,
                                           cost.collective_time("reduce-scatter", rs[0][2], partial, combined), extra))
    return result


def int8_payload(t: Tensor, spec: Spec, mesh: MeshSpec) -> int:
    """Bytes of one device's partial sums of `t` (laid out as `spec` before the reduction) as int8
    with a bf16 scale per `wire.BLOCK` elements: what its int8 exchange carries."""
    elems = t.size // num_shards(spec, mesh)
    return elems + SCALE_BYTES * elems // BLOCK


def int8_reduction(kind: str, t: Tensor, spec: Spec, partial: tuple[int, ...], cost: CostModel) -> tuple[tuple[Comm, ...], float]:
    """A gradient's partial sums reduced as int8 chunks (`planner.emit.wire.reduce_int8`): priced as
    the ring collective `kind` of the int8 payload (the all-to-all of qgZ moves the (n - 1) / n of
    it a ring reduce-scatter moves; an all-reduce adds the int8 all-gather), and the quantisation's
    memory traffic on the device: the float32 partial sums read and quantised, the n chunks received
    dequantised and summed, for an all-reduce the reduced chunk quantised again and the gathered
    chunks dequantised into the result."""
    mesh = cost.mesh
    elems = t.size // num_shards(spec, mesh)
    n = mesh.axis_size(partial)
    payload = int8_payload(t, spec, mesh)
    traffic = elems * (4 + 1) + payload + elems // n * 4
    if kind == "all-reduce":
        traffic += elems // n * (4 + 1) + payload + elems * t.dtype.itemsize
    return ((kind, partial, payload),), cost.compute_time(0.0, traffic)


def enumerate_strategies(sig: OpSig, ins: Sequence[Tensor | None], outs: Sequence[Tensor], cost: CostModel,
                         full_split_only: bool = False, combined: bool = False,
                         traffic: Traffic | None = None) -> list[Strategy]:
    """Every assignment of active mesh axes to shardable labels that divides evenly.

    Args:
      sig: the op's labels.
      ins / outs: operand types (None for literals) and result types.
      cost: the cost model (mesh, collective and compute times).
      full_split_only: keep only strategies that use every mesh axis when any exist (for heavy ops,
        where leaving an axis idle replicates expensive compute; Alpa makes the same cut).
      combined: the op's reductions can be combined with others (no latency term).
      traffic: the op's memory reads and writes after fusion (`_build`).
    """
    mesh = cost.mesh
    if sig.pinned is not None:
        fixed = pinned_axes(sig, mesh)
        if all(l in fixed for l in sig.shardable()):
            return _build(sig, ins, outs, fixed, cost, combined, traffic)
    labels = sig.shardable()
    axes = active_axes(mesh)
    found: dict[tuple, Strategy] = {}
    int8 = cost.comm_precision == "int8" and combined
    for choice in itertools.product(range(-1, len(labels)), repeat=len(axes)):
        axes_of: dict[str, tuple[int, ...]] = {}
        for a, c in zip(axes, choice):
            if c >= 0:
                axes_of[labels[c]] = axes_of.get(labels[c], ()) + (a,)
        if any(sig.sizes[l] % mesh.axis_size(v) for l, v in axes_of.items()):
            continue
        if sig.pinned is not None and any(axes_of.get(l, ()) != v for l, v in fixed.items()):
            continue
        for s in _build(sig, ins, outs, axes_of, cost, combined, traffic):
            # an int8 gradient exchange stays beside the native one: it trades compute for
            # communication, which the objective may hide behind compute (`ilp.objective`)
            key = (s.in_specs, s.out_specs) + ((s.comms,) if int8 else ())
            if key not in found or s.cost < found[key].cost:
                found[key] = s
    strategies = list(found.values())
    if full_split_only:
        full = [s for s in strategies if sum(len(v) for _, v in s.assignment) == len(axes)]
        if full:
            strategies = full
    return strategies


def pinned_axes(sig: OpSig, mesh: MeshSpec) -> dict[str, tuple[int, ...]]:
    """The pinned labels' mesh axes (indices; axes of size 1 dropped), checked against the mesh."""
    out: dict[str, tuple[int, ...]] = {}
    for label, names in sig.pinned or ():
        missing = [n for n in names if n not in mesh.axis_names]
        if missing:
            raise MeshError(f"{sig.where} names mesh axis {missing[0]!r}, which mesh {mesh} "
                            f"(axes {', '.join(mesh.axis_names)}) does not have")
        axes = tuple(mesh.axis_names.index(n) for n in names if mesh.shape[mesh.axis_names.index(n)] > 1)
        if sig.sizes.get(label, 1) % mesh.axis_size(axes):
            raise MeshError(f"{sig.where} splits a dimension of size {sig.sizes.get(label, 1)} over "
                            f"{'*'.join(names)} ({mesh.axis_size(axes)} devices), which does not divide it")
        out[label] = axes
    return out


def follow(sig: OpSig, operand: int, spec: Spec, ins: Sequence[Tensor | None], outs: Sequence[Tensor],
           cost: CostModel, combined: bool = False, traffic: Traffic | None = None) -> tuple[Strategy, tuple[Comm, ...]]:
    """The strategy of a one-operand op that keeps its operand's sharding as far as the op allows.

    Axes that split an operand dimension the op cannot keep split are gathered first (returned as
    the extra collectives); partial sums are all-reduced.
    """
    mesh = cost.mesh
    labels = sig.inputs[operand]
    assert labels is not None
    axes_of: dict[str, tuple[int, ...]] = {}
    gathered: list[int] = []
    fixed = pinned_axes(sig, mesh) if sig.pinned is not None else {}
    taken = {a for v in fixed.values() for a in v}
    for d, axes in enumerate(spec):
        lab = labels[d]
        if not axes or lab in fixed:
            continue
        if lab is None or sig.sizes[lab] % mesh.axis_size(axes) or taken & set(axes):
            gathered.extend(axes)
        else:
            axes_of[lab] = axes
    if sig.pinned is not None:  # the operand is resharded to the pinned layout
        axes_of.update(fixed)
        strategy = _build(sig, ins, outs, axes_of, cost, combined, traffic)[0]
        t = ins[operand]
        assert t is not None
        return strategy, _transitions(t, spec, strategy.in_specs[operand], cost)[0]
    pre: tuple[Comm, ...] = ()
    if gathered:
        kept = tuple(tuple(a for a in axes if a not in gathered) for axes in spec)
        t = ins[operand]
        assert t is not None
        pre = (("all-gather", tuple(sorted(gathered)), shard_bytes(t, kept, mesh)),)
    strategy = _build(sig, ins, outs, axes_of, cost, combined, traffic)[0]
    return strategy, pre


def _gather_order(src: Spec, axes: Sequence[int]) -> list[int]:
    """The order XLA gathers several axes in (read back from compiled HLO): the last tensor dim
    first, and within a dim split by several axes the minor axis first."""
    def key(a: int) -> tuple[int, int]:
        d = axis_dim(src, a)
        assert d is not None
        return -d, -src[d].index(a)
    return sorted(axes, key=key)


def _transitions(t: Tensor | Quantized, src: Spec, dst: Spec, cost: CostModel) -> tuple[tuple[Comm, ...], float]:
    """The collectives that take `src` to `dst`, and their time:

    - a collective-permute per dim whose kept axes are not a prefix of its source axes (a major
      axis leaves a dim split by several, so the minor axes' blocks are out of order);
    - an all-to-all on the shard per axis that moves to another dim;
    - the axes that stop splitting the tensor gathered in `_gather_order`, those leaving one dim
      together as one all-gather over their combined group (XLA emits one; priced as one, at the
      group's slowest link, so the same layouts cost the same on a mesh and on its refinement:
      two gathers of 2 devices priced apart paid two latency rounds where one ring of 4 pays
      three, and made gpt2-small's 2x4 plan 1% cheaper on 2x2x2), each group on the buffer the
      previous groups left. Their ring bytes sum to (g - 1) / g of the gathered size.
    """
    mesh = cost.mesh
    quantized = t if isinstance(t, Quantized) else None
    if quantized is not None:
        t = quantized.native
    nbytes = shard_bytes(t, src, mesh)
    comms: list[Comm] = []
    total = 0.0
    for s_axes, d_axes in zip(src, dst):
        kept = [a for a in s_axes if a in d_axes]
        if kept and tuple(kept) != s_axes[: len(kept)]:
            moved = tuple(a for a in s_axes[: s_axes.index(kept[-1])] if a not in kept)
            comms.append(("collective-permute", moved, nbytes))
            total += cost.collective_time("collective-permute", nbytes, moved)
    leaving = []
    for a in active_axes(mesh):
        frm, to = axis_dim(src, a), axis_dim(dst, a)
        if frm is None or frm == to:
            continue
        if to is None:
            leaving.append(a)
        else:
            comms.append(("all-to-all", (a,), nbytes))
            total += cost.collective_time("all-to-all", nbytes, (a,))
    size = shard_bytes(quantized.wire if quantized else t, src, mesh)
    groups: list[tuple[int | None, list[int], int]] = []  # (dim, axes, gathered bytes)
    for a in _gather_order(src, leaving):
        size *= mesh.shape[a]
        d = axis_dim(src, a)
        if groups and groups[-1][0] == d:
            groups[-1] = (d, groups[-1][1] + [a], size)
        else:
            groups.append((d, [a], size))
    for d, axes, gathered in groups:
        group = tuple(a for a in src[d] if a in axes)
        comms.append(("all-gather", group, gathered))
        total += cost.collective_time("all-gather", gathered, group)
    if groups and quantized is not None:
        total += quantize_time(quantized, src, dst, cost)
    return tuple(comms), total


def _gather_time(t: Tensor | Quantized, src: Spec, axes: Sequence[int], cost: CostModel) -> float:
    """Time to take exactly `axes` out of `src` (all-gathers, and the permute a kept minor axis needs)."""
    dst = tuple(tuple(a for a in dim if a not in axes) for dim in src)
    return _transitions(t, src, dst, cost)[1]


def reshard_axis_cost(t: Tensor | Quantized, src: Spec, axis: int, to_dim: int | None, cost: CostModel) -> tuple[Comm | None, float]:
    """Cost of changing what mesh `axis` splits, from its dim in `src` to `to_dim` (None = no dim),
    the other axes staying where they are.

    An axis that stops splitting the tensor is an all-gather of the shard, one that moves to another
    dimension is an all-to-all, one that starts splitting is a free slice.
    """
    mesh = cost.mesh
    frm = axis_dim(src, axis)
    if frm is None or frm == to_dim:
        return None, 0.0
    if to_dim is None:
        gathered = shard_bytes(t.wire if isinstance(t, Quantized) else t, src, mesh) * mesh.shape[axis]
        return ("all-gather", (axis,), gathered), _gather_time(t, src, (axis,), cost)
    if isinstance(t, Quantized):
        t = t.native
    nbytes = shard_bytes(t, src, mesh)
    # Taking a major axis out of a dim split by several leaves the minor axes' blocks out of order:
    # XLA first permutes the shards (collective-permute), then exchanges. Assumes the minor axes stay.
    reorder = cost.collective_time("collective-permute", nbytes, (axis,)) if src[frm][-1] != axis else 0.0
    return ("all-to-all", (axis,), nbytes), cost.collective_time("all-to-all", nbytes, (axis,)) + reorder


def edge_parts(mesh: MeshSpec) -> tuple[tuple[int, ...], ...]:
    """The parts the ILP splits an edge's resharding cost into: each active mesh axis alone, then
    each group of two or more active axes (what gathering them together costs beyond their parts)."""
    axes = active_axes(mesh)
    return tuple(c for k in range(1, len(axes) + 1) for c in itertools.combinations(axes, k))


def part_key(part: tuple[int, ...], dst: Spec) -> int | bool | None:
    """What of the consumer's spec `dst` a part's cost depends on: the dim of a single axis (None: no
    dim), for a group whether none of its axes splits `dst`."""
    if len(part) == 1:
        return axis_dim(dst, part[0])
    return all(axis_dim(dst, a) is None for a in part)


def part_time(t: Tensor | Quantized, src: Spec, part: tuple[int, ...], key: int | bool | None, cost: CostModel) -> float:
    """The cost of one part of `edge_parts` given its `part_key` (`_part_time`), computed once per
    cost model (`CostModel.part_times`: the layer ILPs of a stage table ask the same questions of
    their mesh's model, GPT-39B on 8x8 V100s ~95% of them)."""
    k = (t, src, part, key)
    found = cost.part_times.get(k)
    if found is None:
        found = cost.part_times[k] = _part_time(t, src, part, key, cost)
    return found


def _part_time(t: Tensor | Quantized, src: Spec, part: tuple[int, ...], key: int | bool | None, cost: CostModel) -> float:
    """The cost of one part of `edge_parts` given its `part_key`.

    A single axis costs `reshard_axis_cost`. A group leaving together costs the Moebius term
    sum over its subsets B of (-1)^(|group| - |B|) gather_time(B): summed over every group of the
    axes L that leave, the parts add up to gather_time(L) exactly, the ring all-gather over the
    combined group (each axis gathers the buffer the previous axes' gathers left). Per-axis parts
    alone would price every axis's gather from the original shard (2x4 mesh, both axes leaving: 4
    shard sizes moved instead of 7).
    """
    if len(part) == 1:
        return reshard_axis_cost(t, src, part[0], key, cost)[1]
    if not key or any(axis_dim(src, a) is None for a in part):
        return 0.0
    return sum((-1) ** (len(part) - k) * _gather_time(t, src, sub, cost)
               for k in range(1, len(part) + 1) for sub in itertools.combinations(part, k))


def edge_time(t: Tensor | Quantized, src: Spec, dst: Spec, cost: CostModel) -> float:
    """Resharding time from `src` to `dst`: the sum of `part_time` over `edge_parts`, the number the
    ILP's objective holds for the edge and the plan's prediction reports.

    Exact (equal to the time of `_transitions`) when the change is gathers only, or moves only, or
    one axis; when axes move and others leave one dim together the permute is priced per axis.
    """
    return sum(part_time(t, src, p, part_key(p, dst), cost) for p in edge_parts(cost.mesh))


def reshard_cost(t: Tensor | Quantized, src: Spec, dst: Spec, cost: CostModel) -> tuple[tuple[Comm, ...], float]:
    """Resharding collectives (as XLA emits them, see `_transitions`) and time (`edge_time`, as the
    ILP prices the edge) from `src` to `dst`."""
    comms, _ = _transitions(t, src, dst, cost)
    return comms, edge_time(t, src, dst, cost)


def int8_reads(graph: Graph, cost: CostModel) -> frozenset[tuple[int, int]]:
    """The weight reads (`wire.weight_reads`) gathered as int8 under comm_precision="int8": those of
    weights whose gather over each active mesh axis and over all of them (from the layout splitting
    their largest dimension that all of them divide) is faster as int8, quantisation included, and
    whose blocks hold at least `wire.MIN_BLOCK` elements (the format is the tensor's: every layout
    the ILP weighs is priced with it, so it must not make any of its gathers dearer)."""
    if cost.comm_precision != "int8":
        return frozenset()
    reads = weight_reads(graph)
    pays: dict[int, bool] = {}
    for tensor, _ in reads:
        if tensor not in pays:
            pays[tensor] = _int8_pays(graph.tensors[tensor], cost)
    return frozenset(r for r in reads if pays[r[0]])


def _int8_pays(t: Tensor, cost: CostModel) -> bool:
    mesh = cost.mesh
    axes = tuple(active_axes(mesh))
    n = mesh.axis_size(axes)
    dims = [d for d in sorted(range(len(t.shape)), key=lambda d: -t.shape[d]) if t.shape[d] % n == 0]
    if not axes or not dims or block_for(t, mesh.size) < MIN_BLOCK:
        return False
    q = Quantized(t, wire_tensor(t, mesh.size))
    dst: Spec = tuple(() for _ in t.shape)
    # every axis alone and all of them together: no gather the ILP may pick is dearer as int8
    for group in [(a,) for a in axes if t.shape[dims[0]] % mesh.shape[a] == 0] + [axes]:
        src = tuple(group if d == dims[0] else () for d in range(len(t.shape)))
        if edge_time(q, src, dst, cost) >= edge_time(t, src, dst, cost):
            return False
    return True
