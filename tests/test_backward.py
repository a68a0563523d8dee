"""The fused backward of causal_conv1d against jax.vjp of the float64 reference (issue 3).

Every gradient (dx, dw, db, d initial_state) is compared with the reference's at the DESIGN.md
tolerance, for random cotangents on y and, where asked, on the returned final state. The cases
follow the seed's symptom table: tile tails, silu, tile count, batch size, chunked training,
L < K-1, and packed boundaries near tile edges. Every kernel test runs on the CPU and, under the
`gpu` marker, on the first GPU; the oracle always runs on the CPU in float64.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (DEVICES, DTYPES, TOLERANCE, assert_close, device, make_inputs, relative_error,
                      to_f64)
from jax.test_util import check_grads

from jax_causal_conv import causal_conv1d, reference

TILE = 64  # time rows per block of the CUDA backward; the tile tails are where halos go wrong
GRAD_NAMES = ("x", "weight", "bias", "initial_state")


def time_axis(layout: str) -> int:
    return 1 if layout == "BLD" else 2


def cpu():
    return jax.devices("cpu")[0]


def inputs(rng, dtype, *, batch, length, channels, width, layout, bias=True, state=True,
           seq_idx=None):
    """make_inputs as a dict of differentiable args; weight and bias follow x to float64."""
    made = make_inputs(rng, batch=batch, length=length, channels=channels, width=width, dtype=dtype,
                       layout=layout, bias=bias, initial_state=state)
    if jnp.dtype(dtype) == jnp.float64:
        made["weight"] = made["weight"].astype(jnp.float64)
        made["bias"] = None if made["bias"] is None else made["bias"].astype(jnp.float64)
    args = {name: made[name] for name in GRAD_NAMES}
    return args, None if seq_idx is None else jnp.asarray(seq_idx, jnp.int32)


def apply(fn, args, seq_idx, *, activation, layout, return_final_state):
    return fn(args["x"], args["weight"], args["bias"], activation=activation,
              initial_state=args["initial_state"], seq_idx=seq_idx,
              return_final_state=return_final_state, layout=layout)


def _vjp(fn, args, seq_idx, cotangent, *, activation, layout, return_final_state):
    out, pull = jax.vjp(
        lambda a: apply(fn, a, seq_idx, activation=activation, layout=layout,
                        return_final_state=return_final_state),
        args,
    )
    return out, pull(cotangent)[0]


_STATIC = ("activation", "layout", "return_final_state")
kernel_vjp = jax.jit(partial(_vjp, causal_conv1d), static_argnames=_STATIC)
# The oracle unrolls K taps; a low backend optimization level keeps its compile time (not its
# float64 results) in check.
reference_vjp = jax.jit(partial(_vjp, reference.causal_conv1d), static_argnames=_STATIC,
                        compiler_options={"xla_backend_optimization_level": 0})


def random_cotangent(rng, out, final):
    """Random cotangents in the outputs' dtypes; the final state's is zero for final='zero'."""
    def draw(a):
        return jnp.asarray(rng.standard_normal(a.shape), a.dtype)

    if final == "none":
        return draw(out)
    y, state = out
    return draw(y), draw(state) if final == "random" else jnp.zeros_like(state)


def compare(dev_name, rng, args, seq_idx, dtype, *, activation, layout, final):
    """Runs the kernel's vjp on the device and the reference's on the CPU; asserts they agree.

    Returns (kernel grads, reference grads) as float64 numpy dicts for further checks.
    """
    kw = dict(activation=activation, layout=layout, return_final_state=final != "none")
    dev_args = jax.device_put(args, device(dev_name))
    dev_seq = None if seq_idx is None else jax.device_put(seq_idx, device(dev_name))
    out_shape = jax.eval_shape(lambda a: apply(causal_conv1d, a, seq_idx, **kw), args)
    cotangent = random_cotangent(rng, out_shape, final)
    out, grads = kernel_vjp(dev_args, dev_seq, jax.device_put(cotangent, device(dev_name)), **kw)

    ref_args = jax.device_put(to_f64(args), cpu())
    ref_seq = None if seq_idx is None else jax.device_put(seq_idx, cpu())
    ref_out, ref_grads = reference_vjp(ref_args, ref_seq, jax.device_put(to_f64(cotangent), cpu()),
                                       **kw)

    for name, o, r in zip(("y", "final_state"), jax.tree.leaves(out), jax.tree.leaves(ref_out)):
        assert_close(o, r, dtype, name)
    for name in GRAD_NAMES:
        if args[name] is None:
            assert grads[name] is None
            continue
        assert grads[name].dtype == args[name].dtype, name
        assert grads[name].shape == args[name].shape, name
        assert_close(grads[name], ref_grads[name], dtype, f"d{name}")
    as_np = lambda g: {k: None if v is None else np.asarray(v, np.float64) for k, v in g.items()}
    return as_np(grads), as_np(ref_grads)


# ---- every optional input, both activations, with and without the final state's cotangent ----

@pytest.mark.parametrize("return_final_state", [False, True], ids=["no_final", "final"])
@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", [None, "silu"], ids=["identity", "silu"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_optional_inputs(dev, layout, activation, bias, state, return_final_state):
    rng = np.random.default_rng(1)
    args, _ = inputs(rng, jnp.float32, batch=2, length=130, channels=5, width=4, layout=layout,
                     bias=bias, state=state)
    # A returned final state is checked with a zero and with a random cotangent.
    for final in ("zero", "random") if return_final_state else ("none",):
        compare(dev, rng, args, None, jnp.float32, activation=activation, layout=layout,
                final=final)


# ---- all dtypes and a spread of widths (L a non-multiple of the tile) ----

# (K, L, D): K = 1 has no state at all; K = 64 and 256 have halos of one and four tiles. K = 256
# compiles a slow oracle (about 5 s), so it runs in one layout only.
WIDTHS = [(1, 100, 6), (2, 100, 6), (3, 100, 6), (4, 100, 6), (5, 100, 6), (8, 100, 6),
          (17, 100, 6), (64, 150, 4)]
WIDTH_CASES = [
    pytest.param(layout, *case, id=f"{layout}-K{case[0]}")
    for layout in ("BLD", "BDL") for case in WIDTHS
] + [pytest.param("BLD", 256, 300, 3, id="BLD-K256")]


@pytest.mark.parametrize("layout,width,length,channels", WIDTH_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dev", DEVICES)
def test_dtypes_and_widths(dev, layout, dtype, width, length, channels):
    rng = np.random.default_rng(width)
    args, _ = inputs(rng, dtype, batch=2, length=length, channels=channels, width=width,
                     layout=layout)
    compare(dev, rng, args, None, dtype, activation="silu", layout=layout, final="random")


# ---- dx at the last K-1 positions of every tile (right halo, out-of-range g) ----

def tile_tails(length: int, state_len: int):
    """(tile start, indices of the last P owned times of that tile) for every time tile."""
    for a in range(0, length, TILE):
        end = min(a + TILE, length)
        yield a, np.arange(max(a, end - state_len), end)


TAILS = [(2, 65, "silu"), (4, 127, None), (4, 127, "silu"), (17, 130, "silu"), (17, 1000, None),
         (17, 1000, "silu"), (64, 130, None), (64, 130, "silu")]


@pytest.mark.parametrize("width,length,activation", TAILS,
                         ids=[f"K{k}-L{n}-{a or 'identity'}" for k, n, a in TAILS])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_tile_tails(dev, layout, activation, width, length):
    rng = np.random.default_rng(length + width)
    axis = time_axis(layout)
    # float64 blocks hold 16 channels and float32 ones 32 on the GPU: both tilings are checked.
    for dtype in (jnp.float32, jnp.float64):
        args, _ = inputs(rng, dtype, batch=2, length=length, channels=3, width=width,
                         layout=layout)
        grads, ref = compare(dev, rng, args, None, dtype, activation=activation, layout=layout,
                             final="random")
        for a, tail in tile_tails(length, width - 1):
            err = relative_error(np.take(grads["x"], tail, axis), np.take(ref["x"], tail, axis))
            assert err <= TOLERANCE[jnp.dtype(dtype)], (
                f"{jnp.dtype(dtype).name} dx at the last K-1 times of the tile at t={a}: {err:.3e}"
            )


def test_tile_tails_cover_every_tile():
    tails = dict(tile_tails(130, 16))
    assert sorted(tails) == [0, 64, 128]
    np.testing.assert_array_equal(tails[0], np.arange(48, 64))
    np.testing.assert_array_equal(tails[128], np.arange(128, 130))


# ---- one tile against many tiles: dw and db must not count halo rows twice ----

@pytest.mark.parametrize("length", [40, 700], ids=["one_tile", "many_tiles"])
@pytest.mark.parametrize("width", [4, 17])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_tile_count(dev, layout, dtype, width, length):
    rng = np.random.default_rng(length * width)
    args, _ = inputs(rng, dtype, batch=3, length=length, channels=4, width=width, layout=layout)
    compare(dev, rng, args, None, dtype, activation="silu", layout=layout, final="random")


# ---- batch 1 against batch 7 (global reduction), with more than one channel chunk ----

@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_batch(dev, layout, dtype, batch):
    rng = np.random.default_rng(batch)
    args, _ = inputs(rng, dtype, batch=batch, length=200, channels=40, width=4, layout=layout)
    compare(dev, rng, args, None, dtype, activation="silu", layout=layout, final="random")


# ---- L < K-1: F holds entries of S, and dS receives dF directly ----

SHORT = [(3, 1), (8, 3), (17, 5), (64, 20)]


@pytest.mark.parametrize("width,length", SHORT, ids=[f"K{k}-L{n}" for k, n in SHORT])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.float64],
                         ids=["float32", "float16", "float64"])
@pytest.mark.parametrize("dev", DEVICES)
def test_short_sequence(dev, dtype, width, length):
    rng = np.random.default_rng(width)
    layout = "BDL" if width % 2 else "BLD"
    args, _ = inputs(rng, dtype, batch=2, length=length, channels=3, width=width, layout=layout)
    compare(dev, rng, args, None, dtype, activation="silu", layout=layout, final="random")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_short_sequence_final_state_path(dev, layout, dtype):
    """With a cotangent on F only, dS and dx are dF shifted into place, bit for bit."""
    rng = np.random.default_rng(3)
    width, length = 9, 3
    P, axis = width - 1, time_axis(layout)
    args, _ = inputs(rng, dtype, batch=2, length=length, channels=5, width=width, layout=layout)
    args = jax.device_put(args, device(dev))

    def loss_terms(a):
        return apply(causal_conv1d, a, None, activation="silu", layout=layout,
                     return_final_state=True)

    (y, final), pull = jax.vjp(loss_terms, args)
    d_final = jnp.asarray(rng.standard_normal(final.shape), dtype)
    (grads,) = pull((jnp.zeros_like(y), jax.device_put(d_final, device(dev))))
    d_final = np.asarray(d_final.astype(jnp.float64))
    ds = np.asarray(grads["initial_state"].astype(jnp.float64))
    dx = np.asarray(grads["x"].astype(jnp.float64))
    # F[j] = S[j + L] for j < P - L and F[j] = x[j - (P - L)] after that.
    np.testing.assert_array_equal(np.take(ds, np.arange(length, P), axis),
                                  np.take(d_final, np.arange(P - length), axis))
    np.testing.assert_array_equal(np.take(ds, np.arange(length), axis), 0)
    np.testing.assert_array_equal(dx, np.take(d_final, np.arange(P - length, P), axis))
    np.testing.assert_array_equal(np.asarray(grads["weight"]), 0)
    np.testing.assert_array_equal(np.asarray(grads["bias"]), 0)


# ---- chunked training: the state chain must reproduce the full sequence ----

CHUNKS = [(8, [64, 3, 61, 1, 6, 65]), (17, [5, 100, 16, 2, 77])]


def chunked_conv(args, *, splits, layout):
    """causal_conv1d over consecutive chunks, each starting from the previous final state."""
    axis = time_axis(layout)
    state, ys, start = args["initial_state"], [], 0
    for n in splits:
        chunk = jax.lax.slice_in_dim(args["x"], start, start + n, axis=axis)
        y, state = causal_conv1d(chunk, args["weight"], args["bias"], activation="silu",
                                 initial_state=state, return_final_state=True, layout=layout)
        ys.append(y)
        start += n
    return jnp.concatenate(ys, axis=axis), state


def full_conv(args, *, layout):
    return apply(causal_conv1d, args, None, activation="silu", layout=layout,
                 return_final_state=True)


@pytest.mark.parametrize("width,splits", CHUNKS, ids=[f"K{k}" for k, _ in CHUNKS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_chunked_training(dev, layout, dtype, width, splits):
    rng = np.random.default_rng(width)
    args, _ = inputs(rng, dtype, batch=2, length=sum(splits), channels=6, width=width,
                     layout=layout)
    args = jax.device_put(args, device(dev))
    out_shape = jax.eval_shape(partial(full_conv, layout=layout), args)
    g_y, g_final = (jax.device_put(jnp.asarray(rng.standard_normal(o.shape), o.dtype), device(dev))
                    for o in out_shape)

    def loss(run, a):
        y, final = run(a)
        return (jnp.sum((y * g_y).astype(jnp.float64))
                + jnp.sum((final * g_final).astype(jnp.float64)))

    def value_and_grad(run):
        return jax.jit(lambda a: (run(a), jax.grad(partial(loss, run))(a)))(args)

    full_out, full_grads = value_and_grad(partial(full_conv, layout=layout))
    chunk_out, chunk_grads = value_and_grad(partial(chunked_conv, splits=splits, layout=layout))
    for name, c, f in zip(("y", "final_state"), chunk_out, full_out):
        assert_close(c, f, dtype, name)
    for name in GRAD_NAMES:
        assert_close(chunk_grads[name], full_grads[name], dtype, f"d{name}")


# ---- packed sequences: boundaries near tile edges, padding, all-padding rows ----

def packed_seq_idx(length: int, edges) -> np.ndarray:
    """Rows: boundaries at each of `edges`; the same plus trailing padding; padding inside the row
    and at its start; all padding."""
    cut = np.searchsorted(np.asarray(edges), np.arange(length), side="right").astype(np.int32)
    trailing = cut.copy()
    trailing[edges[-1] + 1:] = -1
    inside = cut.copy()
    inside[:3] = -1
    inside[edges[0]:edges[-1]] = -2
    return np.stack([cut, trailing, inside, np.full(length, -1, np.int32)])


EDGES = {"62-66": [62, 63, 64, 65, 66], "127-129": [127, 128, 129]}


@pytest.mark.parametrize("edges", list(EDGES.values()), ids=list(EDGES))
@pytest.mark.parametrize("width", [4, 17])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_seq_idx_tile_edges(dev, layout, width, edges):
    rng = np.random.default_rng(width)
    seq_idx = packed_seq_idx(200, edges)
    for dtype in (jnp.float32, jnp.float64):
        args, seq = inputs(rng, dtype, batch=4, length=200, channels=3, width=width, layout=layout,
                           seq_idx=seq_idx)
        grads, _ = compare(dev, rng, args, seq, dtype, activation="silu", layout=layout,
                           final="random")
        # An all-padding row feeds no output and keeps no final state: nothing flows back.
        np.testing.assert_array_equal(grads["x"][3], 0)
        np.testing.assert_array_equal(grads["initial_state"][3], 0)


def test_packed_seq_idx_rows():
    rows = packed_seq_idx(10, [4, 5])
    np.testing.assert_array_equal(rows[0], [0, 0, 0, 0, 1, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(rows[1], [0, 0, 0, 0, 1, 2, -1, -1, -1, -1])
    np.testing.assert_array_equal(rows[2], [-1, -1, -1, 0, -2, 2, 2, 2, 2, 2])
    assert (rows[3] == -1).all()


# ---- numerical gradients (float64, CPU) ----

@pytest.mark.parametrize("width,length", [(3, 10), (6, 2)], ids=["K3-L10", "K6-L2"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_check_grads(layout, width, length):
    rng = np.random.default_rng(width)
    args, seq = inputs(rng, jnp.float64, batch=2, length=length, channels=3, width=width,
                       layout=layout, seq_idx=np.stack([np.arange(length) // 4,
                                                        np.zeros(length)]).astype(np.int32))

    def f(x, weight, bias, initial_state):
        return causal_conv1d(x, weight, bias, activation="silu", initial_state=initial_state,
                             seq_idx=seq, return_final_state=True, layout=layout)

    with jax.default_device(cpu()):
        check_grads(f, tuple(jax.device_put(args[n], cpu()) for n in GRAD_NAMES), order=1,
                    modes=["rev"])


# ---- jax.jit(jax.grad(loss)) with every optional input ----

@pytest.mark.parametrize("use_final", [False, True], ids=["final_unused", "final_used"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_jit_grad_every_optional_input(dev, layout, use_final):
    rng = np.random.default_rng(7)
    length = 150
    seq_idx = packed_seq_idx(length, [30, 64, 100])[:3]
    args, seq = inputs(rng, jnp.float32, batch=3, length=length, channels=5, width=4,
                       layout=layout, seq_idx=seq_idx)
    g_y = rng.standard_normal(args["x"].shape)
    g_final = rng.standard_normal(args["initial_state"].shape)

    def loss(fn, a, seq, g_y, g_final):
        y, final = apply(fn, a, seq, activation="swish", layout=layout, return_final_state=True)
        total = jnp.sum(y.astype(jnp.float64) * g_y)
        return total + jnp.sum(final.astype(jnp.float64) * g_final) if use_final else total

    on = partial(jax.device_put, device=device(dev))
    grads = jax.jit(jax.grad(partial(loss, causal_conv1d)))(on(args), on(seq), g_y, g_final)
    on_cpu = partial(jax.device_put, device=cpu())
    ref = jax.jit(jax.grad(partial(loss, reference.causal_conv1d)))(on_cpu(to_f64(args)),
                                                                    on_cpu(seq), g_y, g_final)
    for name in GRAD_NAMES:
        assert grads[name].dtype == args[name].dtype
        assert_close(grads[name], ref[name], jnp.float32, f"d{name}")


# ---- determinism: the same backward 100 times gives the same bits ----
# (BDL: on the GPU the channel-first kernels, whose lanes each sum dw/db in their own fixed order.)

@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_backward_deterministic(dev, layout):
    rng = np.random.default_rng(11)
    batch, length, channels = (2, 300, 40) if dev == "cpu" else (4, 2048, 512)
    args, seq = inputs(rng, jnp.float32, batch=batch, length=length, channels=channels, width=4,
                       layout=layout, seq_idx=packed_seq_idx(length, [100, 1000, 1500])[:batch])
    kw = dict(activation="silu", layout=layout, return_final_state=True)
    on = partial(jax.device_put, device=device(dev))
    out_shape = jax.eval_shape(lambda a: apply(causal_conv1d, a, seq, **kw), args)
    cotangent = on(random_cotangent(rng, out_shape, "random"))
    args, seq = on(args), on(seq)

    def run():
        _, grads = kernel_vjp(args, seq, cotangent, **kw)
        return {name: np.asarray(g) for name, g in grads.items()}

    first = run()
    _, ref_grads = reference_vjp(jax.device_put(to_f64(args), cpu()), jax.device_put(seq, cpu()),
                                 jax.device_put(to_f64(cotangent), cpu()), **kw)
    for name in GRAD_NAMES:
        assert_close(first[name], ref_grads[name], jnp.float32, f"d{name}")
    for i in range(99):
        again = run()
        for name in GRAD_NAMES:
            assert np.array_equal(again[name], first[name]), f"d{name} differs in run {i + 2}"
