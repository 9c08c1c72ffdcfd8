"""The `planner` command line: `plan`, `explain`, `diff`, `compare`, `profile`."""
from planner.cli.commands import main

__all__ = ["main"]
