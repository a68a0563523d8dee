"""Loads the compiled extensions and registers their XLA FFI targets.

The CPU extension is always built, so a missing one is a broken install. The CUDA extension is
optional: without it (or without a GPU) the package still imports and runs on CPU.
"""

from __future__ import annotations

import importlib

import jax

TARGET_PREFIX = "jax_causal_conv_"


def _register(module_name: str, platform: str) -> bool:
    try:
        module = importlib.import_module(f"jax_causal_conv.{module_name}")
    except ImportError:
        return False
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform=platform)
    return True


if not _register("_cpu", "cpu"):
    raise ImportError(
        "jax_causal_conv: the compiled CPU extension (_cpu) is missing; reinstall with `pip install .`"
    )

# Lowering platforms (as JAX names them) that have our kernels. Others lower to the reference.
native_platforms: set[str] = {"cpu"}
if _register("_cuda", "CUDA"):
    native_platforms.add("cuda")


def target(name: str) -> str:
    return TARGET_PREFIX + name
