"""jax-causal-conv: the depthwise causal 1-D convolution of Mamba-style models for JAX.

``causal_conv1d`` runs as XLA FFI custom calls (CPU and CUDA kernels) with a fused backward through
``jax.custom_vjp``; ``reference`` holds pure-jnp versions with the same signatures.
"""

from . import _native  # registers the FFI targets before any lowering
from . import reference
from ._conv import causal_conv1d

__all__ = ["causal_conv1d", "reference"]
__version__ = "0.1.0"
