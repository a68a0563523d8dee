"""Values no trace-time check can see, for compute-sanitizer (memcheck) on the GPU (issue 7 item 3).

Forward and backward with seq_idx ids in any order (decreasing, sparse, reappearing, int32
extremes, all padding), causal_conv1d_update with state_indices and cache_seqlens anywhere in
int32 (shift and ring modes, vectorizable and generic widths), and causal_conv1d_varlen with
cu_seqlens out of order, negative and past T. Each result is checked against the float64
reference, so a wrong answer fails the run as well as an out-of-bounds access.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_unvalidated.py [conv] [update] [varlen]
"""

import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_causal_conv as jcc  # noqa: E402
from jax_causal_conv import reference  # noqa: E402

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
failures = []


def report(what, got, want, tol, exact=False):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if exact:
        ok = np.array_equal(got, want, equal_nan=True)
        err = 0.0 if ok else float("inf")
    else:
        err = reference.relative_error(got, want)
        ok = err <= tol
    print(f"{what}: {'ok' if ok else 'MISMATCH'} ({err:.1e})")
    if not ok:
        failures.append(what)


def seq_patterns(batch, length, rng):
    rows = {
        "decreasing": np.repeat(np.arange(4)[::-1], -(-length // 4))[:length],
        "sparse": np.repeat([3, 1000, 2**30, I32_MAX], -(-length // 4))[:length],
        "reappearing": rng.integers(-1, 3, length),
        "padding_runs": np.where(np.arange(length) % 7 < 2, I32_MIN, np.arange(length) // 9),
        "all_padding": np.full(length, -1),
    }
    names = list(rows)
    return {n: np.stack([rows[names[(i + b) % len(names)]] for b in range(batch)]).astype(np.int32)
            for i, n in enumerate(names)}


def conv_cases(rng):
    # batch, length, channels, width, layout, dtype: vectorized (K <= 4, D or L a multiple of the
    # pack) and generic paths, tile tails, L < K-1.
    for batch, length, channels, width, layout, dtype in [
        (3, 200, 64, 4, "BLD", jnp.bfloat16),
        (2, 136, 16, 3, "BDL", jnp.float32),
        (3, 130, 33, 5, "BLD", jnp.float16),
        (2, 2, 8, 6, "BDL", jnp.float64),
    ]:
        for name, ids in seq_patterns(batch, length, rng).items():
            x_shape = (batch, length, channels) if layout == "BLD" else (batch, channels, length)
            s_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
            acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
            args = (jnp.asarray(rng.standard_normal(x_shape), dtype),
                    jnp.asarray(rng.standard_normal((channels, width)), acc),
                    jnp.asarray(rng.standard_normal(channels), acc),
                    jnp.asarray(rng.standard_normal(s_shape), dtype))
            cot = (jnp.asarray(rng.standard_normal(x_shape), dtype),
                   jnp.asarray(rng.standard_normal(s_shape), dtype))
            seq_idx = jnp.asarray(ids)

            def vjp(fn, x, w, b, s, cot):
                out, pull = jax.vjp(
                    lambda x, w, b, s: fn(x, w, b, activation="silu", initial_state=s,
                                          seq_idx=seq_idx, return_final_state=True, layout=layout),
                    x, w, b, s)
                return out, pull(cot)

            got = jax.jit(lambda *a: vjp(jcc.causal_conv1d, *a))(*args, cot)
            want = vjp(reference.causal_conv1d,
                       *[jnp.asarray(a, jnp.float64) for a in args],
                       tuple(jnp.asarray(c, jnp.float64) for c in cot))
            for i, (g, r) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
                report(f"conv {layout} K={width} {jnp.dtype(dtype).name} {name} [{i}]", g, r,
                       reference.TOLERANCE[jnp.dtype(dtype)])


def update_cases(rng):
    for batch, tokens, channels, width, slots, pool, layout, dtype in [
        (8, 1, 64, 4, 3, 5, "BLD", jnp.bfloat16),
        (8, 3, 16, 3, 7, 4, "BDL", jnp.float32),
        (8, 2, 33, 9, 10, 6, "BLD", jnp.float16),
    ]:
        indices = np.asarray([I32_MIN, -1, 0, pool - 1, pool, I32_MAX, 1, 2], np.int32)
        for mode, cache in [
            ("shift", None),
            ("ring", np.asarray([0, 3, slots + 2, I32_MAX - tokens + 1, I32_MIN, -5, 10**9, 1], np.int32)),
        ]:
            x_shape = (batch, tokens, channels) if layout == "BLD" else (batch, channels, tokens)
            s_shape = (pool, slots, channels) if layout == "BLD" else (pool, channels, slots)
            x = jnp.asarray(rng.standard_normal(x_shape), dtype)
            state = jnp.asarray(rng.standard_normal(s_shape), dtype)
            w = jnp.asarray(rng.standard_normal((channels, width)), jnp.float32)
            kwargs = dict(activation="silu", layout=layout, state_indices=jnp.asarray(indices),
                          cache_seqlens=None if cache is None else jnp.asarray(cache))
            y, new_state = jax.jit(lambda x, s, w: jcc.causal_conv1d_update(x, s, w, **kwargs))(x, state, w)
            y_ref, _ = reference.causal_conv1d_update(
                jnp.asarray(x, jnp.float64), jnp.asarray(state, jnp.float64), w, **kwargs)
            _, state_ref = reference.causal_conv1d_update(x, state, w, **kwargs)
            what = f"update {mode} {layout} K={width} {jnp.dtype(dtype).name}"
            report(what + " y", y, y_ref, reference.TOLERANCE[jnp.dtype(dtype)])
            report(what + " state", new_state, state_ref, 0, exact=True)


def varlen_cases(rng):
    T, D, K = 50, 16, 4
    for cu in ([0, 20, 10, 45], [-7, 12, 60, 70], [50, 3, 0, 2], [5, 5, 49, 50]):
        cu = jnp.asarray(cu, jnp.int32)
        N = cu.shape[0] - 1
        args = (jnp.asarray(rng.standard_normal((T, D)), jnp.float32),
                jnp.asarray(rng.standard_normal((D, K)), jnp.float32),
                jnp.asarray(rng.standard_normal(D), jnp.float32),
                jnp.asarray(rng.standard_normal((N, K - 1, D)), jnp.float32))
        cot = (jnp.asarray(rng.standard_normal((T, D)), jnp.float32),
               jnp.asarray(rng.standard_normal((N, K - 1, D)), jnp.float32))

        def vjp(fn, x, w, b, s, cot):
            out, pull = jax.vjp(
                lambda x, w, b, s: fn(x, w, b, cu_seqlens=cu, activation="silu", initial_states=s,
                                      return_final_states=True), x, w, b, s)
            return out, pull(cot)

        got = jax.jit(lambda *a: vjp(jcc.causal_conv1d_varlen, *a))(*args, cot)
        want = vjp(reference.causal_conv1d_varlen, *[jnp.asarray(a, jnp.float64) for a in args],
                   tuple(jnp.asarray(c, jnp.float64) for c in cot))
        for i, (g, r) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            report(f"varlen cu={np.asarray(cu).tolist()} [{i}]", g, r,
                   reference.TOLERANCE[jnp.dtype(jnp.float32)])


SECTIONS = {"conv": conv_cases, "update": update_cases, "varlen": varlen_cases}


def main():
    # Sections by name (all by default): one sanitizer process per section keeps a crash of the
    # sanitizer itself from hiding the sections after it.
    names = sys.argv[1:] or list(SECTIONS)
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    print("devices:", jax.devices())
    rng = np.random.default_rng(0)
    for name in names:
        SECTIONS[name](rng)
    print(f"{len(failures)} mismatches")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
