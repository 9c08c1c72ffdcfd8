"""What a stage costs: latency and memory of every layer range, summed from the layer cost table.

A range of layers costs the sum of its layers' times (`LayerCostTable`), the resharding between
them and the sends at its boundaries; its memory is assembled from theirs.

A stage runs in one of eight ways, and the DP takes the fastest that fits the device memory (the
intra-op ILP plans each layer for time alone; it has no stage-level view of memory):
  state layout "plan"           parameters stored as the plan shards them;
               "sharded-state"  parameters, gradient accumulators and optimizer state split over every
                                device of the stage (ZeRO-3 on top of the plan), the plan's layout
                                all-gathered before the forward and again before the backward;
               "sharded-optimizer"  parameters and gradients as the plan lays them out, the optimizer
                                state split over the stage's data axes too (Megatron-LM's
                                distributed optimizer, ZeRO stage 1; `layer_cost.optimizer_layout`):
                                once per step a reduce-scatter, the update on the shards, an
                                all-gather; not for a stage that splits a parameter over a data
                                axis (its runtime reduces every microbatch, `split_ranges`);
               "offloaded-optimizer"  as "sharded-optimizer", the optimizer state kept in host
                                memory between updates: copied to the device for the update and
                                back, once per step over the host link (`Hardware.host_bandwidth`;
                                not offered where none is known or `offload="off"`); the device
                                holds it only during the update, when no activations are live,
                                one parameter's at a time (`update_peak`);
  remat False  activations kept from each microbatch's forward to its backward;
        True   only the stage's input kept; the backward recomputes the stage's forward first
               (extra time: the forward's share of the FLOPs, times the layer's time);
        True, kept j  the stage's last j layers keep their activations, the layers before them
               are recomputed (only the stage's input kept for them): per microbatch in flight the
               stage input and the last j layers' activations, the recomputed layers' activations
               once (while their backward runs), their forward once more. Offered where the
               layers are the model's own modules (`KEPT_LEVELS`, `kept_levels`): the runtime
               finds the cut by their names (`emit.pipeline.programs.recompute_cut`).
  prefetch (sharded-state)  each layer's parameter all-gather issued while the layer before it
               computes (forward; in the backward the one after it), as FSDP and ZeRO-3 prefetch:
               a gather is exposed only by what it exceeds that layer's compute free of its own
               hidden communication (`_Columns.prefetch_hidden`), the stage's first gather of each
               pass whole (so are the recomputed forward's); the device then holds the next layer's
               gathered parameters too. Offered where collectives overlap compute (not XLA:CPU) and
               `prefetch` is not off; the plan then assumes XLA's latency-hiding scheduler
               (`Plan.xla_flags()`).
  offloaded activations (without remat)  each microbatch's saved activations are copied to host
               memory after its forward and back before its backward (the next backward's ahead
               of time, `emit.pipeline.runtime`): the device holds one microbatch's going out
               and one coming back; per microbatch one trip each way over the host link
               (`Hardware.host_bandwidth`, one direction per device), overlapping the stage's
               compute: the stage takes max(its time, the trip). Offered where the host link is
               known and `offload` is not "off", where keeping the activations does not fit.
Each of them in the layers' own plans or in one of the table's variants (`StageOption`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from planner.core.pipeline_records import PipelineStage, stage_way
from planner.stages.cost_table import LayerCostTable
from planner.stages.layer_cost import LayerCost
from planner.stages.submesh import boundary_link


# The state layouts a stage runs in (see the module docstring).
LAYOUTS = ("plan", "sharded-state", "sharded-optimizer", "offloaded-optimizer")

# The layouts that split (and may offload) the optimizer state alone (`layer_cost.optimizer_layout`).
OPTIMIZER_LAYOUTS = ("sharded-optimizer", "offloaded-optimizer")

# How many of a stage's last layers may keep their activations under recomputation (`StageOption.kept`):
# every count up to 4, then about 1.5x apart, so a stage of n layers can keep within ~1/3 of any count.
KEPT_LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def kept_levels(table: LayerCostTable) -> tuple[int, ...]:
    """The `StageOption.kept` counts tried for `table`'s layers: every level below the layer count
    where the layers are the model's own modules (the runtime cuts a stage's program by their
    names), none otherwise."""
    layers = table.layers
    if layers.method != "modules":
        return ()
    return tuple(j for j in KEPT_LEVELS if j < layers.num_layers)


@dataclasses.dataclass(frozen=True, slots=True)
class StageOption:
    """One way to run a stage on a submesh: a logical mesh (index into the table's meshes), a state
    layout ("plan" or "sharded-state"), whether the backward recomputes the forward, which
    per-layer plans it runs ("": each layer's own; else a `LayerCostTable.variants` name), and under
    recomputation how many of the stage's last layers keep their activations (`kept`; 0: none, the
    whole forward is recomputed); without it, whether the saved activations wait in host memory
    (`offload_acts`); in the sharded-state layout, whether each layer's parameter gather is issued
    behind the compute of the layer before it (`prefetch`)."""

    mesh_index: int
    layout: str
    remat: bool
    variant: str = ""
    kept: int = 0
    offload_acts: bool = False
    prefetch: bool = False

    @property
    def name(self) -> str:
        """As `planner.core.pipeline_records.stage_way` writes a stage, e.g. "fsdp:sharded-state+remat"."""
        return stage_way(PipelineStage(layer_plans=self.variant or "planned", state_layout=self.layout,
                                       remat=self.remat, kept_layers=self.kept,
                                       offloaded_activations=self.offload_acts, prefetch=self.prefetch))


def stage_collectives(table: LayerCostTable, first: int, last: int, option: StageOption) -> tuple:
    """The collectives per microbatch of layers first..last run as `option` says: each layer's plan's
    (`LayerCost.collectives`) and, in the sharded-state layout, its parameter gathers
    (`LayerCost.zero_collectives`): what `stage_communication` and the stage times price."""
    out = []
    for layer in range(first, last + 1):
        cost = table.cost(layer, option.mesh_index, option.variant)
        out += cost.collectives
        if option.layout == "sharded-state":
            out += cost.zero_collectives
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class StageTimes:
    """Latency of every (layer range, submesh) for the DP, and how each was obtained.

    Attributes:
      times: `times[q, k, i, m]` seconds per microbatch of layers k..i on submesh m with
        `inflight[q]` microbatches in flight; infinity when nothing fits.
      option: index into `options[m]` of the way achieving it (-1: none).
      options: per submesh, the ways considered.
      inflight: in-flight microbatches of each q.
      boundary: activation bytes crossing each layer boundary per microbatch.
    """

    times: np.ndarray
    option: np.ndarray
    options: tuple[tuple[StageOption, ...], ...]
    inflight: tuple[int, ...]
    boundary: np.ndarray


def _range_sums(x: np.ndarray) -> np.ndarray:
    """`out[k, i] = sum(x[k..i])` for i >= k, infinity below the diagonal or over an infinite entry."""
    L = len(x)
    bad = ~np.isfinite(x)
    c = np.concatenate([[0.0], np.cumsum(np.where(bad, 0.0, x))])
    nbad = np.concatenate([[0], np.cumsum(bad)])
    out = c[None, 1:] - c[:-1, None]
    idx = np.arange(L)
    out[((nbad[None, 1:] - nbad[:-1, None]) > 0) | (idx[:, None] > idx[None, :])] = np.inf
    return out


def _range_max(x: np.ndarray) -> np.ndarray:
    L = len(x)
    out = np.full((L, L), np.inf)
    for k in range(L):
        out[k, k:] = np.maximum.accumulate(x[k:])
    return out


def sync_every_microbatch(cost: LayerCost, option: StageOption) -> bool:
    """Whether the layer's data-parallel gradient reduction (`LayerCost.sync_s`) runs every
    microbatch as `option` runs it, not once per step: in the sharded-state layout its parameters
    are split over the data axes too, and the pipeline runtime then reduces every microbatch
    (`stage_records.set_replicas`)."""
    return option.layout == "sharded-state" and bool(cost.data_axes) and cost.sync_s > 0


def split_ranges(rows: Sequence[LayerCost], option: StageOption) -> tuple[np.ndarray, np.ndarray]:
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
    return split, _range_sums(sync)


class _Columns:
    """`_columns` of one (layers, mesh, variant, state layout, microbatch count) and their range sums,
    made once and shared by every way of running a stage there (recomputation, kept layers, offloaded
    activations: `shared_columns`); read-only once made."""

    def __init__(self, table: LayerCostTable, option: StageOption):
        self.col = _columns(table, option)
        self.inner = table.inner(option.mesh_index, option.variant)
        self._sums: dict[str, np.ndarray] = {}

    def __getitem__(self, kind: str) -> np.ndarray:
        return self.col[kind]

    def sums(self, kind: str) -> np.ndarray:
        """`_range_sums` of column `kind`."""
        if kind not in self._sums:
            self._sums[kind] = _range_sums(self.col[kind])
        return self._sums[kind]

    def work_max(self) -> np.ndarray:
        if "work max" not in self._sums:
            self._sums["work max"] = _range_max(self.col["work"])
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
                fwd_part = _range_sums(hf) - hf[:, None]  # sum over l = k+1..i
                bwd_part = _range_sums(hb) - hb[None, :]  # sum over l = k..i-1
                both = fwd_part + bwd_part
            self._sums["prefetch"] = np.where(np.isfinite(both), both, 0.0)
        return self._sums["prefetch"]

    def prefetched_params(self) -> np.ndarray:
        """`out[k, i]`: the most gathered parameter bytes of a layer of k..i, which prefetch holds
        beside the layer computing (none where the range is one layer)."""
        if "prefetched" not in self._sums:
            most = _range_max(self.col["param"])
            idx = np.arange(len(self.col["param"]))
            self._sums["prefetched"] = np.where(idx[:, None] < idx[None, :], most, 0.0)
        return self._sums["prefetched"]


def shared_columns(table: LayerCostTable, option: StageOption) -> _Columns:
    """The `_Columns` of `option`'s mesh, variant and state layout, kept in `table.ranges` (the ways
    of one layout differ only in how they combine them)."""
    key = ("columns", table.layers.keys, table.meshes[option.mesh_index], option.variant, option.layout,
           table.microbatches)
    hit = table.ranges.get(key)
    if hit is None:
        hit = table.ranges[key] = _Columns(table, option)
    return hit


def _columns(table: LayerCostTable, option: StageOption) -> dict[str, np.ndarray]:
    """Per layer on the option's mesh, variant and state layout: its time per microbatch ("time")
    and the exposed communication inside it ("comm"), each with what remat's recomputed forward adds
    ("..._recompute"); its state, activation and working bytes; and per layer range the
    once-per-step reductions a split stage moves into every microbatch ("split_sync",
    `split_ranges`)."""
    rows = table.rows(option.mesh_index, option.variant)
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
                           else r.opt_state_bytes - r.opt_host_bytes if option.layout == "offloaded-optimizer"
                           else r.state_bytes for r in rows]),
        "act": np.array([r.act_bytes for r in rows]),
        "work": np.array([r.zero_work_bytes if sharded else r.work_bytes for r in rows]),
        "gather": np.array([g / 2 for g in gathers]),  # one of the two (forward, backward)
        "free_fwd": np.array([f * r.fwd_fraction for f, r in zip(free, rows)]),
        "free_bwd": np.array([f * (1 - r.fwd_fraction) for f, r in zip(free, rows)]),
        "param": np.array([max(0.0, r.zero_work_bytes - r.work_bytes) if sharded and np.isfinite(r.work_bytes)
                           else 0.0 for r in rows]),  # the layer's gathered parameters
    }


def stage_ranges(table: LayerCostTable, option: StageOption, devices: int,
                 boundary: np.ndarray, link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every layer range k..i: (latency per microbatch, fixed memory, memory per in-flight microbatch).

    The latency includes sending the stage's output activations forward and its input gradients
    backward (`alpha + bytes * beta / devices` each, over the cluster's boundary link), and the
    resharding of values passed between the range's layers (`LayerCostTable.inner`; once more in
    the recomputed forward under remat). Kept in `table.ranges` (shared by the tables of one step
    at every batch size: the same layers at the same microbatch size and count give the same
    ranges); read-only.
    """
    # the count too: each layer's plan is made for the step's microbatches (`LayerCostTable.microbatches`)
    key = (table.layers.keys, table.meshes[option.mesh_index], option, devices, boundary.tobytes(), link,
           table.microbatches)
    hit = table.ranges.get(key)
    if hit is None:
        hit = table.ranges[key] = _stage_ranges(table, option, devices, boundary, link)
    return hit


