"""Hosts read from live devices: devices that span several processes (`jax.distributed`, one process
per host) are planned as the hosts they are, not as one host.

A process's devices share the fast link (NVLink, the host's own memory); the links between
processes are the slower network, whatever `hardware=` names as its inter-host link. So where the
options name no cluster (`hardware="2x8:h100"` says it itself), no `inter_host_axes` and no
measured profile (whose levels were measured across the processes already):

- on the user's mesh, the axes along which the devices' process changes are the inter-host axes
  (`mesh_host_axes`: read from the mesh's own device array, however it was laid out);
- without a mesh, the mesh search derives each candidate's inter-host axes from the devices per
  process (`search_meshes(devices_per_host=)`), with the devices in process order, as the
  candidates' row-major layouts assume (JAX lists them so by default).

Pipeline stages run across processes where arrays can move between them (`jax.device_put` to
devices another process owns: `compat.cross_process_transfers`, a backend that supports it or
`jax_cross_host_transfer_socket_address` set): every process runs the same schedule, each program
executing on the processes whose devices it spans, each process placing its own shards of the
step's inputs (`emit.pipeline.runtime._put`), activations move with `_send`. Elsewhere stages are
not weighed, and `pipeline=` is a one-line error naming the flag. Without a mesh the stage search
(weighed by default, or asked for) plans for the cluster of the processes (`process_cluster`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from planner.core.compat import cross_process_transfers
from planner.core.errors import InvalidArgumentError
from planner.core.options import PlanOptions
from planner.cost_model import Cluster, Hardware, get_hardware

log = logging.getLogger(__name__)


def process_of(device: Any) -> int:
    """The process that owns `device` (0 for objects that carry none)."""
    return int(getattr(device, "process_index", 0))


def process_count(devices: Sequence[Any]) -> int:
    """How many processes own `devices`."""
    return len({process_of(d) for d in devices})


def mesh_host_axes(device_grid: Any) -> tuple[int, ...]:
    """Axes of a mesh's device array (`jax.sharding.Mesh.devices`) along which the owning process
    changes: their collectives cross the network between hosts."""
    grid = np.asarray(device_grid, dtype=object)
    procs = np.vectorize(process_of, otypes=[int])(grid)
    return tuple(a for a in range(procs.ndim) if procs.shape[a] > 1 and bool((np.diff(procs, axis=a) != 0).any()))


@dataclasses.dataclass(frozen=True)
class LiveHosts:
    """What `live_hosts` found. `options`: the options to plan with; `devices`: the devices, in
    process order where the mesh search lays meshes out; `devices_per_host`: the devices of each
    process for the mesh search (None: one host, or the options say the hosts themselves)."""

    options: PlanOptions
    devices: tuple[Any, ...]
    devices_per_host: int | None = None


def live_hosts(options: PlanOptions, devices: Sequence[Any], jax_mesh: Any = None) -> LiveHosts:
    """The options and devices a step on `devices` (bound to `jax_mesh`, when the user gave one) is
    planned with, its hosts read from the devices' processes (see the module docstring)."""
    found = tuple(devices)
    hosts = process_count(found)
    if (hosts < 2 or Cluster.is_cluster(options.hardware) or options.inter_host_axes
            or options.profile is not None):
        return LiveHosts(options, found)
    if jax_mesh is not None:
        axes = mesh_host_axes(jax_mesh.devices)
        log.info("the mesh's devices span %d processes: axes %s planned over the inter-host link", hosts, axes)
        return LiveHosts(dataclasses.replace(options, inter_host_axes=axes), found)
    counts = collections.Counter(process_of(d) for d in found)
    if len(set(counts.values())) != 1:
        log.warning("the devices span %d processes with %s devices each: not one count per host, so they are "
                    "planned as one host; pass hardware='HOSTSxDEVICES:PRESET' or a mesh", hosts,
                    sorted(counts.values()))
        return LiveHosts(options, found)
    ordered = tuple(sorted(found, key=process_of))  # stable: each process's devices keep their order
    return LiveHosts(options, ordered, len(found) // hosts)


def stages_can_run(devices: Sequence[Any]) -> bool:
    """Whether the pipeline runtime can run stages on `devices`: one process, or arrays can move
    between the processes (`compat.cross_process_transfers`)."""
    return process_count(devices) < 2 or cross_process_transfers()


def check_stages_can_run(devices: Sequence[Any], asked: str) -> None:
    """Raises the one-line InvalidArgumentError where `stages_can_run` does not hold."""
    if not stages_can_run(devices):
        raise InvalidArgumentError(
            f"{asked}: these devices span {process_count(devices)} processes and pipeline stages move activations "
            "between them, which this backend cannot do unless jax.config.update("
            "'jax_cross_host_transfer_socket_address', 'HOST:PORT') is set in each process before "
            "jax.distributed.initialize; or plan without pipeline= (sharding over every process)")


def process_cluster(options: PlanOptions, devices: Sequence[Any], devices_per_host: int | None) -> PlanOptions:
    """`options` naming the cluster of the devices' processes ("2x4:PRESET") where `live_hosts`
    found one count of devices per process and the options name a preset (or none), so that a
    pipeline plans its stages over those hosts; unchanged otherwise."""
    if devices_per_host is None or isinstance(options.hardware, Hardware) or Cluster.is_cluster(options.hardware):
        return options
    hw = get_hardware(options.hardware)
    return dataclasses.replace(options, hardware=f"{len(devices) // devices_per_host}x{devices_per_host}:{hw.name}")
