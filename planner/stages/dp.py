"""Alpa's inter-op dynamic program: stage boundaries and submeshes minimising pipeline latency.

With `B` microbatches and per-microbatch stage latencies `t_1 .. t_S`, a synchronous pipeline
(GPipe or 1F1B) takes `T = sum(t_i) + (B - 1) * max(t_i)`. For a fixed bound `t_max` on the
slowest stage, the least `sum(t_i)` is a dynamic program over (stages left, first layer, devices
left):

    F(s, k, d) = min over i >= k, submesh m with t(k..i, m) <= t_max:  t(k..i, m) + F(s - 1, i + 1, d - |m|)

with F(0, L, 0) = 0, and T* = min over t_max of (min_s F(s, 0, D)) + (B - 1) * t_max. Stages must
use every device (Alpa's submesh shapes always tile the cluster). The stage `s` positions from the
end of the pipeline holds `min(s, B)` microbatches of activations under 1F1B (all `B` under
GPipe), so its latency table is indexed by that in-flight count: a layer range whose memory does
not fit with that many microbatches costs infinity there.

`t_max` ranges over the distinct stage latencies. The smallest feasible one is the least slowest
stage of any pipeline: the same recurrence with `max` for `+` gives it in one pass (`_bottleneck`),
run under caps that double from a lower bound (each layer lies in some stage, so the least latency
of a range holding it bounds t_max below) until a pipeline fits under the cap: a pass under a low
cap only reads the short stages that fit it. `F(t)` only falls as `t` grows (a larger bound allows
more stages), so over an interval of candidates `[a, b]` the objective is at least
`F(b) + (B - 1) * a`, and every pipeline's `sum(t_i)` is at least its slowest stage, so at least the
smallest feasible bound: the search evaluates that bound, drops the candidates whose `(B - 1) * t`
alone cannot beat the best `T` found, and splits what is left at its middle candidate, dropping
every interval whose bound cannot beat the best `T` found (exact; Alpa enumerates the candidates in
order and stops at `(B - 1) * t_max` alone). `rel_gap > 0` also drops intervals whose bound is
within that relative distance of the best, bounding the loss at `rel_gap * T`; `rel_gap = 0` is
exact. Ties go to the smallest `t_max`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class StageChoice:
    """One stage of a DP solution: layers `first..last` (inclusive) on submesh index `submesh`."""

    first: int
    last: int
    submesh: int
    time_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class DPResult:
    """The best pipeline the DP found.

    Attributes:
      stages: in pipeline order.
      objective_s: sum(t_i) + (B - 1) * max(t_i) of these stages.
      t_max: the slowest stage's latency.
      evaluations: how many `t_max` bounds were tried.
    """

    stages: tuple[StageChoice, ...]
    objective_s: float
    t_max: float
    evaluations: int


def pipeline_latency(times: Sequence[float], num_microbatches: int) -> float:
    """`sum(t) + (B - 1) * max(t)`."""
    return float(sum(times) + (num_microbatches - 1) * max(times))


def bubble_fraction(times: Sequence[float], num_microbatches: int) -> float:
    """Share of device time spent idle: `1 - B * sum(t) / (S * T)`; `(S-1)/(S+B-1)` for equal stages."""
    total = pipeline_latency(times, num_microbatches)
    if total <= 0:
        return 0.0
    return float(max(0.0, 1.0 - num_microbatches * sum(times) / (len(times) * total)))


@dataclasses.dataclass(frozen=True)
class _Diagonals:
    """`times` laid out by stage length, made once per DP: `by_len[q, m, k, j]` is the latency of
    layers k..k+j on submesh m holding q + 1 microbatches (infinity past the last layer), and
    `shortest[q, m, j]` its least over k, so that the longest stage under a bound is read without
    scanning the table (`widths`)."""

    by_len: np.ndarray
    shortest: np.ndarray

    @staticmethod
    def of(times: np.ndarray) -> _Diagonals:
        L = times.shape[1]
        k = np.arange(L)[:, None]
        last = k + np.arange(L)[None, :]
        by_len = np.where((last < L)[None, :, :, None], times[:, k, np.minimum(last, L - 1), :], np.inf)  # [Q, k, j, M]
        by_len = np.ascontiguousarray(by_len.transpose(0, 3, 1, 2))  # [Q, M, k, j]
        return _Diagonals(by_len, by_len.min(axis=2))

    def widths(self, t_max: float) -> np.ndarray:
        """[Q, M]: one more than the longest stage (in layers, less one) that fits under t_max on
        each submesh at each in-flight count; 0 where none does."""
        fits = self.shortest <= t_max
        L = fits.shape[-1]
        return np.where(fits.any(axis=-1), L - np.argmax(fits[..., ::-1], axis=-1), 0)


def _solve(diagonals: _Diagonals, sizes: Sequence[int], num_devices: int, t_max: float, max_stages: int,
           min_stages: int, keep: bool):
    """min_s F(s, 0, D) for stages bounded by t_max; optionally the back-pointers to rebuild it.

    Each stage count's min-plus step runs per submesh m over the stages that fit under t_max: those
    starting at layer k end at k + j for j < w (the band width on m, `_Diagonals.widths`; most
    lengths are over a tight bound), read as a sliding window over the table of the stages after."""
    Q, M, L, _ = diagonals.by_len.shape
    D = num_devices
    inf = math.inf
    widths = diagonals.widths(t_max)
    W = int(widths.max())
    prev = np.full((L + W, D + 1), inf)  # rows past L: no layers left to start a stage at
    prev[L, 0] = 0.0
    best, best_s = inf, 0
    pointers = []
    for s in range(1, max_stages + 1):
        q = min(s, Q) - 1
        cur = np.full((L + W, D + 1), inf)
        if keep:
            arg_i = np.zeros((L, D + 1), dtype=np.int32)
            arg_m = np.full((L, D + 1), -1, dtype=np.int32)
        # after[k, d, j]: the best of the stages after one ending at layer k + j, with d devices left
        after = np.lib.stride_tricks.sliding_window_view(prev[1:], W, axis=0)
        for m in range(M):
            z, w = sizes[m], int(widths[q, m])
            if w == 0 or z > D:
                continue
            a = diagonals.by_len[q, m, :, :w]
            a = np.where(a <= t_max, a, inf)
            cand = a[:, None, :] + after[:L, : D + 1 - z, :w]  # [k, d - z, j]
            if not keep:  # the value only: no arg-min to carry
                np.minimum(cur[:L, z:], cand.min(axis=2), out=cur[:L, z:])
                continue
            j = cand.argmin(axis=2)
            val = np.take_along_axis(cand, j[:, :, None], axis=2)[:, :, 0]
            better = val < cur[:L, z:]
            cur[:L, z:] = np.where(better, val, cur[:L, z:])
            arg_i[:, z:] = np.where(better, np.arange(L)[:, None] + j, arg_i[:, z:])
            arg_m[:, z:] = np.where(better, m, arg_m[:, z:])
        if keep:
            pointers.append((arg_i, arg_m))
        if s >= min_stages and cur[0, D] < best:
            best, best_s = float(cur[0, D]), s
        if not np.isfinite(cur[:L]).any():
            break
        prev = cur
    return best, best_s, pointers


def _bottleneck(diagonals: _Diagonals, sizes: Sequence[int], num_devices: int, cap: float, max_stages: int,
                min_stages: int) -> float:
    """The least slowest-stage latency of any pipeline of stages no slower than `cap` (infinity: none).

    `_solve`'s recurrence with `max` for `+`: G(s, k, d) = min over stages k..i on m of
    max(t(k..i, m), G(s - 1, i + 1, d - |m|)), with G(0, L, 0) = -infinity."""
    Q, M, L, _ = diagonals.by_len.shape
    D = num_devices
    inf = math.inf
    widths = diagonals.widths(cap)
    W = int(widths.max())
    if W == 0:
        return inf
    prev = np.full((L + W, D + 1), inf)
    prev[L, 0] = -inf
    best = inf
    for s in range(1, max_stages + 1):
        q = min(s, Q) - 1
        cur = np.full((L + W, D + 1), inf)
        after = np.lib.stride_tricks.sliding_window_view(prev[1:], W, axis=0)
        for m in range(M):
            z, w = sizes[m], int(widths[q, m])
            if w == 0 or z > D:
                continue
            a = diagonals.by_len[q, m, :, :w]
            a = np.where(a <= cap, a, inf)
            np.minimum(cur[:L, z:], np.maximum(a[:, None, :], after[:L, : D + 1 - z, :w]).min(axis=2),
                       out=cur[:L, z:])
        if s >= min_stages and cur[0, D] < best:
            best = float(cur[0, D])
        if not np.isfinite(cur[:L]).any():
            break
        prev = cur
    return best


def _least_bound(diagonals: _Diagonals, sizes: Sequence[int], num_devices: int, max_stages: int, min_stages: int,
                 values: np.ndarray) -> tuple[float, int]:
    """(the smallest `t_max` any pipeline fits under, infinity where none does; the `_bottleneck`
    passes it took), under caps doubling from a lower bound: every layer lies in some stage, so the
    least latency of a range holding it (any submesh, any in-flight count) bounds t_max below."""
    L = diagonals.by_len.shape[2]
    ranges = diagonals.by_len.min(axis=(0, 1))  # [k, j]: the least latency of layers k..k+j
    least = np.full(L, np.inf)  # per layer, the least latency of a range holding it
    for j in range(L):
        for d in range(j + 1):  # range k..k+j holds layer k+d
            np.minimum(least[d:L - j + d], ranges[:L - j, j], out=least[d:L - j + d])
    if not np.isfinite(least).all():  # a layer no stage can hold
        return math.inf, 0
    cap, passes = max(float(least.max()), float(values[0])), 0
    while True:
        passes += 1
        t = _bottleneck(diagonals, sizes, num_devices, cap, max_stages, min_stages)
        if math.isfinite(t) or cap >= values[-1]:
            return t, passes
        cap = min(2.0 * cap, float(values[-1]))


def pipeline_dp(times: np.ndarray, sizes: Sequence[int], num_devices: int, num_microbatches: int,
                max_stages: int | None = None, min_stages: int = 1, rel_gap: float = 0.0,
                memo: dict | None = None) -> DPResult | None:
    """Best stage boundaries and submeshes.

    Args:
      times: `times[q, k, i, m]`: per-microbatch latency of a stage of layers k..i (inclusive) on
        submesh m when it must hold `q + 1` microbatches of activations (for q = Q - 1: at least Q);
        infinity where the range does not fit or i < k. Pass Q = 1 when memory does not depend on
        the stage's position (GPipe, or no memory limit).
      sizes: devices of each submesh.
      num_devices: devices the stages must use in total.
      num_microbatches: B.
      max_stages / min_stages: bounds on the number of stages.
      rel_gap: intervals of t_max candidates whose bound is within this relative distance of the
        best objective found are not searched (loss at most `rel_gap` times the optimum).
      memo: kept between calls (`PlanningMemo.dp`): per table (by content) and device count, the
        least `sum(t_i)` under each bound evaluated and the pipelines read back, which do not depend
        on `num_microbatches` (only how they combine into the objective does): the same table at
        another microbatch count costs one pass over the bounds already known.

    Returns:
      The best pipeline, or None when no assignment covers all layers and devices.
    """
    Q, L, L2, M = times.shape
    if L != L2 or M != len(sizes):
        raise ValueError(f"times has shape {times.shape}; expected (Q, L, L, {len(sizes)})")
    # Devices in units of the sizes' common divisor (whole hosts when every submesh is): the same
    # assignments, the DP's device axis that many times shorter.
    unit = math.gcd(num_devices, *sizes)
    if unit > 1:
        return pipeline_dp(times, [z // unit for z in sizes], num_devices // unit, num_microbatches,
                           max_stages=max_stages, min_stages=min_stages, rel_gap=rel_gap, memo=memo)
    max_stages = min(max_stages or L, L, num_devices)
    if min_stages > max_stages:
        return None
    values = np.unique(times[np.isfinite(times)])
    if values.size == 0:
        return None
    B = num_microbatches
    evaluations = 0

    known = _known(memo, times, sizes, num_devices, max_stages, min_stages)
    found: dict[int, float] = known["F"]  # index into `values` -> F(that bound)
    tried: set[int] = set()
    diagonals: list[_Diagonals] = []  # made on the first bound not known

    def solve(t_max: float, keep: bool):
        if not diagonals:
            diagonals.append(_Diagonals.of(times))
        return _solve(diagonals[0], sizes, num_devices, t_max, max_stages, min_stages, keep)

    def F(j: int) -> float:
        nonlocal evaluations
        if j not in tried:
            tried.add(j)
            evaluations += 1
        if j not in found:
            found[j] = solve(values[j], False)[0]
        return found[j]

    if "least" not in known:  # the smallest feasible bound (index into `values`; None: no pipeline fits)
        if not diagonals:
            diagonals.append(_Diagonals.of(times))
        t, passes = _least_bound(diagonals[0], sizes, num_devices, max_stages, min_stages, values)
        known["least"] = (int(np.searchsorted(values, t)) if math.isfinite(t) else None, passes)
    lo, passes = known["least"]
    evaluations += passes
    if lo is None:
        return None
    if B == 1:
        lo = values.size - 1

    best_t = _best_bound(F, values, lo, B, rel_gap)
    if best_t not in known["kept"]:
        known["kept"][best_t] = solve(best_t, True)
    total, s, pointers = known["kept"][best_t]
    evaluations += 1
    if not math.isfinite(total):
        return None
    stages = _read_back(times, sizes, num_devices, best_t, s, pointers)
    ts = [st.time_s for st in stages]
    return DPResult(stages, pipeline_latency(ts, B), max(ts), evaluations)


def _known(memo: dict | None, times: np.ndarray, sizes: Sequence[int], num_devices: int, max_stages: int,
           min_stages: int) -> dict:
    """`memo`'s entry for this table and device count (a fresh one without a memo)."""
    if memo is None:
        return {"F": {}, "kept": {}}
    key = (hashlib.blake2b(np.ascontiguousarray(times).tobytes(), digest_size=16).hexdigest(), times.shape,
           tuple(sizes), num_devices, max_stages, min_stages)
    return memo.setdefault(key, {"F": {}, "kept": {}})


