"""The CPU kernels on shapes that span several of their tiles and run on several threads.

The other tests use short sequences, which the CPU kernels run as one tile on the calling thread.
Here the shapes cross tile boundaries in time and channels (a tile recomputes delta on its right
halo and owns only its dx and dw/db terms) and exceed the threading threshold, with packed
segments, padding inside a row, initial and final states, in both layouts, at a compile-time
width (4) and a runtime one (17). A forward with fewer tiles than threads cuts them shorter: a
child process with 16 threads must give the same bits, forward and backward, as one with one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_inputs, random_seq_idx, to_f64

from jax_causal_conv import causal_conv1d, reference

# (batch, length, channels) per layout: "BLD" tiles are runs of 512 to a few thousand channels
# (1024 at float32 K = 4, 512 at K = 17) by at least 128 steps, "BDL" tiles up to 8192 steps of a
# few channel rows.
SHAPES = {"BLD": (2, 700, 1100), "BDL": (2, 9000, 20)}


def vjp_all(fn, args, seq_idx, cotangent, layout):
    def f(x, weight, bias, initial_state):
        return fn(x, weight, bias, activation="silu", initial_state=initial_state, seq_idx=seq_idx,
                  return_final_state=True, layout=layout)

    out, pull = jax.vjp(f, *args)
    return out, pull(cotangent)


def case(layout, width, seed):
    rng = np.random.default_rng(seed)
    batch, length, channels = SHAPES[layout]
    made = make_inputs(rng, batch=batch, length=length, channels=channels, width=width,
                       dtype=jnp.float32, layout=layout, initial_state=True)
    seq = random_seq_idx(rng, batch, length)
    seq[0, length // 3: length // 3 + 5] = -1  # padding inside a row
    seq[-1, length // 2:] += 7                 # labels that jump
    args = (made["x"], made["weight"], made["bias"], made["initial_state"])
    y_shape, s_shape = made["x"].shape, made["initial_state"].shape
    cotangent = (jnp.asarray(rng.standard_normal(y_shape), jnp.float32),
                 jnp.asarray(rng.standard_normal(s_shape), jnp.float32))
    return args, jnp.asarray(seq), cotangent


@pytest.mark.parametrize("width", [4, 17])
@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_many_tiles_match_reference(layout, width):
    args, seq, cotangent = case(layout, width, seed=width)
    run = jax.jit(lambda a, s, c: vjp_all(causal_conv1d, a, s, c, layout))
    (y, final), grads = run(args, seq, cotangent)
    (y_ref, final_ref), grads_ref = jax.jit(
        lambda a, s, c: vjp_all(reference.causal_conv1d, a, s, c, layout)
    )(to_f64(args), seq, to_f64(cotangent))
    assert_close(y, y_ref, jnp.float32, "y")
    assert_close(final, final_ref, jnp.float32, "final_state")
    for name, g, r in zip(("dx", "dweight", "dbias", "dinitial_state"), grads, grads_ref):
        assert_close(g, r, jnp.float32, name)


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
def test_many_tiles_deterministic(layout):
    args, seq, cotangent = case(layout, 4, seed=5)
    run = jax.jit(lambda a, s, c: vjp_all(causal_conv1d, a, s, c, layout))
    first = [np.asarray(v) for v in jax.tree.leaves(run(args, seq, cotangent))]
    for _ in range(3):
        again = [np.asarray(v) for v in jax.tree.leaves(run(args, seq, cotangent))]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


# A forward of several tiles, fewer than the pool's threads, has its time cut into shorter tiles,
# down to 32 steps (cpu_kernels.cc, `Tiling`); the backward's tiles never depend on the threads.
# XLA sizes the pool by PJRT_NPROC, so a child process with 16 threads takes that path on any
# machine, and one with a single thread runs the plain tiles; both must give the same bits,
# forward and backward. Shapes: 4 tiles cut into 16 of 64 (BLD) or 128 (BDL) steps; 2 tiles cut
# into 32-step ones, shorter than K = 40's halo.
SPLIT_CASES = [  # batch, length, channels, width, layout, dtype
    (2, 512, 256, 4, "BLD", jnp.bfloat16),
    (2, 512, 256, 2, "BDL", jnp.bfloat16),
    (2, 256, 256, 17, "BLD", jnp.float32),
    (2, 256, 256, 40, "BLD", jnp.float32),
    (2, 256, 256, 40, "BDL", jnp.bfloat16),
]

# The child's script: each case's y, final state and four gradients through our kernels, as
# float32 arrays. It has its own vjp_all: importing this module would import conftest, which puts
# back the 8 fake devices (and so 8 pool threads) before XLA starts.
IN_CHILD = """
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jax_causal_conv import causal_conv1d


