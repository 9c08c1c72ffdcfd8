"""A plan in the vocabulary of MaxText / t5x: logical axis names per dimension, and rules to mesh axes.

Users of those frameworks annotate every parameter dimension with a *logical* name (`embed`, `mlp`,
`heads`, ...) and map names to mesh axes with rules such as `[('batch', 'data'), ('mlp', 'model')]`.
The planner works on raw PartitionSpecs; this module translates back.

How logical names are inferred (no annotations are needed, only pytree paths and shapes):

- Leaves are parameters when their path contains a `params` key; optimizer state leaves (under
  `opt_state`, e.g. Adam's `mu` / `nu`) mirror a parameter when their path ends with that
  parameter's path and the shapes agree; the leaves of the other arguments are data (below).
- `embed` (the model width) is the most common size of the norm scales (`scale` leaves of modules
  named `ln*` / `bn*` / `*norm*`); a model without norms takes the input width of its first kernel.
  Kernels are leaves named `kernel` (flax) or `w` (haiku); nnx `.value` suffixes are ignored.
- Module names decide first: an `embedding` table is `[vocab, embed]`, or `[length, embed]` when
  its module is a position table (`wpe`, `pos*`, `position*`); a kernel of a module named like an
  output head (`lm_head`, `head`, `logits`, `unembed`) is `[embed, vocab]`.
- Mixture-of-experts weights (under a module named `moe*` / `*expert*`): `[exp, embed, mlp]`,
  `[exp, mlp, embed]`, and the router `[embed, exp]`. Scanned layer stacks (leaves under a `layers` /
  `blocks` / `scan`... key that share a leading dimension) get `layers` for that dimension.
- Then shapes: a 2-D kernel is `[embed, mlp]` or `[mlp, embed]` by which side equals `embed`; a 3-D
  kernel is `[embed, heads, kv]` (attention q/k/v projections, flax `DenseGeneral`) or
  `[heads, kv, embed]` (the output projection); a 2-D bias is `[heads, kv]`; a 1-D bias takes the
  name of its size (`embed`, else `mlp`, or `vocab` for a head); a norm parameter is `embed` or
  unnamed.
- Data (arguments holding no parameters or optimizer state): the first dimension is `batch`; the
  second is `length` for integer tokens [B, S] and activations [B, S, E]; a last dimension equal to
  `embed` is `embed`. Leaves beside the parameters that mirror none (batch statistics, step
  counters) are model state and get no names.
- Dimensions matching none of these get no name (`None`) and never enter the rules.

Rules are read off the plan by a byte-weighted vote: for each logical name, the mesh axes that split
the dimensions carrying that name, weighted by the bytes of those tensors. Leaves whose planned spec
the rules do not reproduce are listed as exceptions (paste them as explicit overrides).
"""
from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from planner.configs.pins import path_tokens, rules_to_pins
from planner.core.errors import InvalidArgumentError

Shape = tuple[int, ...]
Axes = tuple[str, ...]  # mesh axis names splitting one dimension, major to minor; () = not split
LogicalNames = tuple[str | None, ...]

LOGICAL_ORDER = ("batch", "length", "vocab", "embed", "mlp", "heads", "kv", "exp", "layers")

