"""causal_conv1d_varlen: packed variable-length sequences with per-sequence states.

Built on causal_conv1d with B = 1 and seq_idx, so it reuses the forward and fused backward kernels
and their custom_vjp. With initial states or final states asked for, the tokens are first
gathered into an extended stream of T + N*(K-1) steps in which every sequence is preceded by its
K-1 state steps (labelled with the sequence's id, so only that sequence reads them); the final
states are then the last K-1 steps of each sequence's segment. All shapes are static, so it works
under jit with traced cu_seqlens, and every gather is differentiable.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ._conv import causal_conv1d
from ._validation import check_varlen_args
from .reference import varlen_offsets


def causal_conv1d_varlen(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    cu_seqlens: jax.Array,
    activation: Optional[str] = None,
    initial_states: Optional[jax.Array] = None,
    return_final_states: bool = False,
):
    """Causal conv over packed sequences: the same result as one causal_conv1d row per sequence.

    Args:
      x: (T, D) packed tokens; float16, bfloat16, float32 or float64.
      weight: (D, K), 1 <= K <= 256 (PyTorch ``conv1d.weight[:, 0, :]`` order); any float dtype.
      bias: optional (D,), any float dtype.
      cu_seqlens: int32 (N+1,) offsets: sequence i is ``x[cu_seqlens[i]:cu_seqlens[i+1]]``.
        Non-decreasing with ``cu_seqlens[N] <= T``; empty sequences are allowed. Tokens
        before cu_seqlens[0] or at or past cu_seqlens[N] are padding: their y is 0. Other values
        are read as their running maximum clipped to [0, T] (``reference.varlen_offsets``): a
        decreasing offset ends an empty sequence, a sequence past T is cut off at T.
      activation: None, ``"silu"`` or ``"swish"``.
      initial_states: optional (N, K-1, D) in x's dtype, one state per sequence (oldest first).
      return_final_states: also return the (N, K-1, D) final states (the last K-1 inputs of each
        sequence, reaching into its initial state when the sequence is shorter than K-1).

    Returns:
      y (T, D) in x's dtype, or ``(y, final_states)``.

    Differentiable in x, weight, bias and initial_states, including the cotangent of
    final_states.
    """
    (x, weight, bias, cu_seqlens, initial_states, return_final_states), spec = check_varlen_args(
        x, weight, bias, cu_seqlens=cu_seqlens, activation=activation,
        initial_states=initial_states, return_final_states=return_final_states,
    )
    T, D, N, P = spec.tokens, spec.channels, spec.num_seqs, spec.state_len
    # Every gather and scatter index below is then in range and distinct.
    cu_seqlens = varlen_offsets(cu_seqlens, T)
    t = jnp.arange(T, dtype=jnp.int32)
    starts_so_far = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32)
    token_seq = jnp.where((starts_so_far >= 1) & (starts_so_far <= N), starts_so_far - 1, -1)

    def conv(stream, seq_idx):
        return causal_conv1d(stream[None], weight, bias, activation=activation, seq_idx=seq_idx[None])[0]

    if initial_states is None and not return_final_states:
        return conv(x, token_seq)

    # Token t moves right by P for every sequence that starts at or before it; state j of
    # sequence i sits just before that sequence's first token.
    token_dest = t + jnp.minimum(starts_so_far, N) * P
    seqs = jnp.arange(N, dtype=jnp.int32)
    steps = jnp.arange(P, dtype=jnp.int32)
    state_dest = (cu_seqlens[:N] + seqs * P)[:, None] + steps
    extended_len = T + N * P
    sources = jnp.zeros((extended_len,), jnp.int32).at[
        jnp.concatenate([token_dest, state_dest.reshape(-1)])
    ].set(jnp.arange(extended_len, dtype=jnp.int32), mode="drop")
    states = jnp.zeros((N, P, D), x.dtype) if initial_states is None else initial_states
    stream = jnp.concatenate([x, states.reshape(N * P, D)])[sources]
    stream_seq = jnp.concatenate([token_seq, jnp.repeat(seqs, P)])[sources]

    y = conv(stream, stream_seq)[token_dest]
    if not return_final_states:
        return y
    final_pos = (cu_seqlens[1:] + seqs * P)[:, None] + steps
    return y, stream[final_pos]
