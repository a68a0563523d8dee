"""jax_causal_conv.nn.CausalConv1d: forward against the reference, the decode cache, nnx.jit,
nnx.split/merge, PyTorch weight loading and optax training."""

from __future__ import annotations

import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICES, assert_close, device, random_seq_idx, to_f64

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jax_causal_conv as jcc  # noqa: E402
from jax_causal_conv import reference  # noqa: E402
from jax_causal_conv.nn import CausalConv1d  # noqa: E402


def layer(features=6, kernel_size=4, seed=0, **kwargs):
    return CausalConv1d(features, kernel_size, activation="silu", rngs=nnx.Rngs(seed), **kwargs)


def assign(variable, value):
    # flax >= 0.12 deprecates the `.value` setter in favour of set_value, which older flax lacks.
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:
        variable.value = value


def randomize_bias(model, rng):
    # The default bias is zeros; a random one makes the bias path visible to the checks.
    assign(model.bias, jnp.asarray(rng.standard_normal(model.bias[...].shape), jnp.float32))


def test_package_import_does_not_import_flax():
    code = (
        "import sys, jax_causal_conv; "
        "assert 'flax' not in sys.modules and 'jax_causal_conv.nn' not in sys.modules; "
        "jax_causal_conv.nn; assert 'flax' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")  # cwd: not the source tree


def test_lazy_import_and_parameters():
    assert jcc.nn.CausalConv1d is CausalConv1d
    model = layer(features=6, kernel_size=4)
    assert model.kernel[...].shape == (6, 4) and model.bias[...].shape == (6,)
    bound = 1 / np.sqrt(4)  # PyTorch's default conv1d bound for fan-in K
    assert 0 < np.abs(np.asarray(model.kernel[...])).max() <= bound
    assert CausalConv1d(6, 4, use_bias=False, rngs=nnx.Rngs(0)).bias is None
    with pytest.raises(ValueError, match="`kernel_size`"):
        CausalConv1d(6, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`activation`"):
        CausalConv1d(6, 3, activation="tanh", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dev", DEVICES)
def test_forward_matches_reference(dev):
    rng = np.random.default_rng(0)
    B, L, D, K = 2, 11, 6, 4
    model = layer(D, K)
    randomize_bias(model, rng)
    x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    seq_idx = jnp.asarray(random_seq_idx(rng, B, L))
    state = jnp.asarray(rng.standard_normal((B, K - 1, D)), jnp.float32)
    args = jax.device_put((x, seq_idx, state), device(dev))

    @nnx.jit
    def apply(model, x, seq_idx, state):
        return model(x, seq_idx=seq_idx, initial_state=state, return_final_state=True)

    y, final = apply(model, *args)
    y_ref, final_ref = reference.causal_conv1d(
        *to_f64((x, model.kernel[...], model.bias[...])), activation="silu", seq_idx=seq_idx,
        initial_state=to_f64(state), return_final_state=True,
    )
    assert_close(y, y_ref, jnp.float32, "y")
    assert_close(final, final_ref, jnp.float32, "final state")


def test_dtype_casts_input():
    rng = np.random.default_rng(1)
    model = layer(dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 7, 6)), jnp.float32)
    y = model(x)
    y_ref = reference.causal_conv1d(
        *to_f64((x.astype(jnp.bfloat16), model.kernel[...], model.bias[...])), activation="silu"
    )
    assert y.dtype == jnp.bfloat16
    assert_close(y, y_ref, jnp.bfloat16, "bfloat16 y")


