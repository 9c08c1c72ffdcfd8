"""The model zoo as data: an immutable table of name -> size config, plus get_model to build one.

Sizes follow the papers the planner is compared against (GPT-2, GPT-3, Alpa's GPT-39B benchmark),
so plans and predicted step times can be checked against published numbers.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

from planner.errors import InvalidArgumentError, PlannerError
from planner.models import gpt, mlp
from planner.models.train import ModelBundle

_GPT2_VOCAB = 50304  # 50257 padded to a multiple of 64, as nanoGPT does
_GPT3_VOCAB = 51200

_CONFIGS: Mapping[str, Any] = types.MappingProxyType(
    {
        "mlp-tiny": mlp.MLPConfig(batch=64, in_dim=32, hidden=64, out_dim=32),
        "mlp-wide": mlp.MLPConfig(batch=8, in_dim=256, hidden=2048, out_dim=256),
        "mlp-tall": mlp.MLPConfig(batch=2048, in_dim=64, hidden=64, out_dim=64),
        "gpt-tiny": gpt.GPTConfig(batch=8, seq=32, vocab=256, d_model=64, heads=4, layers=2),
        "gpt-small-test": gpt.GPTConfig(
            batch=8, seq=64, vocab=512, d_model=128, heads=4, layers=4
        ),
        "gpt2-small": gpt.GPTConfig(
            batch=8, seq=1024, vocab=_GPT2_VOCAB, d_model=768, heads=12, layers=12
        ),
        "gpt2-medium": gpt.GPTConfig(
            batch=8, seq=1024, vocab=_GPT2_VOCAB, d_model=1024, heads=16, layers=24
        ),
        "gpt2-large": gpt.GPTConfig(
            batch=8, seq=1024, vocab=_GPT2_VOCAB, d_model=1280, heads=20, layers=36
        ),
        "gpt3-1.3b": gpt.GPTConfig(
            batch=8, seq=2048, vocab=_GPT3_VOCAB, d_model=2048, heads=16, layers=24
        ),
        "gpt3-2.7b": gpt.GPTConfig(
            batch=8, seq=2048, vocab=_GPT3_VOCAB, d_model=2560, heads=32, layers=32
        ),
        "gpt3-6.7b": gpt.GPTConfig(
            batch=8, seq=2048, vocab=_GPT3_VOCAB, d_model=4096, heads=32, layers=32
        ),
        # Alpa's benchmark shape: seq 1024, not GPT-3's 2048.
        "gpt3-39b": gpt.GPTConfig(
            batch=8, seq=1024, vocab=_GPT3_VOCAB, d_model=8192, heads=64, layers=48
        ),
    }
)

_BUILDERS: Mapping[type, Callable[[str, Any], ModelBundle]] = types.MappingProxyType(
    {mlp.MLPConfig: mlp.build, gpt.GPTConfig: gpt.build}
)


class UnknownModelError(PlannerError, ValueError):
    """The requested model name is not in the zoo."""


def model_names() -> tuple[str, ...]:
    """Names get_model accepts, smallest models first."""
    return tuple(_CONFIGS)


def get_config(name: str, **overrides: Any) -> Any:
    """The size config registered under `name`, with `overrides` replacing its fields.

    Raises:
      UnknownModelError (a ValueError): `name` is not registered.
      InvalidArgumentError (a TypeError): an override names no field of the config.
      TypeError / ValueError: an override has a bad type or value (from the config's checks).
    """
    if name not in _CONFIGS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(_CONFIGS)}")
    config = _CONFIGS[name]
    fields = tuple(f.name for f in dataclasses.fields(config))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise InvalidArgumentError(
            f"unknown override(s) {unknown} for model {name!r} ({type(config).__name__}); "
            f"valid fields: {', '.join(fields)}"
        )
    return dataclasses.replace(config, **overrides)


def get_model(name: str, **overrides: Any) -> ModelBundle:
    """Builds the named model, e.g. get_model("gpt-tiny", batch=8, seq=32).

    Args:
      name: one of model_names().
      **overrides: replacements for fields of the model's size config (batch, seq, dtype, ...).

    Returns:
      A ModelBundle whose train_step is a plain (non-jitted) function.

    Raises:
      UnknownModelError (a ValueError): `name` is not registered.
      InvalidArgumentError (a TypeError): an override names no field of the config.
    """
    config = get_config(name, **overrides)
    return _BUILDERS[type(config)](name, config)
