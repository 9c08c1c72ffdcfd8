"""Pins: shardings a user fixes for some arguments; the planner plans everything else around them.

A pin is `pattern -> PartitionSpec` (or the spec as plan tables print it, `"P((x,y), None)"`).

Patterns are globs (`fnmatch`: `*` matches any run of characters, `/` included; `?` one
character; `[...]` a set) over an argument leaf's path written as the plan tables write it:
pytree keys joined by `/`. A leaf answers to three names, and a pattern matches the leaf when it
matches one of them whole or one of their `/`-separated suffixes:

- with the argument index: `0/params/wte/embedding`, `0/opt_state/0/mu/wte/embedding`, `1/inputs`;
- without it: `params/wte/embedding`, `opt_state/0/mu/wte/embedding`, `inputs`;
- without any numeric key (the tables' display form): `opt_state/mu/wte/embedding`.

So `wte/embedding` pins the parameter and the optimizer moments that mirror it,
`params/wte/embedding` the parameter alone, `blocks_*/mlp/fc_in/kernel` that kernel in every layer,
`blocks_0/mlp/fc_in/kernel` in the first layer only, and `1/*` every leaf of the second argument.
The first pattern (in the mapping's order) that matches a leaf decides its spec. A PartitionSpec
shorter than the leaf's rank is padded with `None`, as JAX pads it.

Errors are one line and name the path, the spec and the shape: a pattern that matches no leaf, a
spec naming an axis the mesh lacks or using one twice, a spec longer than the rank, a split that
does not divide its dimension.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from planner.core.compat import PLANNER_CONSTRAINT
from planner.core.errors import InvalidArgumentError
from planner.core.mesh import MeshSpec
from planner.core.sharding import Spec

Shape = tuple[int, ...]
Pins = Mapping[str, Any]

_TOKEN = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)")
_SPEC_TEXT = re.compile(r"^\s*(?:P|PartitionSpec)\s*\((.*)\)\s*$", re.DOTALL)


def path_tokens(path: str, keep_value: bool = False) -> tuple[str, ...]:
    """`"[0]['params']['wte']['embedding']"` (a `jax.tree_util.keystr`) -> `("0", "params", "wte",
    "embedding")`; an nnx Variable's trailing `.value` is dropped unless `keep_value` (the plan
    tables' path columns keep it)."""
    tokens = tuple(next(g for g in m.groups() if g is not None) for m in _TOKEN.finditer(path))
    return tokens[:-1] if path.endswith(".value") and tokens and not keep_value else tokens


def leaf_names(path: str) -> tuple[str, ...]:
    """The names a pin pattern is matched against (see the module docstring)."""
    tokens = path_tokens(path)
    names = ["/".join(tokens), "/".join(tokens[1:]), "/".join(t for t in tokens[1:] if not t.isdigit())]
    return tuple(dict.fromkeys(n for n in names if n))


def display_path(path: str) -> str:
    """The leaf's path without its argument index, as error messages and tables show it."""
    names = leaf_names(path)
    return names[1] if len(names) > 1 else names[0] if names else path


def matches(pattern: str, path: str) -> bool:
    """Whether glob `pattern` matches one of the leaf's names whole or at a `/` boundary."""
    return _matches_names(pattern.strip().strip("/"), leaf_names(path))


def _matches_names(pattern: str, names: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, "*/" + pattern) for n in names)


_ESCAPED = re.compile(r"\[([*?[])\]")  # what `exact_pattern` escapes


