"""Pure-jnp reference implementations: the oracle for tests and the fallback lowering.

They follow DESIGN.md sections 1 to 3 literally (a shifted sum over the K taps with the seq_idx,
ring-buffer and per-sequence masks applied to the inputs), validate their arguments like the
kernels' API, and are differentiable by JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._validation import check_conv_args, check_update_args, check_varlen_args


# The largest relative error ||out - ref|| / ||ref|| against this reference (run in float64) that
# the kernels may show, for y and every gradient, by input dtype (DESIGN.md section 5); float64
# inputs compute in float64 throughout.
TOLERANCE = {
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64, the measure of `TOLERANCE` (||out|| where ref is all
    zero); NaN in either gives inf, so that it never passes a tolerance."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"relative_error: shapes differ, {out.shape} against {ref.shape}")
    if np.isnan(out).any() or np.isnan(ref).any():
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


def accumulation_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


@jax.custom_jvp
def _silu(z):
    """z * sigmoid(z), differentiated with DESIGN.md's silu'(z) = s * (1 + z * (1 - s)).

    One factor, as in the kernels: JAX's own derivative of z * sigmoid(z) is a sum of two
    products, which turns an infinite cotangent into inf - inf = NaN where the kernels give +-inf.
    """
    return z * jax.nn.sigmoid(z)


@_silu.defjvp
def _silu_jvp(primals, tangents):
    (z,), (dz,) = primals, tangents
    s = jax.nn.sigmoid(z)
    return z * s, dz * (s * (1 + z * (1 - s)))


def _to_bld(a, layout):
    return a if layout == "BLD" else jnp.swapaxes(a, 1, 2)


def _replicated(a):
    """`a` with a replicated sharding type, if a mesh with Explicit axes shards it.

    On such meshes shardings are types, and these references mix their inputs with arrays they
    create (zero states, accumulators, masks) whose types carry no sharding; an oracle trades the
    split for that simplicity. Elsewhere `a` is returned as is.
    """
    if a is None:
        return a
    sharding = getattr(jax.typeof(a), "sharding", None)
    if not isinstance(sharding, NamedSharding) or all(s is None for s in sharding.spec):
        return a
    if AxisType.Explicit not in tuple(getattr(sharding.mesh, "axis_types", ())):
        return a
    return jax.sharding.reshard(a, PartitionSpec())


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
    x, initial_state, seq_idx = (_replicated(a) for a in (x, initial_state, seq_idx))
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
        if seq_idx is None:
            z = z + tap * w[:, k]
        else:
            # An unused tap contributes nothing: the input and the product are both masked, so
            # that neither a NaN/Inf input nor an infinite weight (0 * Inf) reaches z or a gradient.
            used = ((seq_idx >= 0) & (seg_ext[:, k : k + L] == seq_idx))[..., None]
            z = z + jnp.where(used, jnp.where(used, tap, 0) * w[:, k], 0)
    if seq_idx is not None:
        z = jnp.where((seq_idx >= 0)[..., None], z, 0)  # padding: y = act(0) = 0, no bias, no gradient
    y = _silu(z) if spec.silu else z
    y = _to_bld(y.astype(x.dtype), layout)
    if not return_final_state:
        return y
    final = x_ext[:, L : L + P, :]  # x_{L-P+j}
    if seq_idx is not None:
        last = seq_idx[:, -1:]
        keep = (last >= 0) & (seg_ext[:, L : L + P] == last)
        final = jnp.where(keep[..., None], final, 0)
    return y, _to_bld(final.astype(x.dtype), layout)


def update_rows(x, conv_state, weight, bias, cache_seqlens, state_indices, *, silu):
    """causal_conv1d_update on validated "BLD" arrays with per-row weight (B, D, K) and bias (B, D).

    x is (B, T, D) and conv_state (pool, S, D); returns (y, new_conv_state). Shared by
    causal_conv1d_update below and the update primitive's fallback lowering.
    """
    batch, tokens, _ = x.shape
    pool, S, _ = conv_state.shape
    P = weight.shape[-1] - 1
    acc = weight.dtype
    if state_indices is None:
        valid = jnp.ones((batch,), bool)
        rows = conv_state
    else:
        valid = (state_indices >= 0) & (state_indices < pool)
        if pool > 0:
            # Padding rows read zeros, not row 0: a NaN in an unrelated pool row must not reach
            # their (discarded) outputs, where it would turn into NaN gradients.
            rows = jnp.where(valid[:, None, None], conv_state[jnp.where(valid, state_indices, 0)], 0)
        else:
            rows = jnp.zeros((batch,) + conv_state.shape[1:], conv_state.dtype)
    if cache_seqlens is None:
        ext = jnp.concatenate([rows, x], axis=1)  # ext[:, S + u] = x_u, u counted from the first new token
        window = ext[:, S - P :]
        new_rows = ext[:, tokens:]
    else:
        start = cache_seqlens[:, None]
        if S > 0:
            # Slots come from start mod S, so no absolute position is formed: any int32
            # cache_seqlens works without overflow, as in the kernels' 64-bit arithmetic.
            base = jnp.mod(start, S)
            back = jnp.arange(P, 0, -1)  # history position c - back, oldest first
            past = jnp.take_along_axis(rows, jnp.mod(base - back, S)[..., None], axis=1)
            past = jnp.where((start >= back)[..., None], past, 0)  # positions < 0 read as 0
            # After the step, slot s holds token T-1 - ((c+T-1-s) mod S) of x, if that is >= 0.
            token = tokens - 1 - jnp.mod(base + tokens - 1 - jnp.arange(S), S)
            written = jnp.take_along_axis(x, jnp.clip(token, 0, tokens - 1)[..., None], axis=1)
            new_rows = jnp.where((token >= 0)[..., None], written, rows)
        else:
            past, new_rows = rows, rows
        window = jnp.concatenate([past, x], axis=1)
    window = window.astype(acc)
    z = bias[:, None, :]
    for k in range(P + 1):
        z = z + window[:, k : k + tokens, :] * weight[:, None, :, k]
    y = _silu(z) if silu else z
    y = jnp.where(valid[:, None, None], y, 0).astype(x.dtype)
    if state_indices is None:
        return y, new_rows
    target = jnp.where(valid, state_indices, pool)  # out of range: dropped
    return y, conv_state.at[target].set(new_rows, mode="drop")


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    *,
    activation=None,
    cache_seqlens=None,
    state_indices=None,
    layout="BLD",
):
    """Reference causal_conv1d_update; same signature and semantics as the kernels' version."""
    (x, conv_state, weight, bias, cache_seqlens, state_indices), spec = check_update_args(
        x, conv_state, weight, bias, activation=activation, cache_seqlens=cache_seqlens,
        state_indices=state_indices, layout=layout, fn="reference.causal_conv1d_update",
    )
    x, conv_state, cache_seqlens, state_indices = (
        _replicated(a) for a in (x, conv_state, cache_seqlens, state_indices))
    acc = accumulation_dtype(x.dtype)
    rows_weight = jnp.broadcast_to(weight.astype(acc), (spec.batch,) + weight.shape)
    b = jnp.zeros((spec.channels,), acc) if bias is None else bias.astype(acc)
    rows_bias = jnp.broadcast_to(b, (spec.batch, spec.channels))
    y, new_state = update_rows(
        _to_bld(x, layout), _to_bld(conv_state, layout), rows_weight, rows_bias, cache_seqlens,
        state_indices, silu=spec.silu,
    )
    y, new_state = _to_bld(y, layout), _to_bld(new_state, layout)
    if spec.single_token:
        y = y[:, 0, :] if layout == "BLD" else y[:, :, 0]
    return y, new_state


