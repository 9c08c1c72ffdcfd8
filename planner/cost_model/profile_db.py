"""The profile database `planner profile` writes and the cost model reads: versioned JSON.

One file describes one cluster: device kind and count, the host of each device, the mesh it was
measured on, the jax version and date, the raw samples (every repetition of every collective over
every axis group and size, plus matmul and memory-bandwidth runs) and the alpha-beta fit of each
(collective, axis group). Axis groups are also stored by the device positions they connect (the
group holding device 0 of the row-major layout), so a profile measured on one mesh shape serves
another mesh over the same devices wherever the groups coincide.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from planner.cost_model.cluster import group_offsets, spans_hosts
from planner.cost_model.collectives import COLLECTIVES, AxisLink, analytic_time, ring_bytes, ring_steps
from planner.cost_model.fit import Curve, Fit, fit_alpha_beta, geometric_sizes
from planner.cost_model.hardware import Hardware, hardware_for_device_kind
from planner.cost_model.topology import is_topology
from planner.core.errors import ProfileError
from planner.core.mesh import MeshSpec, default_axis_names

FORMAT = "planner-profile"
VERSION = 1


class ProfileWarning(UserWarning):
    """A profile database that serves the plan only in part (another mesh shape, unmeasured groups)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveSamples:
    """Every measurement of one collective over one axis group.

    Attributes:
      collective: one of `COLLECTIVES`.
      axes: the profiled mesh's axes the group spans.
      devices: device positions of the group holding device 0 (row-major layout).
      nbytes: buffer size of each measured point (see `collectives` for what the size means).
      seconds: raw wall time of each repetition at each size.
      fit: alpha-beta fit of the overhead-corrected median times.
    """

    collective: str
    axes: tuple[int, ...]
    devices: tuple[int, ...]
    nbytes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    fit: Fit

    @property
    def group_size(self) -> int:
        return len(self.devices)


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileDB:
    """A loaded profile database (see the module docstring).

    Attributes:
      device_kind: `jax.Device.device_kind` of the profiled devices.
      platform: "cpu", "gpu" or "tpu".
      num_devices: devices profiled.
      num_processes: `jax.process_count()` of the run.
      host_of: process index of each device position of the mesh.
      mesh: the mesh the collectives were measured on.
      jax_version: jax version of the run.
      created: ISO-8601 UTC time of the run.
      settings: the job's options (sizes, repetitions).
      dispatch_overhead_s: time of launching an empty program, removed from every sample.
      collectives: the measurements.
      matmul_flops: measured matmul FLOP/s per device, per dtype name.
      memory_bandwidth: measured bytes/s per device (read + write), or None.
      compute_samples: raw matmul / memory runs.
      path: file the database was read from (None when built in memory).
      kernel_launch_s: measured least time of one kernel inside a program (None: not measured).
      device_memory_bytes: memory one device can allocate (None: the backend does not say).
      host_bandwidth: measured bytes/s of one direction of a device's link to its host's pinned
        memory, as the planned program copies (None: not measured, or no host memory space).
      topology: the profiled devices' topology (`cost_model.topology`, e.g. "2xv5p:4x4x4") when
        they carry their place in a torus; None: hosts (`host_of`) on a network.
    """

    device_kind: str
    platform: str
    num_devices: int
    num_processes: int
    host_of: tuple[int, ...]
    mesh: MeshSpec
    jax_version: str
    created: str
    settings: Mapping[str, Any]
    dispatch_overhead_s: float
    collectives: tuple[CollectiveSamples, ...]
    matmul_flops: tuple[tuple[str, float], ...] = ()
    memory_bandwidth: float | None = None
    compute_samples: tuple[Mapping[str, Any], ...] = ()
    path: str | None = None
    kernel_launch_s: float | None = None
    device_memory_bytes: float | None = None
    host_bandwidth: float | None = None
    topology: str | None = None

    @property
    def name(self) -> str:
        return self.path or "<in-memory profile>"

    def net_seconds(self, raw: float) -> float:
        """A sample's time without the launch overhead (never below 1% of the raw time)."""
        return max(raw - self.dispatch_overhead_s, 0.01 * raw)

    def curve(self, entry: CollectiveSamples) -> Curve:
        xs = [b for b, reps in zip(entry.nbytes, entry.seconds) for _ in reps]
        ys = [self.net_seconds(s) for reps in entry.seconds for s in reps]
        return Curve.from_samples(xs, ys, entry.fit)

    def entries(self, collective: str | None = None) -> tuple[CollectiveSamples, ...]:
        return tuple(e for e in self.collectives if collective is None or e.collective == collective)

    # ---- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "jax_version": self.jax_version,
            "platform": self.platform,
            "device_kind": self.device_kind,
            "num_devices": self.num_devices,
            "num_processes": self.num_processes,
            "host_of": list(self.host_of),
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(self.mesh.axis_names)},
            "settings": dict(self.settings),
            "dispatch_overhead_s": self.dispatch_overhead_s,
            "collectives": [
                {
                    "collective": e.collective,
                    "axes": list(e.axes),
                    "axis_names": [self.mesh.axis_names[a] for a in e.axes],
                    "group_size": e.group_size,
                    "devices": list(e.devices),
                    "samples": [{"nbytes": b, "seconds": list(s)} for b, s in zip(e.nbytes, e.seconds)],
                    "fit": e.fit.to_json(),
                }
                for e in self.collectives
            ],
            "compute": {
                "matmul_flops": dict(self.matmul_flops),
                "memory_bandwidth": self.memory_bandwidth,
                "kernel_launch_s": self.kernel_launch_s,
                "device_memory_bytes": self.device_memory_bytes,
                "host_bandwidth": self.host_bandwidth,
                "samples": [dict(s) for s in self.compute_samples],
            },
            **({"topology": self.topology} if self.topology else {}),
        }

    @classmethod
    def from_json(cls, data: Any, path: str | None = None) -> ProfileDB:
        """Validates and reads a database; every problem is a `ProfileError` naming the file."""
        name = path or "<in-memory profile>"
        reader = _Reader(name)
        if not isinstance(data, Mapping):
            raise ProfileError(f"profile {name}: expected a JSON object at the top level, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ProfileError(f"profile {name}: not a planner profile database (missing \"format\": \"{FORMAT}\"); "
                               "write one with `planner profile --out FILE`")
        version = reader.get(data, "version", int)
        if version > VERSION or version < 1:
            raise ProfileError(f"profile {name}: format version {version} is not supported (this planner reads "
                               f"version {VERSION}); re-run `planner profile` with this planner")
        mesh, num_devices, host_of = reader.devices(data)
        overhead = reader.get(data, "dispatch_overhead_s", float)
        entries = [reader.collective(e, f"collectives[{i}]", mesh)
                   for i, e in enumerate(reader.get_list(data, "collectives", Mapping))]
        compute, flops, bw, launch, capacity, host = reader.compute(data)
        return cls(
            device_kind=reader.get(data, "device_kind", str),
            platform=str(data.get("platform", "")),
            num_devices=num_devices,
            num_processes=reader.get(data, "num_processes", int),
            host_of=host_of,
            mesh=mesh,
            jax_version=str(data.get("jax_version", "")),
            created=str(data.get("created", "")),
            settings=dict(data.get("settings") or {}),
            dispatch_overhead_s=overhead,
            collectives=tuple(entries),
            matmul_flops=tuple((str(k), float(v)) for k, v in flops.items()),
            memory_bandwidth=None if bw is None else float(bw),
            compute_samples=tuple(s for s in compute.get("samples", ()) if isinstance(s, Mapping)),
            path=path,
            kernel_launch_s=None if launch is None else float(launch),
            device_memory_bytes=None if capacity is None else float(capacity),
            host_bandwidth=None if host is None else float(host),
            topology=reader.topology(data),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProfileDB:
        """Reads a database file.

        Raises:
          ProfileError: the file is missing, unreadable, not JSON, or not a valid database.
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ProfileError(f"profile {path}: no such file; write one with `planner profile --out {path}`") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                               "the file is corrupt or truncated, re-run `planner profile`") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"profile {path}: cannot be read ({e})") from None
        return cls.from_json(data, path)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the database atomically: a temporary file in the same folder, then `os.replace`,
        so a reader never sees a half-written file and an interrupted run leaves the old one."""
        write_json_atomic(path, self.to_json())

    # ---- synthetic databases ------------------------------------------------------------------

    @classmethod
    def synthetic(cls, mesh: MeshSpec | Sequence[int], links: Sequence[AxisLink], *, device_kind: str = "cpu",
                  platform: str = "cpu", host_of: Sequence[int] | None = None,
                  sizes: Sequence[int] = geometric_sizes(1024, 64 * 2**20), collectives: Sequence[str] = COLLECTIVES,
                  matmul_flops: Mapping[str, float] | None = None, memory_bandwidth: float | None = None) -> ProfileDB:
        """A database whose samples follow the analytic model with the given per-axis links.

        For what-if planning ("what if axis 0 were 10x slower?") and for tests.
        """
        if not isinstance(mesh, MeshSpec):
            mesh = MeshSpec(tuple(mesh), default_axis_names(len(tuple(mesh))))
        host_of = tuple(host_of) if host_of is not None else (0,) * mesh.size
        entries = []
        for axes in axis_groups(mesh):
            for kind in collectives:
                ts = tuple((analytic_time(kind, b, axes, mesh, links),) for b in sizes)
                fit = fit_alpha_beta(sizes, [t[0] for t in ts])
                entries.append(CollectiveSamples(kind, axes, group_offsets(mesh, axes), tuple(sizes), ts, fit))
        return cls(device_kind, platform, mesh.size, len(set(host_of)), host_of, mesh, "synthetic",
                   utc_now(), {"synthetic": True}, 0.0, tuple(entries),
                   tuple((matmul_flops or {}).items()), memory_bandwidth)


def axis_groups(mesh: MeshSpec) -> tuple[tuple[int, ...], ...]:
    """Every non-empty set of mesh axes of size > 1 whose devices differ from a smaller set's,
    singletons first (the groups the profiler measures and the planner can use)."""
    axes = [a for a in range(mesh.ndim) if mesh.shape[a] > 1]
    out, seen = [], set()
    for r in range(1, len(axes) + 1):
        for group in itertools.combinations(axes, r):
            key = group_offsets(mesh, group)
            if key not in seen:
                seen.add(key)
                out.append(group)
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class MeasuredCollectives:
    """Profile curves bound to one planning mesh: (collective, sorted axes) -> curve.

    Attributes:
      curves: measured curve per (collective, axes of the planning mesh).
      links: per planning-mesh axis, the link implied by the fits of a collective over that axis
        alone (latency per ring step from the whole-range fit, cost per ring byte from the
        large-message fit), or None where the axis was not measured.
      inter_host_axes: planning-mesh axes whose groups span hosts of the profiled cluster.
      source: the database's file name.
    """

    curves: Mapping[tuple[str, tuple[int, ...]], Curve]
    links: tuple[AxisLink | None, ...]
    inter_host_axes: tuple[int, ...]
    source: str

    def get(self, kind: str, axes: tuple[int, ...]) -> Curve | None:
        return self.curves.get((kind, axes))


def load_profile(profile: Any) -> ProfileDB:
    """A `ProfileDB` from a path, a parsed JSON mapping, or a `ProfileDB` (passed through).

    Raises:
      ProfileError: the file or mapping is not a usable database.
    """
    if isinstance(profile, ProfileDB):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return ProfileDB.load(profile)
    if isinstance(profile, Mapping):
        return ProfileDB.from_json(profile)
    raise ProfileError(f"profile={profile!r} is neither a file path nor a loaded ProfileDB; pass the path "
                       "`planner profile --out` wrote")


def check_device_kind(db: ProfileDB, hardware: Hardware | None, local_kind: str | None) -> None:
    """Raises ProfileError when the database was measured on other devices than those planned for:
    the requested hardware preset's, or else the devices this process sees (`local_kind`)."""
    if hardware is not None:
        if hardware.device_kind and not hardware.matches_device_kind(db.device_kind):
            raise ProfileError(
                f"profile {db.name} was measured on {db.device_kind!r} devices but hardware={hardware.name!r} was "
                "requested; re-run `planner profile` on that hardware, or drop the hardware option to plan for "
                "the profiled devices"
            )
        return
    if local_kind is not None and local_kind.strip().lower() != db.device_kind.strip().lower():
        preset = hardware_for_device_kind(db.device_kind)
        fix = f"pass hardware={preset.name!r} to plan for them from here" if preset else "plan on the profiled cluster"
        raise ProfileError(
            f"profile {db.name} was measured on {db.device_kind!r} devices but this process has {local_kind!r} "
            f"devices; re-run `planner profile` here, or {fix}"
        )


def bind(db: ProfileDB, mesh: MeshSpec) -> MeasuredCollectives:
    """Matches the database's axis groups to the planning mesh's.

    Args:
      db: the database.
      mesh: the planning mesh.

    Raises:
      ProfileError: the database was measured on another number of devices.

    Warns:
      ProfileWarning: the mesh differs from the profiled one and some axis groups of the planning
        mesh were not measured (those use the analytic model).
    """
    if db.num_devices != mesh.size:
        raise ProfileError(
            f"profile {db.name} was measured on {db.num_devices} devices (mesh {db.mesh}) but the planning mesh "
            f"{mesh} has {mesh.size}; re-run `planner profile` on the cluster you plan for"
        )
    by_devices: dict[tuple[str, tuple[int, ...]], CollectiveSamples] = {}
    for e in db.collectives:
        by_devices.setdefault((e.collective, e.devices), e)
    curves: dict[tuple[str, tuple[int, ...]], Curve] = {}
    missing = []
    for axes in axis_groups(mesh):
        key = group_offsets(mesh, axes)
        found = False
        for kind in COLLECTIVES:
            e = by_devices.get((kind, key))
            if e is not None:
                curves[(kind, axes)] = db.curve(e)
                found = True
        if not found:
            missing.append(axes)
    links: list[AxisLink | None] = []
    for a in range(mesh.ndim):
        link = None
        n = mesh.shape[a]
        for kind in ("all-reduce", "all-gather", "reduce-scatter"):
            c = curves.get((kind, (a,)))
            if c is not None and n > 1 and c.slope > 0:
                link = AxisLink(c.fit.alpha / ring_steps(kind, n), c.slope / ring_bytes(kind, 1.0, n))
                break
        links.append(link)
    if tuple(db.mesh.shape) != tuple(mesh.shape) and missing:
        names = ", ".join("*".join(mesh.axis_names[a] for a in g) for g in missing)
        warnings.warn(
            f"profile {db.name} was measured on mesh {db.mesh}, not {mesh}: axis group(s) {names} of the planning "
            "mesh were not measured and use the analytic model; profile with `--mesh "
            f"{mesh}` for measured times everywhere",
            ProfileWarning,
            stacklevel=3,
        )
    inter = tuple(a for a in range(mesh.ndim) if spans_hosts(mesh, (a,), db.host_of))
    return MeasuredCollectives(curves, tuple(links), inter, db.name)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Writes `data` as JSON to `path` atomically (temporary file in the same folder, fsync, replace)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


class _Reader:
    """Typed field access that turns a missing or mistyped field into a ProfileError."""

    def __init__(self, name: str):
        self.name = name

    def _fail(self, where: str, key: str, problem: str) -> ProfileError:
        at = f"{where}.{key}" if where else key
        return ProfileError(f"profile {self.name}: field {at!r} {problem}; the file is corrupt or from another "
                            "tool, re-run `planner profile`")

    def _check(self, value: Any, typ: type, where: str, key: str) -> Any:
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self._fail(where, key, f"must be a number, got {value!r}")
            return float(value)
        if typ is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self._fail(where, key, f"must be an integer, got {value!r}")
            return value
        if not isinstance(value, typ):
            raise self._fail(where, key, f"must be of type {getattr(typ, '__name__', typ)}, got {type(value).__name__}")
        return value

    def get(self, d: Mapping, key: str, typ: type, where: str = "") -> Any:
        if key not in d:
            raise self._fail(where, key, "is missing")
        return self._check(d[key], typ, where, key)

    def get_list(self, d: Mapping, key: str, typ: type, where: str = "") -> list:
        items = self.get(d, key, list, where)
        return [self._check(v, typ, where, f"{key}[{i}]") for i, v in enumerate(items)]

    def topology(self, data: Mapping) -> str | None:
        text = data.get("topology")
        if text is None:
            return None
        if not is_topology(text):
            raise ProfileError(f"profile {self.name}: topology={text!r} is not a topology description such as "
                               "'v5p:4x4x4'")
        return str(text)

    def devices(self, data: Mapping) -> tuple[MeshSpec, int, tuple[int, ...]]:
        """(mesh, number of devices, host of each device), checked against each other."""
        name = self.name
        mesh_d = self.get(data, "mesh", Mapping)
        shape = tuple(self.get_list(mesh_d, "shape", int, "mesh"))
        names = tuple(self.get_list(mesh_d, "axis_names", str, "mesh"))
        try:
            mesh = MeshSpec(shape, names)
        except ValueError as e:
            raise ProfileError(f"profile {name}: bad mesh: {e}") from None
        num_devices = self.get(data, "num_devices", int)
        if num_devices != mesh.size:
            raise ProfileError(f"profile {name}: num_devices={num_devices} differs from the mesh {mesh} "
                               f"({mesh.size} devices)")
        host_of = tuple(self.get_list(data, "host_of", int))
        if len(host_of) != num_devices:
            raise ProfileError(f"profile {name}: host_of lists {len(host_of)} devices, expected {num_devices}")
        return mesh, num_devices, host_of

    def collective(self, e: Mapping, where: str, mesh: MeshSpec) -> CollectiveSamples:
        """One collective's samples and fit (`where`: its place in the file, for errors)."""
        name = self.name
        kind = self.get(e, "collective", str, where)
        if kind not in COLLECTIVES:
            raise ProfileError(f"profile {name}: {where}.collective={kind!r} is not one of {COLLECTIVES}")
        axes = tuple(self.get_list(e, "axes", int, where))
        if not axes or any(not 0 <= a < mesh.ndim for a in axes):
            raise ProfileError(f"profile {name}: {where}.axes={list(axes)} are not axes of the mesh {mesh}")
        devices = tuple(self.get_list(e, "devices", int, where))
        if len(devices) != mesh.axis_size(axes):
            raise ProfileError(f"profile {name}: {where}.devices lists {len(devices)} devices but axes "
                               f"{list(axes)} span {mesh.axis_size(axes)}")
        nbytes, seconds = [], []
        for j, s in enumerate(self.get_list(e, "samples", Mapping, where)):
            nbytes.append(self.get(s, "nbytes", int, f"{where}.samples[{j}]"))
            reps = tuple(self.get_list(s, "seconds", float, f"{where}.samples[{j}]"))
            if not reps or any(not (math.isfinite(r) and r > 0) for r in reps):
                raise ProfileError(f"profile {name}: {where}.samples[{j}].seconds must be positive numbers")
            seconds.append(reps)
        if not nbytes:
            raise ProfileError(f"profile {name}: {where} has no samples")
        fd = self.get(e, "fit", Mapping, where)
        fit = Fit(self.get(fd, "alpha", float, f"{where}.fit"), self.get(fd, "beta", float, f"{where}.fit"),
                  float(fd.get("rel_rmse", 0.0)), int(fd.get("samples", 0)))
        if not (fit.alpha >= 0 and fit.beta >= 0 and math.isfinite(fit.alpha) and math.isfinite(fit.beta)):
            raise ProfileError(f"profile {name}: {where}.fit has alpha={fit.alpha}, beta={fit.beta}; "
                               "both must be finite and >= 0")
        return CollectiveSamples(kind, axes, devices, tuple(nbytes), tuple(seconds), fit)

    def compute(self, data: Mapping) -> tuple[Mapping, Mapping, Any, Any, Any, Any]:
        """(the compute block, matmul FLOP/s, memory bandwidth, kernel launch, device memory, host
        bandwidth), each checked (None where the file has none)."""
        name = self.name
        compute = data.get("compute") or {}
        if not isinstance(compute, Mapping):
            raise ProfileError(f"profile {name}: compute must be an object")
        flops = compute.get("matmul_flops") or {}
        if not isinstance(flops, Mapping) or any(not _positive(v) for v in flops.values()):
            raise ProfileError(f"profile {name}: compute.matmul_flops must map dtype names to positive FLOP/s")
        bw = compute.get("memory_bandwidth")
        if bw is not None and not _positive(bw):
            raise ProfileError(f"profile {name}: compute.memory_bandwidth={bw!r} must be a positive number or null")
        launch = compute.get("kernel_launch_s")
        if launch is not None and not (_positive(launch) or launch == 0):
            raise ProfileError(f"profile {name}: compute.kernel_launch_s={launch!r} must be a number >= 0 or null")
        capacity = compute.get("device_memory_bytes")
        if capacity is not None and not _positive(capacity):
            raise ProfileError(f"profile {name}: compute.device_memory_bytes={capacity!r} must be a positive number "
                               "or null")
        host = compute.get("host_bandwidth")
        if host is not None and not _positive(host):
            raise ProfileError(f"profile {name}: compute.host_bandwidth={host!r} must be a positive number or null")
        return compute, flops, bw, launch, capacity, host
