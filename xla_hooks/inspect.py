"""Reads a compiled XLA program back: its collectives, memory and FLOPs.

The planner predicts communication and memory; this module measures what XLA actually emitted,
so the two can be compared. It is a small reader of the HLO text printed by
`jax.stages.Compiled.as_text()`, not a full HLO parser: it looks at instruction lines only.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import pathlib
import re
import tempfile
from typing import Any

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "token": 0,
}  # f8* types are 8 bits, handled in _dtype_bits.

_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S.*?)\s+(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*[ (].*\{\s*$")
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,<=\s]*)\]")
_MODULE = re.compile(r"^\s*HloModule\b.*$", re.M)
_HEADER_INT = re.compile(r"\b(num_partitions|replica_count)=(\d+)")
_IOTA_SPEC = r"\[([\d,]+)\](?:T\(([\d,]+)\))?"  # iota(prod(reshape)).reshape(..).transpose(..)
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=" + _IOTA_SPEC)
_IOTA_IDS = re.compile(r"^\s*" + _IOTA_SPEC + r"\s*$")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\s*\d+\s*,\s*\d+\s*\},?\s*)*)\}")
_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?"
    r"\s*\{(?P<refs>[^}]*)\}"
)
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")
_AXIS_REF = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


class HloParseError(ValueError):
    """Raised for input that is not HLO text this reader understands."""


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One logical collective in a compiled program (an async start/done pair counts once)."""

    kind: str
    name: str
    dtype: str  # element type; comma-joined when a tuple result mixes types
    shape: tuple[int, ...] | tuple[tuple[int, ...], ...]  # per element for tuple results
    result_bytes: int  # per device, summed over tuple elements
    operand_bytes: int  # per device, summed over operands
    group_size: int
    num_groups: int
    groups: tuple[tuple[int, ...], ...]
    computation: str  # enclosing HLO computation (e.g. a while body)
    # times it runs per program run: the product of the known trip counts of the while loops around
    # it (XLA annotates `known_trip_count` on loops it can count; 1 where it cannot)
    trips: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Collective kind {self.kind!r} must be one of {KINDS}")

    @property
    def bytes_moved_per_device(self) -> float:
        """Bytes each device sends under the ring algorithm, the usual model of these ops."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.result_bytes)
        if n <= 1:
            return 0.0
        frac = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * frac * self.result_bytes
        if self.kind == "reduce-scatter":
            return frac * self.operand_bytes
        return frac * self.result_bytes  # all-gather (output size), all-to-all


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStats:
    """Per-device buffer sizes from `compiled.memory_analysis()`.

    peak_bytes = argument_bytes + output_bytes + temp_bytes - alias_bytes: everything live at once,
    counting donated (aliased) buffers once. Generated code is reported but not included.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class HloReport:
    """What XLA emitted for one program: collectives, memory and cost-analysis figures."""

    collectives: tuple[Collective, ...]
    memory: MemoryStats | None
    flops: float | None
    bytes_accessed: float | None

    def counts(self) -> dict[str, int]:
        """Number of collectives per kind, in order of first appearance."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def bytes_moved_per_device(self) -> float:
        """Total ring-model bytes each device sends (each static instruction counted once)."""
        return sum(c.bytes_moved_per_device for c in self.collectives)

    def executed_bytes_moved_per_device(self) -> float:
        """Total ring-model bytes each device sends per run: each collective times its loops' known
        trip counts (`Collective.trips`; a scanned model's per-layer collectives run once per layer)."""
        return sum(c.bytes_moved_per_device * c.trips for c in self.collectives)

    def summary(self) -> str:
        """A fixed-width table for logs and experiment reports."""
        lines = [f"{'collective':<20}{'count':>7}{'bytes/device':>16}"]
        for kind, count in self.counts().items():
            moved = sum(c.bytes_moved_per_device for c in self.collectives if c.kind == kind)
            lines.append(f"{kind:<20}{count:>7}{moved:>16,.0f}")
        lines.append(f"{'total':<20}{len(self.collectives):>7}{self.bytes_moved_per_device():>16,.0f}")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"memory/device: args {m.argument_bytes:,} out {m.output_bytes:,} temp {m.temp_bytes:,}"
                f" alias {m.alias_bytes:,} peak {m.peak_bytes:,}"
            )
        if self.flops is not None:
            lines.append(f"flops/device: {self.flops:,.0f}")
        return "\n".join(lines)


