"""Named hand configurations, written as pins (`planner.configs.pins`) the way a JAX user writes them.

Mesh roles: every active mesh axis is a *data* axis for `dp`, `zero1`, `zero2` and `fsdp` (the
batch is split over all devices); `megatron-tp` and `megatron-tp-sp` use every active axis as one
tensor-parallel group; `dp-tp` splits the batch over all axes but the last and uses the last for
tensor parallelism (on 1x8 that is pure tensor parallelism, on 8x1 pure data parallelism).

Leaves are told apart by path: under a `params` key a parameter; a leaf whose path ends with a
parameter's key and has its shape (Adam's `mu`/`nu` under `opt_state`) its optimizer state;
other leaves of a state argument (step counters) stay replicated; the leaves of the other
arguments are the batch (dim 0 is the batch dimension, dim 1 the sequence of a token batch).

| baseline        | parameters                          | optimizer state            | batch              |
|-----------------|-------------------------------------|----------------------------|--------------------|
| dp              | replicated                          | replicated                 | dim 0 over all     |
| zero1           | replicated                          | largest divisible dim, all | dim 0 over all     |
| zero2           | as zero1 (see below)                | as zero1                   | dim 0 over all     |
| fsdp (ZeRO-3)   | largest divisible dim over all      | like its parameter         | dim 0 over all     |
| megatron-tp     | Megatron table below, all axes      | like its parameter         | replicated         |
| megatron-tp-sp  | as megatron-tp                      | like its parameter         | dim 1 over all     |
| dp-tp           | Megatron table on the last axis     | like its parameter         | dim 0 over the rest|

Megatron-LM's layout (Shoeybi et al. 2019, sec. 3), by parameter key glob -> the dim split
(counted from the end, so scanned layer stacks with a leading layer dim take the same rules):
attention q/k/v kernels `[embed, heads, kv]` and biases `[heads, kv]` split heads (column
parallel); the attention output kernel `[heads, kv, embed]` splits heads (row parallel); MLP input
kernels (`fc_in`, `gate`, `up`; `[embed, mlp]`) and their biases split mlp (column), MLP output
kernels (`fc_out`, `down`; `[mlp, embed]`) split mlp (row); the token embedding `[vocab, embed]`
and the LM head `[embed, vocab]` split the vocabulary. Everything else (norms, position table,
row-parallel biases) is replicated.

Pipeline baselines, `NAME+ppN` (`parse_baseline`; `planner.evaluate(..., baseline="megatron-tp+pp2")`):
the baseline inside each of N hand-chosen even pipeline stages, as Megatron-LM lays out TP x PP x
DP (`planner.stages.fixed_pipeline.fixed_pipeline`). A stage spanning several hosts is the mesh (hosts,
devices per host); there megatron-tp and megatron-tp-sp put tensor parallelism on the axis inside
a host and split the batch over the host axis (`host_axes`; with no such split left they keep
one tensor-parallel group over every axis, as above).

Where pins on arguments cannot say it, a baseline is approximated, and `APPROXIMATIONS` says how:
gradients and activations are not arguments, so zero2 (gradients reduce-scattered) has zero1's
argument layout and the planner chooses how gradients are reduced in both; megatron-tp-sp's
sequence-parallel norms/dropout are activations, so only its token batch arrives split along the
sequence and the planner chooses the norms' layout. A weight whose split dim the tensor-parallel
group does not divide (grouped-query k/v heads fewer than the group) stays replicated, as
Megatron replicates k/v heads then.
"""
from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from planner.core.errors import InvalidArgumentError
from planner.core.mesh import MeshSpec
from planner.configs.pins import exact_pattern, glob_escape, leaf_names, path_tokens, resolve, to_spec

Shape = tuple[int, ...]

# (parameter key glob, dim split counted from the end)
MEGATRON: tuple[tuple[str, int], ...] = (
    ("*query/kernel", -2), ("*key/kernel", -2), ("*value/kernel", -2),
    ("*query/bias", -2), ("*key/bias", -2), ("*value/bias", -2),
    ("*attn/out/kernel", -3),
    ("*fc_in/kernel", -1), ("*fc_in/bias", -1), ("*gate/kernel", -1), ("*up/kernel", -1),
    ("*fc_out/kernel", -2), ("*down/kernel", -2),
    ("*wte/embedding", -2), ("*embed/embedding", -2), ("*lm_head/kernel", -1),
)

