"""Determinism (issue 7 item 5): forward and backward are bitwise identical over many runs.

One jitted function (jax.vjp of causal_conv1d) is called N times on the same inputs; every call
runs the kernels again (XLA caches executables, not results). Each run's y, final state and
gradients are compared bit for bit (as unsigned integers, so -0.0 != 0.0 and NaN patterns count)
with the first run's, on the device; only the mismatch counts come back to the host, once.

Cases: the main training workload (B=8, L=2048, D=4096, K=4, bfloat16) in both layouts, plain and
with bias, silu, seq_idx and initial/final state, plus the generic-width tile kernels (K=5, D not
a multiple of the 16-byte pack), and the plain channel-first bf16 K = 8 call, whose backward runs on
tensor cores.

    python3 scripts/determinism.py              # N=1000 on the default device (H200: ~15 s)
    python3 scripts/determinism.py --smoke      # small sizes, N=5

Exit status 1 if any run differs from the first.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_causal_conv as jcc

NAMES = ("y", "final_state", "dx", "dweight", "dbias", "dinitial_state")
UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def cases(smoke: bool):
    # name, batch, length, channels, width, layout, full (bias, silu, seq_idx, states)
    B, L, D = (2, 64, 32) if smoke else (8, 2048, 4096)
    return [
        ("plain", B, L, D, 4, "BLD", False),
        ("full", B, L, D, 4, "BLD", True),
        ("plain", B, L, D, 4, "BDL", False),
        ("full", B, L, D, 4, "BDL", True),
        ("full_generic", B, L, D + 4, 5, "BLD", True),
        ("plain", B, L, D, 8, "BDL", False),
    ]


def make_inputs(rng, batch, length, channels, width, layout, full):
    dtype = jnp.bfloat16
    x_shape = (batch, length, channels) if layout == "BLD" else (batch, channels, length)
    s_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
    normal = lambda shape, dt: jnp.asarray(rng.standard_normal(shape, np.float32), dt)  # noqa: E731
    seq_idx = None
    if full:
        # Three segments per row and a padded tail, boundaries off the tile and pack grid.
        ids = np.zeros((batch, length), np.int32)
        ids[:, length // 3 + 1:] = 1
        ids[:, 2 * length // 3 + 3:] = 2
        ids[:, length - length // 16 - 1:] = -1
        seq_idx = jnp.asarray(ids)
    return dict(
        x=normal(x_shape, dtype),
        weight=normal((channels, width), jnp.float32) / np.sqrt(width),
        bias=normal((channels,), jnp.float32) if full else None,
        initial_state=normal(s_shape, dtype) if full else None,
        seq_idx=seq_idx,
        dy=normal(x_shape, dtype),
        dfinal_state=normal(s_shape, dtype) if full else None,
    )


def fwd_bwd(full, layout, x, weight, bias, initial_state, seq_idx, dy, dfinal_state):
    def f(x, weight, bias, initial_state):
        return jcc.causal_conv1d(x, weight, bias, activation="silu" if full else None,
                                 initial_state=initial_state, seq_idx=seq_idx,
                                 return_final_state=full, layout=layout)

    out, pull = jax.vjp(f, x, weight, bias, initial_state)
    y, final = out if full else (out, None)
    grads = pull((dy, dfinal_state) if full else dy)
    return dict(zip(NAMES, (y, final, *grads)))


def bits(a):
    return lax.bitcast_convert_type(a, UNSIGNED[a.dtype.itemsize])


@jax.jit
def count_mismatches(first, out, counts, runs_differing):
    """counts[i] += 1 where output i differs in any bit from the first run; runs_differing += any."""
    differs = jnp.stack([jnp.any(bits(first[n]) != bits(out[n])) for n in sorted(first)])
    return counts + differs.astype(jnp.int32), runs_differing + jnp.any(differs).astype(jnp.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes and N=5 (any device, CI)")
    parser.add_argument("--runs", type=int, default=None, help="runs per case (default 1000, smoke 5)")
    args = parser.parse_args()
    runs = args.runs or (5 if args.smoke else 1000)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}); runs={runs}")
    rng = np.random.default_rng(0)
    failed = []
    for name, batch, length, channels, width, layout, full in cases(args.smoke):
        inputs = make_inputs(rng, batch, length, channels, width, layout, full)
        run = jax.jit(partial(fwd_bwd, full, layout))
        first = {n: a for n, a in run(**inputs).items() if a is not None}
        jax.block_until_ready(first)  # compile outside the timing
        counts = jnp.zeros(len(first), jnp.int32)
        runs_differing = jnp.zeros((), jnp.int32)
        t0 = time.perf_counter()
        for _ in range(runs - 1):
            out = {n: a for n, a in run(**inputs).items() if a is not None}
            counts, runs_differing = count_mismatches(first, out, counts, runs_differing)
        counts, runs_differing = np.asarray(counts), int(runs_differing)  # waits for every run
        seconds = time.perf_counter() - t0
        per_output = " ".join(f"{n}={c}" for n, c in zip(sorted(first), counts))
        what = (f"{name:12s} {layout} B={batch} L={length} D={channels} K={width} bfloat16: "
                f"{runs} runs, {runs_differing} differ from run 0 ({per_output})")
        print(f"{what} {'ok' if runs_differing == 0 else 'FAIL'} {seconds:.2f} s", flush=True)
        if runs_differing:
            failed.append(f"{name}/{layout}")
    print(f"determinism: {'FAILED ' + ' '.join(failed) if failed else 'all bitwise identical'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
