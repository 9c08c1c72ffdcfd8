"""What `planner plan` plans: a zoo model by name (`--model`) or a user factory (`--fn MODULE:FACTORY`).

Both give (label, train_step, example_args); zoo models come abstract (`jax.ShapeDtypeStruct`
leaves), so nothing is allocated. Errors name the flag, the value and the fix, in one line.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

from planner.core.errors import InvalidArgumentError
from zoo import UnknownModelError, get_config, get_model, model_names


class ProgramError(InvalidArgumentError):
    """The program to plan cannot be loaded (unknown model, broken factory)."""


def load_model(name: str, batch: int | None, seq: int | None, dtype: str | None = None,
               default_dtype: str | None = None, pipelined: bool = False):
    """(label, train_step, example_args) of a zoo model, abstract (ShapeDtypeStruct leaves).

    `dtype` is its compute dtype (parameters and optimizer state stay float32), named in the label;
    `default_dtype` applies when no `dtype` is given (the hardware's, `Hardware.default_dtype`).
    `pipelined`: the step will be split into pipeline stages, so a zoo model that scans its layers
    over stacked weights (Llama's `scan_layers`) is built with them unrolled: a stage holds whole
    parameter leaves, and a stacked leaf would keep every layer's weights on one stage (scanned
    llama-70b on 8x8: 272 s/step against 16.1 s unrolled). The label says so."""
    overrides = {k: v for k, v in (("batch", batch), ("seq", seq), ("dtype", dtype)) if v is not None}
    label = name + "".join(f" {k}={v}" for k, v in overrides.items())
    if dtype is None and default_dtype is not None:
        overrides["dtype"] = default_dtype
    if pipelined:
        try:
            scans = getattr(get_config(name), "scan_layers", False)
        except UnknownModelError:
            scans = False  # reported below, with the known names
        if scans:
            overrides["scan_layers"] = False
            label += " (layers unrolled for pipelining)"
    try:
        bundle = get_model(name, **overrides)
    except UnknownModelError:
        raise ProgramError(f"unknown model {name!r}; choose one of {', '.join(model_names())} "
                       "or pass your own with --fn MODULE:FACTORY") from None
    except (TypeError, ValueError) as e:
        raise ProgramError(f"model {name!r} does not accept {overrides}: {e}") from None
    return label, bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch())


def load_factory(spec: str, batch: int | None, seq: int | None, dtype: str | None = None):
    """(label, train_step, example_args) from a user factory `MODULE:FACTORY` (called with the
    batch, seq and dtype that are given)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ProgramError(f"--fn {spec!r} is not MODULE:FACTORY; write e.g. --fn mypkg.train:make_step "
                       "or --fn path/to/train.py:make_step")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise ProgramError(f"--fn {spec!r}: file {module_name!r} does not exist; check the path")
            mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0],
                                                              module_name)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ProgramError:
        raise
    except ImportError as e:
        raise ProgramError(f"--fn {spec!r}: cannot import {module_name!r} ({e}); run from the directory that holds it "
                       "or set PYTHONPATH") from None
    except Exception as e:  # the user's module failed while loading: name it, no traceback
        raise ProgramError(f"--fn {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}; fix the module") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ProgramError(f"--fn {spec!r}: module {module_name!r} has no callable {attr!r}; name a function that "
                       "returns (train_step, example_args)")
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq), ("dtype", dtype)) if v is not None}
    try:
        if kwargs:
            inspect.signature(factory).bind(**kwargs)
    except TypeError:
        raise ProgramError(f"--fn {spec!r}: {attr}() takes no {', '.join(kwargs)} argument; drop "
                       f"{' '.join('--' + k for k in kwargs)} or add the parameter to the factory") from None
    except ValueError:
        pass
    try:
        result = factory(**kwargs)
    except Exception as e:
        raise ProgramError(f"--fn {spec!r}: {attr}() raised {type(e).__name__}: {e}; fix the factory") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[0])):
        raise ProgramError(f"--fn {spec!r}: {attr}() returned {type(result).__name__}, not (train_step, example_args); "
                       "return the step function and a tuple of its example arguments")
    step, args = result
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    return spec, step, args
