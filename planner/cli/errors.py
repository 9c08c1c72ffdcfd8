"""Errors of the command line itself: printed as one line, exit status 2."""
from __future__ import annotations


class CLIError(Exception):
    """A problem with the command line itself; printed as one line, exit status 2."""


def one_line(e: BaseException) -> str:
    """The error's message with its whitespace runs (newlines included) as single spaces."""
    return " ".join(str(e).split())
