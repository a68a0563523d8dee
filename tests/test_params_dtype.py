"""Weight and bias in x's own dtype (bfloat16 or float16 x): the kernels read them as they are.

With both in x's dtype the custom calls take them without a convert op and the backward's kernel
writes dweight and dbias in that dtype, summed in float32 and rounded once; any other combination
is converted to the accumulation dtype first (as before). Checked here: forward and every gradient
against jax.vjp of the float64 reference at the DESIGN.md tolerances, in both layouts, with and
without seq_idx and the initial state; bitwise agreement with the same weights given in float32
(the kernels widen them exactly); the gradients' dtypes; the decode step; vmap and sharding; that
the lowered program holds no convert of the weight or bias; and the FFI handlers' dtype checks.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, TOLERANCE, assert_close, device, to_f64
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_backward import compare, inputs, packed_seq_idx, random_cotangent

import jax_causal_conv as jcc
from jax_causal_conv import _primitives, reference

HALF = [jnp.bfloat16, jnp.float16]
# Shapes that take the vectorized CUDA kernels (D, or L, a multiple of the 16-byte pack) and a
# channel count that takes the generic ones; on the CPU they run the CPU kernels' tiles.
SHAPES = {"BLD": dict(batch=2, length=300, channels=64), "BDL": dict(batch=2, length=1000, channels=4)}
ODD_SHAPE = dict(batch=2, length=100, channels=6)


def name(dtype) -> str:
    return jnp.dtype(dtype).name


def packed_rows(batch: int, length: int) -> np.ndarray:
    """packed_seq_idx's rows (boundaries, trailing padding, padding inside, all padding)."""
    edges = [e for e in (40, 63, 64, 128, 255, 256, 700) if e < length - 1]
    rows = packed_seq_idx(length, edges)
    return rows[np.arange(batch) % len(rows)]


def with_params(args, dtype, bias_dtype=None):
    """args with weight in `dtype` and bias (if any) in `bias_dtype` (default: `dtype`)."""
    out = dict(args, weight=args["weight"].astype(dtype))
    if args["bias"] is not None:
        out["bias"] = args["bias"].astype(bias_dtype or dtype)
    return out


@pytest.mark.parametrize("masked", [False, True], ids=["no_seq_idx", "seq_idx"])
@pytest.mark.parametrize("state", [False, True], ids=["no_state", "state"])
@pytest.mark.parametrize("params", ["x", "float32"])
@pytest.mark.parametrize("dtype", HALF, ids=name)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_forward_and_gradients(dev, layout, dtype, params, state, masked):
    """y, the final state and every gradient against the reference; compare() also asserts that
    each gradient has its primal's dtype."""
    rng = np.random.default_rng(7)
    shape = dict(SHAPES[layout], batch=4)
    seq = packed_rows(shape["batch"], shape["length"]) if masked else None
    args, seq_idx = inputs(rng, dtype, width=4, layout=layout, state=state, seq_idx=seq, **shape)
    args = with_params(args, dtype if params == "x" else jnp.float32)
    compare(dev, rng, args, seq_idx, dtype, activation="silu", layout=layout,
            final="random" if state else "none")


