"""The CPU kernels on shapes that span several of their tiles and run on several threads.

The other tests use short sequences, which the CPU kernels run as one tile on the calling thread.
Here the shapes cross tile boundaries in time and channels (a tile recomputes delta on its right
halo and owns only its dx and dw/db terms) and exceed the threading threshold, with packed
segments, padding inside a row, initial and final states, in both layouts, at a compile-time
width (4) and a runtime one (17).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_inputs, random_seq_idx, to_f64

from jax_causal_conv import causal_conv1d, reference

# (batch, length, channels) per layout: "BLD" tiles are runs of 512 to a few thousand channels
# (1024 at float32 K = 4, 512 at K = 17) by at least 128 steps, "BDL" tiles up to 8192 steps of a
# few channel rows.
SHAPES = {"BLD": (2, 700, 1100), "BDL": (2, 9000, 20)}


def vjp_all(fn, args, seq_idx, cotangent, layout):
    def f(x, weight, bias, initial_state):
        return fn(x, weight, bias, activation="silu", initial_state=initial_state, seq_idx=seq_idx,
                  return_final_state=True, layout=layout)

    out, pull = jax.vjp(f, *args)
    return out, pull(cotangent)


def case(layout, width, seed):
    rng = np.random.default_rng(seed)
    batch, length, channels = SHAPES[layout]
    made = make_inputs(rng, batch=batch, length=length, channels=channels, width=width,
                       dtype=jnp.float32, layout=layout, initial_state=True)
    seq = random_seq_idx(rng, batch, length)
    seq[0, length // 3: length // 3 + 5] = -1  # padding inside a row
    seq[-1, length // 2:] += 7                 # labels that jump
    args = (made["x"], made["weight"], made["bias"], made["initial_state"])
    y_shape, s_shape = made["x"].shape, made["initial_state"].shape
    cotangent = (jnp.asarray(rng.standard_normal(y_shape), jnp.float32),
                 jnp.asarray(rng.standard_normal(s_shape), jnp.float32))
    return args, jnp.asarray(seq), cotangent


@pytest.mark.parametrize("width", [4, 17])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_many_tiles_match_reference(layout, width):
    args, seq, cotangent = case(layout, width, seed=width)
    run = jax.jit(lambda a, s, c: vjp_all(causal_conv1d, a, s, c, layout))
    (y, final), grads = run(args, seq, cotangent)
    (y_ref, final_ref), grads_ref = jax.jit(
        lambda a, s, c: vjp_all(reference.causal_conv1d, a, s, c, layout)
    )(to_f64(args), seq, to_f64(cotangent))
    assert_close(y, y_ref, jnp.float32, "y")
    assert_close(final, final_ref, jnp.float32, "final_state")
    for name, g, r in zip(("dx", "dweight", "dbias", "dinitial_state"), grads, grads_ref):
        assert_close(g, r, jnp.float32, name)


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_many_tiles_deterministic(layout):
    args, seq, cotangent = case(layout, 4, seed=5)
    run = jax.jit(lambda a, s, c: vjp_all(causal_conv1d, a, s, c, layout))
    first = [np.asarray(v) for v in jax.tree.leaves(run(args, seq, cotangent))]
    for _ in range(3):
        again = [np.asarray(v) for v in jax.tree.leaves(run(args, seq, cotangent))]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
