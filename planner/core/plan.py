"""The Plan: the planner's frozen, JSON-serialisable answer (its parts' records: `plan_records`,
`pipeline_records`)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from planner.core.errors import InvalidArgumentError
from planner.core.layer_index import star_indices
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.pipeline_records import PipelineFacts, PipelineStage, stage_way
from planner.core.plan_records import LEVER_NAMES, Levers, SolverStats, UserConstraint, solver_quality
from planner.core.sharding import Spec, format_spec, named_sharding, spec_from_json, spec_to_json
from planner.core.units import format_bytes

PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PredictedCollective:
    """One collective the plan expects XLA to emit.

    Attributes:
      kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all".
      axes: mesh axis names it spans.
      nbytes: buffer bytes on one device (see `cost_model.collectives`).
      group_size: devices per group.
      where: the op (name and module path) that causes it.
      reason: "partial sum" (a split contraction), "reshard" (a producer/consumer mismatch),
        "follow" (an op that cannot keep its operand's split), "sharded state" (a pipeline stage
        gathering parameters it stores split over every axis) or, between pipeline stages,
        "activation" / "gradient".
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    group_size: int
    where: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    """What the planner's cost model predicts for one step (per device).

    `step_time_s` = `compute_time_s` + `communication_time_s`, the communication on the critical
    path (exposed); `hidden_communication_time_s` runs beside compute (overlapped gradient
    reductions) and is not in the step time.
    """

    step_time_s: float
    compute_time_s: float
    communication_time_s: float
    memory_bytes_per_device: int
    bytes_moved_per_device: float
    collectives: tuple[PredictedCollective, ...]
    hidden_communication_time_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One ILP decision and why: the chosen strategy, its cost, and the runner-up.

    `cost_s` = `compute_s` + `communication_s` (the op's own collectives) + `resharding_s` (on the
    edges into and out of it), all other decisions fixed; `ops` counts the layers sharing it.
    `collectives` / `runner_up_collectives`: the op's own collectives under the chosen strategy and
    under the runner-up, one entry per collective of one member op: (kind, mesh axis names, buffer
    bytes per device, seconds as the planner costed it).
    """

    label: str
    chosen: str
    cost_s: float
    runner_up: str
    runner_up_delta_s: float
    ops: int
    compute_s: float = 0.0
    communication_s: float = 0.0
    resharding_s: float = 0.0
    collectives: tuple[tuple[str, tuple[str, ...], int, float], ...] = ()
    runner_up_collectives: tuple[tuple[str, tuple[str, ...], int, float], ...] = ()


def _decision_from_json(x: dict) -> Decision:
    def comms(items) -> tuple:
        return tuple((str(k), tuple(str(a) for a in axes), int(b), float(t)) for k, axes, b, t in items)

    x = dict(x)
    for key in ("collectives", "runner_up_collectives"):
        x[key] = comms(x.get(key, ()))
    return Decision(**x)


@dataclasses.dataclass(frozen=True, slots=True)
class WireFormat:
    """One collective the plan runs in another dtype than its value's (`planner.ilp.wire`).

    kind "partial-sum": op `op`'s result `pos`, a split contraction's partial sums, reduced in
    `dtype` (float32) and rounded to the result's dtype after. kind "gather": op `op`'s operand
    `pos`, a weight, gathered as `dtype` (int8) with one bf16 scale per `block` elements of its
    last dimension. kind "reduce": op `op`'s result, a gradient's partial sums over mesh axes
    `axes`, cut along its dimension `pos` into one chunk per device and exchanged as `dtype` (int8).
    """

    kind: str
    op: int
    pos: int
    dtype: str
    block: int = 0
    axes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How to run one program on one mesh.

    Attributes:
      mesh: the logical mesh.
      input_paths / input_specs: pytree path and sharding of each flattened argument leaf.
      output_paths / output_specs: same for results (None: left to XLA).
      op_specs: (op index, result position, spec) for every intermediate the plan constrains.
      prediction: predicted time, memory and communication.
      decisions: per ILP decision, the choice and the runner-up (for `explain`).
      solver: how the plan was found (`SolverStats`: status, times, problem size).
      options: the options the plan was made with, as it records them (`PlanOptions.recorded`).
      fallback_primitives: primitives planned replicated for lack of a rule.
      kernels: how the plan priced the program's fused kernels, one line each (which attention
        implementation it assumed for the target, which kernels run on shards).
      wire: the collectives it runs in another dtype than their values' (`WireFormat`): float32
        partial sums under comm_precision "exact", int8 weight gathers under "int8".
      operand_specs: (op index, operand position, spec) where an op reads an operand in another
        layout than its producer left it: the planned resharding, pinned so XLA reshards there
        instead of picking another decomposition of the op.
      stages: pipeline stages (`PipelineStage`: layers, submesh, mesh, ...); empty for a one-stage plan.
      pipeline: pipeline-level facts when the plan was made with `pipeline=True/"auto"`
        (`PipelineFacts`: schedule, num_microbatches, num_stages, bubble_fraction, the single-stage
        comparison; see `planner.stages.pipeline_plan.PipelinePlan.facts`); None otherwise.
      scatter_specs: (op index, result position, spec before the scatter) of partial sums the plan
        reduce-scatters; emission pins the reduced value first so XLA reduces, then slices (the
        pattern its reduce-scatter pass recognises), instead of resharding an operand.
      in_tree / out_tree / jax_mesh: bound at planning time; not serialised (see `bind`).
      user_constraints: the step's own sharding constraints (`with_sharding_constraint`,
        `jax.sharding.reshard`), each a `UserConstraint`.
      levers: the memory levers the plan uses (`Levers`), records that emission reads (so they
        take part in equality, unlike `solver`): `accumulation` (`planner.levers.accumulate`: k
        microbatches), `remat` (`planner.levers.remat`: policy and layers recomputed), `offload`
        (`planner.ilp.offload`: argument and output positions kept in host memory).
    """

    mesh: MeshSpec
    input_paths: tuple[str, ...]
    input_specs: tuple[Spec, ...]
    output_paths: tuple[str, ...]
    output_specs: tuple[Spec | None, ...]
    op_specs: tuple[tuple[int, int, Spec], ...]
    prediction: Prediction
    decisions: tuple[Decision, ...]
    solver: SolverStats = dataclasses.field(compare=False)  # timings differ run to run
    options: PlanOptions = dataclasses.field(default_factory=PlanOptions)
    fallback_primitives: tuple[str, ...] = ()
    scatter_specs: tuple[tuple[int, int, Spec], ...] = ()
    stages: tuple[PipelineStage, ...] = ()
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()
    pipeline: PipelineFacts | None = dataclasses.field(default=None, compare=False)
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    jax_mesh: jax.sharding.Mesh | None = dataclasses.field(default=None, compare=False, repr=False)
    assumed_xla_flags: tuple[str, ...] = ()
    user_constraints: tuple[UserConstraint, ...] = ()
    levers: Levers = dataclasses.field(default_factory=Levers)
    kernels: tuple[str, ...] = ()
    wire: tuple[WireFormat, ...] = ()

    def with_levers(self, **records: Any) -> Plan:
        """This plan with the lever records given (`Levers` fields: accumulation=, remat=, offload=)."""
        return dataclasses.replace(self, levers=dataclasses.replace(self.levers, **records))

    def xla_flags(self) -> list[str]:
        """The XLA flags the prediction assumes (the latency-hiding scheduler and collective combiner
        thresholds under which gradient reductions overlap the backward pass); empty when it
        assumes none. Apply them before JAX starts its backend, e.g.
        `os.environ["XLA_FLAGS"] = " ".join(plan.xla_flags())` (TPU: `LIBTPU_INIT_ARGS`);
        `planner plan` prints them."""
        return list(self.assumed_xla_flags)

    # ----- shardings -------------------------------------------------------------------------
    def _mesh(self) -> jax.sharding.Mesh:
        return self.jax_mesh if self.jax_mesh is not None else self.mesh.to_jax_mesh()

    def _tree(self, tree, paths: Sequence[str], what: str):
        if tree is None:
            raise InvalidArgumentError(
                f"this plan has no {what} pytree structure (it was loaded from JSON); "
                "call plan.bind(*example_args) or use the flat `*_specs` fields"
            )
        return tree

    @property
    def in_shardings(self):
        """Pytree (matching the argument tuple) of `NamedSharding`s."""
        tree = self._tree(self.in_tree, self.input_paths, "input")
        m = self._mesh()
        return jax.tree_util.tree_unflatten(tree, [named_sharding(s, self.mesh, m) for s in self.input_specs])

    @property
    def out_shardings(self):
        """Pytree (matching the result) of `NamedSharding`s (None where XLA may choose)."""
        tree = self._tree(self.out_tree, self.output_paths, "output")
        m = self._mesh()
        leaves = [None if s is None else named_sharding(s, self.mesh, m) for s in self.output_specs]
        return jax.tree_util.tree_unflatten(tree, leaves)

    def bind(self, *args, mesh: jax.sharding.Mesh | None = None, out_tree=None) -> Plan:
        """Attaches the argument structure of `args` (and optionally a real mesh) to a loaded plan."""
        with_path, in_tree = jax.tree_util.tree_flatten_with_path(args)
        paths = tuple(jax.tree_util.keystr(p) for p, _ in with_path)
        if paths != self.input_paths:
            raise InvalidArgumentError(
                f"arguments do not match the plan: plan has {len(self.input_paths)} input leaves, got {len(paths)}"
                + (f"; first difference at {next(a for a, b in zip(paths, self.input_paths) if a != b)}"
                   if any(a != b for a, b in zip(paths, self.input_paths)) else "")
            )
        return dataclasses.replace(self, in_tree=in_tree, jax_mesh=mesh or self.jax_mesh,
                                   out_tree=out_tree or self.out_tree)

    def spec_of(self, path: str) -> Spec:
        """The sharding of the input leaf at pytree `path`, e.g. "[0]['params']['w']"."""
        try:
            return self.input_specs[self.input_paths.index(path)]
        except ValueError:
            raise KeyError(f"no input leaf at {path!r}; known paths start {self.input_paths[:3]}") from None

    # ----- text ------------------------------------------------------------------------------
    def summary(self, max_rows: int = 40) -> str:
        """A readable table: mesh, predictions, and the sharding of each input leaf."""
        p = self.prediction
        lines = [
            f"Plan on mesh {self.mesh} ({', '.join(f'{n}={s}' for n, s in zip(self.mesh.axis_names, self.mesh.shape))})",
            f"  predicted step time   {p.step_time_s * 1e3:10.3f} ms  (compute {p.compute_time_s * 1e3:.3f} ms, "
            f"communication {p.communication_time_s * 1e3:.3f} ms)",
            f"  memory per device     {format_bytes(p.memory_bytes_per_device):>13}",
            f"  bytes moved / device  {format_bytes(p.bytes_moved_per_device):>13} in {len(p.collectives)} collectives",
            f"  solver                {self.solver.status} in {self.solver.solve_time_s or 0:.2f} s "
            f"({self.solver.decisions} decisions, {self.solver.variables_shared} after layer sharing)"
            + solver_quality(self.solver),
        ]
        if self.fallback_primitives:
            lines.append(f"  replicated (no rule)  {', '.join(self.fallback_primitives)}")
        lines += [f"  kernels               {k}" for k in self.kernels]
        if self.pipeline:
            pl = self.pipeline
            lines.append(f"  pipeline              {pl.num_stages} stage(s), {pl.num_microbatches} "
                         f"microbatches, {pl.schedule}, bubble {float(pl.bubble_fraction or 0):.1%}")
            for k, st in enumerate(self.stages):
                mesh = "x".join(str(v) for v in st.mesh.shape) if st.mesh is not None else ""
                layers = list(st.layers or ())
                names = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]} ({len(layers)})" if layers else ""
                devices = list(st.devices or ()) or ["?"]
                lines.append(f"    stage {k}: {names:<28} submesh {'x'.join(map(str, st.submesh or ()))} "
                             f"mesh {mesh:<5} devices {devices[0]}-{devices[-1]}  {stage_way(st)}")
        if self.stages:
            lines.append("  inputs: sharded per stage, on each stage's own mesh (stages[i]['shardings'])")
            return "\n".join(lines)
        lines.append("  inputs:")
        rows = _collapse_layers(list(zip(self.input_paths, (format_spec(s, self.mesh) for s in self.input_specs))))
        for path, spec, count in rows[:max_rows]:
            lines.append(f"    {path:<70} {spec}" + (f"   (x{count})" if count > 1 else ""))
        if len(rows) > max_rows:
            lines.append(f"    ... {len(rows) - max_rows} more rows")
        return "\n".join(lines)

    # ----- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def to_dict(self) -> dict:
        p = self.prediction
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "mesh": {n: int(k) for n, k in zip(self.mesh.axis_names, self.mesh.shape)},
            "shardings": {a: _spec_names(s, self.mesh) for a, s in zip(self.input_paths, self.input_specs)},
            "stages": [st.to_json() for st in self.stages] or [{
                "layers": "all", "submesh": list(self.mesh.shape),
                "mesh": {n: int(k) for n, k in zip(self.mesh.axis_names, self.mesh.shape)}}],
            "inputs": [{"path": a, "spec": spec_to_json(s)} for a, s in zip(self.input_paths, self.input_specs)],
            "outputs": [{"path": a, "spec": None if s is None else spec_to_json(s)}
                        for a, s in zip(self.output_paths, self.output_specs)],
            "op_specs": [[i, k, spec_to_json(s)] for i, k, s in self.op_specs],
            "predicted": {
                "step_time_s": p.step_time_s,
                "compute_time_s": p.compute_time_s,
                "communication_time_s": p.communication_time_s,
                "hidden_communication_time_s": p.hidden_communication_time_s,
                "memory_bytes_per_device": p.memory_bytes_per_device,
                "bytes_moved_per_device": p.bytes_moved_per_device,
                "collectives": [dataclasses.asdict(c) for c in p.collectives],
            },
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
            "solver": self.solver.to_json(),
            "options": self.options.to_json(),
            "fallback_primitives": list(self.fallback_primitives),
            "scatter_specs": [[i, k, spec_to_json(s)] for i, k, s in self.scatter_specs],
            "operand_specs": [[i, k, spec_to_json(s)] for i, k, s in self.operand_specs],
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else {},
            "xla_flags": list(self.assumed_xla_flags),
            "user_constraints": [c.to_json() for c in self.user_constraints],
            "levers": self.levers.to_json(),
            "kernels": list(self.kernels),
            "wire": [dataclasses.asdict(w) for w in self.wire],
        }

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"not a valid plan JSON: {type(e).__name__}: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """The plan of its JSON form (`to_dict`)."""
        try:
            if d.get("format_version") != PLAN_FORMAT_VERSION:
                raise InvalidArgumentError(
                    f"plan format version {d.get('format_version')!r} is not {PLAN_FORMAT_VERSION}; re-plan")
            mesh = MeshSpec(tuple(int(v) for v in d["mesh"].values()), tuple(d["mesh"]))
            p = d["predicted"]
            pred = Prediction(
                p["step_time_s"], p["compute_time_s"], p["communication_time_s"], int(p["memory_bytes_per_device"]),
                p["bytes_moved_per_device"],
                tuple(PredictedCollective(c["kind"], tuple(c["axes"]), int(c["nbytes"]), int(c["group_size"]),
                                          c["where"], c["reason"]) for c in p["collectives"]),
                float(p.get("hidden_communication_time_s", 0.0)),
            )
            return cls(
                mesh=mesh,
                input_paths=tuple(x["path"] for x in d["inputs"]),
                input_specs=tuple(spec_from_json(x["spec"]) for x in d["inputs"]),
                output_paths=tuple(x["path"] for x in d["outputs"]),
                output_specs=tuple(None if x["spec"] is None else spec_from_json(x["spec"]) for x in d["outputs"]),
                op_specs=tuple((int(i), int(k), spec_from_json(s)) for i, k, s in d["op_specs"]),
                prediction=pred,
                decisions=tuple(_decision_from_json(x) for x in d["decisions"]),
                solver=SolverStats.from_json(d["solver"]),
                options=PlanOptions.from_json(d["options"]),
                fallback_primitives=tuple(d.get("fallback_primitives", ())),
                kernels=tuple(d.get("kernels", ())),
                wire=tuple(WireFormat(**{**w, "axes": tuple(w.get("axes", ()))}) for w in d.get("wire", ())),
                scatter_specs=tuple((int(i), int(k), spec_from_json(s)) for i, k, s in d.get("scatter_specs", ())),
                operand_specs=tuple((int(i), int(k), spec_from_json(s)) for i, k, s in d.get("operand_specs", ())),
                stages=tuple(PipelineStage.from_json(st, cls.from_dict) for st in d.get("stages", ())
                             if st.get("layers") != "all"),
                pipeline=PipelineFacts.from_json(d["pipeline"]) if d.get("pipeline") else None,
                assumed_xla_flags=tuple(d.get("xla_flags", ())),
                user_constraints=tuple(UserConstraint.from_json(c) for c in d.get("user_constraints", ())),
                levers=Levers.from_json(d.get("levers") or {k: d["solver"][k] for k in LEVER_NAMES
                                                            if k in d["solver"]}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"not a valid plan JSON: {type(e).__name__}: {e}") from None


def _spec_names(spec: Spec, mesh: MeshSpec) -> list:
    """JSON form of a PartitionSpec: one entry per dim, None / axis name / list of axis names."""
    out: list = []
    for axes in spec:
        names = [mesh.axis_names[a] for a in axes]
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return out


def _collapse_layers(rows: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Collapses rows that differ only in a layer index into one row with a count."""
    out: dict[tuple[str, str], int] = {}
    for path, spec in rows:
        key = (star_indices(path), spec)
        out[key] = out.get(key, 0) + 1
    return [(p, s, n) for (p, s), n in out.items()]
