"""Pipeline stages: which layers run together on which submesh (Alpa's inter-op dynamic program).

`clustering` (ops -> layers), `submesh` (cluster, submesh shapes, logical meshes), `layer_facts`
(each layer's ops, parameters and edges), `layer_cost` (one layer's intra-op plan on one logical
mesh), `cost_table` (every distinct layer on every mesh, planned once), `stage_cost` (layer ranges
-> stage latency and memory), `dp` (the inter-op DP), `microbatches` (counts, tracing at a
microbatch), `search_space` (what the planning searches, one count's table and DP), `candidate`
(a priced count -> stage plans), `selection` (the winner priced as run), `single_stage` (the
whole-cluster competitor), `inter_op` (the planning driver, `plan_pipeline`), `fixed_pipeline`
(hand-chosen even pipelines), `pipeline_plan` (the answer's records), `schedule` (GPipe / 1F1B task
orders), `step` (the plain train step, marked), `derived` (loss and update read from an unmarked
step). Running a planned pipeline is emission: `planner.emit.pipeline`.
"""
