"""Bad, extreme and non-finite inputs for every public function (issue 7, items 2 and 3).

1. Invalid calls: a corpus per function - causal_conv1d_update, causal_conv1d_varlen, their
   references, the cases of causal_conv1d that test_validation.py lacks, and nn.CausalConv1d (its
   constructor, init_cache, prefill and decode calls). Each case breaks one argument of a valid
   call and expects ValueError or TypeError whose message names the argument.
2. Valid extreme calls: empty batch (B = 0), no channels (D = 0), an empty state pool, and no
   sequences give the reference's result; zero-length inputs are rejected (L = 0 for
   causal_conv1d is in test_validation.py).
3. NaN and Inf: they reach the same positions of y, the states and every gradient as in the
   reference, and never cross into another segment, sequence or batch row, nor out of padding.
4. Values no trace-time check can see - seq_idx ids in any order, state_indices and
   cache_seqlens out of range or negative, cu_seqlens out of order or past T - have the defined
   behaviour of the README's Guarantees section, checked here against independent computations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, TOLERANCE, device, relative_error, to_f64

import jax_causal_conv as jcc
from jax_causal_conv import reference

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
RNG = np.random.default_rng(7)


def rand(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


# ---------------------------------------------------------------------------------------------
# 1. Invalid calls
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    change: Callable[[dict], dict]  # valid call -> invalid call
    error: type
    name: str  # the argument the message must name, in backticks
    also: tuple[str, ...] = field(default=())  # further words the message must contain


def _set(**changes):
    return lambda call: {**call, **changes}


def _map(name, f):
    return lambda call: {**call, name: f(call[name])}


def _cast(name, dtype):
    return _map(name, lambda v: v.astype(dtype))


def dtype_cases(name, error=TypeError, kinds=("int32", "bool", "complex64")):
    """The argument in an integer, boolean and complex dtype."""
    makers = {
        "int32": _cast(name, jnp.int32), "bool": _map(name, lambda v: v > 0),
        "complex64": _cast(name, jnp.complex64), "int64": _cast(name, jnp.int64),
        "float32": _cast(name, jnp.float32), "uint32": _cast(name, jnp.uint32),
        "int16": _cast(name, jnp.int16), "float8": _cast(name, jnp.float8_e4m3fn),
    }
    return [Case(f"{name}_{k}", makers[k], error, name) for k in kinds]


def weight_cases(channels, width):
    return [
        Case("weight_rank1", _map("weight", lambda w: w[:, 0]), ValueError, "weight"),
        Case("weight_torch_rank3", _map("weight", lambda w: w[:, None, :]), ValueError, "weight"),
        Case("weight_channels", _set(weight=rand(channels + 1, width)), ValueError, "weight"),
        Case("weight_K0", _map("weight", lambda w: w[:, :0]), ValueError, "weight", ("K=0",)),
        Case("weight_K257", _set(weight=rand(channels, 257)), ValueError, "weight", ("K=257",)),
        Case("weight_none", _set(weight=None), TypeError, "weight"),
        *dtype_cases("weight"),
        Case("bias_rank2", _map("bias", lambda b: b[None]), ValueError, "bias"),
        Case("bias_channels", _set(bias=rand(channels + 1)), ValueError, "bias"),
        Case("bias_string", _set(bias="zero"), TypeError, "bias"),
        *dtype_cases("bias"),
        Case("activation_relu", _set(activation="relu"), ValueError, "activation"),
        Case("activation_bool", _set(activation=True), ValueError, "activation"),
    ]


def x_cases(valid_ranks: str):
    return [
        Case("x_none", _set(x=None), TypeError, "x"),
        Case("x_string", _set(x="abc"), TypeError, "x"),
        Case("x_ragged_list", _set(x=[[1.0, 2.0], [3.0]]), TypeError, "x"),
        Case("x_scalar", _set(x=jnp.float32(1)), ValueError, "x", (valid_ranks,)),
        *dtype_cases("x", kinds=("int32", "bool", "complex64", "float8")),
    ]


def index_cases(name, good_shape):
    """An int32 index argument with the wrong dtype, rank or length."""
    n = good_shape[0]
    return [
        *dtype_cases(name, kinds=("int64", "uint32", "int16", "float32", "bool")),
        Case(f"{name}_long", _set(**{name: jnp.zeros((n + 1,), jnp.int32)}), ValueError, name),
        Case(f"{name}_rank2", _set(**{name: jnp.zeros((n, 1), jnp.int32)}), ValueError, name),
        Case(f"{name}_scalar", _set(**{name: jnp.int32(0)}), ValueError, name),
        Case(f"{name}_list", _set(**{name: [0.5] * n}), TypeError, name),
    ]


# causal_conv1d_update: B rows, T tokens, D channels, K taps, S state slots, a pool of rows.
UB, UT, UD, UK, US, UPOOL = 2, 3, 4, 3, 6, 5


def update_call(layout="BLD"):
    rng = np.random.default_rng(1)
    x_shape = (UB, UT, UD) if layout == "BLD" else (UB, UD, UT)
    s_shape = (UPOOL, US, UD) if layout == "BLD" else (UPOOL, UD, US)
    return dict(
        x=jnp.asarray(rng.standard_normal(x_shape), jnp.float32),
        conv_state=jnp.asarray(rng.standard_normal(s_shape), jnp.float32),
        weight=jnp.asarray(rng.standard_normal((UD, UK)), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(UD), jnp.float32),
        activation="silu",
        cache_seqlens=jnp.asarray([0, 7], jnp.int32),
        state_indices=jnp.asarray([3, 0], jnp.int32),
        layout=layout,
    )


UPDATE_CASES = [
    *x_cases("(B, D)"),
    Case("x_rank4", _map("x", lambda x: x[..., None]), ValueError, "x"),
    Case("x_rank1", _map("x", lambda x: x[0, 0]), ValueError, "x"),
    Case("x_no_tokens", _map("x", lambda x: x[:, :0]), ValueError, "x", ("at least one token",)),
    Case("state_rank2", _map("conv_state", lambda s: s[0]), ValueError, "conv_state"),
    Case("state_rank4", _map("conv_state", lambda s: s[None]), ValueError, "conv_state"),
    Case("state_none", _set(conv_state=None), TypeError, "conv_state"),
    Case("state_channels", _set(conv_state=rand(UPOOL, US, UD + 1)), ValueError, "conv_state"),
    Case("state_too_few_slots", _set(conv_state=rand(UPOOL, UK - 2, UD)), ValueError, "conv_state",
         (f"S >= K-1={UK - 1}",)),
    Case("state_float16", _cast("conv_state", jnp.float16), TypeError, "conv_state"),
    Case("state_float64", _cast("conv_state", jnp.float64), TypeError, "conv_state"),
    *dtype_cases("conv_state"),
    Case("state_pool_without_indices", _set(state_indices=None), ValueError, "conv_state",
         ("state_indices",)),
    # BDL-shaped tensors with layout="BLD": x's D comes from the wrong axis.
    Case("layout_mismatch_x", lambda c: {**update_call("BDL"), "layout": "BLD"}, ValueError,
         "weight"),
    Case("layout_mismatch_state", lambda c: {**c, "conv_state": update_call("BDL")["conv_state"]},
         ValueError, "conv_state"),
    *weight_cases(UD, UK),
    *index_cases("cache_seqlens", (UB,)),
    *index_cases("state_indices", (UB,)),
    Case("layout_unknown", _set(layout="BTD"), ValueError, "layout"),
    Case("layout_none", _set(layout=None), ValueError, "layout"),
]

# causal_conv1d_varlen: T packed tokens, D channels, K taps, N sequences.
VT, VD, VK, VN = 10, 3, 5, 2


def varlen_call():
    rng = np.random.default_rng(2)
    return dict(
        x=jnp.asarray(rng.standard_normal((VT, VD)), jnp.float32),
        weight=jnp.asarray(rng.standard_normal((VD, VK)), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(VD), jnp.float32),
        cu_seqlens=jnp.asarray([0, 4, 9], jnp.int32),
        activation="silu",
        initial_states=jnp.asarray(rng.standard_normal((VN, VK - 1, VD)), jnp.float32),
        return_final_states=True,
    )


VARLEN_CASES = [
    *x_cases("(T, D)"),
    Case("x_rank3", _map("x", lambda x: x[None]), ValueError, "x"),
    Case("x_rank1", _map("x", lambda x: x[:, 0]), ValueError, "x"),
    Case("x_no_tokens", _map("x", lambda x: x[:0]), ValueError, "x", ("T >= 1",)),
    *weight_cases(VD, VK),
    Case("cu_seqlens_none", _set(cu_seqlens=None), ValueError, "cu_seqlens", ("required",)),
    *dtype_cases("cu_seqlens", kinds=("int64", "uint32", "float32", "bool")),
    Case("cu_seqlens_scalar", _set(cu_seqlens=jnp.int32(0)), ValueError, "cu_seqlens"),
    Case("cu_seqlens_rank2", _map("cu_seqlens", lambda c: c[None]), ValueError, "cu_seqlens"),
    Case("cu_seqlens_empty", _set(cu_seqlens=jnp.zeros((0,), jnp.int32)), ValueError, "cu_seqlens"),
    Case("cu_seqlens_string", _set(cu_seqlens="0,4,9"), TypeError, "cu_seqlens"),
    Case("states_count", _set(initial_states=rand(VN + 1, VK - 1, VD)), ValueError, "initial_states"),
    Case("states_steps", _set(initial_states=rand(VN, VK, VD)), ValueError, "initial_states"),
    Case("states_channels", _set(initial_states=rand(VN, VK - 1, VD + 1)), ValueError,
         "initial_states"),
    Case("states_channel_first", _set(initial_states=rand(VN, VD, VK - 1)), ValueError,
         "initial_states"),
    Case("states_rank2", _map("initial_states", lambda s: s[0]), ValueError, "initial_states"),
    Case("states_float16", _cast("initial_states", jnp.float16), TypeError, "initial_states"),
    *dtype_cases("initial_states"),
    Case("final_int", _set(return_final_states=1), TypeError, "return_final_states"),
    Case("final_none", _set(return_final_states=None), TypeError, "return_final_states"),
    Case("final_array", _set(return_final_states=jnp.bool_(True)), TypeError, "return_final_states"),
]

# causal_conv1d: what test_validation.py's 49 cases leave out.
CB, CL, CD, CK = 2, 6, 3, 3


def conv_call(layout="BLD"):
    rng = np.random.default_rng(3)
    x_shape = (CB, CL, CD) if layout == "BLD" else (CB, CD, CL)
    s_shape = (CB, CK - 1, CD) if layout == "BLD" else (CB, CD, CK - 1)
    return dict(
        x=jnp.asarray(rng.standard_normal(x_shape), jnp.float32),
        weight=jnp.asarray(rng.standard_normal((CD, CK)), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(CD), jnp.float32),
        activation="silu",
        initial_state=jnp.asarray(rng.standard_normal(s_shape), jnp.float32),
        seq_idx=jnp.asarray([[0, 0, 1, 1, 1, -1]] * CB, jnp.int32),
        return_final_state=True,
        layout=layout,
    )


CONV_CASES = [
    Case("x_uint8", _cast("x", jnp.uint8), TypeError, "x"),
    Case("x_complex128", _cast("x", jnp.complex128), TypeError, "x"),
    Case("x_scalar", _set(x=jnp.float32(1)), ValueError, "x"),
    Case("weight_complex64", _cast("weight", jnp.complex64), TypeError, "weight"),
    Case("weight_string", _set(weight="w"), TypeError, "weight"),
    Case("bias_bool", _map("bias", lambda b: b > 0), TypeError, "bias"),
    Case("bias_string", _set(bias="zero"), TypeError, "bias"),
    Case("bias_scalar", _set(bias=jnp.float32(1)), ValueError, "bias"),
    Case("state_bool", _map("initial_state", lambda s: s > 0), TypeError, "initial_state"),
    Case("state_complex64", _cast("initial_state", jnp.complex64), TypeError, "initial_state"),
    Case("state_float64", _cast("initial_state", jnp.float64), TypeError, "initial_state"),
    Case("state_string", _set(initial_state="s"), TypeError, "initial_state"),
    Case("seq_idx_int16", _cast("seq_idx", jnp.int16), TypeError, "seq_idx"),
    Case("seq_idx_complex64", _cast("seq_idx", jnp.complex64), TypeError, "seq_idx"),
    Case("seq_idx_float_list", _set(seq_idx=[[0.5] * CL] * CB), TypeError, "seq_idx"),
    Case("seq_idx_transposed", _map("seq_idx", lambda s: s.T), ValueError, "seq_idx"),
    Case("layout_lowercase_bdl", _set(layout="bdl"), ValueError, "layout"),
    Case("activation_none_string", _set(activation="None"), ValueError, "activation"),
    # BLD-shaped x with layout="BDL" (and the other way round): D read from the wrong axis.
    Case("layout_mismatch_BDL", lambda c: {**conv_call("BLD"), "layout": "BDL"}, ValueError,
         "weight", ("layout='BDL'",)),
    Case("layout_mismatch_state", lambda c: {**c, "initial_state": conv_call("BDL")["initial_state"]},
         ValueError, "initial_state"),
]

ARRAY_ARGS = {
    "update": ("x", "conv_state", "weight", "bias", "cache_seqlens", "state_indices"),
    "varlen": ("x", "weight", "bias", "cu_seqlens", "initial_states"),
    "conv": ("x", "weight", "bias", "initial_state", "seq_idx"),
}
POSITIONAL = {"update": ("x", "conv_state", "weight", "bias"), "varlen": ("x", "weight", "bias"),
              "conv": ("x", "weight", "bias")}
OPS = {
    "update": (update_call, UPDATE_CASES, [(jcc.causal_conv1d_update, "causal_conv1d_update"),
               (reference.causal_conv1d_update, "reference.causal_conv1d_update")]),
    "varlen": (varlen_call, VARLEN_CASES, [(jcc.causal_conv1d_varlen, "causal_conv1d_varlen"),
               (reference.causal_conv1d_varlen, "reference.causal_conv1d_varlen")]),
    "conv": (conv_call, CONV_CASES, [(jcc.causal_conv1d, "causal_conv1d"),
             (reference.causal_conv1d, "reference.causal_conv1d")]),
}


def call_op(op, fn, call, jit):
    """fn(**call); under jit the array arguments are traced and the rest are static."""
    positional = [call[k] for k in POSITIONAL[op]]
    keywords = {k: v for k, v in call.items() if k not in POSITIONAL[op]}
    if not jit:
        return fn(*positional, **keywords)
    traced = ARRAY_ARGS[op]
    static = {k: v for k, v in call.items() if k not in traced}

    def run(*arrays):
        args = {**dict(zip(traced, arrays)), **static}
        return fn(*[args[k] for k in POSITIONAL[op]],
                  **{k: v for k, v in args.items() if k not in POSITIONAL[op]})

    return jax.jit(run)(*[call[k] for k in traced])


def _traceable(op, call):
    return all(call[k] is None or hasattr(call[k], "dtype") for k in ARRAY_ARGS[op])


def _corpus_params():
    params = []
    for op, (valid, cases, fns) in OPS.items():
        for fn, fn_name in fns:
            for case in cases:
                jits = [False, True] if _traceable(op, case.change(valid())) else [False]
                for jit in jits:
                    mode = "jit" if jit else "eager"
                    params.append(pytest.param(op, fn, fn_name, case, jit,
                                               id=f"{fn_name}-{case.id}-{mode}"))
    return params


def test_corpus_ids_are_distinct():
    for op, (_, cases, _) in OPS.items():
        ids = [c.id for c in cases]
        assert len(ids) == len(set(ids)), op


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_valid_calls_pass(op, jit):
    """Each corpus starts from a call that is valid, so each case's error comes from its change."""
    valid, _, fns = OPS[op]
    for fn, _ in fns:
        out = call_op(op, fn, valid(), jit)
        assert jax.tree.leaves(out)


