"""The FFI handlers check the buffers XLA hands them, whoever lowers the call.

The public functions validate their arguments at trace time, so these checks are a second line:
a lowering (ours, or a user's `jax.ffi.ffi_call`) that passes buffers of the wrong size gets an
error from the handler, never a kernel reading or writing past a buffer. Each case calls the
registered target directly with one buffer of the wrong size, on the CPU and on the first GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, device

import jax_causal_conv as jcc
from jax_causal_conv import _native

B, L, D, K = 2, 16, 8, 4  # channel-last x (B, L, D); one group of weights (1, D, K)


def shaped(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def operands(rng):
    x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((1, D, K)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, D)), jnp.float32)
    no_state = jnp.zeros((0,), jnp.float32)
    no_seq_idx = jnp.zeros((0,), jnp.int32)
    return x, weight, bias, no_state, no_seq_idx


def forward(results, *args):
    call = jax.ffi.ffi_call(_native.target("causal_conv1d_fwd"), results)
    return call(*args, silu=np.bool_(True), channel_last=np.bool_(True))


FORWARD_CASES = {
    "y": ((shaped((B, L, D - 1)), shaped((0,))), "y must have x's size"),
    "final_state": ((shaped((B, L, D)), shaped((B, K, D))), "final_state has the wrong size"),
}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("buffer", list(FORWARD_CASES))
def test_forward_handler_refuses_a_wrong_size(buffer, dev):
    results, message = FORWARD_CASES[buffer]
    with jax.default_device(device(dev)):
        args = operands(np.random.default_rng(0))
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(lambda *a: forward(results, *a))(*args))


@pytest.mark.parametrize("dev", DEVICES)
def test_forward_handler_accepts_the_right_sizes(dev):
    """The same direct call with every buffer of the right size runs and matches the public op."""
    with jax.default_device(device(dev)):
        x, weight, bias, no_state, no_seq_idx = operands(np.random.default_rng(1))
        y, final_state = jax.jit(
            lambda *a: forward((shaped((B, L, D)), shaped((B, K - 1, D))), *a)
        )(x, weight, bias, no_state, no_seq_idx)
        want, want_state = jcc.causal_conv1d(x, weight[0], bias[0], activation="silu",
                                             return_final_state=True)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(final_state, want_state, rtol=0, atol=0)


def backward(results, *args):
    call = jax.ffi.ffi_call(_native.target("causal_conv1d_bwd"), results)
    return call(*args, silu=np.bool_(True), channel_last=np.bool_(True))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("buffer", ["dx", "dweight"])
def test_backward_handler_refuses_a_wrong_size(buffer, dev):
    platform = "cpu" if dev == "cpu" else "cuda"
    workspace = _native.backward_workspace_elements(platform, B, L, D, K)
    sizes = {"dx": (B, L, D), "dweight": (1, D, K)}
    sizes[buffer] = sizes[buffer][:-1] + (sizes[buffer][-1] - 1,)
    results = (shaped(sizes["dx"]), shaped(sizes["dweight"]), shaped((1, D)), shaped((0,)),
               shaped((workspace,)))
    message = {"dx": "dy and dx must have x's size",
               "dweight": "dweight and dbias must have the sizes of weight and bias"}[buffer]
    with jax.default_device(device(dev)):
        rng = np.random.default_rng(2)
        x, weight, bias, no_state, no_seq_idx = operands(rng)
        dy = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(lambda *a: backward(results, *a))(
                x, weight, bias, no_state, no_seq_idx, dy, no_state))
