"""Prefill and token-by-token generation with a tiny Mamba-style block, checked against a full pass.

The block is the conv half of a Mamba layer (no SSM): embed -> in-proj into (u, gate) ->
CausalConv1d(u) with silu -> u * silu(gate) -> out-proj (residual) -> logits. Generation keeps only
the conv's (B, K-1, D) cache: the prompt is prefilled with the parallel kernel from the empty
cache, then each new token runs causal_conv1d_update. The script asserts that the logits seen
while generating equal those of one full forward over the same tokens.

Run: python examples/decode.py   (CPU: a few seconds; uses the GPU when JAX has one)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_causal_conv.nn import CausalConv1d
from jax_causal_conv.reference import relative_error


class TinyMamba(nnx.Module):
    def __init__(self, vocab: int, embed: int, inner: int, kernel_size: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, embed, rngs=rngs)
        self.in_proj = nnx.Linear(embed, 2 * inner, rngs=rngs)
        self.conv = CausalConv1d(inner, kernel_size, activation="silu", rngs=rngs)
        self.out_proj = nnx.Linear(inner, embed, rngs=rngs)
        self.lm_head = nnx.Linear(embed, vocab, rngs=rngs)

    def init_cache(self, batch_size: int) -> None:
        self.conv.init_cache(batch_size)

    def __call__(self, tokens: jax.Array, *, decode: bool = False) -> jax.Array:
        """tokens (B, L) -> logits (B, L, vocab); with decode, also tokens (B,) -> logits (B, vocab)."""
        h = self.embed(tokens)
        u, gate = jnp.split(self.in_proj(h), 2, axis=-1)
        u = self.conv(u, decode=decode)
        return self.lm_head(h + self.out_proj(u * jax.nn.silu(gate)))


@nnx.jit
def forward(model: TinyMamba, tokens: jax.Array) -> jax.Array:
    return model(tokens)


@nnx.jit
def decode_step(model: TinyMamba, tokens: jax.Array) -> jax.Array:
    return model(tokens, decode=True)


def main(batch: int = 2, prompt_len: int = 12, new_tokens: int = 16) -> None:
    vocab = 64
    model = TinyMamba(vocab, embed=32, inner=64, kernel_size=4, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (batch, prompt_len), 0, vocab, dtype=jnp.int32)

    model.init_cache(batch)
    prefill_logits = decode_step(model, prompt)  # (B, prompt_len, vocab)
    token = jnp.argmax(prefill_logits[:, -1], axis=-1).astype(jnp.int32)
    generated, step_logits = [], []
    for _ in range(new_tokens):
        generated.append(token)
        logits = decode_step(model, token)  # (B, vocab), from the cached conv state
        step_logits.append(logits)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    tokens = jnp.concatenate([prompt, jnp.stack(generated, axis=1)], axis=1)
    decoded = jnp.concatenate([prefill_logits, jnp.stack(step_logits, axis=1)], axis=1)
    full = forward(model, tokens)
    err = relative_error(decoded, full)
    print(f"device: {jax.devices()[0].platform}; generated {new_tokens} tokens per row after a "
          f"{prompt_len}-token prompt")
    print("row 0:", np.asarray(tokens[0, prompt_len:]).tolist())
    print(f"relative difference, decoded vs full-forward logits: {err:.2e}")
    assert err <= 1e-5, f"decoded logits differ from the full forward: {err:.2e}"


if __name__ == "__main__":
    main()
