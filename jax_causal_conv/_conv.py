"""causal_conv1d: the public function and its custom_vjp."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax

from . import _sharding
from ._primitives import grouped_params
from ._validation import check_conv_args


class _Config(NamedTuple):
    silu: bool
    channel_last: bool
    return_final_state: bool


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(config: _Config, x, weight, bias, initial_state, seq_idx):
    return _sharding.forward(x, weight, bias, initial_state, seq_idx, **config._asdict())


def _conv_fwd(config, x, weight, bias, initial_state, seq_idx):
    # Only the inputs are saved: the backward recomputes z and delta.
    out = _conv(config, x, weight, bias, initial_state, seq_idx)
    return out, (x, weight, bias, initial_state, seq_idx)


def _conv_bwd(config, residuals, cotangent):
    x, weight, bias, initial_state, seq_idx = residuals
    dy, dfinal_state = cotangent if config.return_final_state else (cotangent, None)
    dx, dweight, dbias, dinitial_state = _sharding.backward(
        x, weight, bias, initial_state, seq_idx, dy, dfinal_state,
        silu=config.silu, channel_last=config.channel_last,
    )
    return dx, dweight, dbias, dinitial_state, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: Optional[jax.Array] = None,
    *,
    activation: Optional[str] = None,
    initial_state: Optional[jax.Array] = None,
    seq_idx: Optional[jax.Array] = None,
    return_final_state: bool = False,
    layout: str = "BLD",
):
    """Depthwise causal 1-D convolution, ``y = act(conv(x, weight) + bias)``.

    Args:
      x: (B, L, D) for ``layout="BLD"`` or (B, D, L) for ``layout="BDL"``; float16, bfloat16,
        float32 or float64.
      weight: (D, K), 1 <= K <= 256; ``weight[:, K-1]`` multiplies the current input (PyTorch
        ``conv1d.weight[:, 0, :]`` order). Any float dtype; see the dtype note below.
      bias: optional (D,), any float dtype.
      activation: None, ``"silu"`` or ``"swish"`` (the same as ``"silu"``).
      initial_state: optional conv state, (B, K-1, D) for "BLD" or (B, D, K-1) for "BDL", oldest
        first, in x's dtype. Zeros when absent.
      seq_idx: optional int32 (B, L) segment ids for packed sequences; taps never cross a segment
        boundary and a negative id marks padding (y = 0 there).
      return_final_state: also return the last K-1 inputs (the state to continue from).
      layout: ``"BLD"`` (default, JAX order) or ``"BDL"`` (PyTorch order).

    Returns:
      y with x's shape and dtype, or ``(y, final_state)`` when ``return_final_state``.

    Differentiable (``jax.custom_vjp`` with a fused backward kernel) in x, weight, bias and
    initial_state, including the cotangent of final_state; every gradient has its primal's dtype.
    Accumulates in float32 (float64 for float64 x).

    Weight and bias dtypes: when both are in x's dtype (bias may be None), or both in the
    accumulation dtype, the kernels read them as they are, and the backward's kernel writes dweight
    and dbias in that dtype (summed in the accumulation dtype, rounded once), so no convert op runs
    around the call. Other combinations are converted to the accumulation dtype first, and the
    gradients back to the weight's and bias's own dtypes.
    """
    (x, weight, bias, initial_state, seq_idx, return_final_state), spec = check_conv_args(
        x, weight, bias, activation=activation, initial_state=initial_state, seq_idx=seq_idx,
        return_final_state=return_final_state, layout=layout,
    )
    grouped_weight, grouped_bias = grouped_params(x.dtype, weight, bias, spec.channels)
    config = _Config(spec.silu, spec.channel_last, return_final_state)
    return _conv(config, x, grouped_weight, grouped_bias, initial_state, seq_idx)
