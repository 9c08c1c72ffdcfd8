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

Usable as `planner profile ...` or `python -m planner.cost_model.profiling ...`.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from planner.cost_model.cluster import group_offsets
from planner.cost_model.collectives import COLLECTIVES
from planner.cost_model.fit import Curve, geometric_sizes
from planner.cost_model.model import attention_curve, matmul_curve
from planner.cost_model.profile_db import CollectiveSamples, ProfileDB, axis_groups, utc_now
from planner.core.errors import InvalidArgumentError, PlannerError, ProfileError
from planner.core.mesh import MeshSpec, default_axis_names, parse_mesh
from planner.core.units import parse_bytes

# Environment variables under which `jax.distributed.initialize()` finds its cluster by itself.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES")
_MATMUL_DTYPES = ("float32", "bfloat16")
_MATMUL_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
# Attention shapes swept (`measure_attention`): head dimensions and sequence lengths of common
# transformers (GPT-2/3, BERT, Llama: d = 64 or 128; sequences 128 to 8192), and the most
# (batch x heads) slices per matmul, as in a training step's microbatch of 8 sequences x 16 heads.
_HEAD_DIMS = (64, 128)
_ATTENTION_SEQS = (128, 256, 512, 1024, 2048, 4096, 8192)
_ATTENTION_SLICES = 128
# A buffer in host memory in compiled HLO: memory space 5 in its layout (XLA's kHostMemorySpace).
# XLA:GPU's instructions carry it (the copies in and out); XLA:CPU's only its entry layout.
_HOST_SPACE = "S(5)"
# The largest buffer of the host-link measurement: 64 MiB takes ~1 ms each way over PCIe 5 x16,
# out of the noise in a program of a few of them, and `max_chain` of them fit any host.
_HOST_LINK_MAX_BYTES = 64 * 2**20
# Stop growing a compute benchmark once one call takes this long: it is then out of the noise.
_LONG_ENOUGH_S = 0.05


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


# ---- measurement ---------------------------------------------------------------------------------


def _time_calls(fn: Callable[[], jax.Array], repeats: int, warmup: int) -> tuple[float, ...]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return tuple(out)


def _input(mesh: jax.sharding.Mesh, per_device: int, dtype=jnp.float32) -> jax.Array:
    """A 1-D array with `per_device` elements on each device (works across processes)."""
    spec = PartitionSpec(tuple(mesh.axis_names))
    shape = (per_device * mesh.devices.size,)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec),
                                        lambda idx: np.ones((per_device,), dtype=dtype))


