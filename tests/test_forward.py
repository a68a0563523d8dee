"""Forward of causal_conv1d (the FFI kernels) against the float64 reference (issue 2, item 5).

The full grid (layout x dtype x K x L x D x bias x states x seq_idx x activation x weight dtypes)
has millions of points, so it is sampled: every (K, L) pair of the issue's grid is one case, and
every other axis is dealt over those cases from a shuffled, balanced deck with a fixed seed, so
each value of each axis appears several times and the selection never changes between runs.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, DTYPES, assert_close, device, make_inputs, to_f64

import jax_causal_conv
from jax_causal_conv import causal_conv1d, reference

WIDTHS = (1, 2, 3, 4, 5, 8, 17, 64)
CHANNELS = (1, 3, 64, 130)
ACTIVATIONS = (None, "silu", "swish")
# Weight and bias dtypes are independent of x's (DESIGN.md section 3).
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
BIAS_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Time offsets around the CUDA backward's 64-step tiles (the forward is pointwise and has none).
TILE_EDGE_OFFSETS = (62, 63, 64, 65, 66, 127, 128, 129)


def lengths(width: int) -> list[int]:
    """The issue's L values for width K, without the non-positive ones."""
    return sorted({n for n in (1, 2, width - 2, width - 1, width, 63, 64, 65, 1000) if n >= 1})


def _deal(rng, values, count):
    """`count` items holding every value of `values` equally often (+-1), in shuffled order."""
    deck = [values[i % len(values)] for i in range(count)]
    return [deck[i] for i in rng.permutation(count)]


def _grid_cases():
    pairs = [(k, n) for k in WIDTHS for n in lengths(k)]
    rng = np.random.default_rng(20240602)
    axes = dict(
        layout=("BLD", "BDL"),
        dtype=tuple(DTYPES),
        channels=CHANNELS,
        batch=(1, 2, 3),
        bias=(True, False),
        initial_state=(True, False),
        final_state=(True, False),
        seq_idx=(True, False),
        activation=ACTIVATIONS,
        weight_dtype=WEIGHT_DTYPES,
        bias_dtype=BIAS_DTYPES,
        jit=(True, False),
    )
    dealt = {name: _deal(rng, values, len(pairs)) for name, values in axes.items()}
    cases = []
    for i, (width, length) in enumerate(pairs):
        case = {name: column[i] for name, column in dealt.items()}
        case.update(width=width, length=length, seed=i)
        cases.append(case)
    return axes, cases


GRID_AXES, GRID_CASES = _grid_cases()


def _case_id(c) -> str:
    return (
        f"K{c['width']}-L{c['length']}-D{c['channels']}-B{c['batch']}-{c['layout']}-"
        f"{jnp.dtype(c['dtype']).name}-w{jnp.dtype(c['weight_dtype']).name}"
        f"-{'b' + jnp.dtype(c['bias_dtype']).name if c['bias'] else 'nobias'}"
        f"{'-init' if c['initial_state'] else ''}{'-final' if c['final_state'] else ''}"
        f"{'-seq' if c['seq_idx'] else ''}-{c['activation']}-{'jit' if c['jit'] else 'eager'}"
    )


def reference_outputs(inputs, **options):
    """The reference on the CPU in float64 (seq_idx stays int32)."""
    floats = {k: v for k, v in inputs.items() if k != "seq_idx"}
    args = jax.device_put(dict(to_f64(floats), seq_idx=inputs["seq_idx"]), jax.devices("cpu")[0])
    return jax.jit(partial(reference.causal_conv1d, **options))(
        args["x"], args["weight"], args["bias"], initial_state=args["initial_state"],
        seq_idx=args["seq_idx"],
    )


def run_and_compare(inputs, dev, *, dtype, activation=None, return_final_state=False,
                    layout="BLD", jit=True, what=""):
    """Runs causal_conv1d on `dev` and the float64 reference on the CPU; checks y (and F)."""
    args = jax.device_put(inputs, device(dev))
    fn = partial(causal_conv1d, activation=activation, return_final_state=return_final_state,
                 layout=layout)
    if jit:
        fn = jax.jit(fn)
    out = fn(args["x"], args["weight"], args["bias"], initial_state=args["initial_state"],
             seq_idx=args["seq_idx"])
    ref = reference_outputs(inputs, activation=activation, return_final_state=return_final_state,
                            layout=layout)

    outs, refs = (out, ref) if return_final_state else ((out,), (ref,))
    for name, o, r in zip(("y", "final_state"), outs, refs):
        assert o.dtype == jnp.dtype(dtype), (name, o.dtype)
        assert o.devices() == {device(dev)}, (name, o.devices())
        assert_close(o, r, dtype, f"{what} {name}")


