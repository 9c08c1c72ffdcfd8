"""One trace per shape family: the step traced once with its batch size symbolic, then made concrete
for each size by evaluating its shapes.

The pipeline search plans the step at every microbatch size, a user plans it at several batch sizes:
the programs differ only in the sizes of their batch dimensions (DietCode's observation for
dynamic-shape kernels: the decisions are shared across a shape family, the cost is a function of the
shape). `trace_family` traces the step once with the leading dimension of every batch leaf a
`jax.export` symbol, and `ShapeFamily.at(size)` is the graph `trace` would make at that size: the
same ops, each tensor's shape and each shape parameter (`reshape`'s sizes, `broadcast_in_dim`'s
shape, `iota`'s, slice bounds) evaluated at the size, each size used as a value (a mean's divisor)
a literal of its value, for every size from 2 (`MIN_SIZE`). Making one costs a pass over the tensors, not a trace (GPT-39B unrolled,
28k ops: ~0.1 s against ~7 s).

The sequence length can be a symbol of the family too (`SEQ`, `batch_and_seq`): a step built for a
symbolic length (a zoo model whose config's `seq` is the symbol, so its position table's shape is
too) traced with both symbols, and `ShapeFamily.with_sizes(s=...)` the family of one length, whose
`at(size)` is then the graph at that batch size and length (`planner plan --seq 1024,2048`: one
trace for every length and batch size, `cli.plan._trace_step`).

A step is traced per size instead (`trace_family` says why, in one line) when:
- it does not trace with a symbolic batch (Python code that branches on the batch size, or sizes
  the batch into a NumPy constant);
- a shape is not linear in the batch size (floor division or remainder: a reshape into groups of a
  fixed size, as an MoE's token groups): such a step may not trace at every size, and the trace
  per size says where;
- it calls an opaque kernel (`pallas_call`, `custom_partitioning`, `shard_map`) whose parameters
  hold shapes this module does not rewrite.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from planner.core.compat import dim_is_linear, evaluate_dim
from planner.core.errors import PlannerError, first_line
from planner.graph.ir import Body, Graph, Literal, Op, Region, Tensor
from planner.graph.trace import trace

# The symbol of the batch size, and of the sequence length (`batch_and_seq`).
BATCH = "b"
SEQ = "s"

# The smallest size at which a family's graph is the one `trace` makes: traced on a size-1 batch, JAX
# treats the unit dimension as one that broadcasts (its transposes sum over it: extra
# `broadcast_in_dim` / `reduce_sum` ops; `take_along_axis` reshapes it away), which a symbolic size
# never is. At size 1 the family gives the symbolic program itself (`ShapeFamily.program_at`).
MIN_SIZE = 2

# Primitives whose parameters hold shapes inside objects (kernels' block specs, bodies traced per
# shard) that `ShapeFamily.at` does not rewrite: a step calling one is traced per size.
OPAQUE = frozenset({"pallas_call", "custom_partitioning", "shard_map", "custom_call"})


@dataclasses.dataclass(frozen=True)
class ShapeFamily:
    """A step traced once with a symbolic batch size (`trace_family`).

    Attributes:
      graph: the symbolic graph (shapes hold `jax.export` dimension expressions).
      symbolic_tensors: ids of the tensors whose shape is symbolic.
      symbolic_ops: indices of the ops with a symbolic parameter or literal operand.
      symbols: the symbols its shapes hold (`BATCH`, and `SEQ` for a family of lengths).
      fixed: the values given to the symbols other than `BATCH` (`with_sizes`).
    """

    graph: Graph
    symbolic_tensors: tuple[int, ...]
    symbolic_ops: tuple[int, ...]
    symbols: tuple[str, ...] = (BATCH,)
    fixed: tuple[tuple[str, int], ...] = ()

    def with_sizes(self, **sizes: int) -> ShapeFamily:
        """The family with its symbols other than the batch size's fixed (`s=2048`: one sequence
        length's family, whose `at(size)` is the graph at that length and batch size)."""
        unknown = sorted(set(sizes) - set(self.symbols) | set(sizes) & {BATCH})
        if unknown:
            raise ValueError(f"a family of the symbols {self.symbols} cannot fix {unknown}")
        small = {k: v for k, v in sizes.items() if v < MIN_SIZE}
        if small:
            raise ValueError(f"a shape family holds sizes of at least {MIN_SIZE}, got {small}")
        return dataclasses.replace(self, fixed=tuple(sorted({**dict(self.fixed), **sizes}.items())))

    @property
    def tag(self) -> str:
        """The fixed sizes as a key suffix ("" for a batch-only family; "/s2048")."""
        return "".join(f"/{k}{v}" for k, v in self.fixed)

    def at(self, size: int) -> Graph:
        """The graph of the step at batch size `size`: what `trace` makes from the step on
        arguments whose batch leaves have `size` rows (with no `source` jaxpr: the jaxpr is the
        symbolic one, see `Traced`)."""
        if size < MIN_SIZE:
            raise ValueError(f"a shape family holds batch sizes of at least {MIN_SIZE}, got {size}")
        return self.program_at(size)

    def program_at(self, size: int) -> Graph:
        """The symbolic program evaluated at batch size `size`, for every size >= 1: `at(size)`
        from `MIN_SIZE` on. At size 1 it is not the graph `trace` makes there (that one has JAX's
        unit-dimension ops) but the same computation, every op valid at that size (a `jax.export`
        dimension stands for every size >= 1): what the pipeline search plans one-row microbatches
        on (their layer costs), instead of a trace of its own (GPT-39B unrolled: ~5 s). The
        pipeline runtime traces its stage programs itself."""
        if size < 1:
            raise ValueError(f"a batch size is at least 1, got {size}")
        env = {**dict(self.fixed), BATCH: int(size)}
        free = sorted(set(self.symbols) - set(env))
        if free:
            raise ValueError(f"the family's sizes {free} are not fixed; see `with_sizes`")
        g = self.graph
        tensors = list(g.tensors)
        for t in self.symbolic_tensors:
            tensors[t] = Tensor(tuple(evaluate_dim(d, env) for d in g.tensors[t].shape), g.tensors[t].dtype)
        ops = list(g.ops)
        for i in self.symbolic_ops:
            op = g.ops[i]
            ops[i] = Op(op.index, op.primitive, _concrete(op.params, env),
                        tuple(_literal(x, env) for x in op.inputs), op.outputs, op.name_stack)
        regions = {k: tuple(_region(r, env) for r in rs) for k, rs in g.regions.items()}
        return dataclasses.replace(
            g, tensors=tuple(tensors), ops=tuple(ops), outputs=tuple(_literal(x, env) for x in g.outputs),
            regions=regions, source=None)


