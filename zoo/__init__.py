"""Test and benchmark models for the planner, each as a ModelBundle: MLPs, GPT, Llama, GShard MoE,
Wide-ResNet, BERT, and MLPs written in plain JAX and in flax.nnx."""
from __future__ import annotations

from zoo.bert import BertConfig
from zoo.gpt import GPTConfig
from zoo.llama import LlamaConfig
from zoo.mlp import MLPConfig
from zoo.moe import MoEConfig
from zoo.nnx_mlp import NNXMLPConfig
from zoo.plain import PlainMLPConfig
from zoo.registry import UnknownModelError, get_config, get_model, model_names
from zoo.resnet import ResNetConfig
from zoo.train import (
    ModelBundle,
    build_bundle,
    build_stateful_bundle,
    init_key,
    make_optimizer,
    make_stateful_train_step,
    make_train_step,
)

__all__ = [
    "BertConfig",
    "GPTConfig",
    "LlamaConfig",
    "MLPConfig",
    "MoEConfig",
    "ModelBundle",
    "NNXMLPConfig",
    "PlainMLPConfig",
    "ResNetConfig",
    "UnknownModelError",
    "build_bundle",
    "build_stateful_bundle",
    "get_config",
    "get_model",
    "init_key",
    "make_optimizer",
    "make_stateful_train_step",
    "make_train_step",
    "model_names",
]
