"""Forward, backward and decode steps on a few shapes, for compute-sanitizer (memcheck, racecheck).

Covers both layouts, seq_idx cases with padding (one boundary, or many so that kernels which skip
the boundary tests inside a segment take both paths), an L < K-1 case with states, a long
generic-K case, channel-first rows long and many enough for the backward's edge-free segments,
short channel-first rows of a few packs, rows of two segments through the masked channel-first
kernels' seq_idx check shared by a block's warps, the bfloat16 channel-first backward on tensor
cores (calls without states), decode steps of the one-token kernel (channel-last,
channel-first with and without the shared-memory staging, ring mode, a pool with padding rows,
grids of several blocks with threads past the channels and rows) and of the generic one (several
tokens, states longer than K - 1, a width past the compiled ones), the channel-first backward's
cluster sums (clusters of two and eight blocks, and one block's items, which take no cluster), and
checks each result against the float64 reference (on the host) so a wrong answer also fails the
run. Each printed line starts with the case's index; `--start N` runs the cases from index N on
(scripts/gpu_check.sh resumes with it after a sanitizer crash), `--stop N` those before index N.
"""

import argparse
from functools import partial
from typing import Any, NamedTuple

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_causal_conv as jcc  # noqa: E402

CASES = [
    # batch, length, channels, width, layout, dtype, segments of seq_idx (0: none), states: True
    # (an initial state, and the final state's cotangent), False (the final state's only) or None
    # (neither: the tensor-core backward takes only such calls, and short channel-first rows
    # without seq_idx take kernels of their own)
    (2, 200, 70, 4, "BLD", jnp.float32, 0, True),
    (2, 200, 70, 4, "BDL", jnp.bfloat16, 0, True),
    (3, 130, 33, 3, "BLD", jnp.float16, 2, True),
    (2, 2, 40, 8, "BDL", jnp.float32, 0, True),    # L < K-1: F holds entries of S
    (1, 100, 17, 17, "BLD", jnp.float64, 2, False),  # generic-width path
    # vectorized paths: K <= 4 and D (BLD) or L (BDL) a multiple of the 16-byte pack
    (2, 200, 64, 4, "BLD", jnp.bfloat16, 2, True),
    (2, 136, 64, 2, "BLD", jnp.float32, 0, True),
    (2, 2, 64, 4, "BLD", jnp.float32, 0, True),      # L < K-1
    (3, 264, 16, 3, "BDL", jnp.float16, 2, True),
    (2, 520, 8, 4, "BDL", jnp.float64, 0, True),
    # channel-first rows many enough that the backward splits them into pieces of several
    # segments, whose inner segments take its copy of the segment without edge tests
    (1, 4096, 2048, 4, "BDL", jnp.bfloat16, 0, True),
    (1, 4096, 2048, 3, "BDL", jnp.bfloat16, 2, True),
    (1, 2048, 2048, 4, "BDL", jnp.float32, 2, False),
    # many boundaries: steps inside a segment and steps whose windows cross one
    (2, 1000, 64, 4, "BLD", jnp.bfloat16, 9, True),
    (2, 600, 128, 3, "BLD", jnp.float32, 7, True),
    (1, 4096, 512, 4, "BDL", jnp.bfloat16, 12, True),
    # channel-last backward blocks whose warps share a run of 32 packs over 4 tiles and sum dw/db
    # in shared memory: whole groups of tiles, and a last group of 3 tiles with seq_idx
    (2, 1024, 256, 4, "BLD", jnp.bfloat16, 0, True),
    (1, 600, 512, 3, "BLD", jnp.float16, 3, False),
    # 16-bit channel-last backward at K >= 5, which reads the next step's rows one step early
    (2, 1000, 256, 6, "BLD", jnp.bfloat16, 3, True),
    # short channel-first rows: a few packs each, several rows per warp
    (64, 128, 256, 4, "BDL", jnp.bfloat16, 0, True),
    (40, 24, 36, 4, "BDL", jnp.float32, 3, True),
    (8, 256, 64, 8, "BDL", jnp.float16, 4, False),
    # K = 7-8: the channel-first backward's interior segments in pairs and K = 8's sums as 8 + 1,
    # the masked 16-bit channel-first forward's half-warp rows, the channel-last forward's long
    # pieces and the masked channel-last backward's final-state rows by cp.async
    (1, 4096, 512, 8, "BDL", jnp.bfloat16, 0, True),
    (1, 4096, 512, 7, "BDL", jnp.float16, 3, True),
    (2, 1000, 256, 8, "BLD", jnp.bfloat16, 0, True),
    (2, 1000, 256, 8, "BLD", jnp.bfloat16, 3, True),
    # the bf16 channel-first backward on tensor cores (K = 7-8, neither seq_idx nor states, items
    # of 16 blocks or more where the device holds 4224 of its warps, as an H200): its cp.async
    # ring wrapping in whole rows with a partial last block, and rows cut into items
    (8, 2056, 1024, 8, "BDL", jnp.bfloat16, 0, None),
    (2, 8320, 512, 7, "BDL", jnp.bfloat16, 0, None),
    # the masked channel-first kernels' seq_idx check shared by a block's 4 warps (whole rows of
    # one batch row) in rows of 2 segments: warps 2 and 3 have no ballot, and the last batch row's
    # would lie past seq_idx
    (3, 264, 64, 4, "BDL", jnp.bfloat16, 2, True),
    # short channel-first rows without seq_idx or states, lanes past the rows' ends (bf16 L = 136:
    # 15 of 32, float32 L = 24: 2 of 8) and channels (36 rows in blocks of 32 and of 4)
    (7, 136, 12, 5, "BDL", jnp.bfloat16, 0, None),
    (40, 24, 36, 4, "BDL", jnp.float32, 0, None),
    (64, 128, 256, 4, "BDL", jnp.bfloat16, 0, None),
    # more channel blocks (4096 of 2 rows) than the device holds warps: one run of batch rows
    (5, 128, 8192, 4, "BDL", jnp.bfloat16, 0, None),
    # the masked 16-bit channel-first backward at K = 4-5: a quarter-warp a row, in segments of 8
    # packs, and rows of at most 32 segments (2040: 31 and 7 packs) one item
    (2, 2040, 256, 5, "BDL", jnp.float16, 3, True),
    # the channel-first backward's cluster sums (no seq_idx; grids that fill an H100 or H200):
    # clusters of two blocks and of eight (201 channels: the last item's second half-warp repeats
    # its channel), and one block's items, which must take the plain kernel and the reduction
    # (st.async needs a cluster of two blocks); the tensor-core kernel's clusters of eight and
    # its one block's items
    (8, 256, 1024, 4, "BDL", jnp.bfloat16, 0, True),
    (32, 256, 201, 8, "BDL", jnp.float16, 0, False),
    (4, 256, 2048, 2, "BDL", jnp.float32, 0, None),
    (32, 2048, 256, 8, "BDL", jnp.bfloat16, 0, None),
    (4, 2048, 2048, 7, "BDL", jnp.bfloat16, 0, None),
]


