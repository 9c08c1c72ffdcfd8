"""Automatic parallelization planner for JAX.

    step = planner.plan_parallel(train_step, mesh=(2, 4))
    state, metrics = step(state, batch)
    print(step.plan(state, batch).summary())
"""
from planner.api import PlannedFunction, plan, plan_parallel
from planner.planning.evaluate import Comparison, compare, evaluate
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, MeshError, PlannerError, ProfileError
from planner.graph.ir import Graph
from planner.graph.trace import trace
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.emit.declared import register_kernel
from planner.search.candidates import candidate_meshes
from planner.stages.step import pipelinable

__all__ = [
    "Comparison", "Graph", "InfeasiblePlanError", "InvalidArgumentError", "MeshError", "MeshSpec", "Plan", "PlanOptions",
    "PlannedFunction", "PlannerError", "ProfileError", "candidate_meshes", "compare", "evaluate", "pipelinable", "plan", "plan_parallel",
    "register_kernel", "trace",
]
