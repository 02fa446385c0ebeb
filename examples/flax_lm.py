"""A small character-level transformer language model in Flax (linen), trained twice on text
that ships with Python: once with Flax's default attention (causal mask) and once with
jax_flash (`attention_fn=jax_flash.flax.causal_attention`, no mask). Prints both loss curves
and the step times.

    python examples/flax_lm.py [--steps 300]

Same initialisation, same batches: the curves agree up to float rounding (bf16 noise on
the GPU, where the model computes in bfloat16).
"""

import argparse
import inspect
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn

import jax_flash.flax


def corpus() -> np.ndarray:
    # Standard-library source code: always there, a few hundred KB of text.
    text = "".join(inspect.getsource(m) for m in (json.decoder, json.encoder, inspect, argparse))
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8)


class Block(nn.Module):
    heads: int
    dtype: jnp.dtype
    attention_fn: object

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype, attention_fn=self.attention_fn)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * x.shape[-1], dtype=self.dtype)(h)
        return x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h))


class CharLM(nn.Module):
    width: int = 128
    depth: int = 2
    heads: int = 4
    dtype: jnp.dtype = jnp.float32
    use_jax_flash: bool = False

    @nn.compact
    def __call__(self, tokens):
        T = tokens.shape[-1]
        x = nn.Embed(256, self.width)(tokens) + self.param("pos", nn.initializers.normal(0.02), (T, self.width))
        if self.use_jax_flash:
            attention_fn, mask = jax_flash.flax.causal_attention, None  # causal flag, no dense mask
        else:
            attention_fn, mask = nn.dot_product_attention, nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(self.heads, self.dtype, attention_fn)(x.astype(self.dtype), mask)
        return nn.Dense(256)(nn.LayerNorm()(x.astype(jnp.float32)))


def train(use_jax_flash: bool, data: np.ndarray, steps: int, batch: int, seq: int, dtype, seed: int = 0):
    model = CharLM(dtype=dtype, use_jax_flash=use_jax_flash)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq - 1, size=(steps, batch))
    batches = np.stack([np.stack([data[s:s + seq + 1] for s in row]) for row in starts]).astype(np.int32)
    params = model.init(jax.random.key(seed), batches[0, :, :-1])
    opt = optax.adamw(3e-3)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, b):
        def loss_fn(p):
            logits = model.apply(p, b[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batches[i])
        losses.append(float(loss))  # blocks: the step time includes the device work
        times.append(time.perf_counter() - t0)
    return np.array(losses), float(np.median(times[5:])) if steps > 10 else float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32  # the GPU kernels take 16-bit inputs
    data = corpus()
    print(f"backend {jax.default_backend()}, {len(data)} characters, {args.steps} steps of "
          f"{args.batch} x {args.seq}, dtype {jnp.dtype(dtype).name}")
    ref, t_ref = train(False, data, args.steps, args.batch, args.seq, dtype)
    ours, t_ours = train(True, data, args.steps, args.batch, args.seq, dtype)
    print("| step | loss (Flax attention) | loss (jax_flash) |")
    print("|---|---|---|")
    for i in sorted({0, *range(args.steps // 10, args.steps, max(1, args.steps // 10)), args.steps - 1}):
        print(f"| {i} | {ref[i]:.4f} | {ours[i]:.4f} |")
    print(f"max |loss difference| over all steps: {np.max(np.abs(ref - ours)):.2e}")
    print(f"median step time: Flax attention {t_ref * 1e3:.1f} ms, jax_flash {t_ours * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