class UpdateCase(NamedTuple):
    batch: int
    channels: int
    width: int
    layout: str
    dtype: Any
    ring: bool  # ring mode (cache_seqlens), else shift mode
    pool: int  # state pool rows (state_indices), 0: none
    tokens: int = 0  # 0: one token, x (B, D); else x (B, T, D) or (B, D, T)
    state_len: int = 0  # 0: width - 1


UPDATE_CASES = [UpdateCase(*case) for case in [
    (7, 512, 4, "BDL", jnp.bfloat16, False, 0),  # staged: channel vectors a multiple of 32
    (7, 512, 8, "BDL", jnp.float32, False, 9),
    (5, 48, 4, "BDL", jnp.bfloat16, False, 0),   # not staged: 6 vectors
    (5, 48, 3, "BLD", jnp.float16, True, 9),
    (3, 20, 4, "BDL", jnp.float32, True, 0),     # channel-first ring: one channel a thread
    (3, 24, 12, "BLD", jnp.bfloat16, False, 0),  # generic kernel: width past the compiled ones
    (37, 48, 4, "BLD", jnp.bfloat16, False, 0),  # grid: threads past the vectors and the tiles
    (5, 4096, 4, "BDL", jnp.bfloat16, False, 0),  # grid: staged, two blocks along x, three along y
    # more rows than one wave of blocks holds: threads walk several rows, two in flight
    (600, 4096, 4, "BDL", jnp.bfloat16, False, 0),    # staged, no pool (the direct kernel)
    (600, 4096, 4, "BDL", jnp.bfloat16, False, 700),  # staged through the pool lookup
    (600, 4096, 4, "BLD", jnp.bfloat16, True, 700),   # channel-last ring through the pool
    # the generic kernel (Update::run): several tokens, or a state longer than K - 1
    (6, 96, 4, "BLD", jnp.bfloat16, False, 0, 5, 3),
    (4, 80, 4, "BDL", jnp.float32, True, 0, 16, 7),
    (5, 40, 3, "BLD", jnp.float16, True, 7, 3, 6),
    (3, 64, 8, "BDL", jnp.bfloat16, False, 9, 1, 12),
    (2, 32, 11, "BLD", jnp.float32, True, 0, 4, 10),  # a width past the compiled ones
]]


