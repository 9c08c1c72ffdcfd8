"""A pipeline stage's lowered programs (`PipelinedStep.lower`)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StageLowered:
    """One stage's lowered programs (`PipelinedStep.lower`, `.lower()` of a pipelined plan).

    Attributes:
      index: the stage's position in the pipeline.
      devices: its devices; mesh: the `jax.sharding.Mesh` its programs run on.
      forward: one microbatch's forward (outputs and the residuals the backward needs).
      backward: one microbatch's backward (gradient accumulation and input cotangents).
      update: the optimizer update of the stage's parameters.
      plan: the stage's intra-op `Plan` of one microbatch's forward + backward (its prediction
        lists the collectives the forward and backward together should compile to).
      data_axes: mesh axes over which the stage accumulates gradients per replica, reducing them in
        its update once per step (`programs.Replica`); empty: the backward reduces them.
      shards_optimizer: its update reduce-scatters those gradients into a split optimizer state and
        all-gathers the parameters back (the sharded- and offloaded-optimizer layouts) where the
        plan's prediction all-reduces them.
      streamed_updates: in the offloaded-optimizer layout, (parameter leaf, its update program) per
        parameter the stage owns: the programs the step runs one after the other in place of
        `update` (which stays the whole update, for its collectives).
    """

    index: int
    devices: tuple[Any, ...]
    mesh: Any
    forward: Any
    backward: Any
    update: Any
    plan: Any = None
    data_axes: tuple[str, ...] = ()
    shards_optimizer: bool = False
    streamed_updates: tuple[tuple[int, Any], ...] = ()

    def programs(self) -> dict[str, Any]:
        return {"forward": self.forward, "backward": self.backward, "update": self.update}
