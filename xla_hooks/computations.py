"""The computations of an HLO module: the kernels a program launches and how often each loop body runs."""
from __future__ import annotations

import re
from typing import Any

from xla_hooks.hlo_text import COMMENT, COMPUTATION, INSTR, HloParseError, hlo_text

# Top-level instructions that launch no kernel of their own (`kernels`).
_NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "domain",
})
_CONTROL = ("while", "conditional", "call")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")


def _computations(text: str) -> tuple[str | None, dict[str, list[tuple[str, str, str]]]]:
    """The ENTRY computation's name (None: none) and, per computation, its instructions in order as
    (opcode, the text after the opening parenthesis, the raw line)."""
    bodies: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for raw in text.splitlines():
        line = COMMENT.sub("", raw)
        m = INSTR.match(line)
        if m is None:
            if c := COMPUTATION.match(line):
                current = c["name"]
                bodies[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if current is not None:
            bodies[current].append((m["op"], m["rest"], raw))
    return entry, bodies


def _callees(rest: str) -> list[str]:
    """The computations a control-flow instruction runs (loop bodies and conditions, branches, calls)."""
    return _CALLED.findall(rest) + [b.strip().lstrip("%") for branches in _BRANCHES.findall(rest)
                                    for b in branches.split(",")]


def kernels(compiled_or_text: Any) -> dict[str, int]:
    """Kernels a compiled program launches, by kind: the instructions of the entry computation and
    of the computations it runs as control flow (while bodies and conditions, branches, calls), not
    those inside fusions. Keys: "fusion:kLoop" (the fusion's kind), "custom-call" (library calls:
    GEMMs, convolutions), or the opcode; control flow, tuples, parameters and bitcasts launch none."""
    text = hlo_text(compiled_or_text)
    entry, bodies = _computations(text)
    if entry is None:
        raise HloParseError(f"No ENTRY computation in the HLO text: {text[:80]!r}")
    counts: dict[str, int] = {}
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        for op, rest, _ in bodies[name]:
            if op in _CONTROL:
                todo.extend(_callees(rest))
            if op in _NO_KERNEL:
                continue
            if op == "fusion":
                kind = _FUSION_KIND.search(rest)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


_TRIP_COUNT = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def base_name(computation: str) -> str:
    """A computation's name without the prefixes and suffixes XLA's passes add to the clones they
    make of it ("wide." from loop widening, ".clone" from cloning): the name it had after SPMD
    partitioning, so loops of the final module can be matched with an earlier dump's."""
    while computation.startswith("wide."):
        computation = computation[len("wide."):]
    while computation.endswith(".clone"):
        computation = computation[:-len(".clone")]
    return computation


def trip_counts(compiled_or_text: Any) -> dict[str, int]:
    """Per computation of a compiled module, how many times it runs per program run: the product of
    the known trip counts (`backend_config` `known_trip_count`) of the while loops whose bodies
    contain it, through nested loops, calls and branches; computations not listed run once. Keys
    are `base_name`s as well as the names themselves."""
    parent: dict[str, tuple[str, int]] = {}
    for current, instructions in _computations(hlo_text(compiled_or_text))[1].items():
        for op, rest, raw in instructions:
            if op == "while":
                body = _BODY.search(rest)
                count = _TRIP_COUNT.search(raw)
                if body is not None:
                    parent[body.group(1)] = (current, int(count.group(1)) if count else 1)
            elif op in ("call", "conditional"):
                for callee in _callees(rest):
                    parent.setdefault(callee, (current, 1))
    out: dict[str, int] = {}

    def trips(name: str, seen: frozenset = frozenset()) -> int:
        if name in out:
            return out[name]
        up, k = parent.get(name, ("", 1))
        n = k * (trips(up, seen | {name}) if up and up not in seen else 1)
        out[name] = n
        return n

    for name in list(parent):
        trips(name)
    out.update({base_name(k): v for k, v in list(out.items()) if base_name(k) not in out})
    return {k: v for k, v in out.items() if v != 1}