NAMES = ("dp", "zero1", "zero2", "fsdp", "megatron-tp", "megatron-tp-sp", "dp-tp")

APPROXIMATIONS = {
    "zero2": "gradients are not arguments: same argument layout as zero1; the planner chooses how gradients "
             "are reduced",
    "megatron-tp-sp": "sequence-parallel norms/dropout are activations: only the token batch arrives split along "
                      "the sequence; the planner chooses the norms' layout",
}


def _axes(mesh: MeshSpec) -> tuple[str, ...]:
    return tuple(mesh.axis_names[a] for a, s in enumerate(mesh.shape) if s > 1)


def _split(shape: Shape, dim: int, axes: Sequence[str], mesh: MeshSpec) -> PartitionSpec:
    """`axes` on `dim` (negative: from the end) if they divide it, else replicated."""
    n = math.prod(mesh.shape[mesh.axis_names.index(a)] for a in axes)
    if not axes or not shape or not -len(shape) <= dim < len(shape) or shape[dim] % n:
        return PartitionSpec()
    spec: list = [None] * len(shape)
    spec[dim % len(shape)] = tuple(axes) if len(axes) > 1 else axes[0]
    return PartitionSpec(*spec)


def _merge(shape: Shape, specs) -> PartitionSpec:
    """The union of single-dim splits of one leaf (each from `_split`)."""
    merged: list = [None] * len(shape)
    for spec in specs:
        for d, entry in enumerate(spec):
            if entry is not None:
                merged[d] = entry
    return PartitionSpec(*merged) if any(e is not None for e in merged) else PartitionSpec()


def _largest(shape: Shape, axes: Sequence[str], mesh: MeshSpec) -> PartitionSpec:
    """ZeRO's split: the largest dim the axes divide (ties: the first), else replicated."""
    for d in sorted(range(len(shape)), key=lambda i: (-shape[i], i)):
        spec = _split(shape, d, axes, mesh)
        if tuple(spec):
            return spec
    return PartitionSpec()


def _megatron(key: str, shape: Shape, axes: Sequence[str], mesh: MeshSpec) -> PartitionSpec:
    for pattern, dim in MEGATRON:
        if fnmatch.fnmatchcase(key, pattern):
            return _split(shape, dim, axes, mesh)
    return PartitionSpec()


def _roles(paths: Sequence[str], shapes: Sequence[Shape]) -> list[tuple[str, str]]:
    """(role, parameter key) per leaf: role "param", "opt_state", "state" or "batch"."""
    tokens = [path_tokens(p) for p in paths]
    params = {}
    for tok, shape in zip(tokens, shapes):
        if "params" in tok:
            params[tok[tok.index("params") + 1:]] = tuple(shape)
    state_args = {tok[0] for tok in tokens if tok and ("params" in tok or "opt_state" in tok)}
    out = []
    for tok, shape in zip(tokens, shapes):
        if "params" in tok:
            out.append(("param", "/".join(tok[tok.index("params") + 1:])))
            continue
        mirror = next((tok[i:] for i in range(len(tok)) if params.get(tok[i:]) == tuple(shape)), None)
        if mirror is not None and shape:
            out.append(("opt_state", "/".join(mirror)))
        elif tok and tok[0] in state_args:
            out.append(("state", ""))
        else:
            out.append(("batch", ""))
    return out


def parse_baseline(text: str) -> tuple[str, int | None]:
    """`"megatron-tp+pp4"` -> `("megatron-tp", 4)`; a plain name -> `(name, None)`. `+pp1` is one
    stage run by the pipeline path: microbatches whose gradients accumulate and are reduced once
    per step, as Megatron-LM runs a configuration without pipeline parallelism.

    Raises:
      InvalidArgumentError: an unknown name or a stage count that is not an integer >= 1.
    """
    name, plus, pp = str(text).strip().partition("+")
    if name not in NAMES:
        raise InvalidArgumentError(f"unknown baseline {name!r}; known: {', '.join(NAMES)}, each optionally +ppN "
                                   "(N even pipeline stages, e.g. megatron-tp+pp4)")
    if not plus:
        return name, None
    m = re.fullmatch(r"pp(\d+)", pp.strip())
    if not m or int(m.group(1)) < 1:
        raise InvalidArgumentError(f"baseline {text!r}: write the pipeline part as +ppN with N >= 1 stages, "
                                   f"e.g. {name}+pp2")
    return name, int(m.group(1))


