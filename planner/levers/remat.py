"""Recomputation (rematerialisation) in single-stage plans: a graph transformation the ILP plans.

`rematerialize(graph, layers, policy)` rewrites a traced train step (`jax.grad` /
`jax.value_and_grad` + update, any signature): for each chosen layer (a repeated module such as
`blocks_3`, `planner.core.layer_index`), the forward ops whose results its backward reads (the
residuals) are copied, computed from the layer's inputs, and placed right before that layer's
backward starts; the backward reads the copies, so the forward's own results die after the forward.

* policy "full" recomputes every residual (`jax.checkpoint` with `nothing_saveable`): a layer keeps
  only its inputs;
* policy "dots" keeps the results of matmuls and convolutions and recomputes the rest from them
  (`jax.checkpoint_policies.dots_saveable`);
* policy "dots_no_batch" keeps only the results of matmuls without batch dimensions (a layer's
  projections) and recomputes the batched ones (attention's scores and weighted values,
  `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).

The transformed graph is planned like any other (`search.mesh_plan.make_plan`): the ILP prices the copies'
compute and their shardings, and the memory model (liveness in program order) sees the shorter live
ranges, so the prediction includes both sides of the trade with no separate model. Emission runs
each layer's copies behind one `optimization_barrier` on their inputs and the incoming cotangent,
and makes their activation inputs depend on that cotangent (`graph.ir.Recompute`), so XLA neither
merges them back into the forward (CSE) nor hoists them. The barrier alone is not enough: XLA
removes barriers before scheduling, and XLA:CPU's default (concurrency-optimised) scheduler then
computes the recomputation during the forward, saving no memory (with `jax.checkpoint` too, and with
this module's barrier alone); the dependency on the cotangent is what keeps it in the backward.
`--xla_cpu_enable_concurrency_optimized_scheduler=false` also helps `jax.checkpoint`, but only as a
process-wide XLA_FLAGS: passed per program (`jax.jit(compiler_options=...)`) it changed nothing
(jax 0.10.2), so plans do not rely on it.

A scanned stack of layers (one `scan` whose body is a layer: MaxText's `scan_layers`, Flax
`nn.scan`) is recomputed by rewriting the step's jaxpr (`planner.graph.scan_remat`): the forward
scan stacks each layer's input instead of its residuals and the backward scan recomputes them per
layer, with the same policies, on every scan of the stack at once, or (under "auto", as for unrolled
layers) on the first n layers of each stack for the fewest n that fits (`scan_remat.rewrite(first=)`:
each scan split at n, the first part recomputing, the rest keeping its residuals).

Out of scope: unrolled layers inside another scan or control-flow region, and layers a pipeline
plans (pipeline stages choose recomputation per stage, `pipeline="auto"`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, NotFasterError
from planner.graph.ir import Body, Graph, Op, Recompute, dot_flops
from planner.graph.scan_remat import (POLICIES as SCAN_POLICIES, is_recomputed, keeps, recomputable_scans,
                                      recompute_scans, split_length)
from planner.ilp.levers import LEVERS, RAISE, levers_text
from planner.core.layer_index import find_indexed, in_fused_attention
from planner.core.options import REMAT
from planner.core.plan import Plan
from planner.core.plan_records import RematRecord
from planner.search.cores import idle_cores
from planner.stages.clustering import BACKWARD, FORWARD, op_phases, repeated_module
from planner.core.units import format_bytes

log = logging.getLogger("planner")

POLICIES = SCAN_POLICIES
OPTIONS = REMAT


# Name stack wrapper of the copies: `remat(jvp(GPT))/blocks_3/mlp` recomputes `jvp(GPT)/blocks_3/mlp`.
WRAPPER = "remat"


def check_option(remat: Any) -> str:
    """`remat` if it is one of `OPTIONS`; a one-line InvalidArgumentError otherwise."""
    if not isinstance(remat, str) or remat not in OPTIONS:
        raise InvalidArgumentError(f"remat={remat!r} must be one of {', '.join(map(repr, OPTIONS))}")
    return remat


def _layer_of(stack: str, prefix: str) -> str | None:
    for m in find_indexed(stack):
        if m.group(1) == prefix:
            return m.group(0)
    return None


@dataclasses.dataclass(frozen=True)
class _Layer:
    name: str
    forward: tuple[int, ...]
    backward: tuple[int, ...]


def _layers(graph: Graph) -> tuple[list[_Layer], dict[str, str]]:
    """Repeated layers in forward order, and per layer left out the reason."""
    phases = op_phases(graph)
    if BACKWARD not in phases:
        return [], {}
    prefix = repeated_module(graph)
    if prefix is None:
        return [], {}
    fwd: dict[str, list[int]] = defaultdict(list)
    bwd: dict[str, list[int]] = defaultdict(list)
    for op in graph.ops:
        name = _layer_of(op.name_stack, prefix)
        if name is not None and phases[op.index] in (FORWARD, BACKWARD):
            (fwd if phases[op.index] == FORWARD else bwd)[name].append(op.index)
    in_region = [False] * len(graph.ops)
    for regions in graph.regions.values():
        for r in regions:
            for i in range(r.start, r.end):
                in_region[i] = True
    out, skipped = [], {}
    for name in sorted(fwd, key=lambda n: fwd[n][0]):
        f, b = fwd[name], bwd.get(name, [])
        if not b:
            skipped[name] = "no backward ops"
        elif any(in_region[i] for i in f + b):
            skipped[name] = "inside a loop or branch (use the model's own jax.checkpoint)"
        elif max(f) >= min(b):
            skipped[name] = "its forward and backward interleave"
        else:
            out.append(_Layer(name, tuple(f), tuple(b)))
    return out, skipped


def remat_layers(graph: Graph) -> list[str]:
    """Names of the layers `rematerialize` can recompute, in forward order."""
    return [layer.name for layer in _layers(graph)[0]]


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One layer's recomputation: the original ops to copy (program order), inserted before op `at`."""

    layer: str
    at: int
    ops: tuple[int, ...]
    gate: int