@pytest.mark.parametrize("dev", DEVICES)
def test_decode_cache_matches_full_forward(dev):
    rng = np.random.default_rng(2)
    B, D, K, prompt, steps = 3, 6, 4, 5, 4
    model = layer(D, K)
    randomize_bias(model, rng)
    x = jax.device_put(jnp.asarray(rng.standard_normal((B, prompt + steps, D)), jnp.float32), device(dev))
    y_full = model(x)

    with pytest.raises(ValueError, match="init_cache"):
        model(x[:, :1], decode=True)
    model.init_cache(B)
    assert model.conv_state[...].shape == (B, K - 1, D)

    @nnx.jit
    def decode(model, x):
        return model(x, decode=True)

    ys = [decode(model, x[:, :prompt])]  # the prompt: parallel forward from the (zero) cache
    for t in range(prompt, prompt + steps - 1):
        ys.append(decode(model, x[:, t])[:, None])  # one (B, D) token: causal_conv1d_update
    ys.append(decode(model, x[:, -1:]))  # one (B, 1, D) token
    assert_close(jnp.concatenate(ys, axis=1), y_full, jnp.float32, "decoded y")
    np.testing.assert_array_equal(np.asarray(model.conv_state[...]), np.asarray(x[:, -(K - 1):]))

    # The cache travels through split / merge.
    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(clone.conv_state[...]), np.asarray(model.conv_state[...]))
    token = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    expected = jcc.causal_conv1d_update(
        token, model.conv_state[...], model.kernel[...], model.bias[...], activation="silu"
    )[0]
    np.testing.assert_array_equal(np.asarray(clone(token, decode=True)), np.asarray(expected))


def test_split_merge_roundtrip():
    rng = np.random.default_rng(3)
    model = layer()
    randomize_bias(model, rng)
    x = jnp.asarray(rng.standard_normal((2, 9, 6)), jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda p: 2 * p, params)
    doubled = nnx.merge(graphdef, params)
    y_ref = reference.causal_conv1d(
        *to_f64((x, 2 * model.kernel[...], 2 * model.bias[...])), activation="silu"
    )
    assert_close(doubled(x), y_ref, jnp.float32, "merged layer")


def test_load_pytorch_weight():
    # A PyTorch depthwise conv1d stores its weight as (D, 1, K) and computes, for padding K-1 and
    # the outputs truncated to the first L, y[t] = b + sum_k w[:, 0, k] * x[t - (K-1) + k].
    rng = np.random.default_rng(4)
    D, K, L = 4, 3, 8
    torch_weight = rng.standard_normal((D, 1, K)).astype(np.float32)
    torch_bias = rng.standard_normal(D).astype(np.float32)
    model = CausalConv1d(D, K, rngs=nnx.Rngs(0))
    assign(model.kernel, jnp.asarray(torch_weight[:, 0, :]))
    assign(model.bias, jnp.asarray(torch_bias))
    x = rng.standard_normal((1, L, D))
    padded = np.concatenate([np.zeros((1, K - 1, D)), x], axis=1)
    expected = torch_bias + sum(torch_weight[:, 0, k] * padded[:, k : k + L] for k in range(K))
    assert_close(model(jnp.asarray(x, jnp.float32)), expected, jnp.float32, "PyTorch-loaded layer")


def make_optimizer(model, tx):
    # flax >= 0.11 needs `wrt` and takes the model in update(); older versions do not.
    if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters:
        return nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.Optimizer(model, tx)


def optimizer_step(optimizer, model, grads):
    if "model" in inspect.signature(optimizer.update).parameters:
        optimizer.update(model, grads)
    else:
        optimizer.update(grads)


def test_optax_training():
    rng = np.random.default_rng(5)
    B, L, D, K = 4, 16, 6, 4
    model = layer(D, K)
    randomize_bias(model, rng)
    x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
    # A reachable target: the output of another conv of the same form.
    target = reference.causal_conv1d(
        x, jnp.asarray(rng.standard_normal((D, K)) / np.sqrt(K), jnp.float32),
        jnp.asarray(rng.standard_normal(D), jnp.float32), activation="silu",
    )

    def loss_fn(model):
        return jnp.mean((model(x) - target) ** 2)

    def reference_loss(kernel, bias):
        y = reference.causal_conv1d(x, kernel, bias, activation="silu")
        return jnp.mean((y - target) ** 2)

    grads = nnx.grad(loss_fn)(model)
    ref_grads = jax.grad(reference_loss, argnums=(0, 1))(*to_f64((model.kernel[...], model.bias[...])))
    assert_close(grads.kernel[...], ref_grads[0], jnp.float32, "d kernel")
    assert_close(grads.bias[...], ref_grads[1], jnp.float32, "d bias")

    optimizer = make_optimizer(model, optax.adam(5e-2))

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer_step(optimizer, model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(8)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.7 * losses[0], losses
    assert_close(loss_fn(model), reference_loss(*to_f64((model.kernel[...], model.bias[...]))),
                 jnp.float32, "loss after training")
