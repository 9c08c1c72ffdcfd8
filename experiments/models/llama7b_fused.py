"""The zoo's Llama-2-7B step with fused (flash) attention, for `planner plan --fn`: the Pallas GPU
kernel in place of the materialised scores (`zoo.llama`, attention="fused"), as JAX-Toolbox's
MaxText runs train Llama-2-7B on H100s (cuDNN flash attention).

    planner plan --fn experiments/models/llama7b_fused.py:make_step --cluster 1x8:h100-sxm --batch 16 --seq 4096
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from zoo import get_model  # noqa: E402


def make_step(batch: int = 16, seq: int = 4096, dtype: str = "bfloat16"):
    b = get_model("llama-7b", batch=batch, seq=seq, dtype=dtype, attention="fused")
    return b.train_step, (b.abstract_state(), b.abstract_batch())
