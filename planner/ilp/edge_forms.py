"""An edge's resharding cost in the form the CP-SAT model adds it (`cpsat._Model._edge`), in strategy
indices, computed once per cost model.

Per part of `strategies.edge_parts` the cost depends on the producer's spec and on the consumer's
`part_key`; producer strategies with equal cost rows share a row, consumer strategies with equal cost
columns a column (the aggregated transportation polytope of `_Model._edge`). That grouping is the
same for every ILP asking about the same tensor, spec lists and multiplier on the same mesh model,
and the layer ILPs of a stage table ask the same questions many times over (GPT-39B at batch 1024
on 8x8 V100s: 251 CP-SAT models built, most of their edges seen before), so it is kept on the cost
model (`CostModel.edge_forms`) beside the part times themselves (`CostModel.part_times`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.core.sharding import Spec
from planner.ilp.strategies import edge_parts, part_key, part_time
from planner.ilp.ticks import _NS


@dataclasses.dataclass(frozen=True, slots=True)
class PartForm:
    """One part's cost: `rows[r]` the producer strategies (indices) of the r-th distinct cost row,
    `cols[c]` the consumer strategies of the c-th distinct cost column, `ticks[c][r]` the cost (model
    units) of row r meeting column c."""

    rows: tuple[tuple[int, ...], ...]
    cols: tuple[tuple[int, ...], ...]
    ticks: tuple[tuple[int, ...], ...]


def edge_form(t, src_specs: Sequence[Spec], dst_specs: Sequence[Spec], mult: int, cost) -> tuple[PartForm, ...]:
    """The parts of the edge from a producer choosing among `src_specs` to a consumer choosing among
    `dst_specs` (different nodes) carrying `t`, `mult` times, that cost anything (`_edge_form`)."""
    key = (t, tuple(src_specs), tuple(dst_specs), mult)
    found = cost.edge_forms.get(key)
    if found is None:
        found = cost.edge_forms[key] = _edge_form(t, src_specs, dst_specs, mult, cost)
    return found


def _edge_form(t, src_specs: Sequence[Spec], dst_specs: Sequence[Spec], mult: int, cost) -> tuple[PartForm, ...]:
    by_src: dict = {}
    for i, s in enumerate(src_specs):
        by_src.setdefault(s, []).append(i)
    forms = []
    for part in edge_parts(cost.mesh):
        by_key: dict = {}
        for j, r in enumerate(dst_specs):
            by_key.setdefault(part_key(part, r), []).append(j)
        keys = list(by_key)
        ticks = {s: tuple(int(round(part_time(t, s, part, q, cost) * mult * _NS)) for q in keys) for s in by_src}
        if not any(any(row) for row in ticks.values()):
            continue
        rows: dict = {}
        for s, idx in by_src.items():
            rows.setdefault(ticks[s], []).extend(idx)
        cols: dict = {}
        for k, q in enumerate(keys):
            cols.setdefault(tuple(row[k] for row in rows), []).extend(by_key[q])
        forms.append(PartForm(tuple(map(tuple, rows.values())), tuple(map(tuple, cols.values())), tuple(cols)))
    return tuple(forms)
