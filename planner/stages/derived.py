"""The loss and the optimizer update of an ordinary train step, read from its trace.

A step written as `jax.value_and_grad` (or `jax.grad`) followed by an optimizer update, with any
signature (params and optimizer state as separate arguments, the batch as several arrays), traces
into forward ops (`jvp(...)` name stacks), backward ops (`transpose(...)`) and update ops after
them (`clustering.op_phases`). From that trace:

* the loss is the one scalar float the forward makes that nothing else reads;
* parameters are the inputs the loss reads whose new value (the output at the same pytree path)
  is computed from exactly one gradient, and that gradient is theirs; the other inputs the loss
  reads are the batch (one common leading dimension);
* everything else the update reads (optimizer state, hyperparameters) is carried as is.

`DerivedStep` then gives the pipeline runtime what `pipelinable` gives it by hand: a loss function
(the forward ops, re-traced at the microbatch size so shapes baked into the ops fit) and an update
that each stage runs on its own parameters (`GraphUpdate`). A step whose structure does not fit
gets a one-line `InvalidArgumentError` saying why and what to pass instead.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from planner.core.errors import InvalidArgumentError
from planner.graph.ir import Graph, Literal
from planner.graph.trace import trace
from planner.stages.clustering import APPLY, BACKWARD, FORWARD, op_phases

FIX = "build the step with planner.pipelinable(loss_fn, optimizer) to pipeline it"


@dataclasses.dataclass(frozen=True)
class StepParts:
    """The structure of one traced train step (indices into `graph.inputs` unless said otherwise).

    Attributes:
      loss: tensor id of the loss.
      forward: op indices computing the loss (whole control-flow regions).
      update: op indices of the optimizer update.
      params: inputs that are parameters, in order; grads: the tensor id of each one's gradient.
      batch: inputs that are the batch; extras: the rest (optimizer state, hyperparameters).
      new_value: input index -> the output (tensor id or Literal) holding its new value.
      depends: update op index -> the positions in `params` whose values or gradients it reads.
    """

    loss: int
    forward: tuple[int, ...]
    update: tuple[int, ...]
    params: tuple[int, ...]
    grads: tuple[int, ...]
    batch: tuple[int, ...]
    extras: tuple[int, ...]
    new_value: Mapping[int, Any]
    depends: Mapping[int, frozenset[int]]


def _fail(why: str):
    raise InvalidArgumentError(f"cannot pipeline this train step: {why}; {FIX}")


def split_step(graph: Graph) -> StepParts:
    """Finds loss, parameters, gradients, batch and update in a traced train step.

    Raises:
      InvalidArgumentError: the step has no gradient, several candidate losses, an update that
        mixes parameters (global-norm clipping), or inputs that are neither parameters nor batch.
    """
    phases = op_phases(graph)
    if BACKWARD not in phases:
        _fail("it computes no gradient (no jax.grad / jax.value_and_grad in its trace)")
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    loss = _loss(graph, phases)
    forward = _closure(graph, {producer[loss]}, producer, lambda i: phases[i] == FORWARD)
    forward = _whole_regions(graph, forward)
    input_index = {t: k for k, t in enumerate(graph.inputs)}
    loss_inputs = sorted({input_index[t] for i in forward for t in graph.ops[i].tensor_inputs if t in input_index})
    update = tuple(i for i, p in enumerate(phases) if p == APPLY)
    upd = set(update)
    made_by_grad = {t for op in graph.ops if phases[op.index] == BACKWARD for t in op.outputs}
    out_at = dict(zip(graph.output_paths, graph.outputs))
    new_value = {k: out_at[p] for k, p in enumerate(graph.input_paths) if p in out_at}

    def grads_of(t) -> set[int]:
        if not isinstance(t, int):
            return set()
        if t in made_by_grad:
            return {t}
        if producer.get(t) not in upd:
            return set()
        ops = _closure(graph, {producer[t]}, producer, lambda i: i in upd)
        return {x for i in ops for x in graph.ops[i].tensor_inputs if x in made_by_grad}

    params, grads, batch = [], [], []
    for k in loss_inputs:
        path, t = graph.input_paths[k], graph.inputs[k]
        gs = grads_of(new_value.get(k))
        if len(gs) > 1:
            _fail(f"the new value of {path} is computed from {len(gs)} gradients (e.g. global-norm clipping); "
                  "a pipeline updates each stage's parameters on their own")
        if gs and is_float(graph.tensors[t].dtype):
            g = gs.pop()
            if graph.tensors[g].shape != graph.tensors[t].shape or g in grads:
                _fail(f"the gradient read by the update of {path} is not that parameter's own gradient")
            params.append(k)
            grads.append(g)
        else:
            batch.append(k)
    sizes = {graph.tensors[graph.inputs[k]].shape[:1] for k in batch}
    if not batch or len(sizes) != 1 or () in sizes:
        paths = [graph.input_paths[k] for k in batch]
        _fail(f"the inputs the loss reads besides parameters ({paths}) must be batch arrays with one common "
              "leading dimension")
    extras = tuple(k for k in range(len(graph.inputs)) if k not in set(params) | set(batch))
    pos = {graph.inputs[k]: n for n, k in enumerate(params)}
    pos.update({g: n for n, g in enumerate(grads)})
    allowed = set(graph.consts) | {graph.inputs[k] for k in params + list(extras)} | set(grads)
    depends: dict[int, frozenset[int]] = {}
    for i in update:
        op = graph.ops[i]
        d: set[int] = set()
        for t in op.tensor_inputs:
            if producer.get(t) in upd:
                d |= depends[producer[t]]
            elif t in allowed:
                d |= {pos[t]} if t in pos else set()
            else:
                _fail(f"the update reads a value of the forward or backward pass other than the gradients "
                      f"(op {op.name} {op.name_stack!r})")
        depends[i] = frozenset(d)
    inputs = set(graph.inputs)
    for path, t in zip(graph.output_paths, graph.outputs):
        if isinstance(t, int) and t != loss and t not in inputs and (
                producer.get(t) not in upd or path not in graph.input_paths):
            _fail(f"output {path} is neither the loss nor the new value of an input")
    return StepParts(loss, tuple(sorted(forward)), update, tuple(params), tuple(grads), tuple(batch), extras,
                     new_value, depends)


def _loss(graph: Graph, phases: Sequence[str]) -> int:
    """The loss: the one scalar float the forward makes that nothing else reads (a program output,
    when there are several)."""
    read_by_grad = {t for op in graph.ops if phases[op.index] != APPLY for t in op.tensor_inputs}
    candidates = [t for op in graph.ops if phases[op.index] == FORWARD for t in op.outputs
                  if not graph.tensors[t].shape and is_float(graph.tensors[t].dtype) and t not in read_by_grad]
    if len(candidates) > 1:
        candidates = [t for t in candidates if t in graph.outputs]
    if len(candidates) != 1:
        _fail(f"found {len(candidates)} candidate losses (scalar floats the forward makes and nothing reads)")
    return candidates[0]


def _closure(graph: Graph, start: set[int], producer: Mapping[int, int], keep: Callable[[int], bool]) -> set[int]:
    """Ops in `start` and every op (passing `keep`) they depend on."""
    seen, todo = set(start), list(start)
    while todo:
        for t in graph.ops[todo.pop()].tensor_inputs:
            i = producer.get(t)
            if i is not None and i not in seen and keep(i):
                seen.add(i)
                todo.append(i)
    return seen


def _whole_regions(graph: Graph, ops: set[int]) -> set[int]:
    out = set(ops)
    for regions in graph.regions.values():
        for r in regions:
            if any(r.start <= i < r.end for i in ops):
                out |= set(range(r.start, r.end))
    return out


def _run_named(graph: Graph, ops, env: dict[int, Any]) -> None:
    """Runs `ops` (regions as control flow) under the name scopes they were traced in, so the
    pipeline's layer clustering of the re-traced loss finds the step's modules again."""
    for start, end in op_ranges(tuple(ops)):
        i = start
        while i < end:
            region = next((r for r in graph.regions.get(i, ()) if r.end <= end), None)
            stop = region.end if region is not None else i + 1
            stack = graph.ops[i].name_stack
            if stack.startswith("jvp("):
                stack = stack[stack.find(")") + 1:].lstrip("/")
            if stack:
                with jax.named_scope(stack):
                    graph.run_range(i, stop, env)
            else:
                graph.run_range(i, stop, env)
            i = stop


class DerivedStep:
    """An ordinary train step `fn(*args)` as the pipeline runtime's loss function and update.

    Runtime pytrees: parameters `{"p": [leaves]}`, batch `{"b": [leaves]}`, carried state
    `{"x<k>": leaf}` (k = the flat input index).
    """

    def __init__(self, fn: Callable[..., Any], graph: Graph, parts: StepParts):
        self.fn, self.graph, self.parts = fn, graph, parts
        self.update = GraphUpdate(graph, parts)
        self._abstract = [jax.ShapeDtypeStruct(graph.tensors[t].shape, graph.tensors[t].dtype) for t in graph.inputs]
        self._at: dict[int, tuple[Graph, StepParts]] = {}

    @classmethod
    def of(cls, fn: Callable[..., Any], graph: Graph) -> DerivedStep:
        """From `graph = trace(fn, *args)`; raises the one-line reason when the step cannot be split."""
        return cls(fn, graph, split_step(graph))

    def batch_argnums(self) -> tuple[int, ...]:
        """Positions of the step's arguments that hold the batch (for microbatched planning)."""
        positions = jax.tree_util.tree_unflatten(self.graph.in_tree, list(range(len(self.graph.inputs))))
        counts = [len(jax.tree_util.tree_leaves(a)) for a in positions]
        starts = np.cumsum([0] + counts)
        arg_of = lambda k: int(np.searchsorted(starts, k, side="right") - 1)  # noqa: E731
        argnums = sorted({arg_of(k) for k in self.parts.batch})
        mixed = [a for a in argnums if any(arg_of(k) == a for k in self.parts.params + self.parts.extras)]
        if mixed:
            _fail(f"argument {mixed[0]} holds both batch arrays and state; pass the batch as its own arguments")
        return tuple(argnums)

    def _graph_at(self, rows: int) -> tuple[Graph, StepParts]:
        if rows not in self._at:
            abstract = list(self._abstract)
            for k in self.parts.batch:
                x = abstract[k]
                abstract[k] = jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype)
            graph = trace(self.fn, *jax.tree_util.tree_unflatten(self.graph.in_tree, abstract))
            parts = split_step(graph)
            if (parts.params, parts.batch) != (self.parts.params, self.parts.batch):
                _fail(f"its structure changes with the batch size ({rows} rows)")
            self._at[rows] = (graph, parts)
        return self._at[rows]

    def loss_fn(self, p: Mapping[str, Any], b: Mapping[str, Any]):
        """The step's loss on parameters `{"p": [...]}` and a (micro)batch `{"b": [...]}`."""
        graph, parts = self._graph_at(int(np.shape(b["b"][0])[0]))
        env: dict[int, Any] = dict(graph.consts)
        env.update(zip((graph.inputs[k] for k in parts.params), p["p"]))
        env.update(zip((graph.inputs[k] for k in parts.batch), b["b"]))
        _run_named(graph, parts.forward, env)
        return env[parts.loss]

    def split_args(self, args: tuple[Any, ...]):
        """The step's arguments as the runtime's (params, carried state, batch)."""
        flat = jax.tree_util.tree_leaves(args)
        if len(flat) != len(self.graph.inputs):
            raise InvalidArgumentError(f"expected {len(self.graph.inputs)} array leaves, got {len(flat)}")
        return ({"p": [flat[k] for k in self.parts.params]}, {f"x{k}": flat[k] for k in self.parts.extras},
                {"b": [flat[k] for k in self.parts.batch]})

    def join_outputs(self, args: tuple[Any, ...], params: Mapping[str, Any], carried: Mapping[str, Any], loss):
        """The step's outputs from the runtime's new parameters, new carried state and mean loss."""
        flat = jax.tree_util.tree_leaves(args)
        new: dict[int, Any] = {self.graph.inputs[k]: flat[k] for k in range(len(flat))}
        for n, k in enumerate(self.parts.params):
            new[self.parts.new_value[k]] = params["p"][n]
        for k in self.parts.extras:
            t = self.parts.new_value.get(k)
            if isinstance(t, int):
                new[t] = carried[f"x{k}"]
        new[self.parts.loss] = loss
        outs = [x.value if isinstance(x, Literal) else new[x] for x in self.graph.outputs]
        return jax.tree_util.tree_unflatten(self.graph.out_tree, outs)

    def rekey(self, specs: Mapping[str, Any]) -> dict[str, Any]:
        """Stage specs keyed by the step's input paths, re-keyed by the runtime's paths."""
        out = {}
        for n, k in enumerate(self.parts.params):
            if self.graph.input_paths[k] in specs:
                out[f"['p'][{n}]"] = specs[self.graph.input_paths[k]]
        for n, k in enumerate(self.parts.batch):
            if self.graph.input_paths[k] in specs:
                out[f"['b'][{n}]"] = specs[self.graph.input_paths[k]]
        return out