@pytest.mark.parametrize("op,fn,fn_name,case,jit", _corpus_params())
def test_invalid_call_raises_naming_argument(op, fn, fn_name, case, jit):
    valid = OPS[op][0]
    with pytest.raises(case.error) as info:
        call_op(op, fn, case.change(valid()), jit)
    message = str(info.value)
    assert message.startswith(f"{fn_name}: "), message
    assert f"`{case.name}`" in message, message
    for word in case.also:
        assert word in message, message


# nn.CausalConv1d: its constructor, init_cache, and prefill and decode calls.

def layer(**kwargs):
    nnx = pytest.importorskip("flax.nnx")  # flax is optional: only the layer's tests need it
    return jcc.nn.CausalConv1d(**{"features": 3, "kernel_size": 4, "rngs": nnx.Rngs(0), **kwargs})


def _decoding(batch=2, **kwargs):
    m = layer(**kwargs)
    m.init_cache(batch)
    return m


NN_CASES = [
    # constructor
    ("features_zero", lambda: layer(features=0), ValueError, "features"),
    ("features_negative", lambda: layer(features=-3), ValueError, "features"),
    ("features_float", lambda: layer(features=3.0), ValueError, "features"),
    ("features_bool", lambda: layer(features=True), ValueError, "features"),
    ("features_string", lambda: layer(features="3"), ValueError, "features"),
    ("kernel_size_0", lambda: layer(kernel_size=0), ValueError, "kernel_size"),
    ("kernel_size_257", lambda: layer(kernel_size=257), ValueError, "kernel_size"),
    ("kernel_size_float", lambda: layer(kernel_size=4.0), ValueError, "kernel_size"),
    ("kernel_size_bool", lambda: layer(kernel_size=True), ValueError, "kernel_size"),
    ("use_bias_string", lambda: layer(use_bias="no"), TypeError, "use_bias"),
    ("use_bias_int", lambda: layer(use_bias=0), TypeError, "use_bias"),
    ("activation_relu", lambda: layer(activation="relu"), ValueError, "activation"),
    ("dtype_int32", lambda: layer(dtype=jnp.int32), TypeError, "dtype"),
    ("dtype_complex64", lambda: layer(dtype=jnp.complex64), TypeError, "dtype"),
    ("dtype_float8", lambda: layer(dtype=jnp.float8_e4m3fn), TypeError, "dtype"),
    ("dtype_string", lambda: layer(dtype="fast"), TypeError, "dtype"),
    ("param_dtype_int32", lambda: layer(param_dtype=jnp.int32), TypeError, "param_dtype"),
    ("param_dtype_bool", lambda: layer(param_dtype=bool), TypeError, "param_dtype"),
    ("param_dtype_complex64", lambda: layer(param_dtype=jnp.complex64), TypeError, "param_dtype"),
    # init_cache
    ("batch_size_negative", lambda: layer().init_cache(-1), ValueError, "batch_size"),
    ("batch_size_float", lambda: layer().init_cache(2.5), ValueError, "batch_size"),
    ("batch_size_bool", lambda: layer().init_cache(True), ValueError, "batch_size"),
    ("cache_dtype_int32", lambda: layer().init_cache(2, jnp.int32), TypeError, "dtype"),
    # prefill call
    ("x_features", lambda: layer()(rand(2, 5, 4)), ValueError, "x"),
    ("x_rank2", lambda: layer()(rand(5, 3)), ValueError, "x"),
    ("x_rank4", lambda: layer()(rand(1, 2, 5, 3)), ValueError, "x"),
    ("x_length0", lambda: layer()(rand(2, 0, 3)), ValueError, "x"),
    ("x_int32", lambda: layer()(jnp.ones((2, 5, 3), jnp.int32)), TypeError, "x"),
    ("x_complex64", lambda: layer()(jnp.ones((2, 5, 3), jnp.complex64)), TypeError, "x"),
    ("x_string", lambda: layer()("x"), TypeError, "x"),
    ("seq_idx_float", lambda: layer()(rand(2, 5, 3), seq_idx=jnp.zeros((2, 5))), TypeError, "seq_idx"),
    ("seq_idx_shape", lambda: layer()(rand(2, 5, 3), seq_idx=jnp.zeros((2, 4), jnp.int32)),
     ValueError, "seq_idx"),
    ("initial_state_shape", lambda: layer()(rand(2, 5, 3), initial_state=rand(2, 2, 3)), ValueError,
     "initial_state"),
    ("return_final_state_int", lambda: layer()(rand(2, 5, 3), return_final_state=1), TypeError,
     "return_final_state"),
    # decode call
    ("decode_before_init_cache", lambda: layer()(rand(2, 3), decode=True), ValueError, "init_cache"),
    ("decode_seq_idx", lambda: _decoding()(rand(2, 3), decode=True, seq_idx=jnp.zeros((2, 1), jnp.int32)),
     ValueError, "seq_idx"),
    ("decode_batch", lambda: _decoding()(rand(3, 3), decode=True), ValueError, "x"),
    ("decode_prompt_batch", lambda: _decoding()(rand(3, 5, 3), decode=True), ValueError, "x"),
    ("decode_features", lambda: _decoding()(rand(2, 4), decode=True), ValueError, "x"),
    ("decode_dtype", lambda: _decoding()(rand(2, 3, dtype=jnp.float16), decode=True), TypeError, "x"),
    ("decode_int32", lambda: _decoding()(jnp.ones((2, 3), jnp.int32), decode=True), TypeError, "x"),
    ("decode_rank1", lambda: _decoding()(rand(3), decode=True), ValueError, "x"),
    ("decode_rank4", lambda: _decoding()(rand(2, 1, 1, 3), decode=True), ValueError, "x"),
    ("decode_no_tokens", lambda: _decoding()(rand(2, 0, 3), decode=True), ValueError, "x"),
]


