"""A plan on its cluster's topology: each mesh axis across and inside the fast domains, and the mesh
as MaxText's `ici_*` / `dcn_*` parallelism settings (`planner plan` prints both for topology
clusters, `cost_model.topology`). `view` is a `present.report.PlanView`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

def topology_line(view: Any, topo: Mapping[str, Any]) -> str:
    """Each mesh axis with its size across fast domains (DCN) and inside one (ICI / NVLink)."""
    split = topo.get("split") or ()
    parts = []
    for name, (across, inside) in zip(view.axis_names, split):
        parts.append(f"{name}={across * inside}" + (f" ({across} across x {inside} inside)" if across > 1 else
                                                   " (inside)"))
    return f"{topo.get('text', '?')}: " + ", ".join(parts)


_MAXTEXT_ROLES = ("data", "fsdp", "tensor", "sequence")


def axis_role(view, axis: str) -> str:
    """What a mesh axis does, in MaxText's mesh-axis vocabulary: "fsdp" when it splits parameters and
    the batch, "tensor" when parameters but not the batch, "sequence" when a data dimension other
    than the batch, "data" otherwise (the batch only, or nothing)."""
    params = batch = seq = False
    for leaf in view.leaves or ():
        dims = [axis in axes for axes in leaf.spec]
        if leaf.role == "param" and any(dims):
            params = True
        elif leaf.role == "data" and dims:
            batch = batch or dims[0]
            seq = seq or any(dims[1:])
    return "fsdp" if params and batch else "tensor" if params else "sequence" if seq and not batch else "data"


def maxtext_mesh(view: Any, topo: Mapping[str, Any]) -> str:
    """The plan's mesh as MaxText's `ici_*_parallelism` / `dcn_*_parallelism` settings (each axis
    named by its role, `axis_role`; two axes of one role are multiplied, as MaxText would lay them
    on one axis)."""
    split = topo.get("split") or ()
    ici: dict[str, int] = {}
    dcn: dict[str, int] = {}
    for name, (across, inside) in zip(view.axis_names, split):
        role = axis_role(view, name)
        ici[role] = ici.get(role, 1) * inside
        dcn[role] = dcn.get(role, 1) * across
    roles = [r for r in _MAXTEXT_ROLES if r in ici]
    text = " ".join(f"ici_{r}_parallelism={ici[r]}" for r in roles)
    if any(dcn[r] > 1 for r in roles):
        text += " " + " ".join(f"dcn_{r}_parallelism={dcn[r]}" for r in roles if dcn[r] > 1)
    names = ", ".join(f"{n}->{axis_role(view, n)}" for n in view.axis_names)
    return f"{text}  ({names})"
