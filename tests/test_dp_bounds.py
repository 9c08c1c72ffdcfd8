"""The stage DP's search over slowest-stage bounds: the smallest feasible bound in one min-max pass,
and the bound of least pipeline latency, each against exhaustive answers."""
from __future__ import annotations

import math

import numpy as np

from planner.stages import dp
from planner.stages.dp import brute_force, pipeline_dp
from tests.helpers import random_stage_table


def _cases(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        sizes = [1, 2, 4][: int(rng.integers(1, 4))]
        D = int(rng.choice([2, 4, 6, 8]))
        Q, L = int(rng.integers(1, 4)), int(rng.integers(1, 7))
        yield random_stage_table(rng, L, sizes, Q), sizes, D, int(rng.integers(1, 3))


def test_least_bound_is_the_least_slowest_stage_of_any_pipeline():
    """`_least_bound` against every pipeline: with B so large that the slowest stage decides the
    objective, brute force's best pipeline has the least slowest stage (random sums differ by far
    more than sum / B)."""
    checked = 0
    for t, sizes, D, min_stages in _cases(5, 150):
        values = np.unique(t[np.isfinite(t)])
        L = t.shape[1]
        got, passes = dp._least_bound(dp._Diagonals.of(t), sizes, D, min(L, D), min_stages, values)
        want = brute_force(t, sizes, D, 10 ** 12, min_stages=min_stages)
        if want is None:
            assert got == math.inf
            continue
        checked += 1
        assert got == max(s.time_s for s in want[1]) and passes >= 1
    assert checked > 50


def test_the_chosen_bound_is_the_best_of_every_candidate():
    """The bound the DP settles on is, of every distinct latency the slowest stage may take, the one
    of least `F(t) + (B - 1) t` (ties to the smallest t), each candidate's F solved on its own."""
    checked = 0
    for t, sizes, D, min_stages in _cases(6, 120):
        L = t.shape[1]
        values = np.unique(t[np.isfinite(t)])
        diagonals = dp._Diagonals.of(t)
        F = [dp._solve(diagonals, sizes, D, v, min(L, D), min_stages, False)[0] for v in values]
        for B in (2, 5, 64, 4096):
            got = pipeline_dp(t, sizes, D, B, min_stages=min_stages)
            feasible = [(f + (B - 1) * v, v) for f, v in zip(F, values) if math.isfinite(f)]
            if not feasible:
                assert got is None
                continue
            checked += 1
            obj, t_max = min(feasible)
            assert math.isclose(got.objective_s, obj, rel_tol=1e-12)
            assert got.t_max <= t_max  # the pipeline read back under t_max: its slowest stage at most that
            assert got.evaluations <= len(values) + 2
    assert checked > 200
