"""The per-layer columns a stage table sums over layer ranges (`stage_cost`): each layer's time,
communication, state, activation and working bytes on one mesh, in one per-layer plan and state
layout, and the range sums and maxima made from them once per layout (`shared_columns`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from planner.stages.cost_table import LayerCostTable
from planner.stages.layer_cost import LayerCost


def range_sums(x: np.ndarray) -> np.ndarray:
    """`out[k, i] = sum(x[k..i])` for i >= k, infinity below the diagonal or over an infinite entry."""
    L = len(x)
    bad = ~np.isfinite(x)
    c = np.concatenate([[0.0], np.cumsum(np.where(bad, 0.0, x))])
    nbad = np.concatenate([[0], np.cumsum(bad)])
    out = c[None, 1:] - c[:-1, None]
    idx = np.arange(L)
    out[((nbad[None, 1:] - nbad[:-1, None]) > 0) | (idx[:, None] > idx[None, :])] = np.inf
    return out


def range_max(x: np.ndarray) -> np.ndarray:
    L = len(x)
    out = np.full((L, L), np.inf)
    for k in range(L):
        out[k, k:] = np.maximum.accumulate(x[k:])
    return out


def sync_every_microbatch(cost: LayerCost, option: Any) -> bool:
    """Whether the layer's data-parallel gradient reduction (`LayerCost.sync_s`) runs every
    microbatch as `option` runs it, not once per step: in the sharded-state layout its parameters
    are split over the data axes too, and the pipeline runtime then reduces every microbatch
    (`stage_records.set_replicas`)."""
    return option.layout == "sharded-state" and bool(cost.data_axes) and cost.sync_s > 0


def split_ranges(rows: Sequence[LayerCost], option: Any) -> tuple[np.ndarray, np.ndarray]:
    """(`split[k, i]`: a layer of k..i splits a parameter over a data axis of some layer of k..i, so
    the runtime reduces the gradients of a stage of those layers every microbatch
    (`selection._replica_fallback`); `sync[k, i]`: the once-per-step reductions of layers k..i,
    which then move into the time per microbatch)."""
    names = sorted({a for r in rows for a in r.param_axes | r.data_axes})
    bit = {a: 1 << i for i, a in enumerate(names)}
    params = np.array([sum(bit[a] for a in r.param_axes) for r in rows], dtype=np.int64)
    data = np.array([sum(bit[a] for a in r.data_axes) for r in rows], dtype=np.int64)
    L = len(rows)
    split = np.zeros((L, L), dtype=bool)
    for k in range(L):
        split[k, k:] = (np.bitwise_or.accumulate(params[k:]) & np.bitwise_or.accumulate(data[k:])) != 0
    sync = np.array([0.0 if sync_every_microbatch(r, option) else r.sync_s for r in rows])
    return split, range_sums(sync)


class Columns:
    """`layer_columns` of one (layers, mesh, variant, state layout, microbatch count) and their range sums,
    made once and shared by every way of running a stage there (recomputation, kept layers, offloaded
    activations: `shared_columns`); read-only once made."""

    def __init__(self, table: LayerCostTable, option: Any):
        self.col = layer_columns(table, option)
        self.inner = table.inner(option.mesh_index, option.variant)
        self._sums: dict[str, np.ndarray] = {}

    def __getitem__(self, kind: str) -> np.ndarray:
        return self.col[kind]

    def sums(self, kind: str) -> np.ndarray:
        """`range_sums` of column `kind`."""
        if kind not in self._sums:
            self._sums[kind] = range_sums(self.col[kind])
        return self._sums[kind]

    def work_max(self) -> np.ndarray:
        if "work max" not in self._sums:
            self._sums["work max"] = range_max(self.col["work"])
        return self._sums["work max"]

    def prefetch_hidden(self) -> np.ndarray:
        """`out[k, i]`: seconds of the sharded-state parameter gathers of layers k..i that prefetch
        hides per microbatch: layer l's forward gather behind layer l-1's forward compute (l > k),
        its backward gather behind layer l+1's backward compute (l < i), each at most the gather;
        zero where the range is empty."""
        if "prefetch" not in self._sums:
            g, fwd, bwd = self.col["gather"], self.col["free_fwd"], self.col["free_bwd"]
            hf = np.concatenate([[0.0], np.minimum(g[1:], fwd[:-1])])  # hf[l]: behind layer l-1
            hb = np.concatenate([np.minimum(g[:-1], bwd[1:]), [0.0]])  # hb[l]: behind layer l+1
            with np.errstate(invalid="ignore"):  # below the diagonal the sums are infinite
                fwd_part = range_sums(hf) - hf[:, None]  # sum over l = k+1..i
                bwd_part = range_sums(hb) - hb[None, :]  # sum over l = k..i-1
                both = fwd_part + bwd_part
            self._sums["prefetch forward"] = np.where(np.isfinite(fwd_part), fwd_part, 0.0)
            self._sums["prefetch"] = np.where(np.isfinite(both), both, 0.0)
        return self._sums["prefetch"]

    def prefetch_hidden_forward(self) -> np.ndarray:
        """The forward's share of `prefetch_hidden`: what a recomputed forward of layers k..i hides
        too, its gathers issued as the forward's are."""
        self.prefetch_hidden()
        return self._sums["prefetch forward"]

    def prefetched_params(self) -> np.ndarray:
        """`out[k, i]`: the most gathered parameter bytes of a layer of k..i, which prefetch holds
        beside the layer computing (none where the range is one layer)."""
        if "prefetched" not in self._sums:
            most = range_max(self.col["param"])
            idx = np.arange(len(self.col["param"]))
            self._sums["prefetched"] = np.where(idx[:, None] < idx[None, :], most, 0.0)
        return self._sums["prefetched"]


