#!/usr/bin/env python3
"""CPU check of issue 6 item 4: our kernels against the jitted reference on the same shapes.

    python3 benchmarks/bench_cpu.py                 # the sweep recorded in RESULTS.md ("## CPU")
    python3 benchmarks/bench_cpu.py --sizes small   # one size only; see --help

For each case (size, dtype, layout, K, with or without seq_idx + initial state + final state) it
times fwd, bwd and fwd+bwd of ``ours`` and ``reference`` (jax_causal_conv.reference under jax.jit)
with bench.py's op definitions and inputs. Calls of the two implementations alternate within each
repetition, so load from other processes on a shared machine hits both alike; each call is timed
to completion and the median over the repetitions is reported, with the ratio ours / reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (bench.py's cases, ops and inputs)

SIZES = {  # name -> (B, L, D)
    "tiny": (2, 64, 32),
    "small": (2, 512, 256),
    "medium": (4, 2048, 512),
    "large": (8, 2048, 2048),
}


def cpu_description() -> str:
    """The CPU's model and the widest vector ISA the kernels' clones use on it (Linux only): the
    x86-64-v4 clones need AVX-512, the v3 ones AVX2 and FMA, and their times differ."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "CPU unknown"
    fields: dict[str, str] = {}  # each key's first value: the first CPU's
    for line in info.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name", "unknown model")
    flags = set(fields.get("flags", "").split())
    isa = ("AVX-512" if "avx512f" in flags else
           "AVX2" if {"avx2", "fma"} <= flags else "no AVX2")
    return f"{model}, {isa}"


def time_pair(fns, args, reps: int, min_time: float):
    """Median seconds per call of each fn, calls alternating within every repetition."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    inner = []
    for fn in fns:  # calls per repetition so that one repetition lasts about min_time
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        inner.append(max(1, int(min_time / max(time.perf_counter() - t0, 1e-7))))
    samples = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(inner[i]):
                out = fn(*args)
                jax.block_until_ready(out)
            samples[i].append((time.perf_counter() - t0) / inner[i])
    return [statistics.median(s) for s in samples]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small,medium,large",
                   help=f"comma-separated sizes from {', '.join(SIZES)}")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--layouts", default="BLD,BDL")
    p.add_argument("--widths", default="2,4,8,17")
    p.add_argument("--features", default="0,1", help="0: plain call, 1: seq_idx + states")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per repetition")
    p.add_argument("--json", default=None, help="write the raw medians here")
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"# {dev.platform} {dev.device_kind} ({cpu_description()}), jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs, "
          f"reps {args.reps}, {args.min_time * 1e3:g} ms per rep; ours from "
          f"{os.path.dirname(bench.jcc.__file__)}", flush=True)
    print("| case | op | ours us | reference us | ours / reference |\n|---|---|---|---|---|")
    rows = []
    for size, dtype, layout, K, feat in itertools.product(
            args.sizes.split(","), args.dtypes.split(","), args.layouts.split(","),
            [int(k) for k in args.widths.split(",")], [f == "1" for f in args.features.split(",")]):
        B, L, D = SIZES[size]
        case = bench.Case(B, L, D, K, dtype=dtype, layout=layout, features=feat)
        inputs = bench.make_inputs(case, 1)[0]
        ops = {impl: bench.make_ops(bench.CONV_FNS[impl], case) for impl in ("ours", "reference")}
        for op in bench.OPS:
            fns = [jax.jit(ops[impl][op]) for impl in ("ours", "reference")]
            ours, ref = time_pair(fns, inputs, args.reps, args.min_time)
            rows.append(dict(size=size, B=B, L=L, D=D, K=K, dtype=dtype, layout=layout,
                             features=feat, op=op, ours_us=ours * 1e6, reference_us=ref * 1e6))
            print(f"| {size} {case.name} | {op} | {ours * 1e6:.1f} | {ref * 1e6:.1f} "
                  f"| {ours / ref:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
