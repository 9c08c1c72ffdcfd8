"""A Llama-3-70B-shaped train step for `planner plan/compare --fn`: 80 layers,
d_model 8192, 64 heads with 8 KV heads (GQA), MLP 28672, vocabulary 128256 (Meta's Llama 3 model
card), seq 4096, bf16 activations with fp32 parameters and AdamW state, each layer recomputed in the
backward (nn.remat inside the scanned layer), as 70B models are trained.

    planner compare --fn experiments/models/llama3_70b.py:make_step --cluster 4x8:h100 --mesh 4x8 \\
        --batch 32 --donate 0 --baselines fsdp,zero1,dp
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from zoo import get_model  # noqa: E402

LLAMA3_VOCAB = 128256  # Meta, Llama 3 model card (tokenizer with 128K tokens)


def make_step(batch: int = 8, seq: int = 4096, dtype: str = "bfloat16"):
    b = get_model("llama-70b", batch=batch, seq=seq, vocab=LLAMA3_VOCAB, dtype=dtype, remat=True)
    return b.train_step, (b.abstract_state(), b.abstract_batch())
