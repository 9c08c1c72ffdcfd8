"""Shared test helpers: models with known answers and comparisons against the unsharded program."""
from __future__ import annotations

import textwrap
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from planner.graph.trace import trace
from zoo import get_model, make_optimizer

# MLP shapes with a textbook answer (2-layer MLP, AdamW):
# batch >> hidden: activations dwarf weights -> data parallel (one combined gradient all-reduce);
# hidden >> batch: weights dwarf activations -> Megatron (column then row split, one activation all-reduce).
TALL = dict(batch=16384, in_dim=64, hidden=64, out_dim=64)
WIDE = dict(batch=16, in_dim=256, hidden=8192, out_dim=256)


def tanh_chain_step(ws, x):
    """A train step over a chain of tanh layers in plain JAX (no module names), plain SGD."""
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)
    l, g = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * gw for w, gw in zip(ws, g)], l


# A user's module for `planner plan --fn FILE:FACTORY`: `make` an MLP step, `bad_trace` a step that
# fails while tracing, `raises` a factory that raises.
USER_STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def make(batch=16):
        def step(params, x):
            loss = lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
            value, g = jax.value_and_grad(loss)(params)
            return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), value
        params = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
                  "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32)}
        return step, (params, jax.ShapeDtypeStruct((batch, 32), jnp.float32))

    def bad_trace():
        def step(params, x):
            return x @ params["w1"].T  # shapes do not match
        return step, ({"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32)}, jax.ShapeDtypeStruct((16, 32), jnp.float32))

    def raises():
        raise RuntimeError("no data\\nsecond line")
""")


def zoo_graph(name: str, **overrides):
    """The traced train step of a zoo model on its abstract state and batch (nothing allocated)."""
    b = get_model(name, **overrides)
    return trace(b.train_step, b.abstract_state(), b.abstract_batch())


def concrete(name: str, **overrides):
    b = get_model(name, **overrides)
    return b, b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))


class ReferenceStep(NamedTuple):
    """A zoo model's first train step, run unsharded: what planned steps are compared against."""
    bundle: Any
    optimizer: Any  # the step's AdamW, from the model's config
    state: Any
    batch: Any
    ref_state: Any  # the unsharded step's new state
    ref_metrics: Any


def reference_step(name: str) -> ReferenceStep:
    """`concrete(name)` and its unsharded first step (jitted)."""
    b, state, batch = concrete(name)
    optimizer = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    return ReferenceStep(b, optimizer, state, batch, ref_state, ref_metrics)


def max_abs_diff(a, b) -> float:
    diffs = jax.tree_util.tree_map(lambda x, y: float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs), default=0.0)


def assert_trees_close(a, b, rtol, atol):
    """allclose per leaf, for results whose tolerance the caller derives."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


# --- Comparing a train step against the unsharded one -------------------------------------------
#
# A plan changes only where sums are split and in which order partial sums are added (per device,
# per microbatch, per collective). So what the plan changes is compared at a tolerance derived from
# that: Higham's bound for recursive summation, |fl(sum x_i) - sum x_i| <= (n-1) u sum|x_i|
# ("Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4), gives two summation orders
# of the same n terms a difference of at most 2 n u sum|x_i|. n is the longest sum in the program
# (read from its jaxpr), sum|x_i| the largest per-example absolute gradient (a normwise bound; see
# assert_gradients_close for why not per element).
# The optimizer update is compared separately: applied by the reference optimizer to the plan's own
# gradients (recovered from Adam's first moment), it must agree to a few roundings of elementwise
# arithmetic. Comparing Adam-updated parameters directly is wrong: Adam divides by sqrt(v), so a
# gradient that is zero up to summation noise moves its parameter by +-lr either way.

ELEMENTWISE_ROUNDINGS = 16  # Adam's update is ~12 rounded elementwise operations; recovering g from mu adds 2.


def unit_roundoff(dtype) -> float:
    return float(jnp.finfo(jnp.dtype(dtype)).eps) / 2  # jnp.finfo knows bfloat16 (2**-9); np.finfo does not


def longest_reduction(fn, *args) -> int:
    """Number of terms in the longest sum `fn` computes: dot contractions, reduce_sum axes and conv
    windows, in nested jaxprs too (scan bodies, custom_vjp rules, remat)."""
    closed = jax.make_jaxpr(fn)(*args)
    longest = 1

    def walk(jaxpr):
        nonlocal longest
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
            if name == "dot_general":
                (lc, _), _ = eqn.params["dimension_numbers"]
                longest = max(longest, int(np.prod([shapes[0][d] for d in lc], dtype=np.int64)))
            elif name == "reduce_sum":
                longest = max(longest, int(np.prod([shapes[0][d] for d in eqn.params["axes"]], dtype=np.int64)))
            elif name == "conv_general_dilated":
                rhs = shapes[1]
                out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
                longest = max(longest, int(np.prod(rhs, dtype=np.int64)) // rhs[out_feature])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(closed.jaxpr)
    return longest


def per_example_abs_grad(loss_fn, params, batch, max_bytes: int = 1 << 28):
    """mean_b |grad l_b|: the scale sum|x_i| of the terms that add up to a mean-loss gradient.
    Computed over chunks of examples whose per-example gradients hold at most `max_bytes`
    (4096 examples of an 8 MB model would hold 32 GB at once)."""
    def one(example):
        return jax.grad(loss_fn)(params, jax.tree.map(lambda x: x[None], example))

    per = jax.jit(jax.vmap(one))
    rows = jax.tree.leaves(batch)[0].shape[0]
    nbytes = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
    chunk = max(1, min(rows, max_bytes // max(nbytes, 1)))
    total = None
    for start in range(0, rows, chunk):
        grads = per(jax.tree.map(lambda x: x[start:start + chunk], batch))
        part = jax.tree.map(lambda g: np.sum(np.abs(np.asarray(g, np.float64)), axis=0), grads)
        total = part if total is None else jax.tree.map(np.add, total, part)
    return jax.tree.map(lambda t: t / rows, total)


def _adam_state(opt_state):
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    assert len(found) == 1, "expected one Adam state in the optimizer state"
    return found[0]


def gradients_from_adam(opt_state, b1: float = 0.9):
    """The gradient of a first Adam step from zero moments: mu = (1 - b1) g."""
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / (1 - b1), _adam_state(opt_state).mu)


def assert_loss_close(got, want, n: int, dtype=np.float32) -> None:
    """A mean of n positive per-token losses in two summation orders: sum|x_i| / n is the loss
    itself, so the two agree within 2 n u |loss| (u of `dtype`, the precision the program computes in)."""
    got, want = float(got), float(want)
    assert abs(got - want) <= 2 * n * unit_roundoff(dtype) * abs(want), (got, want, n)


def assert_gradients_close(loss_fn, params, batch, got, want, n: int, extra_roundings: int = 0,
                           absolute: float = 0.0, dtype=np.float32):
    """Gradients of a mean loss computed in two summation orders agree within 2 n u ||A||_inf per
    element, A being the per-example absolute gradient over all parameters.

    The bound is normwise, not per element: backward passes cancel internally (a softmax's
    Jacobian rows sum to zero, so the gradient of an attention key bias is zero up to rounding of
    terms as large as the other cotangents), so an element's own per-example magnitude does not
    bound its rounding. `extra_roundings` relative roundings of the gradient itself are added for
    gradients recovered by arithmetic (e.g. from an optimizer moment), `absolute` for the roundings
    of recovering them from parameters. `dtype`: the precision the sums are carried in (a mixed
    precision program's compute dtype).
    """
    u = unit_roundoff(dtype)
    scale = max(float(np.max(a)) for a in jax.tree.leaves(per_example_abs_grad(loss_fn, params, batch)))
    for (path, gp), gr in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        gp, gr = np.asarray(gp, np.float64), np.asarray(gr, np.float64)
        err = np.abs(gp - gr)
        tol = 2 * n * u * scale + np.abs(gr) * extra_roundings * u + absolute
        worst = np.unravel_index(np.argmax(err - tol), err.shape) if err.ndim else ()
        assert np.all(err <= tol), (
            f"gradient {jax.tree_util.keystr(path)}: |diff| {err[worst]:.3g} > bound {tol[worst]:.3g} "
            f"(n={n}, scale {scale:.3g})")


def assert_sgd_step_close(loss_fn, lr: float, params, batch, new_params, *, n: int | None = None):
    """Checks one SGD step p - lr g against the unsharded gradient: the gradient bound scaled by lr,
    plus two roundings of the subtraction (one in each program)."""
    n = n or longest_reduction(jax.grad(loss_fn), params, batch)
    u = unit_roundoff(np.float32)
    want_g = jax.jit(jax.grad(loss_fn))(params, batch)
    got_g = jax.tree.map(lambda p, q: (np.asarray(p, np.float64) - np.asarray(q, np.float64)) / lr,
                         params, new_params)
    # p - q recovers lr g up to the rounding of q = p - lr g and of the subtraction: 2u (|p| + |q|).
    largest = max(float(np.max(np.abs(np.asarray(p)))) for p in jax.tree.leaves(params))
    assert_gradients_close(loss_fn, params, batch, got_g, want_g, n, absolute=4 * u * largest / lr)


def assert_first_step_close(loss_fn, optimizer, state, batch, new_state, metrics, ref_state, ref_metrics,
                            *, train_step=None, dtype=np.float32):
    """Checks a planned first AdamW step against the unsharded one: loss and gradients within the
    summation-order bound, then the update applied to the plan's own gradients within a few roundings.

    Args:
      loss_fn: (params, batch) -> mean loss over the batch (for the per-example gradient scale).
      optimizer: the optax optimizer of the step (its first Adam moment reveals the gradient).
      state, batch: the step's inputs (opt_state freshly initialised).
      new_state, metrics: what the planned step returned; ref_state, ref_metrics: the unsharded step's.
      train_step: the step, to read its longest sum from; defaults to one built from loss_fn.
      dtype: the compute dtype of a mixed-precision step (activations and their sums); the
        parameters, gradients handed to the optimizer and its state are float32.
    """
    step = train_step or (lambda s, x: (jax.value_and_grad(loss_fn)(s["params"], x), s))
    n = longest_reduction(step, state, batch)
    u = unit_roundoff(np.float32)
    bound = 2 * n * unit_roundoff(dtype)
    assert_loss_close(metrics["loss"], ref_metrics["loss"], n, dtype)
    # Gradients: what the plan changes.
    g_plan = gradients_from_adam(new_state["opt_state"])
    assert_gradients_close(loss_fn, state["params"], batch, g_plan, gradients_from_adam(ref_state["opt_state"]),
                           n, extra_roundings=4, dtype=dtype)
    # The update: the reference optimizer applied to the plan's gradients gives the plan's new state.
    g32 = jax.tree.map(lambda g: np.asarray(g, np.float32), g_plan)
    updates, opt_state = optimizer.update(g32, state["opt_state"], state["params"])
    expected = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    k = ELEMENTWISE_ROUNDINGS * u
    for (path, got), want, step_size in zip(
            jax.tree_util.tree_leaves_with_path({"params": new_state["params"], "opt_state": new_state["opt_state"]}),
            jax.tree.leaves(expected),
            jax.tree.leaves({"params": updates, "opt_state": jax.tree.map(np.zeros_like, opt_state)})):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        tol = k * (np.abs(want) + np.abs(np.asarray(step_size, np.float64)))
        assert np.all(np.abs(got - want) <= tol), (
            f"update {jax.tree_util.keystr(path)}: max |diff| {np.max(np.abs(got - want)):.3g}")
    # Anything else in the state (batch statistics) is a mean over the batch: a summation bound.
    for key in set(new_state) - {"params", "opt_state"}:
        for got, want in zip(jax.tree.leaves(new_state[key]), jax.tree.leaves(ref_state[key])):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            assert np.all(np.abs(got - want) <= bound * (np.abs(want) + np.max(np.abs(want)))), key


def assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics):
    """assert_first_step_close for a zoo model bundle (AdamW from its config, its compute dtype)."""
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step, dtype=jnp.dtype(getattr(b.config, "dtype", "float32")))


def random_stage_table(rng, L, sizes, Q):
    """A stage latency table for `stages.dp.pipeline_dp` (Q in-flight counts, L layers, one column per
    submesh size): a range costs its layers' work over a noisy speed-up plus a fixed cost, a fifth of
    the cells do not fit, and more microbatches in flight never make a range faster."""
    per = rng.uniform(0.5, 2.0, L)
    t = np.full((Q, L, L, len(sizes)), np.inf)
    for k in range(L):
        for i in range(k, L):
            for m, z in enumerate(sizes):
                t[:, k, i, m] = per[k:i + 1].sum() / z ** rng.uniform(0.5, 1.0) + rng.uniform(0, 0.3)
    t[rng.uniform(size=t.shape) < 0.2] = np.inf  # memory: some ranges do not fit
    return np.sort(t, axis=0)                    # more microbatches in flight never helps
