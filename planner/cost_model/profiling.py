"""`planner profile`: the offline job that measures the cluster and writes the profile database.

Measures, on the devices it runs on, every collective of `COLLECTIVES` over every mesh axis and axis
group for message sizes from `--min-bytes` to `--max-bytes`, with warm-up and repetitions, plus
matmul throughput (square GEMMs and attention's batched matmuls), memory bandwidth and the host
link (copies to and from pinned host memory); fits
alpha-beta per (collective, axis group) and writes everything (raw samples included) to a versioned
JSON file, atomically, from process 0.

Multi-host: run one copy per host under `jax.distributed` (`--coordinator HOST:PORT
--num-processes N --process-id I`, or auto-detected from SLURM / Open MPI / Cloud TPU environment
variables as `jax.distributed.initialize()` does). Every process runs the same programs; process 0's
timings are kept.

Usable as `planner profile ...` or `python -m planner.cost_model.profiling ...`. This module is the
job (its sweep, summary and command line); the measurements are `planner.cost_model.measurements`'.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import IO

import jax

from planner.cost_model.cluster import group_offsets
from planner.cost_model.collectives import COLLECTIVES
from planner.cost_model.fit import Curve, geometric_sizes
from planner.cost_model.model import attention_curve, matmul_curve
from planner.cost_model.profile_db import CollectiveSamples, ProfileDB, axis_groups, utc_now
from planner.cost_model.profile_levels import measured_levels, profiled_topology
from planner.cost_model.topology import device_order, from_devices
from planner.core.errors import InvalidArgumentError, PlannerError, ProfileError
from planner.core.mesh import MeshSpec, default_axis_names, parse_mesh
from planner.core.units import parse_bytes, positive_int
from planner.cost_model.measurements import (device_memory_bytes, measure_attention, measure_collective,
                                             measure_host_link, measure_kernel_launch, measure_matmul,
                                             measure_memory, measure_overhead)

# Environment variables under which `jax.distributed.initialize()` finds its cluster by itself.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES")
_MATMUL_DTYPES = ("float32", "bfloat16")


class ProgressBar:
    """A one-line text progress bar (redrawn in place on a terminal, a line per 10% otherwise)."""

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool = True, width: int = 30):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1
        self._start = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {frac:4.0%} {time.perf_counter() - self._start:6.1f}s {label}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if self.done == self.total:
                self.stream.write("\n")
        elif int(frac * 10) != self._last_decile or self.done == self.total:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()


# ---- the job -------------------------------------------------------------------------------------


def profile(mesh: jax.sharding.Mesh, sizes: Sequence[int], repeats: int = 5, warmup: int = 2,
            collectives: Sequence[str] = COLLECTIVES, compute: bool = True,
            progress: ProgressBar | None = None, settings: dict | None = None) -> ProfileDB:
    """Measures `mesh` and returns the database (every process returns the same structure, with
    its own timings).

    Args:
      mesh: the devices to profile, as a mesh (axes define the groups measured).
      sizes: buffer sizes in bytes (see `collectives` for what a collective's size means).
      repeats / warmup: timed and untimed calls per point.
      collectives: which kinds to measure.
      compute: also measure matmul throughput (square GEMMs, attention shapes) and memory bandwidth.
      progress: advanced once per measured point.
      settings: recorded in the database as the job's options.
    """
    spec = MeshSpec(tuple(int(s) for s in mesh.devices.shape), tuple(str(n) for n in mesh.axis_names))
    overhead = measure_overhead(mesh)
    entries = _measure_collectives(mesh, spec, sizes, repeats, warmup, collectives, overhead, progress)
    matmul, memory, host, compute_samples, launch = {}, None, None, [], None
    if compute:
        matmul, memory, host, compute_samples, launch = _measure_compute(mesh, max(sizes), progress)
    device = mesh.devices.flat[0]
    found = from_devices(list(mesh.devices.flat))
    return ProfileDB(
        device_kind=device.device_kind,
        platform=device.platform,
        num_devices=spec.size,
        num_processes=jax.process_count(),
        host_of=tuple(int(d.process_index) for d in mesh.devices.flat),
        mesh=spec,
        jax_version=jax.__version__,
        created=utc_now(),
        settings=dict(settings or {}),
        dispatch_overhead_s=overhead,
        collectives=tuple(entries),
        matmul_flops=tuple(matmul.items()),
        memory_bandwidth=memory,
        compute_samples=tuple(compute_samples),
        kernel_launch_s=launch,
        device_memory_bytes=device_memory_bytes(device),
        host_bandwidth=host,
        topology=str(found[0]) if found is not None else None,
    )


def _measure_collectives(mesh: jax.sharding.Mesh, spec: MeshSpec, sizes: Sequence[int], repeats: int, warmup: int,
                         collectives: Sequence[str], overhead: float,
                         progress: ProgressBar | None) -> list[CollectiveSamples]:
    """Every collective kind over every axis group at every size, with its alpha-beta fit (the
    launch `overhead` taken off each time)."""
    entries = []
    for axes in axis_groups(spec):
        for kind in collectives:
            nbytes, seconds = [], []
            for size in sizes:
                measured, times = measure_collective(mesh, kind, axes, size, repeats, warmup)
                if progress is not None:
                    progress.step(f"{kind} over {'*'.join(spec.axis_names[a] for a in axes)} {_fmt_bytes(size)}")
                if nbytes and measured <= nbytes[-1]:
                    continue  # rounding to the group size made it a repeat of the previous size
                nbytes.append(measured)
                seconds.append(times)
            net = [max(s - overhead, 0.01 * s) for reps in seconds for s in reps]
            xs = [b for b, reps in zip(nbytes, seconds) for _ in reps]
            fit = Curve.from_samples(xs, net).fit
            entries.append(CollectiveSamples(kind, axes, group_offsets(spec, axes), tuple(nbytes), tuple(seconds), fit))
    return entries


def _measure_compute(mesh: jax.sharding.Mesh, max_bytes: int, progress: ProgressBar | None):
    """(matmul FLOP/s per dtype, memory bandwidth, host link bandwidth, the raw samples, kernel launch
    seconds): the device's compute, memory and host link, buffers up to `max_bytes`."""
    matmul, compute_samples = {}, []
    launch = measure_kernel_launch(mesh)
    for dtype in _MATMUL_DTYPES:
        matmul[dtype], s = measure_matmul(mesh, dtype, max(max_bytes, 3 * 128 * 128 * 4))
        compute_samples += s
        if progress is not None:
            progress.step(f"matmul {dtype}")
        compute_samples += measure_attention(mesh, dtype, max(max_bytes, 128 * 128 * 4))
        if progress is not None:
            progress.step(f"attention matmuls {dtype}")
    memory, s = measure_memory(mesh, max_bytes)
    compute_samples += s
    if progress is not None:
        progress.step("memory bandwidth")
    host, s = measure_host_link(mesh, max_bytes)
    compute_samples += s
    if progress is not None:
        progress.step("host link")
    return matmul, memory, host, compute_samples, launch


def progress_steps(spec: MeshSpec, sizes: Sequence[int], collectives: Sequence[str], compute: bool) -> int:
    """How many times `profile` advances its progress bar."""
    return len(axis_groups(spec)) * len(collectives) * len(sizes) + (2 * len(_MATMUL_DTYPES) + 2 if compute else 0)


def summary(db: ProfileDB) -> str:
    """A table of the fits: latency, bandwidth and fit error per (collective, axis group)."""
    lines = [f"profile of {db.num_devices} x {db.device_kind} ({db.num_processes} process(es)), mesh {db.mesh}, "
             f"launch overhead {db.dispatch_overhead_s * 1e6:.1f} us",
             f"  {'collective':<20}{'axes':<12}{'n':>4}{'alpha (us)':>12}{'GB/s':>10}{'fit err':>9}"]
    for e in db.collectives:
        bw = f"{1.0 / e.fit.beta / 1e9:.3f}" if e.fit.beta > 0 else "-"
        axes = "*".join(db.mesh.axis_names[a] for a in e.axes)
        lines.append(f"  {e.collective:<20}{axes:<12}{e.group_size:>4}{e.fit.alpha * 1e6:>12.1f}{bw:>10}"
                     f"{e.fit.rel_rmse:>8.0%}")
    topo = profiled_topology(db)
    for level, link in sorted(measured_levels(db).items()):
        lv = topo.levels[level]
        what = "per port, one direction" if lv.torus else "per device, one direction"
        lines.append(f"  level {lv.name:<10} {link.bandwidth / 1e9:10.2f} GB/s {what}, {link.latency * 1e6:.1f} us per "
                     "step (serves other shapes of this topology)")
    for dtype, flops in db.matmul_flops:
        lines.append(f"  matmul {dtype:<10} {flops / 1e9:10.2f} GFLOP/s per device")
    for cls, points in matmul_curve(db):
        lines.append(f"  GEMM curve {cls:<8} " + ", ".join(f"{round((f / 2) ** (1 / 3))}^3: {r / 1e9:.1f}"
                                                           for f, r in points) + " GFLOP/s")
    for cls, d, points in attention_curve(db):
        lines.append(f"  attention {cls:<8} d={d:<4} " + ", ".join(f"{_fmt_flops(f)}: {r / 1e9:.1f}"
                                                                 for f, r in points) + " GFLOP/s")
    if db.memory_bandwidth:
        lines.append(f"  memory bandwidth  {db.memory_bandwidth / 1e9:10.2f} GB/s per device")
    if db.host_bandwidth:
        lines.append(f"  host link         {db.host_bandwidth / 1e9:10.2f} GB/s per device, each way")
    if db.kernel_launch_s is not None:
        lines.append(f"  kernel launch     {db.kernel_launch_s * 1e6:10.2f} us per kernel")
    return "\n".join(lines)


def _fmt_flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOP"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}B"


# ---- command line --------------------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return int(parse_bytes(text, "size"))
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `planner profile` options to `parser`."""
    parser.add_argument("--out", required=True, metavar="FILE", help="profile database to write (JSON)")
    parser.add_argument("--max-bytes", type=_size, default=256 * 2**20, metavar="SIZE",
                        help="largest message per device, e.g. 64MiB (default 256MiB)")
    parser.add_argument("--min-bytes", type=_size, default=1024, metavar="SIZE",
                        help="smallest message per device (default 1KiB)")
    parser.add_argument("--step", type=positive_int, default=4, metavar="K",
                        help="message size grows by this factor, 2 or more (default 4)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per point (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing (default 2)")
    parser.add_argument("--mesh", default=None, metavar="SHAPE",
                        help="mesh to measure, e.g. 2x4 (default: processes x local devices, or all devices 1-D)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), metavar="LIST",
                        help="comma-separated subset of " + ", ".join(COLLECTIVES))
    parser.add_argument("--no-compute", action="store_true",
                        help="skip the matmul, attention and memory-bandwidth runs")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="jax.distributed coordinator address (multi-host runs)")
    parser.add_argument("--num-processes", type=positive_int, default=None, metavar="N",
                        help="processes in the jax.distributed run")
    parser.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def _init_distributed(args: argparse.Namespace) -> None:
    explicit = args.coordinator is not None or args.num_processes is not None or args.process_id is not None
    auto = any(v in os.environ for v in _CLUSTER_ENV) or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1
    if not (explicit or auto):
        return
    # CPU devices exchange data across processes only with a collectives library.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (RuntimeError, ValueError) as e:
        raise ProfileError(
            f"jax.distributed.initialize(coordinator={args.coordinator!r}, num_processes={args.num_processes!r}, "
            f"process_id={args.process_id!r}) failed: {e}; pass --coordinator HOST:PORT --num-processes N "
            "--process-id I on every host"
        ) from None


def _mesh(text: str | None) -> jax.sharding.Mesh:
    """The mesh measured: --mesh, else on devices that carry torus coordinates (TPU) the slices
    and the torus dimensions, one axis each (every level measured alone), the devices in topology
    order; else processes x local devices."""
    devices = jax.devices()
    found = from_devices(devices)
    if found is not None:
        devices = device_order(devices, found[0])
    if text is None and found is not None:
        topo = found[0]
        shape = ((topo.domains,) if topo.domains > 1 else ()) + tuple(topo.levels[0].torus)
        spec = MeshSpec(shape, default_axis_names(len(shape)))
    elif text is None:
        procs = jax.process_count()
        shape = (procs, len(devices) // procs) if procs > 1 else (len(devices),)
        spec = MeshSpec(shape, default_axis_names(len(shape)))
    else:
        spec, _ = parse_mesh(text, len(devices))
    return spec.to_jax_mesh(devices)


def run(args: argparse.Namespace) -> int:
    """Runs the job described by `args` (from `add_arguments`); returns the exit status."""
    err = sys.stderr
    try:
        if args.min_bytes > args.max_bytes:
            raise InvalidArgumentError(f"--min-bytes {args.min_bytes} exceeds --max-bytes {args.max_bytes}")
        if args.step < 2:
            raise InvalidArgumentError(f"--step {args.step} must be 2 or more")
        kinds = tuple(k.strip() for k in args.collectives.split(",") if k.strip())
        bad = [k for k in kinds if k not in COLLECTIVES]
        if bad or not kinds:
            raise InvalidArgumentError(f"--collectives {args.collectives!r}: choose from {', '.join(COLLECTIVES)}")
        out_dir = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(out_dir):
            raise InvalidArgumentError(f"--out {args.out}: folder {out_dir} does not exist")
        _init_distributed(args)
        mesh = _mesh(args.mesh)
        spec = MeshSpec(tuple(mesh.devices.shape), tuple(mesh.axis_names))
        sizes = geometric_sizes(args.min_bytes, args.max_bytes, args.step)
        lead = jax.process_index() == 0
        bar = ProgressBar(progress_steps(spec, sizes, kinds, not args.no_compute), err, enabled=lead and not args.quiet)
        settings = {"min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "step": args.step,
                    "repeats": args.repeats, "warmup": args.warmup, "collectives": list(kinds)}
        db = profile(mesh, sizes, args.repeats, max(args.warmup, 0), kinds, not args.no_compute, bar, settings)
        if lead:
            db.save(args.out)
            if not args.quiet:
                print(summary(db))
                print(f"wrote {args.out}")
        return 0
    except PlannerError as e:
        print(f"planner profile: error: {e}", file=err)
        return 2
    except KeyboardInterrupt:
        print(f"\nplanner profile: interrupted; {args.out} was not written", file=err)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="planner profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
