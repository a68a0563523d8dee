"""vmap of causal_conv1d: one kernel launch per op, ensembles, and vmap composed with autodiff.

Each test builds the same function around the kernels' causal_conv1d and around the float64
reference (whose vmap and grad are plain JAX), and compares them in float64 on the CPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, random_seq_idx

import jax_causal_conv as jcc
from jax_causal_conv import reference

F64 = jnp.float64


def custom_calls(fn, *args) -> dict:
    """Kernel launches per op, and whether there is a loop, in fn's lowered module."""
    text = jax.jit(fn).lower(*args).as_text()
    return dict(
        fwd=len(re.findall(r"custom_call @jax_causal_conv_causal_conv1d_fwd\b", text)),
        bwd=len(re.findall(r"custom_call @jax_causal_conv_causal_conv1d_bwd\b", text)),
        loop=bool(re.search(r"stablehlo\.while|\bscan\b", text)),
    )


def normal(rng, shape, dtype=F64, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def conv_fn(conv, **kwargs):
    """causal_conv1d(x, w, b, s, seq_idx) with fixed keyword arguments, for either version."""

    def fn(x, w, b, s=None, seq_idx=None):
        return conv(x, w, b, initial_state=s, seq_idx=seq_idx, **kwargs)

    return fn


def assert_tree_close(out, ref, dtype, what):
    leaves_out, leaves_ref = jax.tree.leaves(out), jax.tree.leaves(ref)
    assert len(leaves_out) == len(leaves_ref), what
    for i, (o, r) in enumerate(zip(leaves_out, leaves_ref)):
        assert_close(o, r, dtype, f"{what}[{i}]")


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("axis", [0, 2])
def test_vmapped_x_is_one_kernel_call(layout, axis):
    """A vmapped x (and seq_idx) with shared weights runs as one forward and one backward call."""
    rng = np.random.default_rng(0)
    V, B, L, D, K = 3, 2, 12, 5, 4
    x_shape = [B, L, D] if layout == "BLD" else [B, D, L]
    x_shape.insert(axis, V)
    x = normal(rng, x_shape, jnp.float32)
    seq_idx = jnp.asarray(np.stack([random_seq_idx(rng, B, L) for _ in range(V)]))
    w, b = normal(rng, (D, K), jnp.float32, K ** -0.5), normal(rng, (D,), jnp.float32)
    dy = normal(rng, (V,) + tuple(np.delete(x_shape, axis)), jnp.float32)

    def batched(conv):
        fn = conv_fn(conv, activation="silu", layout=layout)
        return jax.vmap(lambda x, w, b, q: fn(x, w, b, seq_idx=q), in_axes=(axis, None, None, 0))

    def loss(conv):
        return lambda x, w, b: jnp.sum(batched(conv)(x, w, b, seq_idx) * dy)

    assert custom_calls(batched(jcc.causal_conv1d), x, w, b, seq_idx) == dict(fwd=1, bwd=0,
                                                                             loop=False)
    value_and_grad = jax.value_and_grad(loss(jcc.causal_conv1d), argnums=(0, 1, 2))
    assert custom_calls(value_and_grad, x, w, b) == dict(fwd=1, bwd=1, loop=False)

    y = jax.jit(batched(jcc.causal_conv1d))(x, w, b, seq_idx)
    args64 = (x.astype(F64), w.astype(F64), b.astype(F64))
    assert_close(y, batched(reference.causal_conv1d)(*args64, seq_idx), jnp.float32, "y")
    ref_grads = jax.grad(loss(reference.causal_conv1d), argnums=(0, 1, 2))(*args64)
    assert_tree_close(jax.jit(value_and_grad)(x, w, b)[1], ref_grads, jnp.float32, "grads")


@pytest.mark.parametrize("shared_x", [False, True])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_ensemble_of_convs(shared_x, layout):
    """Vmapped weight, bias and initial state (and x, or one x for all members)."""
    rng = np.random.default_rng(1)
    E, B, L, D, K = 3, 2, 9, 4, 3
    x_shape = (B, L, D) if layout == "BLD" else (B, D, L)
    s_shape = (B, K - 1, D) if layout == "BLD" else (B, D, K - 1)
    x = normal(rng, x_shape if shared_x else (E,) + x_shape)
    w, b = normal(rng, (E, D, K), scale=K ** -0.5), normal(rng, (E, D))
    s = normal(rng, (E,) + s_shape)
    dy, dF = normal(rng, (E,) + x_shape), normal(rng, (E,) + s_shape)
    in_axes = (None if shared_x else 0, 0, 0, 0)

    def ensemble(conv):
        fn = conv_fn(conv, activation="silu", return_final_state=True, layout=layout)
        return jax.vmap(fn, in_axes=in_axes)

    def loss(conv):
        def f(x, w, b, s):
            y, final = ensemble(conv)(x, w, b, s)
            return jnp.sum(y * dy) + jnp.sum(final * dF)

        return f

    assert custom_calls(ensemble(jcc.causal_conv1d), x, w, b, s)["fwd"] == 1
    out = jax.jit(ensemble(jcc.causal_conv1d))(x, w, b, s)
    ref = ensemble(reference.causal_conv1d)(x, w, b, s)
    assert_tree_close(out, ref, F64, "y, final_state")
    grads = jax.jit(jax.grad(loss(jcc.causal_conv1d), argnums=(0, 1, 2, 3)))(x, w, b, s)
    ref_grads = jax.grad(loss(reference.causal_conv1d), argnums=(0, 1, 2, 3))(x, w, b, s)
    assert_tree_close(grads, ref_grads, F64, "dx, dw, db, ds")


@pytest.mark.parametrize("seq", [False, True])
def test_vmap_of_grad_per_example(seq):
    """Per-example gradients: vmap(grad) over examples with shared parameters."""
    rng = np.random.default_rng(2)
    N, L, D, K = 4, 10, 3, 4
    x, s = normal(rng, (N, 1, L, D)), normal(rng, (N, 1, K - 1, D))
    w, b = normal(rng, (D, K), scale=K ** -0.5), normal(rng, (D,))
    q = jnp.asarray(random_seq_idx(rng, N, L))[:, None] if seq else None
    dy, dF = normal(rng, (N, 1, L, D)), normal(rng, (N, 1, K - 1, D))

    def per_example(conv):
        fn = conv_fn(conv, activation="silu", return_final_state=True)

        def loss(x, w, b, s, q, dy, dF):
            y, final = fn(x, w, b, s, q)
            return jnp.sum(y * dy) + jnp.sum(final * dF)

        return jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)), in_axes=(0, None, None, 0, 0, 0, 0))

    args = (x, w, b, s, q, dy, dF)
    out = jax.jit(per_example(jcc.causal_conv1d))(*args)
    assert_tree_close(out, per_example(reference.causal_conv1d)(*args), F64, "per-example grads")
    assert out[1].shape == (N, D, K)