def _plan_copies(graph: Graph, layer: _Layer, policy: str, consumers, producer) -> _Copy | None:
    at = layer.backward[0]
    made = {t: i for i in layer.forward for t in graph.ops[i].outputs}
    saved = {t for t, i in made.items() if keeps(graph.ops[i].name, graph.ops[i].params, policy)
             and (not in_fused_attention(graph.ops[i].name_stack)  # a fused attention keeps its output only
                  or any(not in_fused_attention(graph.ops[j].name_stack) for j, _ in consumers.get(t, ())))}
    residuals = {t for t in made if t not in saved and any(j >= at for j, _ in consumers.get(t, ()))}
    todo, copy = [made[t] for t in residuals], set()
    while todo:
        i = todo.pop()
        if i in copy:
            continue
        copy.add(i)
        todo.extend(made[t] for t in graph.ops[i].tensor_inputs if t in made and t not in saved)
    if not copy or any("callback" in graph.ops[i].name for i in copy):
        return None
    # the gate: the latest value of an earlier backward op this layer's backward reads (its cotangent)
    own = set(layer.backward)
    incoming = [t for i in layer.backward for t in graph.ops[i].tensor_inputs
                if producer.get(t, at) < at and producer[t] not in own and _is_backward(graph, producer[t])]
    if not incoming:
        return None
    gate = max(incoming, key=lambda t: producer[t])
    return _Copy(layer.name, at, tuple(sorted(copy)), gate)


def _is_backward(graph: Graph, i: int) -> bool:
    return graph.ops[i].name_stack.startswith("transpose(")