@pytest.mark.parametrize("make,error,name", [pytest.param(*c[1:], id=c[0]) for c in NN_CASES])
def test_layer_invalid_raises_naming_argument(make, error, name):
    with pytest.raises(error) as info:
        make()
    needle = "init_cache" if name == "init_cache" else f"`{name}`"  # the fix, not an argument
    assert needle in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# 2. Valid extreme calls
# ---------------------------------------------------------------------------------------------

def conv_vjp(fn, a, seq_idx, cotangent, *, layout, activation="silu"):
    def f(a):
        return fn(a["x"], a["weight"], a["bias"], activation=activation,
                  initial_state=a["initial_state"], seq_idx=seq_idx, return_final_state=True,
                  layout=layout)

    out, pull = jax.vjp(f, a)
    return out, pull(cotangent)[0]


def conv_args(rng, batch, length, channels, width, layout, dtype=jnp.float32):
    x_shape = (batch, length, channels) if layout == "BLD" else (batch, channels, length)
    s_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    args = dict(
        x=jnp.asarray(rng.standard_normal(x_shape), dtype),
        weight=jnp.asarray(rng.standard_normal((channels, width)) / np.sqrt(width), acc),
        bias=jnp.asarray(rng.standard_normal(channels), acc),
        initial_state=jnp.asarray(rng.standard_normal(s_shape), dtype),
    )
    cotangent = (jnp.asarray(rng.standard_normal(x_shape), dtype),
                 jnp.asarray(rng.standard_normal(s_shape), dtype))
    return args, cotangent