def test_grad_of_vmap_shared_and_mapped_parameters():
    """grad of a vmapped conv: cotangents of shared parameters are summed over the vmapped axis."""
    rng = np.random.default_rng(3)
    V, B, L, D, K = 3, 2, 7, 4, 2
    x, b = normal(rng, (V, B, L, D)), normal(rng, (V, D))
    w, s = normal(rng, (D, K), scale=K ** -0.5), normal(rng, (B, K - 1, D))
    dy = normal(rng, (V, B, L, D))

    def loss(conv):
        fn = jax.vmap(conv_fn(conv), in_axes=(0, None, 0, None))
        return lambda x, w, b, s: jnp.sum(fn(x, w, b, s) * dy)

    grads = jax.jit(jax.grad(loss(jcc.causal_conv1d), argnums=(0, 1, 2, 3)))(x, w, b, s)
    ref = jax.grad(loss(reference.causal_conv1d), argnums=(0, 1, 2, 3))(x, w, b, s)
    assert_tree_close(grads, ref, F64, "dx, dw, db, ds")


@pytest.mark.parametrize("inner_maps_weight", [False, True])
def test_vmap_of_vmap(inner_maps_weight):
    """Two nested vmaps (one over x only, one over x and the weights) still make one call per op."""
    rng = np.random.default_rng(4)
    V1, V2, B, L, D, K = 2, 3, 2, 8, 3, 4
    x = normal(rng, (V1, V2, B, L, D))
    w_lead = (V1, V2) if inner_maps_weight else (V1,)
    w, b = normal(rng, w_lead + (D, K), scale=K ** -0.5), normal(rng, w_lead + (D,))
    dy = normal(rng, x.shape)
    inner_axes = (0, 0, 0) if inner_maps_weight else (0, None, None)

    def nested(conv):
        return jax.vmap(jax.vmap(conv_fn(conv, activation="silu"), in_axes=inner_axes))

    def loss(conv):
        return lambda x, w, b: jnp.sum(nested(conv)(x, w, b) * dy)

    assert custom_calls(nested(jcc.causal_conv1d), x, w, b) == dict(fwd=1, bwd=0, loop=False)
    value_and_grad = jax.value_and_grad(loss(jcc.causal_conv1d), argnums=(0, 1, 2))
    assert custom_calls(value_and_grad, x, w, b) == dict(fwd=1, bwd=1, loop=False)
    y = jax.jit(nested(jcc.causal_conv1d))(x, w, b)
    assert_close(y, nested(reference.causal_conv1d)(x, w, b), F64, "y")
    ref = jax.grad(loss(reference.causal_conv1d), argnums=(0, 1, 2))(x, w, b)
    assert_tree_close(jax.jit(value_and_grad)(x, w, b)[1], ref, F64, "dx, dw, db")


@pytest.mark.parametrize("seq", [False, True])
def test_jacrev(seq):
    """Full Jacobians of y and the final state in x, weight, bias and initial state."""
    rng = np.random.default_rng(5)
    B, L, D, K = 2, 5, 2, 3
    x, s = normal(rng, (B, L, D)), normal(rng, (B, K - 1, D))
    w, b = normal(rng, (D, K), scale=K ** -0.5), normal(rng, (D,))
    q = jnp.asarray(random_seq_idx(rng, B, L, boundaries=[2], padding=False)) if seq else None

    def jac(conv):
        fn = conv_fn(conv, activation="silu", return_final_state=True)
        return jax.jacrev(lambda x, w, b, s: fn(x, w, b, s, q), argnums=(0, 1, 2, 3))

    out = jax.jit(jac(jcc.causal_conv1d))(x, w, b, s)
    assert_tree_close(out, jac(reference.causal_conv1d)(x, w, b, s), F64, "jacobian")