def vjp_all(x, weight, bias, initial_state, seq_idx, dy, dfinal, layout):
    def f(x, weight, bias, initial_state):
        return causal_conv1d(x, weight, bias, activation="silu", initial_state=initial_state,
                             seq_idx=seq_idx, return_final_state=True, layout=layout)

    out, pull = jax.vjp(f, x, weight, bias, initial_state)
    return (*out, *pull((dy, dfinal)))


data = np.load(sys.argv[1])
out = {}
for i in range(int(data["cases"])):
    arg = lambda name: data[f"{i}/{name}"]
    dtype = jnp.dtype(str(arg("dtype")))
    args = [jnp.asarray(arg("x"), dtype), arg("weight"), arg("bias"),
            jnp.asarray(arg("initial_state"), dtype), arg("seq_idx"),
            jnp.asarray(arg("dy"), dtype), jnp.asarray(arg("dfinal"), dtype)]
    values = jax.jit(vjp_all, static_argnums=7)(*args, str(arg("layout")))
    for j, value in enumerate(values):
        out[f"{i}/{j}"] = np.asarray(value, np.float32)
out["pool_threads"] = -1
if os.path.isdir("/proc/self/task"):  # Linux: XLA names its intra-op pool's threads "tf_XLAEigen"
    thread_names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    out["pool_threads"] = sum("XLAEigen" in name for name in thread_names)
np.savez(sys.argv[2], **out)
"""


def test_tiles_cut_for_many_threads(tmp_path):
    rng = np.random.default_rng(62)
    inputs, cases = {"cases": len(SPLIT_CASES)}, []
    for i, (batch, length, channels, width, layout, dtype) in enumerate(SPLIT_CASES):
        case = make_inputs(rng, batch=batch, length=length, channels=channels, width=width,
                           dtype=dtype, layout=layout, initial_state=True, seq_idx=True)
        case["dy"] = jnp.asarray(rng.standard_normal(case["x"].shape), dtype)
        case["dfinal"] = jnp.asarray(rng.standard_normal(case["initial_state"].shape), dtype)
        cases.append(case)
        for name, value in case.items():
            inputs[f"{i}/{name}"] = np.asarray(value, np.float32 if name != "seq_idx" else None)
        inputs[f"{i}/layout"], inputs[f"{i}/dtype"] = layout, jnp.dtype(dtype).name
    np.savez(tmp_path / "inputs.npz", **inputs)
    outputs = {}
    for threads in (1, 16):
        env = dict(os.environ, PJRT_NPROC=str(threads), JAX_PLATFORMS="cpu")
        # One CPU device, not conftest's 8: XLA gives the pool at least a thread per device.
        env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                    if "xla_force_host_platform_device_count" not in flag)
        path = tmp_path / f"threads{threads}.npz"
        # cwd: not the source tree, whose package has no compiled modules.
        subprocess.run([sys.executable, "-c", IN_CHILD, str(tmp_path / "inputs.npz"), str(path)],
                       check=True, cwd="/", env=env)
        outputs[threads] = np.load(path)
    # Where the child could count them, its pool must have had the 16 threads that cut the tiles.
    pool_threads = int(outputs[16]["pool_threads"])
    if pool_threads >= 0:
        assert pool_threads >= 16, f"PJRT_NPROC=16 gave XLA's pool {pool_threads} threads"
    names = ("y", "final_state", "dx", "dweight", "dbias", "dinitial_state")
    for i, case in enumerate(cases):
        layout, dtype = SPLIT_CASES[i][4], SPLIT_CASES[i][5]
        args = (case["x"], case["weight"], case["bias"], case["initial_state"])
        out_ref, grads_ref = jax.jit(
            lambda a, s, c: vjp_all(reference.causal_conv1d, a, s, c, layout)
        )(to_f64(args), case["seq_idx"], to_f64((case["dy"], case["dfinal"])))
        for j, (name, ref) in enumerate(zip(names, (*out_ref, *grads_ref))):
            ours = outputs[16][f"{i}/{j}"]
            np.testing.assert_array_equal(ours, outputs[1][f"{i}/{j}"],
                                          err_msg=f"case {i} {name}: 16 threads and 1")
            assert_close(ours, ref, dtype, f"case {i} {name}")