def rematerialize(graph: Graph, layers: Sequence[str] | None = None, policy: str = "full",
                  scan_first: int | None = None) -> Graph:
    """`graph` with the forward of each layer in `layers` (default: every layer `remat_layers`
    finds) recomputed before its backward (module docstring), and the layers of each scanned stack
    (its first `scan_first` only, where given: `graph.scan_remat.recompute_scans`). The result
    computes the same values.

    Raises:
      InvalidArgumentError: an unknown policy, or a layer name that is not a recomputable layer.
    """
    if policy not in POLICIES:
        raise InvalidArgumentError(f"remat policy {policy!r} must be one of {', '.join(map(repr, POLICIES))}")
    graph = recompute_scans(graph, policy, scan_first)  # a scanned stack: its jaxpr rewritten, traced again
    found, skipped = _layers(graph)
    by_name = {layer.name: layer for layer in found}
    if layers is None:
        chosen = found
    else:
        unknown = [n for n in layers if n not in by_name]
        if unknown:
            why = skipped.get(unknown[0], "not a repeated layer of this step")
            raise InvalidArgumentError(f"cannot recompute layer {unknown[0]!r}: {why}; recomputable layers: "
                                       f"{', '.join(by_name) or 'none'}")
        chosen = [by_name[n] for n in layers]
    consumers, producer = graph.consumers(), {t: op.index for op in graph.ops for t in op.outputs}
    copies = [c for c in (_plan_copies(graph, layer, policy, consumers, producer) for layer in chosen) if c]
    inside = [r for regions in graph.regions.values() for r in regions]
    copies = [c for c in copies if not any(r.start < c.at < r.end for r in inside)]
    if not copies:
        return graph
    return _insert(graph, sorted(copies, key=lambda c: c.at))


def _insert(graph: Graph, copies: Sequence[_Copy]) -> Graph:
    tensors = list(graph.tensors)
    ops: list[Op] = []
    new_index: list[int] = [0] * len(graph.ops)
    rename: dict[int, int] = {}  # residual -> its copy, for every op placed after the copy
    groups: dict[int, Recompute] = {}
    pending = list(copies)

    def read(x):
        return rename.get(x, x) if isinstance(x, int) else x

    for i, op in enumerate(graph.ops):
        while pending and pending[0].at == i:
            c = pending.pop(0)
            start, local = len(ops), {}
            for j in c.ops:
                src = graph.ops[j]
                outs = []
                for t in src.outputs:
                    tensors.append(graph.tensors[t])
                    local[t] = len(tensors) - 1
                    outs.append(local[t])
                inputs = tuple(local.get(x, read(x)) if isinstance(x, int) else x for x in src.inputs)
                ops.append(Op(len(ops), src.primitive, src.params, inputs, tuple(outs),
                              f"{WRAPPER}({src.name_stack})" if src.name_stack else WRAPPER))
            made = set(local.values())
            outside = sorted({x for o in ops[start:] for x in o.tensor_inputs if x not in made
                              and x not in graph.consts})
            groups[start] = Recompute(start, len(ops), tuple(outside), read(c.gate))
            rename.update(local)
        new_index[i] = len(ops)
        ops.append(Op(len(ops), op.primitive, op.params, tuple(read(x) for x in op.inputs), op.outputs,
                      op.name_stack))

    def index(s: int) -> int:
        return new_index[s] if s < len(new_index) else len(ops)

    def end(s: int, e: int) -> int:
        return index(e - 1) + 1 if e > s else index(s)

    def body(b: Body) -> Body:
        return Body(index(b.start), end(b.start, b.end), tuple(read(x) for x in b.inputs),
                    tuple(read(x) for x in b.outputs))

    regions = {index(k): tuple(dataclasses.replace(r, start=index(r.start), end=end(r.start, r.end),
                                                   operands=tuple(read(x) for x in r.operands),
                                                   bodies=tuple(body(b) for b in r.bodies)) for r in rs)
               for k, rs in graph.regions.items()}
    return dataclasses.replace(graph, tensors=tuple(tensors), ops=tuple(ops), regions=regions,
                               recompute={**{index(k): dataclasses.replace(g, start=index(g.start),
                                                                           end=end(g.start, g.end))
                                             for k, g in graph.recompute.items()}, **groups})


