"""Pipeline stages: which layers run together on which submesh (Alpa's inter-op dynamic program).

`clustering` (ops -> layers), `submesh` (cluster, submesh shapes, logical meshes), `stage_cost`
(per-layer intra-op plans -> stage latency and memory), `dp` (the inter-op DP), `inter_op` (the
planning driver), `schedule` (GPipe / 1F1B task orders), `step` (the plain train step, marked),
`derived` (loss and update read from an unmarked step). Running a planned pipeline is emission:
`planner.emit.pipeline`.
"""