def varlen_offsets(cu_seqlens, tokens: int):
    """The sequence offsets causal_conv1d_varlen uses: cu_seqlens made non-decreasing (running
    maximum) and clipped to [0, tokens].

    Valid offsets are unchanged. Values no trace-time check can see get a defined meaning: an
    offset below its predecessor ends an empty sequence, and a sequence is cut off at the end of x.
    """
    return jnp.clip(jax.lax.cummax(cu_seqlens, axis=0), 0, tokens)


def causal_conv1d_varlen(
    x,
    weight,
    bias=None,
    *,
    cu_seqlens,
    activation=None,
    initial_states=None,
    return_final_states=False,
):
    """Reference causal_conv1d_varlen; same signature and semantics as the kernels' version.

    Each token looks up its sequence i in cu_seqlens; a tap before the sequence start reads
    initial_states[i] (or 0), tokens outside [cu_seqlens[0], cu_seqlens[N]) give 0. cu_seqlens
    is read as ``varlen_offsets(cu_seqlens, T)`` (non-decreasing, within [0, T]).
    """
    (x, weight, bias, cu_seqlens, initial_states, return_final_states), spec = check_varlen_args(
        x, weight, bias, cu_seqlens=cu_seqlens, activation=activation,
        initial_states=initial_states, return_final_states=return_final_states,
        fn="reference.causal_conv1d_varlen",
    )
    x, cu_seqlens, initial_states = (_replicated(a) for a in (x, cu_seqlens, initial_states))
    acc = accumulation_dtype(x.dtype)
    T, D, N, P = spec.tokens, spec.channels, spec.num_seqs, spec.state_len
    if N == 0:
        y = jnp.zeros_like(x)
        return (y, jnp.zeros((0, P, D), x.dtype)) if return_final_states else y
    cu_seqlens = varlen_offsets(cu_seqlens, T)
    xa = x.astype(acc)
    states = jnp.zeros((N, P, D), acc) if initial_states is None else initial_states.astype(acc)

    def extended(seq, u):
        """x_u seen from sequence seq: the packed token when inside it, else its initial state."""
        start = cu_seqlens[seq]
        from_x = xa[jnp.clip(u, 0, T - 1)]
        if P == 0:
            return from_x
        from_state = states[seq, jnp.clip(u - start + P, 0, P - 1)]
        return jnp.where((u >= start)[..., None], from_x, from_state)

    t = jnp.arange(T)
    seq = jnp.searchsorted(cu_seqlens, t, side="right") - 1
    inside = (seq >= 0) & (seq < N)
    seq = jnp.clip(seq, 0, N - 1)
    w = weight.astype(acc)
    z = jnp.zeros((T, D), acc) if bias is None else jnp.broadcast_to(bias.astype(acc), (T, D))
    # taps[k, t] = x_{t-P+k} seen from t's sequence, all K taps in one gather. Padding tokens
    # read nothing: a NaN there would otherwise reach dw through 0 * NaN.
    taps = extended(seq[None, :], t[None, :] - P + jnp.arange(spec.width)[:, None])
    taps = jnp.where(inside[None, :, None], taps, 0)
    z = z + jnp.einsum("ktd,dk->td", taps, w)
    y = _silu(z) if spec.silu else z
    y = jnp.where(inside[:, None], y, 0).astype(x.dtype)
    if not return_final_states:
        return y
    ends = cu_seqlens[1:, None] - P + jnp.arange(P)  # (N, P): x_{L-P+j} of each sequence
    final = extended(jnp.broadcast_to(jnp.arange(N)[:, None], ends.shape), ends)
    return y, final.astype(x.dtype)