def same_program(a: Graph, b: Graph) -> bool:
    """Whether two graphs are the same program: the same ops in order on the same tensors, with
    equal parameters (bodies kept for evaluation aside: their ops are the graph's) and literals.
    How a family made from one step is checked against another step built for another batch size
    (a zoo model or factory made per size, which may close over the size)."""
    if len(a.ops) != len(b.ops) or a.tensors != b.tensors or a.inputs != b.inputs:
        return False
    for x, y in zip(a.ops, b.ops):
        if x.name != y.name or x.outputs != y.outputs or set(x.params) != set(y.params):
            return False
        if not all(_same_value(x.params[k], y.params[k]) for k in x.params if k not in _BODIES):
            return False
        if not all(_same_operand(p, q) for p, q in zip(x.inputs, y.inputs)):
            return False
    return True


# Parameters holding jaxprs or their thunks (bodies kept for evaluation, inlined into the graph's ops).
_BODIES = frozenset({"jaxpr", "call_jaxpr", "fun_jaxpr", "branches", "body_jaxpr", "cond_jaxpr", "fwd_jaxpr_thunk",
                     "bwd", "jvp_jaxpr_fun", "jvp_jaxpr_thunk"})


def _same_value(a: Any, b: Any) -> bool:
    try:
        if bool(np.all(a == b)):
            return True
    except Exception:  # values without a usable == (objects, ragged tuples): by their printed form
        pass
    return repr(a) == repr(b)


def _same_operand(a: int | Literal, b: int | Literal) -> bool:
    if isinstance(a, Literal) != isinstance(b, Literal):
        return False
    if not isinstance(a, Literal):
        return a == b
    return a.tensor == b.tensor and _same_value(np.asarray(a.value), np.asarray(b.value))


def batch_and_seq() -> tuple[Any, Any]:
    """The symbols `BATCH` and `SEQ`, of one `jax.export` scope (symbols of two scopes do not mix):
    build the step for the sequence length `SEQ` and give `trace_family` the `BATCH` one."""
    b, s = jax.export.symbolic_shape(f"{BATCH}, {SEQ}")
    return b, s


def length_family(build: Callable[[Any], tuple[Callable[..., Any], Sequence[Any]]]) -> ShapeFamily | str:
    """The family of every batch size and sequence length of a step built by `build(seq)` ->
    (step, example arguments, the batch last) for the symbol `SEQ` and traced once with its batch
    symbolic too (`trace_family`); or why not, in one line (a step that does not build for a
    symbolic length: then each length is traced on its own). How `planner plan --seq A,B` and
    experiments/bench_planning.py trace a zoo model once for all its lengths."""
    b, s = batch_and_seq()
    try:
        step, example = build(s)
    except Exception as e:  # e.g. a size that must divide batch x length at build time (the MoE's groups)
        return f"it does not build for a symbolic sequence length ({type(e).__name__}: {first_line(e)})"
    return trace_family(step, example, (len(example) - 1,), batch_symbol=b)


