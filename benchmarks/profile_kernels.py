"""Runs the main workload's forward and backward (or another shape's) once each, for a profiler.

    ncu --clock-control none --kernel-name regex:"forward|backward|reduce" \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 benchmarks/profile_kernels.py --layout BLD

Compilation and warm-up happen before the profiled calls are made, so each of our kernels shows
up once per call in the profiler's output.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_causal_conv as jcc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="BLD", choices=("BLD", "BDL"))
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--shape", default="8,2048,4096", help="batch,length,channels")
    args = parser.parse_args()
    batch, length, channels = (int(n) for n in args.shape.split(","))
    rng = np.random.default_rng(0)
    shape = (batch, length, channels) if args.layout == "BLD" else (batch, channels, length)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((channels, args.width)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(channels), jnp.float32)

    def fwd(x, w, b):
        return jcc.causal_conv1d(x, w, b, activation="silu", layout=args.layout)

    def bwd(x, w, b, dy):
        return jax.vjp(fwd, x, w, b)[1](dy)

    fwd_jit, bwd_jit = jax.jit(fwd), jax.jit(bwd)
    jax.block_until_ready(fwd_jit(x, w, b))
    jax.block_until_ready(bwd_jit(x, w, b, dy))
    jax.block_until_ready(fwd_jit(x, w, b))
    jax.block_until_ready(bwd_jit(x, w, b, dy))


if __name__ == "__main__":
    main()
