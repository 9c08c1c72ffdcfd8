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
                                one parameter's at a time (`update_peak`); "+params": the
                                float32 master parameters read only by casts wait there too, the
                                device holding their cast copies (three trips a step: in for the
                                casts, in and back for the update; weighed where the plain
                                layout fits some range but not at every in-flight count);
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
               hidden communication (`Columns.prefetch_hidden`), the stage's first gather of each
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
from planner.stages.stage_columns import (Columns, per_layout, range_max, range_sums, shared_columns, shifted,
                                         sync_every_microbatch)
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
    behind the compute of the layer before it (`prefetch`); in the offloaded-optimizer layout,
    whether the master parameters wait in host memory too (`offload_params`)."""

    mesh_index: int
    layout: str
    remat: bool
    variant: str = ""
    kept: int = 0
    offload_acts: bool = False
    prefetch: bool = False
    offload_params: bool = False

    @property
    def name(self) -> str:
        """As `planner.core.pipeline_records.stage_way` writes a stage, e.g. "fsdp:sharded-state+remat"."""
        return stage_way(PipelineStage(layer_plans=self.variant or "planned", state_layout=self.layout,
                                       remat=self.remat, kept_layers=self.kept,
                                       offloaded_activations=self.offload_acts, prefetch=self.prefetch,
                                       offloaded_params=self.offload_params))


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


def stage_ranges(table: LayerCostTable, option: StageOption, devices: int,
                 boundary: np.ndarray, link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every layer range k..i: (latency per microbatch, fixed memory, memory per in-flight microbatch).

    The latency includes sending the stage's output activations forward and its input gradients
    backward (`alpha + bytes * beta / devices` each, over the cluster's boundary link), and the
    resharding of values passed between the range's layers (`LayerCostTable.inner`; once more in
    the recomputed forward under remat). Kept in `table.ranges` (shared by the tables of one step
    at every batch size: the same layers at the same microbatch size and count give the same
    ranges, and so do other counts' tables where each layer's cost is the same, `SameCosts`); read-only.
    """
    # the layers' costs too (each layer's plan is made for the step's microbatches,
    # `LayerCostTable.microbatches`): another count's table shares the ranges where it has the same
    key = (table.layers.keys, table.meshes[option.mesh_index], option, devices, boundary.tobytes(), link,
           table.same_rows(option.mesh_index, option.variant))
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
    masters = bool(option.offload_params)  # then the cast copies on the device, each master copied in with its state
    return (range_sums(np.array([r.opt_state_bytes - r.opt_host_bytes - masters * (r.master_bytes - r.master_cast_bytes)
                                 for r in rows]))
            + 2 * range_max(np.array([r.opt_host_leaf_bytes + masters * r.master_leaf_bytes for r in rows])))


def host_ranges(table: LayerCostTable, option: StageOption) -> tuple[np.ndarray, np.ndarray] | None:
    """Per range k..i, the bytes per device a stage run as `option` keeps in its host's memory:
    (whatever the in-flight count: the offloaded optimizer state, with the master parameters where
    they wait there too; per in-flight microbatch: its saved activations where they are offloaded).
    None where it keeps nothing there. `stage_times` fits them in `Hardware.host_memory_per_device`."""
    if option.layout != "offloaded-optimizer" and not option.offload_acts:
        return None
    rows = table.rows(option.mesh_index, option.variant)
    L = len(rows)
    masters = bool(option.offload_params)
    fixed = (range_sums(np.array([r.opt_host_bytes + masters * r.master_bytes for r in rows]))
             if option.layout == "offloaded-optimizer" else np.zeros((L, L)))
    return fixed, shared_columns(table, option).sums("act") if option.offload_acts else np.zeros((L, L))


def once_per_step_ranges(table: LayerCostTable, option: StageOption) -> np.ndarray:
    """`out[k, i]`: the once-per-step term of layers k..i as one stage run as `option` says (its
    gradient exchange and update, and in the offloaded-optimizer layout the optimizer state's trip
    over the host link), as `candidate.once_per_step` prices a chosen stage: what `stage_times`
    weighs, amortised over the microbatches, when it picks a stage's way."""
    return per_layout(table, option, "once per step", lambda: _once_per_step_ranges(table, option))


def once_per_step_columns(table: LayerCostTable, rows: Sequence[LayerCost], option: StageOption
                          ) -> tuple[list[float], list[float]]:
    """Per layer of `rows` run as `option` says in a stage that splits no parameter over a data
    axis: (its gradient exchange once per step, with the offloaded-optimizer layout's trip over the
    host link; its update). `candidate.once_per_step` sums them over a chosen stage,
    `once_per_step_ranges` over every range."""
    if option.layout in OPTIMIZER_LAYOUTS:
        host = table.cluster.hardware.host_bandwidth if option.layout == "offloaded-optimizer" else None
        # host-kept master parameters: copied in for their casts, in for the update and back
        trips = [2 * r.opt_host_bytes + (3 * r.master_bytes if option.offload_params else 0.0) for r in rows]
        return ([r.opt_sync_s + (t / host if host else 0.0) for r, t in zip(rows, trips)],
                [r.opt_apply_s for r in rows])
    return [0.0 if sync_every_microbatch(r, option) else r.sync_s for r in rows], [r.apply_s for r in rows]


