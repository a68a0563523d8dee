"""Trace-time argument checks shared by the kernels' API and the reference.

Every check raises ValueError (bad value or shape) or TypeError (bad dtype) naming the argument
and what was expected, before anything reaches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

MAX_WIDTH = 256
LAYOUTS = ("BLD", "BDL")
ACTIVATIONS = {None: False, "silu": True, "swish": True}
X_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclass(frozen=True)
class ConvSpec:
    """Static facts about one causal_conv1d call, read off validated arguments."""

    batch: int
    length: int
    channels: int
    width: int
    silu: bool
    layout: str

    @property
    def state_len(self) -> int:
        return self.width - 1

    @property
    def channel_last(self) -> bool:
        return self.layout == "BLD"

    def x_shape(self, length: int) -> tuple[int, int, int]:
        """Shape of an x-like tensor with `length` time steps, in this call's layout."""
        if self.channel_last:
            return (self.batch, length, self.channels)
        return (self.batch, self.channels, length)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.x_shape(self.state_len)


def _array(value: Any, name: str, fn: str) -> jnp.ndarray:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        # jnp.asarray rejects None and ragged sequences with a ValueError that names no argument.
        try:
            value = jnp.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{fn}: `{name}` must be an array, got {type(value).__name__}") from e
    return value


def is_float_dtype(dtype: np.dtype, allowed: Optional[Sequence[Any]] = None) -> bool:
    """Whether `dtype` is one of `allowed`, or any floating dtype when `allowed` is not given."""
    if allowed:
        return any(dtype == np.dtype(d) for d in allowed)
    return bool(jnp.issubdtype(dtype, jnp.floating))


def float_dtype_names(allowed: Optional[Sequence[Any]] = None) -> str:
    """What `is_float_dtype` accepts, in words, for an error message."""
    return ", ".join(np.dtype(d).name for d in allowed) if allowed else "a floating dtype"


def _check_float(value: Any, name: str, fn: str, allowed=None) -> None:
    dtype = np.dtype(value.dtype)
    if not is_float_dtype(dtype, allowed):
        expected = float_dtype_names(allowed)
        raise TypeError(f"{fn}: `{name}` must have dtype {expected}, got {dtype.name}")


def check_layout(layout: Any, fn: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: `layout` must be 'BLD' or 'BDL', got {layout!r}")
    return layout


def check_activation(activation: Any, fn: str) -> bool:
    if not isinstance(activation, (str, type(None))) or activation not in ACTIVATIONS:
        raise ValueError(
            f"{fn}: `activation` must be None, 'silu' or 'swish', got {activation!r}"
        )
    return ACTIVATIONS[activation]


def check_weight(weight: Any, channels: int, fn: str, channels_from: str = ""):
    """`channels_from` says where D was read (e.g. x's axis for a layout), for a mismatch message."""
    weight = _array(weight, "weight", fn)
    _check_float(weight, "weight", fn)
    if weight.ndim != 2 or weight.shape[0] != channels:
        where = f" with D from {channels_from}" if channels_from else ""
        raise ValueError(
            f"{fn}: `weight` must have shape (D, K) = ({channels}, K){where}, got {tuple(weight.shape)}"
        )
    width = weight.shape[1]
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"{fn}: `weight` width K must be in [1, {MAX_WIDTH}], got K={width}")
    return weight, width


def check_bias(bias: Any, channels: int, fn: str):
    if bias is None:
        return None
    bias = _array(bias, "bias", fn)
    _check_float(bias, "bias", fn)
    if tuple(bias.shape) != (channels,):
        raise ValueError(f"{fn}: `bias` must have shape (D,) = ({channels},), got {tuple(bias.shape)}")
    return bias


def check_state(state: Any, name: str, shape: tuple[int, ...], dtype, fn: str):
    if state is None:
        return None
    state = _array(state, name, fn)
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{fn}: `{name}` must have shape {tuple(shape)}, got {tuple(state.shape)}")
    if np.dtype(state.dtype) != np.dtype(dtype):
        raise TypeError(
            f"{fn}: `{name}` must have x's dtype {np.dtype(dtype).name}, got {np.dtype(state.dtype).name}"
        )
    return state


def check_int32(value: Any, name: str, shape: tuple[int, ...], fn: str):
    if value is None:
        return None
    value = _array(value, name, fn)
    if np.dtype(value.dtype) != np.dtype(np.int32):
        raise TypeError(f"{fn}: `{name}` must have dtype int32, got {np.dtype(value.dtype).name}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{fn}: `{name}` must have shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def check_flag(value: Any, name: str, fn: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: `{name}` must be a Python bool, got {type(value).__name__}")
    return bool(value)


def check_conv_args(
    x, weight, bias, *, activation, initial_state, seq_idx, return_final_state, layout,
    fn: str = "causal_conv1d",
):
    """Validates causal_conv1d's arguments; returns them as arrays plus a ConvSpec."""
    layout = check_layout(layout, fn)
    silu = check_activation(activation, fn)
    return_final_state = check_flag(return_final_state, "return_final_state", fn)
    x = _array(x, "x", fn)
    _check_float(x, "x", fn, X_DTYPES)
    if x.ndim != 3:
        order = "(B, L, D)" if layout == "BLD" else "(B, D, L)"
        raise ValueError(f"{fn}: `x` must have rank 3, {order} for layout={layout!r}, got shape {tuple(x.shape)}")
    if layout == "BLD":
        batch, length, channels = x.shape
    else:
        batch, channels, length = x.shape
    if length < 1:
        raise ValueError(f"{fn}: `x` must have at least one time step, got shape {tuple(x.shape)}")
    d_axis = 2 if layout == "BLD" else 1
    weight, width = check_weight(
        weight, channels, fn, f"x.shape[{d_axis}] (layout={layout!r})"
    )
    bias = check_bias(bias, channels, fn)
    spec = ConvSpec(batch, length, channels, width, silu, layout)
    initial_state = check_state(initial_state, "initial_state", spec.state_shape, x.dtype, fn)
    seq_idx = check_int32(seq_idx, "seq_idx", (batch, length), fn)
    return (x, weight, bias, initial_state, seq_idx, return_final_state), spec


