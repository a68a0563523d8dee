"""Property-based tests (hypothesis): random problems against the float64 reference (issue 7).

Each example draws a small problem - shapes, dtypes, layout, K (1..9 mostly, up to 40 now and
then), the optional inputs, and per-row seq_idx patterns (packed segments, padding runs anywhere,
all padding, one segment, sparse, decreasing and reappearing ids) - and checks the kernels'
forward and every gradient against jax.vjp of the float64 reference. causal_conv1d_update
(shift and ring modes, padding state_indices, any int32 cache_seqlens) and causal_conv1d_varlen
(random cu_seqlens with empty sequences, leading and trailing padding, and offsets out of order
or past T) get the same treatment.

The profile is derandomized and keeps no example database, so CI runs the same examples every
time; JCC_HYPOTHESIS_SCALE=10 runs ten times as many.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, TOLERANCE, device, relative_error, to_f64
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_causal_conv as jcc
from jax_causal_conv import reference

settings.register_profile(
    "jax_causal_conv",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_PROFILE = settings.get_profile("jax_causal_conv")
_SCALE = float(os.environ.get("JCC_HYPOTHESIS_SCALE", "1"))


def examples(n: int) -> settings:
    return settings(_PROFILE, max_examples=max(1, int(n * _SCALE)))


X_DTYPES = [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def tolerance(*dtypes) -> float:
    """The loosest DESIGN.md tolerance among the dtypes a result passed through."""
    return max(TOLERANCE[jnp.dtype(d)] for d in dtypes)


def check(out, ref, tol, what):
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# ---- strategies ----

def widths(large=(12, 17, 24, 33, 40)):
    """K in 1..9 mostly (three entries each), and now and then one of `large`."""
    return st.sampled_from(list(range(1, 10)) * 3 + list(large))


ID_KINDS = ("packed", "padding_runs", "all_padding", "single", "sparse", "decreasing", "reappearing")


def make_ids(rng, kind: str, length: int) -> np.ndarray:
    """One row of seq_idx of the given kind: 1 to 6 runs of random lengths."""
    if kind == "all_padding":
        return np.full(length, rng.integers(INT32_MIN, -1, endpoint=True), np.int32)
    if kind == "single":
        return np.full(length, rng.integers(0, INT32_MAX, endpoint=True), np.int32)
    cuts = rng.choice(np.arange(1, length), size=min(int(rng.integers(1, 6)), length - 1), replace=False)
    runs = np.diff(np.concatenate([[0], np.sort(cuts), [length]]))
    n = len(runs)
    if kind == "packed":
        ids = np.arange(n)
    elif kind == "padding_runs":  # padding (any negative id) before, between and after segments
        ids = np.where(rng.random(n) < 0.4, rng.integers(-3, 0, n), np.arange(n))
    elif kind == "sparse":  # increasing, with gaps between the ids
        ids = rng.integers(0, 100) + np.cumsum(rng.integers(1, 1000, n))
    elif kind == "decreasing":
        ids = (n - 1 - np.arange(n)) * rng.integers(1, 4)
    else:  # reappearing: an id labels several runs, with other ids or padding between them
        ids = rng.integers(-1, 3, n)
    return np.repeat(ids, runs).astype(np.int32)


@st.composite
def id_rows(draw, length):
    """A row of seq_idx: the kind is drawn by hypothesis, the runs from a drawn seed."""
    kind = draw(st.sampled_from(ID_KINDS))
    return make_ids(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), kind, length)


@st.composite
def conv_problems(draw):
    layout = draw(st.sampled_from(["BLD", "BDL"]))
    dtype = draw(st.sampled_from(X_DTYPES))
    batch = draw(st.integers(1, 3))
    length = draw(st.one_of(st.integers(1, 24), st.integers(25, 80)))
    channels = draw(st.integers(1, 6))
    width = draw(widths())
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    weight_dtype = draw(st.sampled_from([acc, jnp.bfloat16]))
    bias_dtype = draw(st.sampled_from([None, acc, jnp.float16]))
    activation = draw(st.sampled_from([None, "silu", "swish"]))
    initial_state = draw(st.booleans())
    return_final_state = draw(st.booleans())
    seq_idx = None
    if draw(st.booleans()):
        seq_idx = np.stack([draw(id_rows(length)) for _ in range(batch)])
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(layout=layout, dtype=dtype, batch=batch, length=length, channels=channels,
                width=width, weight_dtype=weight_dtype, bias_dtype=bias_dtype,
                activation=activation, initial_state=initial_state,
                return_final_state=return_final_state, seq_idx=seq_idx, seed=seed)


def conv_arrays(prob):
    """Random arrays for a drawn problem: the differentiable args, seq_idx and the cotangent."""
    rng = np.random.default_rng(prob["seed"])
    B, L, D, K, layout = prob["batch"], prob["length"], prob["channels"], prob["width"], prob["layout"]
    P = K - 1
    x_shape = (B, L, D) if layout == "BLD" else (B, D, L)
    s_shape = (B, P, D) if layout == "BLD" else (B, D, P)
    dtype = prob["dtype"]
    args = dict(
        x=jnp.asarray(rng.standard_normal(x_shape), dtype),
        weight=jnp.asarray(rng.standard_normal((D, K)) / np.sqrt(K), prob["weight_dtype"]),
        bias=(None if prob["bias_dtype"] is None
              else jnp.asarray(rng.standard_normal(D), prob["bias_dtype"])),
        initial_state=jnp.asarray(rng.standard_normal(s_shape), dtype) if prob["initial_state"] else None,
    )
    dy = jnp.asarray(rng.standard_normal(x_shape), dtype)
    cotangent = (dy, jnp.asarray(rng.standard_normal(s_shape), dtype)) if prob["return_final_state"] else dy
    seq_idx = None if prob["seq_idx"] is None else jnp.asarray(prob["seq_idx"])
    return args, seq_idx, cotangent


def conv_vjp(fn, args, seq_idx, cotangent, *, activation, layout, return_final_state):
    def f(a):
        return fn(a["x"], a["weight"], a["bias"], activation=activation,
                  initial_state=a["initial_state"], seq_idx=seq_idx,
                  return_final_state=return_final_state, layout=layout)

    out, pull = jax.vjp(f, args)
    return out, pull(cotangent)[0]


@pytest.mark.parametrize("dev", DEVICES)
@examples(40)
@given(prob=conv_problems())
def test_causal_conv1d_forward_and_gradients(dev, prob):
    args, seq_idx, cotangent = conv_arrays(prob)
    static = dict(activation=prob["activation"], layout=prob["layout"],
                  return_final_state=prob["return_final_state"])
    out, grads = jax.jit(partial(conv_vjp, jcc.causal_conv1d, **static))(
        *jax.device_put((args, seq_idx, cotangent), device(dev)))
    out_ref, grads_ref = jax.jit(partial(conv_vjp, reference.causal_conv1d, **static))(
        to_f64(args), seq_idx, to_f64(cotangent))
    dtype = prob["dtype"]
    outs, outs_ref = (out, out_ref) if prob["return_final_state"] else ((out,), (out_ref,))
    for name, o, r in zip(("y", "final_state"), outs, outs_ref):
        assert o.dtype == dtype
        check(o, r, tolerance(dtype), name)
    for name, g in grads.items():
        if g is None:
            continue
        assert g.dtype == args[name].dtype, name
        check(g, grads_ref[name], tolerance(dtype, g.dtype), f"d{name}")


# ---- causal_conv1d_update ----

@st.composite
def update_problems(draw):
    layout = draw(st.sampled_from(["BLD", "BDL"]))
    dtype = draw(st.sampled_from(X_DTYPES))
    batch = draw(st.integers(1, 4))
    tokens = draw(st.integers(1, 5))
    single_token = tokens == 1 and draw(st.booleans())  # x as (B, D)
    channels = draw(st.integers(1, 6))
    width = draw(widths(large=(12, 20)))
    state_len = width - 1 + draw(st.integers(0, 4))
    activation = draw(st.sampled_from([None, "silu"]))
    bias = draw(st.booleans())
    cache_seqlens = None
    if draw(st.booleans()):  # ring mode: from a fresh sequence to the far ends of int32
        cache_seqlens = draw(st.lists(
            st.one_of(st.just(0), st.integers(0, 3 * state_len + 3),
                      st.integers(INT32_MAX - 8, INT32_MAX), st.integers(INT32_MIN, -1)),
            min_size=batch, max_size=batch))
    pool, state_indices = batch, None
    if draw(st.booleans()):
        pool = batch + draw(st.integers(0, 3))
        rows = draw(st.permutations(range(pool)))[:batch]
        padding = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
        bad = st.one_of(st.integers(INT32_MIN, -1), st.integers(pool, INT32_MAX))
        state_indices = [draw(bad) if pad else row for row, pad in zip(rows, padding)]
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(layout=layout, dtype=dtype, batch=batch, tokens=tokens, single_token=single_token,
                channels=channels, width=width, state_len=state_len, activation=activation,
                bias=bias, cache_seqlens=cache_seqlens, pool=pool, state_indices=state_indices,
                seed=seed)


def update_arrays(prob):
    rng = np.random.default_rng(prob["seed"])
    B, T, D, K, S = prob["batch"], prob["tokens"], prob["channels"], prob["width"], prob["state_len"]
    layout, dtype = prob["layout"], prob["dtype"]
    if prob["single_token"]:
        x_shape = (B, D)
    else:
        x_shape = (B, T, D) if layout == "BLD" else (B, D, T)
    s_shape = (prob["pool"], S, D) if layout == "BLD" else (prob["pool"], D, S)

    def ints(v):
        return None if v is None else jnp.asarray(v, jnp.int32)

    return dict(
        x=jnp.asarray(rng.standard_normal(x_shape), dtype),
        conv_state=jnp.asarray(rng.standard_normal(s_shape), dtype),
        weight=jnp.asarray(rng.standard_normal((D, K)) / np.sqrt(K), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(D), jnp.float32) if prob["bias"] else None,
        cache_seqlens=ints(prob["cache_seqlens"]),
        state_indices=ints(prob["state_indices"]),
    )


def run_update(fn, a, *, activation, layout):
    return fn(a["x"], a["conv_state"], a["weight"], a["bias"], activation=activation,
              cache_seqlens=a["cache_seqlens"], state_indices=a["state_indices"], layout=layout)


@pytest.mark.parametrize("dev", DEVICES)
@examples(40)
@given(prob=update_problems())
def test_causal_conv1d_update(dev, prob):
    a = update_arrays(prob)
    static = dict(activation=prob["activation"], layout=prob["layout"])
    y, state = jax.jit(partial(run_update, jcc.causal_conv1d_update, **static))(
        jax.device_put(a, device(dev)))
    y_ref, state_ref = jax.jit(partial(run_update, reference.causal_conv1d_update, **static))(
        to_f64(a) | {k: a[k] for k in ("cache_seqlens", "state_indices")})
    assert y.dtype == prob["dtype"] and y.shape == a["x"].shape
    check(y, y_ref, tolerance(prob["dtype"]), "y")
    # The state holds copies of x and old state values: exactly equal, nothing else touched.
    np.testing.assert_array_equal(np.asarray(state, np.float64), np.asarray(state_ref))


# ---- causal_conv1d_varlen ----

@st.composite
def varlen_problems(draw):
    dtype = draw(st.sampled_from(X_DTYPES))
    tokens = draw(st.integers(1, 40))
    channels = draw(st.integers(1, 5))
    width = draw(widths(large=(12, 20)))
    num_seqs = draw(st.integers(0, 5))
    if draw(st.integers(0, 2)) == 0:  # offsets no trace-time check can see: any order, past T
        cu = draw(st.lists(st.integers(-3, tokens + 5), min_size=num_seqs + 1, max_size=num_seqs + 1))
    else:  # sorted offsets: empty sequences, leading and trailing padding
        cu = sorted(draw(st.lists(st.integers(0, tokens), min_size=num_seqs + 1, max_size=num_seqs + 1)))
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return dict(
        dtype=dtype, tokens=tokens, channels=channels, width=width, num_seqs=num_seqs, cu=cu,
        weight_dtype=acc, bias=draw(st.booleans()), activation=draw(st.sampled_from([None, "silu"])),
        initial_states=draw(st.booleans()), return_final_states=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def varlen_vjp(fn, args, cu_seqlens, cotangent, *, activation, return_final_states):
    def f(a):
        return fn(a["x"], a["weight"], a["bias"], cu_seqlens=cu_seqlens, activation=activation,
                  initial_states=a["initial_states"], return_final_states=return_final_states)

    out, pull = jax.vjp(f, args)
    return out, pull(cotangent)[0]


@pytest.mark.parametrize("dev", DEVICES)
@examples(30)
@given(prob=varlen_problems())
def test_causal_conv1d_varlen_forward_and_gradients(dev, prob):
    rng = np.random.default_rng(prob["seed"])
    T, D, K, N, dtype = prob["tokens"], prob["channels"], prob["width"], prob["num_seqs"], prob["dtype"]
    args = dict(
        x=jnp.asarray(rng.standard_normal((T, D)), dtype),
        weight=jnp.asarray(rng.standard_normal((D, K)) / np.sqrt(K), prob["weight_dtype"]),
        bias=jnp.asarray(rng.standard_normal(D), jnp.float32) if prob["bias"] else None,
        initial_states=(jnp.asarray(rng.standard_normal((N, K - 1, D)), dtype)
                        if prob["initial_states"] else None),
    )
    dy = jnp.asarray(rng.standard_normal((T, D)), dtype)
    cotangent = dy
    if prob["return_final_states"]:
        cotangent = (dy, jnp.asarray(rng.standard_normal((N, K - 1, D)), dtype))
    cu = jnp.asarray(prob["cu"], jnp.int32)
    static = dict(activation=prob["activation"], return_final_states=prob["return_final_states"])
    out, grads = jax.jit(partial(varlen_vjp, jcc.causal_conv1d_varlen, **static))(
        *jax.device_put((args, cu, cotangent), device(dev)))
    out_ref, grads_ref = jax.jit(partial(varlen_vjp, reference.causal_conv1d_varlen, **static))(
        to_f64(args), cu, to_f64(cotangent))
    outs, outs_ref = (out, out_ref) if prob["return_final_states"] else ((out,), (out_ref,))
    for name, o, r in zip(("y", "final_states"), outs, outs_ref):
        assert o.dtype == dtype
        check(o, r, tolerance(dtype), name)
    for name, g in grads.items():
        if g is not None:
            check(g, grads_ref[name], tolerance(dtype, g.dtype), f"d{name}")