@pytest.mark.parametrize("shape", ["vector", "odd"])
@pytest.mark.parametrize("width", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_widths(dev, layout, width, shape):
    """Compile-time and runtime widths, aligned and odd shapes, bfloat16 x and parameters."""
    rng = np.random.default_rng(width)
    args, _ = inputs(rng, jnp.bfloat16, width=width, layout=layout,
                     **(SHAPES[layout] if shape == "vector" else ODD_SHAPE))
    args = with_params(args, jnp.bfloat16)
    compare(dev, rng, args, None, jnp.bfloat16, activation="silu", layout=layout, final="random")


def _conv(args, seq_idx, layout):
    return jcc.causal_conv1d(args["x"], args["weight"], args["bias"], activation="silu",
                             initial_state=args["initial_state"], seq_idx=seq_idx,
                             return_final_state=True, layout=layout)


def _vjp_all(args, seq_idx, cotangent, *, layout):
    out, pull = jax.vjp(lambda a: _conv(a, seq_idx, layout), args)
    return out, pull(cotangent)[0]


vjp_all = jax.jit(_vjp_all, static_argnames="layout")


@pytest.mark.parametrize("shape", ["vector", "odd"])
@pytest.mark.parametrize("dtype", HALF, ids=name)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_bitwise_equal_to_float32_params(dev, layout, dtype, shape):
    """Parameters in x's dtype give the bits of the same values given in float32: y, the states
    and dx equal, dweight and dbias equal the float32 run's rounded to x's dtype. Twice, equal."""
    rng = np.random.default_rng(3)
    shape = dict(SHAPES[layout] if shape == "vector" else ODD_SHAPE, batch=4)
    seq = packed_rows(shape["batch"], shape["length"])
    args, seq_idx = inputs(rng, dtype, width=4, layout=layout, seq_idx=seq, **shape)
    narrow = with_params(args, dtype)
    wide = with_params(narrow, jnp.float32)  # the same values, exactly
    on = partial(jax.device_put, device=device(dev))
    out_shape = jax.eval_shape(lambda a: _conv(a, seq_idx, layout), narrow)
    cotangent = on(random_cotangent(rng, out_shape, "random"))
    narrow, wide, seq_idx = on(narrow), on(wide), on(seq_idx)

    out, grads = vjp_all(narrow, seq_idx, cotangent, layout=layout)
    out_wide, grads_wide = vjp_all(wide, seq_idx, cotangent, layout=layout)
    again = vjp_all(narrow, seq_idx, cotangent, layout=layout)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((out, grads))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for what, a, b in zip(("y", "final_state"), out, out_wide):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
    for what in ("x", "initial_state"):
        np.testing.assert_array_equal(np.asarray(grads[what]), np.asarray(grads_wide[what]),
                                      err_msg=f"d{what}")
    for what in ("weight", "bias"):
        assert grads[what].dtype == jnp.dtype(dtype), what
        assert grads_wide[what].dtype == jnp.float32, what
        np.testing.assert_array_equal(np.asarray(grads[what]),
                                      np.asarray(grads_wide[what].astype(dtype)), err_msg=f"d{what}")


# (x, weight, bias): both in x's dtype (bias absent or present), and the mixed combinations, which
# travel in float32; every gradient comes back in its primal's dtype.
MIXED = [
    (jnp.bfloat16, jnp.bfloat16, None),
    (jnp.float16, jnp.float16, jnp.float16),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.float16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float16, jnp.float16),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16),
]


@pytest.mark.parametrize("dtype,weight_dtype,bias_dtype", MIXED,
                         ids=["-".join("none" if d is None else name(d) for d in c) for c in MIXED])
@pytest.mark.parametrize("dev", DEVICES)
def test_dtype_combinations(dev, dtype, weight_dtype, bias_dtype):
    rng = np.random.default_rng(11)
    args, _ = inputs(rng, dtype, width=4, layout="BLD", bias=bias_dtype is not None,
                     **SHAPES["BLD"])
    args = with_params(args, weight_dtype, bias_dtype)
    # Gradients rounded to a parameter's narrower dtype are held to that dtype's tolerance.
    coarsest = max((d for d in (dtype, weight_dtype, bias_dtype) if d is not None),
                   key=lambda d: TOLERANCE[jnp.dtype(d)])
    compare(dev, rng, args, None, coarsest, activation="silu", layout="BLD", final="random")


# ---- the point of the change: no convert op on the parameters around the custom calls ----

D, K = 24, 3  # sizes that no other array in these programs has


