"""Pure-jnp reference implementations: the oracle for tests and the fallback lowering.

They follow DESIGN.md sections 1 and 2 literally (a shifted sum over the K taps with the seq_idx
masks applied to the inputs), validate their arguments like the kernels' API, and are
differentiable by JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._validation import check_conv_args


def accumulation_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _to_bld(a, layout):
    return a if layout == "BLD" else jnp.swapaxes(a, 1, 2)


def causal_conv1d(
    x,
    weight,
    bias=None,
    *,
    activation=None,
    initial_state=None,
    seq_idx=None,
    return_final_state=False,
    layout="BLD",
):
    """Reference causal_conv1d; same signature and semantics as jax_causal_conv.causal_conv1d."""
    (x, weight, bias, initial_state, seq_idx, return_final_state), spec = check_conv_args(
        x, weight, bias, activation=activation, initial_state=initial_state, seq_idx=seq_idx,
        return_final_state=return_final_state, layout=layout, fn="reference.causal_conv1d",
    )
    acc = accumulation_dtype(x.dtype)
    L, P = spec.length, spec.state_len
    x_bld = _to_bld(x, layout).astype(acc)
    if initial_state is None:
        state = jnp.zeros((spec.batch, P, spec.channels), acc)
    else:
        state = _to_bld(initial_state, layout).astype(acc)
    x_ext = jnp.concatenate([state, x_bld], axis=1)  # x_ext[:, u + P] = x_u, u in [-P, L)
    w = weight.astype(acc)
    if seq_idx is not None:
        seg_ext = jnp.concatenate([jnp.repeat(seq_idx[:, :1], P, axis=1), seq_idx], axis=1)

    z = jnp.zeros((spec.batch, L, spec.channels), acc)
    if bias is not None:
        z = z + bias.astype(acc)
    for k in range(spec.width):
        tap = x_ext[:, k : k + L, :]
        if seq_idx is not None:
            used = (seq_idx >= 0) & (seg_ext[:, k : k + L] == seq_idx)
            tap = jnp.where(used[..., None], tap, 0)
        z = z + tap * w[:, k]
    y = z * jax.nn.sigmoid(z) if spec.silu else z
    if seq_idx is not None:
        y = jnp.where((seq_idx >= 0)[..., None], y, 0)
    y = _to_bld(y.astype(x.dtype), layout)
    if not return_final_state:
        return y
    final = x_ext[:, L : L + P, :]  # x_{L-P+j}
    if seq_idx is not None:
        last = seq_idx[:, -1:]
        keep = (last >= 0) & (seg_ext[:, L : L + P] == last)
        final = jnp.where(keep[..., None], final, 0)
    return y, _to_bld(final.astype(x.dtype), layout)