def _best_bound(F: Callable[[int], float], values: np.ndarray, lo: int, B: int, rel_gap: float) -> float:
    """The `t_max` candidate (`values[j]`, j >= lo, the smallest feasible) of least objective
    `F(j) + (B - 1) * values[j]`, by interval splitting (see the module docstring); ties to the smallest."""

    def objective(j: int) -> tuple[float, float]:
        return F(j) + (B - 1) * float(values[j]), float(values[j])

    best_obj, best_t = objective(lo)
    # open intervals (a, b] of candidates, each with a lower bound on F over it: F at b or past it
    # (F falls as t grows), at first values[lo] (a pipeline's sum is at least its slowest stage)
    intervals = [(lo, values.size - 1, float(values[lo]))]
    while intervals:
        a, b, fb = intervals.pop()
        if b <= a:
            continue
        bound = fb + (B - 1) * float(values[a + 1])  # the least objective any bound inside can give
        if (bound > best_obj or (rel_gap > 0 and bound * (1.0 + rel_gap) >= best_obj)
                or (bound == best_obj and values[a + 1] > best_t)):
            continue
        # candidates whose (B - 1) * t alone, with fb, is over the best found are dropped unevaluated
        if B > 1:
            b = min(b, max(a + 1, int(np.searchsorted(values, (best_obj - fb) / (B - 1), side="right"))))
        mid = (a + b + 1) // 2
        best_obj, best_t = min((best_obj, best_t), objective(mid))
        intervals += [(mid, b, fb), (a, mid - 1, F(mid))]
    return best_t


