"""The optional inputs on the GPU: the Hopper kernels (implementation=None) against the portable
ones. Prints ms per call (median of rounds) for the forward and for forward + backward, and
TFLOP/s over the same-segment pairs (bias / mask: over every pair the causal rule leaves, as
for a call without them; backward = 2.5x the forward's FLOPs, FlashAttention's count).
  python3 tools/segment_bench.py            # packed sequences: 1 / 8 / 64 equal segments
  python3 tools/segment_bench.py --dense    # a bias [1, 1, T, S] float32 / a mask [B, 1, T, S]
  python3 tools/segment_bench.py --dropout  # dropout 0.1, and the same call without it
  add --fwd to time the forward alone, --h=128 for one head dim"""
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import _time

IMPLS = [None, "portable"]
PASSES = ["fwd"] if "--fwd" in sys.argv else ["fwd", "fwd+bwd"]
HEADS = [(H, N) for H, N in [(64, 32), (128, 16), (256, 8)]
         if not any(a.startswith("--h=") for a in sys.argv) or f"--h={H}" in sys.argv]


def timings(q, k, v, causal, kw):
    ms = {}
    for impl in IMPLS:
        def fwd(q, k, v, impl=impl):
            return jax_flash.dot_product_attention(q, k, v, is_causal=causal, implementation=impl, **kw)
        loss = lambda q, k, v, f=fwd: jnp.sum(f(q, k, v).astype(jnp.float32))
        ms[impl, "fwd"] = _time(jax.jit(fwd), (q, k, v), rounds=7, calls=10) * 1e3
        if "fwd+bwd" in PASSES:
            ms[impl, "fwd+bwd"] = _time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), rounds=7, calls=10) * 1e3
    return ms


def report(label, H, causal, pairs, ms):
    for what, mult in [("fwd", 4), ("fwd+bwd", 14)][:len(PASSES)]:
        a, b = ms[None, what], ms["portable", what]
        print(f"| {H} | {label} | {'yes' if causal else 'no'} | {what} | {a:.3f} | {b:.3f} | "
              f"{mult * pairs * H / a / 1e9:.0f} | {b / a:.2f} |", flush=True)


def qkv(B, S, N, H):
    ks = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kk, (B, S, N, H), jnp.bfloat16) for kk in ks)


print("| H | inputs | causal | pass | hopper ms | portable ms | hopper TFLOP/s | x portable |")
print("|---|---|---|---|---|---|---|---|")
B, S = 2, 8192
if "--dense" in sys.argv:
    for H, N in HEADS:
        q, k, v = qkv(B, S, N, H)
        bias = jax.random.normal(jax.random.key(1), (1, 1, S, S), jnp.float32)
        mask = jax.random.bernoulli(jax.random.key(2), 0.8, (B, 1, S, S))
        for causal in [False, True]:
            pairs = B * N * (S * (S + 1) / 2 if causal else S * S)
            report("bias 1x1xTxS f32", H, causal, pairs, timings(q, k, v, causal, dict(bias=bias)))
            report("mask Bx1xTxS", H, causal, pairs, timings(q, k, v, causal, dict(mask=mask)))
elif "--dropout" in sys.argv:
    for H, N in HEADS:
        q, k, v = qkv(B, S, N, H)
        for causal in [False, True]:
            pairs = B * N * (S * (S + 1) / 2 if causal else S * S)
            kw = dict(dropout_rate=0.1, dropout_rng=jax.random.key(3))
            report("dropout 0.1", H, causal, pairs, timings(q, k, v, causal, kw))
            report("none", H, causal, pairs, timings(q, k, v, causal, {}))
else:
    for H, N in HEADS:
        q, k, v = qkv(B, S, N, H)
        for nseg in [1, 8, 64]:
            ids = jnp.broadcast_to((jnp.arange(S) * nseg // S).astype(jnp.int32), (B, S))
            kw = dict(query_segment_ids=ids, key_value_segment_ids=ids)
            seglen = S // nseg
            for causal in [False, True]:
                pairs = B * N * nseg * (seglen * (seglen + 1) / 2 if causal else seglen * seglen)
                report(f"{nseg} segments", H, causal, pairs, timings(q, k, v, causal, kw))
