"""Test and benchmark models for the planner, each as a ModelBundle: MLPs, GPT, Llama, GShard MoE,
Wide-ResNet, BERT, and MLPs written in plain JAX and in flax.nnx."""
from __future__ import annotations

from planner.models.bert import BertConfig
from planner.models.gpt import GPTConfig
from planner.models.llama import LlamaConfig
from planner.models.mlp import MLPConfig
from planner.models.moe import MoEConfig
from planner.models.nnx_mlp import NNXMLPConfig
from planner.models.plain import PlainMLPConfig
from planner.models.registry import UnknownModelError, get_config, get_model, model_names
from planner.models.resnet import ResNetConfig
from planner.models.train import (
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