def _roles_axes(name: str, mesh: MeshSpec, host_axes: Sequence[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(data axes, tensor-parallel axes) of the baseline on `mesh` (see the module docstring)."""
    every = _axes(mesh)
    if name == "dp-tp":
        return every[:-1], every[-1:]
    hosts = tuple(mesh.axis_names[a] for a in host_axes if mesh.shape[a] > 1)
    inside = tuple(a for a in every if a not in hosts)
    if name in ("megatron-tp", "megatron-tp-sp") and hosts and inside:
        return hosts, inside  # Megatron-LM: tensor parallel inside a host, data parallel across hosts
    return every, every


def batch_ways(name: str, mesh: MeshSpec, host_axes: Sequence[int] = ()) -> int:
    """How many ways the baseline splits the batch dimension (dim 0) of the token batch."""
    name = parse_baseline(name)[0]
    data, _ = _roles_axes(name, mesh, host_axes)
    if name in ("megatron-tp", "megatron-tp-sp") and data == _axes(mesh):
        return 1
    return math.prod(mesh.shape[mesh.axis_names.index(a)] for a in data)


def check_name(name: str) -> None:
    """Raises `InvalidArgumentError` (one line, naming the known ones) unless `name` is a baseline."""
    if name not in NAMES:
        raise InvalidArgumentError(f"unknown baseline {name!r}; known: {', '.join(NAMES)}")


def baseline_specs(name: str, paths: Sequence[str], shapes: Sequence[Shape], mesh: MeshSpec,
                   host_axes: Sequence[int] = (), roles: Sequence[tuple[str, str]] | None = None) -> list[PartitionSpec]:
    """The baseline's PartitionSpec of every argument leaf (see the module docstring).

    `host_axes` (mesh axis indices crossing hosts) matter to megatron-tp(-sp) only: given, and with
    axes inside a host left, tensor parallelism takes the axes inside a host and the batch is split
    over the host axes, as Megatron-LM lays out TP x DP (a pipeline stage over several hosts).

    `roles`: `_roles(paths, shapes)` when the caller has it.

    Raises:
      InvalidArgumentError: an unknown baseline name.
    """
    check_name(name)
    every = _axes(mesh)
    data, model = _roles_axes(name, mesh, host_axes)
    megatron_dp = name in ("megatron-tp", "megatron-tp-sp") and data != every
    out = []
    for (role, key), shape in zip(_roles(paths, shapes) if roles is None else roles, shapes):
        shape = tuple(shape)
        if role == "batch":
            if megatron_dp:
                dims = {0: _split(shape, 0, data, mesh)}
                if name == "megatron-tp-sp" and len(shape) >= 2:
                    dims[1] = _split(shape, 1, model, mesh)
                out.append(_merge(shape, dims.values()))
            elif name in ("megatron-tp",):
                out.append(PartitionSpec())
            elif name == "megatron-tp-sp":
                out.append(_split(shape, 1, model, mesh) if len(shape) >= 2 else PartitionSpec())
            else:
                out.append(_split(shape, 0, data, mesh))
        elif role == "state":
            out.append(PartitionSpec())
        elif name == "dp":
            out.append(PartitionSpec())
        elif name in ("zero1", "zero2"):
            out.append(_largest(shape, every, mesh) if role == "opt_state" else PartitionSpec())
        elif name == "fsdp":
            out.append(_largest(shape, every, mesh))
        else:
            out.append(_megatron(key, shape, model, mesh))
    return out


def baseline_pins(name: str, host_axes: Sequence[int] = ()) -> Callable[[Sequence[str], Sequence[Shape], MeshSpec],
                                                                        dict[str, PartitionSpec]]:
    """Pins of the named baseline, as a function of the arguments' leaves and the mesh: one exact
    path pattern per leaf (for `plan_parallel(pins=...)` / `evaluate`).

    Raises:
      InvalidArgumentError: an unknown baseline name.
    """
    check_name(name)

    def pins(paths: Sequence[str], shapes: Sequence[Shape], mesh: MeshSpec) -> dict[str, PartitionSpec]:
        specs = baseline_specs(name, paths, shapes, mesh, host_axes)
        return {exact_pattern(p): s for p, s in zip(paths, specs)}

    pins.__name__ = f"baseline_{name}"
    return pins


def _stage_pins(name: str, graph: Any, lm: Any, param_split: bool) -> dict[int, Any]:
    """{program input tensor id: Spec} of the baseline on a stage's logical mesh, every argument leaf
    pinned; {} when `param_split` and the baseline splits no parameter there."""
    paths, shapes, roles, suffix_free, patterns = _leaves(graph)
    specs = baseline_specs(name, paths, shapes, lm.mesh, lm.host_axes, roles)
    if param_split and not any(role == "param" and tuple(spec) for (role, _), spec in zip(roles, specs)):
        return {}
    if suffix_free:  # each leaf's first matching pattern is its own exact one: no matching needed
        return {t: to_spec(spec, shape, lm.mesh, path, pattern)
                for t, path, pattern, shape, spec in zip(graph.inputs, paths, patterns, shapes, specs)}
    resolved = resolve({exact_pattern(p): s for p, s in zip(paths, specs)}, paths, shapes, lm.mesh, complete=True)
    return {graph.inputs[i]: spec for i, spec in resolved.items()}


def _leaves(graph: Any) -> tuple:
    """What the baselines read of `graph`'s argument leaves whatever the mesh, once per graph (the
    pipeline search pins every layout on every logical mesh): paths, shapes, roles (`_roles`),
    whether the leaves' indexed names are suffix-free (`_suffix_free`) and their exact patterns."""
    def make() -> tuple:
        paths = graph.input_paths
        shapes = [tuple(graph.tensors[t].shape) for t in graph.inputs]
        names = [(leaf_names(p) or (p,))[0] for p in paths]
        return paths, shapes, _roles(paths, shapes), _suffix_free(names), [glob_escape(n) for n in names]
    return graph.cached(("baseline_leaves",), make)


def _suffix_free(names: Sequence[str]) -> bool:
    """Whether no leaf's indexed name ends with `/` + another's: then a leaf's exact pattern
    (`exact_pattern`) matches that leaf only, and `resolve` of the exact patterns in leaf order pins
    every leaf by its own (the planning of every pipeline stage's variants makes these pins on every
    mesh: matching 2k patterns against 2k leaves each time was most of it)."""
    known = set(names)
    return len(known) == len(names) and not any(
        "/".join(parts[j:]) in known for n in names for parts in (n.split("/"),) for j in range(1, len(parts)))


def stage_baseline_pins(name: str) -> Callable[[Any, Any], dict[int, Any]]:
    """The baseline's pins on a pipeline stage's logical mesh (`planner.stages.submesh.LogicalMesh`),
    as `(graph, logical mesh) -> {program input tensor id: Spec}`, every argument leaf pinned
    (`fixed_pipeline.fixed_pipeline`'s `pins`). megatron-tp(-sp) take the mesh's host axes as Megatron
    does (`baseline_specs`).

    Raises:
      InvalidArgumentError: an unknown baseline name.
    """
    check_name(name)
    return lambda graph, lm: _stage_pins(name, graph, lm, False)


def replica_ways(name: str, graph: Any, lm: Any) -> int:
    """How many data-parallel replicas of a pipeline stage on the logical mesh `lm` accumulate their
    own gradients, so that the pipeline runtime traces the step on one replica's share of a
    microbatch (`planner.emit.pipeline.stage_records.set_replicas`): `batch_ways`, or 1 where the
    baseline splits a parameter of `graph`'s inputs over a data axis (fsdp), as the runtime then
    reduces gradients in every microbatch's backward instead."""
    ways = batch_ways(name, lm.mesh, lm.host_axes)
    if ways <= 1:
        return ways
    data = {lm.mesh.axis_names.index(a) for a in _roles_axes(name, lm.mesh, lm.host_axes)[0]}
    pins = _stage_pins(name, graph, lm, False)
    roles = _leaves(graph)[2]
    if any(role == "param" and any(data & set(dims) for dims in pins.get(t, ()))
           for (role, _), t in zip(roles, graph.inputs)):
        return 1
    return ways


def layer_variant_pins(name: str) -> Callable[[Any, Any], dict[int, Any]]:
    """`stage_baseline_pins(name)` as a per-layer plan variant of the pipeline's cost tables
    (`planner.stages.cost_table.LayerCostTable.variants`): empty (no variant) on a mesh where the
    baseline splits no parameter, since then it is no hand layout of the model's weights (a model
    whose parameter keys Megatron's table does not name, or a mesh it cannot divide).

    Raises:
      InvalidArgumentError: an unknown baseline name.
    """
    check_name(name)
    return lambda graph, lm: _stage_pins(name, graph, lm, True)