def summary(original: Graph, transformed: Graph, policy: str) -> RematRecord:
    """What `plan.levers.remat` records: the policy, the layers recomputed (those actually copied,
    forward order), how many layers could be (`recomputable`), the ops added."""
    prefix = repeated_module(original) or ""
    copied = {_layer_of(op.name_stack, prefix) for op in transformed.ops if op.name_stack.startswith(f"{WRAPPER}(")}
    names = remat_layers(original)
    scans = transformed.source.scans_recomputed if transformed.source is not None else 0
    added = sum(op.name_stack.startswith(f"{WRAPPER}(") or is_recomputed(op.name_stack) for op in transformed.ops)
    first = transformed.source.scan_first if scans else None
    return RematRecord(policy, tuple(n for n in names if n in copied), len(names), added, scans=scans or None,
                       scan_layers=first)


def graph_for(graph: Graph, plan: Plan) -> Graph:
    """The graph `plan` was made for, from the step's own trace: rewritten as `plan.levers.remat`
    records (a saved plan re-emitted with `jit_planned` needs it); `graph` itself for other plans."""
    info = plan.levers.remat
    if info is None or not (info.recomputed_ops or info.scans):
        return graph
    return rematerialize(graph, info.layers, info.policy, info.scan_layers)


# The plan without recomputation that remat="auto" weighed the chosen one against: (fits the
# budget, its step time when it fits, its peak or the smallest peak found), or None when not planned.
Without = tuple[bool, float | None, int | None]


def record(plan: Plan, original: Graph, transformed: Graph, policy: str, without: Without | None = None) -> Plan:
    """`plan` (of `transformed`) with `levers.remat` (`summary`, and what it was weighed against)."""
    if transformed is original:
        return plan.with_levers(remat=RematRecord("off"))
    rec = summary(original, transformed, policy)
    if without is not None:
        rec = dataclasses.replace(rec, without_fits=without[0], without_step_time_s=without[1],
                                  without_memory_bytes=without[2])
    return plan.with_levers(remat=rec)


T = TypeVar("T")


# What a recomputable layer is, as the errors say it.
NO_LAYERS = ("recomputable layers are repeated modules named like blocks_0, blocks_1, ... outside loops, with a "
             "gradient, or a scanned stack whose backward scan reads the residuals its forward scan stacked")


def plan_remat(graph: Graph, remat: str, budget: float | None, plan_fn: Callable[[Graph, bool], T],
               plan_of: Callable[[T], Plan], scan_first: bool = True,
               threads: int | None = 1) -> tuple[Graph, T, str, Without | None]:
    """Plans `graph` with recomputation `remat` ("off", "full", "dots" or "auto").

    "auto": no recomputation when there is no budget, or when the plan without it meets the budget
    without a memory constraint (its unconstrained optimum fits: recomputation only adds work).
    Otherwise "off", "dots", "dots_no_batch" and "full" (every layer) are planned; when a policy fits
    but "off" does not, the fastest fitting one is applied to the first n layers (forward order) for
    the fewest n that fits, by bisection over n in [1, L]: the first layers' residuals live longest;
    Megatron-LM's `--recompute-method block --recompute-num-layers N` likewise recomputes the first N
    layers of each pipeline stage (NVIDIA/Megatron-LM, megatron/core/transformer/transformer_block.py,
    `_checkpointed_forward`: `if l < recompute_num_layers`). Bisection assumes "fits" is monotone
    in n (nearly so: the ILP may shard differently at each n): the n found fits (it was planned) and
    may be a layer or so over the fewest, for at most ceil(log2 L) extra plans of one policy
    (plan_fn(graph, False): no smallest-peak search). The result is the fastest (predicted step
    time) of what fits: "off", each policy on all L layers, the policy on its first n layers, and
    the bisection's other fitting probes, fewer layers first on a tie (fewer is usually faster, not
    always: the memory they keep can force more sharding). When "off" fits, no bisection runs; it
    stops at a probe proven unable to beat the fastest plan (`_fewest_layers`). Each plan tried logs
    one line (the `[planner ...]` lines of the CLI).

    Args:
      plan_fn: (graph, search) -> its plan (or a result holding it, `plan_of`); raises
        InfeasiblePlanError when nothing fits the budget, after a search for the smallest peak
        when `search` (False under "auto": the smallest peak of the fewest-bytes plan only, so
        that an infeasible "off" costs little before recomputation is tried).
      scan_first: whether a scanned stack's first n layers are bisected too (under "full" and
        `SCAN_GAIN`, see `_fewest_layers`); the accumulation lever's per-count searches do not.
      threads: under "auto", the threads the policies are probed on side by side (1: one after
        another; None: the idle cores; `_policies`); the plan chosen is the same.

    Returns:
      (the graph planned, plan_fn's result, the policy chosen: "off" or one of `POLICIES`, and under
      "auto" with recomputation chosen the plan without it (`Without`), else None); `summary` of the
      graph tells which layers it recomputes.

    Raises:
      InvalidArgumentError: an unknown option, or a policy for a step with no recomputable layer.
      InfeasiblePlanError: nothing fits; names the smallest peak found per policy tried.
    """
    check_option(remat)
    if remat in POLICIES:
        transformed = rematerialize(graph, None, remat)
        if transformed is graph:
            raise InvalidArgumentError(f"remat={remat!r}: this step has no layer to recompute ({NO_LAYERS})")
        return transformed, plan_fn(transformed, True), remat, None
    names = remat_layers(graph) if remat == "auto" and budget is not None else []
    if names or (remat == "auto" and budget is not None and recomputable_scans(graph)):
        return _plan_auto(graph, names, plan_fn, plan_of, scan_first, threads)
    try:
        return graph, plan_fn(graph, True), "off", None
    except InfeasiblePlanError as e:
        if remat != "auto" or budget is None:
            raise
        raise e.reworded(f"{e}; remat='auto' found no layer it can recompute in this step ({NO_LAYERS})") from None


