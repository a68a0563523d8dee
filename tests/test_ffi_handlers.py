"""The FFI handlers check the buffers XLA hands them, whoever lowers the call.

The public functions validate their arguments at trace time, so these checks are a second line:
a lowering (ours, or a user's `jax.ffi.ffi_call`) that passes buffers of the wrong size gets an
error from the handler, never a kernel reading or writing past a buffer. Each case calls the
registered target directly with one buffer of the wrong size or dtype (a narrower dtype of the
same count is as short), on the CPU and on the first GPU.
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


def update_operands(rng, tokens=2):
    x = jnp.asarray(rng.standard_normal((B, tokens, D)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((1, D, K)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, D)), jnp.float32)
    conv_state = jnp.asarray(rng.standard_normal((B, K - 1, D)), jnp.float32)
    no_index = jnp.zeros((0,), jnp.int32)
    return x, weight, bias, conv_state, no_index, no_index


def call_target(name, results, *args):
    """The registered target `name`, called as a user's `jax.ffi.ffi_call` would, under jit."""
    call = jax.ffi.ffi_call(_native.target(name), results)
    return jax.jit(lambda *a: call(*a, silu=np.bool_(True), channel_last=np.bool_(True)))(*args)


FWD, UPDATE = "causal_conv1d_fwd", "causal_conv1d_update"
Y_MESSAGE = "y must have x's dtype and size"
FINAL_STATE_MESSAGE = "final_state has the wrong size or dtype"
NEW_STATE_MESSAGE = "new_conv_state must have conv_state's dtype and size"
# case: (target, operands, results, the handler's message)
REFUSED = {
    "fwd-y": (FWD, operands, (shaped((B, L, D - 1)), shaped((0,))), Y_MESSAGE),
    "fwd-y-dtype": (FWD, operands, (shaped((B, L, D), jnp.bfloat16), shaped((0,))), Y_MESSAGE),
    "fwd-final_state": (FWD, operands, (shaped((B, L, D)), shaped((B, K, D))), FINAL_STATE_MESSAGE),
    "fwd-final_state-dtype": (
        FWD, operands, (shaped((B, L, D)), shaped((B, K - 1, D), jnp.float16)), FINAL_STATE_MESSAGE),
    "update-y": (UPDATE, update_operands, (shaped((B, 1, D)), shaped((B, K - 1, D))), Y_MESSAGE),
    "update-new_conv_state": (UPDATE, update_operands, (shaped((B, 2, D)), shaped((B, K - 2, D))),
                              NEW_STATE_MESSAGE),
    "update-new_conv_state-dtype": (
        UPDATE, update_operands, (shaped((B, 2, D)), shaped((B, K - 1, D), jnp.bfloat16)),
        NEW_STATE_MESSAGE),
}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", list(REFUSED))
def test_handler_refuses_a_wrong_output(case, dev):
    target, make_operands, results, message = REFUSED[case]
    with jax.default_device(device(dev)):
        args = make_operands(np.random.default_rng(0))
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call_target(target, results, *args))


@pytest.mark.parametrize("dev", DEVICES)
def test_forward_handler_accepts_the_right_sizes(dev):
    """The same direct call with every buffer of the right size runs and matches the public op."""
    with jax.default_device(device(dev)):
        x, weight, bias, no_state, no_seq_idx = operands(np.random.default_rng(1))
        y, final_state = call_target(FWD, (shaped((B, L, D)), shaped((B, K - 1, D))),
                                     x, weight, bias, no_state, no_seq_idx)
        want, want_state = jcc.causal_conv1d(x, weight[0], bias[0], activation="silu",
                                             return_final_state=True)
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(final_state, want_state, rtol=0, atol=0)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("buffer", ["dx", "dx-dtype", "dweight", "dbias-dtype"])
def test_backward_handler_refuses_a_wrong_output(buffer, dev):
    platform = "cpu" if dev == "cpu" else "cuda"
    workspace = _native.backward_workspace_elements(platform, B, L, D, K)
    wrong = {"dx": shaped((B, L, D - 1)), "dx-dtype": shaped((B, L, D), jnp.float16),
             "dweight": shaped((1, D, K - 1)), "dbias-dtype": shaped((1, D), jnp.bfloat16)}
    results = {"dx": shaped((B, L, D)), "dweight": shaped((1, D, K)), "dbias": shaped((1, D))}
    results[buffer.removesuffix("-dtype")] = wrong[buffer]
    results = (*results.values(), shaped((0,)), shaped((workspace,)))
    message = ("dy and dx must have x's dtype and size" if buffer.startswith("dx") else
               "dweight and dbias must have the dtypes and sizes of weight and bias")
    with jax.default_device(device(dev)):
        rng = np.random.default_rng(2)
        x, weight, bias, no_state, no_seq_idx = operands(rng)
        dy = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call_target("causal_conv1d_bwd", results, x, weight, bias,
                                              no_state, no_seq_idx, dy, no_state))


@pytest.mark.parametrize("dev", DEVICES)
def test_update_handler_copies_an_unaliased_state(dev):
    """Called without the lowering's aliasing, the handler copies conv_state into new_conv_state
    before updating it; the results match the public op and conv_state is left as it was."""
    with jax.default_device(device(dev)):
        x, weight, bias, conv_state, no_index, _ = update_operands(np.random.default_rng(4))
        before = np.asarray(conv_state)
        y, new_state = call_target(UPDATE, (shaped((B, 2, D)), shaped((B, K - 1, D))),
                                   x, weight, bias, conv_state, no_index, no_index)
        want_y, want_state = jcc.causal_conv1d_update(x, conv_state, weight[0], bias[0],
                                                      activation="silu")
        np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new_state, want_state, rtol=0, atol=0)
        np.testing.assert_array_equal(conv_state, before)


def test_extensions_ffi_api_is_the_runtimes_or_older():
    """The extensions were compiled against an XLA FFI API the installed jaxlib accepts (the
    build pins jax 0.10.2's headers, API 0.3), and the runtime's version is readable."""
    runtime = _native.runtime_ffi_api_version()
    assert runtime is not None and runtime >= (0, 3)
    from jax_causal_conv import _cpu

    assert tuple(_cpu.ffi_api_version()) <= runtime
    if _native._cuda is not None:
        assert tuple(_native._cuda.ffi_api_version()) == tuple(_cpu.ffi_api_version())


@pytest.mark.parametrize("built, runtime", [((0, 4), (0, 4)), ((0, 3), (0, 5)), ((0, 5), None)])
def test_ffi_api_check_accepts(built, runtime):
    _native.check_ffi_api_version("_cpu", built, runtime)


@pytest.mark.parametrize("built, runtime", [((0, 5), (0, 4)), ((1, 0), (0, 9))])
def test_ffi_api_check_rejects_a_newer_extension(built, runtime):
    """Registered, such an extension would make XLA fail to start the backend; the import says
    why instead, and how to rebuild."""
    with pytest.raises(ImportError, match=r"compiled against XLA FFI API .*--no-build-isolation"):
        _native.check_ffi_api_version("_cpu", built, runtime)
