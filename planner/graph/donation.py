"""Which argument a train step hands back: the state it takes and returns, whose buffers
`jax.jit(..., donate_argnums=...)` lets the compiled step reuse."""
from __future__ import annotations

from planner.graph.ir import Graph, Literal


def returns_its_argument(graph: Graph, position: int = 0) -> bool:
    """True when result `position` of the traced step has the pytree paths, shapes and dtypes of
    argument `position` (a train step's `state -> (new_state, metrics)`), so donating the argument
    loses nothing the caller still needs in the usual training loop."""
    prefix = f"[{position}]"

    def leaves(ids, paths) -> dict[str, tuple]:
        return {p[len(prefix):]: (None if isinstance(t, Literal) else
                                  (graph.tensors[t].shape, str(graph.tensors[t].dtype)))
                for t, p in zip(ids, paths) if p.startswith(prefix)}

    given = leaves(graph.inputs, graph.input_paths)
    return bool(given) and given == leaves(graph.outputs, graph.output_paths)