def per_layout(table: LayerCostTable, option: Any, name: str, make: Callable[[], Any]) -> Any:
    """`make()`, kept in `table.ranges` under `name` and what the ways of one state layout share:
    `option`'s mesh, per-layer plans, state layout and where its master parameters wait (its
    recomputation, kept layers, offloaded activations and prefetch aside)."""
    key = (name, table.layers.keys, table.meshes[option.mesh_index], option.variant, option.layout,
           option.offload_params, table.same_rows(option.mesh_index, option.variant))
    hit = table.ranges.get(key)
    if hit is None:
        hit = table.ranges[key] = make()
    return hit


def shared_columns(table: LayerCostTable, option: Any) -> Columns:
    """The `Columns` of `option`'s mesh, variant and state layout (`per_layout`: the ways of one
    layout differ only in how they combine them)."""
    return per_layout(table, option, "columns", lambda: Columns(table, option))


def layer_columns(table: LayerCostTable, option: Any) -> dict[str, np.ndarray]:
    """Per layer on the option's mesh, variant and state layout: its time per microbatch ("time")
    and the exposed communication inside it ("comm"), each with what remat's recomputed forward adds
    ("..._recompute"); its state, activation and working bytes; and per layer range the
    once-per-step reductions a split stage moves into every microbatch ("split_sync",
    `split_ranges`)."""
    rows = table.rows(option.mesh_index, option.variant)
    masters = bool(option.offload_params)  # the master parameters in host memory, their cast copies here
    sharded = option.layout == "sharded-state"
    gathers = [r.zero_extra_s if sharded else 0.0 for r in rows]  # the sharded state's all-gathers
    # compute free of the layer's own hidden communication, behind which prefetch issues a gather
    free = [max(0.0, r.time_s - r.comm_s - r.hidden_s) if sharded and np.isfinite(r.time_s) else 0.0 for r in rows]
    every = [r.sync_s if sync_every_microbatch(r, option) else 0.0 for r in rows]
    split, sync = split_ranges(rows, option)
    return {
        "split": split,  # [first, last]: the runtime reduces the stage's gradients every microbatch
        "split_sync": np.where(split, sync, 0.0),  # [first, last]: reductions moved into every microbatch
        "time": np.array([r.time_s + g + e for r, g, e in zip(rows, gathers, every)]),
        "time_recompute": np.array([r.time_s * r.fwd_fraction + g / 2 for r, g in zip(rows, gathers)]),
        "comm": np.array([r.comm_s + g + e for r, g, e in zip(rows, gathers, every)]),
        "comm_recompute": np.array([r.comm_s * r.fwd_fraction + g / 2 for r, g in zip(rows, gathers)]),
        "state": np.array([r.zero_state_bytes if sharded else r.opt_state_bytes if option.layout == "sharded-optimizer"
                           else r.opt_state_bytes - r.opt_host_bytes - masters * (r.master_bytes - r.master_cast_bytes)
                           if option.layout == "offloaded-optimizer" else r.state_bytes for r in rows]),
        "act": np.array([r.act_bytes for r in rows]),
        "work": np.array([r.zero_work_bytes if sharded else r.work_bytes for r in rows]),
        "gather": np.array([g / 2 for g in gathers]),  # one of the two (forward, backward)
        "free_fwd": np.array([f * r.fwd_fraction for f, r in zip(free, rows)]),
        "free_bwd": np.array([f * (1 - r.fwd_fraction) for f, r in zip(free, rows)]),
        "param": np.array([max(0.0, r.zero_work_bytes - r.work_bytes) if sharded and np.isfinite(r.work_bytes)
                           else 0.0 for r in rows]),  # the layer's gathered parameters
    }


def shifted(m: np.ndarray, j: int) -> np.ndarray:
    """`out[k, i] = m[k, i - j]` where `i - j >= k`, else infinity: the range k..i less its last j
    layers (a range of `j` layers or fewer has no layer left to recompute)."""
    out = np.full_like(m, np.inf)
    if j < m.shape[1]:
        out[:, j:] = m[:, :-j] if j else m
    return np.where(np.triu(np.ones(m.shape, dtype=bool), j), out, np.inf)
