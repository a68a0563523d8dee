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

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DEVICES
from test_backward import compare, inputs, packed_seq_idx

HALF_AND_FLOAT = [jnp.float32, jnp.float16, jnp.bfloat16]
SHAPES = {"BLD": dict(batch=2, length=300, channels=64), "BDL": dict(batch=2, length=1000, channels=4)}
GPU = [p for p in DEVICES if p.id == "gpu"]


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
    steps back). Small problems take forward pieces of 32 steps and backward tiles of 64, and the
    kernels check their steps 32 at a time, so boundaries fall on multiples of 32 and 1 and P - 1
    steps after them (segments shorter than P among them), and in the P steps after a tile.

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


# Forward pieces of 64 steps and backward tiles longer than 64 (about 125 steps on an H200),
# with random segments of 1 to 300 steps and padding runs, so that boundaries fall at every
# offset within pieces, tiles and checks.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", GPU)
def test_segment_boundaries_long_rows(dev, dtype):
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
    args, seq_idx = inputs(rng, dtype, batch=2, length=length, channels=512, width=4,
                           layout="BLD", seq_idx=np.stack(rows))
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout="BLD", final="random")
