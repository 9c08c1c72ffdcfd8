"""Which values of a traced program XLA keeps in registers and which go through device memory.

XLA's fusion passes merge elementwise ops, broadcasts, layout-only ops and reductions into kernels
("fusions"); a value made and used inside one fusion never touches device memory (HBM). The cost
model therefore charges memory traffic at fusion boundaries, not per op: each fusion reads every
value it takes from outside once and writes every value used outside it once.

The grouping follows XLA's producer-consumer fusion (`InstructionFusion`,
xla/service/instruction_fusion.cc) in simplified form (`fusions`):
  - contractions (dot, convolution), gathers and scatters, sorts, collectives, custom calls and
    every primitive not listed in `_FUSIBLE` run as kernels of their own and fuse with nothing
    (XLA:GPU emits library calls for dots and convolutions);
  - a reduction is a fusion root: its producers fuse into it (input fusion), its result is written
    for its consumers;
  - an op joins its consumers' fusion when they are all fusible ops of one and the same fusion;
    otherwise it is written once and read by each consuming fusion;
  - on GPU only (`DUPLICATING`), a cheap producer (not in XLA:GPU's `IsExpensive` list: float32 /
    float16 exp, sqrt, rsqrt and division are cheap there, `GpuInstructionFusion::IsExpensive`;
    tanh, log, erf, ... are not) whose consumers lie in several fusions is duplicated into each of
    them, each recomputing it from its operands, when that moves fewer bytes: all consumers
    fusible, n fusions reading its operands against one kernel reading them, writing the result
    and n reads of it (XLA:GPU's priority fusion fuses a producer into all its consumers when its
    performance model says so; here the comparison is in bytes); when some consumer cannot take
    it (a dot, a program output) it is still written for those and duplicated into the fusible
    ones if its operands are no larger than its result;
  - a value that is a program output is written.
Approximations, stated: XLA caps fusion sizes and operand counts (not modelled); multi-output
sibling fusions of reductions over one input are not formed (each reduction reads its input);
XLA:GPU's softmax rewriter (Triton normalization fusions), dot epilogues and cuDNN fusions are not
modelled; a duplicated op's FLOPs are counted once. tests/test_fusion.py checks the CPU grouping's
bytes against the `bytes accessed` of XLA:CPU's compiled cost analysis and both groupings by hand;
the GPU grouping is unchecked against XLA:GPU's compiled programs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np

from planner.core.layer_index import in_fused_attention
from planner.graph.ir import Graph

# Ops XLA fuses into loop / input fusions: elementwise arithmetic and comparisons, conversions,
# broadcasts and layout-only ops, slices and pads, iota, and reductions (as fusion roots).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "one_minus_square", "or",
    "pow", "real", "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    "name", "optimization_barrier", "reduce_precision", "bitcast_convert_type", "random_bits", "random_wrap",
    "random_unwrap", "threefry2x32",
})
_LAYOUT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "iota", "slice", "dynamic_slice",
    "pad", "concatenate",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "argmax", "argmin", "reduce_precision_sum"})
_FUSIBLE = _ELEMENTWISE | _LAYOUT | _REDUCTIONS
# XLA:GPU fuses gathers like the other index ops (a gather reads its operand inside the consumer's
# loop: the float32 convert of a language model's logits runs inside the fusion that picks each
# target's logit) and makes scatters fusion roots whose operand and updates fuse in (the zeros a
# gradient of an indexing op scatters into are never written); compiled HLO of the zoo's GPT on
# an H100, experiments/check_gpu.py.
_GPU_INDEXING = frozenset({"gather"})
_GPU_ROOTS = frozenset({"scatter-add", "scatter"})

# XLA's InstructionFusion::IsExpensive (xla/service/instruction_fusion.cc), by the HLO each JAX
# primitive lowers to: transcendental ops (exp, log, tanh, erf, logistic, power, sqrt, rsqrt, cbrt,
# atan2, and what decomposes into them: the hyperbolic and inverse trigonometric functions,
# lgamma, digamma), float division and remainder, and random-bit generation. Sine, cosine, tangent,
# abs and sign are cheap for real numbers; everything else elementwise is cheap.
_EXPENSIVE = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "erf", "erfc", "erf_inv", "pow", "sqrt", "rsqrt",
    "cbrt", "atan2", "acos", "acosh", "asin", "asinh", "atan", "atanh", "sinh", "cosh", "lgamma", "digamma",
    "div", "rem", "random_bits", "threefry2x32",
})
# XLA:GPU's GpuInstructionFusion::IsExpensive (xla/service/gpu/transforms/instruction_fusion.cc):
# "some floating-point math ops are cheap on the GPU": division, sqrt, rsqrt and exp of float32 or
# float16 values.
_CHEAP_ON_GPU = frozenset({"div", "sqrt", "rsqrt", "exp"})
_GPU_CHEAP_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
# Operands that do not count as large inputs (EffectivelyAtMostUnary): broadcasts and iotas.
_SMALL_PRODUCERS = frozenset({"broadcast_in_dim", "iota"})
# Platforms whose fusion duplicates cheap producers here. XLA:GPU does (its instruction fusion and
# priority fusion fuse a producer into all of its consumers). XLA:CPU's base pass allows it too,
# but the XLA:CPU of jax 0.10 runs reductions as YNNPACK custom fusions over materialized
# operands and keeps the stable-softmax shift materialized (CpuInstructionFusion), and its compiled
# `bytes accessed` on the zoo models agree with the non-duplicating grouping (1.00-1.05x) better
# than with duplication (0.93-0.97x; tests/test_fusion.py); XLA:TPU's passes are not public.
DUPLICATING = frozenset({"gpu"})
# Platforms on which `jax.nn.dot_product_attention` runs as one fused kernel (cuDNN's flash attention
# on GPU, `jax.nn.dot_product_attention(implementation="cudnn")`; the splash / flash Pallas kernels
# on TPU): its scores and probabilities never reach device memory (`attention_groups`).
FUSED_ATTENTION_PLATFORMS = frozenset({"gpu", "tpu"})
# What the fused kernel's matmuls cost against the materialised ones under a causal mask: it skips
# the key blocks above the diagonal, about half (the diagonal blocks' other halves aside).
CAUSAL_FRACTION = 0.5
# A flash kernel's backward recomputes the scores (QK^T) before the four matmuls of the materialised
# backward: 5 matmuls where the traced program has 4, 2.5x the forward's FLOPs (Dao, FlashAttention-2,
# 2023, section 3.1: "the backward pass ... 2.5 times the forward pass").
FLASH_BACKWARD = 5 / 4
# Ops that read a window of their first operand, not all of it (an unrolled scan indexes a layer's
# weights and residuals out of their stacks so: reading whole stacks would charge L layers L times).
_WINDOWS = frozenset({"slice", "dynamic_slice"})
# Layout ops an unrolled scan moves a layer's values with (`graph.trace.unroll_scan`: stacked over
# the iterations, indexed back out); through them an attention kernel's values stay its own.
_PLUMBING = frozenset({"stack", "concatenate", "broadcast_in_dim", "reshape", "expand_dims", "squeeze", "slice",
                       "dynamic_slice", "copy", "copy_p"})


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
    """Which operands an op reads from and which results it writes to device memory.

    Attributes:
      fusions: every fusion the op runs in (their ids; more than one when XLA duplicates it).
      reads: per operand position, how many times the op reads that value from memory: once per
        fusion it runs in where it is the first op of the fusion to read a value made outside it
        (0 for literals and values made inside); a slice reads the share of its operand it keeps.
      writes: per result, True when the value leaves the fusion (or the program).
    """

    fusions: tuple[int, ...]
    reads: tuple[float, ...]
    writes: tuple[bool, ...]
    flop_scale: float = 1.0  # the share of its FLOPs the op runs (a fused causal attention's matmuls)
    causal: tuple[int, ...] = ()  # a fused causal attention's matmul: its scores' (queries, keys) lengths
    in_place: bool = False  # its result is written by its producers (`in_place_stacks`): it moves no bytes itself
    rate_dtype: str | None = None  # the dtype its FLOPs run at inside a fused kernel (`_kernel_dtypes`)

    @property
    def charged(self) -> tuple:
        """The traffic as the strategies price it (`ilp.strategies._build`): (reads, writes charged
        (an in-place result's are its producers'), FLOP share, the dtype its FLOPs run at, the
        causal scores' lengths)."""
        return (self.reads, tuple(w and not self.in_place for w in self.writes), self.flop_scale, self.rate_dtype,
                self.causal)

    @property
    def fusion(self) -> int:
        """The op's fusion id (ops of one fusion share it; an unfused op has its own); for an op
        duplicated into several fusions, the first of `fusions`."""
        return self.fusions[0]


def fusible(name: str, platform: str = "cpu") -> bool:
    """Whether XLA on `platform` fuses ops of this primitive into loop / input fusions."""
    return name in _FUSIBLE or (platform == "gpu" and name in _GPU_INDEXING | _GPU_ROOTS)


def _root(name: str, platform: str) -> bool:
    """Whether ops of this primitive end their fusion: producers fuse into them, their result is written."""
    return name in _REDUCTIONS or (platform == "gpu" and name in _GPU_ROOTS)


def expensive(name: str, dtype, platform: str = "cpu") -> bool:
    """Whether XLA on `platform` counts an op as too expensive to duplicate into several fusions."""
    if _root(name, platform):
        return True
    if platform == "gpu" and name in _CHEAP_ON_GPU and dtype in _GPU_CHEAP_DTYPES:
        return False
    return name in _EXPENSIVE


def fusions(graph: Graph, platform: str = "cpu") -> Mapping[int, Traffic]:
    """The fusions every op of `graph` runs in and its memory traffic, under the fusion rules of
    XLA on `platform` ("cpu", "gpu" or "tpu"; see the module docstring). Computed once per graph and
    platform (`Graph.cached`; read-only)."""
    return graph.cached(("fusions", platform), lambda: MappingProxyType(_fusions(graph, platform)))


def _mask_ops(graph: Graph) -> frozenset[int]:
    """The marked ops that compute from no array but constants (the causal mask: iotas compared;
    JAX hoists them out of a scanned layer, so every layer's attention reads them): a flash kernel
    computes them in place, and they join no call (they would join every layer's into one).
    Computed once per graph (`Graph.cached`)."""
    def find() -> frozenset[int]:
        marked = [op for op in graph.ops if in_fused_attention(op.name_stack)]
        producer = graph.producers() if marked else {}
        mask: set[int] = set()
        for op in marked:
            if all(
                    not isinstance(x, int) or x in graph.consts or producer.get(x, (None,))[0] in mask
                    for x in op.inputs):
                mask.add(op.index)
        return frozenset(mask)

    return graph.cached(("attention_masks",), find)


def attention_calls(graph: Graph) -> dict[int, int]:
    """op index -> its attention call (the first op's index): the ops of one call of
    `jax.nn.dot_product_attention`'s core (named `.../fused_attention` by the tracer), forward and
    backward, grouped by the values they pass each other (the mask's ops aside, `_mask_ops`).
    Computed once per graph (`Graph.cached`; read-only)."""
    return graph.cached(("attention_calls",), lambda: _attention_calls(graph))


def _attention_calls(graph: Graph) -> dict[int, int]:
    mask = _mask_ops(graph)
    parent = {op.index: op.index for op in graph.ops if in_fused_attention(op.name_stack) and op.index not in mask}
    if not parent:
        return {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {t: op.index for op in graph.ops for t in op.outputs}
    for i in parent:
        for x in graph.ops[i].inputs:
            j = producer.get(x) if isinstance(x, int) else None
            if j is not None and j in parent:
                a, b = find(i), find(j)
                parent[max(a, b)] = min(a, b)
    return {i: find(i) for i in parent}


def is_backward(name_stack: str) -> bool:
    """Whether an op of this name stack belongs to a derivative's transpose (the backward pass)."""
    return name_stack.startswith("transpose(") or "/transpose(" in name_stack


def attention_groups(graph: Graph) -> dict[int, int]:
    """op index -> its fused kernel (the first op's index): an attention call's forward ops, and its
    backward ops apart (a flash kernel's backward is a kernel of its own, which recomputes the
    scores from the saved queries and keys instead of reading them)."""
    calls = attention_calls(graph)
    first: dict[tuple[int, bool], int] = {}
    for i in sorted(calls):
        first.setdefault((calls[i], is_backward(graph.ops[i].name_stack)), i)
    return {i: first[(c, is_backward(graph.ops[i].name_stack))] for i, c in calls.items()}


def _causal_calls(graph: Graph, calls: dict[int, int]) -> dict[int, tuple[int, int]]:
    """The attention calls that mask causally (they read a mask made by jax.nn's `jnp.tril`, a
    named call among `_mask_ops`), each with its scores' (queries, keys) lengths: the mask's last
    two dimensions."""
    mask = _mask_ops(graph)
    if not any("/tril" in graph.ops[i].name_stack for i in mask):
        return {}
    made = {t for i in mask for t in graph.ops[i].outputs}
    out: dict[int, tuple[int, int]] = {}
    for i, c in calls.items():
        for x in graph.ops[i].inputs:
            if isinstance(x, int) and x in made and len(graph.tensors[x].shape) >= 2:
                out.setdefault(c, tuple(graph.tensors[x].shape[-2:]))
    return out


def _kernel_dtypes(graph: Graph, calls: dict[int, int]) -> dict[int, str]:
    """Per attention call, the dtype its matmuls run at in a fused kernel: the narrowest floating
    dtype among their operands (the queries' and keys'; the materialised program's backward feeds
    float32 softmax gradients to its matmuls, which a flash kernel converts to the compute dtype
    before its tensor-core matmuls, FlashAttention-2 section 3.1)."""
    out: dict[int, str] = {}
    for i, c in calls.items():
        op = graph.ops[i]
        if op.name != "dot_general":
            continue
        for x in op.inputs[:2]:
            if isinstance(x, int) and jnp.issubdtype(graph.tensors[x].dtype, jnp.floating):  # bf16 too
                d = graph.tensors[x].dtype
                if c not in out or d.itemsize < np.dtype(out[c]).itemsize:
                    out[c] = str(d)
    return out


def in_place_stacks(graph: Graph) -> set[int]:
    """The `stack` ops that make an unrolled scan's stacked outputs (`graph.trace.unroll_scan`): the
    scan writes each iteration's value into its slice of the output buffer as it makes it, so
    stacking reads and writes nothing more."""
    stacked = {t for regions in graph.regions.values() for r in regions if r.kind == "scan"
               for t in r.outputs if isinstance(t, int)}
    return {op.index for op in graph.ops if op.name == "stack" and op.outputs and op.outputs[0] in stacked}


def _fusions(graph: Graph, platform: str) -> dict[int, Traffic]:
    duplicate = platform in DUPLICATING
    consumers = graph.consumers()
    program_outputs = {t for t in graph.outputs if isinstance(t, int)}
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    runs_in: dict[int, frozenset[int]] = {}
    attention = attention_groups(graph) if platform in FUSED_ATTENTION_PLATFORMS else {}
    calls = attention_calls(graph) if attention else {}
    causal = _causal_calls(graph, calls)
    kernel_dtype = _kernel_dtypes(graph, calls)
    in_place = in_place_stacks(graph)
    for op in reversed(graph.ops):
        own = frozenset((op.index,))
        runs_in[op.index] = own
        if op.index in attention:  # one kernel: the group's ops share one fusion
            runs_in[op.index] = frozenset((attention[op.index],))
            continue
        if not fusible(op.name, platform) or _root(op.name, platform):
            continue
        users = {c for t in op.outputs for c, _ in consumers.get(t, ())}
        outputs = any(t in program_outputs for t in op.outputs)
        if not users:
            continue
        into = [c for c in users if fusible(graph.ops[c].name, platform)]
        targets = frozenset().union(*(runs_in[c] for c in into))
        dtype = graph.tensors[op.outputs[0]].dtype if op.outputs else None
        if duplicate and not expensive(op.name, dtype, platform) and len(targets) > 1:
            read_in = _operand_bytes(op, graph, producer)
            made = sum(graph.tensors[t].nbytes for t in op.outputs)
            n = len(targets)
            if len(into) == len(users) and not outputs:
                # fused into all: each consuming fusion reads the operands; unfused: one kernel
                # reads them and writes the result, each consuming fusion reads that
                if n * read_in <= read_in + (n + 1) * made:
                    runs_in[op.index] = targets
                    continue
            elif into and read_in <= made:  # written anyway; the fusible consumers read operands
                runs_in[op.index] = own | targets
                continue
        if not outputs and len(into) == len(users) and len(targets) == 1:
            runs_in[op.index] = targets
    out: dict[int, Traffic] = {}
    read: set[tuple[int, int]] = set()  # (fusion, tensor) already read by an earlier op of the fusion
    for op in graph.ops:
        mine = runs_in[op.index]
        reads = []
        for k, x in enumerate(op.inputs):
            if not isinstance(x, int):
                reads.append(0)
                continue
            made_in = runs_in.get(producer[x], frozenset()) if x in producer else frozenset()
            if k == 0 and op.name in _WINDOWS and graph.tensors[x].nbytes:  # reads its window only
                share = graph.tensors[op.outputs[0]].nbytes / graph.tensors[x].nbytes
                reads.append(share * sum(1 for f in mine if f not in made_in and (f, x) not in read))
                continue
            count = 0
            for f in mine:
                if f not in made_in and (f, x) not in read:
                    read.add((f, x))
                    count += 1
            reads.append(count)
        writes = tuple(t in program_outputs or any(not runs_in[c] <= mine for c, _ in consumers.get(t, ()))
                       for t in op.outputs)
        scale, lengths = 1.0, ()
        if op.index in attention and op.name == "dot_general":
            scale = (CAUSAL_FRACTION if calls[op.index] in causal else 1.0) * (
                FLASH_BACKWARD if is_backward(op.name_stack) else 1.0)
            lengths = causal.get(calls[op.index], ())
        if op.index in in_place:
            reads = [0] * len(reads)
        rate = kernel_dtype.get(calls[op.index]) if op.index in attention and op.name == "dot_general" else None
        out[op.index] = Traffic(tuple(sorted(mine)), tuple(reads), writes, scale, lengths, op.index in in_place, rate)
    return out


def attention_internal(graph: Graph, platform: str) -> frozenset[int]:
    """Values a fused attention kernel keeps to itself on `platform` (`FUSED_ATTENTION_PLATFORMS`):
    made by an attention call's ops and read only by them (the scores, the mask, the
    probabilities, the ones its backward reads too): they take no device memory; their operands
    (the queries, keys and values) stay until the last op that reads them, which recomputes them
    (as `recomputed` values do on XLA:CPU)."""
    if platform not in FUSED_ATTENTION_PLATFORMS:
        return frozenset()

    def find() -> frozenset[int]:
        calls = attention_calls(graph)
        kernel = set(calls) | _mask_ops(graph)
        outputs = {t for t in graph.outputs if isinstance(t, int)}
        consumers = graph.consumers()
        # values the kernel makes, and what an unrolled scan's plumbing makes of them alone (a
        # layer's probabilities stacked over the layers for the backward scan, sliced back out)
        made = {t for i in kernel for t in graph.ops[i].outputs}
        plumbing: set[int] = set()
        for op in graph.ops:
            if op.index not in kernel and op.name in _PLUMBING and op.tensor_inputs \
                    and all(x in made for x in op.tensor_inputs):
                plumbing.add(op.index)
                made.update(op.outputs)
        internal: set[int] = set()
        for op in reversed(graph.ops):  # a value's readers come later: decided first
            if op.index not in kernel and op.index not in plumbing:
                continue
            for t in op.outputs:
                readers = consumers.get(t, ())
                if t not in outputs and readers and all(
                        j in kernel or (j in plumbing and all(u in internal for u in graph.ops[j].outputs))
                        for j, _ in readers):
                    internal.add(t)
        return frozenset(internal)

    return graph.cached(("attention_internal",), find)


def _operand_bytes(op, graph: Graph, producer: Mapping[int, int]) -> int:
    """Bytes a fusion reads to recompute `op`: its operands, except broadcasts and iotas (which
    fuse along and read little; XLA's InstructionFusion::EffectivelyAtMostUnary ignores them too)."""
    total = 0
    for x in set(x for x in op.inputs if isinstance(x, int)):
        if x in producer and graph.ops[producer[x]].name in _SMALL_PRODUCERS:
            continue
        total += graph.tensors[x].nbytes
    return total


def memory_traffic_bytes(graph: Graph, traffic: Mapping[int, Traffic] | None = None,
                         platform: str = "cpu") -> float:
    """Bytes the unsharded program reads and writes in device memory after fusion (the figure XLA's
    cost analysis reports as `bytes accessed` for one device)."""
    traffic = fusions(graph, platform) if traffic is None else traffic
    total = 0
    for op in graph.ops:
        tr = traffic[op.index]
        total += sum(graph.tensors[x].nbytes * r for x, r in zip(op.inputs, tr.reads) if r)
        total += sum(graph.tensors[t].nbytes for t, w in zip(op.outputs, tr.writes) if w and not tr.in_place)
    return float(total)


# Conversions `recomputed` leaves written: batch norms convert each bf16 convolution output to float32
# for their statistics, and XLA:CPU keeps those converts in memory (it runs bf16 arithmetic in float32).
_KEPT_ON_CPU = frozenset({"convert_element_type"})


def recomputed(graph: Graph, platform: str = "cpu") -> frozenset[int]:
    """Values XLA:CPU recomputes inside each fusion that reads them instead of writing them once:
    residuals of cheap elementwise chains that the forward and the backward both read (XLA's
    `InstructionFusion` duplicates a producer into every consumer when it is not `IsExpensive` and
    duplicating it reads no more bytes than it writes, `ComputeGloballyUnfusible`). Read from
    XLA:CPU's buffer assignment (`--xla_dump_to`) of gpt-tiny: per tanh-approximated GELU it writes
    the matmul's output, the tanh and the GELU's output, and the backward's fusion recomputes what
    else it reads from them; per batch-norm layer of wresnet-tiny it writes the convolution's and
    the relu's outputs and recomputes the normalisation in between.

    A value is recomputed when its op is cheap and elementwise (not a conversion, `_KEPT_ON_CPU`), it
    is not a program output, every
    op reading it is elementwise, its readers lie in more than one fusion of the non-duplicating
    grouping (`fusions`) and its operands (broadcasts and iotas aside, `_operand_bytes`) are no
    larger than it; then the cheap elementwise values it is made from are recomputed along with it.
    Their operands stay in memory until the last fusion that recomputes them
    (`ilp.live_ranges.last_reads`). Not covered: a value the grouping puts into a later fusion (the
    GELU's 1 - tanh and 3 c x^2 join the backward's fusion, their only reader) still counts from
    its producer's place in program order (gpt-tiny, 2 layers, batch 16, seq 64 on 1x8: predicted
    1.07x of the compiled peak; 1.16x before this rule). Only XLA:CPU (empty elsewhere): on XLA:GPU
    no value kept inside a fusion takes memory (`ilp.live_ranges.KEEPS_FUSED_VALUES_IN_REGISTERS`)."""
    if platform != "cpu":
        return frozenset()
    return graph.cached(("recomputed", platform), lambda: frozenset(_recomputed(graph, platform)))


def _recomputed(graph: Graph, platform: str) -> set[int]:
    consumers = graph.consumers()
    traffic = fusions(graph, platform)
    program_outputs = {t for t in graph.outputs if isinstance(t, int)}
    producer = {t: op.index for op in graph.ops for t in op.outputs}

    def duplicable(t: int) -> bool:
        op = graph.ops[producer[t]]
        if op.name not in _ELEMENTWISE or op.name in _KEPT_ON_CPU or len(op.outputs) != 1 or t in program_outputs:
            return False
        if expensive(op.name, graph.tensors[t].dtype, platform):
            return False
        readers = [c for c, _ in consumers.get(t, ())]
        if not readers or any(graph.ops[c].name not in _ELEMENTWISE for c in readers):
            return False
        return _operand_bytes(op, graph, producer) <= graph.tensors[t].nbytes

    found = {t for t in producer if duplicable(t)
             and len({traffic[c].fusion for c, _ in consumers.get(t, ())}) > 1}
    todo = list(found)
    while todo:
        for x in graph.ops[producer[todo.pop()]].inputs:
            if isinstance(x, int) and x in producer and x not in found and duplicable(x):
                found.add(x)
                todo.append(x)
    return found