def param_converts(text: str) -> list[str]:
    """The stablehlo.convert lines whose operand or result is shaped like weight or bias (also as
    one group)."""
    shapes = (f"{D}x{K}x", f"1x{D}x{K}x", f"{D}x", f"1x{D}x")
    return [
        line for line in text.splitlines()
        if "stablehlo.convert" in line
        and any(re.search(rf"tensor<{s}(bf16|f16|f32|f64)>", line) for s in shapes)
    ]


def conv_program(weight_dtype, bias_dtype, *, grad, layout="BLD"):
    x_shape = (2, 40, D) if layout == "BLD" else (2, D, 40)
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, K), weight_dtype)
    b = jax.ShapeDtypeStruct((D,), bias_dtype)

    def conv(x, w, b):
        return jcc.causal_conv1d(x, w, b, activation="silu", layout=layout)

    def loss(x, w, b):
        return jnp.sum(conv(x, w, b).astype(jnp.float32) ** 2)

    fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else conv
    return jax.jit(fn).lower(x, w, b).as_text()


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_no_param_convert_in_program(layout, grad):
    text = conv_program(jnp.bfloat16, jnp.bfloat16, grad=grad, layout=layout)
    assert "custom_call" in text
    assert param_converts(text) == []
    # The check finds them where they are: parameters in another dtype are converted.
    assert param_converts(conv_program(jnp.float16, jnp.float16, grad=grad, layout=layout))


