"""The causal_conv1d forward and backward primitives.

Each primitive has a shape rule, a lowering per platform (our FFI kernels on CPU and CUDA, the
reference on every other platform), and a batching rule that folds vmapped axes into the batch so
that a vmapped call is still one custom call.

Operands are the present inputs in a fixed slot order; absent optional inputs are simply not
operands (flags in the params say which are present) and travel to the FFI handler as empty
buffers. Weight and bias arrive as (groups, D, K) and (groups, D), both in x's dtype or both in
the accumulation dtype (see grouped_params); dweight and dbias come back in that dtype. Batch row
b uses group b // (B // groups).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from . import _native, reference
from .reference import accumulation_dtype

FWD_SLOTS = ("x", "weight", "bias", "initial_state", "seq_idx")
BWD_SLOTS = FWD_SLOTS + ("dy", "dfinal_state")
FWD_RESULTS = ("y", "final_state")
BWD_RESULTS = ("dx", "dweight", "dbias", "dinitial_state")

forward_p = Primitive("causal_conv1d_fwd")
forward_p.multiple_results = True
backward_p = Primitive("causal_conv1d_bwd")
backward_p.multiple_results = True


def params_dtype(x_dtype, weight, bias):
    """The dtype weight and bias travel to the kernels in: x's own when both already have it (the
    kernels widen them as they load them, so the program holds no convert of them), else x's
    accumulation dtype (the one the kernels compute in)."""
    x_dtype = jnp.dtype(x_dtype)
    if weight.dtype == x_dtype and (bias is None or bias.dtype == x_dtype):
        return x_dtype
    return accumulation_dtype(x_dtype)


def grouped_params(x_dtype, weight, bias, channels: int):
    """Weight (D, K) and bias (D,) or None as one group, (1, D, K) and (1, D), in params_dtype;
    an absent bias is zeros. Under autodiff their cotangents come back in the user's dtypes."""
    dtype = params_dtype(x_dtype, weight, bias)
    grouped_bias = jnp.zeros((channels,), dtype) if bias is None else bias.astype(dtype)
    return weight.astype(dtype)[None], grouped_bias[None]


def _present(slots, params) -> list[str]:
    """The slots (operands or results) that exist for these params."""
    flags = {
        "initial_state": params["has_initial_state"],
        "seq_idx": params["has_seq_idx"],
        "dfinal_state": params.get("has_dfinal_state", False),
        "final_state": params.get("return_final_state", False),
        "dinitial_state": params["has_initial_state"],
    }
    return [s for s in slots if flags.get(s, True)]


def _named(values, slots, params) -> dict:
    return dict(zip(_present(slots, params), values))


def _state_shape(x_shape, state_len, channel_last):
    if channel_last:
        return (x_shape[0], state_len, x_shape[2])
    return (x_shape[0], x_shape[1], state_len)


def _typed_like(like, shape, time_axis=None):
    """An aval of `like`'s dtype and sharding type, unsharded along `time_axis` if given.

    On meshes with Explicit axes the sharding is part of the type: outputs keep their operand's
    (y and the gradients), and the final state, which comes from the last time step, is whole
    along time.
    """
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return jax.core.ShapedArray(shape, like.dtype)
    if time_axis is not None:
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        spec[time_axis] = None
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return jax.core.ShapedArray(shape, like.dtype, sharding=sharding)


def _forward_abstract(*operands, **params):
    a = _named(operands, FWD_SLOTS, params)
    x, weight = a["x"], a["weight"]
    outs = [_typed_like(x, x.shape)]
    if params["return_final_state"]:
        shape = _state_shape(x.shape, weight.shape[-1] - 1, params["channel_last"])
        outs.append(_typed_like(x, shape, time_axis=1 if params["channel_last"] else 2))
    return outs