def _plan_auto(graph: Graph, names: Sequence[str], plan_fn: Callable[[Graph, bool], T],
               plan_of: Callable[[T], Plan], scan_first: bool = True,
               threads: int | None = 1) -> tuple[Graph, T, str, Without | None]:
    """`plan_remat`'s "auto" with a budget and recomputable layers `names` (see there;
    `scan_first`: whether a scanned stack's first layers are bisected; `threads`: `_policies`')."""
    failed: dict[str, InfeasiblePlanError] = {}
    found: list[tuple[float, int, Graph, T, str]] = []  # (step time, layers recomputed, graph, result, policy)
    try:
        result = plan_fn(graph, False)
    except InfeasiblePlanError as e:
        failed["off"] = e
        without: Without = (False, None, e.min_memory_bytes)
        log.info("remat auto: off does not fit")
    else:
        plan = plan_of(result)
        if (plan.solver.rounds or 1) <= 1:  # the budget did not bind: recomputation only adds work
            return graph, result, "off", None
        without = (True, plan.prediction.step_time_s, plan.prediction.memory_bytes_per_device)
        found.append((plan.prediction.step_time_s, 0, graph, result, "off"))
        log.info("remat auto: off fits, %.4g s/step", plan.prediction.step_time_s)
    for policy, probe in _policies(graph, len(names), plan_fn, plan_of, found, threads):
        if isinstance(probe, InfeasiblePlanError):
            failed[policy] = probe
        else:
            found.append(probe)
    if found and "off" in failed:
        fastest = min(found, key=lambda x: x[:2])[4]
        beat = min(f[0] for f in found)
        if names:
            found.extend(_fewest_layers(len(names), lambda n: rematerialize(graph, names[:n], fastest), fastest,
                                        plan_fn, plan_of, beat))
        elif scan_first and fastest == "full" and split_length(graph):  # a scanned stack's first n layers
            total, best = split_length(graph), min(found, key=lambda x: x[:2])
            saving = recompute_time(best[2], plan_of(best[3]))
            found.extend(_fewest_layers(total, lambda n: rematerialize(graph, None, fastest, n), fastest, plan_fn,
                                        plan_of, beat, worth=lambda n: (total - n) / total * saving > SCAN_GAIN * beat))
    if found:
        _, _, g, result, policy = min(found, key=lambda x: x[:2])  # on a tie, fewer layers recomputed
        return g, result, policy, (None if g is graph else without)
    return *_fully_recomputed(graph, failed, plan_fn), without


