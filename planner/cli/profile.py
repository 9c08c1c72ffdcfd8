"""`planner profile`: the offline profiling job (`planner.cost_model.profiling`), loaded only when asked for."""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

from planner.cli.errors import CLIError

PROFILE_MISSING = ("`planner profile` is not available in this installation (planner.cost_model.profiling is "
                   "missing); update the planner, or plan with the analytic cost model (omit --profile)")


def _profiling_module():
    """planner.cost_model.profiling, imported only for `planner profile` (it may be missing)."""
    if importlib.util.find_spec("planner.cost_model.profiling") is None:
        return None
    return importlib.import_module("planner.cost_model.profiling")


def load_profiling(argv: Sequence[str]) -> Any:
    """The profiling module when `argv` runs `planner profile` (its `add_arguments` fill the parser);
    None for the other commands, and for `planner profile --help` when the module is missing."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "profile":
        return None
    try:
        profiling = _profiling_module()
    except Exception as e:  # a broken profiling module must not take the other commands down
        raise CLIError(f"cannot load planner.cost_model.profiling ({type(e).__name__}: {e})") from None
    if profiling is None and not {"-h", "--help"} & set(argv):
        raise CLIError(PROFILE_MISSING)
    return profiling


def cmd_profile(args, profiling) -> int:
    if profiling is None:
        raise CLIError(PROFILE_MISSING)
    return int(profiling.run(args) or 0)
