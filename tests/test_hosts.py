"""Hosts read from live devices (planning/hosts.py): devices of several processes planned as hosts.

Fake devices stand in for a multi-process run's (their `process_index` is all that is read);
tests/test_multihost.py plans on two real processes."""
from __future__ import annotations

import types

import numpy as np
import pytest

from planner.core.options import PlanOptions
from planner.planning.hosts import live_hosts, mesh_host_axes


def _devices(procs):
    return [types.SimpleNamespace(id=i, process_index=p) for i, p in enumerate(procs)]


def _mesh(devices, shape):
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return types.SimpleNamespace(devices=grid.reshape(shape))


def test_mesh_axes_that_cross_processes():
    two_hosts = _devices([0] * 4 + [1] * 4)
    assert mesh_host_axes(_mesh(two_hosts, (2, 4)).devices) == (0,)
    assert mesh_host_axes(_mesh(two_hosts, (4, 2)).devices) == (0,)  # the axis spans hosts in part
    assert mesh_host_axes(_mesh(two_hosts, (8,)).devices) == (0,)
    interleaved = _devices([0, 1] * 4)
    assert mesh_host_axes(_mesh(interleaved, (4, 2)).devices) == (1,)
    assert mesh_host_axes(_mesh(_devices([0] * 8), (2, 4)).devices) == ()


def test_the_options_and_devices_planned_with():
    opts = PlanOptions()
    two_hosts = _devices([1] * 4 + [0] * 4)
    live = live_hosts(opts, two_hosts, _mesh(two_hosts, (2, 4)))
    assert live.options.inter_host_axes == (0,) and live.devices_per_host is None
    live = live_hosts(opts, two_hosts)
    assert live.devices_per_host == 4 and live.options == opts
    assert [d.process_index for d in live.devices] == [0] * 4 + [1] * 4  # process order, each keeps its own
    assert [d.id for d in live.devices[:4]] == [4, 5, 6, 7]
    # One process, or options that say the hosts themselves: unchanged.
    one = _devices([0] * 8)
    assert live_hosts(opts, one) == live_hosts(opts, one, None)
    assert live_hosts(opts, one).devices_per_host is None
    for given in (PlanOptions(hardware="2x4:v100"), PlanOptions(inter_host_axes=(1,))):
        live = live_hosts(given, two_hosts, _mesh(two_hosts, (2, 4)))
        assert live.options == given and live.devices_per_host is None
    # Processes holding different numbers of devices: no one count per host, planned as one host.
    assert live_hosts(opts, _devices([0] * 5 + [1] * 3)).devices_per_host is None


def test_stages_across_processes_need_transfers_between_them():
    """Here (XLA:CPU, `jax_cross_host_transfer_socket_address` unset) arrays cannot move between
    processes: stages on devices of two processes are refused in one line naming the flag; one
    process runs them. (tests/test_multihost.py runs a pipeline over two processes with it set.)"""
    from planner.core.errors import InvalidArgumentError
    from planner.planning.hosts import check_stages_can_run, process_cluster, stages_can_run

    two_hosts = _devices([0] * 4 + [1] * 4)
    assert stages_can_run(_devices([0] * 8)) and not stages_can_run(two_hosts)
    with pytest.raises(InvalidArgumentError, match="jax_cross_host_transfer_socket_address"):
        check_stages_can_run(two_hosts, "pipeline=True")
    # an explicit pipeline plans for the cluster of the processes
    assert process_cluster(PlanOptions(hardware="h100"), two_hosts, 4).hardware == "2x4:h100-sxm"
    assert process_cluster(PlanOptions(), two_hosts, None) == PlanOptions()
    assert process_cluster(PlanOptions(hardware="1x8:v100"), two_hosts, 4).hardware == "1x8:v100"
