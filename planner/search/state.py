"""The records a mesh search passes between its steps: a mesh with its ILP and bounds, and what the search knows."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.graph.ir import Graph
from planner.ilp.problem import Problem
from planner.search.results import MeshResult


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """A mesh of the search with its ILP and bounds, before it is solved."""

    index: int
    mesh: MeshSpec
    inter: tuple[int, ...]
    options: PlanOptions
    problem: Problem | None = None
    memory_bound: int | None = None
    time_bound: float = 0.0
    build_s: float = 0.0
    refines: tuple | None = None  # (coarse MeshResult, fine axes of each coarse axis): a neighbourhood search


class Fastest:
    """The step time a mesh must beat: the fastest plan's found so far (at first the caller's `beat`).
    The one mutable part of a search: the solves running in other threads read it as it falls."""

    __slots__ = ("step_time_s",)

    def __init__(self, step_time_s: float):
        self.step_time_s = step_time_s


@dataclasses.dataclass(frozen=True)
class Search:
    """What a mesh search knows between its steps; each step returns an updated copy.

    Attributes:
      graph, options, devices, prune: `search_meshes`'s arguments.
      fastest: the step time to beat, shared with the running solves.
      candidates: the meshes built within the budget, to solve.
      deferred: the meshes of three or more axes, built near a plan once one is known (`meshes._refine`).
      built: every mesh whose ILP was built, with its candidate.
      planned, failed, pruned: the results so far: with a plan, with an error, not solved.
      twins: (mesh, its inter-host axes, `mirror_key`) of each mesh another mesh's problem stands for.
      keys: `mirror_key` -> the mesh planned for it.
      floors: devices -> (bytes no plan goes below, what they are).
      lived: the device counts whose `liveness_floor` is known (one built mesh gives it).
      mirrors: the twins' results, once the search is done.
    """

    graph: Graph
    options: PlanOptions
    devices: Sequence[Any] | None
    prune: bool
    fastest: Fastest
    candidates: tuple[Candidate, ...] = ()
    deferred: tuple[Candidate, ...] = ()
    built: Mapping[MeshSpec, Candidate] = dataclasses.field(default_factory=dict)
    planned: tuple[MeshResult, ...] = ()
    failed: tuple[MeshResult, ...] = ()
    pruned: tuple[MeshResult, ...] = ()
    twins: tuple[tuple[MeshSpec, tuple[int, ...], tuple], ...] = ()
    keys: Mapping[tuple, MeshSpec] = dataclasses.field(default_factory=dict)
    floors: Mapping[int, tuple[int, str]] = dataclasses.field(default_factory=dict)
    lived: frozenset[int] = frozenset()
    mirrors: tuple[MeshResult, ...] = ()


def record(search: Search, result: MeshResult) -> Search:
    """`search` with `result` among the meshes not solved, planned (the step time to beat then falls
    to its plan's, if faster) or failed."""
    if result.pruned is not None:
        return dataclasses.replace(search, pruned=search.pruned + (result,))
    if result.plan is not None:
        search.fastest.step_time_s = min(search.fastest.step_time_s, result.plan.prediction.step_time_s)
        return dataclasses.replace(search, planned=search.planned + (result,))
    return dataclasses.replace(search, failed=search.failed + (result,))
