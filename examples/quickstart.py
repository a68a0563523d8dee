"""Quickstart: the causal conv forward with states and packed sequences, checked against the reference.

Runs on CPU or GPU: `python examples/quickstart.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_causal_conv as jcc
from jax_causal_conv.reference import relative_error


def main():
    rng = np.random.default_rng(0)
    batch, length, channels, width = 2, 256, 64, 4
    x = jnp.asarray(rng.standard_normal((batch, length, channels)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((channels, width)) / 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(channels), jnp.float32)
    print("device:", jax.devices()[0])

    # 1. Forward with silu, an initial conv state and the final state to continue from.
    initial_state = jnp.asarray(rng.standard_normal((batch, width - 1, channels)), jnp.float32)
    conv = jax.jit(jcc.causal_conv1d, static_argnames=("activation", "return_final_state"))
    y, final_state = conv(x, weight, bias, activation="silu", initial_state=initial_state,
                          return_final_state=True)
    y_ref, final_ref = jcc.reference.causal_conv1d(
        x, weight, bias, activation="silu", initial_state=initial_state, return_final_state=True)
    print(f"y: {y.shape}, final_state: {final_state.shape}")
    print(f"  rel. error vs reference: y {relative_error(y, y_ref):.1e}, "
          f"final_state {relative_error(final_state, final_ref):.1e}")
    assert relative_error(y, y_ref) < 1e-5 and relative_error(final_state, final_ref) == 0.0

    # Continuing from final_state gives the same outputs as one long sequence.
    x_next = jnp.asarray(rng.standard_normal((batch, 32, channels)), jnp.float32)
    y_next = conv(x_next, weight, bias, activation="silu", initial_state=final_state)
    y_long = conv(jnp.concatenate([x, x_next], axis=1), weight, bias, activation="silu",
                  initial_state=initial_state)
    print(f"  chunked vs full sequence: {relative_error(y_next, y_long[:, length:]):.1e}")
    assert relative_error(y_next, y_long[:, length:]) < 1e-5

    # 2. Packed sequences: seq_idx labels segments; taps never cross a boundary; -1 is padding.
    seq_idx = np.zeros((batch, length), np.int32)
    seq_idx[0, 100:] = 1
    seq_idx[0, 200:] = 2
    seq_idx[1, 230:] = -1
    seq_idx = jnp.asarray(seq_idx)
    y_packed = jcc.causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx)
    y_packed_ref = jcc.reference.causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx)
    alone = jcc.causal_conv1d(x[:1, 100:200], weight, bias, activation="silu")
    print(f"packed: rel. error vs reference {relative_error(y_packed, y_packed_ref):.1e}; "
          f"segment 1 vs run alone {relative_error(y_packed[:1, 100:200], alone):.1e}; "
          f"padding max |y| {float(jnp.abs(y_packed[1, 230:]).max())}")
    assert relative_error(y_packed, y_packed_ref) < 1e-5
    assert relative_error(y_packed[:1, 100:200], alone) < 1e-5
    assert float(jnp.abs(y_packed[1, 230:]).max()) == 0.0

    # 3. Gradients come from the fused backward kernel through jax.custom_vjp.
    def loss(f, x, weight, bias, initial_state):
        y, final = f(x, weight, bias, activation="silu", initial_state=initial_state,
                     return_final_state=True)
        return jnp.sum(y**2) + jnp.sum(final)

    grads = jax.jit(jax.grad(lambda *a: loss(jcc.causal_conv1d, *a), argnums=(0, 1, 2, 3)))(
        x, weight, bias, initial_state)
    grads_ref = jax.grad(lambda *a: loss(jcc.reference.causal_conv1d, *a), argnums=(0, 1, 2, 3))(
        x, weight, bias, initial_state)
    for name, g, r in zip(("x", "weight", "bias", "initial_state"), grads, grads_ref):
        print(f"  d{name}: rel. error vs jax.grad(reference) {relative_error(g, r):.1e}")
        assert relative_error(g, r) < 1e-5
    print("quickstart: all checks passed")


if __name__ == "__main__":
    main()
