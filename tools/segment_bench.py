"""Packed sequences on the GPU: the Hopper kernels (implementation=None) against the portable
ones. Prints ms per call (median of rounds) for the forward and for forward + backward, and
TFLOP/s over the same-segment pairs (backward = 2.5x the forward's FLOPs, FlashAttention's count).
  python3 tools/segment_bench.py"""
import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import _time

IMPLS = [None, "portable"]


def case(H, N, nseg, causal, B=2, S=8192):
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, S, N, H), jnp.bfloat16) for kk in ks)
    ids = jnp.broadcast_to((jnp.arange(S) * nseg // S).astype(jnp.int32), (B, S))
    seglen = S // nseg
    pairs = B * N * nseg * (seglen * (seglen + 1) / 2 if causal else seglen * seglen)
    ms = {}
    for impl in IMPLS:
        def fwd(q, k, v, impl=impl):
            return jax_flash.dot_product_attention(q, k, v, is_causal=causal, query_segment_ids=ids,
                                                   key_value_segment_ids=ids, implementation=impl)
        loss = lambda q, k, v, f=fwd: jnp.sum(f(q, k, v).astype(jnp.float32))
        ms[impl, "fwd"] = _time(jax.jit(fwd), (q, k, v), rounds=7, calls=10) * 1e3
        ms[impl, "fwd+bwd"] = _time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), rounds=7, calls=10) * 1e3
    return pairs, ms


print("| H | segments | causal | pass | hopper ms | portable ms | hopper TFLOP/s | x portable |")
print("|---|---|---|---|---|---|---|---|")
for H, N in [(64, 32), (128, 16), (256, 8)]:
    for nseg in [1, 8, 64]:
        for causal in [False, True]:
            pairs, ms = case(H, N, nseg, causal)
            for what, mult in [("fwd", 4), ("fwd+bwd", 14)]:
                a, b = ms[None, what], ms["portable", what]
                print(f"| {H} | {nseg} | {'yes' if causal else 'no'} | {what} | {a:.3f} | {b:.3f} | "
                      f"{mult * pairs * H / a / 1e9:.0f} | {b / a:.2f} |", flush=True)
