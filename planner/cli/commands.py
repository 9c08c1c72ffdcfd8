"""The `planner` command: parse the arguments, run the subcommand, report errors in one line.

Results go to stdout, progress to stderr; bad input exits with status 2 and a one-line message.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence

from planner.core.errors import PlannerError
from planner.cli.args import build_parser
from planner.cli.compare import cmd_compare
from planner.cli.errors import CLIError, one_line
from planner.cli.explain import cmd_diff, cmd_explain
from planner.cli.plan import cmd_plan
from planner.cli.profile import cmd_profile, load_profiling
from planner.cli.target import MESH_SHAPE, mesh_devices

__all__ = ["main"]

log = logging.getLogger("planner")

# The subcommands that print to stdout; `profile` runs the profiling module's job.
COMMANDS = {"plan": cmd_plan, "explain": cmd_explain, "compare": cmd_compare, "diff": cmd_diff}


class _Elapsed(logging.Formatter):
    def __init__(self, start: float):
        super().__init__("[planner %(elapsed)6.1fs] %(message)s")
        self.start = start

    def format(self, record):
        record.elapsed = record.created - self.start
        return super().format(record)


def _provide_cpu_devices(argv: Sequence[str]) -> None:
    """Lets a --fn factory build a jax Mesh of the planned size on a CPU-only machine.

    Planning itself never needs devices; this only helps user factories that call `jax.devices()`.
    It must run before JAX initialises its backends, so only the console-script entry point does it.
    """
    n = 0
    for flag, value in zip(argv, list(argv[1:]) + [""]):
        if flag == "--devices" and value.isdigit():
            n = int(value)
        elif flag in ("--mesh", "--cluster") and MESH_SHAPE.match(value):
            n = mesh_devices(value)
    if n <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already up (an embedding program started JAX first): planning does not need them


@contextlib.contextmanager
def _progress(enabled: bool):
    """Progress lines (the "planner" log at INFO) on stderr, each with the seconds since the start."""
    handler = None
    if enabled:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Elapsed(time.time()))
        log.addHandler(handler)
    old_level = log.level
    if handler is not None:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(old_level)


def _run(args, profiling) -> int:
    """The subcommand's exit status; errors of the input print one line and exit 2."""
    try:
        if args.command == "profile":
            return cmd_profile(args, profiling)
        return COMMANDS[args.command](args, sys.stdout)
    except (CLIError, PlannerError) as e:
        print(f"planner: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`planner plan ... | head`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 bad input)."""
    console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        profiling = load_profiling(argv)
    except CLIError as e:
        print(f"planner: error: {e}", file=sys.stderr)
        return 2
    parser = build_parser(getattr(profiling, "add_arguments", None))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if console:
        _provide_cpu_devices(argv)
    with _progress(not getattr(args, "quiet", False)), warnings.catch_warnings():
        warnings.showwarning = _one_line_warning  # restored when the block ends
        return _run(args, profiling)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the command line prints it: one line naming it, not the source line raising it."""
    print(f"planner: warning: {str(message).splitlines()[0] if str(message) else category.__name__}",
          file=sys.stderr if file is None else file)


if __name__ == "__main__":
    sys.exit(main())
