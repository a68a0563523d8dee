"""causal_conv1d_update: against the float64 reference, against the forward (prefill + decode), in a
shuffled state pool, in place under donation, under vmap, and its argument checks."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, DTYPES, GPU, assert_close, device, to_f64

import jax_causal_conv as jcc
from jax_causal_conv import reference

LAYOUTS = ["BLD", "BDL"]
MODES = ["shift", "ring"]


def x_like(rng, batch, steps, channels, dtype, layout):
    shape = (batch, steps, channels) if layout == "BLD" else (batch, channels, steps)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def steps_of(a, start, stop, layout):
    """a[:, start:stop] along the time axis of `layout`."""
    return a[:, start:stop] if layout == "BLD" else a[:, :, start:stop]


def step(a, t, layout):
    return a[:, t] if layout == "BLD" else a[:, :, t]


def weights(rng, channels, width):
    w = jnp.asarray(rng.standard_normal((channels, width)) / np.sqrt(width), jnp.float32)
    b = jnp.asarray(rng.standard_normal(channels), jnp.float32)
    return w, b


def put(dev, tree):
    return jax.device_put(tree, device(dev))


def check_against_reference(dev, dtype, x, state, w, bias, kwargs, padding_rows, what):
    """One jitted update against the float64 reference (y) and the reference in x's dtype (the
    state, which only ever receives copies of x or of itself: exact in every dtype); padding_rows'
    y must be 0."""
    y, new_state = jax.jit(
        lambda x, s, w, b: jcc.causal_conv1d_update(x, s, w, b, **kwargs)
    )(*put(dev, (x, state, w, bias)))
    y_ref, _ = reference.causal_conv1d_update(*to_f64((x, state, w, bias)), **kwargs)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, y_ref, dtype, what)
    _, state_ref = reference.causal_conv1d_update(x, state, w, bias, **kwargs)
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(state_ref))
    if padding_rows:
        assert np.all(np.asarray(y[jnp.asarray(padding_rows)], np.float32) == 0), "padding rows must give y = 0"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, mode, layout, dev):
    rng = np.random.default_rng(DTYPES.index(dtype) * 4 + MODES.index(mode) * 2 + LAYOUTS.index(layout))
    B, D, K = 4, 6, 4
    # (tokens, state slots, pool rows or None, bias, activation): one token with a state of
    # exactly K-1 slots, and several tokens with a larger state in a pool with padding rows.
    for tokens, S, pool, use_bias, activation in ((1, K - 1, None, True, "silu"), (3, K + 2, 7, False, None)):
        if tokens == 1:
            x = jnp.asarray(rng.standard_normal((B, D)), dtype)
        else:
            x = x_like(rng, B, tokens, D, dtype, layout)
        state = x_like(rng, pool or B, S, D, dtype, layout)
        w, b = weights(rng, D, K)
        kwargs = dict(activation=activation, layout=layout)
        if mode == "ring":
            kwargs["cache_seqlens"] = jnp.asarray([0, 2, 3 * S + 1, 17], jnp.int32)
        if pool is not None:
            kwargs["state_indices"] = jnp.asarray([5, -1, 0, 7], jnp.int32)  # -1 and 7: padding
        bias = b if use_bias else None
        check_against_reference(dev, dtype, x, state, w, bias, kwargs,
                                [1, 3] if pool is not None else [], f"y tokens={tokens}")


# Enough work for the CPU kernel's thread pool (B*T*D >= 65536 points) and channels in several
# tiles of 1024, the last one partial; a pool with padding rows and rows in shuffled order.
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_many_channel_tiles(mode, layout, dev):
    rng = np.random.default_rng(40 + MODES.index(mode) * 2 + LAYOUTS.index(layout))
    B, T, D, K, S, pool = 12, 3, 2500, 4, 5, 16
    x = x_like(rng, B, T, D, jnp.bfloat16, layout)
    state = x_like(rng, pool, S, D, jnp.bfloat16, layout)
    w, b = weights(rng, D, K)
    indices = rng.permutation(pool)[:B].astype(np.int32)
    indices[[2, 7]] = [-1, pool]  # padding rows
    kwargs = dict(activation="silu", layout=layout, state_indices=jnp.asarray(indices))
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.asarray(rng.integers(0, 40, B), jnp.int32)
    check_against_reference(dev, jnp.bfloat16, x, state, w, b, kwargs, [2, 7], "y")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width", [1, 2, 5, 9])
def test_widths(width, mode, dev):
    rng = np.random.default_rng(width)
    B, D, T = 3, 5, 2
    S = width - 1 if mode == "shift" else width + 1
    x = x_like(rng, B, T, D, jnp.float32, "BLD")
    state = x_like(rng, B, S, D, jnp.float32, "BLD")
    w, b = weights(rng, D, width)
    kwargs = dict(activation="silu")
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.asarray([0, 4, 11], jnp.int32)
    y, new_state = jcc.causal_conv1d_update(*put(dev, (x, state, w, b)), **kwargs)
    y_ref, state_ref = reference.causal_conv1d_update(*to_f64((x, state, w, b)), **kwargs)
    assert_close(y, y_ref, jnp.float32, f"y K={width}")
    np.testing.assert_array_equal(np.asarray(new_state, np.float64), np.asarray(state_ref))


def one_token_check(rng, dtype, layout, mode, B, D, K, dev, pool=None, indices=None, activation="silu"):
    """One decode step against the reference: y at DESIGN tolerance, the state exactly."""
    S = K - 1
    x = jnp.asarray(rng.standard_normal((B, D)), dtype)
    state = x_like(rng, pool or B, S, D, dtype, layout)
    w, b = weights(rng, D, K)
    kwargs = dict(activation=activation, layout=layout)
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.asarray(rng.integers(-2, 4 * S + 3, B), jnp.int32)
    if indices is not None:
        kwargs["state_indices"] = jnp.asarray(indices, jnp.int32)
    check_against_reference(dev, dtype, x, state, w, b, kwargs, [], f"y {layout} {mode} D={D} K={K}")


# The GPU's one-token kernel takes a vector of channels (16 bytes of x) in several batch rows per
# thread where the channels tile the vectors, and one channel otherwise: D = 16 is whole vectors in
# every dtype, D = 12 only for 32- and 64-bit x, D = 5 for none. B = 7 is a multiple of no row count.
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("channels", [16, 12, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_vectors(dtype, mode, layout, channels, dev):
    rng = np.random.default_rng(60 + DTYPES.index(dtype) * 12 + MODES.index(mode) * 6 + LAYOUTS.index(layout) * 3 + channels)
    one_token_check(rng, dtype, layout, mode, 7, channels, 4, dev)
    # A state pool with padding rows (-1, and 9 == pool) among live ones.
    one_token_check(rng, dtype, layout, mode, 7, channels, 4, dev, pool=9, indices=[3, -1, 0, 8, 9, 5, 1])


@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_token_widths(dtype, layout, width, dev):
    rng = np.random.default_rng(120 + width * 4 + LAYOUTS.index(layout) * 2 + (dtype == jnp.float32))
    for mode in MODES:
        one_token_check(rng, dtype, layout, mode, 5, 24, width, dev, pool=6, indices=[2, 5, -1, 0, 4])


# Channel-first, where the channel vectors are a multiple of 32, the GPU's one-token kernel stages
# each warp's state through shared memory: D = 512 is 32 to 256 vectors in every dtype, B = 7 leaves
# a row tile short, and the pool has padding rows.
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_staged(dtype, width, dev):
    rng = np.random.default_rng(170 + DTYPES.index(dtype) * 8 + width)
    one_token_check(rng, dtype, "BDL", "shift", 7, 512, width, dev)
    one_token_check(rng, dtype, "BDL", "shift", 7, 512, width, dev, pool=9, indices=[3, -1, 0, 8, 9, 5, 1])


# The GPU's one-token kernel compiles the step with silu and without; this takes the path without
# in each of its variants: channel vectors (staged channel-first in shift mode: D = 512), and one
# channel a thread (D = 5).
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("channels", [512, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_without_activation(dtype, mode, layout, channels, dev):
    case = DTYPES.index(dtype) * 8 + MODES.index(mode) * 4 + LAYOUTS.index(layout) * 2 + (channels == 5)
    rng = np.random.default_rng(700 + case)
    check = partial(one_token_check, rng, dtype, layout, mode, 7, channels, 4, dev, activation=None)
    check()
    check(pool=9, indices=[3, -1, 0, 8, 9, 5, 1])


# The GPU's one-token kernel takes its channel vector from the grid's x index and its first batch
# row from y, then walks rows a grid's extent along y apart; z, the weight groups, is
# test_one_token_weight_groups'. Grid y is at most one wave of resident blocks over the x and z
# blocks (two blocks an SM: 264 on an H200). D = 4096 is 512 vectors, two blocks of 256 threads
# along x, and B = 5 five blocks along y, a row a thread. D = 48 is 6 vectors: a block of 32 x 8
# threads, most of them past the vectors, and B = 37 five blocks along y whose last has threads
# past the rows. B = 300 at D = 4096 (132 blocks along y on an H200) and B = 5000 at D = 48 (264
# blocks of 8 rows) are more than two waves' rows: threads walk two or three rows, the next one's
# loads in flight; the pool indices, with padding rows, take the walk through the row lookup.
# Beyond 65535 rows a weight group the generic kernel takes the step.
@pytest.mark.parametrize("dev", GPU)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_one_token_grid(mode, layout, dev):
    rng = np.random.default_rng(720 + MODES.index(mode) * 2 + LAYOUTS.index(layout))
    one_token_check(rng, jnp.bfloat16, layout, mode, 5, 4096, 4, dev)
    one_token_check(rng, jnp.bfloat16, layout, mode, 37, 48, 4, dev)
    one_token_check(rng, jnp.bfloat16, layout, mode, 65537, 8, 4, dev)
    one_token_check(rng, jnp.bfloat16, layout, mode, 300, 4096, 4, dev)
    walk = rng.permutation(5000)
    walk[::7] = -1
    one_token_check(rng, jnp.bfloat16, layout, mode, 5000, 48, 4, dev, pool=5000, indices=walk)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_one_token_weight_groups(mode, layout, dev):
    """vmapped weights become weight groups of one launch; 5 rows per group split into uneven
    row tiles, which must not mix groups."""
    rng = np.random.default_rng(150 + MODES.index(mode) * 2 + LAYOUTS.index(layout))
    G, B, D, K = 3, 5, 16, 4
    x = jnp.asarray(rng.standard_normal((G, B, D)), jnp.bfloat16)
    state = x_like(rng, G * B, K - 1, D, jnp.bfloat16, layout)
    state = state.reshape((G, B) + state.shape[1:])
    w = jnp.asarray(rng.standard_normal((G, D, K)) / 2, jnp.float32)
    b = jnp.asarray(rng.standard_normal((G, D)), jnp.float32)
    seqlens = jnp.asarray(rng.integers(0, 12, (G, B)), jnp.int32)
    indices = jnp.asarray([[4, -1, 0, 2, 1], [0, 1, 2, 3, 4], [3, 2, 5, -1, 0]], jnp.int32)

    def f(x, state, w, b, seqlens, indices):
        return jcc.causal_conv1d_update(
            x, state, w, b, activation="silu", cache_seqlens=seqlens if mode == "ring" else None,
            state_indices=indices, layout=layout,
        )

    y, new_state = jax.jit(jax.vmap(f))(*put(dev, (x, state, w, b, seqlens, indices)))
    for g in range(G):
        kwargs = dict(activation="silu", state_indices=indices[g], layout=layout)
        if mode == "ring":
            kwargs["cache_seqlens"] = seqlens[g]
        y_ref, _ = reference.causal_conv1d_update(*to_f64((x[g], state[g], w[g], b[g])), **kwargs)
        assert_close(y[g], y_ref, jnp.bfloat16, f"group {g} y")
        _, state_ref = reference.causal_conv1d_update(x[g], state[g], w[g], b[g], **kwargs)
        np.testing.assert_array_equal(np.asarray(new_state[g]), np.asarray(state_ref))


def decode_one_by_one(x_new, state, w, b, layout, cache_start=None, state_indices=None):
    """Feeds x_new one token at a time through a lax.scan, as a serving loop would."""

    def body(carry, t):
        state, = carry
        x_t = jax.lax.dynamic_index_in_dim(x_new, t, axis=1 if layout == "BLD" else 2, keepdims=False)
        seqlens = None if cache_start is None else cache_start + t
        y_t, state = jcc.causal_conv1d_update(
            x_t, state, w, b, activation="silu", cache_seqlens=seqlens,
            state_indices=state_indices, layout=layout,
        )
        return (state,), y_t

    T = x_new.shape[1] if layout == "BLD" else x_new.shape[2]
    (state,), ys = jax.lax.scan(body, (state,), jnp.arange(T, dtype=jnp.int32))
    return jnp.moveaxis(ys, 0, 1 if layout == "BLD" else 2), state


def ring_of(x_full, positions, S, layout):
    """The ring state expected after writing x_full[:, p] to slot p % S for p in positions."""
    x_bld = np.asarray(x_full if layout == "BLD" else jnp.swapaxes(x_full, 1, 2))
    ring = np.zeros((x_bld.shape[0], S, x_bld.shape[2]), x_bld.dtype)
    for p in positions:
        ring[:, p % S] = x_bld[:, p]
    return ring if layout == "BLD" else np.swapaxes(ring, 1, 2)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_prefill_then_decode_equals_forward(mode, layout, dev):
    rng = np.random.default_rng(10 + MODES.index(mode) * 2 + LAYOUTS.index(layout))
    B, D, K, L, T = 3, 6, 4, 7, 5
    x_full = x_like(rng, B, L + T, D, jnp.float32, layout)
    w, b = weights(rng, D, K)
    x_full, w, b = put(dev, (x_full, w, b))
    conv = jax.jit(
        lambda x: jcc.causal_conv1d(x, w, b, activation="silu", return_final_state=True, layout=layout)
    )
    y_full, final_full = conv(x_full)
    x_pre, x_new = steps_of(x_full, 0, L, layout), steps_of(x_full, L, L + T, layout)
    y_expected = steps_of(y_full, L, L + T, layout)

    if mode == "shift":
        _, state = conv(x_pre)
        cache_start = None
        expected_state = np.asarray(final_full)
    else:
        # A ring of K+1 < L slots, filled by the update itself from empty: the prefill wraps around.
        S = K + 1
        state = jnp.asarray(rng.standard_normal((B, S, D) if layout == "BLD" else (B, D, S)), jnp.float32)
        start = jnp.zeros((B,), jnp.int32)
        y_pre, state = jcc.causal_conv1d_update(
            x_pre, put(dev, state), w, b, activation="silu", cache_seqlens=start, layout=layout
        )
        assert_close(y_pre, steps_of(y_full, 0, L, layout), jnp.float32, "ring prefill")
        np.testing.assert_array_equal(np.asarray(state), ring_of(x_full, range(L - S, L), S, layout))
        cache_start = jnp.full((B,), L, jnp.int32)
        expected_state = ring_of(x_full, range(L + T - S, L + T), S, layout)

    y_one, state_one = jax.jit(decode_one_by_one, static_argnums=4)(x_new, state, w, b, layout, cache_start)
    assert_close(y_one, y_expected, jnp.float32, "one token at a time")
    np.testing.assert_array_equal(np.asarray(state_one), expected_state)

    y_all, state_all = jcc.causal_conv1d_update(
        x_new, state, w, b, activation="silu", cache_seqlens=cache_start, layout=layout
    )
    assert_close(y_all, y_expected, jnp.float32, "T tokens at once")
    np.testing.assert_array_equal(np.asarray(state_all), expected_state)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_state_pool_with_shuffled_rows(mode, dev):
    rng = np.random.default_rng(20 + MODES.index(mode))
    B, D, K, L, T, pool = 4, 5, 3, 6, 4, 9
    S = K - 1 if mode == "shift" else K + 2
    x_full = x_like(rng, B, L + T, D, jnp.float32, "BLD")
    w, b = weights(rng, D, K)
    y_full = jcc.causal_conv1d(x_full, w, b, activation="silu")
    # Rows 0 and 2 live at shuffled pool rows; row 1 (index -1) and row 3 (index == pool) are padding.
    indices = np.asarray([6, -1, 2, pool], np.int32)
    pool_state = rng.standard_normal((pool, S, D)).astype(np.float32)
    live = [0, 2]
    if mode == "shift":
        _, final = jcc.causal_conv1d(x_full[:, :L], w, b, return_final_state=True)
        pool_state[indices[live]] = np.asarray(final)[live]
        cache_start = None
    else:
        pool_state[indices[live]] = ring_of(x_full, range(L - S, L), S, "BLD")[live]
        cache_start = jnp.full((B,), L, jnp.int32)
    before = pool_state.copy()

    y, new_pool = jax.jit(decode_one_by_one, static_argnums=4)(
        *put(dev, (x_full[:, L:], jnp.asarray(pool_state), w, b)), "BLD", cache_start, jnp.asarray(indices)
    )
    assert_close(y[jnp.asarray(live)], y_full[jnp.asarray(live), L:], jnp.float32, "live rows")
    assert np.all(np.asarray(y)[[1, 3]] == 0), "padding rows must give y = 0"
    new_pool = np.asarray(new_pool)
    untouched = [r for r in range(pool) if r not in indices[live]]
    np.testing.assert_array_equal(new_pool[untouched], before[untouched])
    if mode == "shift":
        _, final_full = jcc.causal_conv1d(x_full, w, b, return_final_state=True)
        expected = np.asarray(final_full)[live]
    else:
        expected = ring_of(x_full, range(L + T - S, L + T), S, "BLD")[live]
    np.testing.assert_array_equal(new_pool[indices[live]], expected)


def pool_copies(hlo_text: str, pool_shape: str) -> list[str]:
    """Instructions that produce a fresh pool-shaped buffer (anything but the parameter or a view)."""
    found = []
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%\S+\s*=\s*(\S+)\s+([\w-]+)\(", line)
        views = ("parameter", "bitcast", "get-tuple-element")
        if m and m.group(1).startswith(pool_shape + "{") and m.group(2) not in views:
            found.append(line.strip())
    return found


@pytest.mark.parametrize("dev", DEVICES)
def test_donated_pool_is_updated_in_place(dev):
    rng = np.random.default_rng(30)
    B, D, K, pool, S = 3, 8, 4, 64, 3
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((pool, S, D)), jnp.float32)
    w, b = weights(rng, D, K)
    indices = jnp.asarray([5, 40, -1], jnp.int32)
    args = put(dev, (x, state, w, b, indices))

    def step_fn(x, state, w, b, indices):
        return jcc.causal_conv1d_update(x, state, w, b, activation="silu", state_indices=indices)

    shape = f"f32[{pool},{S},{D}]"
    donated = jax.jit(step_fn, donate_argnums=1).lower(*args).compile().as_text()
    assert "output_to_operand_aliasing" in donated
    assert pool_copies(donated, shape) == [], "the donated pool was copied"
    # Control: without donation XLA must copy the pool before the in-place custom call.
    kept = jax.jit(step_fn).lower(*args).compile().as_text()
    assert pool_copies(kept, shape), "expected a pool copy when the state is not donated"

    expected = reference.causal_conv1d_update(x, state, w, b, activation="silu", state_indices=indices)
    y, new_state = jax.jit(step_fn, donate_argnums=1)(*args)
    assert_close(y, expected[0], jnp.float32, "donated y")
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(expected[1]))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("state_mapped", [True, False])
def test_vmap(state_mapped, dev):
    rng = np.random.default_rng(40 + state_mapped)
    V, B, T, D, K, pool, S = 3, 2, 2, 4, 3, 4, 5
    x = jnp.asarray(rng.standard_normal((V, B, T, D)), jnp.float32)
    state_shape = (V, pool, S, D) if state_mapped else (pool, S, D)
    state = jnp.asarray(rng.standard_normal(state_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D, K)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(D), jnp.float32)
    seqlens = jnp.asarray(rng.integers(0, 9, (V, B)), jnp.int32)
    indices = jnp.asarray([[3, 0], [-1, 2], [1, 4]], jnp.int32)  # 4 == pool: padding

    def f(x, state, w, seqlens, indices):
        return jcc.causal_conv1d_update(
            x, state, w, b, activation="silu", cache_seqlens=seqlens, state_indices=indices
        )

    state_axis = 0 if state_mapped else None
    y, new_state = jax.vmap(f, in_axes=(0, state_axis, 0, 0, 0))(*put(dev, (x, state, w, seqlens, indices)))
    for v in range(V):
        s_v = state[v] if state_mapped else state
        y_ref, state_ref = reference.causal_conv1d_update(
            x[v], s_v, w[v], b, activation="silu", cache_seqlens=seqlens[v], state_indices=indices[v]
        )
        assert_close(y[v], y_ref, jnp.float32, f"vmap y[{v}]")
        np.testing.assert_array_equal(np.asarray(new_state[v]), np.asarray(state_ref))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_lowering_on_platforms_without_kernels(layout, monkeypatch):
    from jax_causal_conv import _native

    monkeypatch.setattr(_native, "native_platforms", set())
    rng = np.random.default_rng(45 + LAYOUTS.index(layout))
    V, B, T, D, K, pool, S = 2, 3, 2, 4, 3, 5, 4
    x = x_like(rng, V * B, T, D, jnp.float32, layout)
    x = x.reshape((V, B) + x.shape[1:])
    state = x_like(rng, V * pool, S, D, jnp.float32, layout)
    state = state.reshape((V, pool) + state.shape[1:])
    w = jnp.asarray(rng.standard_normal((V, D, K)), jnp.float32)
    seqlens = jnp.asarray(rng.integers(0, 9, (V, B)), jnp.int32)
    indices = jnp.asarray([[4, -1, 0], [2, 3, 5]], jnp.int32)

    def f(x, state, w, seqlens, indices):
        return jcc.causal_conv1d_update(
            x, state, w, activation="silu", cache_seqlens=seqlens, state_indices=indices, layout=layout
        )

    y, new_state = jax.jit(jax.vmap(f))(x, state, w, seqlens, indices)
    assert "custom_call" not in jax.jit(jax.vmap(f)).lower(x, state, w, seqlens, indices).as_text()
    for v in range(V):
        y_ref, state_ref = reference.causal_conv1d_update(
            x[v], state[v], w[v], activation="silu", cache_seqlens=seqlens[v], state_indices=indices[v],
            layout=layout,
        )
        assert_close(y[v], y_ref, jnp.float32, f"fallback y[{v}]")
        np.testing.assert_array_equal(np.asarray(new_state[v]), np.asarray(state_ref))


def test_grad_raises_clear_error():
    rng = np.random.default_rng(50)
    x = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((2, 2, 3)), jnp.float32)
    w, _ = weights(rng, 3, 3)
    with pytest.raises(NotImplementedError, match="causal_conv1d_update has no derivative"):
        jax.grad(lambda x: jcc.causal_conv1d_update(x, state, w)[0].sum())(x)
    # Nothing is differentiated through the op here, so it is fine inside jax.grad.
    g = jax.grad(lambda s: (s * jcc.causal_conv1d_update(x, state, w)[0].sum()))(2.0)
    assert np.isfinite(float(g))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=np.zeros((2, 3, 4, 1), np.float32)), ValueError, "`x` must be"),
        (dict(x=np.zeros((2, 3), np.int32)), TypeError, "`x` must have dtype"),
        (dict(conv_state=np.zeros((2, 1, 3), np.float32)), ValueError, "S >= K-1=2"),
        (dict(conv_state=np.zeros((2, 2, 3), np.float16)), TypeError, "`conv_state` must have x's dtype"),
        (dict(conv_state=np.zeros((5, 2, 3), np.float32)), ValueError, "without `state_indices`"),
        (dict(weight=np.zeros((4, 3), np.float32)), ValueError, "`weight` must have shape"),
        (dict(cache_seqlens=np.zeros((2,), np.int64)), TypeError, "`cache_seqlens` must have dtype int32"),
        (dict(state_indices=np.zeros((3,), np.int32)), ValueError, "`state_indices` must have shape"),
        (dict(activation="relu"), ValueError, "`activation`"),
        (dict(layout="LBD"), ValueError, "`layout`"),
    ],
)
def test_validation(change, error, match):
    args = dict(
        x=np.ones((2, 3), np.float32), conv_state=np.ones((2, 2, 3), np.float32),
        weight=np.ones((3, 3), np.float32),
    )
    args.update(change)
    x, conv_state, weight = args.pop("x"), args.pop("conv_state"), args.pop("weight")
    for fn in (jcc.causal_conv1d_update, reference.causal_conv1d_update):
        with pytest.raises(error, match=match):
            fn(x, conv_state, weight, **args)
