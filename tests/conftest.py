"""Shared test setup: float64 oracle, DESIGN.md tolerances, devices, and random inputs."""

from __future__ import annotations

import os

# Eight host devices for the sharding tests; XLA reads the flag once, when jax initializes.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # the reference runs in float64 (DESIGN.md section 5)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_causal_conv.reference import TOLERANCE, relative_error  # noqa: E402

DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64]


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected, so shards stay even
def pytest_collection_modifyitems(config, items):
    """JCC_TEST_SHARD=i/n keeps every n-th test from the i-th. scripts/gpu_check.sh runs n such
    processes at once on one GPU: most of a GPU test's time is XLA compiling on the host."""
    shard = os.environ.get("JCC_TEST_SHARD")
    if not shard:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"JCC_TEST_SHARD={shard!r}: want i/n with 0 <= i < n")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
    items[:] = items[index::count]


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# Kernel tests run on the CPU and, with the `gpu` marker, on the first GPU (GPU below: the GPU
# alone).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "gpu", id="gpu",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not gpu_devices(), reason="no GPU")],
    ),
]


# The GPU case alone, for tests too large for the CPU run or whose shapes only choose among the
# CUDA kernels' variants (the decode step's grids, channel vectors and staging), which the CPU
# kernels do not have: the other tests' CPU cases cover those.
GPU = [p for p in DEVICES if p.id == "gpu"]


def device(name: str):
    return jax.devices("cpu")[0] if name == "cpu" else gpu_devices()[0]


def assert_close(out, ref, dtype, what=""):
    err = relative_error(out, ref)
    tol = TOLERANCE[jnp.dtype(dtype)]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


def to_f64(tree):
    return jax.tree.map(lambda a: None if a is None else jnp.asarray(a, jnp.float64), tree)


def random_seq_idx(rng, batch, length, boundaries=None, padding=True):
    """Sorted segment ids per row; optional explicit boundaries; optional trailing padding (-1)."""
    rows = []
    for _ in range(batch):
        if boundaries is None:
            cuts = np.sort(rng.choice(np.arange(1, max(length, 2)), size=min(3, max(length - 1, 0)), replace=False))
        else:
            cuts = np.asarray([c for c in boundaries if 0 < c < length])
        ids = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)
        if padding and length > 2:
            ids[length - rng.integers(1, max(2, length // 4)):] = -1
        rows.append(ids)
    return np.stack(rows)


def make_inputs(rng, *, batch, length, channels, width, dtype, layout="BLD", bias=True,
                initial_state=False, seq_idx=False):
    """Fresh random inputs for causal_conv1d, as numpy arrays (x and states in `dtype`)."""
    x_shape = (batch, length, channels) if layout == "BLD" else (batch, channels, length)
    s_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
    out = dict(
        x=jnp.asarray(rng.standard_normal(x_shape), dtype),
        weight=jnp.asarray(rng.standard_normal((channels, width)) / np.sqrt(width), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(channels), jnp.float32) if bias else None,
        initial_state=jnp.asarray(rng.standard_normal(s_shape), dtype) if initial_state else None,
        seq_idx=jnp.asarray(random_seq_idx(rng, batch, length)) if seq_idx else None,
    )
    return out
