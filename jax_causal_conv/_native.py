"""Loads the compiled extensions and registers their XLA FFI targets.

The CPU extension is always built, so a missing one is a broken install. The CUDA extension is
optional: without it (or without a GPU) the package still imports and runs on CPU.

Each extension carries the XLA FFI API version of the jaxlib headers it was compiled against.
XLA refuses a handler whose version is newer than its own, and then fails to start the whole
backend ("Unable to initialize backend 'cpu'"), breaking every JAX computation of the process;
so a newer one is an ImportError here, before anything is registered.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from typing import Optional

import jax

TARGET_PREFIX = "jax_causal_conv_"


@functools.cache  # read once for both extensions
def runtime_ffi_api_version() -> Optional[tuple[int, int]]:
    """The XLA FFI API version of the installed jaxlib, from the C API header it ships with (the
    one its runtime implements); None where the header cannot be read."""
    header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    if major is None or minor is None:
        return None
    return int(major.group(1)), int(minor.group(1))


def check_ffi_api_version(module_name: str, built: tuple[int, int],
                          runtime: Optional[tuple[int, int]]) -> None:
    """Raises ImportError if the extension was compiled against a newer XLA FFI API than the
    installed jaxlib implements."""
    if runtime is None or tuple(built) <= tuple(runtime):
        return
    raise ImportError(
        f"jax_causal_conv.{module_name} was compiled against XLA FFI API "
        f"{built[0]}.{built[1]}, newer than the {runtime[0]}.{runtime[1]} of the installed jaxlib "
        f"(jax {jax.__version__}): XLA would reject its kernels and fail to start the backend. "
        "Reinstall jax_causal_conv against this jax (`pip install --no-build-isolation "
        "--force-reinstall --no-deps .` from the checkout, with scikit-build-core and nanobind "
        "installed), or upgrade jax."
    )


def _register(module_name: str, platform: str):
    try:
        module = importlib.import_module(f"jax_causal_conv.{module_name}")
    except ImportError:
        return None
    check_ffi_api_version(module_name, module.ffi_api_version(), runtime_ffi_api_version())
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
