"""Arguments as users pass them: array leaves are traced, every other leaf is static.

An Equinox module carries its activation function, dropout rate and sizes as leaves of the same
pytree as its weights; `equinox.filter_jit` traces the arrays and treats the rest as compile-time
constants. A planned step does the same: the non-array leaves are closed over when the step is
traced, they are part of the plan's cache key (a new value re-plans), and the step's non-array
results (the module it returns) are handed back as the trace made them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


def is_array(x: Any) -> bool:
    """A traced leaf: anything with a shape and a dtype (jax and numpy arrays, ShapeDtypeStructs)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _key(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return (type(x), id(x))
    return (type(x), x)


@dataclasses.dataclass(frozen=True)
class StaticLeaves:
    """The non-array leaves of a call's arguments.

    Attributes:
      tree: the treedef of the whole argument tuple.
      leaves: (position among the tree's leaves, value) of each non-array leaf.
    """

    tree: Any
    leaves: tuple[tuple[int, Any], ...]

    def key(self) -> tuple:
        """Hashable identity of the static values (unhashable ones by object identity)."""
        return (self.tree, tuple((i, _key(x)) for i, x in self.leaves))


def split(args: tuple[Any, ...], leaves: list[Any] | None = None,
          tree: Any = None) -> tuple[tuple[Any, ...], StaticLeaves | None]:
    """(the arguments with every non-array leaf replaced by None, those leaves); (args, None) when all
    leaves are arrays. Array leaves keep their pytree paths. `leaves` and `tree`: the arguments
    flattened already (a planned step's call flattens them once)."""
    if leaves is None:
        leaves, tree = jax.tree_util.tree_flatten(args)
    static = tuple((i, x) for i, x in enumerate(leaves) if not is_array(x))
    if not static:
        return args, None
    dyn = [None if not is_array(x) else x for x in leaves]
    return jax.tree_util.tree_unflatten(tree, dyn), StaticLeaves(tree, static)


def merge(dyn_args: tuple[Any, ...], static: StaticLeaves) -> tuple[Any, ...]:
    """The whole arguments again: `split`'s array part with the static leaves put back."""
    arrays = iter(jax.tree_util.tree_leaves(dyn_args))
    where = dict(static.leaves)
    leaves = [where[i] if i in where else next(arrays) for i in range(static.tree.num_leaves)]
    return jax.tree_util.tree_unflatten(static.tree, leaves)


@dataclasses.dataclass
class StaticResults:
    """The non-array results of a step, recorded when it is traced (per signature)."""

    tree: Any = None
    leaves: tuple[tuple[int, Any], ...] = ()

    def restore(self, outs: Any) -> Any:
        """The step's results: the traced program's array results with the recorded static ones."""
        if not self.leaves:
            return outs
        return merge(outs, StaticLeaves(self.tree, self.leaves))


def array_function(fn: Callable[..., Any], static: StaticLeaves, results: StaticResults) -> Callable[..., Any]:
    """`fn` as a function of `split`'s array part: the static leaves closed over, the static results
    recorded in `results` and left out (None) of what it returns."""

    def arrays_only(*dyn_args):
        out = fn(*merge(dyn_args, static))
        leaves, tree = jax.tree_util.tree_flatten(out)
        results.tree = tree
        results.leaves = tuple((i, x) for i, x in enumerate(leaves) if not is_array(x))
        return jax.tree_util.tree_unflatten(tree, [x if is_array(x) else None for x in leaves])

    arrays_only.__name__ = getattr(fn, "__name__", "step")
    return arrays_only