def _policies(graph: Graph, n: int, plan_fn: Callable[..., T], plan_of: Callable[[T], Plan], found: list,
              threads: int | None) -> list[tuple[str, Any]]:
    """Each policy on all `n` layers probed (`_probe`) with the fastest fit known at its start to beat,
    in turn or side by side on `threads` threads (None: the idle cores; CP-SAT leaves the GIL as it
    solves): the same fastest plan (a bound stops only a solve that cannot give it)."""
    graphs = []
    for policy in ("dots", "dots_no_batch", "full"):
        transformed = rematerialize(graph, None, policy)
        if transformed is not graph:  # "dots" can leave a step unchanged that "full" rewrites
            graphs.append((policy, transformed))
    fastest = [f[0] for f in found]

    def probe(policy: str, transformed: Graph) -> tuple[str, Any]:
        got = _probe(transformed, policy, n, n, plan_fn, plan_of, min(fastest, default=math.inf))
        if not isinstance(got, InfeasiblePlanError):
            fastest.append(got[0])
        return policy, got

    workers = min(len(graphs), idle_cores() if threads is None else threads)
    if workers <= 1:
        return [probe(*g) for g in graphs]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda g: probe(*g), graphs))


def _fully_recomputed(graph: Graph, failed: dict[str, InfeasiblePlanError],
                      plan_fn: Callable[[Graph, bool], T]) -> tuple[Graph, T, str]:
    """When no policy tried fits: full recomputation planned with the smallest-peak search, or the
    error naming the smallest peaks found (`failed`: each policy tried's error)."""
    floors = [e.lower_bound_bytes for e in failed.values() if e.lower_bound_bytes is not None]
    off = failed["off"]
    # the smallest peak with full recomputation, now searched for (the attempts above did not)
    transformed = rematerialize(graph, None, "full")
    try:
        result = plan_fn(transformed, True)
    except InfeasiblePlanError as e:
        full = e
    else:
        return transformed, result, "full"
    text = (re.split(r"[.;] [Tt]ried:", str(full))[0] + " (with full recomputation"
            + (f"; without recomputation no plan goes below {format_bytes(off.lower_bound_bytes)}"
               if off.lower_bound_bytes is not None else "") + ")")
    best = full.min_memory_bytes
    levers = tuple(dataclasses.replace(v, state="tried") if v.name == "rematerialisation" else v
                   for v in (full.levers or LEVERS))
    raise InfeasiblePlanError(f"{text}. {levers_text(levers)}. {RAISE}",
                              best, min(floors) if floors else None, levers=levers)


def _probe(transformed: Graph, policy: str, n: int, total: int, plan_fn: Callable[..., T],
           plan_of: Callable[[T], Plan],
           beat: float = math.inf) -> tuple[float, int, Graph, T, str] | InfeasiblePlanError:
    """`transformed` (`policy` on the first `n` of `total` layers) planned without the smallest-peak
    search, logged: its `plan_remat` candidate, or the error when it does not fit (or, with a finite
    `beat`, when no plan of it fits and beats that step time)."""
    try:
        result = plan_fn(transformed, False) if math.isinf(beat) else plan_fn(transformed, False, beat)
    except InfeasiblePlanError as e:
        log.info("remat auto: %s on %s does not fit%s", policy, _which(n, total),
                 "" if math.isinf(beat) else f" or beat {beat:.4g} s/step")
        return e
    step = plan_of(result).prediction.step_time_s
    log.info("remat auto: %s on %s fits, %.4g s/step", policy, _which(n, total), step)
    return step, n, transformed, result, policy


def _which(n: int, total: int) -> str:
    """The layers a probe recomputes, as its log line names them."""
    return f"{n} of {total} layers" if total else "the scanned layers"


