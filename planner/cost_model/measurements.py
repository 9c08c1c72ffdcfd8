"""The measurements of the profiling job (`planner.cost_model.profiling`), every device at once.

Collectives over mesh axes, the launch overhead of a program and of one kernel, matmul and attention
throughput, streaming memory bandwidth and the host link. Compute is timed as one op of a dependent
chain inside one compiled program (`_per_op_seconds`), so the program's launch does not count.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from planner.cost_model.collectives import COLLECTIVES
from planner.cost_model.fit import geometric_sizes

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
    and its synchronisation cancel out: on a GPU they take longer than a small kernel. Returns
    (seconds per op, seconds of the k = 1 program)."""
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