@dataclass(frozen=True)
class UpdateSpec:
    """Static facts about one causal_conv1d_update call, read off validated arguments."""

    batch: int
    tokens: int
    channels: int
    width: int
    state_len: int  # S, the conv_state slots (at least width - 1)
    pool: int
    silu: bool
    layout: str
    single_token: bool  # x was (B, D)

    @property
    def channel_last(self) -> bool:
        return self.layout == "BLD"


def check_update_args(
    x, conv_state, weight, bias, *, activation, cache_seqlens, state_indices, layout,
    fn: str = "causal_conv1d_update",
):
    """Validates causal_conv1d_update's arguments; returns them as arrays (x as rank 3) and a spec."""
    layout = check_layout(layout, fn)
    silu = check_activation(activation, fn)
    x = _array(x, "x", fn)
    _check_float(x, "x", fn, X_DTYPES)
    order = "(B, T, D)" if layout == "BLD" else "(B, D, T)"
    single_token = x.ndim == 2
    if single_token:
        x = x[:, None, :] if layout == "BLD" else x[:, :, None]
    elif x.ndim != 3:
        raise ValueError(
            f"{fn}: `x` must be (B, D) for one token or {order} for layout={layout!r}, "
            f"got shape {tuple(x.shape)}"
        )
    batch, tokens, channels = x.shape if layout == "BLD" else (x.shape[0], x.shape[2], x.shape[1])
    if tokens < 1:
        raise ValueError(f"{fn}: `x` must hold at least one token, got shape {tuple(x.shape)}")
    weight, width = check_weight(weight, channels, fn)
    bias = check_bias(bias, channels, fn)

    conv_state = _array(conv_state, "conv_state", fn)
    state_order = "(pool, S, D)" if layout == "BLD" else "(pool, D, S)"
    if conv_state.ndim != 3:
        raise ValueError(
            f"{fn}: `conv_state` must have rank 3, {state_order} for layout={layout!r}, "
            f"got shape {tuple(conv_state.shape)}"
        )
    if np.dtype(conv_state.dtype) != np.dtype(x.dtype):
        raise TypeError(
            f"{fn}: `conv_state` must have x's dtype {np.dtype(x.dtype).name}, "
            f"got {np.dtype(conv_state.dtype).name}"
        )
    if layout == "BLD":
        pool, state_len, state_channels = conv_state.shape
    else:
        pool, state_channels, state_len = conv_state.shape
    if state_channels != channels or state_len < width - 1:
        raise ValueError(
            f"{fn}: `conv_state` must be {state_order} with D={channels} and S >= K-1={width - 1}, "
            f"got shape {tuple(conv_state.shape)}"
        )
    cache_seqlens = check_int32(cache_seqlens, "cache_seqlens", (batch,), fn)
    state_indices = check_int32(state_indices, "state_indices", (batch,), fn)
    if state_indices is None and pool != batch:
        raise ValueError(
            f"{fn}: without `state_indices`, `conv_state` must have one row per batch row "
            f"(pool={batch}), got pool={pool}"
        )
    spec = UpdateSpec(batch, tokens, channels, width, state_len, pool, silu, layout, single_token)
    return (x, conv_state, weight, bias, cache_seqlens, state_indices), spec


@dataclass(frozen=True)
class VarlenSpec:
    """Static facts about one causal_conv1d_varlen call, read off validated arguments."""

    tokens: int
    channels: int
    width: int
    num_seqs: int
    silu: bool

    @property
    def state_len(self) -> int:
        return self.width - 1


def check_varlen_args(
    x, weight, bias, *, cu_seqlens, activation, initial_states, return_final_states,
    fn: str = "causal_conv1d_varlen",
):
    """Validates causal_conv1d_varlen's arguments; returns them as arrays plus a VarlenSpec."""
    silu = check_activation(activation, fn)
    return_final_states = check_flag(return_final_states, "return_final_states", fn)
    x = _array(x, "x", fn)
    _check_float(x, "x", fn, X_DTYPES)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(
            f"{fn}: `x` must be packed tokens (T, D) with T >= 1, got shape {tuple(x.shape)}"
        )
    tokens, channels = x.shape
    weight, width = check_weight(weight, channels, fn)
    bias = check_bias(bias, channels, fn)
    if cu_seqlens is None:
        raise ValueError(
            f"{fn}: `cu_seqlens` is required, an int32 (N+1,) array of sequence offsets"
        )
    cu_seqlens = _array(cu_seqlens, "cu_seqlens", fn)
    if np.dtype(cu_seqlens.dtype) != np.dtype(np.int32):
        raise TypeError(
            f"{fn}: `cu_seqlens` must have dtype int32, got {np.dtype(cu_seqlens.dtype).name}"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"{fn}: `cu_seqlens` must have shape (N+1,) with N >= 0, got {tuple(cu_seqlens.shape)}"
        )
    spec = VarlenSpec(tokens, channels, width, cu_seqlens.shape[0] - 1, silu)
    initial_states = check_state(
        initial_states, "initial_states", (spec.num_seqs, spec.state_len, channels), x.dtype, fn
    )
    return (x, weight, bias, cu_seqlens, initial_states, return_final_states), spec