def _literal(pattern: str) -> str | None:
    """The one text glob `pattern` matches (`[*]`-style escapes read as their character), or None
    when it has wildcards or character classes."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] in "*?":
            return None
        if pattern[i] == "[":
            m = _ESCAPED.match(pattern, i)
            if not m:
                return None
            out.append(m.group(1))
            i = m.end()
            continue
        out.append(pattern[i])
        i += 1
    return "".join(out)


def _first_match(globs: Sequence[tuple[int, str]], literal: Mapping[str, int], names: Sequence[str]) -> int | None:
    """Index of the first pattern matching a leaf with these `leaf_names`, as `matches` decides it:
    the wildcard-free patterns by lookup (`literal`: their text -> first index; a name matches at a
    `/` boundary, so every `/`-suffix of a name is looked up), the others (`globs`: (index, stripped
    pattern) in order) by glob."""
    best = min((literal[s] for n in names for parts in (n.split("/"),) for j in range(len(parts))
                for s in ("/".join(parts[j:]),) if s in literal), default=None)
    for k, pattern in globs:
        if best is not None and k >= best:
            break
        if _matches_names(pattern, names):
            return k
    return best


def exact_pattern(path: str) -> str:
    """A pattern matching exactly this leaf (its indexed name, glob characters escaped)."""
    return glob_escape(leaf_names(path)[0])


def glob_escape(text: str) -> str:
    """`text` as a glob pattern matching only itself (`*`, `?` and `[` escaped as `[*]` ...)."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def parse_spec_text(text: str) -> PartitionSpec:
    """`"P((x,y), None)"` (as plan tables print specs; quotes optional) -> `PartitionSpec(('x','y'), None)`.

    Raises:
      InvalidArgumentError: text that is not of that form.
    """
    m = _SPEC_TEXT.match(text)
    if not m:
        raise InvalidArgumentError(f"spec {text!r} is not of the form P(x, None, (x,y))")
    body = m.group(1).strip()
    items, depth, cur = [], 0, ""
    for ch in body:
        depth += (ch == "(") - (ch == ")")
        if depth < 0 or depth > 1:
            raise InvalidArgumentError(f"spec {text!r} is not of the form P(x, None, (x,y))")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise InvalidArgumentError(f"spec {text!r} is not of the form P(x, None, (x,y))")
    if cur.strip() or items:
        items.append(cur)
    if len(items) > 1 and not items[-1].strip():  # a trailing comma, as in P('x',)
        items.pop()
    parts: list[Any] = []
    for item in (i.strip() for i in items):
        if item.startswith("(") and item.endswith(")"):
            names = tuple(n.strip().strip("'\"") for n in item[1:-1].split(",") if n.strip())
            parts.append(names if names else None)
        elif item == "None":
            parts.append(None)
        elif re.fullmatch(r"['\"]?\w+['\"]?", item):
            parts.append(item.strip("'\""))
        else:
            raise InvalidArgumentError(f"spec {text!r} is not of the form P(x, None, (x,y))")
    return PartitionSpec(*parts)


