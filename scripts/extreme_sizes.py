"""Extreme sizes (issue 7 item 4): causal_conv1d forward and backward against the reference.

Cases: B*L*D past 2**31 elements (vectorized channel-last, vectorized channel-first and the
generic-width path), D = 131072, L = 2**20 with B = 1, B = 4096 with L = 1 (L < K-1, so the
initial state feeds every output and the final state) and K = 256.

Each case runs the kernels once (jit of jax.vjp) and checks y, the final state and every
gradient over the whole output, not samples: the float64 reference runs chunk by chunk (a block
of batch rows times a block of channels, over the full time axis with the real initial state, so
each chunk is an exact sub-problem), our outputs are sliced the same way on the device, and the
chunks' squared errors add up to ||out - ref|| / ||ref|| of the full arrays. dweight and dbias
sum the chunks' reference gradients over the batch blocks and are compared at the end.

    python3 scripts/extreme_sizes.py           # H200: about 30 GB peak, --budget caps the time
    python3 scripts/extreme_sizes.py --smoke   # the same cases with tiny sizes, any device

One line per case; exit status 1 if any case fails (a wrong result or an exception).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

# The tolerances and seq_idx generator of the tests (DESIGN.md section 5).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TOLERANCE, random_seq_idx  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jax_causal_conv as jcc  # noqa: E402
from jax_causal_conv import reference  # noqa: E402

ELEMENTWISE = ("y", "final_state", "dx", "dinitial_state")
REDUCED = ("dweight", "dbias")


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    length: int
    channels: int
    width: int
    layout: str = "BLD"
    dtype: type = jnp.bfloat16
    bias: bool = True
    silu: bool = True
    state: bool = True  # initial_state and return_final_state
    seq_idx: bool = False

    def x_shape(self, rows: Optional[int] = None, channels: Optional[int] = None):
        b, d = rows or self.batch, channels or self.channels
        return (b, self.length, d) if self.layout == "BLD" else (b, d, self.length)

    def state_shape(self):
        p = self.width - 1
        return (self.batch, p, self.channels) if self.layout == "BLD" else (self.batch, self.channels, p)

    @property
    def elements(self) -> int:
        return self.batch * self.length * self.channels


def cases(smoke: bool) -> list[Case]:
    big = 2**20
    if smoke:
        # Same structure as the full cases (multiples of the 16-byte pack or not, tails, K),
        # small enough for a CPU.
        return [
            Case("over_2^31_BLD_vec", 2, 64 + 5, 24, 4, seq_idx=True),
            Case("over_2^31_BDL_vec", 2, 64 + 8, 24, 4, layout="BDL", seq_idx=True),
            Case("over_2^31_BLD_generic", 2, 64 + 5, 26, 5),
            Case("D=131072_BLD", 2, 16, 256, 4, seq_idx=True),
            Case("D=131072_BDL", 2, 16, 256, 4, layout="BDL"),
            Case("L=2^20_plain", 1, 1024, 8, 4, bias=False, silu=False, state=False),
            Case("L=2^20_BLD", 1, 1024, 8, 4, seq_idx=True),
            Case("L=2^20_BDL", 1, 1024, 8, 4, layout="BDL", seq_idx=True),
            Case("B=4096_L=1_BLD", 64, 1, 16, 4),
            Case("B=4096_L=1_BDL", 64, 1, 16, 4, layout="BDL"),
            Case("K=256_BLD", 2, 300, 8, 256, dtype=jnp.float32),
        ]
    return [
        # 2 * (2**20 + 5) * 1088 = 1.0625 * 2**31 elements, 4.6 GB per bf16 tensor; D a multiple
        # of the bf16 pack: vectorized channel-last kernels.
        Case("over_2^31_BLD_vec", 2, big + 5, 1088, 4, seq_idx=True),
        # L a multiple of the pack: vectorized channel-first kernels.
        Case("over_2^31_BDL_vec", 2, big + 8, 1088, 4, layout="BDL", seq_idx=True),
        # K = 5 and D not a multiple of the pack: generic element and tile kernels.
        Case("over_2^31_BLD_generic", 2, big + 5, 1090, 5),
        Case("D=131072_BLD", 2, 64, 131072, 4, seq_idx=True),
        Case("D=131072_BDL", 2, 64, 131072, 4, layout="BDL"),
        Case("L=2^20_plain", 1, big, 64, 4, bias=False, silu=False, state=False),
        Case("L=2^20_BLD", 1, big, 64, 4, seq_idx=True),
        Case("L=2^20_BDL", 1, big, 64, 4, layout="BDL", seq_idx=True),
        Case("B=4096_L=1_BLD", 4096, 1, 256, 4),
        Case("B=4096_L=1_BDL", 4096, 1, 256, 4, layout="BDL"),
        # Last: the float64 reference unrolls 256 taps (and their transposes), the slowest compile.
        Case("K=256_BLD", 2, 4096, 64, 256, dtype=jnp.float32),
    ]


@partial(jax.jit, static_argnames=("shape", "dtype", "piece"))
def normal(key, shape: tuple, dtype, piece: int):
    """Standard normal samples, drawn `piece` at a time.

    A single draw of a few 2**31 elements would keep about 16 bytes of random-bit temporaries per
    element alive at once; a loop of pieces bounds them to one piece.
    """
    count = math.prod(shape)
    size = min(piece, count)
    pieces = -(-count // size)
    blocks = lax.map(lambda k: jax.random.normal(k, (size,), dtype), jax.random.split(key, pieces))
    return blocks.reshape(-1)[:count].reshape(shape)


def make_inputs(case: Case, seed: int, piece: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 6)
    rng = np.random.default_rng(seed)
    D, K = case.channels, case.width
    return dict(
        x=normal(keys[0], case.x_shape(), case.dtype, piece),
        weight=jax.random.normal(keys[1], (D, K), jnp.float32) / np.sqrt(K),
        bias=jax.random.normal(keys[2], (D,), jnp.float32) if case.bias else None,
        initial_state=normal(keys[3], case.state_shape(), case.dtype, piece) if case.state else None,
        seq_idx=jnp.asarray(random_seq_idx(rng, case.batch, case.length)) if case.seq_idx else None,
        dy=normal(keys[4], case.x_shape(), case.dtype, piece),
        dfinal_state=normal(keys[5], case.state_shape(), case.dtype, piece) if case.state else None,
    )


def conv_vjp(fn, case: Case, x, weight, bias, initial_state, seq_idx, dy, dfinal_state) -> dict:
    """y, final state and all gradients of `fn` (the kernels or the reference) for `case`."""

    def f(x, weight, bias, initial_state):
        return fn(x, weight, bias, activation="silu" if case.silu else None,
                  initial_state=initial_state, seq_idx=seq_idx,
                  return_final_state=case.state, layout=case.layout)

    out, pull = jax.vjp(f, x, weight, bias, initial_state)
    y, final = out if case.state else (out, None)
    dx, dw, db, ds = pull((dy, dfinal_state) if case.state else dy)
    return dict(y=y, final_state=final, dx=dx, dweight=dw, dbias=db, dinitial_state=ds)


def largest_divisor(n: int, unit: int, limit: int) -> int:
    """The largest divisor d of n with d * unit <= limit (1 if none)."""
    return max([d for d in range(1, n + 1) if n % d == 0 and d * unit <= limit], default=1)


def take(a, case: Case, b0, c0, rows: int, channels: int):
    """Rows [b0, b0+rows) and channels [c0, c0+channels) of a (B, *, D) / (B, D, *) array."""
    if a is None:
        return None
    channel_axis = 2 if case.layout == "BLD" else 1
    starts = [b0, 0, 0]
    sizes = [rows, *a.shape[1:]]
    starts[channel_axis], sizes[channel_axis] = c0, channels
    return lax.dynamic_slice(a, starts, sizes)


def chunk_step(case: Case, rows: int, channels: int, acc: dict, inputs: dict, got: dict, b0, c0):
    """Adds one chunk's squared errors and reference dweight/dbias to `acc`."""
    f64 = lambda a: None if a is None else a.astype(jnp.float64)  # noqa: E731
    sliced = {k: take(v, case, b0, c0, rows, channels)
              for k, v in inputs.items() if k not in ("weight", "bias", "seq_idx")}
    weight = lax.dynamic_slice(inputs["weight"], (c0, 0), (channels, case.width))
    bias = None if inputs["bias"] is None else lax.dynamic_slice(inputs["bias"], (c0,), (channels,))
    seq_idx = None if inputs["seq_idx"] is None else lax.dynamic_slice(
        inputs["seq_idx"], (b0, 0), (rows, case.length))
    ref = conv_vjp(reference.causal_conv1d, case, f64(sliced["x"]), f64(weight), f64(bias),
                   f64(sliced["initial_state"]), seq_idx, f64(sliced["dy"]),
                   f64(sliced["dfinal_state"]))
    acc = dict(acc)
    for name in ELEMENTWISE:
        if got[name] is None:
            continue
        ours = f64(take(got[name], case, b0, c0, rows, channels))
        acc[name] = acc[name] + jnp.stack([jnp.sum((ours - ref[name]) ** 2), jnp.sum(ref[name] ** 2)])
    for name in REDUCED:
        if got[name] is None:
            continue
        start = (c0,) + (0,) * (ref[name].ndim - 1)
        total = lax.dynamic_slice(acc[name], start, ref[name].shape) + ref[name]
        acc[name] = lax.dynamic_update_slice(acc[name], total, start)
    return acc