def _backward_abstract(*operands, **params):
    a = _named(operands, BWD_SLOTS, params)
    outs = [a["x"], a["weight"], a["bias"]]
    if params["has_initial_state"]:
        outs.append(a["initial_state"])
    return [_typed_like(o, o.shape) for o in outs]


forward_p.def_abstract_eval(_forward_abstract)
backward_p.def_abstract_eval(_backward_abstract)


def _apply(prim, *operands, **params):
    return jax.jit(partial(prim.bind, **params))(*operands)


forward_p.def_impl(partial(_apply, forward_p))
backward_p.def_impl(partial(_apply, backward_p))


# ---- reference lowering (platforms without our kernels) ----

def _grouped_reference(a, params, return_final_state):
    """The reference over (groups, rows per group), matching the primitives' weight groups."""
    x, weight, bias = a["x"], a["weight"], a["bias"]
    groups = weight.shape[0]
    layout = "BLD" if params["channel_last"] else "BDL"

    def split(v):
        return None if v is None else v.reshape((groups, v.shape[0] // groups) + v.shape[1:])

    def one_group(x, weight, bias, initial_state, seq_idx):
        return reference.causal_conv1d(
            x, weight, bias, activation="silu" if params["silu"] else None,
            initial_state=initial_state, seq_idx=seq_idx,
            return_final_state=return_final_state, layout=layout,
        )

    def merge(v):
        return v.reshape((v.shape[0] * v.shape[1],) + v.shape[2:])

    def run(x, weight, bias, initial_state):
        out = jax.vmap(one_group)(split(x), weight, bias, split(initial_state), split(a.get("seq_idx")))
        return jax.tree.map(merge, out)

    return run, (x, weight, bias, a.get("initial_state"))


def _forward_fallback(*operands, **params):
    a = _named(operands, FWD_SLOTS, params)
    run, args = _grouped_reference(a, params, params["return_final_state"])
    out = run(*args)
    return list(out) if params["return_final_state"] else [out]


def _backward_fallback(*operands, **params):
    a = _named(operands, BWD_SLOTS, params)
    run, args = _grouped_reference(a, params, True)
    (y, final), vjp = jax.vjp(run, *args)
    dfinal = a.get("dfinal_state", jnp.zeros_like(final))
    dx, dweight, dbias, dinitial = vjp((a["dy"], dfinal))
    outs = [dx, dweight, dbias]
    if params["has_initial_state"]:
        outs.append(dinitial)
    return outs


# ---- FFI lowering ----

def _workspace_aval(platform, avals_in, params):
    """The backward's extra workspace output (partial sums in the accumulation dtype), sized by
    the platform's kernel."""
    x, weight = avals_in[0], avals_in[1]
    batch = x.shape[0]
    length, channels = (x.shape[1], x.shape[2]) if params["channel_last"] else (x.shape[2], x.shape[1])
    n = _native.backward_workspace_elements(platform, batch, length, channels, weight.shape[-1])
    return jax.core.ShapedArray((n,), accumulation_dtype(x.dtype))


def _ffi_rule(platform, target, slots, result_slots):
    """Lowers to the FFI target, passing absent operands and results as empty buffers."""
    ffi_lowering = jax.ffi.ffi_lowering(_native.target(target))

    def rule(ctx, *operands, **params):
        given = dict(zip(_present(slots, params), zip(operands, ctx.avals_in)))
        dtype = ctx.avals_in[0].dtype
        args, avals_in = [], []
        for slot in slots:
            if slot in given:
                value, aval = given[slot]
            else:
                empty = np.zeros((0,), np.int32 if slot == "seq_idx" else dtype)
                value, aval = mlir.ir_constant(empty), jax.core.ShapedArray(empty.shape, empty.dtype)
            args.append(value)
            avals_in.append(aval)
        produced = _present(result_slots, params)
        out_avals = iter(ctx.avals_out)
        avals_out = [
            next(out_avals) if slot in produced else jax.core.ShapedArray((0,), dtype)
            for slot in result_slots
        ]
        if target == "causal_conv1d_bwd":
            avals_out.append(_workspace_aval(platform, ctx.avals_in, params))
        results = ffi_lowering(
            ctx.replace(avals_in=avals_in, avals_out=avals_out), *args,
            silu=np.bool_(params["silu"]), channel_last=np.bool_(params["channel_last"]),
        )
        return [r for slot, r in zip(result_slots, results) if slot in produced]

    return rule


def _platform_rule(platform, native_rule, fallback_rule):
    def rule(ctx, *operands, **params):
        chosen = native_rule if platform in _native.native_platforms else fallback_rule
        return chosen(ctx, *operands, **params)

    return rule


for _prim, _target, _slots, _results, _fallback in (
    (forward_p, "causal_conv1d_fwd", FWD_SLOTS, FWD_RESULTS, _forward_fallback),
    (backward_p, "causal_conv1d_bwd", BWD_SLOTS, BWD_RESULTS, _backward_fallback),
):
    _fallback_rule = mlir.lower_fun(_fallback, multiple_results=True)
    mlir.register_lowering(_prim, _fallback_rule)
    for _platform in ("cpu", "cuda"):
        _native_rule = _ffi_rule(_platform, _target, _slots, _results)
        mlir.register_lowering(
            _prim, _platform_rule(_platform, _native_rule, _fallback_rule), platform=_platform
        )


# ---- batching: fold the vmapped axis into batch rows (and weight groups) ----

def fold_batch(bind, operands, dims):
    """Runs `bind` once on operands whose vmapped axis (dims; None when unmapped) is folded into
    the leading axis: batch rows for x-like operands, groups for weight and bias. Every result
    comes back with the vmapped axis in front."""
    size = next(o.shape[d] for o, d in zip(operands, dims) if d is not None)
    folded = []
    for operand, dim in zip(operands, dims):
        front = batching.bdim_at_front(operand, dim, size)
        folded.append(front.reshape((size * front.shape[1],) + front.shape[2:]))
    outs = bind(*folded)
    return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0] * len(outs)


def _batching_rule(prim):
    def rule(operands, dims, **params):
        return fold_batch(partial(prim.bind, **params), operands, dims)

    return rule


batching.primitive_batchers[forward_p] = _batching_rule(forward_p)
batching.primitive_batchers[backward_p] = _batching_rule(backward_p)


# ---- binding helpers used by the custom_vjp ----

def _bind(prim, *operands, **params):
    return prim.bind(*operands, **params)


def forward(x, weight, bias, initial_state, seq_idx, *, silu, channel_last, return_final_state,
            bind=_bind):
    """y (and the final state) from grouped weight (G, D, K) and bias (G, D), both in x's dtype or
    both in its accumulation dtype.

    `bind(primitive, *operands, **params)` binds the primitive (the sharding module passes its own).
    """
    operands = [v for v in (x, weight, bias, initial_state, seq_idx) if v is not None]
    outs = bind(
        forward_p,
        *operands, silu=silu, channel_last=channel_last, has_initial_state=initial_state is not None,
        has_seq_idx=seq_idx is not None, return_final_state=return_final_state,
    )
    return tuple(outs) if return_final_state else outs[0]


def backward(x, weight, bias, initial_state, seq_idx, dy, dfinal_state, *, silu, channel_last,
             bind=_bind):
    """(dx, dweight, dbias, dinitial_state or None) for grouped weight and bias; `bind` as in
    forward."""
    operands = [
        v for v in (x, weight, bias, initial_state, seq_idx, dy, dfinal_state) if v is not None
    ]
    outs = bind(
        backward_p,
        *operands, silu=silu, channel_last=channel_last, has_initial_state=initial_state is not None,
        has_seq_idx=seq_idx is not None, has_dfinal_state=dfinal_state is not None,
    )
    return tuple(outs) if initial_state is not None else (*outs, None)