def _dtype_bits(dtype: str, where: str) -> int:
    if dtype.startswith("f8"):
        return 8
    if dtype not in _BITS:
        raise HloParseError(f"Unknown element type {dtype!r} in {where}")
    return _BITS[dtype]


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (m["dtype"], tuple(int(d.replace("<=", "")) for d in m["dims"].split(",") if d.strip()))
        for m in _ARRAY.finditer(shape)
    ]


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]], where: str) -> int:
    return sum(math.ceil(_dtype_bits(dt, where) * math.prod(dims) / 8) for dt, dims in arrays)


def _split_call(rest: str) -> tuple[str, str]:
    """Splits `operands), attrs` at the parenthesis closing the operand list."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def _iota(dims: list[int], perm: list[int] | None) -> list[int]:
    """Flattened iota(prod(dims)).reshape(dims).transpose(perm), XLA's compact device lists."""
    perm = perm if perm is not None else list(range(len(dims)))
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    return [
        sum(i * strides[p] for i, p in zip(idx, perm))
        for idx in itertools.product(*(range(dims[p]) for p in perm))
    ]


def _operand_names(operands: str) -> list[str]:
    """Operand names, dropping any inline shapes (`f32[8]{0} %x` -> `x`)."""
    bare = _ARRAY.sub(" ", re.sub(r"\{[^{}]*\}", " ", operands))
    return [t.lstrip("%") for t in re.split(r"[\s,()]+", bare) if t]


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def _mesh_groups(m: re.Match, where: str) -> tuple[tuple[int, ...], ...]:
    """Groups of `mesh[a=2,b=4], device_ids=(...) {b}`: devices that differ only along the braced axes."""
    axes = _MESH_AXIS.findall(m["axes"])
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = m["ids"]
    iota = _IOTA_IDS.match(ids) if ids else None
    if iota:
        devices = _iota(_ints(iota[1]), _ints(iota[2]) if iota[2] else None)
    else:
        devices = _ints(ids) if ids else list(range(math.prod(sizes)))
    refs = []  # (mesh dim, stride of the (sub-)axis within that dim, size)
    for name, pre, size in _AXIS_REF.findall(m["refs"]):
        if name not in names:
            raise HloParseError(f"Axis {name!r} is not in mesh {names} in {where}")
        dim, full = names.index(name), sizes[names.index(name)]
        sub = int(size) if size else full
        refs.append((dim, full // ((int(pre) if pre else 1) * sub), sub))
    if len(devices) != math.prod(sizes):
        raise HloParseError(f"Mesh {m['axes']} does not match its {len(devices)} device ids in {where}")
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for coords, dev in zip(itertools.product(*(range(s) for s in sizes)), devices):
        inner = tuple((coords[d] // stride) % size for d, stride, size in refs)
        rest = list(coords)
        for (d, stride, _), k in zip(refs, inner):
            rest[d] -= k * stride
        groups.setdefault(tuple(rest), []).append((inner, dev))
    return tuple(tuple(dev for _, dev in sorted(g)) for _, g in sorted(groups.items()))


def _groups(attrs: str, num_devices: int, where: str) -> tuple[tuple[int, ...], ...]:
    """Expands every replica-group spelling XLA prints into explicit device-id tuples."""
    if m := _PAIRS.search(attrs):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", m[1]))
    if m := _MESH.search(attrs):
        return _mesh_groups(m, where)
    if m := _IOTA.search(attrs):
        flat, size = _iota(_ints(m[3]), _ints(m[4]) if m[4] else None), int(m[2])
        return tuple(tuple(flat[i : i + size]) for i in range(0, int(m[1]) * size, size))
    if m := _EXPLICIT.search(attrs):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", m[1]))
        return groups or (tuple(range(num_devices)),)
    pos = attrs.find("replica_groups=")
    if pos < 0:
        return (tuple(range(num_devices)),)
    raise HloParseError(f"Unrecognised replica_groups in {where}: {attrs[pos:pos + 120]!r}")


def _text(compiled_or_text: Any) -> str:
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    if callable(getattr(compiled_or_text, "as_text", None)):
        text = compiled_or_text.as_text()
        if isinstance(text, str):
            return text
    raise HloParseError(
        f"Expected a jax.stages.Compiled or HLO text, got {type(compiled_or_text).__name__}"
    )


# Top-level instructions that launch no kernel of their own (`kernels`).
_NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "domain",
})
_CONTROL = ("while", "conditional", "call")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")


def _computations(text: str) -> tuple[str | None, dict[str, list[tuple[str, str, str]]]]:
    """The ENTRY computation's name (None: none) and, per computation, its instructions in order as
    (opcode, the text after the opening parenthesis, the raw line)."""
    bodies: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw)
        m = _INSTR.match(line)
        if m is None:
            if c := _COMPUTATION.match(line):
                current = c["name"]
                bodies[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if current is not None:
            bodies[current].append((m["op"], m["rest"], raw))
    return entry, bodies


def _callees(rest: str) -> list[str]:
    """The computations a control-flow instruction runs (loop bodies and conditions, branches, calls)."""
    return _CALLED.findall(rest) + [b.strip().lstrip("%") for branches in _BRANCHES.findall(rest)
                                    for b in branches.split(",")]


def kernels(compiled_or_text: Any) -> dict[str, int]:
    """Kernels a compiled program launches, by kind: the instructions of the entry computation and
    of the computations it runs as control flow (while bodies and conditions, branches, calls), not
    those inside fusions. Keys: "fusion:kLoop" (the fusion's kind), "custom-call" (library calls:
    GEMMs, convolutions), or the opcode; control flow, tuples, parameters and bitcasts launch none."""
    text = _text(compiled_or_text)
    entry, bodies = _computations(text)
    if entry is None:
        raise HloParseError(f"No ENTRY computation in the HLO text: {text[:80]!r}")
    counts: dict[str, int] = {}
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        for op, rest, _ in bodies[name]:
            if op in _CONTROL:
                todo.extend(_callees(rest))
            if op in _NO_KERNEL:
                continue
            if op == "fusion":
                kind = _FUSION_KIND.search(rest)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


_TRIP_COUNT = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def _base_name(computation: str) -> str:
    """A computation's name without the prefixes and suffixes XLA's passes add to the clones they
    make of it ("wide." from loop widening, ".clone" from cloning): the name it had after SPMD
    partitioning, so loops of the final module can be matched with an earlier dump's."""
    while computation.startswith("wide."):
        computation = computation[len("wide."):]
    while computation.endswith(".clone"):
        computation = computation[:-len(".clone")]
    return computation


def trip_counts(compiled_or_text: Any) -> dict[str, int]:
    """Per computation of a compiled module, how many times it runs per program run: the product of
    the known trip counts (`backend_config` `known_trip_count`) of the while loops whose bodies
    contain it, through nested loops, calls and branches; computations not listed run once. Keys
    are `_base_name`s as well as the names themselves."""
    parent: dict[str, tuple[str, int]] = {}
    for current, instructions in _computations(_text(compiled_or_text))[1].items():
        for op, rest, raw in instructions:
            if op == "while":
                body = _BODY.search(rest)
                count = _TRIP_COUNT.search(raw)
                if body is not None:
                    parent[body.group(1)] = (current, int(count.group(1)) if count else 1)
            elif op in ("call", "conditional"):
                for callee in _callees(rest):
                    parent.setdefault(callee, (current, 1))
    out: dict[str, int] = {}

    def trips(name: str, seen: frozenset = frozenset()) -> int:
        if name in out:
            return out[name]
        up, k = parent.get(name, ("", 1))
        n = k * (trips(up, seen | {name}) if up and up not in seen else 1)
        out[name] = n
        return n

    for name in list(parent):
        trips(name)
    out.update({_base_name(k): v for k, v in list(out.items()) if _base_name(k) not in out})
    return {k: v for k, v in out.items() if v != 1}


def collectives(compiled_or_text: Any, *, num_devices: int | None = None) -> tuple[Collective, ...]:
    """Lists the collectives of a compiled program in program order.

    Args:
      compiled_or_text: a `jax.stages.Compiled` or the HLO text it prints.
      num_devices: devices in the program, used for `replica_groups={}`; defaults to
        `num_partitions * replica_count` from the HloModule header (1 when absent).

    Returns:
      One `Collective` per logical collective instruction, including those in loop bodies.
    """
    text = _text(compiled_or_text)
    module = _MODULE.search(text)
    header = {k: int(v) for k, v in _HEADER_INT.findall(module[0] if module else "")}
    if num_devices is None:
        num_devices = header.get("num_partitions", 1) * header.get("replica_count", 1)
    shapes: dict[str, str] = {}
    found: list[dict[str, Any]] = []
    starts: dict[str, dict[str, Any]] = {}
    computation, seen_hlo = "", module is not None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw)
        m = _INSTR.match(line)
        if m is None or not (m["shape"].startswith("(") or _ARRAY.match(m["shape"])):
            if c := _COMPUTATION.match(line):
                computation, seen_hlo = c["name"], True
            continue
        seen_hlo = True
        name, shape, op = m["name"], m["shape"], m["op"]
        shapes[name] = shape
        base = op.removesuffix("-start").removesuffix("-done")
        if base not in KINDS:
            continue
        operands, attrs = _split_call(m["rest"])
        if op.endswith("-done"):
            start = starts.get(next(iter(_operand_names(operands)), ""))
            if start is not None:
                start["shape"] = shape  # the done's result is the collective's output
            continue
        rec = dict(kind=base, name=name, shape=shape, operands=operands, attrs=attrs, comp=computation)
        found.append(rec)
        if op.endswith("-start"):
            starts[name] = rec
    if not seen_hlo:
        raise HloParseError(f"Input does not look like HLO text: {text[:80]!r}")
    loops = trip_counts(text)
    return tuple(dataclasses.replace(c, trips=loops.get(c.computation, 1))
                 for c in (_collective(r, shapes, num_devices) for r in found))


# The first XLA:CPU pass that widens 16-bit collectives to float32 (float-normalization-bf16 does the
# same when it is off): XLA:CPU's collectives have no 16-bit reductions.
_WIDENING_PASS = "all-reduce-promotion"


def compile_with_program_collectives(lowered: Any) -> tuple[Any, tuple[Collective, ...]]:
    """Compiles `lowered` (a `jax.stages.Lowered`) once and returns the executable with the
    collectives as the partitioned program has them, before XLA:CPU runs every 16-bit collective in
    float32: the module is dumped just before `_WIDENING_PASS` (compiler options `xla_dump_to`,
    `xla_dump_hlo_pass_re`), after SPMD partitioning and the passes before it. On XLA:CPU a bf16
    program's collectives move twice the bytes in the compiled program that they move on a GPU
    (whose NCCL reduces bf16); these are the GPU's. Their `trips` come from the compiled module's
    loop annotations, matched by the loop bodies' names (`_base_name`). Raises HloParseError when
    the backend dumped no such module (it has no such pass)."""
    with tempfile.TemporaryDirectory() as out:
        compiled = lowered.compile({"xla_dump_to": out, "xla_dump_hlo_pass_re": _WIDENING_PASS})
        found = sorted(pathlib.Path(out).glob(f"*before_{_WIDENING_PASS}.txt"))
        if not found:
            raise HloParseError(f"no module was dumped before the {_WIDENING_PASS!r} pass (not XLA:CPU?)")
        early = collectives(found[-1].read_text())
    loops = trip_counts(compiled)  # annotated by the later passes: matched by the loop bodies' names
    return compiled, tuple(dataclasses.replace(c, trips=loops.get(_base_name(c.computation), c.trips))
                           for c in early)


def _collective(rec: dict[str, Any], shapes: dict[str, str], num_devices: int) -> Collective:
    where = f"instruction {rec['name']!r}"
    result = _arrays(rec["shape"])
    if not result:
        raise HloParseError(f"Cannot read the result shape {rec['shape']!r} of {where}")
    groups = _groups(rec["attrs"], num_devices, where)
    n = 2 if rec["kind"] == "collective-permute" else (len(groups[0]) if groups else 1)
    result_bytes = _nbytes(result, where)
    inline = _arrays(rec["operands"])
    names = _operand_names(rec["operands"])
    if inline:
        operand_bytes = _nbytes(inline, where)
    elif names and all(t in shapes for t in names):
        operand_bytes = _nbytes([a for t in names for a in _arrays(shapes[t])], where)
    else:  # operands defined outside the given text: infer from the result
        scale = {"all-gather": 1 / n, "reduce-scatter": n}.get(rec["kind"], 1)
        operand_bytes = int(result_bytes * scale)
    dtypes = list(dict.fromkeys(dt for dt, _ in result))
    is_tuple = rec["shape"].lstrip().startswith("(")
    return Collective(
        kind=rec["kind"],
        name=rec["name"],
        dtype=",".join(dtypes),
        shape=tuple(d for _, d in result) if is_tuple else result[0][1],
        result_bytes=result_bytes,
        operand_bytes=operand_bytes,
        group_size=n,
        num_groups=len(groups),
        groups=groups,
        computation=rec["comp"],
    )


_ENTRY_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*)\)->(.*)\}")
_LAID_OUT = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\]\{(?P<layout>[^}]*)\}")
HOST_MEMORY_SPACE = "S(5)"  # a layout's memory space 5: XLA's host memory (JAX's "pinned_host")