def relative(diff2, ref2) -> float:
    """||out - ref|| / ||ref|| from the sums of squares; NaN anywhere gives inf."""
    err = float(np.sqrt(diff2) / np.sqrt(ref2)) if ref2 > 0 else float(np.sqrt(diff2))
    return err if np.isfinite(err) else float("inf")


def run_case(case: Case, seed: int, chunk_elements: int, piece: int) -> tuple[dict, float, float]:
    """Relative error per output, the tolerance, and the seconds until the kernels' results."""
    t0 = time.perf_counter()
    inputs = make_inputs(case, seed, piece)
    got = jax.jit(partial(conv_vjp, jcc.causal_conv1d, case))(**inputs)
    jax.block_until_ready(got)
    kernel_seconds = time.perf_counter() - t0

    # Chunks: as many channels as fit with the full time axis, then as many batch rows.
    channels = largest_divisor(case.channels, case.length, chunk_elements)
    rows = largest_divisor(case.batch, case.length * channels, chunk_elements)
    acc = {n: jnp.zeros(2, jnp.float64) for n in ELEMENTWISE if got[n] is not None}
    acc.update({n: jnp.zeros(got[n].shape, jnp.float64) for n in REDUCED if got[n] is not None})
    step = jax.jit(partial(chunk_step, case, rows, channels))
    for b0 in range(0, case.batch, rows):
        for c0 in range(0, case.channels, channels):
            acc = step(acc, inputs, got, b0, c0)

    errors = {}
    for name in ELEMENTWISE:
        if name in acc:
            errors[name] = relative(*np.asarray(acc[name]))
    for name in REDUCED:
        if name in acc:
            ours = np.asarray(got[name], np.float64)
            want = np.asarray(acc[name])
            errors[name] = relative(np.sum((ours - want) ** 2), np.sum(want**2))
    return errors, TOLERANCE[jnp.dtype(case.dtype)], kernel_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device, CI)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds after which the remaining cases are not started (they fail)")
    args = parser.parse_args()
    start = time.perf_counter()
    # Smoke sizes force several reference chunks per axis and several random-draw pieces.
    chunk_elements, piece = (2**9, 2**10) if args.smoke else (2**27, 2**26)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}); smoke={args.smoke}")
    failed = []
    for i, case in enumerate(cases(args.smoke)):
        if args.only not in case.name:
            continue
        t0 = time.perf_counter()
        shape = "x".join(map(str, case.x_shape()))
        what = (f"{case.name:22s} {case.layout} {shape:>20s} K={case.width:<3d} "
                f"{jnp.dtype(case.dtype).name:8s} ({case.elements / 2**31:.3f} * 2^31 elements)")
        if t0 - start > args.budget:
            print(f"{what} FAIL not run: past the {args.budget:.0f} s budget", flush=True)
            failed.append(case.name)
            continue
        try:
            errors, tol, kernel_seconds = run_case(case, i, chunk_elements, piece)
        except Exception as exc:  # one failing case must not hide the others
            first_line = (str(exc).splitlines() or [""])[0][:300]
            print(f"{what} FAIL {type(exc).__name__}: {first_line}", flush=True)
            failed.append(case.name)
        else:
            ok = all(e <= tol for e in errors.values())
            errs = " ".join(f"{n}={e:.1e}" for n, e in errors.items())
            print(f"{what} {errs} tol={tol:.0e} {'ok' if ok else 'FAIL'} "
                  f"{time.perf_counter() - t0:.1f} s (inputs + kernels {kernel_seconds:.1f} s)",
                  flush=True)
            if not ok:
                failed.append(case.name)
        jax.clear_caches()
        gc.collect()
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.1f} GiB")
    print(f"extreme sizes: {'FAILED ' + ' '.join(failed) if failed else 'all ok'} "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