class GraphUpdate:
    """The step's own update ops as the runtime's optimizer: `init(masked params)` says which
    carried leaves a stage needs, `apply(params, carried, grads)` runs the update ops of the
    stage's parameters (and the shared ones, such as a step count, on every stage)."""

    def __init__(self, graph: Graph, parts: StepParts):
        self.graph, self.parts = graph, parts
        self._producer = {t: op.index for op in graph.ops for t in op.outputs}

    def _ops(self, present: frozenset[int]) -> tuple[int, ...]:
        parts, upd = self.parts, set(self.parts.update)
        mine = set()
        for i in parts.update:
            d = parts.depends[i]
            if d & present and not d <= present:
                _fail("its optimizer update combines parameters of several pipeline stages")
            if d and d <= present:
                mine.add(i)
        for k in parts.extras:  # shared state (a step count) is updated on every stage
            t = parts.new_value.get(k)
            if isinstance(t, int) and self._producer.get(t) in upd and not parts.depends[self._producer[t]]:
                mine.add(self._producer[t])
        return tuple(sorted(_closure(self.graph, mine, self._producer, lambda i: i in upd)))

    def _present(self, masked: Mapping[str, Any]) -> frozenset[int]:
        return frozenset(n for n, x in enumerate(masked["p"]) if x is not None)

    def _extras(self, ops) -> list[int]:
        read = {t for i in ops for t in self.graph.ops[i].tensor_inputs}
        return [k for k in self.parts.extras if self.graph.inputs[k] in read]

    def init(self, masked: Mapping[str, Any]) -> dict[str, Any]:
        ops = self._ops(self._present(masked))
        return {f"x{k}": jax.ShapeDtypeStruct(self.graph.tensors[self.graph.inputs[k]].shape,
                                              self.graph.tensors[self.graph.inputs[k]].dtype)
                for k in self._extras(ops)}

    def apply(self, p: Mapping[str, Any], o: Mapping[str, Any], g: Mapping[str, Any]):
        graph, parts = self.graph, self.parts
        present = self._present(p)
        env: dict[int, Any] = dict(graph.consts)
        for n in present:
            env[graph.inputs[parts.params[n]]] = p["p"][n]
            env[parts.grads[n]] = g["p"][n]
        env.update((graph.inputs[int(key[1:])], x) for key, x in o.items())
        for start, end in op_ranges(self._ops(present)):
            graph.run_range(start, end, env)

        def value(x):
            return x.value if isinstance(x, Literal) else env[x]

        new_p = {"p": [value(parts.new_value[parts.params[n]]) if n in present else None
                       for n in range(len(parts.params))]}
        new_o = {}
        for key, x in o.items():
            t = parts.new_value.get(int(key[1:]))
            new_o[key] = value(t) if t is not None and (not isinstance(t, int) or t in env) else x
        return new_p, new_o


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def op_ranges(ops: tuple[int, ...]) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of consecutive op indices: each runs as `Graph.evaluate` would,
    so a control-flow region inside one runs as its loop or branch (partition keeps `cond` and
    `while` regions whole; a `scan` split across stages runs unrolled, which computes the same)."""
    out: list[tuple[int, int]] = []
    for i in ops:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
