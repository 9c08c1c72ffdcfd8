"""Fitting measured collective times: alpha-beta least squares and piecewise-linear curves.

Message sizes span five orders of magnitude, so an ordinary least-squares fit would be decided by
the largest messages alone and say nothing about latency. The fit minimises *relative* error
instead (each sample's residual divided by its time), which weighs every size equally.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

# Sizes the large-message (extrapolation) slope is fitted to.
TAIL_SIZES = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Fit:
    """`seconds ~= alpha + beta * nbytes`.

    Attributes:
      alpha: fixed cost of one collective (s), >= 0.
      beta: cost per byte of the buffer (s/byte), >= 0.
      rel_rmse: root-mean-square relative error of the fit over its samples.
      samples: number of (size, time) points fitted.
    """

    alpha: float
    beta: float
    rel_rmse: float = 0.0
    samples: int = 0

    def __call__(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    def to_json(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "rel_rmse": self.rel_rmse, "samples": self.samples}


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], relative: bool = True) -> Fit:
    """Least-squares `alpha + beta * nbytes` through the samples, minimising relative error.

    Both coefficients are kept non-negative: when the unconstrained optimum has a negative one,
    the best fit with that coefficient at zero is taken instead.

    Args:
      nbytes: message size of each sample (bytes).
      seconds: measured time of each sample, > 0.
      relative: minimise relative error (the default); False minimises absolute error, which
        suits samples of similar size where one slow outlier should not flatten the slope.

    Returns:
      The fit; with one distinct size only, a pure latency or pure bandwidth model cannot be told
      apart, so the time is attributed to bandwidth (`alpha = 0`).

    Raises:
      ValueError: no samples, mismatched lengths, or a non-positive time.
    """
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need equally long, non-empty sample lists; got {x.shape} sizes and {y.shape} times")
    if not (np.all(np.isfinite(y)) and np.all(y > 0) and np.all(x >= 0)):
        raise ValueError("sample times must be finite and > 0, sizes >= 0")
    w = 1.0 / y if relative else np.full_like(y, 1.0 / y.mean())
    candidates: list[tuple[float, float]] = []
    if np.unique(x).size >= 2:
        a = np.stack([w, w * x], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(a, w * y, rcond=None)
        if alpha >= 0 and beta >= 0:
            candidates.append((float(alpha), float(beta)))
    if not candidates:
        # With one coefficient held at zero, the weighted least-squares optimum of the other.
        w2 = w * w
        if np.any(x > 0):
            candidates.append((0.0, float((w2 * x * y).sum() / (w2 * x * x).sum())))
        if np.unique(x).size >= 2 or not candidates:
            candidates.append((float((w2 * y).sum() / w2.sum()), 0.0))

    def err(c: tuple[float, float], weights: np.ndarray = w) -> float:
        return float(np.sqrt(np.mean(((c[0] + c[1] * x - y) * weights) ** 2)))

    alpha, beta = min(candidates, key=err)
    return Fit(alpha, beta, err((alpha, beta), 1.0 / y), int(x.size))


@dataclasses.dataclass(frozen=True, slots=True)
class Curve:
    """Measured time as a function of bytes: piecewise-linear between samples, fitted slopes beyond.

    Outside the sampled range the curve continues from the first / last sample with a fitted
    per-byte cost, so it stays continuous. Above the range the slope is `tail`'s, fitted to the
    `TAIL_SIZES` largest sizes only (absolute error): there time is bandwidth-bound, while the
    whole-range fit is also bent by the latency-bound small sizes (and by the switch from tree to
    ring algorithms).

    Attributes:
      nbytes: sampled sizes, strictly increasing.
      seconds: time at each size (median of repetitions, dispatch overhead removed).
      fit: alpha-beta fit of all the samples.
      tail: alpha-beta fit of the `TAIL_SIZES` largest sizes.
    """

    nbytes: tuple[float, ...]
    seconds: tuple[float, ...]
    fit: Fit
    tail: Fit

    def __post_init__(self):
        if not self.nbytes or len(self.nbytes) != len(self.seconds):
            raise ValueError("a curve needs as many times as sizes, at least one")
        if any(b <= a for a, b in zip(self.nbytes, self.nbytes[1:])):
            raise ValueError(f"curve sizes {self.nbytes} must be strictly increasing")

    @classmethod
    def from_samples(cls, nbytes: Sequence[float], seconds: Sequence[float], fit: Fit | None = None) -> Curve:
        """Median time per distinct size; fitted here unless `fit` is given."""
        by_size: dict[float, list[float]] = {}
        for b, s in zip(nbytes, seconds):
            by_size.setdefault(float(b), []).append(float(s))
        xs = tuple(sorted(by_size))
        ys = tuple(float(np.median(by_size[b])) for b in xs)
        fit = fit if fit is not None else fit_alpha_beta(xs, ys)
        tail = fit_alpha_beta(xs[-TAIL_SIZES:], ys[-TAIL_SIZES:], relative=False) if len(xs) >= 2 else fit
        return cls(xs, ys, fit, tail)

    @property
    def slope(self) -> float:
        """Seconds per byte for large messages: the tail fit's, or the whole fit's where noise left
        the tail flat."""
        return self.tail.beta if self.tail.beta > 0 else self.fit.beta

    def __call__(self, nbytes: float) -> float:
        xs, ys = self.nbytes, self.seconds
        if nbytes <= xs[0]:
            return max(0.0, ys[0] - self.fit.beta * (xs[0] - nbytes))
        if nbytes >= xs[-1]:
            return ys[-1] + self.slope * (nbytes - xs[-1])
        i = bisect.bisect_right(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def geometric_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> tuple[int, ...]:
    """`min_bytes * factor**k` up to `max_bytes` (always including `min_bytes`)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes ({min_bytes}) <= max_bytes ({max_bytes}) and factor ({factor}) >= 2")
    count = int(math.floor(math.log(max_bytes / min_bytes, factor) + 1e-9)) + 1
    return tuple(min_bytes * factor**k for k in range(count))
