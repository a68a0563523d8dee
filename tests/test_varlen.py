"""causal_conv1d_varlen: against the float64 reference (values and gradients), against running each
sequence alone, and its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, DTYPES, assert_close, device, to_f64

import jax_causal_conv as jcc
from jax_causal_conv import reference

# Sequences of 5, 0, 1, 2, 7 and 3 tokens (with K = 4: empty, shorter than K-1, and long ones),
# then 6 padding tokens.
LENGTHS = [5, 0, 1, 2, 7, 3]
TOKENS = 24


def cu_of(lengths, start=0):
    return jnp.asarray(np.concatenate([[start], start + np.cumsum(lengths)]), jnp.int32)


def inputs(rng, *, tokens, channels, width, num_seqs, dtype, states=True):
    return dict(
        x=jnp.asarray(rng.standard_normal((tokens, channels)), dtype),
        weight=jnp.asarray(rng.standard_normal((channels, width)) / np.sqrt(width), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(channels), jnp.float32),
        initial_states=(
            jnp.asarray(rng.standard_normal((num_seqs, width - 1, channels)), dtype) if states else None
        ),
    )


def put(dev, tree):
    return jax.device_put(tree, device(dev))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, dev):
    rng = np.random.default_rng(DTYPES.index(dtype))
    D, K = 6, 4
    # Two leading padding tokens (before cu_seqlens[0]) and four trailing ones.
    cu = cu_of(LENGTHS, start=2)
    a = inputs(rng, tokens=TOKENS, channels=D, width=K, num_seqs=len(LENGTHS), dtype=dtype)
    y, final = jax.jit(
        lambda a, cu: jcc.causal_conv1d_varlen(
            **a, cu_seqlens=cu, activation="silu", return_final_states=True
        )
    )(put(dev, a), cu)
    y_ref, final_ref = reference.causal_conv1d_varlen(
        **to_f64(a), cu_seqlens=cu, activation="silu", return_final_states=True
    )
    assert y.dtype == a["x"].dtype and final.dtype == a["x"].dtype
    assert_close(y, y_ref, dtype, "y")
    np.testing.assert_array_equal(np.asarray(final, np.float64), np.asarray(final_ref))
    padding = np.r_[0:2, int(cu[-1]):TOKENS]
    assert np.all(np.asarray(y, np.float32)[padding] == 0)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("with_states", [False, True])
def test_equals_each_sequence_alone(with_states, dev):
    rng = np.random.default_rng(10 + with_states)
    D, K = 5, 4
    cu = cu_of(LENGTHS)
    a = put(dev, inputs(rng, tokens=TOKENS, channels=D, width=K, num_seqs=len(LENGTHS),
                        dtype=jnp.float32, states=with_states))
    y, final = jcc.causal_conv1d_varlen(**a, cu_seqlens=cu, activation="silu", return_final_states=True)
    y_plain = jcc.causal_conv1d_varlen(**a, cu_seqlens=cu, activation="silu")
    np.testing.assert_array_equal(np.asarray(y_plain), np.asarray(y))
    for i, (start, stop) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
        state = None if a["initial_states"] is None else a["initial_states"][i][None]
        if stop == start:
            expected_final = np.zeros((K - 1, D), np.float32) if state is None else np.asarray(state[0])
            np.testing.assert_array_equal(np.asarray(final[i]), expected_final)
            continue
        y_i, final_i = jcc.causal_conv1d(
            a["x"][None, start:stop], a["weight"], a["bias"], activation="silu",
            initial_state=state, return_final_state=True,
        )
        assert_close(y[start:stop], y_i[0], jnp.float32, f"y of sequence {i}")
        np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(final_i[0]))
    assert np.all(np.asarray(y)[int(cu[-1]):] == 0)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize(
    "with_states, return_final", [(False, False), (True, False), (False, True), (True, True)]
)
def test_gradients_match_reference(with_states, return_final, dev):
    rng = np.random.default_rng(20 + 2 * with_states + return_final)
    D, K = 5, 4
    cu = cu_of(LENGTHS)
    a = inputs(rng, tokens=TOKENS, channels=D, width=K, num_seqs=len(LENGTHS), dtype=jnp.float32,
               states=with_states)
    dy = jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.float32)
    dfinal = jnp.asarray(rng.standard_normal((len(LENGTHS), K - 1, D)), jnp.float32)
    cotangent = (dy, dfinal) if return_final else dy

    def run(fn, a):
        return fn(**a, cu_seqlens=cu, activation="silu", return_final_states=return_final)

    out, vjp = jax.vjp(lambda a: run(jcc.causal_conv1d_varlen, a), put(dev, a))
    out_ref, vjp_ref = jax.vjp(lambda a: run(reference.causal_conv1d_varlen, a), to_f64(a))
    assert_close(out[0] if return_final else out, out_ref[0] if return_final else out_ref, jnp.float32, "y")
    (grads,), (grads_ref,) = vjp(put(dev, cotangent)), vjp_ref(to_f64(cotangent))
    for name in a:
        if a[name] is not None:
            assert_close(grads[name], grads_ref[name], jnp.float32, f"d{name}")


@pytest.mark.parametrize("width", [1, 2, 7])
def test_widths(width):
    rng = np.random.default_rng(30 + width)
    D = 4
    cu = cu_of(LENGTHS)
    a = inputs(rng, tokens=TOKENS, channels=D, width=width, num_seqs=len(LENGTHS), dtype=jnp.float32)
    y, final = jcc.causal_conv1d_varlen(**a, cu_seqlens=cu, return_final_states=True)
    y_ref, final_ref = reference.causal_conv1d_varlen(**to_f64(a), cu_seqlens=cu, return_final_states=True)
    assert final.shape == (len(LENGTHS), width - 1, D)
    assert_close(y, y_ref, jnp.float32, f"y K={width}")
    np.testing.assert_array_equal(np.asarray(final, np.float64), np.asarray(final_ref))


def test_no_sequences_is_all_padding():
    rng = np.random.default_rng(40)
    a = inputs(rng, tokens=5, channels=3, width=3, num_seqs=0, dtype=jnp.float32)
    for fn in (jcc.causal_conv1d_varlen, reference.causal_conv1d_varlen):
        y, final = fn(**a, cu_seqlens=jnp.zeros((1,), jnp.int32), return_final_states=True)
        assert final.shape == (0, 2, 3)
        assert np.all(np.asarray(y) == 0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=np.zeros((1, 8, 3), np.float32)), ValueError, "`x` must be packed tokens"),
        (dict(x=np.zeros((8, 3), np.int32)), TypeError, "`x` must have dtype"),
        (dict(cu_seqlens=np.asarray([0, 4, 8], np.int64)), TypeError, "`cu_seqlens` must have dtype int32"),
        (dict(cu_seqlens=np.zeros((2, 2), np.int32)), ValueError, "`cu_seqlens` must have shape"),
        (dict(cu_seqlens=None), ValueError, "`cu_seqlens` is required"),
        (dict(initial_states=np.zeros((3, 2, 3), np.float32)), ValueError,
         r"`initial_states` must have shape \(2, 2, 3\)"),
        (dict(initial_states=np.zeros((2, 2, 3), np.float16)), TypeError,
         "`initial_states` must have x's dtype"),
        (dict(weight=np.zeros((3, 300), np.float32)), ValueError, "width K must be in"),
        (dict(return_final_states=1), TypeError, "`return_final_states` must be a Python bool"),
        (dict(activation="gelu"), ValueError, "`activation`"),
    ],
)
def test_validation(change, error, match):
    args = dict(
        x=np.ones((8, 3), np.float32), weight=np.ones((3, 3), np.float32),
        cu_seqlens=np.asarray([0, 4, 8], np.int32),
    )
    args.update(change)
    x, weight = args.pop("x"), args.pop("weight")
    for fn in (jcc.causal_conv1d_varlen, reference.causal_conv1d_varlen):
        with pytest.raises(error, match=match):
            fn(x, weight, **args)
