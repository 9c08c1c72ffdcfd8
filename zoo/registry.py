"""The model zoo as data: an immutable table of name -> size config, plus get_model to build one.

Sizes follow the papers the planner is compared against (GPT-2, GPT-3, Alpa's GPT-39B and MoE
benchmarks, Llama 2, BERT, Wide-ResNet), so plans and predicted step times can be checked against
published numbers. "-tiny" sizes train in seconds on CPU; the rest are for abstract planning.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

from planner.core.errors import InvalidArgumentError, PlannerError
from zoo import bert, gpt, llama, mlp, moe, nnx_mlp, plain, resnet
from zoo.train import ModelBundle

_GPT2_VOCAB = 50304  # 50257 padded to a multiple of 64, as nanoGPT does
_GPT3_VOCAB = 51200
_LLAMA_VOCAB = 32000
_BERT_VOCAB = 30528  # 30522 padded to a multiple of 64

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
        "llama-tiny": llama.LlamaConfig(
            batch=8, seq=32, vocab=256, d_model=64, heads=4, kv_heads=2, layers=2, mlp_dim=128
        ),
        "llama-small-test": llama.LlamaConfig(
            batch=8, seq=64, vocab=512, d_model=128, heads=8, kv_heads=2, layers=4, mlp_dim=256
        ),
        # Llama 2 7B is multi-head (kv_heads == heads); 70B is grouped-query with 8 kv heads.
        "llama-7b": llama.LlamaConfig(
            batch=8, seq=2048, vocab=_LLAMA_VOCAB, d_model=4096, heads=32, kv_heads=32,
            layers=32, mlp_dim=11008,
        ),
        "llama-70b": llama.LlamaConfig(
            batch=8, seq=4096, vocab=_LLAMA_VOCAB, d_model=8192, heads=64, kv_heads=8,
            layers=80, mlp_dim=28672,
        ),
        "moe-tiny": moe.MoEConfig(
            batch=8, seq=32, vocab=256, d_model=64, heads=4, layers=2, experts=4, mlp_dim=128,
            group_size=32,
        ),
        # Experts dominate the params and 4096 tokens route per step: expert parallelism should win.
        "moe-large-experts": moe.MoEConfig(
            batch=32, seq=128, vocab=1024, d_model=256, heads=4, layers=2, experts=8,
            mlp_dim=2048, group_size=128, moe_every=1,
        ),
        # Alpa's MoE "1.3B": every layer MoE, 16 experts, expert group size 2048.
        "gshard-moe-1.3b": moe.MoEConfig(
            batch=8, seq=1024, vocab=32000, d_model=768, heads=16, layers=16, experts=16,
            mlp_dim=3072, group_size=2048, moe_every=1,
        ),
        "wresnet-tiny": resnet.ResNetConfig(
            batch=8, image_size=32, channels=3, num_classes=10, stage_sizes=(1, 1),
            base_width=16, width_factor=2, bottleneck=False, imagenet_stem=False,
        ),
        "wresnet-50-2": resnet.ResNetConfig(
            batch=32, image_size=224, channels=3, num_classes=1000, stage_sizes=(3, 4, 6, 3),
            base_width=64, width_factor=2,
        ),
        "bert-tiny": bert.BertConfig(
            batch=8, seq=32, vocab=256, d_model=64, heads=4, layers=2, mlp_dim=256
        ),
        "bert-base": bert.BertConfig(
            batch=8, seq=512, vocab=_BERT_VOCAB, d_model=768, heads=12, layers=12, mlp_dim=3072
        ),
        "bert-large": bert.BertConfig(
            batch=8, seq=512, vocab=_BERT_VOCAB, d_model=1024, heads=16, layers=24, mlp_dim=4096
        ),
        "plain-mlp-tiny": plain.PlainMLPConfig(batch=32, in_dim=16, hidden=32, classes=4),
        "nnx-mlp-tiny": nnx_mlp.NNXMLPConfig(batch=32, in_dim=16, hidden=32, out_dim=8),
    }
)

_BUILDERS: Mapping[type, Callable[[str, Any], ModelBundle]] = types.MappingProxyType(
    {
        mlp.MLPConfig: mlp.build,
        gpt.GPTConfig: gpt.build,
        llama.LlamaConfig: llama.build,
        moe.MoEConfig: moe.build,
        resnet.ResNetConfig: resnet.build,
        bert.BertConfig: bert.build,
        plain.PlainMLPConfig: plain.build,
        nnx_mlp.NNXMLPConfig: nnx_mlp.build,
    }
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
