"""Optimizer state across pipeline stages: each stage updates its own parameters, so it gets
the optimizer-state leaves that mirror them (found by pytree path in the full state), sharded
like those parameters, and a copy of the shared ones (e.g. the step count)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from planner.core.errors import InvalidArgumentError
from planner.emit.pipeline.programs import StagePrograms


@dataclasses.dataclass(frozen=True)
class StateLayouts:
    """Where a pipeline's optimizer state lives, for one argument signature (made once per
    signature: each is an `eval_shape` of the optimizer's init per stage, and per parameter of an
    offloaded-optimizer stage).

    Attributes:
      stages: per stage, (the parameters' treedef, the stage's state treedef, its leaf paths).
      groups: per stage index that updates one parameter at a time, `group_layouts` of its parameters.
    """

    stages: tuple[tuple[Any, Any, tuple[str, ...]], ...]
    groups: Mapping[int, Mapping[int, tuple[Any, list[str]]]]


def state_layouts(optimizer: Any, num_stages: int, params: Any, param_owner: Mapping[int, int],
                  streamed: Mapping[int, Sequence[int]]) -> StateLayouts:
    """Per stage the optimizer-state pytree of its parameters (`opt_layouts` finds its leaves in the
    full state by path), and `group_layouts` of each stage in `streamed` (stage index -> its
    parameters), which updates one parameter at a time."""
    treedef = jax.tree_util.tree_structure(params)
    n = treedef.num_leaves
    flat = jax.tree_util.tree_leaves(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))
    stages = []
    for s in range(num_stages):
        masked = jax.tree_util.tree_unflatten(treedef, [flat[k] if param_owner[k] == s else None
                                                        for k in range(n)])
        paths, tdef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(optimizer.init, masked))
        stages.append((treedef, tdef, tuple(jax.tree_util.keystr(p) for p, _ in paths)))
    return StateLayouts(tuple(stages), {s: group_layouts(optimizer, params, owned) for s, owned in streamed.items()})


def opt_layouts(layouts: StateLayouts, opt_state: Any):
    """Per stage (the parameters' treedef, its state treedef, its leaf paths into the full state),
    and the full state's leaves by path.

    Raises:
      InvalidArgumentError: a stage's state has a leaf the full state has not (an optimizer whose
        state is not one per parameter plus shared leaves).
    """
    full = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]}
    for s, (_, _, keys) in enumerate(layouts.stages):
        unknown = [k for k in keys if k not in full]
        if unknown:
            raise InvalidArgumentError(
                f"optimizer state leaves {unknown[:3]} of stage {s} have no counterpart in the full optimizer "
                "state; the pipeline needs an optimizer that updates each parameter on its own")
    return [(treedef, tdef, list(keys)) for treedef, tdef, keys in layouts.stages], full


def group_layouts(optimizer: Any, params: Any, owned: Sequence[int]) -> dict[int, tuple[Any, list[str]]]:
    """Per parameter leaf `k` of `owned`: the structure and leaf paths (keys into the full state,
    as `opt_layouts` gives a stage's) of the optimizer state of that parameter alone (its moments
    and the shared leaves, e.g. the step count): what a streamed update takes per parameter."""
    treedef = jax.tree_util.tree_structure(params)
    flat = jax.tree_util.tree_leaves(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))
    out = {}
    for k in owned:
        masked = jax.tree_util.tree_unflatten(treedef, [x if i == k else None for i, x in enumerate(flat)])
        paths, tdef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(optimizer.init, masked))
        out[k] = (tdef, [jax.tree_util.keystr(p) for p, _ in paths])
    return out


def parameter_groups(ptree: Any, owned: Sequence[int], stage_params: Sequence[Any], grads: Sequence[Any],
                     state: Mapping[str, Any], groups: Mapping[int, tuple[Any, list[str]]]):
    """The arguments (parameters, optimizer state, gradients) of a streamed update, one parameter at
    a time in leaf order: yields (leaf `k`, the state's keys, the args), the trees masked to `k`.
    `stage_params` and `grads` are in `owned`'s order; `state` the stage's state leaves by key;
    `groups` each parameter's state layout (`group_layouts`)."""
    n = ptree.num_leaves
    pos = {k: j for j, k in enumerate(owned)}
    for k in sorted(owned):
        gdef, gkeys = groups[k]

        def one(xs, k=k):
            return jax.tree_util.tree_unflatten(ptree, [xs[pos[i]] if i == k else None for i in range(n)])

        yield k, gkeys, (one(stage_params), jax.tree_util.tree_unflatten(gdef, [state[key] for key in gkeys]),
                         one(grads))


def opt_shardings(okeys: Sequence[str], st: StagePrograms, flat_params: Sequence[Any], treedef: Any):
    """Optimizer-state leaves take the sharding of the parameter they mirror (in the
    sharded-optimizer layout its optimizer state's, `StagePrograms.opt_shardings`); the rest are
    replicated."""
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(treedef, flat_params))[0]]
    mine = [(paths[k], np.shape(flat_params[k]), sh)
            for k, sh in zip(st.params, st.opt_shardings or st.param_shardings)]
    rep = jax.sharding.NamedSharding(st.mesh, jax.sharding.PartitionSpec())

    def shard_of(key: str, leaf) -> Any:
        for path, shape, sh in mine:
            if key.endswith(path) and np.shape(leaf) == shape:
                return sh
        return rep

    return shard_of
