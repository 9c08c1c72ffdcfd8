"""Names of repeated layers: a module name with an index, `blocks_3`, `Dense_0`, `scaniter_12`.

The one recogniser of layer indices, used by layer sharing in the ILP, layer clustering for
pipelines, and every view that collapses repeated layers into one row. A name is indexed when it
starts with a letter and ends in `_<digits>`, standing alone (not inside a longer word): the
name part may itself contain underscores (`mlp_fc_2` is layer 2 of `mlp_fc`).
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterator

# Names the tracer gives (`planner.graph.trace`): each iteration of an unrolled scan, `scaniter_<i>`, and
# each branch of a cond / switch, `branch_<k>` (JAX names a branch's own ops so too).
SCAN_ITERATION = "scaniter"
COND_BRANCH = "branch"
# ... and the ops of `jax.nn.dot_product_attention`'s core (scores, mask, softmax, weighted sum, and
# their derivatives), `.../fused_attention`: what a GPU or TPU runs as one fused attention kernel
# (`planner.graph.fusion.attention_groups`).
FUSED_ATTENTION = "fused_attention"


def in_fused_attention(name_stack: str) -> bool:
    """Whether an op of this name stack computes `jax.nn.dot_product_attention`'s core."""
    return FUSED_ATTENTION in name_stack.split("/")


def with_fused_attention(name_stack: str) -> str:
    """`name_stack` marked as inside `jax.nn.dot_product_attention`'s core (once)."""
    if in_fused_attention(name_stack):
        return name_stack
    return f"{name_stack}/{FUSED_ATTENTION}" if name_stack else FUSED_ATTENTION

INDEXED = re.compile(r"(?<![A-Za-z0-9])([A-Za-z][A-Za-z0-9_]*?)_(\d+)(?![A-Za-z0-9])")


def find_indexed(text: str) -> Iterator[re.Match]:
    """Every indexed name in `text` (a name stack, a label, a pytree path); group 1 is the name,
    group 2 the index."""
    return INDEXED.finditer(text)


def split_indexed(token: str) -> tuple[str, int] | None:
    """`("blocks", 3)` for the token `"blocks_3"`, None for a token that is not an indexed name."""
    m = INDEXED.fullmatch(token)
    return (m.group(1), int(m.group(2))) if m else None


def star_indices(text: str, names: Collection[str] | None = None) -> str:
    """`text` with the index of every indexed name (of `names` only, when given) replaced by `*`."""
    return INDEXED.sub(lambda m: f"{m.group(1)}_*" if names is None or m.group(1) in names else m.group(0), text)
