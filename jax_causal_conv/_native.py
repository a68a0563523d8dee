"""Loads the compiled extensions and registers their XLA FFI targets.

The CPU extension is always built, so a missing one is a broken install. The CUDA extension is
optional: without it (or without a GPU) the package still imports and runs on CPU.
"""

from __future__ import annotations

import importlib

import jax

TARGET_PREFIX = "jax_causal_conv_"


def _register(module_name: str, platform: str):
    try:
        module = importlib.import_module(f"jax_causal_conv.{module_name}")
    except ImportError:
        return None
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform=platform)
    return module


if _register("_cpu", "cpu") is None:
    raise ImportError(
        "jax_causal_conv: the compiled CPU extension (_cpu) is missing; reinstall with `pip install .`"
    )
_cuda = _register("_cuda", "CUDA")

# Lowering platforms (as JAX names them) that have our kernels. Others lower to the reference.
native_platforms: set[str] = {"cpu"} if _cuda is None else {"cpu", "cuda"}


def backward_workspace_elements(platform: str, batch: int, length: int, channels: int,
                                width: int) -> int:
    """Size of the backward's partial-sum workspace output; the CPU kernel needs none."""
    if platform == "cuda":
        return _cuda.backward_workspace_elements(batch, length, channels, width)
    return 0


def target(name: str) -> str:
    return TARGET_PREFIX + name