def check_update(index):
    """One decode step of UPDATE_CASES[index]: y and the new state against the reference."""
    batch, channels, width, layout, dtype, ring, pool, tokens, state_len = UPDATE_CASES[index]
    rng = np.random.default_rng(100 + index)
    rows = pool or batch
    state_len = state_len or width - 1
    s_shape = (rows, state_len, channels) if layout == "BLD" else (rows, channels, state_len)
    x_shape = (batch, channels)
    if tokens:
        x_shape = (batch, tokens, channels) if layout == "BLD" else (batch, channels, tokens)
    x = jnp.asarray(rng.standard_normal(x_shape), dtype)
    state = jnp.asarray(rng.standard_normal(s_shape), dtype)
    w = jnp.asarray(rng.standard_normal((channels, width)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(channels), jnp.float32)
    kwargs = dict(activation="silu", layout=layout)
    if ring:
        kwargs["cache_seqlens"] = jnp.asarray(rng.integers(0, 3 * width, batch), jnp.int32)
    if pool:
        indices = rng.permutation(pool + 1)[:batch] - 1  # -1 and pool: padding rows
        kwargs["state_indices"] = jnp.asarray(indices, jnp.int32)
    y, new_state = jax.jit(lambda *a: jcc.causal_conv1d_update(*a, **kwargs))(x, state, w, b)
    f64 = [jnp.asarray(a, jnp.float64) for a in (x, state, w, b)]
    y_ref, _ = jcc.reference.causal_conv1d_update(*f64, **kwargs)
    _, state_ref = jcc.reference.causal_conv1d_update(x, state, w, b, **kwargs)
    err = jcc.reference.relative_error(y, y_ref)
    tol = jcc.reference.TOLERANCE[jnp.dtype(dtype)]
    same_state = bool(np.array_equal(np.asarray(new_state), np.asarray(state_ref)))
    status = "ok" if err <= tol * 10 and same_state else "MISMATCH"
    print(len(CASES) + index, "update", batch, channels, width, layout, jnp.dtype(dtype).name,
          "ring" if ring else "shift", pool, f"tokens={tokens or 1} state={state_len}",
          "%.1e" % err, "state equal" if same_state else "state differs", status, flush=True)
    if status != "ok":
        raise SystemExit(1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start", type=int, default=0,
                        help="index of the first case to run (to resume after a sanitizer crash)")
    parser.add_argument("--stop", type=int, default=None,
                        help="index past the last case to run (default: all)")
    args = parser.parse_args(argv)
    total = len(CASES) + len(UPDATE_CASES)
    stop = total if args.stop is None else args.stop
    if not 0 <= args.start <= total:
        parser.error(f"--start must be in [0, {total}], got {args.start}")
    if not args.start <= stop <= total:
        parser.error(f"--stop must be in [{args.start}, {total}], got {stop}")
    print(f"cases {args.start} to {stop - 1} of {total} cases", flush=True)
    for index in range(args.start, min(stop, len(CASES))):
        batch, length, channels, width, layout, dtype, segments, states = CASES[index]
        with_state, with_final = bool(states), states is not None
        # Per case, so that a resumed run gives each case the inputs of a whole run.
        rng = np.random.default_rng(index)
        x_shape = (batch, length, channels) if layout == "BLD" else (batch, channels, length)
        s_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
        x = jnp.asarray(rng.standard_normal(x_shape), dtype)
        w = jnp.asarray(rng.standard_normal((channels, width)), jnp.float32)
        b = jnp.asarray(rng.standard_normal(channels), jnp.float32)
        s = jnp.asarray(rng.standard_normal(s_shape), dtype) if with_state else None
        seq = None
        if segments:
            ids = np.broadcast_to(np.arange(length) * segments // length, (batch, length))
            ids = ids.astype(np.int32)
            ids[:, length - 5:] = -1
            seq = jnp.asarray(ids)

        def loss(f, seq, x, w, b, s):
            out = f(x, w, b, activation="silu", initial_state=s, seq_idx=seq,
                    return_final_state=with_final, layout=layout)
            if not with_final:
                return jnp.sum(out.astype(jnp.float64) ** 2)
            y, final = out
            return jnp.sum(y.astype(jnp.float64) ** 2) + jnp.sum(final.astype(jnp.float64))

        inputs = (x, w, b, s)
        argnums = (1, 2, 3, 4) if with_state else (1, 2, 3)
        grads = jax.jit(jax.grad(partial(loss, jcc.causal_conv1d), argnums=argnums))(seq, *inputs)
        # The float64 reference and the errors on the host: on the device, with the reference's
        # op-by-op intermediates (K shifted copies of x), an H100 under memcheck ran out of
        # memory at case 38 (tests/GPU.md, sixty-fifth session).
        with jax.default_device(jax.devices("cpu")[0]):
            f64 = [None if a is None else jnp.asarray(np.asarray(a), jnp.float64) for a in inputs]
            seq_on_host = None if seq is None else jnp.asarray(np.asarray(seq))
            ref = jax.grad(partial(loss, jcc.reference.causal_conv1d), argnums=argnums)(
                seq_on_host, *f64)
        errs = [jcc.reference.relative_error(g, r) for g, r in zip(grads, ref)]
        tol = jcc.reference.TOLERANCE[jnp.dtype(dtype)]
        # Low-precision x rounds y before the loss, so allow the dtype's tolerance only.
        status = "ok" if max(errs) <= max(tol, 1e-5) * 10 else "MISMATCH"
        print(index, batch, length, channels, width, layout, jnp.dtype(dtype).name, segments,
              states, ["%.1e" % e for e in errs], status, flush=True)
        if status != "ok":
            raise SystemExit(1)
    for index in range(max(args.start - len(CASES), 0), max(stop - len(CASES), 0)):
        check_update(index)


if __name__ == "__main__":
    main()
