"""Shape families: one symbolic trace of the step made concrete per batch size is the graph a trace
at that size makes (same ops, shapes, parameters and literals); steps that cannot be traced so say
why and are traced per size."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planner.graph.ir import Graph, Literal
from planner.graph.shape_family import BATCH, MIN_SIZE, SEQ, ShapeFamily, length_family, trace_family
from planner.graph.trace import trace
from planner.stages.microbatches import MicrobatchGraphs, microbatch_args
from zoo import get_model

# Parameters holding jaxprs (bodies kept for evaluation): compared by the ops they were inlined into.
_BODIES = {"jaxpr", "call_jaxpr", "fun_jaxpr", "branches", "body_jaxpr", "cond_jaxpr", "fwd_jaxpr_thunk", "bwd",
           "jvp_jaxpr_fun", "jvp_jaxpr_thunk"}


def _same_param(a, b) -> bool:
    try:
        if bool(np.all(a == b)):
            return True
    except Exception:  # objects without a usable ==: compared by their printed form
        pass
    return repr(a) == repr(b)


def assert_same_graph(got: Graph, want: Graph) -> None:
    assert len(got.ops) == len(want.ops)
    assert got.tensors == want.tensors
    assert got.inputs == want.inputs and got.input_paths == want.input_paths
    for a, b in zip(got.ops, want.ops):
        assert (a.name, a.outputs, a.name_stack) == (b.name, b.outputs, b.name_stack)
        assert set(a.params) == set(b.params)
        for k in set(a.params) - _BODIES:
            assert _same_param(a.params[k], b.params[k]), (a.name, k, a.params[k], b.params[k])
        for x, y in zip(a.inputs, b.inputs, strict=True):
            if isinstance(x, Literal):
                assert isinstance(y, Literal) and x.tensor == y.tensor
                assert np.asarray(x.value).item() == np.asarray(y.value).item()
            else:
                assert x == y


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "wresnet-tiny"])
def test_family_is_the_trace_at_each_size(name):
    """The zoo's transformer (a mean's divisor from the batch size), scanned Llama, MoE (token
    groups by reshape) and Wide-ResNet (BatchNorm over the batch): every size the same graph as
    tracing at that size."""
    bundle = get_model(name)
    args = (bundle.abstract_state(), bundle.abstract_batch())
    family = trace_family(bundle.train_step, args, (1,))
    assert isinstance(family, ShapeFamily), family
    assert family.symbolic_tensors and family.symbolic_ops
    for rows in (MIN_SIZE, 3, 8):
        assert_same_graph(family.at(rows), trace(bundle.train_step, *microbatch_args(args, rows)))


def _mean_step(params, batch):
    def loss(p):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
    return jax.grad(loss)(params)


def _args(rows: int = 8):
    return ({"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)},
            {"x": jax.ShapeDtypeStruct((rows, 4), jnp.float32), "y": jax.ShapeDtypeStruct((rows, 2), jnp.float32)})


def test_family_graph_evaluates_like_the_step():
    """The graph made at a size runs: its literal divisor is that size's (the mean's 1 / (rows * 2))."""
    family = trace_family(_mean_step, _args(), (1,))
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 2)).astype(np.float32)}
    batch = {"x": rng.normal(size=(6, 4)).astype(np.float32), "y": rng.normal(size=(6, 2)).astype(np.float32)}
    got = family.at(6).evaluate(jax.tree_util.tree_leaves((params, batch)))
    np.testing.assert_allclose(got[0], _mean_step(params, batch)["w"], rtol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        family.at(1)


def test_steps_that_cannot_be_a_family_say_why():
    def branches(params, batch):  # Python control flow on the batch size
        x = batch["x"] if batch["x"].shape[0] > 4 else 2 * batch["x"]
        return (x @ params["w"]).sum()

    def groups(params, batch):  # rows in pairs: a floor division of the batch size
        x = batch["x"]
        return (x[:x.shape[0] // 2 * 2].reshape(x.shape[0] // 2, 2, 4) @ params["w"]).sum()

    assert "does not trace with a symbolic batch size" in trace_family(branches, _args(), (1,))
    assert "not linear in the batch size" in trace_family(groups, _args(), (1,))


def test_microbatch_graphs_trace_per_size_where_there_is_no_family(monkeypatch):
    """Steps without a family are traced per size; a family serves every size, one row too (the
    symbolic program at one row, no trace of its own)."""
    def groups(params, batch):
        x = batch["x"]
        return (x[:x.shape[0] // 2 * 2].reshape(x.shape[0] // 2, 2, 4) @ params["w"]).sum()

    graphs = MicrobatchGraphs(_mean_step, _args(), -1)
    assert_same_graph(graphs.at(4, 2), trace(_mean_step, *_args(2)))
    assert isinstance(graphs.family, ShapeFamily)
    from planner.stages import microbatches

    def no_trace(*a, **k):
        raise AssertionError("traced although the family holds the size")
    with monkeypatch.context() as m:
        m.setattr(microbatches, "trace_microbatch", no_trace)
        assert_same_graph(graphs.at(8, 1), graphs.family.program_at(1))
    other = MicrobatchGraphs(groups, _args(), -1)
    assert_same_graph(other.at(2, 4), trace(groups, *_args(4)))
    assert isinstance(other.family, str)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_one_row_is_the_symbolic_program_at_one_row(name):
    """At one row the family gives the symbolic program evaluated there (`ShapeFamily.program_at`),
    not JAX's own trace (which has unit-dimension ops: gpt-tiny's `take_along_axis` reshapes the
    batch away): the same arguments and results, and evaluated op by op on the same one-row batch,
    the same numbers as that trace. Exactly: the programs differ only in ops over the unit
    dimension (broadcasts, reshapes, sums of one term), which round nothing."""
    bundle = get_model(name, batch=4, seq=16, d_model=32, dtype="float32")
    args = (bundle.abstract_state(), bundle.abstract_batch())
    family = trace_family(bundle.train_step, args, (1,))
    assert isinstance(family, ShapeFamily), family
    one = family.program_at(1)
    traced = trace(bundle.train_step, *microbatch_args(args, 1))
    assert [one.tensors[t] for t in one.inputs] == [traced.tensors[t] for t in traced.inputs]
    assert [one.tensors[t].shape for t in one.outputs if isinstance(t, int)] == \
        [traced.tensors[t].shape for t in traced.outputs if isinstance(t, int)]
    state = bundle.init_state(jax.random.PRNGKey(0))
    batch = jax.tree.map(lambda x: x[:1], bundle.make_batch(jax.random.PRNGKey(1)))
    flat = jax.tree_util.tree_leaves((state, batch))
    got, want = one.evaluate(flat), traced.evaluate(flat)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_a_family_graphs_layers_are_its_symbolic_graphs_partition(name):
    """`MicrobatchGraphs.layers_at`: a graph the symbolic trace made is partitioned into the model's
    repeated modules as clustering that graph itself does (the same layer of each op and input, the
    same phases and names), its keys telling the same layers apart and alike; keys differ between
    sizes (the layers' shapes do)."""
    from planner.stages.clustering import cluster_layers

    bundle = get_model(name)
    args = (bundle.abstract_state(), bundle.abstract_batch())
    graphs = MicrobatchGraphs(bundle.train_step, args, 1)
    batch = jax.tree.leaves(args[1])[0].shape[0]
    found = {}
    for count in (batch // MIN_SIZE, batch // 4, batch):  # microbatches of 2 and 4 rows, and of one
        rows = batch // count
        got, want = graphs.layers_at(count, rows, None), cluster_layers(graphs.at(count, rows))
        assert got.method == want.method == "modules"
        assert (got.op_layer, got.input_layer, got.op_phase, got.names) == \
            (want.op_layer, want.input_layer, want.op_phase, want.names)
        same = lambda keys: [[a == b for b in keys] for a in keys]  # noqa: E731
        assert same(got.keys) == same(want.keys)
        assert graphs.layers_at(count, rows, None) is got  # once per graph
        found[rows] = set(got.keys)
    assert not found[MIN_SIZE] & found[4]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "bert-tiny"])
def test_a_family_of_batch_and_length_is_the_trace_at_each_shape(name):
    """A zoo model built for a symbolic sequence length (its position table's shape symbolic too)
    and traced once with both sizes symbolic: at every (batch, length) the graph of the model built
    for that length, traced at that batch size (BERT's token types split the length in half: a
    literal evaluated per length). What lets a sweep over lengths trace once
    (`cli.plan._from_seq_family`)."""
    def build(s):
        bundle = get_model(name, seq=s)
        return bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch())

    family = length_family(build)
    assert isinstance(family, ShapeFamily), family
    assert family.symbols == (BATCH, SEQ)
    for rows, seq in ((MIN_SIZE, 16), (3, 32), (8, 64)):
        concrete = get_model(name, seq=seq)
        args = microbatch_args((concrete.abstract_state(), concrete.abstract_batch()), rows)
        assert_same_graph(family.with_sizes(s=seq).at(rows), trace(concrete.train_step, *args))
    with pytest.raises(ValueError, match="not fixed"):
        family.at(8)
    with pytest.raises(ValueError, match="at least"):
        family.with_sizes(s=1)
    with pytest.raises(ValueError, match="cannot fix"):
        family.with_sizes(t=8)

