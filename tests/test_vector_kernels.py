"""Shapes that take the vectorized CUDA kernels (compile-time K <= 8, float or half x, the packs
tiling the contiguous dimension), forward and backward against the float64 reference.

Channel-last: D a multiple of 8, several time tiles with a tail. Channel-first: L a multiple of 8
over several 32-pack segments, with few rows, so that rows are cut into chunks and each chunk's
last dx needs the next chunk's first deltas; and (GPU only, they are large) enough rows for
whole-row warps and a long channel-last row cut into many tiles. On the CPU the same cases run
the CPU kernels.
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