def assert_matches(out, ref, dtype, what):
    for i, (o, r) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
        assert o.shape == r.shape, (what, i, o.shape, r.shape)
        err = relative_error(o, r)
        assert err <= TOLERANCE[jnp.dtype(dtype)], f"{what} leaf {i}: {err:.2e}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("batch,channels", [(0, 4), (2, 0), (0, 0)], ids=["B0", "D0", "B0D0"])
def test_empty_batch_or_channels_causal_conv1d(batch, channels, layout, dev):
    rng = np.random.default_rng(11)
    args, cot = conv_args(rng, batch, 7, channels, 4, layout)
    seq_idx = jnp.zeros((batch, 7), jnp.int32)
    out, grads = conv_vjp(jcc.causal_conv1d, *jax.device_put((args, seq_idx, cot), device(dev)),
                          layout=layout)
    out_ref, grads_ref = conv_vjp(reference.causal_conv1d, to_f64(args), seq_idx, to_f64(cot),
                                  layout=layout)
    assert_matches((out, grads), (out_ref, grads_ref), jnp.float32, "empty")
    assert np.all(np.asarray(grads["weight"]) == 0) and np.all(np.asarray(grads["bias"]) == 0)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", ["shift", "ring"])
@pytest.mark.parametrize("case", ["B0", "B0_pool", "pool0", "D0"])
def test_empty_update(case, mode, dev):
    """No rows, no rows with a pool, a pool of no rows (all rows padding), and no channels."""
    rng = np.random.default_rng(12)
    batch, pool, channels, width, slots = {
        "B0": (0, 0, 3, 3, 2), "B0_pool": (0, 4, 3, 3, 2), "pool0": (3, 0, 3, 3, 2),
        "D0": (2, 2, 0, 3, 2)}[case]
    x = jnp.asarray(rng.standard_normal((batch, 2, channels)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((pool, slots, channels)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((channels, width)), jnp.float32)
    kwargs = dict(activation="silu")
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.arange(batch, dtype=jnp.int32) * 5
    if case in ("B0_pool", "pool0"):
        kwargs["state_indices"] = jnp.arange(batch, dtype=jnp.int32)
    y, new_state = jcc.causal_conv1d_update(*jax.device_put((x, state, w), device(dev)), **kwargs)
    y_ref, state_ref = reference.causal_conv1d_update(*to_f64((x, state, w)), **kwargs)
    assert y.shape == x.shape and new_state.shape == state.shape
    assert_matches(y, y_ref, jnp.float32, "y")
    np.testing.assert_array_equal(np.asarray(new_state, np.float64), np.asarray(state_ref))
    if case == "pool0":
        assert np.all(np.asarray(y) == 0), "rows without a pool row are padding"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("num_seqs,channels", [(0, 3), (2, 0)], ids=["N0", "D0"])
def test_empty_varlen(num_seqs, channels, dev):
    rng = np.random.default_rng(13)
    T, K = 6, 3
    args = dict(x=jnp.asarray(rng.standard_normal((T, channels)), jnp.float32),
                weight=jnp.asarray(rng.standard_normal((channels, K)), jnp.float32),
                bias=jnp.asarray(rng.standard_normal(channels), jnp.float32),
                initial_states=jnp.asarray(rng.standard_normal((num_seqs, K - 1, channels)), jnp.float32))
    cu = jnp.asarray([0, 2, 5][: num_seqs + 1], jnp.int32)
    cot = (jnp.asarray(rng.standard_normal((T, channels)), jnp.float32),
           jnp.asarray(rng.standard_normal((num_seqs, K - 1, channels)), jnp.float32))

    def vjp(fn, a, cu, cot):
        out, pull = jax.vjp(lambda a: fn(a["x"], a["weight"], a["bias"], cu_seqlens=cu,
                                         activation="silu", initial_states=a["initial_states"],
                                         return_final_states=True), a)
        return out, pull(cot)[0]

    got = vjp(jcc.causal_conv1d_varlen, *jax.device_put((args, cu, cot), device(dev)))
    want = vjp(reference.causal_conv1d_varlen, to_f64(args), cu, to_f64(cot))
    assert_matches(got, want, jnp.float32, "varlen")


def test_layer_accepts_numpy_ints():
    m = layer(features=np.int64(3), kernel_size=np.int32(4))
    assert (m.features, m.kernel_size) == (3, 4) and m.kernel[...].shape == (3, 4)
    m.init_cache(np.int64(2))
    assert m.conv_state[...].shape == (2, 3, 3)


def test_layer_empty_batch():
    m = layer(activation="silu")
    x = rand(0, 5, 3)
    np.testing.assert_array_equal(np.asarray(m(x)), np.zeros((0, 5, 3)))
    m.init_cache(0)
    assert m(x, decode=True).shape == (0, 5, 3)
    assert m(rand(0, 3), decode=True).shape == (0, 3)
    assert m.conv_state[...].shape == (0, 3, 3)


# ---------------------------------------------------------------------------------------------
# 3. NaN and Inf
# ---------------------------------------------------------------------------------------------

NONFINITE = np.asarray([np.nan, np.inf, -np.inf])


def sprinkle(rng, a, fraction=0.1):
    """a with about `fraction` of its entries replaced by NaN, +Inf or -Inf."""
    a = np.array(a, np.float64)
    hit = rng.random(a.shape) < fraction
    a[hit] = rng.choice(NONFINITE, hit.sum())
    return a


def assert_same_nonfinite(out, ref, tol, what):
    """NaN, +Inf and -Inf at the same positions; the finite entries within `tol`."""
    out = np.asarray(jnp.asarray(out, jnp.float64))
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, what
    for kind, test in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        np.testing.assert_array_equal(test(out), test(ref), err_msg=f"{what}: {kind} positions differ")
    finite = np.isfinite(ref)
    err = relative_error(np.where(finite, out, 0), np.where(finite, ref, 0))
    assert err <= tol, f"{what}: finite entries differ by {err:.2e}"


def as_dtype(tree, dtype):
    return jax.tree.map(lambda a: None if a is None else jnp.asarray(a, dtype), tree)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("where", ["data", "parameters"])
@pytest.mark.parametrize("length", [24, 200])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_nonfinite_propagates_like_reference(packed, length, where, activation, layout, dev):
    """NaN/Inf in x, the initial state and both cotangents (data), or in weight and bias
    (parameters), with packed segments and padding or without seq_idx: the same non-finite
    positions everywhere. Rows of 200 times reach the GPU's segment kernels (more than 32 packs),
    rows of 24 the short-row ones; their activation derivatives are written differently. Plain
    float32 BLD rows reach the channel-last backward's edge steps, whose activations and dx taps
    are selected without branches."""
    # Plain seeds from 128: with those from 16 one case sprinkled no parameter.
    rng = np.random.default_rng(["data", "parameters"].index(where) * 4 + (activation is None) * 2
                                + (layout == "BDL") + 8 * (length != 24) + 128 * (not packed))
    B, L, D, K = 3, length, 4, 4
    args, (dy, dF) = conv_args(rng, B, L, D, K, layout, jnp.float64)
    first, padding = 3 * L // 8, L // 6
    seq_idx = jnp.asarray([[0] * first + [1] * (L - first - padding) + [-1] * padding, [5] * L,
                           [-1] * 3 + [2] * (L - 3)], jnp.int32) if packed else None
    if where == "data":
        args["x"] = sprinkle(rng, args["x"], 0.03)
        args["initial_state"] = sprinkle(rng, args["initial_state"])
        dy, dF = sprinkle(rng, dy, 0.03), sprinkle(rng, dF)
    else:
        args["weight"], args["bias"] = sprinkle(rng, args["weight"], 0.06), sprinkle(rng, args["bias"], 0.2)
    for dtype in (jnp.float64, jnp.float32):
        a = as_dtype(args, dtype)
        cot = as_dtype((dy, dF), dtype)
        (y, final), grads = conv_vjp(jcc.causal_conv1d, *jax.device_put((a, seq_idx, cot), device(dev)),
                                     layout=layout, activation=activation)
        (y_ref, final_ref), grads_ref = conv_vjp(reference.causal_conv1d, to_f64(a), seq_idx,
                                                 to_f64(cot), layout=layout, activation=activation)
        tol = TOLERANCE[jnp.dtype(dtype)]
        assert_same_nonfinite(y, y_ref, tol, f"{dtype.__name__} y")
        assert_same_nonfinite(final, final_ref, tol, f"{dtype.__name__} final_state")
        for name in grads:
            assert_same_nonfinite(grads[name], grads_ref[name], tol, f"{dtype.__name__} d{name}")
        assert not np.all(np.isfinite(np.asarray(y, np.float64))), "the case must reach y"


def time_slice(a, layout, sl):
    return a[:, sl] if layout == "BLD" else a[:, :, sl]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("fn", [jcc.causal_conv1d, reference.causal_conv1d], ids=["kernels", "reference"])
def test_padding_and_segments_isolate_nonfinite(fn, layout, dev):
    """Poison every padding position (x, dy, and the states of rows that start or end in
    padding) and one whole segment (x and dy): the other segments' y, dx and the rows' other
    outputs are unchanged, bit for bit, and dw and db stay finite without the poisoned segment."""
    rng = np.random.default_rng(21 + (layout == "BDL"))
    B, L, D, K = 3, 20, 3, 5
    args, (dy, dF) = conv_args(rng, B, L, D, K, layout, jnp.float64)
    ids = np.asarray([[-1] * 3 + [0] * 6 + [-2] * 2 + [1] * 6 + [-1] * 3,   # padding at both ends
                      [7] * 8 + [-5] * 4 + [3] * 8,                          # ends in a segment
                      [-1] * 20], np.int32)                                   # all padding
    seq_idx = jnp.asarray(ids)

    def poison(a, mask_bt):
        """NaN/Inf wherever mask_bt (B, time) is set, in either layout."""
        a = np.array(a)
        m = np.expand_dims(mask_bt, 2 if layout == "BLD" else 1)
        m = np.broadcast_to(m, a.shape)
        a[m] = rng.choice(NONFINITE, m.sum())
        return jnp.asarray(a)

    padding = ids < 0
    starts_padding = np.repeat(padding[:, :1], K - 1, axis=1)
    ends_padding = np.repeat(padding[:, -1:], K - 1, axis=1)
    clean = (args, (dy, dF))
    pad_args = dict(args, x=poison(args["x"], padding),
                    initial_state=poison(args["initial_state"], starts_padding))
    pad_cot = (poison(dy, padding), poison(dF, ends_padding))
    segment = ids == 0  # a real segment: its own outputs may become non-finite, nothing else
    seg_args = dict(pad_args, x=poison(pad_args["x"], segment))
    seg_cot = (poison(pad_cot[0], segment), pad_cot[1])

    def run(a, cot):
        return conv_vjp(fn, *jax.device_put((a, seq_idx, cot), device(dev)), layout=layout)

    (y0, f0), g0 = run(*clean)
    (y1, f1), g1 = run(pad_args, pad_cot)
    (y2, f2), g2 = run(seg_args, seg_cot)
    # Padding contents reach nothing: every output and gradient stays finite.
    for name, v in [("y", y1), ("final_state", f1), *g1.items()]:
        assert np.all(np.isfinite(np.asarray(v))), f"padding NaN reached {name}"
    # They do not even change a bit of any output that is not itself padding.
    keep = ~padding
    m = np.broadcast_to(np.expand_dims(keep, 2 if layout == "BLD" else 1), y0.shape)
    np.testing.assert_array_equal(np.asarray(y1)[m], np.asarray(y0)[m])
    np.testing.assert_array_equal(np.asarray(g1["x"])[m], np.asarray(g0["x"])[m])
    np.testing.assert_array_equal(np.asarray(f1), np.asarray(f0))
    # A poisoned segment reaches its own y and dx, and dw/db, but not the other segments or rows.
    others = keep & ~segment
    m = np.broadcast_to(np.expand_dims(others, 2 if layout == "BLD" else 1), y0.shape)
    np.testing.assert_array_equal(np.asarray(y2)[m], np.asarray(y0)[m])
    np.testing.assert_array_equal(np.asarray(g2["x"])[m], np.asarray(g0["x"])[m])
    np.testing.assert_array_equal(np.asarray(f2), np.asarray(f0))
    np.testing.assert_array_equal(np.asarray(g2["initial_state"]), np.asarray(g0["initial_state"]))
    assert not np.all(np.isfinite(np.asarray(time_slice(y2, layout, slice(3, 9)))))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", ["shift", "ring"])
def test_update_nonfinite(mode, dev):
    """NaN/Inf in x and in the state reach the same y positions as in the reference, and never
    leave padding rows, unused pool rows or slots older than the window."""
    rng = np.random.default_rng(31 + (mode == "ring"))
    B, T, D, K, S, pool = 4, 2, 3, 3, 5, 7
    x = rng.standard_normal((B, T, D))
    state = rng.standard_normal((pool, S, D))
    w = jnp.asarray(rng.standard_normal((D, K)), jnp.float64)
    indices = np.asarray([4, -3, 0, 9], np.int32)  # rows 1 and 3 are padding
    kwargs = dict(activation="silu", state_indices=jnp.asarray(indices))
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.asarray([6, 1, 1, 12], jnp.int32)
        # Row 0 (c = 6, pool row 4) reads positions 4, 5 -> slots 4, 0; row 2 (c = 1, pool
        # row 0) reads positions -1 (zero), 0 -> slot 0.
        stale = {4: [1, 2, 3], 0: [1, 2, 3, 4]}
    else:
        stale = {4: [0, 1, 2], 0: [0, 1, 2]}  # only the last K-1 = 2 slots are read
    unused = [r for r in range(pool) if r not in (4, 0)]
    poisoned = state.copy()
    for row, slots in stale.items():
        poisoned[row, slots] = rng.choice(NONFINITE, (len(slots), D))
    poisoned[unused] = rng.choice(NONFINITE, (len(unused), S, D))
    x_poisoned = x.copy()
    x_poisoned[[1, 3]] = np.nan
    for dtype in (jnp.float64, jnp.float32):
        args = as_dtype((x_poisoned, poisoned, w), dtype)
        y, new_state = jcc.causal_conv1d_update(*jax.device_put(args, device(dev)), **kwargs)
        y_ref, state_ref = reference.causal_conv1d_update(*to_f64(args), **kwargs)
        assert np.all(np.isfinite(np.asarray(y))), "stale slots, unused rows or padding reached y"
        assert np.all(np.asarray(y)[[1, 3]] == 0)
        np.testing.assert_array_equal(np.asarray(new_state, np.float64), np.asarray(state_ref))
        np.testing.assert_array_equal(np.asarray(new_state, np.float64)[unused],
                                      np.asarray(args[1], np.float64)[unused])
        assert relative_error(y, y_ref) <= TOLERANCE[jnp.dtype(dtype)]
        # Now in the window and the new tokens of live rows: positions as in the reference.
        args = as_dtype((sprinkle(rng, x, 0.2), sprinkle(rng, state, 0.2), w), dtype)
        y, _ = jcc.causal_conv1d_update(*jax.device_put(args, device(dev)), **kwargs)
        y_ref, _ = reference.causal_conv1d_update(*to_f64(args), **kwargs)
        assert_same_nonfinite(y, y_ref, TOLERANCE[jnp.dtype(dtype)], f"{dtype.__name__} y")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("fn", [jcc.causal_conv1d_varlen, reference.causal_conv1d_varlen],
                         ids=["kernels", "reference"])
@pytest.mark.parametrize("states", [False, True])
def test_varlen_nonfinite(states, fn, dev):
    """NaN/Inf in padding tokens reach nothing; in one sequence they stay in that sequence (and
    in dw, db); elsewhere they land where the reference puts them."""
    rng = np.random.default_rng(41 + states)
    T, D, K = 20, 3, 4
    cu = jnp.asarray([2, 6, 6, 13, 16], jnp.int32)  # padding 0-1 and 16-19, an empty sequence
    N = 4
    args = dict(x=rng.standard_normal((T, D)), weight=rng.standard_normal((D, K)),
                bias=rng.standard_normal(D),
                initial_states=rng.standard_normal((N, K - 1, D)) if states else None)
    cot = (rng.standard_normal((T, D)), rng.standard_normal((N, K - 1, D)))

    def run(a, c):
        a, c = as_dtype(a, jnp.float64), as_dtype(c, jnp.float64)
        out, pull = jax.vjp(lambda a: fn(a["x"], a["weight"], a["bias"], cu_seqlens=cu,
                                         activation="silu", initial_states=a["initial_states"],
                                         return_final_states=True),
                            jax.device_put(a, device(dev)))
        return out, pull(jax.device_put(c, device(dev)))[0]

    (y0, f0), g0 = run(args, cot)
    padding = np.r_[0:2, 16:20]
    x = args["x"].copy()
    x[padding] = rng.choice(NONFINITE, (len(padding), D))
    dy = cot[0].copy()
    dy[padding] = np.nan
    (y1, f1), g1 = run(dict(args, x=x), (dy, cot[1]))
    for name, v in [("y", y1), ("final_states", f1), *((k, v) for k, v in g1.items() if v is not None)]:
        assert np.all(np.isfinite(np.asarray(v))), f"padding NaN reached {name}"
    # Equal up to rounding: the reference's scatter-adds run in no fixed order on GPUs.
    def unchanged(a, b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)

    unchanged(np.asarray(y1)[2:16], np.asarray(y0)[2:16])
    x[6:13] = np.nan  # sequence 2
    (y2, f2), g2 = run(dict(args, x=x), (dy, cot[1]))
    others = np.r_[2:6, 13:16]
    unchanged(np.asarray(y2)[others], np.asarray(y0)[others])
    unchanged(np.asarray(g2["x"])[others], np.asarray(g0["x"])[others])
    unchanged(np.asarray(f2)[[0, 1, 3]], np.asarray(f0)[[0, 1, 3]])
    assert np.all(np.isnan(np.asarray(y2)[6:13]))


@pytest.mark.parametrize("dev", DEVICES)
def test_varlen_nonfinite_like_reference(dev):
    rng = np.random.default_rng(45)
    T, D, K, N = 24, 3, 3, 3
    cu = jnp.asarray([0, 7, 15, 21], jnp.int32)
    args = dict(x=sprinkle(rng, rng.standard_normal((T, D)), 0.05), weight=rng.standard_normal((D, K)),
                bias=rng.standard_normal(D),
                initial_states=sprinkle(rng, rng.standard_normal((N, K - 1, D)), 0.1))
    cot = (sprinkle(rng, rng.standard_normal((T, D)), 0.05),
           sprinkle(rng, rng.standard_normal((N, K - 1, D)), 0.1))
    for dtype in (jnp.float64, jnp.float32):
        a, c = as_dtype(args, dtype), as_dtype(cot, dtype)

        def run(fn, a, c):
            out, pull = jax.vjp(lambda a: fn(a["x"], a["weight"], a["bias"], cu_seqlens=cu,
                                             activation="silu", initial_states=a["initial_states"],
                                             return_final_states=True), a)
            return out, pull(c)[0]

        (y, f), g = run(jcc.causal_conv1d_varlen, *jax.device_put((a, c), device(dev)))
        (y_ref, f_ref), g_ref = run(reference.causal_conv1d_varlen, to_f64(a), to_f64(c))
        tol = TOLERANCE[jnp.dtype(dtype)]
        assert_same_nonfinite(y, y_ref, tol, "y")
        assert_same_nonfinite(f, f_ref, tol, "final_states")
        for name in g:
            assert_same_nonfinite(g[name], g_ref[name], tol, f"d{name}")


# ---------------------------------------------------------------------------------------------
# 4. Values no trace-time check can see
# ---------------------------------------------------------------------------------------------

def hand_conv(x, w, b, ids, state=None):
    """DESIGN.md section 2 for one row in float64 numpy: x (L, D), w (D, K), ids (L,)."""
    L, D = x.shape
    P = w.shape[1] - 1
    ext = np.concatenate([np.zeros((P, D)) if state is None else state, x])
    seg = np.concatenate([np.full(P, ids[0]), ids])
    y = np.zeros((L, D))
    for t in range(L):
        if ids[t] < 0:
            continue
        z = b.copy()
        for k in range(P + 1):
            if seg[t + k] == ids[t]:
                z += w[:, k] * ext[t + k]
        y[t] = z
    return y


@pytest.mark.parametrize("dev", DEVICES)
def test_seq_idx_ids_are_only_compared(dev):
    """Ids need not be sorted, dense or contiguous: equal non-negative ids within K-1 steps are
    joined (an id that reappears reconnects, also to the initial state), every negative id is
    padding; relabelling ids one-to-one (keeping signs) changes no bit of any result."""
    rng = np.random.default_rng(51)
    L, D, K = 16, 3, 4
    base = np.asarray([[0, 0, 0, 1, 1, 0, 0, -1, 2, 2, -1, 2, 0, 0, 0, 0],
                       [3, 3, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0, -4, -4]], np.int32)
    relabel = {0: 2**31 - 1, 1: 7, 2: 0, 3: 123456, -1: INT32_MIN, -4: -1}
    relabelled = np.vectorize(relabel.get)(base).astype(np.int32)
    x = rng.standard_normal((2, L, D))
    state = rng.standard_normal((2, K - 1, D))
    w = rng.standard_normal((D, K))
    b = rng.standard_normal(D)
    dy = rng.standard_normal((2, L, D))
    outs = []
    for ids in (base, relabelled):
        def f(x, w, b, s, ids=ids):
            return jcc.causal_conv1d(x, w, b, initial_state=s, seq_idx=jnp.asarray(ids),
                                     return_final_state=True)

        (y, final), pull = jax.vjp(f, *jax.device_put((x, w, b, state), device(dev)))
        outs.append((y, final, pull((jnp.asarray(dy), jnp.ones_like(final)))))
        for r in range(2):
            np.testing.assert_allclose(np.asarray(y[r]), hand_conv(x[r], w, b, base[r], state[r]),
                                       rtol=1e-12, atol=1e-12)
    for a, b_ in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", ["shift", "ring"])
def test_state_indices_out_of_range_are_padding(mode, dev):
    """Any index < 0 or >= pool (up to the int32 limits) gives y = 0 and touches no state; rows
    with distinct valid indices are unaffected by the others, even by duplicated indices."""
    rng = np.random.default_rng(52 + (mode == "ring"))
    pool, S, D, K, T = 4, 3, 3, 3, 2
    state = jnp.asarray(rng.standard_normal((pool, S, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, K)), jnp.float32)
    indices = np.asarray([2, -1, pool, INT32_MAX, INT32_MIN, 0, 3, 3], np.int32)  # 3 twice
    B = len(indices)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    kwargs = dict(activation="silu")
    if mode == "ring":
        kwargs["cache_seqlens"] = jnp.asarray(rng.integers(0, 20, B), jnp.int32)
    y, new_state = jcc.causal_conv1d_update(*jax.device_put((x, state, w), device(dev)),
                                            state_indices=jnp.asarray(indices), **kwargs)
    padding = [1, 2, 3, 4]
    assert np.all(np.asarray(y)[padding] == 0)
    # The distinct valid rows, alone, give the same y and pool rows bit for bit.
    live = [0, 5]
    alone_kwargs = {k: v[jnp.asarray(live)] for k, v in kwargs.items() if k == "cache_seqlens"}
    y_alone, state_alone = jcc.causal_conv1d_update(
        x[jnp.asarray(live)], state, w, activation="silu", state_indices=jnp.asarray(indices[live]),
        **alone_kwargs)
    np.testing.assert_array_equal(np.asarray(y)[live], np.asarray(y_alone))
    np.testing.assert_array_equal(np.asarray(new_state)[[0, 1, 2]], np.asarray(state_alone)[[0, 1, 2]])
    assert np.all(np.isfinite(np.asarray(y)[[6, 7]])) and np.all(np.isfinite(np.asarray(new_state)))


@pytest.mark.parametrize("dev", DEVICES)
def test_cache_seqlens_any_int32(dev):
    """Positions are exact for every int32 cache_seqlens: positions < 0 read zeros (and are
    still written to slot p mod S); c and c + S*m agree whenever c - (K-1) >= 0."""
    rng = np.random.default_rng(54)
    B, T, D, K, S = 7, 3, 2, 4, 5
    # INT32_MAX: positions past int32 (the kernels compute them in 64 bits).
    cache = np.asarray([0, 2, S + 1, INT32_MAX - T + 1, INT32_MAX, INT32_MIN, -2], np.int32)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float64)
    state = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float64)
    w = jnp.asarray(rng.standard_normal((D, K)), jnp.float64)
    y, new_state = jcc.causal_conv1d_update(*jax.device_put((x, state, w), device(dev)),
                                            cache_seqlens=jnp.asarray(cache))
    y_ref, state_ref = reference.causal_conv1d_update(x, state, w, cache_seqlens=jnp.asarray(cache))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(new_state), np.asarray(state_ref))
    # By hand: the window is positions c-3 .. c+T-1, slot p mod S (floor), zero for p < 0.
    xs, st, wn = np.asarray(x), np.asarray(state), np.asarray(w)
    for b, c in enumerate(cache.astype(np.int64)):
        window = [st[b, p % S] if p >= 0 else np.zeros(D) for p in range(c - K + 1, c)]
        window = np.concatenate([np.stack(window), xs[b]])
        expect = np.stack([sum(wn[:, k] * window[t + k] for k in range(K)) for t in range(T)])
        np.testing.assert_allclose(np.asarray(y[b]), expect, rtol=1e-12, atol=1e-12)
        ring = st[b].copy()
        for t in range(T):
            ring[(c + t) % S] = xs[b, t]
        np.testing.assert_array_equal(np.asarray(new_state[b]), ring)