# A scanned stack's first n layers are recomputed under "full" only (`scan_remat.rewrite(first=)`):
# Megatron-LM likewise chooses layers (`--recompute-method block --recompute-num-layers N`) with
# `--recompute-granularity full` only; its selective recomputation (attention's core, "dots_no_batch"
# here) runs on every layer (Megatron-LM's recomputation arguments; NeMo's "Activation Recomputation"
# guide describes the same two modes).
# Each probe traces the rewritten step again, and where "dots" or "dots_no_batch" already fits the
# recomputed matmuls are few (Llama-2-7B b16 s4096: 0 and 4.5% of the step's matmul FLOPs, against
# 21% under "full"), while the bisection's probes near L, which nearly fit, take the longest to
# prove they cannot beat the fastest plan (`planner plan --model llama-7b --cluster 1x8:h100-sxm
# --batch 16 --seq 4096`: two bisections under "dots" / "dots_no_batch" took 52 -> 93 s, no faster
# plan).
# A probe of a scanned stack's first n layers is made only where the recomputation it drops, priced
# in the fastest plan found (`recompute_time`), could beat that plan by this fraction: the stage
# tables accept their layer plans this far from optimal (`stages.layer_cost.LAYER_GAP`), and the
# probes nearest L nearly fit and take longest to refute (Llama-2-70B b128 s4096 on 8x8 H100: "full"
# on 78 of 80 layers took 89 s to prove it cannot beat all 80, for at most 2/80 of their recomputation).
SCAN_GAIN = 0.02


def recompute_time(transformed: Graph, plan: Plan) -> float:
    """The recomputation's share of `plan`'s compute time (the plan of `transformed`), estimated by
    matmul FLOPs: those of the recomputed ops over all, ops inside a scan counted once per iteration."""
    weight = np.ones(len(transformed.ops))
    for regions in transformed.regions.values():
        for r in regions:
            if r.kind == "scan":
                weight[r.start:r.end] *= r.params["length"]
    flops = np.array([dot_flops(transformed, op) for op in transformed.ops]) * weight
    recomputed = np.array([is_recomputed(op.name_stack) or op.name_stack.startswith(f"{WRAPPER}(")
                           for op in transformed.ops], dtype=bool)
    total = float(flops.sum())
    return plan.prediction.compute_time_s * float(flops[recomputed].sum()) / total if total else 0.0


def _fewest_layers(total: int, make: Callable[[int], Graph], policy: str, plan_fn: Callable[[Graph, bool], T],
                   plan_of: Callable[[T], Plan], beat: float = math.inf,
                   worth: Callable[[int], bool] | None = None) -> list[tuple[float, int, Graph, T, str]]:
    """`policy` on the first n of `total` layers (`make(n)`: the step so rewritten; the unrolled
    layers' names, or the first iterations of a scanned stack) for the fewest n that fits, by
    bisection: none fits at 0 ("off" did not), all of them at `total` (planned already). Every plan the bisection found
    fitting, the one at that n last, as `plan_remat` candidates (all were planned anyway, and one
    with more layers can be faster: its unconstrained optimum may fit where the fewest layers
    need more sharding).

    Each probe is given the fastest step time found so far (`beat`, then the probes'), and the
    bisection ends at a probe whose every mesh is proven unable to beat it (`NotFasterError`):
    fewer recomputed layers hold more memory, and a budget that already makes this many layers
    slower than the fastest plan found binds harder below (GPT-39B b1024 on 8x8 V100, microbatches
    of 512 rows: all 48 layers 31.13 s, the first 47 38.3 s after a 114 s probe; 4 microbatches:
    16.53 s and 24.22 s at 45 after 104 s). A rule, not a proof: fewer layers also recompute less.
    `worth(n)`: whether n layers can save enough to be probed; a probe that cannot is taken as
    fitting with no gain (more layers save less still), and the bisection goes on below it only."""
    lo, hi, fitting = 0, total, []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if worth is not None and not worth(mid):
            log.info("remat auto: %s on %d of %d layers not probed: it cannot save enough to beat the fastest plan",
                     policy, mid, total)
            hi = mid
            continue
        fastest = min([beat] + [f[0] for f in fitting])
        probe = _probe(make(mid), policy, mid, total, plan_fn, plan_of, fastest)
        if isinstance(probe, NotFasterError):
            log.info("remat auto: fewer layers than %d not probed: %d no longer beat %.4g s/step", mid, mid, fastest)
            break
        if isinstance(probe, InfeasiblePlanError):
            lo = mid
        else:
            hi = mid
            fitting.append(probe)
    return fitting