def test_no_param_convert_in_decode_program():
    state = jax.ShapeDtypeStruct((2, K - 1, D), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((2, D), jnp.bfloat16)

    def text(dtype):
        w, b = jax.ShapeDtypeStruct((D, K), dtype), jax.ShapeDtypeStruct((D,), dtype)
        fn = partial(jcc.causal_conv1d_update, activation="silu")
        return jax.jit(fn).lower(x, state, w, b).as_text()

    assert "custom_call" in text(jnp.bfloat16)
    assert param_converts(text(jnp.bfloat16)) == []
    assert param_converts(text(jnp.float16))


# ---- the decode step ----

@pytest.mark.parametrize("channels", [16, 5])
@pytest.mark.parametrize("mode", ["shift", "ring"])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dtype", HALF, ids=name)
@pytest.mark.parametrize("dev", DEVICES)
def test_update(dev, dtype, layout, mode, channels):
    """One token (the vectorized CUDA kernel where channels allow) and three tokens, against the
    reference in float64 and bitwise against the same parameters in float32."""
    rng = np.random.default_rng(channels)
    B, width = 3, 4
    w = jnp.asarray(rng.standard_normal((channels, width)) / 2, dtype)
    b = jnp.asarray(rng.standard_normal(channels), dtype)
    seqlens = jnp.asarray([0, 2, 9], jnp.int32) if mode == "ring" else None
    for tokens in (1, 3):
        x_shape = (B, channels) if tokens == 1 else (
            (B, tokens, channels) if layout == "BLD" else (B, channels, tokens))
        s_shape = (B, width - 1, channels) if layout == "BLD" else (B, channels, width - 1)
        x = jnp.asarray(rng.standard_normal(x_shape), dtype)
        state = jnp.asarray(rng.standard_normal(s_shape), dtype)
        on = partial(jax.device_put, device=device(dev))
        run = jax.jit(partial(jcc.causal_conv1d_update, activation="silu", layout=layout))
        y, new_state = run(on(x), on(state), on(w), on(b), cache_seqlens=on(seqlens))
        y32, state32 = run(on(x), on(state), on(w.astype(jnp.float32)), on(b.astype(jnp.float32)),
                           cache_seqlens=on(seqlens))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y32))
        np.testing.assert_array_equal(np.asarray(new_state), np.asarray(state32))
        y_ref, state_ref = reference.causal_conv1d_update(
            *to_f64((x, state, w, b)), activation="silu", cache_seqlens=seqlens, layout=layout)
        assert y.dtype == jnp.dtype(dtype)
        assert_close(y, y_ref, dtype, f"y, {tokens} tokens")
        np.testing.assert_array_equal(np.asarray(new_state), np.asarray(state_ref.astype(dtype)))


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("dev", DEVICES)
def test_update_widths(dev, width):
    rng = np.random.default_rng(width)
    B, channels = 4, 32
    w = jnp.asarray(rng.standard_normal((channels, width)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(channels), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((B, channels)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((B, width - 1, channels)), jnp.bfloat16)
    y, _ = jax.jit(jcc.causal_conv1d_update)(*jax.device_put((x, state, w, b), device(dev)))
    y_ref, _ = reference.causal_conv1d_update(*to_f64((x, state, w, b)))
    assert_close(y, y_ref, jnp.bfloat16, "y")


# ---- vmap (weight groups) and sharding ----

def test_vmapped_parameters():
    """An ensemble of parameter sets over one x: the batching rule makes them weight groups."""
    rng = np.random.default_rng(5)
    members, (B, L, Dm, Km) = 3, (2, 50, 8, 4)
    x = jnp.asarray(rng.standard_normal((B, L, Dm)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((members, Dm, Km)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((members, Dm)), jnp.bfloat16)

    def loss(conv, x, w, b):
        return jnp.sum(jnp.sin(conv(x, w, b, activation="silu").astype(jnp.float64)))

    grads = jax.jit(jax.vmap(jax.grad(partial(loss, jcc.causal_conv1d), argnums=(0, 1, 2)),
                             in_axes=(None, 0, 0)))(x, w, b)
    refs = jax.vmap(jax.grad(partial(loss, reference.causal_conv1d), argnums=(0, 1, 2)),
                    in_axes=(None, 0, 0))(*to_f64((x, w, b)))
    for what, g, r, primal in zip(("dx", "dweight", "dbias"), grads, refs, (x, w, b)):
        assert g.dtype == primal.dtype, what
        assert_close(g, r, jnp.bfloat16, what)


def test_sharded_gradients():
    """Batch, sequence and channel sharding at once: dweight and dbias, summed over the batch and
    sequence shards (in float32), come back in bfloat16 and agree with one device."""
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 cpu devices")
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 2, 2), ("data", "seq", "model"))
    rng = np.random.default_rng(8)
    Bs, Ls, Ds, Ks = 4, 32, 8, 4
    x = jnp.asarray(rng.standard_normal((Bs, Ls, Ds)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((Ds, Ks)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(Ds), jnp.bfloat16)
    s = jnp.asarray(rng.standard_normal((Bs, Ks - 1, Ds)), jnp.bfloat16)

    def loss(x, w, b, s):
        y, final = jcc.causal_conv1d(x, w, b, activation="silu", initial_state=s,
                                     return_final_state=True)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(final.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    single = grad(x, w, b, s)
    specs = (P("data", "seq", "model"), P("model", None), P("model"), P("data", None, "model"))
    sharded = grad(*(jax.device_put(a, NamedSharding(mesh, spec))
                     for a, spec in zip((x, w, b, s), specs)))
    for what, g, r, primal in zip(("dx", "dweight", "dbias", "dinitial"), sharded, single,
                                  (x, w, b, s)):
        assert g.dtype == primal.dtype == r.dtype, what
        assert_close(g, r, jnp.bfloat16, what)


def test_varlen():
    rng = np.random.default_rng(9)
    T, Dv, Kv = 60, 8, 4
    x = jnp.asarray(rng.standard_normal((T, Dv)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((Dv, Kv)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(Dv), jnp.bfloat16)
    states = jnp.asarray(rng.standard_normal((3, Kv - 1, Dv)), jnp.bfloat16)
    cu = jnp.asarray([0, 10, 35, 55], jnp.int32)

    def loss(fn, x, w, b, states):
        y, final = fn(x, w, b, cu_seqlens=cu, activation="silu", initial_states=states,
                      return_final_states=True)
        return jnp.sum(jnp.sin(y.astype(jnp.float64))) + jnp.sum(final.astype(jnp.float64) ** 2)

    grads = jax.jit(jax.grad(partial(loss, jcc.causal_conv1d_varlen), argnums=(0, 1, 2, 3)))(
        x, w, b, states)
    refs = jax.grad(partial(loss, reference.causal_conv1d_varlen), argnums=(0, 1, 2, 3))(
        *to_f64((x, w, b, states)))
    for what, g, r, primal in zip(("dx", "dweight", "dbias", "dstates"), grads, refs,
                                  (x, w, b, states)):
        assert g.dtype == primal.dtype, what
        assert_close(g, r, jnp.bfloat16, what)


def test_reference_lowering(monkeypatch):
    """On a platform without our kernels the primitives lower to the reference, which also takes
    parameters in x's dtype and accumulates in float32."""
    from jax_causal_conv import _native

    monkeypatch.setattr(_native, "native_platforms", set())
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((2, 30, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8, 4)) / 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)

    def loss(fn, x, w, b):
        return jnp.sum(jnp.sin(fn(x, w, b, activation="silu").astype(jnp.float32)))

    grad = jax.jit(jax.grad(partial(loss, jcc.causal_conv1d), argnums=(0, 1, 2)))
    assert "custom_call" not in grad.lower(x, w, b).as_text()
    refs = jax.grad(partial(loss, reference.causal_conv1d), argnums=(0, 1, 2))(*to_f64((x, w, b)))
    for what, g, r, primal in zip(("dx", "dweight", "dbias"), grad(x, w, b), refs, (x, w, b)):
        assert g.dtype == primal.dtype, what
        assert_close(g, r, jnp.bfloat16, what)

    state = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.bfloat16)
    y, new_state = jax.jit(jcc.causal_conv1d_update)(x[:, 0], state, w, b)
    y_ref, state_ref = reference.causal_conv1d_update(x[:, 0], state, w, b)
    assert_close(y, y_ref, jnp.float32, "y (as the reference computes it, in float32)")
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(state_ref))


# ---- the FFI handlers' dtype checks (the public functions never bind such operands) ----

@pytest.mark.parametrize("weight_dtype,bias_dtype,message", [
    (jnp.float16, jnp.float16, "weight must have x's dtype or x's accumulation dtype"),
    (jnp.float64, jnp.float64, "weight must have x's dtype or x's accumulation dtype"),
    (jnp.bfloat16, jnp.float32, "bias must have weight's dtype"),
    (jnp.float32, jnp.bfloat16, "bias must have weight's dtype"),
], ids=["f16-weight", "f64-weight", "bias-f32", "bias-bf16"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_ffi_rejects_other_param_dtypes(backward, weight_dtype, bias_dtype, message):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 16, 4)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, 4, 3)), weight_dtype)
    b = jnp.asarray(rng.standard_normal((1, 4)), bias_dtype)
    flags = dict(silu=False, channel_last=True)
    if backward:
        run = lambda: _primitives.backward(x, w, b, None, None, x, None, **flags)
    else:
        run = lambda: _primitives.forward(x, w, b, None, None, return_final_state=False, **flags)
    with pytest.raises(Exception, match=re.escape(message)):
        jax.block_until_ready(run())


def test_update_ffi_rejects_other_param_dtypes():
    from jax_causal_conv import _update

    x = jnp.ones((1, 1, 4), jnp.bfloat16) * 0.5
    state = jnp.ones((1, 2, 4), jnp.bfloat16) * 0.25
    w, b = jnp.ones((1, 4, 3), jnp.bfloat16), jnp.ones((1, 4), jnp.float32)
    with pytest.raises(Exception, match=re.escape("bias must have weight's dtype")):
        jax.block_until_ready(_update.update_p.bind(
            x, w, b, state, silu=False, channel_last=True, has_cache_seqlens=False,
            has_state_indices=False))
