"""A hand configuration costed by the planner's own model, and the plan beside such configurations.

`evaluate` pins every argument leaf (`planner.pins`): the leaves the configuration names get its
spec, the others are replicated (what `jax.jit` does with `PartitionSpec()`). It then runs the
planning code path unchanged, so the intermediates get the layouts the ILP finds best for those
arguments (XLA's own sharding propagation is not modelled) and the result is a `Plan` with the same
prediction, report, explanation and HTML as a plan. A plan whose every argument is pinned to a
configuration therefore predicts exactly what `evaluate` of that configuration predicts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from planner.api import PlannedFunction
from planner.baselines import APPROXIMATIONS, NAMES, baseline_pins
from planner.errors import InfeasiblePlanError, InvalidArgumentError, PlannerError
from planner.pins import exact_pattern
from planner.plan import Plan


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def shardings_to_pins(shardings: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """`in_shardings`-style specs (a pytree of PartitionSpec / NamedSharding / None, the arguments'
    tree or a prefix of it) -> one exact pin per argument leaf.

    Raises:
      InvalidArgumentError: a tree that is not a prefix of the arguments' tree.
    """
    if _is_spec_leaf(shardings):
        shardings = (shardings,) * len(args)
    elif len(args) == 1 and not (isinstance(shardings, (tuple, list)) and len(shardings) == 1):
        shardings = (shardings,)
    try:
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), tuple(shardings), tuple(args),
                            is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"shardings do not match the arguments' tree: {str(e).splitlines()[0]}") from None
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    specs = jax.tree.leaves(full, is_leaf=_is_spec_leaf)
    if len(specs) != len(leaves):
        raise InvalidArgumentError(f"shardings give {len(specs)} specs for {len(leaves)} argument leaves")
    return {exact_pattern(jax.tree_util.keystr(p)): (s if s is not None else PartitionSpec())
            for (p, _), s in zip(leaves, specs)}


def _configuration(shardings, pins, baseline, rules, args) -> tuple[Any, str]:
    given = [k for k, v in (("shardings", shardings), ("pins", pins), ("baseline", baseline), ("rules", rules))
             if v is not None]
    if len(given) != 1:
        raise InvalidArgumentError(f"evaluate takes exactly one of shardings=, pins=, rules=, baseline= (got "
                                   f"{', '.join(given) or 'none'})")
    if rules is not None:
        return None, "rules"
    if shardings is not None:
        return shardings_to_pins(shardings, args), "shardings"
    if pins is not None:
        return pins, "pins"
    return baseline_pins(baseline), f"baseline {baseline}"


def evaluate(fn: Callable[..., Any], *args: Any, mesh: Any, shardings: Any = None,
             pins: Mapping[str, Any] | None = None, baseline: str | None = None, rules: Any = None,
             logical: Any = None, **options: Any) -> Plan:
    """The predicted cost, memory and collectives of exactly one configuration, as a Plan.

    Args:
      fn: the train step.
      *args: its arguments (arrays or ShapeDtypeStructs).
      mesh: a `jax.sharding.Mesh`, a shape like `(2, 4)` or `"2x4"`.
      shardings: `in_shardings` as `jax.jit` takes them (PartitionSpecs / NamedShardings).
      pins: {path glob: spec} (`planner.pins`); leaves no pattern matches are replicated.
      baseline: a name of `planner.baselines.NAMES`.
      rules, logical: logical-axis rules and (optionally) the logical names they apply to, as
        `plan_parallel` takes them.
      **options: `PlanOptions` fields; a memory budget is not enforced (the plan reports the
        configuration's memory).

    Returns:
      A Plan; `plan.solver["configuration"]` names what was evaluated.

    Raises:
      InvalidArgumentError: not exactly one configuration, an unknown baseline, a bad pin.
    """
    config, label = _configuration(shardings, pins, baseline, rules, args)
    options = {k: v for k, v in options.items() if k != "memory_budget"}  # reported, not enforced
    plan = PlannedFunction(fn, mesh=mesh, pins=config, unpinned="replicate", rules=rules, logical=logical,
                           **options).plan(*args)
    return labelled(plan, label)


def labelled(plan: Plan, label: str) -> Plan:
    """`plan` with `solver['configuration']` (and a baseline's approximation note) recorded."""
    solver = {**plan.solver, "configuration": label}
    if label.startswith("baseline ") and label[9:] in APPROXIMATIONS:
        solver["approximation"] = APPROXIMATIONS[label[9:]]
    return dataclasses.replace(plan, solver=solver)


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """The planner's plan beside hand configurations, all under one cost model.

    Attributes:
      plan: the planner's plan.
      others: (name, Plan) per configuration that could be evaluated.
      skipped: (name, one-line reason) per configuration that could not (a spec the shapes refuse,
        no fit in the memory budget).
    """

    plan: Plan
    others: tuple[tuple[str, Plan], ...]
    skipped: tuple[tuple[str, str], ...]


def compare(fn: Callable[..., Any], *args: Any, mesh: Any, baselines: Sequence[str] | None = None,
            pins: Mapping[str, Any] | None = None, shardings: Any = None, rules: Any = None, logical: Any = None,
            **options: Any) -> Comparison:
    """The planner's plan and, evaluated by the same code path, the named baselines (all by
    default) and optionally the user's own pins / shardings (named "yours").

    Raises:
      InvalidArgumentError: an unknown baseline name (before anything is planned).
    """
    names = list(NAMES if baselines is None else baselines)
    for n in names:
        if n not in NAMES:
            raise InvalidArgumentError(f"unknown baseline {n!r}; known: {', '.join(NAMES)}")
    plan = PlannedFunction(fn, mesh=mesh, **options).plan(*args)
    configs: list[tuple[str, dict]] = [(n, {"baseline": n}) for n in names]
    if pins is not None:
        configs.append(("yours", {"pins": pins}))
    if shardings is not None:
        configs.append(("yours", {"shardings": shardings}))
    if rules is not None:
        configs.append(("your rules", {"rules": rules, "logical": logical}))
    others, skipped = [], []
    for name, kw in configs:
        try:
            others.append((name, evaluate(fn, *args, mesh=mesh, **kw, **options)))
        except InfeasiblePlanError as e:
            skipped.append((name, str(e).splitlines()[0]))
        except PlannerError as e:
            if not kw.get("baseline"):
                raise
            skipped.append((name, str(e).splitlines()[0]))
    return Comparison(plan, tuple(others), tuple(skipped))