def as_partition_spec(value: Any, mesh: MeshSpec, where: str) -> PartitionSpec:
    """A pin's value as a PartitionSpec: a PartitionSpec, a NamedSharding on the same axes, or text."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, NamedSharding):
        if tuple(value.mesh.axis_names) != tuple(mesh.axis_names):
            raise InvalidArgumentError(f"{where}: sharding on mesh axes {tuple(value.mesh.axis_names)} but the plan's "
                                       f"mesh has axes {mesh.axis_names}")
        return value.spec
    if isinstance(value, str):
        return parse_spec_text(value)
    if value is None:
        return PartitionSpec()
    raise InvalidArgumentError(f"{where}: {value!r} is not a PartitionSpec, NamedSharding or 'P(...)' text")


def _spec_text(pspec: PartitionSpec) -> str:
    parts = []
    for p in pspec:
        if p is None:
            parts.append("None")
        elif isinstance(p, (tuple, list)):
            parts.append("(" + ",".join(str(a) for a in p) + ")" if len(p) != 1 else str(p[0]))
        else:
            parts.append(str(p))
    return "P(" + ", ".join(parts) + ")"


def to_spec(pspec: PartitionSpec, shape: Shape, mesh: MeshSpec, path: str, pattern: str | None = None) -> Spec:
    """The planner's Spec of `pspec` for a leaf of `shape` on `mesh` (size-1 axes dropped: they
    split nothing).

    Raises:
      InvalidArgumentError: one line naming the path, the spec and the shape.
    """
    def where() -> str:  # named in the error only (every pipeline stage's pins come through here)
        who = f"pin {pattern!r} on {display_path(path)}" if pattern is not None else display_path(path)
        return f"{who} (shape {tuple(shape)}): spec {_spec_text(pspec)}"

    entries = tuple(pspec)
    if len(entries) > len(shape):
        raise InvalidArgumentError(f"{where()} has {len(entries)} entries but the leaf has rank {len(shape)}")
    entries = entries + (None,) * (len(shape) - len(entries))
    out: list[tuple[int, ...]] = []
    seen: set[str] = set()
    for d, entry in enumerate(entries):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = []
        for n in names:
            if n not in mesh.axis_names:
                raise InvalidArgumentError(f"{where()} names mesh axis {n!r}, but the mesh has axes {mesh.axis_names}")
            if n in seen:
                raise InvalidArgumentError(f"{where()} uses mesh axis {n!r} twice")
            seen.add(n)
            axes.append(mesh.axis_names.index(n))
        if shape[d] % mesh.axis_size(axes):
            raise InvalidArgumentError(f"{where()} splits dim {d} of size {shape[d]} over {mesh.axis_size(axes)} devices, "
                                       f"which does not divide it")
        active = tuple(a for a in axes if mesh.shape[a] > 1)
        if list(active) != sorted(active):
            raise InvalidArgumentError(f"{where()} orders mesh axes on dim {d} against the mesh's order "
                                       f"{mesh.axis_names}; list them major to minor")
        out.append(active)
    return tuple(out)


def first_matches(patterns: Sequence[str], paths: Sequence[str]) -> list[int | None]:
    """Per path, the index of the first of `patterns` that `matches` it (None: none does), without
    globbing every pattern against every path: wildcard-free patterns are looked up."""
    stripped = [str(p).strip().strip("/") for p in patterns]
    literal: dict[str, int] = {}
    globs = []
    for k, pattern in enumerate(stripped):
        text = _literal(pattern)
        if text is None:
            globs.append((k, pattern))
        else:
            literal.setdefault(text, k)
    return [_first_match(globs, literal, leaf_names(path)) for path in paths]


def resolve(pins: Pins | None, paths: Sequence[str], shapes: Sequence[Shape], mesh: MeshSpec,
            complete: bool = False) -> dict[int, Spec]:
    """Argument position -> pinned Spec for every leaf some pattern matches (first match wins).

    Args:
      pins: pattern -> spec, in priority order.
      paths: the arguments' leaf paths (`Graph.input_paths`).
      shapes: their shapes.
      mesh: the logical mesh.
      complete: pin the leaves no pattern matches replicated (a configuration given in full, as
        `evaluate` takes it).

    Raises:
      InvalidArgumentError: a pattern matching nothing, or a spec the leaf or the mesh cannot take.
    """
    if pins is None:
        pins = {}
    if not isinstance(pins, Mapping):
        raise InvalidArgumentError(f"pins must map path patterns to PartitionSpecs, got {type(pins).__name__}")
    items = [(str(p), as_partition_spec(v, mesh, f"pin {p!r}")) for p, v in pins.items()]
    out: dict[int, Spec] = {}
    used = set()
    for i, (path, shape, k) in enumerate(zip(paths, shapes, first_matches([p for p, _ in items], paths))):
        if k is not None:
            pattern, pspec = items[k]
            used.add(k)
            out[i] = to_spec(pspec, tuple(shape), mesh, path, pattern)
        elif complete:
            out[i] = ((),) * len(shape)
    for k, (pattern, _) in enumerate(items):
        if k not in used and not any(matches(pattern, p) for p in paths):
            examples = ", ".join(display_path(p) for p in paths[:3])
            raise InvalidArgumentError(f"pin {pattern!r} matches no argument path (paths look like {examples}) "
                                       "nor checkpoint_name intermediate")
    return out


def check_patterns(pins: Pins, paths: Sequence[str]) -> None:
    """Every pattern of `pins` matches some leaf, else the one-line error `resolve` gives."""
    if not isinstance(pins, Mapping):
        raise InvalidArgumentError(f"pins must map path patterns to PartitionSpecs, got {type(pins).__name__}")
    for pattern in pins:
        if not any(matches(str(pattern), p) for p in paths):
            examples = ", ".join(display_path(p) for p in paths[:3])
            raise InvalidArgumentError(f"pin {str(pattern)!r} matches no argument path (paths look like {examples})")


STAGE_AXES = ("x", "y")


def check_stage_pins(pins: Pins, paths: Sequence[str]) -> None:
    """Pins for pipeline stages: every pattern matches a leaf and every spec names only the stage
    meshes' axes (`STAGE_AXES`), else a one-line error."""
    check_patterns(pins, paths)
    stage_mesh = MeshSpec((2, 2), STAGE_AXES)
    for pattern, value in pins.items():
        pspec = as_partition_spec(value, stage_mesh, f"pin {pattern!r}") if not isinstance(value, NamedSharding) \
            else value.spec
        for entry in pspec:
            for name in () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry):
                if name not in STAGE_AXES:
                    raise InvalidArgumentError(
                        f"pin {str(pattern)!r} names mesh axis {name!r}; with pipeline stages pins name the stage "
                        f"meshes' axes {', '.join(STAGE_AXES)} (x across hosts when a stage spans hosts)")


