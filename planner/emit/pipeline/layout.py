"""Where each pipeline stage runs: its layers, devices, logical mesh and input shardings.

`StageLayout` is what `PipelinedStep` runs; `even_layouts` builds simple ones by hand, and the
spec helpers find a leaf's sharding from a stage's specs keyed by train-step or loss paths.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from planner.core.errors import InvalidArgumentError
from planner.graph.trace import trace
from planner.core.mesh import MeshSpec
from planner.core.sharding import Spec, is_valid, replicated
from planner.stages.clustering import cluster_layers


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where and how one stage runs.

    Attributes:
      layers: names of the layers it runs (as `cluster_layers` names them: "pre", "blocks_3", ...).
      devices: its devices.
      mesh: the logical mesh over `devices`.
      specs: sharding of program inputs by pytree path (parameters and batch leaves; paths of the
        train step such as "[0]['params']['blocks_3']['mlp']['fc_in']['kernel']" or of `loss_fn`'s
        own arguments); missing leaves: parameters replicated, batch leaves split over the whole
        mesh along axis 0 where it divides.
      remat: recompute the forward in the backward instead of keeping activations.
      data_axes: axes of `mesh` that split the stage's batch (its data-parallel replicas), as the
        plan priced them (`pipeline_plan.StagePlan.data_axes`: axes splitting any layer's activations or
        batch leaves by rows); None: read from the batch specs (`data_axes`).
      shard_optimizer: the sharded-optimizer state layout: the optimizer state split over the data
        axes too, reduce-scattered into and gathered back from once per step (`programs`).
      offload_optimizer: the offloaded-optimizer state layout: that optimizer state (split so where
        the stage has replicas) kept in host memory between updates.
      kept_layers: under `remat`, how many of `layers`' last layers keep their activations (their
        backward reads them as the forward left them); the layers before them are recomputed from
        the stage's input (`programs.recompute_cut`). 0: the whole forward is recomputed.
      offload_activations: without remat, each microbatch's saved activations wait in host memory
        (`pinned_host`) between its forward and its backward, copied back one backward ahead.
      offload_params: with `offload_optimizer`, the float32 master parameters the stage reads only
        by casting them to a narrower float wait in host memory too: each step copies them in one at
        a time as their cast copies, which the microbatches read, and the update copies them in
        and back with their optimizer state (`programs.master_casts`).
    """

    layers: tuple[str, ...]
    devices: tuple[Any, ...]
    mesh: MeshSpec
    specs: Mapping[str, Spec] = dataclasses.field(default_factory=dict)
    remat: bool = False
    data_axes: tuple[int, ...] | None = None
    shard_optimizer: bool = False
    offload_optimizer: bool = False
    kept_layers: int = 0
    offload_activations: bool = False
    offload_params: bool = False

    def __post_init__(self):
        if len(self.devices) != self.mesh.size:
            raise InvalidArgumentError(
                f"stage mesh {self.mesh} needs {self.mesh.size} devices but {len(self.devices)} were given")
        if self.kept_layers and not (self.remat and 0 < self.kept_layers < len(self.layers)):
            raise InvalidArgumentError(
                f"kept_layers={self.kept_layers} needs remat=True and fewer kept layers than the stage's "
                f"{len(self.layers)}")
        if self.offload_params and not self.offload_optimizer:
            raise InvalidArgumentError("offload_params needs offload_optimizer=True (the masters wait in host memory "
                                       "with their optimizer state)")
        if self.offload_activations and self.remat:
            raise InvalidArgumentError("offload_activations is for a stage that keeps its activations (remat=False)")

    @property
    def recomputes_all(self) -> bool:
        """The backward recomputes the whole forward from the stage's inputs (nothing else kept)."""
        return self.remat and not self.kept_layers


def layer_names(loss_fn: Callable[..., Any], params: Any, batch: Any) -> tuple[str, ...]:
    """The layers `PipelinedStep` splits `loss_fn` into (to build stage layouts by hand)."""
    return cluster_layers(trace(loss_fn, params, batch)).names


def even_layouts(names: Sequence[str], devices: Sequence[Any], num_stages: int) -> tuple[StageLayout, ...]:
    """`num_stages` stages of consecutive layers (as even as possible), each on an equal slice of
    `devices` as a 1-D mesh: a simple layout for tests and manual use."""
    if not 1 <= num_stages <= len(names):
        raise InvalidArgumentError(f"num_stages={num_stages} must be between 1 and the {len(names)} layers")
    if len(devices) % num_stages:
        raise InvalidArgumentError(f"{len(devices)} devices do not split evenly into {num_stages} stages")
    per = len(devices) // num_stages
    cuts = np.linspace(0, len(names), num_stages + 1).round().astype(int)
    return tuple(StageLayout(tuple(names[cuts[s]:cuts[s + 1]]), tuple(devices[s * per:(s + 1) * per]),
                             MeshSpec((per,), ("x",))) for s in range(num_stages))


def find_spec(specs: Mapping[str, Spec], path: str, shape: tuple[int, ...], mesh: MeshSpec) -> Spec | None:
    """The spec of a leaf from a mapping keyed by train-step or loss-function paths (suffix match)."""
    best = None
    for key, spec in specs.items():
        if key == path or (key.endswith(path) and "opt_state" not in key):
            if len(spec) == len(shape) and is_valid(shape, spec, mesh):
                if key == path or key.endswith("['params']" + path):
                    return spec
                best = best or spec
    return best


def data_spec(shape: tuple[int, ...], axes: tuple[int, ...], mesh: MeshSpec) -> Spec:
    if shape and axes and shape[0] % mesh.axis_size(axes) == 0:
        return (axes,) + ((),) * (len(shape) - 1)
    return replicated(len(shape))


def data_axes(lay: StageLayout, batch_paths: Sequence[str], abstract_mb) -> tuple[int, ...]:
    """Mesh axes that split the batch on this stage: the layout's own (`StageLayout.data_axes`, the
    plan's), else those splitting its batch specs' rows, else all axes. The plan's count where they
    differ: a stage that reads the token ids replicated (beside a vocabulary-split embedding) and
    splits its activations by rows is priced as data-parallel, accumulating gradients per replica."""
    if lay.data_axes is not None:
        return tuple(a for a in lay.data_axes if lay.mesh.shape[a] > 1)
    for path, leaf in zip(batch_paths, jax.tree_util.tree_leaves(abstract_mb)):
        spec = find_spec(lay.specs, path, tuple(leaf.shape), lay.mesh)
        if spec is not None:
            return spec[0] if spec else ()
    return tuple(range(lay.mesh.ndim))
