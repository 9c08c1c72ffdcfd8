"""A hand configuration costed by the planner's own model, and the plan beside such configurations.

`evaluate` pins every argument leaf (`planner.configs.pins`): the leaves the configuration names get its
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

from planner.configs.baselines import (APPROXIMATIONS, NAMES, baseline_pins, batch_ways, check_name, parse_baseline,
                                       replica_ways)
from planner.configs.baselines import stage_baseline_pins as pipeline_baseline_pins
from planner.configs.pins import exact_pattern
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, PlannerError
from planner.core.mesh import parse_mesh
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.cost_model import Cluster
from planner.emit.pipeline.planned import pipeline_cluster, plan_fixed_stages
from planner.graph.ir import Graph
from planner.graph.trace import trace
from planner.planning.step import plan_step
from planner.search.mesh_plan import check_options


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


def evaluate(fn: Callable[..., Any], *args: Any, mesh: Any = None, shardings: Any = None,
             pins: Mapping[str, Any] | None = None, baseline: str | None = None, rules: Any = None,
             logical: Any = None, pipeline_stages: int | None = None, cluster: Cluster | str | None = None,
             remat: bool | None = None, tensor_parallel: int | None = None, **options: Any) -> Plan:
    """The predicted cost, memory and collectives of exactly one configuration, as a Plan.

    Args:
      fn: the train step.
      *args: its arguments (arrays or ShapeDtypeStructs).
      mesh: a `jax.sharding.Mesh`, a shape like `(2, 4)` or `"2x4"`.
      shardings: `in_shardings` as `jax.jit` takes them (PartitionSpecs / NamedShardings).
      pins: {path glob: spec} (`planner.configs.pins`); leaves no pattern matches are replicated.
      baseline: a name of `planner.configs.baselines.NAMES`, optionally with `+ppN`: the baseline inside
        each of N hand-chosen even pipeline stages (below).
      rules, logical: logical-axis rules and (optionally) the logical names they apply to, as
        `plan_parallel` takes them.
      pipeline_stages: N even pipeline stages for `baseline` (same as `baseline="NAME+ppN"`).
      cluster: for pipeline baselines, the cluster: a `planner.stages.submesh.make_cluster(...)` or
        `"HOSTSxDEVICES[:PRESET]"` (default: `mesh` as one host, or `hardware="HxD:preset"`;
        `inter_host=` / `intra_host=` options set its links).
      remat: pipeline baselines only: True (every stage recomputes its forward in the backward,
        as Megatron-LM's activation recomputation), False, or None (the faster that fits memory).
      tensor_parallel: pipeline baselines only: each stage's submesh as a (devices / T, T) mesh
        with T devices of one host on the second axis (Megatron-LM's TP degree; the baseline's
        pins put tensor parallelism there); default: the planner's own view of the submesh.
      **options: `PlanOptions` fields; a memory budget is not enforced (the plan reports the
        configuration's memory). Pipeline baselines read `num_microbatches` (None: every count
        dividing the batch whose microbatch the stage's data-parallel axes divide, the fastest
        kept) and `schedule` ("1f1b").

    A pipeline baseline is laid out as Megatron-LM lays out TP x PP x DP: the repeated layers split
    evenly over N stages (the embedding with the first, the head and loss with the last; an uneven
    split is an error), each stage on an equal submesh (whole hosts when there are at least N
    hosts, else an equal part of each host), planned as the logical mesh the planner's pipeline
    search uses for that submesh (hosts x devices across hosts); every stage's arguments pinned by
    the baseline on that mesh, where megatron-tp(-sp) puts tensor parallelism on the axis inside a
    host and data parallelism on the host axis when the stage spans hosts. It is costed by the
    planner's pipeline path (`planner.stages.fixed_pipeline.fixed_pipeline`: per-layer ILP cost tables
    with the pins, boundary transfers, bubble, gradient sync, update) and returned as the planner
    returns its pipeline plans (`plan.stages`, `plan.pipeline`; run it with
    `planner.emit.pipeline.planned.run_plan(fn, plan)`). For example Megatron-LM's 39.1B GPT row (TP 8, PP 2,
    DP 32 on 64 hosts of 8 A100-80GB):

        b = zoo.get_model("gpt3-39b", batch=1536, seq=2048, dtype="bfloat16")
        plan = evaluate(b.train_step, b.abstract_state(), b.abstract_batch(),
                        baseline="megatron-tp+pp2", cluster="64x8:a100-80gb",
                        num_microbatches=48, remat=True)

    Returns:
      A Plan; `plan.solver.configuration` names what was evaluated.

    Raises:
      InvalidArgumentError: not exactly one configuration, an unknown baseline, a bad pin, layers or
        devices that do not split into the pipeline stages.
    """
    if baseline is not None:
        name, stages = parse_baseline(baseline)
        if pipeline_stages is not None:
            if stages is not None and stages != pipeline_stages:
                raise InvalidArgumentError(f"baseline {baseline!r} and pipeline_stages={pipeline_stages} disagree")
            stages = pipeline_stages
        if stages is not None:
            if shardings is not None or pins is not None or rules is not None:
                raise InvalidArgumentError("evaluate takes exactly one of shardings=, pins=, rules=, baseline=")
            return evaluate_pipeline(fn, args, name, stages, mesh=mesh, cluster=cluster, remat=remat,
                                     tensor_parallel=tensor_parallel, **options)
        baseline = name
    elif pipeline_stages is not None:
        raise InvalidArgumentError("pipeline_stages= goes with baseline= (e.g. baseline='megatron-tp', "
                                   "pipeline_stages=4)")
    if cluster is not None or remat is not None or tensor_parallel is not None:
        raise InvalidArgumentError("cluster=, remat= and tensor_parallel= are for pipeline baselines "
                                   "(baseline='NAME+ppN'); "
                                   "give the mesh with mesh= and its links with inter_host=")
    config, label = _configuration(shardings, pins, baseline, rules, args)
    options = {k: v for k, v in options.items() if k != "memory_budget"}  # reported, not enforced
    plan = plan_step(fn, *args, mesh=mesh, pins=config, unpinned="replicate", rules=rules, logical=logical,
                     **options)
    return labelled(plan, label)


def labelled(plan: Plan, label: str) -> Plan:
    """`plan` with `solver.configuration` (and a baseline's approximation note) recorded."""
    solver = dataclasses.replace(plan.solver, configuration=label)
    name, plus, _ = label[9:].partition("+")
    notes = [APPROXIMATIONS[name]] if label.startswith("baseline ") and name in APPROXIMATIONS else []
    if label.startswith("baseline ") and plus and name in ("zero1", "zero2"):
        notes.append(PP_APPROXIMATION)
    if notes:
        solver = dataclasses.replace(solver, approximation="; ".join(notes))
    return dataclasses.replace(plan, solver=solver)


PP_APPROXIMATION = ("inside pipeline stages the optimizer state is costed split like its parameter (the stage "
                    "cost tables know parameters, not their optimizer state)")


def evaluate_pipeline(fn: Callable[..., Any], args: tuple[Any, ...], name: str, num_stages: int, *,
                      mesh: Any = None, cluster: Cluster | str | None = None, remat: bool | None = None,
                      graph: Graph | None = None, tensor_parallel: int | None = None, **options: Any) -> Plan:
    """The baseline `name` in `num_stages` hand-chosen even pipeline stages (see `evaluate`)."""
    check_name(name)
    options = {k: v for k, v in options.items() if k not in ("pipeline",)}
    opts = check_options(PlanOptions.from_kwargs({**options, "pipeline": True}))
    if isinstance(cluster, str):
        if not Cluster.is_cluster(cluster):
            raise InvalidArgumentError(f"cluster={cluster!r} is not 'HOSTSxDEVICES[:PRESET]', e.g. '64x8:a100-80gb'")
        opts = dataclasses.replace(opts, hardware=cluster)
        cluster = None
    if cluster is None:
        if mesh is None and not Cluster.is_cluster(opts.hardware):
            raise InvalidArgumentError("a pipeline baseline needs the devices: pass cluster='HOSTSxDEVICES[:PRESET]' "
                                       "(or a make_cluster(...)) or mesh=")
        spec = parse_mesh(mesh, len(jax.devices()))[0] if mesh is not None else None
        cluster = pipeline_cluster(spec, spec.size if spec is not None else 0, opts)
    elif not isinstance(cluster, Cluster):
        raise InvalidArgumentError(f"cluster must be a 'HOSTSxDEVICES[:PRESET]' string or a make_cluster(...), "
                                   f"got {type(cluster).__name__}")
    graph = graph if graph is not None else trace(fn, *args)
    return pipeline_baseline(fn, tuple(args), graph, name, num_stages, cluster, opts, remat, tensor_parallel)[0]


def pipeline_baseline(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, name: str, num_stages: int,
                      cluster: Cluster, options: PlanOptions, remat: bool | None = None,
                      tensor_parallel: int | None = None) -> tuple[Plan, Any]:
    """(Plan, `PipelinePlan`) of the baseline `name` in `num_stages` even stages on `cluster` (the
    code path of `evaluate(..., baseline="NAME+ppN")` and `planner plan/compare --baseline`)."""
    check_name(name)
    plan, pp = plan_fixed_stages(fn, tuple(args), graph, cluster, dataclasses.replace(options, pipeline=True),
                                 num_stages, pins=pipeline_baseline_pins(name),
                                 batch_ways=lambda lm: batch_ways(name, lm.mesh, lm.host_axes),
                                 replica_ways=lambda g, lm: replica_ways(name, g, lm), remat=remat,
                                 tensor_parallel=tensor_parallel)
    tp = f" (tensor parallel {tensor_parallel})" if tensor_parallel else ""
    return labelled(plan, f"baseline {name}+pp{num_stages}{tp}"), pp


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
    default; `NAME+ppN` names a pipeline baseline, costed on `mesh`'s devices as one host unless
    `hardware="HxD:preset"` names the cluster) and optionally the user's own pins / shardings
    (named "yours"). Beside a pipeline baseline on a cluster of several hosts the planner's plan
    weighs pipeline stages on that cluster too (`planning.pipeline_lever`, as `planner compare`
    does): the faster of its plan on `mesh` and its stage search.

    Raises:
      InvalidArgumentError: an unknown baseline name (before anything is planned).
    """
    names = list(NAMES if baselines is None else baselines)
    for n in names:
        parse_baseline(n)
    staged = any(parse_baseline(n)[1] for n in names)
    plan = plan_step(fn, *args, mesh=mesh, stages_beside_mesh=staged, **options)
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