def _stage_ranges(table: LayerCostTable, option: StageOption, devices: int,
                  boundary: np.ndarray, link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    col = shared_columns(table, option)
    t = _range_seconds(table, col, "time", option, boundary, link, devices)
    if option.layout in OPTIMIZER_LAYOUTS:  # its runtime shards no optimizer state where it reduces every microbatch
        t = np.where(col["split"], np.inf, t)
    state, act, work = col.sums("state"), col.sums("act"), col.work_max()
    if option.prefetch:  # the next layer's gathered parameters beside the layer computing
        work = work + col.prefetched_params()
    if option.offload_acts:  # one microbatch's activations going out, one coming back
        return t, state + work + 2 * act, np.where(np.isfinite(act), 0.0, np.inf)
    if not option.remat:
        return t, state + work, act
    stage_input = np.concatenate([[0.0], boundary[:-1]]) / devices
    per_mb = np.where(np.isfinite(act), np.broadcast_to(stage_input[:, None], act.shape), np.inf)
    if not option.kept:
        return t, state + act + work, per_mb
    # layers k..i-j recomputed (their activations once), i-j+1..i kept per microbatch in flight
    recomputed = shifted(act, option.kept)
    longer = np.isfinite(recomputed)  # the range has more layers than it keeps
    kept = act - np.where(longer, recomputed, 0.0)  # the last j layers' sum
    return t, state + recomputed + work, np.where(longer, per_mb + kept, np.inf)


def shifted(m: np.ndarray, j: int) -> np.ndarray:
    """`out[k, i] = m[k, i - j]` where `i - j >= k`, else infinity: the range k..i less its last j
    layers (a range of `j` layers or fewer has no layer left to recompute)."""
    out = np.full_like(m, np.inf)
    if j < m.shape[1]:
        out[:, j:] = m[:, :-j] if j else m
    return np.where(np.triu(np.ones(m.shape, dtype=bool), j), out, np.inf)


def update_peak(table: LayerCostTable, option: StageOption) -> np.ndarray:
    """`out[k, i]`: bytes per device layers k..i hold during the update in the offloaded-optimizer
    layout: parameters and gradients, and the optimizer state of one parameter at a time, copied in
    and its new value going out (the runtime's streamed update, `emit.pipeline.runtime._updated`):
    twice the largest parameter's (`LayerCost.opt_host_leaf_bytes`); no activations are live then.
    Zeros in the other layouts, whose update holds no more than the microbatches do."""
    L = table.layers.num_layers
    if option.layout != "offloaded-optimizer":
        return np.zeros((L, L))
    rows = table.rows(option.mesh_index, option.variant)
    return (_range_sums(np.array([r.opt_state_bytes - r.opt_host_bytes for r in rows]))
            + 2 * _range_max(np.array([r.opt_host_leaf_bytes for r in rows])))


def once_per_step_ranges(table: LayerCostTable, option: StageOption) -> np.ndarray:
    """`out[k, i]`: the once-per-step term of layers k..i as one stage run as `option` says (its
    gradient exchange and update, and in the offloaded-optimizer layout the optimizer state's trip
    over the host link), as `candidate.once_per_step` prices a chosen stage: what `stage_times`
    weighs, amortised over the microbatches, when it picks a stage's way."""
    # the term depends on the mesh, the per-layer plans and the state layout only
    key = ("once per step", table.layers.keys, table.meshes[option.mesh_index], option.variant, option.layout,
           table.microbatches)
    hit = table.ranges.get(key)
    if hit is None:
        hit = table.ranges[key] = _once_per_step_ranges(table, option)
    return hit


def once_per_step_columns(table: LayerCostTable, rows: Sequence[LayerCost], option: StageOption
                          ) -> tuple[list[float], list[float]]:
    """Per layer of `rows` run as `option` says in a stage that splits no parameter over a data
    axis: (its gradient exchange once per step, with the offloaded-optimizer layout's trip over the
    host link; its update). `candidate.once_per_step` sums them over a chosen stage,
    `once_per_step_ranges` over every range."""
    if option.layout in OPTIMIZER_LAYOUTS:
        host = table.cluster.hardware.host_bandwidth if option.layout == "offloaded-optimizer" else None
        return ([r.opt_sync_s + (2 * r.opt_host_bytes / host if host else 0.0) for r in rows],
                [r.opt_apply_s for r in rows])
    return [0.0 if sync_every_microbatch(r, option) else r.sync_s for r in rows], [r.apply_s for r in rows]


def _once_per_step_ranges(table: LayerCostTable, option: StageOption) -> np.ndarray:
    rows = table.rows(option.mesh_index, option.variant)
    split = shared_columns(table, option)["split"]
    apply = _range_sums(np.array([r.apply_s for r in rows]))  # a split stage: reduced every microbatch
    sync, update = once_per_step_columns(table, rows, option)
    return np.where(split, apply, _range_sums(np.array(sync) + np.array(update)))


def host_offload(table: LayerCostTable) -> bool:
    """Whether stages may keep values in host memory: the host link is known and the options do not
    turn host offload off."""
    return table.cluster.hardware.host_bandwidth is not None and table.options.offload in (None, "auto")


def prefetch_offered(table: LayerCostTable) -> bool:
    """Whether sharded-state stages may prefetch their gathers: collectives overlap compute on the
    hardware (XLA:CPU runs them synchronously, `cost_model.hardware.xla_flags`) and the options do not
    turn prefetch off."""
    return table.cluster.hardware.platform != "cpu" and table.options.prefetch is not False


def offload_layouts(table: LayerCostTable, layouts: Sequence[str]) -> tuple[str, ...]:
    """`layouts` without the offloaded-optimizer layout where the host link is unknown or the
    options turn host offload off."""
    known = host_offload(table)
    return tuple(lay for lay in layouts if known or lay != "offloaded-optimizer")


def _sends(boundary: np.ndarray, link, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: the forward send after it (its stage ends there) and the backward send before it
    (its stage starts there), `alpha + bytes * beta / devices` over the boundary link."""
    send = np.array([link.alpha + b * link.beta / devices if b > 0 else 0.0 for b in boundary])
    fwd_send = send.copy()
    fwd_send[-1] = 0.0
    bwd_send = np.concatenate([[0.0], send[:-1]])
    return fwd_send, bwd_send


def _range_seconds(table: LayerCostTable, col: _Columns, kind: str, option: StageOption,
                   boundary: np.ndarray, link, devices: int) -> np.ndarray:
    """`out[k, i]`: seconds per microbatch of layers k..i as one stage, from the per-layer column
    `kind` of `_columns` ("time", or "comm" for the communication inside it): the layers' sum, the
    reductions a split stage runs every microbatch ("split_sync"), the resharding between them (`LayerCostTable.inner`), the boundary sends; under remat the
    recomputed forward's share of the layers and of the resharding."""
    inner = col.inner
    fwd_send, bwd_send = _sends(boundary, link, devices)
    out = col.sums(kind) + inner + fwd_send[None, :] + bwd_send[:, None] + col["split_sync"]
    if option.prefetch:  # the gathers hidden behind the layers' compute
        out = out - col.prefetch_hidden()
    if option.remat:  # the recomputed layers' forward and resharding (the layers before the last `kept`)
        out = out + shifted(col.sums(f"{kind}_recompute") + inner / 2, option.kept)
    if option.offload_acts:  # the host trips overlap the stage's compute; what they exceed it by is exposed
        time = out if kind == "time" else _range_seconds(table, col, "time", option, boundary, link, devices)
        with np.errstate(invalid="ignore"):  # below the diagonal both are infinite
            over = np.maximum(col.sums("act") / table.cluster.hardware.host_bandwidth - time, 0.0)
        out = out + np.where(np.isnan(over), np.inf, over)
    return out


def stage_communication(table: LayerCostTable, first: int, last: int, option: StageOption, devices: int,
                        boundary: np.ndarray, link) -> tuple[float, float]:
    """(exposed, hidden) communication per microbatch inside the stage time `stage_ranges` gives for
    layers first..last (`_range_seconds` of the "comm" column)."""
    col = shared_columns(table, option)
    exposed = _range_seconds(table, col, "comm", option, boundary, link, devices)
    prefetched = float(col.prefetch_hidden()[first, last]) if option.prefetch else 0.0
    return float(exposed[first, last]), prefetched + sum(table.cost(l, option.mesh_index, option.variant).hidden_s
                                                         for l in range(first, last + 1))


def stage_times(table: LayerCostTable, submeshes: Sequence[tuple[int, int]],
                mesh_indices: Sequence[Sequence[int]], num_microbatches: int, schedule: str,
                memory_budget: float, boundary: np.ndarray, layouts: Sequence[str] = LAYOUTS,
                remats: Sequence[bool] = (False, True), variants: Sequence[str] | None = None,
                kept: Sequence[int] | None = None, offload_acts: bool = True) -> StageTimes:
    """The DP's latency table: per (layer range, submesh, in-flight count) the fastest way that fits
    (its time per microbatch, the way weighed with its once-per-step term over the step's
    microbatches: `once_per_step_ranges`).

    A way fits when `fixed + inflight * per_microbatch <= memory_budget` (see `stage_ranges`), where
    `inflight` is what a stage at that pipeline position holds: under 1F1B min(position from the
    end, B), under GPipe B. `layouts` and `remats` restrict the ways tried (a hand configuration
    fixes its state layout, and may fix recomputation); `variants` the per-layer plans (None: the
    layers' own and every one of `table.variants`); `kept` the counts of last layers a recomputing
    stage may keep (None: `kept_levels`; a hand configuration recomputes all or none);
    `offload_acts` whether stages may keep their saved activations in host memory (`host_offload`).
    """
    L = table.layers.num_layers
    B = num_microbatches
    variants = ("", *table.variants) if variants is None else tuple(variants)
    kept = kept_levels(table) if kept is None else tuple(kept)
    hosted = offload_acts and host_offload(table)
    prefetching = prefetch_offered(table)
    table.fill(sorted({mi for idx in mesh_indices for mi in idx}), variants=variants)
    inflight = tuple(range(1, min(B, L) + 1)) if schedule == "1f1b" else (B,)
    Q, S = len(inflight), len(submeshes)
    times = np.full((S, Q, L, L), np.inf)  # by submesh while filled: each submesh's block contiguous
    option = np.full((S, Q, L, L), -1, dtype=np.int32)
    link = boundary_link(table.cluster)
    options: list[tuple[StageOption, ...]] = []
    for m, (n, k) in enumerate(submeshes):
        opts: list[StageOption] = []
        best = _Fastest(inflight, L)

        def weigh(opt: StageOption) -> tuple[np.ndarray, np.ndarray]:
            """Offers `opt`; (where it can run, how many of the in-flight counts it fits) per range."""
            t, fixed, per_mb = stage_ranges(table, opt, n * k, boundary, link)
            runs = np.isfinite(t)
            if opt.layout == "offloaded-optimizer":
                runs &= update_peak(table, opt) <= memory_budget
            fit = np.where(runs, fitting_counts(fixed, per_mb, memory_budget, inflight), 0)
            # the ways are weighed with their once-per-step term amortised over the microbatches (a
            # way that is faster per microbatch may pay more once: an offloaded optimizer state's trip)
            best.offer(t, t + once_per_step_ranges(table, opt) / B, fit, len(opts))
            opts.append(opt)
            return runs, fit

        for mi in mesh_indices[m]:
            for v in variants:
                if not table.has_variant(v, mi):
                    continue
                for layout in offload_layouts(table, layouts):
                    ways = {r: weigh(StageOption(mi, layout, r, v)) for r in remats}
                    # keeping the last layers holds more than recomputing all and is slower than
                    # keeping all: it can only win where recomputing all fits and keeping all does not
                    if True in ways and (False not in ways
                                         or (ways[False][0] & (ways[True][1] > ways[False][1])).any()):
                        for j in kept:
                            weigh(StageOption(mi, layout, True, v, j))
                    # offloading the activations is no faster than keeping them: only where that does not fit
                    if hosted and False in ways and (ways[False][0] & (ways[False][1] < Q)).any():
                        weigh(StageOption(mi, layout, False, v, offload_acts=True))
                    # prefetch: where a sharded-state stage runs and some gather can hide
                    if prefetching and layout == "sharded-state" and \
                            shared_columns(table, StageOption(mi, layout, False, v)).prefetch_hidden().any():
                        for r, (runs, _) in ways.items():
                            if runs.any():
                                weigh(StageOption(mi, layout, r, v, prefetch=True))
        times[m], option[m] = best.tables()
        options.append(tuple(opts))
    return StageTimes(np.ascontiguousarray(times.transpose(1, 2, 3, 0)),
                      np.ascontiguousarray(option.transpose(1, 2, 3, 0)), tuple(options), inflight, boundary)


def fitting_counts(fixed: np.ndarray, per_mb: np.ndarray, budget: float, inflight: Sequence[int]) -> np.ndarray:
    """Per range, how many of the (ascending) in-flight counts q fit: `fixed + q * per_mb <= budget`
    holds for a prefix of them (the left side grows with q), found from the largest q that fits."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.where(per_mb > 0, np.floor((budget - fixed) / per_mb), np.where(fixed <= budget, np.inf, -np.inf))
        q = np.where(fixed + (q + 1) * per_mb <= budget, q + 1, q)  # the division's rounding, either way
        q = np.where(fixed + q * per_mb > budget, q - 1, q)
    q = np.where(np.isnan(q), -np.inf, q)
    return np.searchsorted(np.asarray(inflight, dtype=float), q, side="right")


class _Fastest:
    """The fastest way per (in-flight count, range) among the ways offered, each fitting a prefix of
    the in-flight counts: each way is kept per range in the bucket of how many counts it fits
    (where it beats the bucket's way, strictly, so the first offered wins a tie), and the way at a
    count is the fastest of the buckets fitting it (ties: the first offered). The same tables as
    weighing every way at every count, at the cost of one range table per way."""

    def __init__(self, inflight: Sequence[int], L: int):
        self.Q, self.L = len(inflight), L
        self.w = np.full((self.Q + 1, L * L), np.inf)  # what a way is picked by
        self.t = np.full((self.Q + 1, L * L), np.inf)
        self.o = np.full((self.Q + 1, L * L), -1, dtype=np.int32)

    def offer(self, t: np.ndarray, weight: np.ndarray, fit: np.ndarray, index: int) -> None:
        cells = np.flatnonzero(fit.ravel() > 0)
        bucket = fit.ravel()[cells]
        w = weight.ravel()[cells]
        better = w < self.w[bucket, cells]
        bucket, cells = bucket[better], cells[better]
        self.w[bucket, cells] = w[better]
        self.t[bucket, cells] = t.ravel()[cells]
        self.o[bucket, cells] = index

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(times, way index) per (in-flight count, first layer, last layer); infinity and -1 where
        no way fits."""
        times = np.full((self.Q, self.L * self.L), np.inf)
        option = np.full((self.Q, self.L * self.L), -1, dtype=np.int32)
        w, t, o = self.w[self.Q].copy(), self.t[self.Q].copy(), self.o[self.Q].copy()
        for q in range(self.Q - 1, -1, -1):  # count q+1 is fitted by the buckets q+1..Q
            if q < self.Q - 1:
                bw, bo = self.w[q + 1], self.o[q + 1]
                take = (bw < w) | ((bw == w) & (bo >= 0) & ((o < 0) | (bo < o)))
                w, t, o = np.where(take, bw, w), np.where(take, self.t[q + 1], t), np.where(take, bo, o)
            times[q], option[q] = t, o
        return times.reshape(self.Q, self.L, self.L), option.reshape(self.Q, self.L, self.L)


def stage_memory(table: LayerCostTable, first: int, last: int, opt: StageOption, devices: int,
                 boundary: np.ndarray, inflight: int) -> float:
    """Predicted per-device memory of one stage holding `inflight` microbatches."""
    _, fixed, per_mb = stage_ranges(table, opt, devices, boundary, boundary_link(table.cluster))
    return max(float(fixed[first, last] + inflight * per_mb[first, last]), float(update_peak(table, opt)[first, last]))
