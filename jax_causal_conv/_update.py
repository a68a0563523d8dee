"""causal_conv1d_update: the public decode function and its primitive.

The primitive has a shape rule, a lowering per platform (our FFI kernels on CPU and CUDA, the
reference elsewhere) and a batching rule that folds vmapped axes into the batch and the state pool,
like the forward primitive in _primitives.py. The FFI call aliases conv_state to new_conv_state, so
with the state donated under jit the pool is updated in place instead of copied.

Operands, in the FFI binding's order: x (B, T, D) or (B, D, T), weight (G, D, K) and bias (G, D)
(both in x's dtype or both in the accumulation dtype, as for the conv primitives), conv_state, then
cache_seqlens and state_indices when present (absent ones travel to the FFI handler as empty
buffers). Batch row b uses weight group b // (B // G).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _native, _primitives, reference
from ._validation import check_update_args
from .reference import accumulation_dtype

SLOTS = ("x", "weight", "bias", "conv_state", "cache_seqlens", "state_indices")
STATE_OPERAND = SLOTS.index("conv_state")
STATE_RESULT = 1  # results: (y, new_conv_state)

update_p = Primitive("causal_conv1d_update")
update_p.multiple_results = True


def _present(params) -> list[str]:
    flags = {
        "cache_seqlens": params["has_cache_seqlens"],
        "state_indices": params["has_state_indices"],
    }
    return [s for s in SLOTS if flags.get(s, True)]


def _named(values, params) -> dict:
    return dict(zip(_present(params), values))


def _abstract(*operands, **params):
    a = _named(operands, params)
    x, state = a["x"], a["conv_state"]
    return [jax.core.ShapedArray(x.shape, x.dtype), jax.core.ShapedArray(state.shape, state.dtype)]


update_p.def_abstract_eval(_abstract)
update_p.def_impl(partial(_primitives._apply, update_p))


def _no_derivative(primals, tangents, **params):
    raise NotImplementedError(
        "causal_conv1d_update has no derivative: it is an inference (decode) op. Differentiate "
        "jax_causal_conv.reference.causal_conv1d_update or causal_conv1d(..., initial_state=...) "
        "instead, or wrap its inputs in jax.lax.stop_gradient."
    )


ad.primitive_jvps[update_p] = _no_derivative


# ---- reference lowering (platforms without our kernels) ----

def _fallback(*operands, **params):
    a = _named(operands, params)
    channel_last = params["channel_last"]

    def to_bld(v):
        return v if channel_last else jnp.swapaxes(v, 1, 2)

    x = to_bld(a["x"])
    acc = accumulation_dtype(x.dtype)  # update_rows computes in the weight's dtype
    weight, bias = a["weight"].astype(acc), a["bias"].astype(acc)
    rows_per_group = x.shape[0] // weight.shape[0]
    y, new_state = reference.update_rows(
        x, to_bld(a["conv_state"]),
        jnp.repeat(weight, rows_per_group, axis=0), jnp.repeat(bias, rows_per_group, axis=0),
        a.get("cache_seqlens"), a.get("state_indices"), silu=params["silu"],
    )
    return [to_bld(y), to_bld(new_state)]


# ---- FFI lowering ----

_ffi_lowering = jax.ffi.ffi_lowering(
    _native.target("causal_conv1d_update"), operand_output_aliases={STATE_OPERAND: STATE_RESULT}
)


def _native_rule(ctx, *operands, **params):
    given = dict(zip(_present(params), zip(operands, ctx.avals_in)))
    args, avals_in = [], []
    for slot in SLOTS:
        if slot in given:
            value, aval = given[slot]
        else:
            empty = np.zeros((0,), np.int32)
            value, aval = mlir.ir_constant(empty), jax.core.ShapedArray(empty.shape, empty.dtype)
        args.append(value)
        avals_in.append(aval)
    return _ffi_lowering(
        ctx.replace(avals_in=avals_in), *args,
        silu=np.bool_(params["silu"]), channel_last=np.bool_(params["channel_last"]),
    )


_fallback_rule = mlir.lower_fun(_fallback, multiple_results=True)
mlir.register_lowering(update_p, _fallback_rule)
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(
        update_p, _primitives._platform_rule(_platform, _native_rule, _fallback_rule),
        platform=_platform,
    )


# ---- batching: fold the vmapped axis into batch rows, pool rows and weight groups ----

def _batching_rule(operands, dims, **params):
    size = next(o.shape[d] for o, d in zip(operands, dims) if d is not None)  # None: not mapped
    front = {
        slot: batching.bdim_at_front(operand, dim, size)
        for slot, operand, dim in zip(_present(params), operands, dims)
    }
    if "state_indices" in front:
        # Instance v's pool rows move to v * pool + row; padding stays padding.
        pool = front["conv_state"].shape[1]
        indices = front["state_indices"]
        shifted = indices + (jnp.arange(size, dtype=jnp.int32) * pool)[:, None]
        front["state_indices"] = jnp.where((indices >= 0) & (indices < pool), shifted, -1)
    folded = [v.reshape((size * v.shape[1],) + v.shape[2:]) for v in front.values()]
    outs = update_p.bind(*folded, **params)
    return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0, 0]


batching.primitive_batchers[update_p] = _batching_rule


def causal_conv1d_update(
    x: jax.Array,
    conv_state: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    activation: Optional[str] = None,
    cache_seqlens: Optional[jax.Array] = None,
    state_indices: Optional[jax.Array] = None,
    layout: str = "BLD",
) -> tuple[jax.Array, jax.Array]:
    """One decode step of the causal conv: T new tokens against a cached conv state.

    Args:
      x: (B, D) for one token, or (B, T, D) for ``layout="BLD"`` / (B, D, T) for ``"BDL"``;
        float16, bfloat16, float32 or float64.
      conv_state: (pool, S, D) for "BLD" or (pool, D, S) for "BDL", S >= K-1, in x's dtype.
        Without ``state_indices`` pool must equal B.
      weight: (D, K), 1 <= K <= 256, PyTorch ``conv1d.weight[:, 0, :]`` order. Any float dtype:
        weight and bias both in x's dtype (bias may be None) or both in the accumulation dtype
        are read by the kernel as they are; other combinations are converted to the accumulation
        dtype first.
      bias: optional (D,), any float dtype.
      activation: None, ``"silu"`` or ``"swish"``.
      cache_seqlens: optional int32 (B,). Absent: shift mode, the state holds the last S inputs
        (oldest first); the window moves left by T and x is appended. Present: ring mode, the
        token at absolute position p lives in slot p % S; the step reads positions c-P .. c+T-1
        (c = cache_seqlens[b], P = K-1, positions < 0 read as 0) and writes c .. c+T-1. The
        caller advances cache_seqlens.
      state_indices: optional int32 (B,): row b reads and writes ``conv_state[state_indices[b]]``.
        An index < 0 or >= pool makes row b padding: its y is 0 and no state is touched. Rows
        that are not padding must use distinct indices.
      layout: ``"BLD"`` (default) or ``"BDL"``.

    Returns:
      ``(y, new_conv_state)``: y with x's shape and dtype, the state with conv_state's shape.
      Functional; under ``jax.jit`` with conv_state donated, the pool is updated in place.

    Not differentiable (jax.grad through it raises NotImplementedError). Accumulates in float32
    (float64 for float64 x).
    """
    (x3, conv_state, weight, bias, cache_seqlens, state_indices), spec = check_update_args(
        x, conv_state, weight, bias, activation=activation, cache_seqlens=cache_seqlens,
        state_indices=state_indices, layout=layout,
    )
    grouped_weight, grouped_bias = _primitives.grouped_params(x3.dtype, weight, bias, spec.channels)
    operands = [
        v for v in (x3, grouped_weight, grouped_bias, conv_state, cache_seqlens, state_indices)
        if v is not None
    ]
    y, new_state = update_p.bind(
        *operands, silu=spec.silu, channel_last=spec.channel_last,
        has_cache_seqlens=cache_seqlens is not None, has_state_indices=state_indices is not None,
    )
    if spec.single_token:
        y = y.reshape((spec.batch, spec.channels))
    return y, new_state
