"""Trace-time validation of causal_conv1d and its reference (issue 2, item 4; DESIGN.md section 3).

Each case breaks one argument of an otherwise valid call and expects ValueError (bad value or
shape) or TypeError (bad dtype or type) with the argument's name, in backticks, in the message.
The same corpus runs against the kernels' API and the reference, eagerly and under jax.jit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_causal_conv import causal_conv1d, reference

B, L, D, K = 2, 8, 4, 3
P = K - 1
FUNCTIONS = [
    pytest.param(causal_conv1d, "causal_conv1d", id="kernels"),
    pytest.param(reference.causal_conv1d, "reference.causal_conv1d", id="reference"),
]
ARRAY_ARGS = ("x", "weight", "bias", "initial_state", "seq_idx")


def valid_call(layout: str = "BLD") -> dict:
    """A call that passes validation, using every argument."""
    rng = np.random.default_rng(0)
    x_shape = (B, L, D) if layout == "BLD" else (B, D, L)
    s_shape = (B, P, D) if layout == "BLD" else (B, D, P)
    return dict(
        x=jnp.asarray(rng.standard_normal(x_shape), jnp.float32),
        weight=jnp.asarray(rng.standard_normal((D, K)), jnp.float32),
        bias=jnp.asarray(rng.standard_normal(D), jnp.float32),
        initial_state=jnp.asarray(rng.standard_normal(s_shape), jnp.float32),
        seq_idx=jnp.asarray(np.repeat([[0, 0, 0, 1, 1, 1, 1, -1]], B, axis=0), jnp.int32),
        activation="silu",
        return_final_state=True,
        layout=layout,
    )


@dataclass(frozen=True)
class Case:
    id: str
    change: Callable[[dict], dict]  # valid call -> invalid call
    error: type
    name: str  # the argument the message must name
    layout: str = "BLD"
    also: tuple[str, ...] = field(default=())  # further words the message must contain


def _set(**changes):
    return lambda call: {**call, **changes}


def _map(name, f):
    return lambda call: {**call, name: f(call[name])}


RNG = np.random.default_rng(1)


def _rand(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


CASES = [
    # x
    Case("x_rank2", _map("x", lambda x: x[0]), ValueError, "x"),
    Case("x_rank4", _map("x", lambda x: x[..., None]), ValueError, "x"),
    Case("x_length0_BLD", _map("x", lambda x: x[:, :0]), ValueError, "x"),
    Case("x_length0_BDL", _map("x", lambda x: x[:, :, :0]), ValueError, "x", layout="BDL"),
    Case("x_int32", _map("x", lambda x: x.astype(jnp.int32)), TypeError, "x"),
    Case("x_bool", _map("x", lambda x: x > 0), TypeError, "x"),
    Case("x_complex64", _map("x", lambda x: x.astype(jnp.complex64)), TypeError, "x"),
    Case("x_float8", _map("x", lambda x: x.astype(jnp.float8_e4m3fn)), TypeError, "x"),
    Case("x_string", _set(x="abc"), TypeError, "x"),
    Case("x_none", _set(x=None), TypeError, "x"),
    Case("x_ragged_list", _set(x=[[1.0, 2.0], [3.0]]), TypeError, "x"),
    # weight
    Case("weight_rank1", _map("weight", lambda w: w[:, 0]), ValueError, "weight"),
    Case("weight_torch_rank3", _map("weight", lambda w: w[:, None, :]), ValueError, "weight"),
    Case("weight_channels", _set(weight=_rand(D + 1, K)), ValueError, "weight"),
    Case("weight_K0", _map("weight", lambda w: w[:, :0]), ValueError, "weight", also=("K=0",)),
    Case("weight_K257", _set(weight=_rand(D, 257)), ValueError, "weight", also=("K=257",)),
    Case("weight_int32", _map("weight", lambda w: w.astype(jnp.int32)), TypeError, "weight"),
    Case("weight_bool", _map("weight", lambda w: w > 0), TypeError, "weight"),
    Case("weight_none", _set(weight=None), TypeError, "weight"),
    # bias
    Case("bias_rank2", _map("bias", lambda b: b[None]), ValueError, "bias"),
    Case("bias_channels", _set(bias=_rand(D + 1)), ValueError, "bias"),
    Case("bias_int32", _map("bias", lambda b: b.astype(jnp.int32)), TypeError, "bias"),
    Case("bias_complex64", _map("bias", lambda b: b.astype(jnp.complex64)), TypeError, "bias"),
    # initial_state: (B, P, D) for BLD, (B, D, P) for BDL, in x's dtype
    Case("state_too_short", _set(initial_state=_rand(B, P - 1, D)), ValueError, "initial_state"),
    Case("state_too_long", _set(initial_state=_rand(B, P + 1, D)), ValueError, "initial_state"),
    Case("state_BDL_shape_with_BLD", _set(initial_state=_rand(B, D, P)), ValueError,
         "initial_state"),
    Case("state_BLD_shape_with_BDL", _set(initial_state=_rand(B, P, D)), ValueError,
         "initial_state", layout="BDL"),
    Case("state_rank2", _set(initial_state=_rand(B, P * D)), ValueError, "initial_state"),
    Case("state_batch", _set(initial_state=_rand(B + 1, P, D)), ValueError, "initial_state"),
    Case("state_float16", _map("initial_state", lambda s: s.astype(jnp.float16)), TypeError,
         "initial_state"),
    Case("state_int32", _map("initial_state", lambda s: s.astype(jnp.int32)), TypeError,
         "initial_state"),
    # seq_idx: int32 (B, L)
    Case("seq_idx_int64", _map("seq_idx", lambda s: s.astype(jnp.int64)), TypeError, "seq_idx"),
    Case("seq_idx_float32", _map("seq_idx", lambda s: s.astype(jnp.float32)), TypeError,
         "seq_idx"),
    Case("seq_idx_uint32", _map("seq_idx", lambda s: s.astype(jnp.uint32)), TypeError, "seq_idx"),
    Case("seq_idx_bool", _map("seq_idx", lambda s: s >= 0), TypeError, "seq_idx"),
    Case("seq_idx_short", _map("seq_idx", lambda s: s[:, 1:]), ValueError, "seq_idx"),
    Case("seq_idx_rank1", _map("seq_idx", lambda s: s[0]), ValueError, "seq_idx"),
    Case("seq_idx_rank3", _map("seq_idx", lambda s: s[..., None]), ValueError, "seq_idx"),
    Case("seq_idx_channels_BDL", _set(seq_idx=jnp.zeros((B, D), jnp.int32)), ValueError,
         "seq_idx", layout="BDL"),
    # activation
    Case("activation_relu", _set(activation="relu"), ValueError, "activation"),
    Case("activation_capitalised", _set(activation="SiLU"), ValueError, "activation"),
    Case("activation_bool", _set(activation=True), ValueError, "activation"),
    # layout
    Case("layout_unknown", _set(layout="BTD"), ValueError, "layout"),
    Case("layout_lowercase", _set(layout="bld"), ValueError, "layout"),
    Case("layout_none", _set(layout=None), ValueError, "layout"),
    # BDL-shaped tensors passed with layout="BLD": D is read from the wrong axis of x.
    Case("layout_mismatch", lambda call: {**valid_call("BDL"), "layout": "BLD"}, ValueError,
         "weight", also=("layout='BLD'",)),
    # return_final_state must be a static Python bool
    Case("final_state_int", _set(return_final_state=1), TypeError, "return_final_state"),
    Case("final_state_str", _set(return_final_state="yes"), TypeError, "return_final_state"),
    Case("final_state_none", _set(return_final_state=None), TypeError, "return_final_state"),
    Case("final_state_array", _set(return_final_state=jnp.bool_(True)), TypeError,
         "return_final_state"),
]


def call_op(fn, call: dict, jit: bool):
    """Calls fn with `call`; under jit the array arguments are traced, the rest static."""
    if not jit:
        return fn(call["x"], call["weight"], call["bias"],
                  **{k: v for k, v in call.items() if k not in ("x", "weight", "bias")})
    static = {k: v for k, v in call.items() if k not in ARRAY_ARGS}

    def traced(x, weight, bias, initial_state, seq_idx):
        return fn(x, weight, bias, initial_state=initial_state, seq_idx=seq_idx, **static)

    return jax.jit(traced)(*(call[k] for k in ARRAY_ARGS))


def _traceable(call: dict) -> bool:
    """Whether jax.jit accepts the array arguments (it rejects strings and lists before the op)."""
    return all(call[k] is None or hasattr(call[k], "dtype") for k in ARRAY_ARGS)


def test_corpus_ids_are_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) >= 25


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fn,fn_name", FUNCTIONS)
def test_valid_call_passes(fn, fn_name, jit, layout):
    """The call every case starts from is valid, so each case's error comes from its change."""
    y, final = call_op(fn, valid_call(layout), jit)
    assert y.shape == valid_call(layout)["x"].shape
    assert final.shape == valid_call(layout)["initial_state"].shape


def _case_params():
    """Every case eagerly, and under jit when jax.jit itself accepts its array arguments."""
    params = []
    for case in CASES:
        params.append(pytest.param(case, False, id=f"{case.id}-eager"))
        if _traceable(case.change(valid_call(case.layout))):
            params.append(pytest.param(case, True, id=f"{case.id}-jit"))
    return params


@pytest.mark.parametrize("case,jit", _case_params())
@pytest.mark.parametrize("fn,fn_name", FUNCTIONS)
def test_invalid_call_raises_naming_argument(fn, fn_name, case, jit):
    with pytest.raises(case.error) as info:
        call_op(fn, case.change(valid_call(case.layout)), jit)
    message = str(info.value)
    assert message.startswith(f"{fn_name}: "), message
    assert f"`{case.name}`" in message, message
    for word in case.also:
        assert word in message, message
