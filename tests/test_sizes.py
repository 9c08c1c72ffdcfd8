"""Sizes of the library's code: no module of planner/ or xla_hooks/ over 550 lines, no function or
method over 100 lines (counted with `ast` from its first decorator to its last line, docstring and
comments included). One test per module, so that each failure names its file."""
from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "xla_hooks")
MAX_MODULE_LINES = 550
MAX_FUNCTION_LINES = 100

MODULES = sorted(str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function and method in `source`, nested
    ones too; a function starts at its first decorator."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                found.append((prefix + child.name, start, child.end_lineno - start + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def long_functions(path: str, source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """One line per function of `source` longer than `limit`: file, name, first line and length."""
    return [f"{path}: {name} (line {start}) is {length} lines, over {limit}"
            for name, start, length in function_lengths(source) if length > limit]


def module_lines(source: str) -> int:
    return len(source.splitlines())


def test_modules_are_found():
    assert "planner/api.py" in MODULES and any(m.startswith("xla_hooks/") for m in MODULES)


@pytest.mark.parametrize("path", MODULES)
def test_module_is_at_most_550_lines(path):
    lines = module_lines((ROOT / path).read_text())
    assert lines <= MAX_MODULE_LINES, f"{path} is {lines} lines, over {MAX_MODULE_LINES}"


@pytest.mark.parametrize("path", MODULES)
def test_functions_are_at_most_100_lines(path):
    too_long = long_functions(path, (ROOT / path).read_text())
    assert not too_long, "\n".join(too_long)


def test_the_counter_counts_decorators_docstrings_and_methods():
    """A 101-line function (a decorator, its `def`, a docstring and 98 statements) counts 101 and
    fails; a method is named with its class and passes under the limit; nested ones are counted too."""
    body = '    """Docstring."""\n' + "    x = 1\n" * 98
    method = textwrap.indent(body.replace("    x = 1\n", "", 1), "    ")  # one statement fewer
    source = f"import functools\n\n\n@functools.cache\ndef f():\n{body}\n\nclass C:\n    def m(self):\n{method}"
    assert function_lengths(source) == [("f", 4, 101), ("C.m", 108, 99)]
    assert long_functions("synthetic.py", source) == ["synthetic.py: f (line 4) is 101 lines, over 100"]
    nested = textwrap.dedent("""
        class Outer:
            class Inner:
                @staticmethod
                @functools.cache
                def g():
                    def h():
                        return 1
                    return h
    """)
    assert function_lengths(nested) == [("Outer.Inner.g", 4, 6), ("Outer.Inner.g.h", 7, 2)]
    assert module_lines("a\nb\n") == 2 and module_lines("a\nb") == 2
