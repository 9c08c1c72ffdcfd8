"""`planner plan --batch 256,512,1024 [--seq 2048,4096]`: one plan per shape in one run.

The shapes of one sequence length share what their plans can (`stages.microbatches.PlanningMemo`):
the pipeline search's trace with a symbolic batch size and its per-layer plans, which depend on the
microbatch size only (batch 512 in 256 microbatches plans the layers of batch 1024 in 512). Every
shape is planned as it would be alone (tested: the same plans); the table says what each took.
Several sequence lengths of a zoo model, pipelined, share one trace: the model built for a symbolic
length and traced once with its batch size and length symbolic (`plan._from_seq_family`); their
layer plans differ (another length is another program) and are their own.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable

from planner.core.errors import PlannerError, first_line
from planner.core.units import format_bytes, positive_int
from planner.stages.microbatches import PlanningMemo
from planner.cli.errors import CLIError


def sizes(text: str) -> tuple[int, ...]:
    """`--batch` / `--seq`: one positive size, or several separated by commas (a sweep)."""
    try:
        values = tuple(positive_int(v) for v in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size or a comma-separated list of them "
                                         "(e.g. 256,512,1024)") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} names a size twice")
    return values


def shapes(args) -> list[tuple[int | None, int | None]]:
    """The (batch, seq) pairs the flags ask for (None: the model's own)."""
    return list(itertools.product(args.batch or (None,), args.seq or (None,)))


def one_shape(args, command: str) -> argparse.Namespace:
    """`args` with `batch` / `seq` as single sizes (a command that plans one shape).

    Raises:
      CLIError: several sizes were given.
    """
    if len(shapes(args)) > 1:
        raise CLIError(f"planner {command} plans one shape; give one --batch and one --seq "
                       "(`planner plan` takes several: --batch 256,512,1024)")
    out = argparse.Namespace(**vars(args))
    out.batch = args.batch[0] if args.batch else None
    out.seq = args.seq[0] if args.seq else None
    return out


def plan_sweep(args, out, plan_one: Callable) -> int:
    """Plans each shape with `plan_one(args_for_shape, out, memo) -> PlanView`, the shapes of one
    sequence length sharing a `PlanningMemo`; prints one table row per shape. `--json` / `--html`
    files are written per shape, the shape in their names (plan.json -> plan.b512.s2048.json).
    A shape with no plan gets its one-line reason in the table, and the exit status 2."""
    memos: dict[int | None, PlanningMemo] = {}
    loaded: dict[int | None, tuple] = {}  # a zoo model built once per sequence length (`plan._trace_step`)
    rows = []
    planned = shapes(args)
    # several lengths: one trace of the model for all of them, made at the first (`plan._from_seq_family`)
    seq_families: dict | None = {} if len({s for _, s in planned}) > 1 else None
    for batch, seq in planned:
        one = argparse.Namespace(**vars(args))
        one.batch, one.seq, one.loaded, one.seq_families = batch, seq, loaded.get(seq), seq_families
        for flag in ("json", "html"):
            if getattr(args, flag, None):
                setattr(one, flag, _shape_path(getattr(args, flag), batch, seq))
        print(f"\n=== batch {batch or 'default'}, seq {seq or 'default'} ===", file=out)
        t0 = time.perf_counter()
        try:
            # the layer ILPs kept where a later batch size of this sequence length may solve them again
            view = plan_one(one, out, memos.setdefault(seq, PlanningMemo(
                keep_layer_problems=sum(s == seq for _, s in planned) > 1)))
        except PlannerError as e:  # this shape has no plan: said in its row, the others still planned
            print(f"no plan: {first_line(e)}", file=out)
            view = first_line(e)
        if getattr(one, "loaded", None) is not None:
            loaded.setdefault(seq, one.loaded)
        rows.append((batch, seq, view, time.perf_counter() - t0))
    print("\n" + _table(rows), file=out)
    return 2 if any(isinstance(v, str) for _, _, v, _ in rows) else 0


def _shape_path(path: str, batch: int | None, seq: int | None) -> str:
    stem, ext = os.path.splitext(path)
    tag = "".join(f".{k}{v}" for k, v in (("b", batch), ("s", seq)) if v is not None)
    return f"{stem}{tag}{ext}"


def _table(rows) -> str:
    lines = ["Shapes planned (each as it would be alone; shapes of one sequence length share the symbolic trace "
             "and the per-layer plans, a zoo model's lengths one trace):",
             f"  {'batch':>6} {'seq':>6}  {'mesh':<10} {'stages':>6} {'microbatches':>12} {'step time':>11} "
             f"{'memory/dev':>10}  {'planned in':>10}"]
    for batch, seq, view, seconds in rows:
        if isinstance(view, str):
            lines.append(f"  {batch or '-':>6} {seq or '-':>6}  no plan ({seconds:.1f} s): {view}")
            continue
        plan = view.plan
        step = plan.prediction.step_time_s
        stages = len(plan.stages) if plan.stages else 1
        micro = plan.pipeline.num_microbatches if plan.pipeline else 1
        shape = "x".join(map(str, plan.mesh.shape))
        lines.append(
            f"  {batch or '-':>6} {seq or '-':>6}  {shape:<10} {stages:>6} {micro:>12} "
            f"{step:>9.4g} s {format_bytes(plan.prediction.memory_bytes_per_device):>10}  {seconds:>8.1f} s")
    return "\n".join(lines)
