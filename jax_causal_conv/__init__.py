"""jax-causal-conv: the depthwise causal 1-D convolution of Mamba-style models for JAX.

``causal_conv1d`` runs as XLA FFI custom calls (CPU and CUDA kernels) with a fused backward through
``jax.custom_vjp``; ``causal_conv1d_update`` is the decode step on a cached conv state;
``causal_conv1d_varlen`` runs packed variable-length sequences with per-sequence states;
``reference`` holds pure-jnp versions with the same signatures. ``jax_causal_conv.nn`` (imported on
first use, needs flax) holds the Flax NNX layer ``CausalConv1d``.
"""

import importlib

from . import _native  # registers the FFI targets before any lowering
from . import reference
from ._conv import causal_conv1d
from ._update import causal_conv1d_update
from ._varlen import causal_conv1d_varlen

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_varlen", "reference"]
__version__ = "0.1.0"


def __getattr__(name):
    # nn needs flax; importing it lazily keeps flax optional for everything else.
    if name == "nn":
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
