"""How a cluster's devices are linked: levels from the device outward, and the link each mesh axis runs on.

A topology is a list of levels, innermost first. Level 0 groups devices (`size` of them: an NVLink
domain, a TPU slice, a host); level i groups `size` units of level i - 1 (hosts into a rack,
slices over the data-center network). Device *positions* 0..N-1 count through the levels in mixed
radix, level 0 fastest; inside a torus level, through its physical shape row-major (the last
dimension fastest). A logical mesh is laid out row-major over positions (`MeshSpec.to_jax_mesh` on
the devices in position order, `device_order`).

A group of devices (the devices one collective runs over) is priced by the outermost level it
spans: a switched level (NVLink switches, InfiniBand, DCN) at its per-device link; a torus level
at one port's link times the ports the group's ring can use in each physical dimension it spans:
two where it covers the whole dimension and the dimension wraps around (a bidirectional ring),
one where it covers part of it (a ring folded onto a line uses each link both ways), divided by
the stride when the group takes every k-th chip of the dimension (k interleaved rings share the
links). Collectives over several torus dimensions use the links of all of them at once ("How to
Scale Your Model", Austin et al. 2025, part 3: an AllGather over several ICI axes has their
bandwidths summed). So a mesh axis laid along one full wrapped dimension of a v5p slice runs at
2 x 100 GB/s, one laid over two dimensions at 4 x 100 GB/s, and an axis that leaves the slice at
the DCN's 6.25 GB/s per chip.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.cost_model.collectives import AxisLink
from planner.cost_model.hardware import GB200, Hardware, get_hardware
from planner.cost_model.topology_text import NVL72_PATTERN, TPU_SLICE_PATTERN
from planner.cost_model.topology_text import is_topology as is_topology  # re-exported: topology texts


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One direction of a per-device link: bandwidth (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"link bandwidth={self.bandwidth!r} must be > 0 and latency={self.latency!r} >= 0")

    def axis_link(self) -> AxisLink:
        return AxisLink(self.latency, 1.0 / self.bandwidth)


@dataclasses.dataclass(frozen=True, slots=True)
class Level:
    """One level of a topology.

    Attributes:
      name: what the level is ("nvlink", "ici", "infiniband", "dcn", ...), printed with plans.
      size: units of the level below (devices, for level 0) in one unit of this level.
      link: a switched level: the per-device link (one direction) to the rest of the unit; a
        torus level: one port's link, one direction.
      torus: the physical shape of a torus (or mesh) level, product == size; () for a switched level.
      wrap: per torus dimension, whether it has wraparound links.
    """

    name: str
    size: int
    link: Link
    torus: tuple[int, ...] = ()
    wrap: tuple[bool, ...] = ()

    def __post_init__(self):
        if isinstance(self.size, bool) or not (isinstance(self.size, int) and self.size >= 1):
            raise ValueError(f"topology level {self.name!r}: size={self.size!r} must be an int >= 1")
        if self.torus:
            if math.prod(self.torus) != self.size or any(not isinstance(d, int) or d < 1 for d in self.torus):
                raise ValueError(f"topology level {self.name!r}: torus {self.torus} must be positive ints "
                                 f"multiplying to its size {self.size}")
            if len(self.wrap) != len(self.torus):
                raise ValueError(f"topology level {self.name!r}: wrap {self.wrap} needs one flag per torus "
                                 f"dimension {self.torus}")
        elif self.wrap:
            raise ValueError(f"topology level {self.name!r}: wrap given without a torus shape")

    def ports(self, coords: np.ndarray) -> float:
        """Ports' worth of bandwidth a ring over the torus positions `coords` ([n, ndim]) can use."""
        ways = 0.0
        for d, n in enumerate(self.torus):
            values = np.unique(coords[:, d])
            if len(values) < 2:
                continue
            stride = int(np.gcd.reduce(np.diff(values)))
            whole = len(values) * stride == n
            ways += (2.0 if whole and self.wrap[d] else 1.0) / stride
        return ways


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """Levels of links from the device outward, and how they are named.

    Attributes:
      levels: innermost first.
      devices_per_host: devices one process drives (TPU VM, GPU server or tray): for multi-host
        runs and host offload; plays no part in pricing inside a level.
      text: the description it was parsed from, canonical (`parse_topology` reads it back).
    """

    levels: tuple[Level, ...]
    devices_per_host: int
    text: str = ""

    def __post_init__(self):
        if not self.levels:
            raise ValueError("a topology needs at least one level")

    @property
    def num_devices(self) -> int:
        return math.prod(lv.size for lv in self.levels)

    @property
    def domain_size(self) -> int:
        """Devices of one unit of level 0 (a slice, an NVLink domain, a host)."""
        return self.levels[0].size

    @property
    def domains(self) -> int:
        return self.num_devices // self.domain_size

    def digits(self, positions: Sequence[int]) -> np.ndarray:
        """[n, levels] index of each position within each level (mixed radix, level 0 fastest)."""
        pos = np.asarray(positions, dtype=np.int64)
        out = np.empty((len(pos), len(self.levels)), dtype=np.int64)
        for i, lv in enumerate(self.levels):
            out[:, i] = pos % lv.size
            pos = pos // lv.size
        return out

    def group_ports(self, positions: Sequence[int]) -> tuple[int, float]:
        """(the outermost level the devices at `positions` span, the links' worth a ring over them
        uses there: 1 on a switched level, `Level.ports` on a torus)."""
        digits = self.digits(positions)
        crossed = [i for i in range(len(self.levels)) if len(np.unique(digits[:, i])) > 1]
        if not crossed:
            return 0, 1.0
        i = crossed[-1]
        lv = self.levels[i]
        if not lv.torus:
            return i, 1.0
        coords = np.stack(np.unravel_index(digits[:, i], lv.torus), axis=1)
        return i, lv.ports(coords)

    def group_link(self, positions: Sequence[int]) -> AxisLink:
        """The link a collective over the devices at `positions` runs at (see the module doc)."""
        i, ports = self.group_ports(positions)
        link = self.levels[i].link
        return AxisLink(link.latency, 1.0 / (link.bandwidth * ports))

    def mesh_links(self, shape: Sequence[int], positions: Sequence[int] | None = None
                   ) -> tuple[tuple[AxisLink, ...], tuple[tuple[tuple[int, ...], AxisLink], ...]]:
        """(link of each axis, link of each group of two or more axes) of a mesh of `shape` laid out
        row-major over `positions` (default: the first prod(shape) positions)."""
        size = math.prod(shape)
        pos = np.arange(size) if positions is None else np.asarray(positions, dtype=np.int64)
        if len(pos) != size or (len(pos) and int(pos.max()) >= self.num_devices):
            raise ValueError(f"a mesh of {size} devices does not fit positions of a {self.num_devices}-device "
                             "topology")
        grid = pos.reshape(tuple(shape))
        ndim = len(shape)

        def link(axes: tuple[int, ...]) -> AxisLink:
            index = tuple(slice(None) if a in axes else 0 for a in range(ndim))
            return self.group_link(grid[index].ravel())

        singles = tuple(link((a,)) for a in range(ndim))
        groups = tuple((axes, link(axes)) for k in range(2, ndim + 1)
                       for axes in itertools.combinations(range(ndim), k))
        return singles, groups

    def split_axes(self, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Each axis of a row-major mesh as (its size across level-0 units, its size inside one):
        MaxText's dcn_* and ici_* parallelism of that axis."""
        out = []
        for a in range(len(shape)):
            stride = math.prod(shape[a + 1:])
            inner = max(1, min(shape[a], self.domain_size // stride)) if stride < self.domain_size else 1
            out.append((shape[a] // inner, inner))
        return tuple(out)

    def describe(self) -> str:
        parts = []
        for lv in self.levels:
            shape = "x".join(map(str, lv.torus)) + (" torus" if any(lv.wrap) else " mesh") if lv.torus else ""
            parts.append(f"{lv.size} {lv.name}" + (f" ({shape})" if shape else ""))
        return " > ".join(parts)

    def __str__(self) -> str:
        return self.text or self.describe()


# ----- descriptions users write ----------------------------------------------------------------
# Per-port ICI bandwidth, one direction: the Cloud TPU system-architecture pages' bidirectional ICI
# bandwidth per chip / ports / 2 directions: v5p 1,200 GB/s over 6 ports = 100 GB/s; v5e 400 GB/s
# over 4 = 50 GB/s; v6e 800 GB/s over 4 = 100 GB/s; v4 ~50 GB/s per link per direction (TPU v4
# paper, Jouppi et al., ISCA 2023), as the `tpu-v4` preset.
_ICI_PORT = {"tpu-v4": 50e9, "tpu-v5p": 100e9, "tpu-v5e": 50e9, "tpu-v6e": 100e9}
# Wraparound: v4 and v5p slices made of whole 4x4x4 cubes wrap around along every dimension
# (Cloud TPU v5p docs' configuration table lists slices by cubes; the scaling book, part 2: "full
# cubes have wraparounds"); v5e and v6e only along a dimension of the full pod's length 16.
_CUBE = {"tpu-v4", "tpu-v5p"}
_TPU_SLICE, _NVL72 = TPU_SLICE_PATTERN, NVL72_PATTERN


def _wraps(generation: str, shape: tuple[int, ...]) -> tuple[bool, ...]:
    if generation in _CUBE:
        cubes = len(shape) == 3 and all(d % 4 == 0 for d in shape)
        return tuple(cubes for _ in shape)
    return tuple(d == 16 for d in shape)


def tpu_slices(generation: str, shape: Sequence[int], slices: int = 1) -> tuple[Topology, Hardware]:
    """`slices` TPU slices of physical `shape` (Cloud TPU's topology, e.g. (8, 8, 8)), joined by the
    data-center network when there are several."""
    hw = get_hardware(generation)
    if hw.name not in _ICI_PORT:
        raise ValueError(f"{generation!r} is not a TPU generation with slices ({', '.join(sorted(_ICI_PORT))})")
    shape = tuple(int(d) for d in shape)
    want = 3 if hw.name in _CUBE else 2
    if len(shape) != want or any(d < 1 for d in shape):
        raise ValueError(f"a {hw.name} slice is a {want}-D torus such as "
                         f"{'8x8x8' if want == 3 else '16x16'}; got {'x'.join(map(str, shape))}")
    if not (isinstance(slices, int) and slices >= 1):
        raise ValueError(f"slices={slices!r} must be an int >= 1")
    levels = [Level("ici", math.prod(shape), Link(_ICI_PORT[hw.name], hw.intra_latency), shape,
                    _wraps(hw.name, shape))]
    if slices > 1:
        levels.append(Level("dcn", slices, Link(hw.inter_bandwidth, hw.inter_latency)))
    short = hw.name.removeprefix("tpu-")
    text = (f"{slices}x" if slices > 1 else "") + f"{short}:" + "x".join(map(str, shape))
    return Topology(tuple(levels), min(hw.devices_per_host, math.prod(shape)), text), hw


def nvl72(racks: int = 1) -> tuple[Topology, Hardware]:
    """`racks` GB200 NVL72 racks: 72 GPUs on NVLink switches each, racks joined by InfiniBand."""
    if not (isinstance(racks, int) and racks >= 1):
        raise ValueError(f"racks={racks!r} must be an int >= 1")
    hw = GB200
    levels = [Level("nvlink", 72, Link(hw.intra_bandwidth, hw.intra_latency))]
    if racks > 1:
        levels.append(Level("infiniband", racks, Link(hw.inter_bandwidth, hw.inter_latency)))
    return Topology(tuple(levels), hw.devices_per_host, f"gb200-nvl72:{racks}"), hw


def levels_text(topology: Topology, hardware: Hardware) -> str:
    """A topology given as levels, as one line of JSON that `parse_topology` reads back (how plan
    options carry a cluster file's topology)."""
    levels = []
    for lv in topology.levels:
        d: dict[str, Any] = {"name": lv.name, "size": lv.size,
                             "link": {"bandwidth": lv.link.bandwidth, "latency": lv.link.latency}}
        if lv.torus:
            d["torus"], d["wrap"] = list(lv.torus), list(lv.wrap)
        levels.append(d)
    return json.dumps({"hardware": hardware.name, "devices_per_host": topology.devices_per_host, "levels": levels},
                      separators=(",", ":"))


def parse_topology(text: str) -> tuple[Topology, Hardware]:
    """(topology, hardware) of a description: `[SLICESx]GEN:AxBxC` (TPU slices: v4, v5p, v5e, v6e) or
    `gb200-nvl72[:RACKS]`.

    Raises:
      ValueError: anything else, in one line.
    """
    if text.lstrip().startswith("{"):
        from planner.core.units import parse_link
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"topology JSON: {e.msg}") from None
        hw = get_hardware(data.get("hardware"))
        topo = topology_from_levels(data.get("levels"), hw, data.get("devices_per_host"), parse_link, "topology")
        return dataclasses.replace(topo, text=levels_text(topo, hw)), hw
    m = _TPU_SLICE.match(text)
    if m:
        shape = tuple(int(d) for d in m.group(4).replace(" ", "").lower().split("x"))
        return tpu_slices(m.group(3).lower(), shape, int(m.group(1) or 1))
    m = _NVL72.match(text)
    if m:
        return nvl72(int(m.group(1) or 1))
    raise ValueError(f"{text!r} is not a topology; write e.g. 'v5p:8x8x8' (one TPU slice), '2xv5p:8x8x8' (two "
                     "slices over DCN) or 'gb200-nvl72:2' (two NVL72 racks)")


def two_level(hosts: int, devices_per_host: int, intra: Link, inter: Link) -> Topology:
    """The topology of `HOSTSxDEVICES` clusters: a switched host, hosts on a switched network."""
    levels = [Level("host", devices_per_host, intra)]
    if hosts > 1:
        levels.append(Level("network", hosts, inter))
    return Topology(tuple(levels), devices_per_host)


def topology_from_levels(levels: Sequence[Mapping[str, Any]], hardware: Hardware, devices_per_host: int | None,
                         parse_link: Callable[[Any, str], tuple[float, float | None]], where: str) -> Topology:
    """A topology from JSON levels, each {"name", "size", "link": "BANDWIDTH[,LATENCY]", optional
    "torus": [..], "wrap": [..]} (a torus link is one port's, one direction).

    Raises:
      ValueError: a malformed level, naming it.
    """
    out = []
    if not isinstance(levels, (list, tuple)) or not levels:
        raise ValueError(f"{where}: 'levels' must be a non-empty list")
    for i, lv in enumerate(levels):
        if not isinstance(lv, Mapping) or not {"size", "link"} <= set(lv):
            raise ValueError(f"{where}: level {i} needs 'size' and 'link' (and optionally 'name', 'torus', 'wrap')")
        unknown = sorted(set(lv) - {"name", "size", "link", "torus", "wrap"})
        if unknown:
            raise ValueError(f"{where}: level {i} has unknown key(s) {', '.join(unknown)}")
        bandwidth, latency = parse_link(lv["link"], f"level {i} link")
        default_latency = hardware.intra_latency if i == 0 else hardware.inter_latency
        torus = tuple(lv.get("torus") or ())
        wrap = tuple(bool(w) for w in lv.get("wrap", [True] * len(torus)))
        out.append(Level(str(lv.get("name", f"level{i}")), lv["size"],
                         Link(bandwidth, default_latency if latency is None else latency), torus, wrap))
    return Topology(tuple(out), devices_per_host or min(hardware.devices_per_host, out[0].size))


# ----- real devices ----------------------------------------------------------------------------
def device_coords(device: Any) -> tuple[int, tuple[int, ...]] | None:
    """(slice index, physical coordinates) of a TPU device, None for devices without coordinates."""
    coords = getattr(device, "coords", None)
    if coords is None:
        return None
    return int(getattr(device, "slice_index", 0) or 0), tuple(int(c) for c in coords)


def from_devices(devices: Sequence[Any], coords_of: Callable[[Any], Any] = device_coords
                 ) -> tuple[Topology, Hardware] | None:
    """The topology of live TPU devices (their slices and the bounding box of their coordinates),
    None where the devices carry no coordinates (GPU, CPU) or their kind is not a TPU preset."""
    from planner.cost_model.hardware import hardware_for_device_kind

    found = [coords_of(d) for d in devices]
    if not devices or any(c is None for c in found):
        return None
    hw = hardware_for_device_kind(str(getattr(devices[0], "device_kind", "")))
    if hw is None or hw.name not in _ICI_PORT:
        return None
    slices = sorted({s for s, _ in found})
    per_slice = len(devices) // len(slices)
    ndim = 3 if hw.name in _CUBE else 2
    cs = np.array([c[:ndim] + (0,) * (ndim - len(c[:ndim])) for _, c in found])
    shape = tuple(int(x) for x in cs.max(axis=0) - cs.min(axis=0) + 1)
    if math.prod(shape) != per_slice:
        # several cores per chip, or a partial slice: not a whole torus; price it as the preset does
        return None
    return tpu_slices(hw.name, shape, len(slices))


def device_order(devices: Sequence[Any], topology: Topology,
                 coords_of: Callable[[Any], Any] = device_coords) -> list[Any]:
    """`devices` in topology position order (slice, then torus position row-major), the order the
    plan's costs assumed; devices without coordinates keep their order."""
    found = [coords_of(d) for d in devices]
    if any(c is None for c in found) or not topology.levels[0].torus:
        return list(devices)
    torus = topology.levels[0].torus
    cs = np.array([c[:len(torus)] for _, c in found])
    lo = cs.min(axis=0)
    slices = sorted({s for s, _ in found})
    rank = {s: i for i, s in enumerate(slices)}

    def position(i: int) -> int:
        s, _ = found[i]
        inner = int(np.ravel_multi_index(tuple(cs[i] - lo), torus))
        return rank[s] * topology.domain_size + inner

    return [devices[i] for i in sorted(range(len(devices)), key=position)]
