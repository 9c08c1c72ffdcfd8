"""The `planner` command line: plan a model for a cluster, explain and compare plans, draw them.

    planner plan --model gpt2-small --devices 8                # search mesh shapes, print the best plan
    planner plan --model gpt3-39b --cluster 8x8 --json p.json --html p.html
    planner plan --fn mypkg.train:make_step --mesh 2x4         # your own (train_step, example_args) factory
    planner plan --from p.json                                 # re-print a saved plan
    planner explain p.json [--op fc_in]                        # why each choice, and the runner-up
    planner diff a.json b.json                                 # where two plans differ and what it costs
    planner plan --model gpt-tiny --mesh 2x4 --pin 'wte/embedding=P((x,y), None)'   # yours, the rest planned
    planner compare --model gpt-tiny --mesh 2x4                # the plan beside dp, fsdp, megatron-tp, ...
    planner compare --model gpt-tiny --mesh 2x4 --html c.html  # ... and the plan's report with that comparison
    planner profile ...                                        # offline profiling (planner.cost_model.profiling)

Planning is abstract: arguments are `jax.ShapeDtypeStruct`s and the target mesh is a description
(`MeshSpec`), so no accelerator (and no device of the planned count) is needed. Results go to
stdout, progress to stderr; bad input exits with status 2 and a one-line message.

One module per command (`plan`, `compare`, `explain` for explain and diff, `profile`), the parser
in `args`, and the entry point `commands.main`.
"""
from planner.cli.commands import main

__all__ = ["main"]