def entry_bytes(compiled_or_text: Any) -> tuple[int, int, int, int]:
    """(host argument bytes, all argument bytes, host result bytes, all result bytes) per device,
    from a compiled program's entry layout: the buffers in host memory carry memory space 5
    (`HOST_MEMORY_SPACE`) there, whatever `memory_analysis()` reports of them."""
    text = _text(compiled_or_text)
    m = _ENTRY_LAYOUT.search(text.split("\n", 1)[0])
    if m is None:
        raise HloParseError("No entry_computation_layout in the module header")
    out = []
    for part in m.groups():
        host = total = 0
        for a in _LAID_OUT.finditer(part):
            b = _nbytes([(a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))], "entry layout")
            total += b
            host += b if HOST_MEMORY_SPACE in a["layout"] else 0
        out += [host, total]
    return out[0], out[1], out[2], out[3]


def memory_stats(compiled: Any) -> MemoryStats:
    """Per-device memory of a compiled program, from XLA's buffer assignment."""
    stats = _memory(compiled)
    if stats is None:
        raise ValueError(f"No memory analysis available for {type(compiled).__name__}")
    return stats


def _memory(compiled: Any) -> MemoryStats | None:
    get = getattr(compiled, "memory_analysis", None)
    analysis = get() if callable(get) else None
    if analysis is None:
        return None
    arg, out = analysis.argument_size_in_bytes, analysis.output_size_in_bytes
    temp, alias = analysis.temp_size_in_bytes, analysis.alias_size_in_bytes
    return MemoryStats(
        argument_bytes=arg,
        output_bytes=out,
        temp_bytes=temp,
        alias_bytes=alias,
        generated_code_bytes=analysis.generated_code_size_in_bytes,
        peak_bytes=arg + out + temp - alias,
    )


def report(compiled: Any) -> HloReport:
    """Collectives, memory and cost figures of one compiled program (text input: collectives only)."""
    cols = collectives(compiled)
    if isinstance(compiled, str):
        return HloReport(cols, None, None, None)
    memory = _memory(compiled)  # None rather than an error: a report is still useful without it
    get = getattr(compiled, "cost_analysis", None)
    cost = get() if callable(get) else None
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per program
        cost = cost[0] if cost else None
    cost = cost or {}
    flops, accessed = cost.get("flops"), cost.get("bytes accessed")
    return HloReport(
        cols,
        memory,
        None if flops is None else float(flops),
        None if accessed is None else float(accessed),
    )


def stage_reports(stages: Any) -> tuple[dict[str, HloReport], ...]:
    """Per pipeline stage, the `report` of each of its compiled programs.

    Args:
      stages: what `.lower()` of a pipelined plan returns: per stage an object whose `programs()`
        maps program names ("forward", "backward", "update") to `jax.stages.Lowered`.
    """
    return tuple({name: report(lowered.compile()) for name, lowered in st.programs().items()} for st in stages)
