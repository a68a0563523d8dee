"""Flax NNX layer for the depthwise causal conv, with a decode cache.

Needs flax; ``import jax_causal_conv`` does not import this module until ``jax_causal_conv.nn`` is
first used.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._conv import causal_conv1d
from ._update import causal_conv1d_update
from ._validation import (
    MAX_WIDTH,
    X_DTYPES,
    _array,
    check_activation,
    check_flag,
    float_dtype_names,
    is_float_dtype,
)

Initializer = Callable[..., jax.Array]

# flax >= 0.12 modules are pytrees whose attributes are static unless marked as data; an attribute
# that is None now and a Variable later (the bias slot, the cache) must be marked. Older flax
# has no nnx.data and needs no marking.
_data = getattr(nnx, "data", lambda value: value)


def _set(variable: nnx.Variable, value: jax.Array) -> None:
    # flax >= 0.12 deprecates the `.value` setter in favour of set_value, which older flax lacks.
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:
        variable.value = value


def _int(value: Any, name: str, low: int, high: Optional[int] = None) -> int:
    """A Python or NumPy integer (not a bool) in [low, high], as an int."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if not ok or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"CausalConv1d: `{name}` must be an int {bounds}, got {value!r}")
    return int(value)


def _float_dtype(value: Any, name: str, allowed=None):
    """`value` as a NumPy dtype when it is a floating dtype (one of `allowed`, when given)."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not is_float_dtype(dtype, allowed):
        got = dtype.name if dtype is not None else repr(value)
        raise TypeError(f"CausalConv1d: `{name}` must be {float_dtype_names(allowed)}, got {got}")
    return dtype


# PyTorch's default for a depthwise conv1d: U(-1/sqrt(K), 1/sqrt(K)), fan-in = kernel_size.
default_kernel_init = nnx.initializers.variance_scaling(
    1.0 / 3.0, "fan_in", "uniform", in_axis=-1, out_axis=-2
)


class CausalConv1d(nnx.Module):
    """Depthwise causal 1-D convolution over (batch, length, features) inputs.

    ``y = act(conv(x, kernel) + bias)`` per feature, where ``kernel[:, K-1]`` multiplies the current
    step (PyTorch ``conv1d`` order, see ``jax_causal_conv.causal_conv1d``).

    Parameters: ``kernel`` (features, kernel_size) and, with ``use_bias``, ``bias`` (features,).
    To load a PyTorch / Dao-AILab ``nn.Conv1d(D, D, K, groups=D, padding=K-1)`` checkpoint whose
    weight is (D, 1, K) (flax < 0.12: assign to ``layer.kernel.value`` instead)::

        layer.kernel[...] = jnp.asarray(torch_conv.weight.detach().cpu().numpy()[:, 0, :])
        layer.bias[...] = jnp.asarray(torch_conv.bias.detach().cpu().numpy())

    Decoding works like Flax's attention cache: ``init_cache(batch_size)`` creates an
    ``nnx.Cache`` holding the last ``kernel_size - 1`` inputs (zeros), and
    ``layer(x, decode=True)`` consumes new steps and updates the cache. One step (x of shape
    (B, D) or (B, 1, D)) runs ``causal_conv1d_update``; several steps (a prompt) run the
    parallel ``causal_conv1d`` from the cached state.

    Args:
      features: number of channels D.
      kernel_size: K, 1 <= K <= 256.
      use_bias: whether to add a learned bias.
      activation: None, ``"silu"`` or ``"swish"``.
      dtype: computation dtype (x is cast to it); None keeps x's dtype.
      param_dtype: dtype of the parameters. In x's dtype (after the ``dtype`` cast) or in its
        accumulation dtype (float32; float64 for float64 x) the kernels read them without a
        convert op; see ``causal_conv1d``.
      kernel_init: initializer of the (features, kernel_size) kernel.
      bias_init: initializer of the (features,) bias.
      rngs: the ``nnx.Rngs`` the parameters are drawn from.
    """

    def __init__(
        self,
        features: int,
        kernel_size: int,
        *,
        use_bias: bool = True,
        activation: Optional[str] = None,
        dtype: Optional[Any] = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ):
        features = _int(features, "features", 1)
        kernel_size = _int(kernel_size, "kernel_size", 1, MAX_WIDTH)
        use_bias = check_flag(use_bias, "use_bias", "CausalConv1d")
        check_activation(activation, "CausalConv1d")
        if dtype is not None:
            _float_dtype(dtype, "dtype", X_DTYPES)
        _float_dtype(param_dtype, "param_dtype")
        self.features = features
        self.kernel_size = kernel_size
        self.use_bias = use_bias
        self.activation = activation
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.kernel = nnx.Param(kernel_init(rngs.params(), (features, kernel_size), param_dtype))
        self.bias = (
            nnx.Param(bias_init(rngs.params(), (features,), param_dtype)) if use_bias else _data(None)
        )
        self.conv_state: Optional[nnx.Cache] = _data(None)

    def init_cache(self, batch_size: int, dtype: Optional[Any] = None) -> None:
        """Creates (or resets) the decode cache: zeros of shape (batch_size, kernel_size - 1, features).

        dtype must be the dtype the decoded x has after the layer's ``dtype`` cast (default: the
        layer's ``dtype``, else float32).
        """
        batch_size = _int(batch_size, "batch_size", 0)
        dtype = _float_dtype(dtype or self.dtype or jnp.float32, "dtype", X_DTYPES)
        self.conv_state = nnx.Cache(jnp.zeros((batch_size, self.kernel_size - 1, self.features), dtype))

    def __call__(
        self,
        x: jax.Array,
        *,
        seq_idx: Optional[jax.Array] = None,
        initial_state: Optional[jax.Array] = None,
        return_final_state: bool = False,
        decode: bool = False,
    ):
        """Applies the conv.

        Args:
          x: (B, L, D); with ``decode=True`` also (B, D) for one step.
          seq_idx, initial_state, return_final_state: as in ``jax_causal_conv.causal_conv1d``
            (not with ``decode``).
          decode: consume x as the next steps after the cached state and update the cache.

        Returns:
          y with x's shape (in ``dtype`` when set), or ``(y, final_state)`` with
          ``return_final_state``.
        """
        x = _array(x, "x", "CausalConv1d")
        if self.dtype is not None:
            x = jnp.asarray(x, self.dtype)
        if x.ndim >= 1 and x.shape[-1] != self.features:
            raise ValueError(
                f"CausalConv1d: `x` must have features={self.features} in its last axis, got shape "
                f"{tuple(x.shape)}"
            )
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        if not decode:
            return causal_conv1d(
                x, kernel, bias, activation=self.activation, initial_state=initial_state,
                seq_idx=seq_idx, return_final_state=return_final_state,
            )
        if self.conv_state is None:
            raise ValueError("CausalConv1d: call init_cache(batch_size) before decode=True")
        if seq_idx is not None or initial_state is not None or return_final_state:
            raise ValueError(
                "CausalConv1d: `seq_idx`, `initial_state` and `return_final_state` are not used "
                "with decode=True (the state is the cache)"
            )
        state = self.conv_state[...]
        if x.ndim >= 2 and x.shape[0] != state.shape[0]:
            raise ValueError(
                f"CausalConv1d: `x` has batch {x.shape[0]} but the decode cache holds "
                f"{state.shape[0]} rows; call init_cache({x.shape[0]})"
            )
        if x.dtype != state.dtype:
            raise TypeError(
                f"CausalConv1d: `x` has dtype {x.dtype} (after the layer's dtype cast) but the decode "
                f"cache holds {state.dtype}; pass that dtype to init_cache"
            )
        if x.ndim == 3 and x.shape[1] > 1:
            y, new_state = causal_conv1d(
                x, kernel, bias, activation=self.activation, initial_state=state,
                return_final_state=True,
            )
        else:
            y, new_state = causal_conv1d_update(x, state, kernel, bias, activation=self.activation)
        _set(self.conv_state, new_state)
        return y
