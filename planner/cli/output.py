"""What the commands read and write besides stdout: saved plans, --json and --html files."""
from __future__ import annotations

import json
import os

from planner.present.html_report import render_html
from planner.present.report import PlanView
from planner.cli.errors import CLIError


def print_xla_flags(plan, out) -> None:
    """The XLA flags the prediction assumes (`Plan.xla_flags()`), ready to export."""
    flags = plan.xla_flags()
    if flags:
        print("\nXLA flags this prediction assumes (collectives overlapping compute: gradient reductions, "
              "prefetched gathers):\n"
              f"  XLA_FLAGS=\"{' '.join(flags)}\"", file=out)


def check_output_paths(args) -> None:
    """--json / --html paths that cannot be written are refused before any planning."""
    for flag, path in (("--json", getattr(args, "json", None)), ("--html", getattr(args, "html", None))):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise CLIError(f"{flag} {path!r} is a directory; name a file")
        if not os.path.isdir(folder):
            raise CLIError(f"{flag} {path!r}: directory {folder!r} does not exist; create it or choose another path")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise CLIError(f"{flag} {path!r}: not writable; choose a writable path")


def load_plan(path: str, flag: str) -> PlanView:
    """A saved plan; a profile database given instead is named as such (one line)."""
    try:
        with open(path) as f:
            head = json.load(f)
    except (OSError, ValueError):
        head = None  # PlanView.load says what is wrong with the file
    if isinstance(head, dict) and head.get("format") == "planner-profile":
        raise CLIError(f"{flag} {path!r} is a profile database (written by `planner profile`), not a plan; pass a "
                       "plan written by `planner plan --json FILE` (a profile goes to `planner plan --profile`)")
    return PlanView.load(path)


def write_outputs(args, view, out) -> None:
    """The plan as --json and its report as --html, where asked for."""
    if getattr(args, "json", None):
        text = json.dumps(view.data, indent=1, sort_keys=True, default=_json_default)
        _write(args.json, text, "--json")
        print(f"\nplan written to {args.json}", file=out)
    if getattr(args, "html", None):
        _write(args.html, render_html(view), "--html")
        print(f"report written to {args.html}", file=out)


def _json_default(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "items"):
        return dict(value.items())
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write(path: str, text: str, flag: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise CLIError(f"{flag} {path!r}: cannot write ({e.strerror}); choose a writable path") from None
