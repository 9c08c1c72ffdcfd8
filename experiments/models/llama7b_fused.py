"""The zoo's Llama-2-7B step with fused (flash) attention, for `planner plan --fn`, as JAX-Toolbox's
MaxText runs train Llama-2-7B on H100s (cuDNN flash attention): `make_step` calls the Pallas GPU
kernel in place of the materialised scores (`zoo.llama`, attention="fused"), `make_dpa_step`
calls `jax.nn.dot_product_attention` (attention="dpa"), which a GPU target prices as cuDNN's fused
kernel whatever machine traces it.

    planner plan --fn experiments/models/llama7b_fused.py:make_step --cluster 1x8:h100-sxm --batch 16 --seq 4096
    planner plan --fn experiments/models/llama7b_fused.py:make_dpa_step --cluster 1x8:h100-sxm --batch 16 --seq 4096

`make_70b_dpa_step` is the zoo's Llama-2-70B the same way, as MaxText trains it on TPU (flash attention):

    planner plan --fn experiments/models/llama7b_fused.py:make_70b_dpa_step --cluster v5p:8x8x8 --batch 2048 --seq 4096
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from zoo import get_model  # noqa: E402


def make_step(batch: int = 16, seq: int = 4096, dtype: str = "bfloat16", attention: str = "fused",
              model: str = "llama-7b"):
    b = get_model(model, batch=batch, seq=seq, dtype=dtype, attention=attention)
    return b.train_step, (b.abstract_state(), b.abstract_batch())


def make_dpa_step(batch: int = 16, seq: int = 4096, dtype: str = "bfloat16"):
    return make_step(batch, seq, dtype, attention="dpa")


def make_70b_dpa_step(batch: int = 2048, seq: int = 4096, dtype: str = "bfloat16"):
    return make_step(batch, seq, dtype, attention="dpa", model="llama-70b")