def _collective_body(kind: str, names: tuple[str, ...], n: int) -> Callable[[jax.Array], jax.Array]:
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, names)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, names, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, names, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, names, 0, 0, tiled=True)
    if kind == "collective-permute":
        perm = [(i, (i + 1) % n) for i in range(n)]
        return lambda x: jax.lax.ppermute(x, names, perm)
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def _per_device_elems(kind: str, nbytes: int, n: int, itemsize: int = 4) -> tuple[int, int]:
    """Input elements per device for a collective whose buffer (see `collectives`) is ~`nbytes`,
    and the buffer bytes actually measured (rounded so the group size divides the buffer)."""
    elems = max(nbytes // itemsize, n)
    elems -= elems % n
    if kind == "all-gather":
        return elems // n, elems * itemsize
    return elems, elems * itemsize


def _spmd(mesh: jax.sharding.Mesh, body: Callable[[jax.Array], jax.Array]):
    spec = PartitionSpec(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def measure_collective(mesh: jax.sharding.Mesh, kind: str, axes: Sequence[int], nbytes: int, repeats: int = 5,
                       warmup: int = 2) -> tuple[int, tuple[float, ...]]:
    """Wall times of one collective over mesh `axes` on a buffer of about `nbytes` per device.

    Returns:
      (buffer bytes actually measured, raw seconds of each repetition).
    """
    names = tuple(mesh.axis_names[a] for a in axes)
    n = int(np.prod([mesh.devices.shape[a] for a in axes]))
    elems, measured = _per_device_elems(kind, nbytes, n)
    fn = _spmd(mesh, _collective_body(kind, names, n))
    x = _input(mesh, elems)
    times = _time_calls(lambda: fn(x), repeats, warmup)
    return measured, times


def measure_overhead(mesh: jax.sharding.Mesh, repeats: int = 10, warmup: int = 2) -> float:
    """Median time of launching a trivial program on every device (removed from collective times:
    inside a compiled step a collective pays no launch)."""
    fn = _spmd(mesh, lambda x: x + 1.0)
    x = _input(mesh, 256)
    return float(np.median(_time_calls(lambda: fn(x), max(repeats, 3), warmup)))


def measure_kernel_launch(mesh: jax.sharding.Mesh, kernels: int = 129, repeats: int = 20, warmup: int = 2) -> float:
    """Seconds one kernel of a compiled program takes at least: a chain of `kernels` dependent tiny
    matmuls (16x16: the work is negligible; dots are never fused together, so each is one kernel)
    against a chain of one, the difference per extra kernel (`_per_op_seconds`). The program's own
    launch cancels out."""
    x = _input(mesh, 256)

    def program(k: int) -> Callable[[], jax.Array]:
        def body(v):
            m = v.reshape(16, 16)
            for _ in range(k):
                m = m @ m * (1.0 / 16.0)
            return m.reshape(-1)
        fn = _spmd(mesh, body)
        return lambda: fn(x)

    return _per_op_seconds(program, repeats, warmup, chain=kernels, max_chain=kernels)[0]


def device_memory_bytes(device: jax.Device) -> float | None:
    """Memory one device can allocate (`memory_stats()["bytes_limit"]`), None where the backend does
    not say (XLA:CPU)."""
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    limit = (stats or {}).get("bytes_limit")
    return float(limit) if limit else None


def _per_op_seconds(program: Callable[[int], Callable[[], jax.Array]], repeats: int, warmup: int,
                    chain: int = 9, max_chain: int = 513) -> tuple[float, float]:
    """Seconds one op takes inside a compiled program: `program(k)` runs k dependent copies of it,
    timed at k = 1 and k = `chain` (grown 4x until the difference is out of the noise, or
    `max_chain`); the difference per extra op. The launch of the program, its dispatch from the host
    and its synchronisation cancel out: on a GPU they take 50-100 us per call, longer than a small
    kernel. Returns (seconds per op, seconds of the k = 1 program)."""
    t1 = float(np.median(_time_calls(program(1), repeats, warmup)))
    while True:
        tk = float(np.median(_time_calls(program(chain), repeats, warmup)))
        if tk - t1 > _LONG_ENOUGH_S / 10 or chain >= max_chain:
            return max(tk - t1, 0.0) / (chain - 1), t1
        chain = min(4 * chain - 3, max_chain)


def measure_matmul(mesh: jax.sharding.Mesh, dtype: str, max_bytes: int, repeats: int = 3,
                   warmup: int = 1) -> tuple[float, list[dict]]:
    """Best matmul FLOP/s per device with every device multiplying its own square matrices at once,
    each size timed as one matmul of a dependent chain inside one program (`_per_op_seconds`: the
    program's launch does not count)."""
    best, samples = 0.0, []
    for size in _MATMUL_SIZES:
        if 3 * size * size * jnp.dtype(dtype).itemsize > max_bytes:
            break
        x = _input(mesh, size * size, jnp.dtype(dtype))

        def program(k: int, s: int = size, x: jax.Array = x) -> Callable[[], jax.Array]:
            def body(v):
                m = v.reshape(s, s)
                b = m * (1.0 / s)  # ones / s: every product of the chain is ones again
                for _ in range(k):
                    m = m @ b
                return m.reshape(-1)
            fn = _spmd(mesh, body)
            return lambda: fn(x)

        t, whole = _per_op_seconds(program, repeats, warmup)
        flops = 2.0 * size**3 / max(t, 1e-12)
        samples.append({"kind": "matmul", "dtype": dtype, "n": size, "seconds": t, "program_seconds": whole,
                        "flops_per_s": flops})
        best = max(best, flops)
        if t > _LONG_ENOUGH_S:
            break
    return best, samples


def measure_attention(mesh: jax.sharding.Mesh, dtype: str, max_bytes: int, repeats: int = 3,
                      warmup: int = 1) -> list[dict]:
    """The rates of attention's two batched matmuls per device, every device at once: for each head
    dimension d of `_HEAD_DIMS` and sequence length s, g slices (batch x heads; `_ATTENTION_SLICES`,
    fewer where the [g, s, s] scores would pass `max_bytes`) of scores = q k^T ([g, s, d] x [g, s, d]
    -> [g, s, s]) then out = scores v ([g, s, s] x [g, s, d] -> [g, s, d]), the pair timed as one
    link of a dependent chain inside one program (`_per_op_seconds`). Each matmul does 2 g s^2 d
    FLOPs; a sample's rate is the pair's (4 g s^2 d FLOPs over its time). Stops growing s for a d
    once one pair takes `_LONG_ENOUGH_S`."""
    itemsize = jnp.dtype(dtype).itemsize
    samples = []
    for d in _HEAD_DIMS:
        for seq in _ATTENTION_SEQS:
            g = min(_ATTENTION_SLICES, max_bytes // (seq * seq * itemsize))
            if g < 1:
                break
            x = _input(mesh, g * seq * d, jnp.dtype(dtype))

            def program(k: int, g: int = g, s: int = seq, d: int = d, x: jax.Array = x) -> Callable[[], jax.Array]:
                def body(v):
                    q = v.reshape(g, s, d)
                    # ones: k = ones / d makes every score 1, v = ones / s every output 1 again
                    keys, values = q * (1.0 / d), q * (1.0 / s)
                    for _ in range(k):
                        scores = jnp.einsum("gsd,gtd->gst", q, keys)
                        q = jnp.einsum("gst,gtd->gsd", scores, values)
                    return q.reshape(-1)
                fn = _spmd(mesh, body)
                return lambda: fn(x)

            t, whole = _per_op_seconds(program, repeats, warmup)
            samples.append({"kind": "attention", "dtype": dtype, "batch": g, "seq": seq, "head_dim": d,
                            "seconds": t, "program_seconds": whole,
                            "flops_per_s": 4.0 * g * seq * seq * d / max(t, 1e-12)})
            if t > _LONG_ENOUGH_S:
                break
    return samples


def measure_memory(mesh: jax.sharding.Mesh, max_bytes: int, repeats: int = 3,
                   warmup: int = 1) -> tuple[float, list[dict]]:
    """Streaming bandwidth per device (bytes read + written per second), all devices at once, of the
    largest buffer measured (smaller ones may sit in caches): one pass of a k-iteration loop that
    scales a buffer in place (`_per_op_seconds`; a loop, as XLA fuses a chain of elementwise ops
    into one pass)."""
    streaming, samples = 0.0, []
    for nbytes in geometric_sizes(1 << 20, max(max_bytes, 1 << 20), 4):
        x = _input(mesh, nbytes // 4)

        def program(k: int, x: jax.Array = x) -> Callable[[], jax.Array]:
            fn = _spmd(mesh, lambda v: jax.lax.fori_loop(0, k, lambda _, a: a * -1.0, v))
            return lambda: fn(x)

        t, whole = _per_op_seconds(program, repeats, warmup, chain=5, max_chain=65)
        bw = 2.0 * nbytes / max(t, 1e-12)
        samples.append({"kind": "memory", "nbytes": nbytes, "seconds": t, "program_seconds": whole,
                        "bytes_per_s": bw})
        streaming = bw
        if t > _LONG_ENOUGH_S:
            break
    return streaming, samples


def measure_host_link(mesh: jax.sharding.Mesh, max_bytes: int, repeats: int = 3,
                      warmup: int = 1) -> tuple[float | None, list[dict]]:
    """Each device's link to its host's pinned memory (bytes/s per device and direction), all
    devices at once, copied the way the planned program copies offloaded state (`planner.ilp.offload`:
    an argument in "pinned_host" memory copied to the device, a result copied back): program(k)
    takes k buffers of the host, brings each to the device, maps it there and hands it back to the
    host; the time per extra buffer (`_per_op_seconds`) moves the buffer once each way, so the rate
    is twice its bytes over that time, copies in and back overlapping as far as the link and XLA's
    schedule let them (as in the planned program). Buffers of 1 MiB up to `_HOST_LINK_MAX_BYTES`;
    the largest one's rate counts, as for `measure_memory`. (None, []) where the devices have no
    "pinned_host" memory, or where the compiled program holds no host buffer (XLA:CPU: its fusions
    read host buffers in place, so there is no link to measure)."""
    memories = getattr(mesh.devices.flat[0], "addressable_memories", None)
    if not callable(memories) or "pinned_host" not in {m.kind for m in memories()}:
        return None, []
    spec = PartitionSpec(tuple(mesh.axis_names))
    device = NamedSharding(mesh, spec, memory_kind="device")
    host = NamedSharding(mesh, spec, memory_kind="pinned_host")
    max_chain = 17
    rate, samples = None, []
    for nbytes in geometric_sizes(1 << 20, min(max(max_bytes, 1 << 20), _HOST_LINK_MAX_BYTES), 4):
        xs = [jax.device_put(_input(mesh, nbytes // 4), host) for _ in range(max_chain)]

        @functools.cache  # the check below compiles program(1), which the timing runs
        def chain(k: int):
            def body(*vs):
                return [jax.device_put(jnp.abs(jax.device_put(v, device)) - 1.0, host) for v in vs]
            return jax.jit(body, in_shardings=(host,) * k, out_shardings=[host] * k)

        def program(k: int, xs: list = xs) -> Callable[[], list]:
            fn = chain(k)
            return lambda: fn(*xs[:k])

        if not samples and _HOST_SPACE not in chain(1).lower(xs[0]).compile().as_text().split("\n", 1)[-1]:
            return None, []  # XLA:CPU: no copies compiled (its fusions read host buffers in place)
        t, whole = _per_op_seconds(program, repeats, warmup, chain=5, max_chain=max_chain)
        rate = 2.0 * nbytes / max(t, 1e-12)
        samples.append({"kind": "host", "nbytes": nbytes, "seconds": t, "program_seconds": whole,
                        "bytes_per_s": rate})
        del xs
    return rate, samples


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
    groups = axis_groups(spec)
    overhead = measure_overhead(mesh)
    entries = []
    for axes in groups:
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
    matmul, memory, host, compute_samples, launch = {}, None, None, [], None
    if compute:
        launch = measure_kernel_launch(mesh)
        max_bytes = max(sizes)
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
    device = mesh.devices.flat[0]
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
    )


def progress_steps(spec: MeshSpec, sizes: Sequence[int], collectives: Sequence[str], compute: bool) -> int:
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


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `planner profile` options to `parser`."""
    parser.add_argument("--out", required=True, metavar="FILE", help="profile database to write (JSON)")
    parser.add_argument("--max-bytes", type=_size, default=256 * 2**20, metavar="SIZE",
                        help="largest message per device, e.g. 64MiB (default 256MiB)")
    parser.add_argument("--min-bytes", type=_size, default=1024, metavar="SIZE",
                        help="smallest message per device (default 1KiB)")
    parser.add_argument("--step", type=_positive_int, default=4, metavar="K",
                        help="message size grows by this factor, 2 or more (default 4)")
    parser.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per point (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing (default 2)")
    parser.add_argument("--mesh", default=None, metavar="SHAPE",
                        help="mesh to measure, e.g. 2x4 (default: processes x local devices, or all devices 1-D)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), metavar="LIST",
                        help="comma-separated subset of " + ", ".join(COLLECTIVES))
    parser.add_argument("--no-compute", action="store_true",
                        help="skip the matmul, attention and memory-bandwidth runs")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="jax.distributed coordinator address (multi-host runs)")
    parser.add_argument("--num-processes", type=_positive_int, default=None, metavar="N",
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
    devices = jax.devices()
    if text is None:
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
