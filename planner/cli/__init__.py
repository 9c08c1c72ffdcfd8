"""The `planner` command line: plan a model for a cluster, explain and compare plans, draw them
(examples: `planner --help`, from `planner.cli.args.EXAMPLES`)."""
from planner.cli.commands import main

__all__ = ["main"]