def test_grid_sample_covers_every_value():
    """The sampled grid holds every (K, L) pair and every value of every other axis."""
    pairs = {(c["width"], c["length"]) for c in GRID_CASES}
    assert pairs == {(k, n) for k in WIDTHS for n in lengths(k)}
    for name, values in GRID_AXES.items():
        seen = [c[name] for c in GRID_CASES]
        for v in values:
            assert any(s is v or s == v for s in seen), (name, v)


@pytest.mark.parametrize("case", GRID_CASES, ids=_case_id)
@pytest.mark.parametrize("dev", DEVICES)
def test_forward_grid(dev, case):
    rng = np.random.default_rng(case["seed"])
    inputs = make_inputs(
        rng, batch=case["batch"], length=case["length"], channels=case["channels"],
        width=case["width"], dtype=case["dtype"], layout=case["layout"], bias=case["bias"],
        initial_state=case["initial_state"], seq_idx=case["seq_idx"],
    )
    inputs["weight"] = inputs["weight"].astype(case["weight_dtype"])
    if case["bias"]:
        inputs["bias"] = inputs["bias"].astype(case["bias_dtype"])
    run_and_compare(
        inputs, dev, dtype=case["dtype"], activation=case["activation"],
        return_final_state=case["final_state"], layout=case["layout"], jit=case["jit"],
        what=_case_id(case),
    )


# L < K - 1: the leading entries of the final state come from the initial state (or are zero);
# with seq_idx they survive only if the row's last segment is its first one.
SHORT = [(3, 1), (4, 2), (5, 3), (8, 1), (17, 15), (64, 2), (64, 62)]


