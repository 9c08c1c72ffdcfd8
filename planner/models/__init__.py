"""Test and benchmark models for the planner: MLPs and GPTs, each as a ModelBundle."""
from __future__ import annotations

from planner.models.gpt import GPTConfig
from planner.models.mlp import MLPConfig
from planner.models.registry import UnknownModelError, get_config, get_model, model_names
from planner.models.train import ModelBundle, make_optimizer, make_train_step

__all__ = [
    "GPTConfig",
    "MLPConfig",
    "ModelBundle",
    "UnknownModelError",
    "get_config",
    "get_model",
    "make_optimizer",
    "make_train_step",
    "model_names",
]
