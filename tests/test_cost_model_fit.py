"""Alpha-beta least-squares fits and piecewise-linear curves on synthetic samples."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost_model.fit import Curve, Fit, fit_alpha_beta, geometric_sizes

SIZES = geometric_sizes(1024, 256 * 2**20, 4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(alpha=st.floats(1e-7, 1e-2), bandwidth=st.floats(1e6, 1e12), relative=st.booleans())
def test_noise_free_samples_give_back_alpha_and_beta(alpha, bandwidth, relative):
    beta = 1.0 / bandwidth
    fit = fit_alpha_beta(SIZES, [alpha + beta * b for b in SIZES], relative=relative)
    # a coefficient whose term is tiny next to every sample (relative fit) or next to the largest
    # (absolute fit) is not identifiable in floating point; the others come back exactly
    if alpha > (1e-6 if relative else 1e-3) * beta * SIZES[-1]:
        assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    if beta * SIZES[-1] > 1e-6 * alpha:
        assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.rel_rmse < 1e-6
    assert fit.samples == len(SIZES)


def test_noisy_samples_stay_close():
    rng = np.random.default_rng(0)
    alpha, beta = 20e-6, 1 / 10e9
    xs = [b for b in SIZES for _ in range(5)]
    ys = [(alpha + beta * b) * rng.uniform(0.95, 1.05) for b in xs]
    fit = fit_alpha_beta(xs, ys)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.1)
    assert 0 < fit.rel_rmse < 0.05


def test_pure_bandwidth_and_pure_latency():
    bw = fit_alpha_beta(SIZES, [b / 1e9 for b in SIZES])
    assert bw.alpha == pytest.approx(0, abs=1e-12) and bw.beta == pytest.approx(1e-9)
    lat = fit_alpha_beta(SIZES, [3e-5] * len(SIZES))
    assert lat.alpha == pytest.approx(3e-5) and lat.beta == pytest.approx(0, abs=1e-20)


def test_fit_coefficients_are_never_negative():
    # times falling with size (noise) would give beta < 0 unconstrained
    fit = fit_alpha_beta([1e3, 1e4, 1e5], [3e-4, 2e-4, 1e-4])
    assert fit.beta == 0.0 and fit.alpha > 0
    # a line through the origin below the small-size times would give alpha < 0
    fit = fit_alpha_beta([1e3, 1e6, 1e7], [1e-9, 1e-3, 1.1e-2])
    assert fit.alpha == 0.0 and fit.beta > 0
    one = fit_alpha_beta([4096], [1e-3])
    assert one.alpha == 0.0 and one(4096) == pytest.approx(1e-3)


@pytest.mark.parametrize("xs, ys", [([], []), ([1, 2], [1.0]), ([1, 2], [1.0, 0.0]), ([1, 2], [1.0, float("nan")])])
def test_fit_rejects_bad_samples(xs, ys):
    with pytest.raises(ValueError):
        fit_alpha_beta(xs, ys)


def test_curve_interpolates_piecewise_linearly_and_extrapolates_with_the_fit():
    xs = [1000, 2000, 4000, 8000, 16000]
    ys = [1.0, 1.5, 1.5, 3.0, 5.0]
    curve = Curve.from_samples(xs, ys)
    for x, y in zip(xs, ys):
        assert curve(x) == pytest.approx(y)
    assert curve(1500) == pytest.approx(1.25)
    assert curve(3000) == pytest.approx(1.5)
    assert curve(12000) == pytest.approx(4.0)
    # beyond the range: continuous, with the large-size fit's slope
    assert curve(16001) == pytest.approx(5.0, rel=1e-3)
    assert curve(32000) == pytest.approx(5.0 + curve.tail.beta * 16000)
    assert curve.tail.beta == curve.slope > 0
    # below the range: continuous, never negative
    assert curve(999) == pytest.approx(1.0, rel=1e-3)
    assert curve(0) >= 0.0


def test_one_slow_outlier_does_not_flatten_the_large_message_slope():
    # noise made the middle of the last three sizes slow: a relative fit would call the tail flat
    curve = Curve.from_samples([2**18, 2**20, 2**22, 2**24], [3e-4, 6.5e-3, 2.7e-3, 9.6e-2])
    assert curve.slope > 1e-9
    assert curve(2**25) > curve(2**24)


def test_curve_takes_the_median_of_repetitions():
    curve = Curve.from_samples([1024, 1024, 1024, 4096], [1.0, 9.0, 2.0, 4.0])
    assert curve.nbytes == (1024.0, 4096.0)
    assert curve.seconds == (2.0, 4.0)


def test_curve_checks_its_samples():
    with pytest.raises(ValueError, match="increasing"):
        Curve((2.0, 1.0), (1.0, 1.0), Fit(0, 1), Fit(0, 1))
    with pytest.raises(ValueError, match="at least one"):
        Curve((), (), Fit(0, 1), Fit(0, 1))


def test_geometric_sizes():
    assert geometric_sizes(1024, 64 * 1024, 4) == (1024, 4096, 16384, 65536)
    assert geometric_sizes(1024, 60 * 1024, 2)[-1] == 32768
    assert geometric_sizes(1024, 1024) == (1024,)
    with pytest.raises(ValueError):
        geometric_sizes(2048, 1024)
