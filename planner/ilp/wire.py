"""Wire formats: the dtype each collective carries (`PlanOptions.comm_precision`).

Two choices are made here, both priced by the cost model and emitted by `planner.emit.wire`:

- **Partial sums of a split contraction.** A dot or convolution whose contracted dimension a mesh
  axis splits leaves each device a partial sum; XLA reduces them across the axis. The unsharded
  contraction of bf16 (or fp16) operands accumulates in float32 and rounds its result once (XLA on
  CPU and GPU, cuBLAS, the TPU MXU); sharded as traced, each device rounds its partial sum to bf16
  and the sum is taken of rounded shares (in bf16 on GPU and TPU; XLA:CPU promotes the all-reduce
  to float32, the shares rounded already): results one bf16 ulp away from the unsharded program's
  where the shares round differently. "exact" (the default) keeps the partial sums in float32
  (`accumulates`: twice the bytes of bf16 on the wire) and rounds once after the reduction;
  "bf16" and "int8" reduce them in the result's dtype.
- **Weights gathered for a contraction** (ZeRO-3 / FSDP all-gathers, `weight_reads`): under "int8",
  as int8 with one bf16 scale per block of at most `BLOCK` elements of the last dimension
  (DeepSpeed ZeRO++'s qwZ, arXiv:2306.10209 section 4.1: block-wise int8 weight all-gathers), where
  that is faster on the mesh than the weight's own dtype (`int8_gathers`), priced with the
  quantisation's memory traffic (`quantize_time`). Only weights: state arguments (an input whose
  new value the step returns under the same path) and their casts, read by a contraction. The
  optimizer's reads of the same leaves are never quantised.
- **Gradients** (the partial sums of a contraction that feeds no matmul, `ilp.problem.combinable_ops`):
  under "int8", cut into one chunk per device of the reduction (`gradient_chunks`), each chunk
  quantised to int8 blocks, exchanged by one all-to-all, dequantised and summed in float32, the
  reduced chunk gathered again as int8 where the plan keeps the gradient whole (ZeRO++'s qgZ,
  arXiv:2306.10209 section 4.2, which reduces in higher precision after the exchange), priced as
  the ring collective of the int8 payload plus the quantisation's memory traffic
  (`ilp.strategies.int8_reduction`).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from planner.graph.ir import Graph, Tensor

CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# Elements per int8 scale, at most: ZeRO++ quantises weights in blocks (arXiv:2306.10209, 4.1: "block-based
# quantization", a scale per block); 256 keeps the bf16 scales under 1% of the int8 payload.
BLOCK = 256
SCALE_BYTES = 2  # one bf16 scale per block, packed beside its block (`planner.emit.wire`)


def accumulates(result_dtype) -> str:
    """The dtype a contraction with results of `result_dtype` accumulates in: "float32" for float
    results of at most 4 bytes (bf16 and fp16 results are rounded from it once), else "" (its own)."""
    dt = np.dtype(result_dtype) if isinstance(result_dtype, (np.dtype, type, str)) else None
    if dt is not None and jnp.issubdtype(dt, jnp.floating) and dt.itemsize <= 4:
        return "float32"
    return ""


def rounds_once(result_dtype) -> bool:
    """Whether a contraction's partial sums are narrower than what it accumulates in (bf16, fp16)."""
    acc = accumulates(result_dtype)
    return bool(acc) and np.dtype(acc).itemsize > np.dtype(result_dtype).itemsize


def gradient_chunks(shape: tuple[int, ...], spec, devices: int, scatter_dim: int | None = None) -> int | None:
    """The dimension a gradient's partial sums are cut along into one chunk per device of the
    reduction (`devices` of them) for the int8 exchange (ZeRO++'s qgZ, `planner.emit.wire`): the
    reduce-scatter's own dimension (`scatter_dim`), or for an all-reduce the largest dimension
    no mesh axis splits that `devices` divides; None where there is none (reduced as it is).
    A dimension already split by other axes is not cut (their order in the result would differ)."""
    if scatter_dim is not None:
        return scatter_dim if not spec[scatter_dim] else None
    free = [d for d in range(len(shape)) if not spec[d] and shape[d] % devices == 0]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