def stage_pins(pins: Any) -> Any:
    """Pins as the pipeline planner applies them: a function `(graph, logical_mesh) -> {program
    input tensor id: Spec}` for each stage's logical mesh (`planner.stages.submesh.LogicalMesh`:
    axes `x`, `y`; `x` crosses hosts when the stage spans hosts). `pins` is a mapping or a
    function `(paths, shapes, mesh) -> mapping` (a baseline's). A pin the mesh cannot take (an axis
    it lacks, a split that does not divide) maps to its one-line `InvalidArgumentError`: the layers
    reading that leaf are then not planned on that mesh."""
    def on(graph: Any, lmesh: Any) -> dict[int, Any]:
        shapes = [tuple(graph.tensors[t].shape) for t in graph.inputs]
        mapping = pins(graph.input_paths, shapes, lmesh.mesh) if callable(pins) else pins
        items = [(str(p), v) for p, v in mapping.items()]
        out: dict[int, Any] = {}
        for t, path, shape in zip(graph.inputs, graph.input_paths, shapes):
            for pattern, value in items:
                if matches(pattern, path):
                    try:
                        out[t] = to_spec(as_partition_spec(value, lmesh.mesh, f"pin {pattern!r}"), shape, lmesh.mesh,
                                         path, pattern)
                    except InvalidArgumentError as e:
                        out[t] = e
                    break
        return out

    return on


# ----- pins on named intermediates ---------------------------------------------------------------
# A pinned intermediate becomes the op the planner already honours as a pin: a sharding constraint
# (`compat.PLANNER_CONSTRAINT`; evaluated as identity, the plan's own constraint places the value).


def intermediate_name(op: Any) -> str | None:
    """The name a pin pattern matches for a `checkpoint_name` value (`jax.ad_checkpoint.checkpoint_name`):
    its module path without the `jvp(...)` / `transpose(...)` wrappers, then the name, e.g.
    `GPT/blocks_0/attn/attn_out`; None for other ops."""
    if op.name == "name":
        name = op.params.get("name")
    elif op.name == "sharding_constraint" and "checkpoint_name" in op.params:
        name = op.params["checkpoint_name"]
    else:
        return None
    stack = op.name_stack.replace("transpose(", "").replace("jvp(", "").replace(")", "")
    return "/".join(t for t in (*stack.split("/"), str(name)) if t)


def _matches_name(pattern: str, name: str) -> bool:
    pattern = pattern.strip().strip("/")
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*/" + pattern)


def intermediate_patterns(pins: Pins, graph: Any) -> set[str]:
    """Patterns of `pins` that match no argument path of `graph` but a named intermediate."""
    names = [n for n in map(intermediate_name, graph.ops) if n is not None]
    return {str(p) for p in pins
            if not any(matches(str(p), path) for path in graph.input_paths)
            and any(_matches_name(str(p), n) for n in names)}


def pin_intermediates(graph: Any, pins: Pins, mesh: MeshSpec) -> Any:
    """`graph` with each named intermediate a pattern of `pins` matches (and no argument path does)
    pinned: its `checkpoint_name` op becomes a sharding constraint to the pin's spec, which the ILP
    keeps (the operand resharded into it, its cost charged). First matching pattern wins.

    Raises:
      InvalidArgumentError: a spec the value or the mesh cannot take (one line naming both).
    """
    patterns = [p for p in pins if str(p) in intermediate_patterns(pins, graph)]
    if not patterns:
        return graph
    abstract = AbstractMesh(tuple(mesh.shape), tuple(mesh.axis_names))
    ops = list(graph.ops)
    for k, op in enumerate(ops):
        name = intermediate_name(op)
        pattern = next((p for p in patterns if name is not None and _matches_name(str(p), name)), None)
        if pattern is None:
            continue
        shape = tuple(graph.tensors[op.outputs[0]].shape)
        pspec = as_partition_spec(pins[pattern], mesh, f"pin {str(pattern)!r}")
        to_spec(pspec, shape, mesh, name, str(pattern))  # checked here: one line naming the value
        ops[k] = dataclasses.replace(op, primitive=PLANNER_CONSTRAINT, params={
            "sharding": NamedSharding(abstract, pspec), "checkpoint_name": op.params.get("name",
                                                                                          op.params.get("checkpoint_name"))})
    return dataclasses.replace(graph, ops=tuple(ops))


