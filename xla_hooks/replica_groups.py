"""Replica groups as XLA prints them (explicit, iota, mesh axes, source-target pairs), expanded to device ids."""
from __future__ import annotations

import itertools
import math
import re

from xla_hooks.hlo_text import HloParseError, ints

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


def _iota(dims: list[int], perm: list[int] | None) -> list[int]:
    """Flattened iota(prod(dims)).reshape(dims).transpose(perm), XLA's compact device lists."""
    perm = perm if perm is not None else list(range(len(dims)))
    strides = [math.prod(dims[k + 1 :]) for k in range(len(dims))]
    return [
        sum(i * strides[p] for i, p in zip(idx, perm))
        for idx in itertools.product(*(range(dims[p]) for p in perm))
    ]


def _mesh_groups(m: re.Match, where: str) -> tuple[tuple[int, ...], ...]:
    """Groups of `mesh[a=2,b=4], device_ids=(...) {b}`: devices that differ only along the braced axes."""
    axes = _MESH_AXIS.findall(m["axes"])
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = m["ids"]
    iota = _IOTA_IDS.match(ids) if ids else None
    if iota:
        devices = _iota(ints(iota[1]), ints(iota[2]) if iota[2] else None)
    else:
        devices = ints(ids) if ids else list(range(math.prod(sizes)))
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


def expand_groups(attrs: str, num_devices: int, where: str) -> tuple[tuple[int, ...], ...]:
    """Expands every replica-group spelling XLA prints into explicit device-id tuples."""
    if m := _PAIRS.search(attrs):
        return tuple(tuple(ints(p)) for p in re.findall(r"\{([^{}]*)\}", m[1]))
    if m := _MESH.search(attrs):
        return _mesh_groups(m, where)
    if m := _IOTA.search(attrs):
        flat, size = _iota(ints(m[3]), ints(m[4]) if m[4] else None), int(m[2])
        return tuple(tuple(flat[i : i + size]) for i in range(0, int(m[1]) * size, size))
    if m := _EXPLICIT.search(attrs):
        groups = tuple(tuple(ints(g)) for g in re.findall(r"\{([^{}]*)\}", m[1]))
        return groups or (tuple(range(num_devices)),)
    pos = attrs.find("replica_groups=")
    if pos < 0:
        return (tuple(range(num_devices)),)
    raise HloParseError(f"Unrecognised replica_groups in {where}: {attrs[pos:pos + 120]!r}")