_NORM = re.compile(r"norm|^ln(_|\d|$)|^bn(_|\d|$)", re.IGNORECASE)
_STACKED = re.compile(r"^(layers|blocks|layer|block|stack|stacked|scan|scanned|scanned_layers|repeat)$", re.IGNORECASE)
_KERNEL = ("kernel", "w")
_EXPERTS = re.compile(r"moe|expert", re.IGNORECASE)
_BIAS = ("bias", "b")
_POSITION = re.compile(r"^(wpe|pos.*|position.*)$", re.IGNORECASE)
_HEAD = re.compile(r"^(lm_head|head|logits|unembed|output_head|decoder_head)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
    """One flattened argument: its path, shape, dtype name, planned spec, and inferred role/names.

    Attributes:
      path: pytree path (`jax.tree_util.keystr`).
      shape: global shape.
      dtype: dtype name.
      spec: mesh axes per dimension.
      role: "param", "opt_state" (mirrors `param_key`), "data", or "other" (scalars, unknown state).
      key: the path tokens after `params` for parameters and their optimizer mirrors.
      names: the logical name of each dimension (None where none was inferred).
    """

    path: str
    shape: Shape
    dtype: str
    spec: tuple[Axes, ...]
    role: str
    key: tuple[str, ...]
    names: LogicalNames

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: str) -> int:
    m = re.search(r"(\d+)$", dtype)
    return max(1, int(m.group(1)) // 8) if m else 4


def _param_key(tokens: tuple[str, ...]) -> tuple[str, ...] | None:
    if "params" in tokens:
        return tokens[tokens.index("params") + 1:]
    return None


def _embed_size(params: Sequence[tuple[tuple[str, ...], Shape]]) -> int | None:
    norms = Counter(shape[-1] for key, shape in params
                    if len(shape) >= 1 and len(key) >= 2 and key[-1] == "scale" and _NORM.search(key[-2]))
    if norms:
        return norms.most_common(1)[0][0]
    for key, shape in params:
        if key and key[-1] in _KERNEL and len(shape) >= 2:
            return shape[0]
    return None


def _stacked_prefixes(params: Mapping[tuple[str, ...], Shape]) -> dict[tuple[str, ...], int]:
    """Key prefixes of scanned layer stacks (`layers`, `blocks`, ...) whose leaves share a leading dim."""
    lead: dict[tuple[str, ...], set[int]] = defaultdict(set)
    for key, shape in params.items():
        for i, token in enumerate(key[:-1]):
            if _STACKED.match(token):
                lead[key[: i + 1]].add(shape[0] if shape else -1)
    return {prefix: next(iter(dims)) for prefix, dims in lead.items() if len(dims) == 1 and next(iter(dims)) > 1}


def _param_names(key: tuple[str, ...], shape: Shape, embed: int | None) -> LogicalNames:
    leaf = key[-1] if key else ""
    module = key[-2] if len(key) >= 2 else ""
    rank = len(shape)

    def by_size(d: int, head: bool) -> str:
        if d == embed:
            return "embed"
        return "vocab" if head else "mlp"

    if leaf in ("embedding", "embeddings") and rank == 2:
        return ("length" if _POSITION.match(module) else "vocab", "embed")
    head = bool(_HEAD.match(module))
    if any(_EXPERTS.search(k) for k in key[:-1]) or _EXPERTS.search(leaf):
        if rank == 3 and shape[1] == embed:
            return ("exp", "embed", "mlp")
        if rank == 3 and shape[2] == embed:
            return ("exp", "mlp", "embed")
        if rank == 2 and shape[0] == embed:  # the router
            return ("embed", "exp")
    if _NORM.search(module) and leaf in ("scale", "bias") and rank == 1:
        return ("embed" if shape[0] == embed else None,)
    if leaf in _KERNEL:
        if rank == 2:
            a, b = shape
            if head:
                return ("embed", "vocab") if a == embed or b != embed else ("vocab", "embed")
            if a == embed and b == embed:
                return ("embed", None)
            if a == embed:
                return ("embed", "mlp")
            if b == embed:
                return ("mlp", "embed")
            return ("embed", "mlp") if embed is None else (None, None)
        if rank == 3:
            if shape[0] == embed or (embed is None and shape[-1] != shape[0]):
                return ("embed", "heads", "kv")
            if shape[-1] == embed:
                return ("heads", "kv", "embed")
        return (None,) * rank
    if leaf in _BIAS:
        if rank == 1:
            return (by_size(shape[0], head),)
        if rank == 2:
            return ("heads", "kv")
    if rank == 1 and shape[0] == embed:
        return ("embed",)
    return (None,) * rank


def _data_names(shape: Shape, dtype: str, embed: int | None) -> LogicalNames:
    rank = len(shape)
    names: list[str | None] = ["batch"] + [None] * (rank - 1)
    if (rank == 2 and "int" in dtype) or rank == 3:  # tokens [B, S] or activations [B, S, E]; not images
        names[1] = "length"
    if rank in (2, 3) and shape[-1] == embed and names[-1] is None:
        names[-1] = "embed"
    return tuple(names)


def classify(paths: Sequence[str], shapes: Sequence[Shape], dtypes: Sequence[str],
             specs: Sequence[Sequence[Axes]]) -> tuple[Leaf, ...]:
    """Role and logical names of every argument leaf (see the module docstring for the inference)."""
    tokens = [path_tokens(p) for p in paths]  # an nnx Variable's `.value` dropped
    params = {}
    for tok, shape in zip(tokens, shapes):
        key = _param_key(tok)
        if key is not None:
            params[key] = tuple(shape)
    stacks = _stacked_prefixes(params)
    embed = _embed_size([(k, s[1:] if _stack_of(k, stacks) else s) for k, s in params.items()])
    state_args = {tok[0] for tok in tokens if tok and ("params" in tok or "opt_state" in tok)}

    def names_of(key: tuple[str, ...], shape: Shape) -> LogicalNames:
        if _stack_of(key, stacks) and len(shape) >= 1:
            return ("layers",) + _param_names(key, shape[1:], embed)
        return _param_names(key, shape, embed)

    out = []
    for path, tok, shape, dtype, spec in zip(paths, tokens, shapes, dtypes, specs):
        shape = tuple(shape)
        spec = tuple(tuple(a) for a in spec)
        key = _param_key(tok)
        if key is not None:
            out.append(Leaf(path, shape, dtype, spec, "param", key, names_of(key, shape)))
            continue
        mirror = next((tok[i:] for i in range(len(tok)) if tok[i:] in params and params[tok[i:]] == shape), None)
        if mirror is not None and len(shape) >= 1:
            out.append(Leaf(path, shape, dtype, spec, "opt_state", mirror, names_of(mirror, shape)))
        elif len(shape) >= 1 and tok and tok[0] not in state_args:
            out.append(Leaf(path, shape, dtype, spec, "data", (), _data_names(shape, dtype, embed)))
        else:  # scalars, optimizer counters, model state such as batch statistics
            out.append(Leaf(path, shape, dtype, spec, "other", (), (None,) * len(shape)))
    return tuple(out)


def _stack_of(key: tuple[str, ...], stacks: Mapping[tuple[str, ...], int]) -> bool:
    return any(key[: len(p)] == p for p in stacks)


@dataclasses.dataclass(frozen=True, slots=True)
class AxisRules:
    """Logical axis rules read off a plan.

    Attributes:
      rules: (logical name, mesh axes) in `LOGICAL_ORDER`; () means replicated.
      coverage: fraction of parameter + data bytes whose planned spec the rules reproduce exactly.
      exceptions: (path, logical names, planned spec, spec the rules would give) where they differ.
      optimizer: "same as params" or a description of how optimizer state is sharded differently.
    """

    rules: tuple[tuple[str, Axes], ...]
    coverage: float
    exceptions: tuple[tuple[str, LogicalNames, tuple[Axes, ...], tuple[Axes, ...]], ...]
    optimizer: str

    def as_python(self) -> str:
        """t5x / flax `logical_axis_rules` (a list of (name, mesh axis or None) pairs)."""
        return "logical_axis_rules = [\n" + "".join(
            f"    ({name!r}, {_axes_py(axes)}),\n" for name, axes in self.rules) + "]"

    def as_yaml(self) -> str:
        """MaxText YAML (`logical_axis_rules: [['batch', ['data']], ...]`)."""
        items = ", ".join(f"['{name}', [{', '.join(repr(a) for a in axes)}]]" for name, axes in self.rules)
        return f"logical_axis_rules: [{items}]"

    def to_dict(self) -> dict:
        return {
            "rules": [[n, list(a)] for n, a in self.rules],
            "coverage": self.coverage,
            "exceptions": [{"path": p, "logical": list(n), "planned": [list(a) for a in s],
                            "by_rules": [list(a) for a in r]} for p, n, s, r in self.exceptions],
            "optimizer": self.optimizer,
        }


def _axes_py(axes: Axes) -> str:
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def apply_rules(names: LogicalNames, rules: dict[str, Axes]) -> tuple[Axes, ...]:
    """The spec the rules give a tensor: like flax, a mesh axis already used by an earlier dim is dropped."""
    used: set[str] = set()
    out = []
    for n in names:
        axes = tuple(a for a in rules.get(n, ()) if a not in used) if n is not None else ()
        if n is not None and len(axes) != len(rules.get(n, ())):
            axes = ()
        used.update(axes)
        out.append(axes)
    return tuple(out)


def infer_rules(leaves: Sequence[Leaf]) -> AxisRules:
    """Byte-weighted vote of the planned specs of parameters and data per logical name."""
    votes: dict[str, Counter] = defaultdict(Counter)
    for leaf in leaves:
        if leaf.role not in ("param", "data"):
            continue
        for name, axes in zip(leaf.names, leaf.spec):
            if name is not None:
                votes[name][axes] += leaf.nbytes
    order = [n for n in LOGICAL_ORDER if n in votes] + sorted(set(votes) - set(LOGICAL_ORDER))
    rules = {n: max(votes[n].items(), key=lambda kv: (kv[1], -len(kv[0])))[0] for n in order}
    covered = total = 0
    exceptions = []
    for leaf in leaves:
        if leaf.role not in ("param", "data"):
            continue
        by_rules = apply_rules(leaf.names, rules)
        total += leaf.nbytes
        if by_rules == leaf.spec:
            covered += leaf.nbytes
        else:
            exceptions.append((leaf.path, leaf.names, leaf.spec, by_rules))
    return AxisRules(tuple((n, rules[n]) for n in order), covered / total if total else 1.0, tuple(exceptions),
                     _optimizer_summary(leaves))


def _optimizer_summary(leaves: Sequence[Leaf]) -> str:
    param_spec = {leaf.key: leaf.spec for leaf in leaves if leaf.role == "param"}
    mirrors = [leaf for leaf in leaves if leaf.role == "opt_state"]
    if not mirrors:
        return "no optimizer state found"
    differ = [m for m in mirrors if param_spec.get(m.key) != m.spec]
    if not differ:
        return "sharded like the parameters"
    extra = Counter()
    for m in differ:
        p = param_spec.get(m.key, ())
        used_p = {a for axes in p for a in axes}
        for axes in m.spec:
            for a in axes:
                if a not in used_p:
                    extra[a] += m.nbytes
    frac = sum(m.nbytes for m in differ) / sum(m.nbytes for m in mirrors)
    how = (" additionally split over " + ", ".join(sorted(extra)) + " (ZeRO-style optimizer-state sharding)"
           if extra else " sharded differently")
    return f"{frac:.0%} of optimizer-state bytes{how}"


def read_rules(text: str, source: str = "rules") -> list:
    """Rules as the planner prints them, read back: the t5x list (`logical_axis_rules = [...]`),
    the MaxText YAML line (`logical_axis_rules: [['batch', ['x']], ...]`) or a bare list.

    Raises:
      InvalidArgumentError: text holding no such list.
    """
    lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
    body = "\n".join(ln for ln in lines if ln.strip())
    start = body.find("[")
    try:
        rules = ast.literal_eval(body[start:].strip()) if start >= 0 else None
    except (ValueError, SyntaxError):
        rules = None
    if not isinstance(rules, (list, tuple)):
        raise InvalidArgumentError(f"{source}: no list of (logical name, mesh axes) pairs found; write it as the plan "
                                   "prints it, e.g. [('batch', 'x'), ('embed', None)]")
    return list(rules)


def rules_file_pins(path: str, graph, mesh) -> dict:
    """Pins from a rules file applied to the logical names this module infers for `graph`'s
    arguments (so the rules a plan prints can be fed back in)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgumentError(f"--rules {path!r}: cannot read ({e.strerror})") from None
    rules = read_rules(text, f"--rules {path!r}")
    shapes = [tuple(graph.tensors[t].shape) for t in graph.inputs]
    dtypes = [str(graph.tensors[t].dtype) for t in graph.inputs]
    leaves = classify(graph.input_paths, shapes, dtypes, [((),) * len(s) for s in shapes])
    named = {leaf.path: leaf.names for leaf in leaves
             if leaf.role in ("param", "opt_state", "data") and any(n is not None for n in leaf.names)}
    return rules_to_pins(rules, named, mesh)