def _once_per_step_ranges(table: LayerCostTable, option: StageOption) -> np.ndarray:
    rows = table.rows(option.mesh_index, option.variant)
    split = shared_columns(table, option)["split"]
    apply = range_sums(np.array([r.apply_s for r in rows]))  # a split stage: reduced every microbatch
    sync, update = once_per_step_columns(table, rows, option)
    return np.where(split, apply, range_sums(np.array(sync) + np.array(update)))


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


def _range_seconds(table: LayerCostTable, col: Columns, kind: str, option: StageOption,
                   boundary: np.ndarray, link, devices: int) -> np.ndarray:
    """`out[k, i]`: seconds per microbatch of layers k..i as one stage, from the per-layer column
    `kind` of `layer_columns` ("time", or "comm" for the communication inside it): the layers' sum, the
    reductions a split stage runs every microbatch ("split_sync"), the resharding between them (`LayerCostTable.inner`), the boundary sends; under remat the
    recomputed forward's share of the layers and of the resharding."""
    inner = col.inner
    fwd_send, bwd_send = _sends(boundary, link, devices)
    out = col.sums(kind) + inner + fwd_send[None, :] + bwd_send[:, None] + col["split_sync"]
    if option.prefetch:  # the gathers hidden behind the layers' compute
        out = out - col.prefetch_hidden()
    if option.remat:  # the recomputed layers' forward and resharding (the layers before the last `kept`)
        out = out + shifted(col.sums(f"{kind}_recompute") + inner / 2, option.kept)
        if option.prefetch:  # its gathers hidden as the forward's are
            out = out - _recompute_prefetched(col, option)
    if option.offload_acts:  # the host trips overlap the stage's compute; what they exceed it by is exposed
        time = out if kind == "time" else _range_seconds(table, col, "time", option, boundary, link, devices)
        with np.errstate(invalid="ignore"):  # below the diagonal both are infinite
            over = np.maximum(col.sums("act") / table.cluster.hardware.host_bandwidth - time, 0.0)
        out = out + np.where(np.isnan(over), np.inf, over)
    return out


def _recompute_prefetched(col: Columns, option: StageOption) -> np.ndarray:
    """`out[k, i]`: the gathers a prefetching stage's recomputed forward (layers k..i less the last
    `option.kept`) hides behind its compute, as the forward's (`Columns.prefetch_hidden_forward`)."""
    again = shifted(col.prefetch_hidden_forward(), option.kept)
    return np.where(np.isfinite(again), again, 0.0)


def stage_communication(table: LayerCostTable, first: int, last: int, option: StageOption, devices: int,
                        boundary: np.ndarray, link) -> tuple[float, float]:
    """(exposed, hidden) communication per microbatch inside the stage time `stage_ranges` gives for
    layers first..last (`_range_seconds` of the "comm" column)."""
    col = shared_columns(table, option)
    exposed = _range_seconds(table, col, "comm", option, boundary, link, devices)
    prefetched = 0.0
    if option.prefetch:
        prefetched = float(col.prefetch_hidden()[first, last]
                           + (_recompute_prefetched(col, option)[first, last] if option.remat else 0.0))
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
    end, B), under GPipe B, and what it keeps in host memory fits the device's share of its host's
    (`host_ranges`, `Hardware.host_memory_per_device`). `layouts` and `remats` restrict the ways tried (a hand configuration
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
    host_budget = table.cluster.hardware.host_memory_per_device
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
        tried: dict[StageOption, tuple[np.ndarray, np.ndarray]] = {}  # the ways of one state layout

        def weigh(opt: StageOption) -> tuple[np.ndarray, np.ndarray]:
            """Offers `opt`; (where it can run, how many of the in-flight counts it fits) per range."""
            t, fixed, per_mb = stage_ranges(table, opt, n * k, boundary, link)
            runs = np.isfinite(t)
            if opt.layout == "offloaded-optimizer":
                runs &= update_peak(table, opt) <= memory_budget
            fit = np.where(runs, fitting_counts(fixed, per_mb, memory_budget, inflight), 0)
            host = host_ranges(table, opt) if np.isfinite(host_budget) else None
            if host is not None:  # and what it keeps in host memory fits the device's share of it
                fit = np.minimum(fit, fitting_counts(*host, host_budget, inflight))
            # the ways are weighed with their once-per-step term amortised over the microbatches (a
            # way that is faster per microbatch may pay more once: an offloaded optimizer state's trip)
            best.offer(t, t + once_per_step_ranges(table, opt) / B, fit, len(opts))
            opts.append(opt)
            tried[opt] = runs, fit
            return runs, fit

        for mi in mesh_indices[m]:
            for v in variants:
                if not table.has_variant(v, mi):
                    continue
                for layout in offload_layouts(table, layouts):
                    tried.clear()
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
                    # master parameters in host memory: beside each way of the offloaded layout (its
                    # recomputation, kept layers, offloaded activations) that runs but not at every count
                    if layout == "offloaded-optimizer" and any(r.master_bytes > 0 for r in table.rows(mi, v)):
                        for way, (runs, fit) in list(tried.items()):
                            if (runs & (fit < Q)).any():
                                weigh(dataclasses.replace(way, offload_params=True))
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
