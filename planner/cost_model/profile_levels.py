"""Per-level links a profile measured: how a profile of one shape of the hardware prices another.

`planner profile` measures every collective over every axis group of its mesh; a single-axis group
crosses one level of the profiled devices' topology (a host, a torus dimension, the network between
hosts or slices). The fits of those groups, turned into that level's link (per device on a switched
level, per port on a torus), are what the hardware offers whatever the cluster's shape
(`CostModel.from_profiled_levels`).
"""
from __future__ import annotations

from planner.cost_model.collectives import ring_bytes, ring_steps
from planner.cost_model.profile_db import ProfileDB
from planner.cost_model.topology import Link, Topology, parse_topology, two_level


def profiled_topology(db: ProfileDB) -> Topology:
    """The profiled devices' topology: the recorded one, else the processes as hosts on a network
    (device positions process-major, as `jax.devices()` orders them). Only its structure is used."""
    if db.topology:
        return parse_topology(db.topology)[0]
    hosts = max(1, len(set(db.host_of)))
    links = Link(1.0, 0.0)  # placeholders: `measured_levels` reads the structure
    return two_level(hosts, db.num_devices // hosts, links, links)


def measured_levels(db: ProfileDB) -> dict[int, Link]:
    """Each level of the profiled topology that a measured single-axis collective crossed (its
    outermost level), with the link the measurements imply: per device for a switched level, per
    port for a torus (the group's bandwidth over the ports its ring used, `Level.ports`); the
    median over the groups and kinds (all-gather, reduce-scatter, all-reduce) measured on it.

    This is how a profile of one slice (or host count) serves another topology of the same devices:
    the levels' links are the hardware's, whatever the shape (`CostModel.from_profile`)."""
    topo = profiled_topology(db)
    if topo.num_devices != db.num_devices:
        return {}
    found: dict[int, list[tuple[float, float]]] = {}
    for e in db.collectives:
        n = e.group_size
        if len(e.axes) != 1 or n < 2 or e.collective not in ("all-gather", "reduce-scatter", "all-reduce"):
            continue
        c = db.curve(e)
        if c.slope <= 0:
            continue
        level, ports = topo.group_ports(e.devices)
        beta = c.slope / ring_bytes(e.collective, 1.0, n)
        found.setdefault(level, []).append((1.0 / (beta * ports), max(0.0, c.fit.alpha / ring_steps(e.collective, n))))
    out = {}
    for level, pairs in found.items():
        bws = sorted(b for b, _ in pairs)
        lats = sorted(a for _, a in pairs)
        out[level] = Link(bws[len(bws) // 2], lats[len(lats) // 2])
    return out