def _read_back(times: np.ndarray, sizes: Sequence[int], num_devices: int, t_max: float, num_stages: int,
               pointers: list) -> tuple[StageChoice, ...]:
    """The stages of `_solve`'s best pipeline of `num_stages` stages under `t_max`, from its back-pointers."""
    Q, L = times.shape[0], times.shape[1]
    stages = []
    k, d = 0, num_devices
    masked = np.where(times <= t_max, times, math.inf)
    for left in range(num_stages, 0, -1):
        arg_i, arg_m = pointers[left - 1]
        i, m = int(arg_i[k, d]), int(arg_m[k, d])
        q = min(left, Q) - 1
        stages.append(StageChoice(k, i, m, float(masked[q, k, i, m])))
        k, d = i + 1, d - sizes[m]
    assert k == L and d == 0, (k, d)
    return tuple(stages)


def brute_force(times: np.ndarray, sizes: Sequence[int], num_devices: int, num_microbatches: int,
                max_stages: int | None = None, min_stages: int = 1) -> tuple[float, tuple[StageChoice, ...]] | None:
    """Exhaustive search over every split and submesh assignment (for tests on small cases)."""
    Q, L = times.shape[0], times.shape[1]
    max_stages = min(max_stages or L, L, num_devices)
    best: tuple[float, tuple[StageChoice, ...]] | None = None

    def rec(k: int, d: int, chosen: list[tuple[int, int, int]]):
        nonlocal best
        if k == L:
            if d == 0 and min_stages <= len(chosen) <= max_stages:
                S = len(chosen)
                stages = tuple(StageChoice(a, b, m, float(times[min(S - j, Q) - 1, a, b, m]))
                               for j, (a, b, m) in enumerate(chosen))
                ts = [st.time_s for st in stages]
                if all(math.isfinite(t) for t in ts):
                    obj = pipeline_latency(ts, num_microbatches)
                    if best is None or obj < best[0] - 1e-12:
                        best = (obj, stages)
            return
        if len(chosen) >= max_stages:
            return
        for i in range(k, L):
            for m, z in enumerate(sizes):
                if z <= d:
                    rec(i + 1, d - z, chosen + [(k, i, m)])

    rec(0, num_devices, [])
    return best