# ----- logical-axis rules in (MaxText / t5x form) -----------------------------------------------
Rules = Sequence[tuple[str, Any]]
LogicalNames = tuple[Any, ...]


def parse_rules(rules: Any, mesh: MeshSpec) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`[('batch', 'data'), ('embed', ('x', 'y')), ('mlp', None)]` (t5x) or MaxText's
    `[['batch', ['data']], ...]` -> ((logical name, mesh axes), ...) in priority order.

    Raises:
      InvalidArgumentError: a malformed rule or a mesh axis the mesh lacks.
    """
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    if not isinstance(rules, (list, tuple)):
        raise InvalidArgumentError(f"rules must be a list of (logical name, mesh axes) pairs, got {type(rules).__name__}")
    out = []
    for rule in rules:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise InvalidArgumentError(f"rule {rule!r} is not a (logical name, mesh axes) pair")
        name, axes = rule
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in mesh.axis_names:
                raise InvalidArgumentError(f"rule {rule!r} names mesh axis {a!r}, but the mesh has axes {mesh.axis_names}")
        out.append((name, axes))
    return tuple(out)


def logical_to_spec(names: LogicalNames, rules: Sequence[tuple[str, tuple[str, ...]]]) -> PartitionSpec:
    """flax's `logical_to_mesh_axes`: per dimension the first rule of its logical name whose mesh
    axes no earlier dimension took; a name without such a rule (or None) leaves the dim unsplit."""
    used: set[str] = set()
    parts: list[Any] = []
    for n in names:
        chosen: Any = None
        if n is not None:
            for name, axes in rules:
                if name == n and not used & set(axes):
                    chosen = axes
                    break
        if chosen:
            used.update(chosen)
            parts.append(chosen[0] if len(chosen) == 1 else tuple(chosen))
        else:
            parts.append(None)
    return PartitionSpec(*parts)


def _nnx_sharding_names(x: Any) -> LogicalNames | None:
    """The logical names of an nnx Variable (`nnx.with_partitioning` puts them in its metadata as
    `out_sharding`; older flax names it `sharding_names` or `sharding`); () for a Variable without them (what
    `nnx.get_partition_spec` gives it: P()); None for anything that is not an nnx Variable."""
    get = getattr(x, "get_metadata", None)
    if get is None or not hasattr(x, "get_value"):
        return None
    meta = get()
    names = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k) is not None), ())
    return tuple(names) if isinstance(names, (tuple, list, PartitionSpec)) else None


def logical_names(tree: Any) -> dict[str, LogicalNames]:
    """Logical names per leaf path of flax metadata: linen `nn.LogicallyPartitioned` boxes (their
    `.names`), nnx Variables annotated by `nnx.with_partitioning` (an `nnx.State` as `nnx.split`
    returns it), or a tree of logical PartitionSpecs as `nn.get_partition_spec` /
    `nnx.get_partition_spec` return. Paths are `jax.tree_util.keystr` of the tree (a box's or a
    Variable's `.value` suffix is what pin matching drops anyway)."""
    import jax

    def is_named(x):
        return (isinstance(x, PartitionSpec) or (hasattr(x, "names") and hasattr(x, "unbox"))
                or _nnx_sharding_names(x) is not None)

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named)[0]:
        if isinstance(leaf, PartitionSpec):
            out[jax.tree_util.keystr(path)] = tuple(leaf)
        elif _nnx_sharding_names(leaf) is not None:
            out[jax.tree_util.keystr(path)] = _nnx_sharding_names(leaf)
        elif is_named(leaf):
            out[jax.tree_util.keystr(path)] = tuple(leaf.names)
    return out


def rules_to_pins(rules: Any, named: Mapping[str, LogicalNames], mesh: MeshSpec) -> dict[str, PartitionSpec]:
    """Pins (one exact pattern per annotated leaf) from logical-axis rules and per-leaf logical names.

    Raises:
      InvalidArgumentError: a rule whose logical name no leaf uses (one line, naming the names in use).
    """
    parsed = parse_rules(rules, mesh)
    in_use = {n for names in named.values() for n in names if n is not None}
    for name, _ in parsed:
        if name not in in_use:
            raise InvalidArgumentError(f"rule for logical axis {name!r}: the model uses no such axis "
                                       f"(its axes: {', '.join(sorted(in_use)) or 'none annotated'})")
    return {exact_pattern(path): logical_to_spec(names, parsed) for path, names in named.items()}
