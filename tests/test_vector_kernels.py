"""Shapes that take the vectorized CUDA kernels (compile-time K <= 8, float or half x, the packs
tiling the contiguous dimension), forward and backward against the float64 reference.

Channel-last: D a multiple of 8, several time tiles with a tail. Channel-first: L a multiple of 8
over several 32-pack segments, with few rows, so that rows are cut into chunks and each chunk's
last dx needs the next chunk's first deltas; and (GPU only, they are large) enough rows for
whole-row warps and a long channel-last row cut into many tiles. On the CPU the same cases run
the CPU kernels.

With seq_idx the channel-last kernels run the step code without seq_idx wherever a step's
window lies inside one segment, and test taps only at the steps whose windows reach across a
boundary or into padding: the packed rows below put boundaries where pieces, backward tiles and
the kernels' 32-step checks start, and just after.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DEVICES, GPU, assert_close, device, make_inputs, to_f64
from test_backward import GRAD_NAMES, compare, inputs, kernel_vjp, packed_seq_idx
from test_forward import reference_outputs, run_and_compare

import jax_causal_conv as jcc
from jax_causal_conv import reference

HALF_AND_FLOAT = [jnp.float32, jnp.float16, jnp.bfloat16]
SHAPES = {"BLD": dict(batch=2, length=300, channels=64), "BDL": dict(batch=2, length=1000, channels=4)}


def seq_idx_for(batch: int, length: int) -> np.ndarray:
    """Packed rows with boundaries at segment and tile edges, and padding (see packed_seq_idx)."""
    rows = packed_seq_idx(length, [63, 128, 255, 256, 700 % length])
    return rows[np.arange(batch) % len(rows)]


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_widths_and_dtypes(dev, layout, dtype, width):
    rng = np.random.default_rng(width)
    args, _ = inputs(rng, dtype, width=width, layout=layout, **SHAPES[layout])
    compare(dev, rng, args, None, dtype, activation="silu", layout=layout, final="random")


@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_seq_idx", "seq_idx"])
@pytest.mark.parametrize("activation", [None, "silu"], ids=["identity", "silu"])
@pytest.mark.parametrize("width", [2, 4, 7])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_features(dev, layout, width, activation, masked, state):
    rng = np.random.default_rng(width)
    shape = dict(SHAPES[layout], batch=4)
    seq = seq_idx_for(shape["batch"], shape["length"]) if masked else None
    for dtype in (jnp.float32, jnp.bfloat16):
        args, seq_idx = inputs(rng, dtype, width=width, layout=layout, state=state, seq_idx=seq,
                               **shape)
        compare(dev, rng, args, seq_idx, dtype, activation=activation, layout=layout,
                final="random" if state else "none")


LARGE = [
    pytest.param("BDL", dict(batch=2, length=512, channels=4096), id="BDL-whole-rows"),
    pytest.param("BLD", dict(batch=1, length=16384, channels=2048), id="BLD-long-rows"),
]


@pytest.mark.parametrize("masked", [False, True], ids=["no_seq_idx", "seq_idx"])
@pytest.mark.parametrize("layout,shape", LARGE)
@pytest.mark.parametrize("dev", GPU)
def test_large(dev, layout, shape, masked):
    rng = np.random.default_rng(5)
    seq = seq_idx_for(shape["batch"], shape["length"]) if masked else None
    args, seq_idx = inputs(rng, jnp.float32, width=4, layout=layout, seq_idx=seq, **shape)
    compare(dev, rng, args, seq_idx, jnp.float32, activation="silu", layout=layout, final="random")


def boundary_rows(length: int, width: int, rng) -> np.ndarray:
    """Four packed rows of `length` ids for the channel-last kernels' windows of width K (P = K - 1
    steps back). Small problems take forward pieces of 32 steps and backward tiles of 64 (32 where
    a row's packs are whole runs of 32, as at D = 256), and the kernels check their steps 32 at a
    time, so boundaries fall on multiples of 32 and 1 and P - 1 steps after them (segments shorter
    than P among them), and in the P steps after a tile.

    Row 0: those boundaries, a run of padding, an id that comes back after a two-step segment.
    Row 1: padding first (the initial state belongs to no segment) and last (no final state).
    Row 2: the first segment, the initial state's, ends within the first P steps; random segments
    of 1 to 80 steps follow, and the last segment is one step long.
    Row 3: one segment over the whole row.
    """
    p = width - 1
    starts = [32, 64, 96, 128, 192, 256, 512, 1024]
    cuts = sorted({c for s in starts for c in (s, s + 1, s + max(p - 1, 1), s + 64 + 1)
                   if 0 < c < length - 2} | {1, length - 2})
    row0 = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)
    row0[300:302] = 1000  # between two stretches of row0[299]'s id
    row0[700:740] = -1
    row1 = row0.copy()
    row1[:5] = -1
    row1[length - 50:] = -1
    lengths = [max(p - 1, 1)]
    while sum(lengths) < length - 1:
        lengths.append(int(rng.integers(1, 81)))
    cut2 = np.cumsum(lengths)
    cut2 = np.append(cut2[cut2 < length - 1], length - 1)
    row2 = np.searchsorted(cut2, np.arange(length), side="right").astype(np.int32)
    row3 = np.zeros(length, np.int32)
    return np.stack([row0, row1, row2, row3])


# D = 64 or 256: a warp's threads take 32 consecutive packs of C channels (16-bit x: C = 8 at K = 2,
# else 4; float32: 4 up to K = 4, else 2), so all its lanes stream one piece of a row at D = 256
# and, but for float32 at K = 8, groups of 8 or 16 lanes do at D = 64.
@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("channels", [64, 256])
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("dev", DEVICES)
def test_segment_boundaries(dev, width, channels, state):
    rng = np.random.default_rng(width)
    seq = boundary_rows(2048, width, rng)
    for dtype in (jnp.float32, jnp.bfloat16):
        args, seq_idx = inputs(rng, dtype, batch=4, length=2048, channels=channels, width=width,
                               layout="BLD", state=state, seq_idx=seq)
        compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BLD", final="random")


# Forward pieces of 64 steps and backward tiles longer than 64 (256 to 512 steps: the columns
# cut into the pieces a row that make the launch's 32768 threads), with random segments of 1 to
# 300 steps and padding runs, so that boundaries fall at every offset within pieces, tiles and
# checks: the backward's 128-step spans (ids begin - P .. begin + 127, 5 reads a lane) among them,
# those turned down (their chunks take the span's bits) and those cut by a tile's end; bf16 K = 6
# and 8 take a boundary's steps with the interior copy that has tap tests.
@pytest.mark.parametrize("width", [2, 4, 6, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_segment_boundaries_long_rows(dev, dtype, width):
    rng = np.random.default_rng(11)
    length = 32768
    rows = []
    for _ in range(2):
        ids, t = np.empty(length, np.int32), 0
        while t < length:
            n = int(rng.integers(1, 301))
            ids[t:t + n] = -1 if rng.random() < 0.1 else t
            t += n
        rows.append(ids)
    args, seq_idx = inputs(rng, dtype, batch=2, length=length, channels=512, width=width,
                           layout="BLD", seq_idx=np.stack(rows))
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BLD", final="random")


# The plain 16-bit channel-last backward at K = 8 in tiles of 256 steps or more, which runs its
# tiles' first and last P steps in the checked copy (kCheckedEdgesMinTile; shorter tiles, as in
# the other tests, take the edge copies): 256 columns cut into 128 tiles a row of 256 steps.
@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_long_tiles_checked_edges(dev, dtype, state):
    rng = np.random.default_rng(13)
    args, _ = inputs(rng, dtype, batch=2, length=32768, channels=512, width=8, layout="BLD",
                     state=state)
    compare(dev, rng, args, None, dtype, activation="silu", layout="BLD", final="random")


# The channel-last backward's grouped blocks (D = 256: 32 to 128 packs a row for every dtype and
# width, whole runs of 32): a block's warps take one run over 4 consecutive tiles and sum their
# dw/db. With so few columns the tiles are 32 steps long: L = 650 makes 21 tiles, five whole
# groups and a last group of one tile of 10 steps (its other three warps add zeros); with dS from
# tile 0, the final state's gradient in the last tile, and seq_idx boundaries at tile and group
# edges (64, 256, 512, 640) and in the last tile.
@pytest.mark.parametrize("masked", [False, True], ids=["no_seq_idx", "seq_idx"])
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_grouped_tiles(dev, dtype, width, masked):
    rng = np.random.default_rng(width)
    length = 650
    seq = packed_seq_idx(length, [63, 64, 255, 256, 257, 511, 512, 640, 645]) if masked else None
    args, seq_idx = inputs(rng, dtype, batch=4, length=length, channels=256, width=width,
                           layout="BLD", seq_idx=seq)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BLD", final="random")


# The channel-last backward's short rows where a row's packs are whole runs of 32 (D = 256 for every
# dtype and width) and columns are few, so that tiles are 32 steps long: a row of one tile
# (L <= 32, ungrouped), of 2-3 tiles (L = 33-65: grouped, as the workspace's tile_count(L) slices
# a row would not hold them ungrouped; a block's other warps add zeros), and of 4 (L = 97, a group
# whose last tile has one step); with dS and the final state's gradient. The launch and the kernel
# read grouping from one rule (fewer slices than tiles); their own rules once disagreed here.
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_short_grouped_rows(dev, dtype, width):
    rng = np.random.default_rng(width)
    for length in (1, 5, 31, 32, 33, 63, 64, 65, 97):
        args, _ = inputs(rng, dtype, batch=2, length=length, channels=256, width=width,
                         layout="BLD")
        compare(dev, rng, args, None, dtype, activation="silu", layout="BLD", final="random")


# The same rows with many columns (B=32 D=4096 bf16: 32768 columns, one tile a row): a row shorter
# than 64 steps runs in one tile of its length, ungrouped.
@pytest.mark.parametrize("dev", GPU)
def test_short_rows_many_columns(dev):
    rng = np.random.default_rng(13)
    for length in (17, 40, 63):
        args, _ = inputs(rng, jnp.bfloat16, batch=32, length=length, channels=4096, width=4,
                         layout="BLD")
        compare(dev, rng, args, None, jnp.bfloat16, activation="silu", layout="BLD",
                final="random")


# The channel-last forward's downward pieces: where x and y together pass the L2, the odd pieces
# of time run from their last row down through their halo where a row's packs are whole runs of
# 32 (D = 256 for every dtype and width); below it every piece runs up (launch_vector_forward).
# A downward piece takes its taps in the upward order, so the whole call's outputs are bit for
# bit those of calls of 16 batch rows (5-11 MB of x: upward pieces only), whose first is checked
# against the reference. x is 85 MB (16-bit) or 170 MB (float32) here, x and y past the 50 MB L2
# of the H100 and H200 more than threefold; which piece ends a row (L = 650) depends on the
# device's piece length. Only piece 0, upward, reads the initial state.
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_downward_pieces(dev, dtype, width):
    rng = np.random.default_rng(width)
    batch, part = 256, 16
    made = make_inputs(rng, batch=batch, length=650, channels=256, width=width, dtype=dtype,
                       initial_state=True)
    x, weight, bias, state = (jax.device_put(made[k], device(dev))
                              for k in ("x", "weight", "bias", "initial_state"))
    conv = jax.jit(partial(jcc.causal_conv1d, activation="silu", layout="BLD"))
    whole = np.asarray(conv(x, weight, bias, initial_state=state))
    parts = [np.asarray(conv(x[i:i + part], weight, bias, initial_state=state[i:i + part]))
             for i in range(0, batch, part)]
    np.testing.assert_array_equal(whole.view(np.uint8), np.concatenate(parts).view(np.uint8))
    first = dict(made, x=made["x"][:part], initial_state=made["initial_state"][:part])
    assert_close(parts[0], reference_outputs(first, activation="silu", layout="BLD"), dtype, "y")


def final_state_rows(length: int, width: int) -> np.ndarray:
    """Rows of seq_idx for the final state: one segment (F keeps every entry, the initial state's
    where L < K - 1), a last segment of o = 1 .. K - 1 steps (F keeps its last o entries; one
    segment where o >= L), and a row ending in padding (F is zero)."""
    rows = [np.zeros(length, np.int32)]
    for o in range(1, width):
        row = np.zeros(length, np.int32)
        row[max(length - o, 0):] = 1
        rows.append(row)
    padded = np.zeros(length, np.int32)
    padded[-1] = -1
    return np.stack(rows + [padded])


# With seq_idx the channel-last forward writes the final state from the thread whose piece ends the
# row (no final-state kernel). Up to 9 rows of D = 64 take 8-step pieces on the GPU: L = 11 and 70
# end in a piece of 3 and 6 steps (shorter than the state from K = 5 and 8 on), and L = 1, 2, 5 are
# shorter than the state itself from K = 3, 4, 7 on. The GPU's backward (64-step tiles here,
# 32-step for float32 at K >= 5, whose rows are whole runs of 32 packs of 2) takes the final
# state's cotangent at L = 66 and 70, whose last tiles of 2 and 6 steps leave the state's first
# times to the tile before from K = 4 and 8 on; at L = 70 with dS. The CPU kernels have no tiles
# (their backward with seq_idx and states: test_backward.py, test_varlen.py), so L = 66 and those
# backward checks run on the GPU only.
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", DEVICES)
def test_channel_last_final_state_seq_idx(dev, dtype, width):
    rng = np.random.default_rng(width)
    for i, length in enumerate([1, 2, 5, 11, 70] + ([66] if dev == "gpu" else [])):
        seq = final_state_rows(length, width)
        made = make_inputs(rng, batch=len(seq), length=length, channels=64, width=width,
                           dtype=dtype, layout="BLD", initial_state=i % 2 == 0)
        made["seq_idx"] = jnp.asarray(seq)
        run_and_compare(made, dev, dtype=dtype, activation="silu", return_final_state=True,
                        layout="BLD", what=f"K{width} L{length}")
        if length >= 64 and dev == "gpu":
            args = {name: made[name] for name in GRAD_NAMES}
            compare(dev, rng, args, made["seq_idx"], dtype, activation="silu", layout="BLD",
                    final="random")


def assert_weight_group_grads(dev, seed, shape, width, layout, members=3):
    """dx, dw and db of a loss through causal_conv1d of a fresh bf16 x of `shape` with bf16
    parameters vmapped over `members` weight groups (x shared: one call, the groups' dw/db summed
    over their own batch rows) against the reference's, in float64 on the CPU."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    channels = shape[-1] if layout == "BLD" else shape[1]
    w = jnp.asarray(rng.standard_normal((members, channels, width)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((members, channels)), jnp.bfloat16)

    def loss(conv, x, w, b):
        y = conv(x, w, b, activation="silu", layout=layout)
        return jnp.sum(jnp.sin(y.astype(jnp.float64)))

    grad = jax.vmap(jax.grad(partial(loss, jcc.causal_conv1d), argnums=(0, 1, 2)),
                    in_axes=(None, 0, 0))
    grads = jax.jit(grad)(*jax.device_put((x, w, b), device(dev)))
    refs = jax.vmap(jax.grad(partial(loss, reference.causal_conv1d), argnums=(0, 1, 2)),
                    in_axes=(None, 0, 0))(*jax.device_put(to_f64((x, w, b)), device("cpu")))
    for what, g, r in zip(("dx", "dweight", "dbias"), grads, refs):
        assert_close(g, r, jnp.bfloat16, what)


# The same blocks under weight groups (vmapped parameters over one x: 3 groups of 2 batch rows),
# whose dw/db the reduction sums over each group's rows and slices.
@pytest.mark.parametrize("dev", GPU)
def test_grouped_tiles_weight_groups(dev):
    assert_weight_group_grads(dev, 12, (2, 650, 256), 4, "BLD")


# The unmasked channel-last forward at K >= 6 loads a thread's weights and biases in runs of up to
# 16 bytes (load_weight_runs), each aligned to its size: 8-byte runs where a thread's weights are
# 56 bytes (K = 7 with 16-bit weights, or float x), else 16-byte ones; weights in x's dtype or
# float32, with and without a bias, and under vmapped weights (3 groups of 2 batch rows, each
# group's threads starting in its own block of the params). L = 300 takes 8-step pieces, up and
# down.
@pytest.mark.parametrize("groups", [1, 3], ids=["one_group", "vmapped"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("params", ["x", "float32"])
@pytest.mark.parametrize("width", [6, 7, 8])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_forward_weight_runs(dev, dtype, width, params, bias, groups):
    rng = np.random.default_rng(width)
    batch, length, channels = 2, 300, 256
    params_dtype = dtype if params == "x" else jnp.float32
    x = jnp.asarray(rng.standard_normal((batch, length, channels)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, channels, width)) / np.sqrt(width), params_dtype)
    b = jnp.asarray(rng.standard_normal((groups, channels)), params_dtype) if bias else None

    def forward(conv, x, w, b):
        if groups == 1:
            return conv(x, w[0], None if b is None else b[0], activation="silu")[None]
        return jax.vmap(lambda w, b: conv(x, w, b, activation="silu"))(w, b)

    y = jax.jit(partial(forward, jcc.causal_conv1d))(*jax.device_put((x, w, b), device(dev)))
    ref = forward(reference.causal_conv1d, *jax.device_put(to_f64((x, w, b)), device("cpu")))
    assert y.dtype == jnp.dtype(dtype)
    assert_close(y, ref, dtype, f"K{width} {params} groups {groups}")


# ---- channel-first with seq_idx: segments inside one sequence take the unmasked arithmetic ----

def segment_len(dtype) -> int:
    """Times per segment of the channel-first kernels: 32 lanes of one 16-byte pack each."""
    return 32 * 16 // jnp.dtype(dtype).itemsize


def cf_row_length(dtype) -> int:
    """6 segments and 2 packs: a last segment of two packs."""
    return 6 * segment_len(dtype) + 2 * 16 // jnp.dtype(dtype).itemsize


def cf_seq_idx(length: int, segment: int, width: int) -> np.ndarray:
    """Rows of seq_idx around the channel-first segments: one id everywhere (every segment
    uniform); boundaries inside a segment, at a segment start, within the first K-1 times after
    one and just before one; the same with a padding run and trailing padding; padding at the
    start and an id that comes back (0 1 0); a boundary at every segment start; all padding."""
    t = np.arange(length)
    P = width - 1
    edges = [segment + 37, 2 * segment, 3 * segment + 1, 3 * segment + max(P - 1, 1),
             4 * segment - 1]
    cut = np.searchsorted(np.asarray(edges), t, side="right").astype(np.int32)
    padded = cut.copy()
    padded[(t >= 5 * segment - 3) & (t < 5 * segment + 40)] = -1
    padded[length - segment // 2:] = -1
    back = np.full(length, 7, np.int32)
    back[:P + 2] = -1
    back[(t >= 2 * segment + 2) & (t < 2 * segment + 5)] = 3
    every = (t // segment).astype(np.int32)
    return np.stack([np.zeros(length, np.int32), cut, padded, back, every,
                     np.full(length, -1, np.int32)])


def test_cf_seq_idx_rows():
    rows = cf_seq_idx(6 * 64 + 16, 64, 4)
    assert (rows[0] == 0).all() and (rows[5] == -1).all()
    np.testing.assert_array_equal(np.flatnonzero(np.diff(rows[1])) + 1, [101, 128, 193, 194, 255])
    assert (rows[2][317:360] == -1).all() and rows[2][316] == 5 and (rows[2][-32:] == -1).all()
    assert list(rows[3][:7]) == [-1] * 5 + [7, 7]
    assert list(rows[3][129:136]) == [7, 3, 3, 3, 7, 7, 7]
    np.testing.assert_array_equal(rows[4][::64], np.arange(7))


@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", DEVICES)
def test_channel_first_seq_idx(dev, dtype, width, state):
    """Few rows: on the GPU every segment is an item of its own (the P times before it and, in the
    backward, the segment after it come from the neighbouring items' times)."""
    check_cf_seq_idx(dev, dtype, width, state, channels=3)


def check_cf_seq_idx(dev, dtype, width, state, channels, boundaries=None):
    """cf_seq_idx's rows, 6 segments and 2 packs long, against the reference; with boundaries, the
    rows' boundaries around segments of that many times instead."""
    rng = np.random.default_rng(width)
    length = cf_row_length(dtype)
    seq = cf_seq_idx(length, boundaries or segment_len(dtype), width)
    args, seq_idx = inputs(rng, dtype, batch=len(seq), length=length, channels=channels,
                           width=width, layout="BDL", state=state, seq_idx=seq)
    grads, _ = compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL",
                       final="random")
    np.testing.assert_array_equal(grads["x"][5], 0)  # the all-padding row


# Enough rows (16384) that the GPU's items hold several segments: in the forward, rows of 8
# segments (bf16) or 16 (float32), in halves; in the backward, rows of 32 (bf16 K = 4's
# quarter-warp segments, float32's half-warp ones), which an item may hold whole.
LARGE_CF = [
    pytest.param(jnp.bfloat16, dict(batch=2, length=2048, channels=8192), id="bf16-8-segments"),
    pytest.param(jnp.float32, dict(batch=2, length=2048, channels=8192), id="f32-16-segments"),
]


@pytest.mark.parametrize("dtype,shape", LARGE_CF)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_large(dev, dtype, shape):
    rng = np.random.default_rng(6)
    seq = cf_seq_idx(shape["length"], segment_len(dtype), 4)[[2, 3]]
    args, seq_idx = inputs(rng, dtype, width=4, layout="BDL", seq_idx=seq, **shape)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final="random")


# The masked forward's loop (turns of kForwardRing segments, then the whole segments left one at a
# time, then the item's last) at every dtype and width: on the H200, 2048 rows of 4 channels make
# items of whole rows of 8 segments (16-bit) and of 6, 8 or 16 (float32), so that turns and the
# single segments after them hold uniform and masked segments; L = 2040 ends each row in a segment
# of 31 (16-bit) or 30 packs. Forward only: the tests above reach the backward's loop.
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_turns(dev, dtype, width):
    rng = np.random.default_rng(width)
    length = 2040
    made = make_inputs(rng, batch=4, length=length, channels=2048, width=width, dtype=dtype,
                       layout="BDL", initial_state=True)
    made["seq_idx"] = jnp.asarray(cf_seq_idx(length, segment_len(dtype), width)[1:5])
    run_and_compare(made, dev, dtype=dtype, activation="silu", return_final_state=True,
                    layout="BDL", what=f"K{width}")


# The masked forward's items of several channels run them one after another in a warp, and where
# an item's segments fill whole turns of the ring (a multiple of its slots: 4, or 8 in the deep
# ring of channel_first_forward_deep_ring, these cases' kernels but bf16 K = 5's) each channel's
# last segments fetch the next channel's first packs. The cases above chain whole rows of 4
# channels; here rows cut into chunks (on the H200: chunks of 4 segments, which the deep ring does
# not chain, or of 8, with turns), so that the next channel's packs start at c0 > 0, and D = 1279,
# whose last item of each batch row has 3 channels (its last channel chains to nothing), at K = 3
# (f16 and float32 without the final state in the kernel), K = 4 and K = 5 (bf16: the ring of 4).
CHAINED_CF = [
    pytest.param(jnp.bfloat16, 4, 4096, id="bf16-K4-chunks-of-4"),
    pytest.param(jnp.bfloat16, 4, 8192, id="bf16-K4-chunks-of-8"),
    pytest.param(jnp.float16, 3, 4096, id="f16-K3-chunks-of-4"),
    pytest.param(jnp.float16, 3, 8192, id="f16-K3-longer-chunks"),
    pytest.param(jnp.bfloat16, 5, 4096, id="bf16-K5-ring-of-4"),
    pytest.param(jnp.float32, 4, 2048, id="f32-K4-chunks-of-4"),
    pytest.param(jnp.float32, 3, 3072, id="f32-K3-chunks-of-4"),
]


@pytest.mark.parametrize("dtype,width,length", CHAINED_CF)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_chained(dev, dtype, width, length):
    rng = np.random.default_rng(width)
    segment = segment_len(dtype)
    made = make_inputs(rng, batch=2, length=length, channels=1279, width=width, dtype=dtype,
                       layout="BDL", initial_state=True)
    edges = [3 * segment + 5, 4 * segment - 1, 4 * segment + 2, length // 2 + 7, length - segment]
    made["seq_idx"] = jnp.asarray(packed_seq_idx(length, edges)[:2])
    run_and_compare(made, dev, dtype=dtype, activation="silu", return_final_state=True,
                    layout="BDL", what=f"K{width}")


# Enough rows (6 x 1024: on the H200 the backward's items are whole rows of 7 segments) that items
# hold several segments, for every dtype and width: the backward's masked segments then run in its
# interior loop too (both segments of a dx the item's own: seq_idx windows without range tests),
# where test_channel_first_seq_idx's items are single segments and the large case has K = 4 only.
# The warps of a block whose items are whole rows of one batch row share their seq_idx check: with
# 1024 channels every block's do (items of 4 channels, 256 a batch row, 4 a block); with 1018 (255
# items a batch row) the blocks across a batch row's end check their own.
@pytest.mark.parametrize("channels", [1024, 1018])
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_items(dev, dtype, width, channels):
    check_cf_seq_idx(dev, dtype, width, True, channels=channels)


# Rows of two segments (the second of one pack), enough of them (B=4, D=8192) that
# channel_first_chunk keeps the rows whole on an H200: in a block's shared seq_idx check two of
# its four warps then have no ballot of their own.
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_two_segments(dev, dtype):
    rng = np.random.default_rng(2)
    segment = segment_len(dtype)
    length = segment + 16 // jnp.dtype(dtype).itemsize
    seq = packed_seq_idx(length, [segment // 2, segment - 1, segment + 1])
    args, seq_idx = inputs(rng, dtype, batch=len(seq), length=length, channels=8192, width=4,
                           layout="BDL", state=True, seq_idx=seq)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final="random")


# With seq_idx the channel-first kernels take two channels a warp, a half-warp each, over segments
# of 16 packs (the backward at every dtype but 16-bit K = 4 and 5, the forward at 16 bits and
# K >= 4), whose uniform_segments masks come two to a ballot of 32 packs: boundaries and padding
# around those segments (the odd ones start in the middle of a 32-pack one), in single-segment
# items (3 channels) and in whole rows (1023: items of 4 channels and a last one of 3, whose second
# pair runs one channel in both halves), with an initial state and the final state's cotangent.
@pytest.mark.parametrize("channels", [3, 1023])
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_half_segments(dev, dtype, width, channels):
    check_cf_seq_idx(dev, dtype, width, True, channels=channels,
                     boundaries=segment_len(dtype) // 2)


# With seq_idx the 16-bit backward at K = 4 and 5 takes four channels a warp, a quarter-warp
# each, over segments of 8 packs: boundaries and padding around those segments, in single-segment
# items (3 channels) and in whole rows (1023: items of 4 channels and a last one of 3).
@pytest.mark.parametrize("channels", [3, 1023])
@pytest.mark.parametrize("width", [4, 5])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_quarter_segments(dev, dtype, width, channels):
    check_cf_seq_idx(dev, dtype, width, True, channels=channels,
                     boundaries=segment_len(dtype) // 4)


# A masked channel-first backward item that ends its row has no segment after it whose first
# deltas its dx needs, so a row of at most kUniformSegments (32) segments is one item: at 16 bits,
# K = 4 and 5 (segments of 8 packs) rows of 2040 and 2048 are, rows of 2056 are cut; K = 3 (16
# packs) keeps rows up to 4096 whole. On the H200, B=2 and D=8192 keep rows whole where they may.
@pytest.mark.parametrize("length", [2040, 2048, 2056])
@pytest.mark.parametrize("width", [3, 4, 5])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_whole_row_items(dev, dtype, width, length):
    rng = np.random.default_rng(length + width)
    segment = segment_len(dtype) // 4
    seq = packed_seq_idx(length, [5 * segment + 3, 17 * segment, 31 * segment + 1, length - 2])
    args, seq_idx = inputs(rng, dtype, batch=2, length=length, channels=8192, width=width,
                           layout="BDL", state=True, seq_idx=seq[1:3])
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final="random")


# Without seq_idx too the 16-bit backward, and the 16-bit forward at K >= 7 (compare checks y),
# take two channels a warp, a half-warp each, over segments of 16 packs: odd channel counts (the
# last item runs its one channel on both halves), in single-segment items (3 channels) and in items
# of several segments (1023), rows of 12 segments and 2 packs, with an initial state and the final
# state's cotangent (float32: one channel a warp).
@pytest.mark.parametrize("channels", [3, 1023])
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_half_segments(dev, dtype, width, channels):
    rng = np.random.default_rng(width)
    args, _ = inputs(rng, dtype, batch=6, length=cf_row_length(dtype), channels=channels,
                     width=width, layout="BDL", state=True)
    compare(dev, rng, args, None, dtype, activation="silu", layout="BDL", final="random")


# Without seq_idx, where a cluster of at most 8 blocks (32 warp items) holds every item of a weight
# group's channel group and the grid fills the device at least once, the channel-first backward's
# clusters sum dw/db themselves (ClusterSums): rows of 256 times, whole items, in 4 batch rows of
# 2048 channels (one block's items: no cluster, the plain kernel and the reduction, as st.async
# needs two blocks), 8 of 1024 (two blocks) and 32 of 201 (eight blocks; an odd
# channel count: the last item's second half-warp repeats its channel), with and without the
# states, float32's one channel a warp. Those grids hold 3232-8192 warps (the H200 and H100 hold
# 2112-3168 of these kernels'). The shapes of one partial wave take the plain kernel and the
# reduction: few rows cut into 8-16 chunks (24 and 32 items a channel group), rows whose last
# segment is partial (1000), and 16 rows of 64 channels (64 items a channel group in 16-bit).
@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("shape", [(4, 256, 2048), (8, 256, 1024), (32, 256, 201), (3, 1000, 5),
                                   (2, 2048, 6), (16, 2048, 64)],
                         ids=["b4_d2048", "b8_d1024", "b32_d201", "b3_d5", "b2_d6", "b16_d64"])
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_cluster_sums(dev, dtype, width, shape, state):
    rng = np.random.default_rng(100 * width + shape[2])
    batch, length, channels = shape
    args, _ = inputs(rng, dtype, batch=batch, length=length, channels=channels, width=width,
                     layout="BDL", state=state)
    compare(dev, rng, args, None, dtype, activation="silu", layout="BDL",
            final="random" if state else "none")


# The same clusters under weight groups (vmapped parameters over one x: 3 groups of 8 batch rows
# of 1001 channels, whole rows of 256 times: 12024 warps, clusters of two blocks): each cluster
# holds one group's items of two channels.
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_cluster_sums_weight_groups(dev):
    assert_weight_group_grads(dev, 15, (8, 1001, 256), 4, "BDL")


# The bfloat16 channel-first backward at K = 7 and 8 in few or short rows: items of fewer than
# kMmaMinItemBlocks blocks of 128 times, which the scalar kernel takes (rows whose last pack is
# partial, whole packs, rows cut into chunks), lengths 1, 7 and 130 other kernels (not multiples
# of 8, or short rows); with an initial state or the final state's cotangent the scalar kernel
# runs whatever the rows. The tensor-core side of that choice is tested below.
@pytest.mark.parametrize("case", [
    dict(activation="silu", bias=True, state=False, final="none"),
    dict(activation=None, bias=True, state=False, final="none"),
    dict(activation="silu", bias=False, state=False, final="none"),
    dict(activation="silu", bias=True, state=False, final="none", params_like_x=True),
    dict(activation="silu", bias=True, state=True, final="random"),
    dict(activation=None, bias=False, state=False, final="random"),
], ids=["silu", "identity", "no_bias", "bf16_params", "state", "final"])
@pytest.mark.parametrize("length", [1, 7, 130, 264, 1000, 2048])
@pytest.mark.parametrize("width", [7, 8])
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_bf16_wide_small_items(dev, width, length, case):
    rng = np.random.default_rng(10 * length + width)
    for batch, channels in [(1, 3), (3, 130)]:
        compare_case(dev, rng, case, batch=batch, length=length, channels=channels, width=width)


def compare_case(dev, rng, case, **shape):
    args, _ = inputs(rng, jnp.bfloat16, layout="BDL", bias=case["bias"], state=case["state"],
                     **shape)
    if case.get("params_like_x"):
        args["weight"] = args["weight"].astype(jnp.bfloat16)
        args["bias"] = args["bias"].astype(jnp.bfloat16)
    compare(dev, rng, args, None, jnp.bfloat16, activation=case["activation"], layout="BDL",
            final=case["final"])


# The bfloat16 channel-first backward at K = 7 and 8 without seq_idx or states, in items of at
# least kMmaMinItemBlocks blocks of 128 times, runs on tensor cores
# (backward_channel_first_mma_kernel: a warp per channel item). The shapes are items on a device
# that holds 4224 warps of the kernel (an H200; elsewhere channel_first_chunk may cut them
# otherwise): whole rows of 17 blocks, the last partial, whose copies wrap the warp's ring of 8
# blocks (the partial block lands in the slot of the row's first, the block past the row, read as
# zeros, in that of its second); and rows cut into items of 17, 17, 17 and 14 blocks (each item's
# last dx needs the next item's first deltas, its dw/db not; 22, 22 and 21 at 3168 warps). Where
# a cluster of at most 8 blocks holds every item of a channel's weight group and the grid fills
# the device, the kernel runs in clusters that sum dw/db themselves (as the scalar kernel's,
# above): the wrap shape in clusters of two blocks, 32 rows of 256 channels of eight (whole rows
# of 16 blocks: 8192 warps, which channel_first_chunk keeps whole where 4352 or 8800 would be cut
# in two, too short for tensor cores); 4 batch rows of 2048 channels hold one block's items, which
# take no cluster (st.async needs two blocks: the plain kernel and the reduction), and the cut
# shape none. Float and bfloat16 weights: split into high and low parts, or exact.
@pytest.mark.parametrize("case", [
    dict(activation="silu", bias=True, state=False, final="none"),
    dict(activation=None, bias=True, state=False, final="none"),
    dict(activation="silu", bias=False, state=False, final="none"),
    dict(activation="silu", bias=True, state=False, final="none", params_like_x=True),
], ids=["silu", "identity", "no_bias", "bf16_params"])
@pytest.mark.parametrize("shape", [(8, 2056, 1024), (2, 8320, 512), (4, 2048, 2048),
                                   (32, 2048, 256)],
                         ids=["wrap", "cut", "one_block", "clusters_of_8"])
@pytest.mark.parametrize("width", [7, 8])
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_tensor_cores(dev, width, shape, case):
    batch, length, channels = shape
    rng = np.random.default_rng(10 * length + width)
    compare_case(dev, rng, case, batch=batch, length=length, channels=channels, width=width)


# The tensor-core cluster sums under weight groups (vmapped parameters over one x: 3 groups of 8
# batch rows of 352 channels, whole rows of 2048 times, 8448 warps, clusters of two blocks).
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_tensor_cores_cluster_sums_weight_groups(dev):
    assert_weight_group_grads(dev, 16, (8, 352, 2048), 8, "BDL")


# The tensor-core backward's dw/db sums: each warp's in a fixed order, then the cluster's first
# block's in the order of its rows (this shape: 8192 warps, clusters of two blocks).
@pytest.mark.parametrize("width", [7, 8])
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_tensor_cores_deterministic(dev, width):
    rng = np.random.default_rng(12)
    shape = (8, 1024, 2048)
    args, _ = inputs(rng, jnp.bfloat16, batch=shape[0], length=shape[2], channels=shape[1],
                     width=width, layout="BDL", state=False)
    kw = dict(activation="silu", layout="BDL", return_final_state=False)
    on = partial(jax.device_put, device=device(dev))
    cotangent = on(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    args = on(args)
    runs = [kernel_vjp(args, None, cotangent, **kw)[1] for _ in range(20)]
    for name in GRAD_NAMES:
        if runs[0][name] is None:
            continue
        first = np.asarray(runs[0][name])
        for i, again in enumerate(runs[1:]):
            assert np.array_equal(np.asarray(again[name]), first), f"d{name} differs in run {i + 2}"


# The masked channel-first backward's states where a row's first or last K - 1 times hold a
# boundary: dS with some of its taps cut, the final state's cotangent kept for only the rows of
# the last time's sequence (its rows load whether kept or not), none kept at trailing padding.
@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_channel_first_seq_idx_state_edges(dev, dtype, width):
    rng = np.random.default_rng(width)
    length = cf_row_length(dtype)
    t = np.arange(length)
    seq = np.stack([np.where(t == 0, 0, np.where(t == length - 1, 2, 1)),
                    np.where(t < 2, 3, np.where(t < length - 2, 4, 5)),
                    np.where(t < length - 3, 0, np.where(t < length - 1, 1, -1))]).astype(np.int32)
    args, seq_idx = inputs(rng, dtype, batch=len(seq), length=length, channels=5, width=width,
                           layout="BDL", state=True, seq_idx=seq)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final="random")


# ---- channel-first short rows: 32 / group rows per warp, group lanes (a power of two) per row ----

SHORT_LENGTHS = [8, 16, 64, 128, 136, 256]  # multiples of 8: every dtype's pack divides them


def short_seq_idx(length: int) -> np.ndarray:
    """Rows of seq_idx for short rows: one id; boundaries a third in, one after it and at the last
    time, with the first id coming back; padding in the middle and at the end."""
    t = np.arange(length)
    third = max(length // 3, 1)
    back = np.where(t < third, 0, np.where(t == third, 1, 0)).astype(np.int32)
    back[length - 1] = 2
    padded = np.zeros(length, np.int32)
    padded[(t >= third) & (t < 2 * third)] = -1
    padded[length - max(length // 8, 1):] = -1
    return np.stack([np.full(length, 3, np.int32), back, padded])


# (seq_idx, initial state, final state's cotangent) of a short-row call: none of them ("plain"),
# or some; a call with none may take code of its own.
SHORT_FEATURES = {
    "plain": (False, False, "none"),
    "final_state": (False, False, "random"),
    "state": (False, True, "random"),
    "seq_idx": (True, False, "random"),
    "seq_idx_state": (True, True, "random"),
}


@pytest.mark.parametrize("features", SHORT_FEATURES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("length", SHORT_LENGTHS)
@pytest.mark.parametrize("dev", DEVICES)
def test_short_rows(dev, length, dtype, features):
    """3 x 7 rows (an odd count: the last warp item is partly empty); bf16 L = 8 puts a row on each
    lane, L = 136 and 256 (bf16) take whole warps, L = 136 with 15 lanes past the row's end."""
    masked, state, final = SHORT_FEATURES[features]
    rng = np.random.default_rng(length)
    seq = short_seq_idx(length) if masked else None
    args, seq_idx = inputs(rng, dtype, batch=3, length=length, channels=7, width=4, layout="BDL",
                           state=state, seq_idx=seq)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final=final)


@pytest.mark.parametrize("features", ["plain", "seq_idx"])
@pytest.mark.parametrize("width", [2, 5, 8])
@pytest.mark.parametrize("dtype", HALF_AND_FLOAT, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", DEVICES)
def test_short_rows_widths(dev, dtype, width, features):
    """Widths whose halo reaches two lanes back (float32, K = 8) or past a one-pack row."""
    masked, _, final = SHORT_FEATURES[features]
    rng = np.random.default_rng(width)
    for length in (8, 24):
        seq = short_seq_idx(length)[np.arange(5) % 3] if masked else None
        args, seq_idx = inputs(rng, dtype, batch=5, length=length, channels=3, width=width,
                               layout="BDL", seq_idx=seq)
        compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final=final)


# More warp units than the GPU holds warps: each warp takes several in turn. A unit is a block of
# channels over a run of batch rows (ShortRowUnits): few channels and many rows make runs of
# several rows, the last one shorter (on the H200, backward: bf16 1001 x 8, 4 channel blocks, runs
# of 2; float32 701 x 7, 7 blocks, runs of 3; the forward runs those one row a unit). The forward
# (K = 4: 4224 bf16 and 5280 float32 warps resident, by ptxas's registers) runs bf16 65 x 4096
# L = 8 in runs of 2 and a last of 1, and runs longer than its ring (kShortForwardDepth = 4) in
# the last two: bf16 30 x 2049 L = 128, 1025 blocks (the last one channel of 2), 4 runs of 8 (the
# last of 6); float32 20 x 3001 L = 64, 1501 blocks (the last 1 of 2), 3 runs of 7 (the last 6).
# The plain kernels (no seq_idx or states) hold more warps, but are launched on the units planned
# for the kernels with features, so that these runs are theirs too.
SHORT_MANY = [
    pytest.param(jnp.bfloat16, dict(batch=65, length=8, channels=4096), id="bf16-L8"),
    pytest.param(jnp.bfloat16, dict(batch=5, length=128, channels=4096), id="bf16-L128"),
    pytest.param(jnp.float32, dict(batch=9, length=64, channels=4093), id="f32-L64-odd"),
    pytest.param(jnp.bfloat16, dict(batch=1001, length=128, channels=8), id="bf16-L128-runs"),
    pytest.param(jnp.float32, dict(batch=701, length=128, channels=7), id="f32-L128-runs"),
    pytest.param(jnp.bfloat16, dict(batch=30, length=128, channels=2049), id="bf16-L128-long-runs"),
    pytest.param(jnp.float32, dict(batch=20, length=64, channels=3001), id="f32-L64-long-runs"),
]


@pytest.mark.parametrize("features", ["plain", "final_state", "seq_idx"])
@pytest.mark.parametrize("dtype,shape", SHORT_MANY)
@pytest.mark.parametrize("dev", GPU)
def test_short_rows_many_items(dev, dtype, shape, features):
    masked, _, final = SHORT_FEATURES[features]
    rng = np.random.default_rng(8)
    seq = short_seq_idx(shape["length"])[np.arange(shape["batch"]) % 3] if masked else None
    args, seq_idx = inputs(rng, dtype, width=4, layout="BDL", seq_idx=seq, **shape)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BDL", final=final)


# Short rows under weight groups (vmapped parameters over one x, 3 groups). 301 batch rows a group:
# the backward's runs stay inside a group, whose slices of partials the reduction sums; 6 channels
# make a second channel block of 2 of its 4 rows (bf16 L = 64: 8 lanes a row). 2 batch rows and
# 1125 channel blocks a group: more blocks than the device holds warps (on the H200 the units are
# planned for 2112 of the backward's), so that each group's rows are one run.
@pytest.mark.parametrize("batch,channels", [(301, 6), (2, 4500)], ids=["runs", "one_run"])
@pytest.mark.parametrize("dev", GPU)
def test_short_rows_weight_groups(dev, batch, channels):
    assert_weight_group_grads(dev, 13, (batch, channels, 64), 4, "BDL")


# The forward under weight groups: 3 groups of 9 batch rows of 2047 channels (bf16 L = 64: 512
# blocks of 4 rows, the last of 3) make, on the H200 (4224 warps resident), runs of 5 rows and of
# 4 inside each group (a run of 5 refetches its ring's first slot); with the initial state, the
# final state and seq_idx.
@pytest.mark.parametrize("masked", [False, True], ids=["no_seq_idx", "seq_idx"])
@pytest.mark.parametrize("dev", GPU)
def test_short_rows_weight_groups_forward(dev, masked):
    rng = np.random.default_rng(14)
    members, batch, length, channels, width = 3, 9, 64, 2047, 4
    x = jnp.asarray(rng.standard_normal((batch, channels, length)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((members, channels, width)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((members, channels)), jnp.bfloat16)
    s = jnp.asarray(rng.standard_normal((batch, channels, width - 1)), jnp.bfloat16)
    q = jnp.asarray(short_seq_idx(length)[np.arange(batch) % 3]) if masked else None

    def run(conv, x, w, b, s, q):
        return conv(x, w, b, activation="silu", initial_state=s, seq_idx=q,
                    return_final_state=True, layout="BDL")

    in_axes = (None, 0, 0, None, None)
    outs = jax.jit(jax.vmap(partial(run, jcc.causal_conv1d), in_axes=in_axes))(
        *jax.device_put((x, w, b, s, q), device(dev)))
    refs = jax.vmap(partial(run, reference.causal_conv1d), in_axes=in_axes)(
        *jax.device_put(to_f64((x, w, b, s)) + (q,), device("cpu")))
    for what, o, r in zip(("y", "final_state"), outs, refs):
        assert_close(o, r, jnp.bfloat16, what)