def before_reduction(out, axes) -> tuple[tuple[tuple[int, ...], ...], int | None]:
    """A contraction's partial sums reduced over mesh `axes` into layout `out`: their layout before
    the reduction and the dimension the reduction scatters them along (None: an all-reduce)."""
    pre = tuple(tuple(a for a in dim if a not in axes) for dim in out)
    return pre, next((d for d, dim in enumerate(out) if set(dim) & set(axes)), None)


def partial_sum_itemsize(sig_accumulates: str, result: Tensor, precision: str) -> int:
    """Bytes per element of a split contraction's partial sums on the wire under `precision`."""
    if precision == "exact" and sig_accumulates:
        return np.dtype(sig_accumulates).itemsize
    return result.dtype.itemsize


def _state_inputs(graph: Graph) -> set[int]:
    """Arguments whose new value the step returns under the same path and type (the train state)."""
    outs = {p: t for p, t in zip(graph.output_paths, graph.outputs) if isinstance(t, int)}
    return {t for p, t in zip(graph.input_paths, graph.inputs)
            if p in outs and outs[p] != t and graph.tensors[outs[p]] == graph.tensors[t]}


def weight_reads(graph: Graph) -> frozenset[tuple[int, int]]:
    """(tensor, reading op) pairs an int8 gather may serve: a floating state argument of at least
    one dimension, or a `convert_element_type` of one, read by a contraction or by such a cast
    whose results only contractions read. Cached on the graph."""
    def build() -> frozenset[tuple[int, int]]:
        consumers: dict[int, list[int]] = {}
        for op in graph.ops:
            for x in op.inputs:
                if isinstance(x, int):
                    consumers.setdefault(x, []).append(op.index)
        weights = {t for t in _state_inputs(graph)
                   if graph.tensors[t].shape and jnp.issubdtype(graph.tensors[t].dtype, jnp.floating)}
        pairs: set[tuple[int, int]] = set()

        def casts_for_contractions(i: int) -> bool:
            op = graph.ops[i]
            return (op.name == "convert_element_type" and bool(consumers.get(op.outputs[0]))
                    and all(graph.ops[c].name in CONTRACTIONS for c in consumers[op.outputs[0]]))

        for w in weights:
            for i in consumers.get(w, ()):
                if graph.ops[i].name in CONTRACTIONS:
                    pairs.add((w, i))
                elif casts_for_contractions(i):
                    pairs.add((w, i))
                    pairs.update((graph.ops[i].outputs[0], c) for c in consumers[graph.ops[i].outputs[0]])
        return frozenset(pairs)

    return graph.cached(("weight_reads",), build)


def block_for(t: Tensor, devices: int) -> int:
    """Elements per scale of weight `t` gathered on a mesh of `devices` devices: the largest divisor
    of its last dimension over gcd(last dimension, devices) that is at most `BLOCK`. Any layout of
    the mesh splits the last dimension by a divisor of that gcd (and the source and destination
    layouts' splits by their lcm, which divides it too), so every shard holds whole blocks."""
    n = t.shape[-1]
    return largest_block(n // math.gcd(n, devices))


def largest_block(n: int) -> int:
    """The largest divisor of `n` that is at most `BLOCK`: the elements per scale of a row of `n`."""
    return max(d for d in range(1, min(BLOCK, n) + 1) if n % d == 0)


def wire_tensor(t: Tensor, devices: int) -> Tensor:
    """The int8 payload of weight `t` on the wire: one byte per element and a bf16 scale per block
    (`block_for`) packed beside it, as a last dimension that much longer."""
    n = t.shape[-1]
    return Tensor(t.shape[:-1] + (n + SCALE_BYTES * (n // block_for(t, devices)),), np.dtype(np.int8))


# int8 is not tried where the blocks would be smaller than this (a scale per few elements)
MIN_BLOCK = 16