@pytest.mark.parametrize("initial_state", [True, False], ids=["init", "noinit"])
@pytest.mark.parametrize("width,length", SHORT)
@pytest.mark.parametrize("dev", DEVICES)
def test_final_state_shorter_than_state(dev, width, length, initial_state):
    i = SHORT.index((width, length))
    layout = ("BLD", "BDL")[i % 2]
    dtype = DTYPES[i % len(DTYPES)]
    rng = np.random.default_rng(100 + i)
    inputs = make_inputs(rng, batch=3, length=length, channels=5, width=width, dtype=dtype,
                         layout=layout, initial_state=initial_state)
    run_and_compare(inputs, dev, dtype=dtype, activation="silu", return_final_state=True,
                    layout=layout, jit=bool(i % 2), what=f"K{width} L{length}")
    if length > 1:
        # Row 0: one segment; row 1: a boundary inside x, so F takes nothing from S;
        # row 2 ends in padding, so F is zero.
        seq = np.zeros((3, length), np.int32)
        seq[1, length // 2:] = 1
        seq[2, -1] = -1
        inputs["seq_idx"] = jnp.asarray(seq)
        run_and_compare(inputs, dev, dtype=dtype, activation=None, return_final_state=True,
                        layout=layout, jit=not i % 2, what=f"K{width} L{length} seq_idx")


def _boundary_rows(width: int, length: int) -> np.ndarray:
    """Two rows per offset b: a segment boundary at b, and trailing padding from b."""
    offsets = sorted({b for b in (*TILE_EDGE_OFFSETS, *range(1, width + 1)) if 0 < b < length})
    rows = []
    for b in offsets:
        boundary = np.zeros(length, np.int32)
        boundary[b:] = 1
        padded = np.zeros(length, np.int32)
        padded[b:] = -1
        rows += [boundary, padded]
    # Short segments and padding between segments, crossing every tile edge at once.
    dense = np.arange(length, dtype=np.int32) // 3
    dense[dense % 5 == 4] = -1
    rows.append(dense)
    return np.stack(rows)


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dev", DEVICES)
def test_seq_idx_boundaries_near_tile_edges(dev, width, layout):
    i = WIDTHS.index(width)
    dtype = DTYPES[(i + (layout == "BDL")) % len(DTYPES)]
    length = 200
    seq = _boundary_rows(width, length)
    rng = np.random.default_rng(200 + i)
    inputs = make_inputs(rng, batch=seq.shape[0], length=length, channels=5, width=width,
                         dtype=dtype, layout=layout, initial_state=True)
    inputs["seq_idx"] = jnp.asarray(seq)
    run_and_compare(inputs, dev, dtype=dtype, activation="silu", return_final_state=True,
                    layout=layout, jit=layout == "BLD", what=f"K{width}")


@pytest.mark.parametrize(
    "dtype,weight_dtype,bias_dtype",
    [
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.float32, jnp.bfloat16, jnp.float16),
        (jnp.float16, jnp.float64, jnp.bfloat16),
        (jnp.float64, jnp.float16, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    ],
    ids=lambda d: jnp.dtype(d).name,
)
@pytest.mark.parametrize("dev", DEVICES)
def test_weight_and_bias_dtypes_independent_of_x(dev, dtype, weight_dtype, bias_dtype):
    rng = np.random.default_rng(300)
    inputs = make_inputs(rng, batch=2, length=70, channels=6, width=4, dtype=dtype,
                         initial_state=True)
    inputs["weight"] = inputs["weight"].astype(weight_dtype)
    inputs["bias"] = inputs["bias"].astype(bias_dtype)
    run_and_compare(inputs, dev, dtype=dtype, activation="silu", return_final_state=True)


@pytest.mark.parametrize("dev", DEVICES)
def test_widest_kernel(dev):
    rng = np.random.default_rng(400)
    inputs = make_inputs(rng, batch=2, length=300, channels=3, width=256, dtype=jnp.float32,
                         layout="BDL", initial_state=True, seq_idx=True)
    run_and_compare(inputs, dev, dtype=jnp.float32, activation="silu", return_final_state=True,
                    layout="BDL")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dev", DEVICES)
def test_swish_is_silu(dev, jit):
    rng = np.random.default_rng(500)
    inputs = jax.device_put(
        make_inputs(rng, batch=2, length=33, channels=7, width=4, dtype=jnp.float32, seq_idx=True),
        device(dev),
    )

    def run(activation):
        fn = partial(causal_conv1d, activation=activation)
        fn = jax.jit(fn) if jit else fn
        return fn(inputs["x"], inputs["weight"], inputs["bias"], seq_idx=inputs["seq_idx"])

    silu, swish, plain = run("silu"), run("swish"), run(None)
    np.testing.assert_array_equal(np.asarray(swish), np.asarray(silu))
    # Guards against both names silently meaning "no activation".
    assert not np.allclose(np.asarray(silu), np.asarray(plain))


# ---- lowering: our custom call where we have kernels, the reference everywhere else ----

_OUR_CUSTOM_CALL = re.compile(r"custom_call\s*@" + re.escape(jax_causal_conv._native.TARGET_PREFIX))


def _lowering_case(dev, layout):
    rng = np.random.default_rng(600)
    inputs = make_inputs(rng, batch=2, length=40, channels=6, width=5, dtype=jnp.float32,
                         layout=layout, initial_state=True, seq_idx=True)
    args = jax.device_put(inputs, device(dev))

    # A fresh function per call, so no lowering cached from another test is reused.
    def f(x, weight, bias, initial_state, seq_idx):
        return causal_conv1d(x, weight, bias, activation="silu", initial_state=initial_state,
                             seq_idx=seq_idx, return_final_state=True, layout=layout)

    lowered = jax.jit(f).lower(args["x"], args["weight"], args["bias"], args["initial_state"],
                               args["seq_idx"])
    y, final = lowered.compile()(args["x"], args["weight"], args["bias"], args["initial_state"],
                                 args["seq_idx"])
    ref_y, ref_final = reference_outputs(inputs, activation="silu", return_final_state=True,
                                         layout=layout)
    assert_close(y, ref_y, jnp.float32, "y")
    assert_close(final, ref_final, jnp.float32, "final_state")
    return lowered.as_text()


def _lowering_platform(dev) -> str:
    return "cpu" if dev == "cpu" else "cuda"


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_native_lowering_is_our_custom_call(dev, layout):
    assert _lowering_platform(dev) in jax_causal_conv._native.native_platforms
    assert _OUR_CUSTOM_CALL.search(_lowering_case(dev, layout))


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("dev", DEVICES)
def test_platform_without_kernels_lowers_to_reference(dev, layout, monkeypatch):
    """A platform missing from native_platforms (TPU, ROCm) gets the reference lowering."""
    platform = _lowering_platform(dev)
    monkeypatch.setattr(
        jax_causal_conv._native, "native_platforms",
        jax_causal_conv._native.native_platforms - {platform},
    )
    assert not _OUR_CUSTOM_CALL.search(_lowering_case(dev, layout))


# The measure every tolerance in the tests is read against (reference.TOLERANCE), public so that
# users check their own numbers the same way.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_relative_error(dtype):
    rng = np.random.default_rng()
    ref = rng.standard_normal((3, 17))
    out = jnp.asarray(ref + 1e-2 * rng.standard_normal(ref.shape), dtype)
    expected = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert reference.relative_error(out, ref) == pytest.approx(expected, rel=1e-12)
    assert reference.relative_error(ref, ref) == 0.0
    zeros = np.zeros_like(ref)
    assert reference.relative_error(ref, zeros) == pytest.approx(np.linalg.norm(ref), rel=1e-12)
    with_nan = ref.copy()
    with_nan[1, 2] = np.nan
    assert reference.relative_error(with_nan, ref) == float("inf")
    assert reference.relative_error(ref, with_nan) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        reference.relative_error(ref, ref[:2])