def per_sequence(x, w, b, cu, states):
    """Each effective sequence through causal_conv1d alone (float64), padding zero."""
    T = x.shape[0]
    eff = np.clip(np.maximum.accumulate(cu), 0, T)
    y = np.zeros_like(x)
    finals = []
    for i in range(len(cu) - 1):
        lo, hi = eff[i], eff[i + 1]
        s = states[i][None]
        if hi > lo:
            yi, fi = jcc.causal_conv1d(x[None, lo:hi], w, b, initial_state=s, return_final_state=True)
            y[lo:hi] = np.asarray(yi[0])
            finals.append(np.asarray(fi[0]))
        else:
            finals.append(states[i])
    return y, np.stack(finals)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("cu", [[0, 5, 3, 9], [4, -3, 8, 30], [12, 2, 1, 0], [-5, 40, 41, 50]],
                         ids=["decreasing", "negative_and_past_T", "reversed", "all_past_T"])
def test_cu_seqlens_out_of_order_or_past_T(cu, dev):
    """cu_seqlens is read as its running maximum clipped to [0, T]: the same result as those
    offsets, and as running each of those sequences alone."""
    rng = np.random.default_rng(55)
    T, D, K = 12, 3, 3
    x = rng.standard_normal((T, D))
    w = rng.standard_normal((D, K))
    b = rng.standard_normal(D)
    states = rng.standard_normal((len(cu) - 1, K - 1, D))
    cu = np.asarray(cu, np.int32)
    eff = np.clip(np.maximum.accumulate(cu), 0, T).astype(np.int32)

    def run(offsets):
        return jcc.causal_conv1d_varlen(*jax.device_put((x, w, b), device(dev)),
                                        cu_seqlens=jnp.asarray(offsets),
                                        initial_states=jax.device_put(states, device(dev)),
                                        return_final_states=True)

    y, final = run(cu)
    y_eff, final_eff = run(eff)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_eff))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_eff))
    y_alone, final_alone = per_sequence(x, w, b, cu, states)
    np.testing.assert_allclose(np.asarray(y), y_alone, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), final_alone, rtol=1e-12, atol=1e-12)
    y_ref, final_ref = reference.causal_conv1d_varlen(x, w, b, cu_seqlens=jnp.asarray(cu),
                                                      initial_states=states, return_final_states=True)
    np.testing.assert_allclose(np.asarray(y_ref), y_alone, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final_ref), final_alone, rtol=1e-12, atol=1e-12)