def trace_family(fn: Callable[..., Any], args: Sequence[Any], batch_argnums: Sequence[int],
                 user_constraints: str = "pin", batch_symbol: Any = None) -> ShapeFamily | str:
    """`fn` traced once with the leading dimension of every leaf of `args[a]` (for `a` in
    `batch_argnums`) the symbol `BATCH`; or, when the step cannot be planned from such a trace, why
    (one line: the caller traces per size instead). With `batch_symbol` (`batch_and_seq`), `args`
    may hold the sequence symbol already (a step built for a symbolic length): a family of both."""
    (symbol,) = jax.export.symbolic_shape(BATCH) if batch_symbol is None else (batch_symbol,)
    symbolic = list(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tuple(args)))
    for a in batch_argnums:
        symbolic[a] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((symbol,) + tuple(x.shape[1:]), x.dtype),
                                   symbolic[a])
    try:
        graph = trace(fn, *symbolic, user_constraints=user_constraints)
    except PlannerError:
        raise
    except Exception as e:  # the step branches on, or computes with, the batch size in Python
        return f"it does not trace with a symbolic batch size ({type(e).__name__}: {first_line(e)})"
    opaque = sorted({op.name for op in graph.ops if op.name in OPAQUE})
    if opaque:
        return f"it calls {', '.join(opaque)}, whose shapes are traced per batch size"
    sym_tensors = tuple(i for i, t in enumerate(graph.tensors) if _symbolic(t.shape))
    sym_ops = tuple(op.index for op in graph.ops
                    if _symbolic(op.params) or any(isinstance(x, Literal) and _symbolic(x.value) for x in op.inputs))
    nonlinear = [d for i in sym_tensors for d in graph.tensors[i].shape if not dim_is_linear(d)]
    nonlinear += [d for i in sym_ops for d in _dims(graph.ops[i].params) if not dim_is_linear(d)]
    if nonlinear:
        sizes = "batch size" if batch_symbol is None else "batch size and sequence length"
        return f"a shape is not linear in the {sizes} ({nonlinear[0]})"
    return ShapeFamily(graph, sym_tensors, sym_ops, (BATCH,) if batch_symbol is None else (BATCH, SEQ))


def _dims(x: Any) -> list[Any]:
    """The symbolic dimensions inside a parameter value (tuples, lists, dicts, shaped values)."""
    if jax.export.is_symbolic_dim(x):
        return [x]
    if isinstance(x, (tuple, list)):
        return [d for v in x for d in _dims(v)]
    if isinstance(x, Mapping):
        return [d for v in x.values() for d in _dims(v)]
    if isinstance(x, jax.ShapeDtypeStruct) or type(x).__name__ == "ShapedArray":
        return _dims(tuple(x.shape))
    return []


def _symbolic(x: Any) -> bool:
    return bool(_dims(x))


def _concrete(x: Any, env: Mapping[str, int]) -> Any:
    """A parameter value with its symbolic dimensions evaluated at `env` (same structure)."""
    if jax.export.is_symbolic_dim(x):
        return evaluate_dim(x, env)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_concrete(v, env) for v in x)
    if isinstance(x, list):
        return [_concrete(v, env) for v in x]
    if isinstance(x, Mapping):
        return {k: _concrete(v, env) for k, v in x.items()}
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(_concrete(tuple(x.shape), env), x.dtype)
    if type(x).__name__ == "ShapedArray":
        return x.update(shape=_concrete(tuple(x.shape), env))
    return x


def _literal(x: int | Literal, env: Mapping[str, int]) -> int | Literal:
    """An operand with a symbolic literal's value evaluated (a tensor id as it is)."""
    if not isinstance(x, Literal) or not jax.export.is_symbolic_dim(x.value):
        return x
    return Literal(np.asarray(evaluate_dim(x.value, env), dtype=x.tensor.dtype)[()], x.tensor)


def _region(r: Region, env: Mapping[str, int]) -> Region:
    """A region with its symbolic literal operands and results evaluated."""
    def lits(xs: Sequence[int | Literal]) -> tuple[int | Literal, ...]:
        return tuple(_literal(x, env) for x in xs)
    bodies = tuple(Body(b.start, b.end, lits(b.inputs), lits(b.outputs)) for b in r.bodies)
    return dataclasses.replace(r, operands=lits(r.operands), outputs=lits(r.outputs), bodies=bodies)
