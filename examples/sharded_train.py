"""Trains a small Mamba-style block with data and sequence (context) parallelism under plain jit.

The block is in-projection -> causal_conv1d (silu) -> gate -> out-projection, with a residual.
It learns to imitate a randomly initialised "teacher" block on random inputs. Inputs are sharded
over a (data, seq) mesh with NamedSharding; there is no shard_map: causal_conv1d partitions itself,
exchanging only (K-1)-step halos between sequence neighbours. The same training then runs on one
device and the two loss curves must agree to float32 tolerance.

    python examples/sharded_train.py                     # CPU, 2x2 mesh of fake host devices
    python examples/sharded_train.py --mesh 4x2          # CPU, 8 fake devices
    python examples/sharded_train.py --gpus 2            # 2 GPUs, 1x2 (data x seq) mesh
    python examples/sharded_train.py --gpus 4 --mesh 2x2
"""

from __future__ import annotations

import argparse
import os
import re


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None,
                        help="run on this many GPUs; without it, run on fake CPU devices")
    parser.add_argument("--mesh", default=None,
                        help="DATAxSEQ mesh shape (default 2x2 on CPU, 1xN on N GPUs)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--width", type=int, default=4, help="conv kernel width K")
    args = parser.parse_args()
    default = "2x2" if args.gpus is None else f"1x{args.gpus}"
    args.data, args.seq = (int(n) for n in (args.mesh or default).lower().split("x"))
    return args


ARGS = parse_args()
if ARGS.gpus is None:
    # XLA reads these once, when jax initializes: fake CPU devices for the mesh.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={ARGS.data * ARGS.seq}"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_causal_conv import causal_conv1d  # noqa: E402

D_MODEL, D_INNER = 32, 64


def init_params(key, width):
    k_in, k_conv, k_bias, k_out = jax.random.split(key, 4)
    return dict(
        in_proj=jax.random.normal(k_in, (D_MODEL, 2 * D_INNER)) / np.sqrt(D_MODEL),
        conv_weight=jax.random.normal(k_conv, (D_INNER, width)) / np.sqrt(width),
        conv_bias=0.1 * jax.random.normal(k_bias, (D_INNER,)),
        out_proj=jax.random.normal(k_out, (D_INNER, D_MODEL)) / np.sqrt(D_INNER),
    )


def block(params, u):
    """u: (batch, length, D_MODEL) -> same shape."""
    x, gate = jnp.split(u @ params["in_proj"], 2, axis=-1)
    x = causal_conv1d(x, params["conv_weight"], params["conv_bias"], activation="silu")
    return u + (x * jax.nn.silu(gate)) @ params["out_proj"]


def loss_fn(params, u, target):
    return jnp.mean((block(params, u) - target) ** 2)


def train(params, u, target, steps):
    """Adam on the imitation loss; returns the loss of every step and the compiled step's HLO."""
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, u, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, u, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    hlo = step.lower(params, opt_state, u, target).compile().as_text()
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, u, target)
        losses.append(float(loss))
    return np.asarray(losses), hlo


def main():
    # Full float32 matmuls (no TF32 on GPUs), so that the two runs can agree to float32 tolerance.
    jax.config.update("jax_default_matmul_precision", "highest")
    platform = "cpu" if ARGS.gpus is None else "gpu"
    n_devices = ARGS.data * ARGS.seq
    devices = jax.devices(platform)
    if ARGS.gpus is not None and ARGS.gpus > len(devices):
        raise SystemExit(f"asked for {ARGS.gpus} GPUs, found {len(devices)}")
    if n_devices > len(devices[: ARGS.gpus or None]):
        raise SystemExit(f"a {ARGS.data}x{ARGS.seq} mesh needs {n_devices} {platform} devices")
    mesh = jax.sharding.Mesh(np.array(devices[:n_devices]).reshape(ARGS.data, ARGS.seq),
                             ("data", "seq"))
    print(f"mesh {dict(mesh.shape)} on {platform}; batch {ARGS.batch}, length {ARGS.length}, "
          f"K={ARGS.width}")

    teacher = init_params(jax.random.key(0), ARGS.width)
    student = init_params(jax.random.key(1), ARGS.width)
    u = jax.random.normal(jax.random.key(2), (ARGS.batch, ARGS.length, D_MODEL))
    target = jax.jit(block)(teacher, u)

    tokens = NamedSharding(mesh, P("data", "seq"))
    replicated = NamedSharding(mesh, P())
    sharded_losses, hlo = train(jax.device_put(student, replicated), jax.device_put(u, tokens),
                                jax.device_put(target, tokens), ARGS.steps)
    single_losses, _ = train(*jax.device_put((student, u, target), devices[0]), ARGS.steps)

    for i in range(0, ARGS.steps, max(1, ARGS.steps // 10)):
        print(f"step {i:3d}  loss {sharded_losses[i]:.6f}  (one device: {single_losses[i]:.6f})")
    print(f"step {ARGS.steps - 1:3d}  loss {sharded_losses[-1]:.6f}  "
          f"(one device: {single_losses[-1]:.6f})")
    counts = {kind: len(re.findall(rf"\b{kind}(?:-start)?\(", hlo))
              for kind in ("all-gather", "all-to-all", "collective-permute", "all-reduce")}
    print("collectives in the compiled sharded step:", counts)

    assert sharded_losses[-1] < 0.5 * sharded_losses[0], "the loss did not go down"
    np.testing.assert_allclose(sharded_losses, single_losses, rtol=1e-5, atol=1e-6)
    print("sharded and single-device losses match")


if __name__ == "__main__":
    main()
