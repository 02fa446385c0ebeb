"""Packed sequences on the GPU: the Hopper forward (implementation=None) against the portable
kernels. Prints ms per forward (median of rounds) and TFLOP/s over the same-segment pairs.
  python3 tools/segment_bench.py"""
import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import _time


rows = []
for H, N in [(64, 32), (128, 16), (256, 8)]:
    for nseg in [1, 8, 64]:
        for causal in [False, True]:
            B, S = 2, 8192
            ks = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(kk, (B, S, N, H), jnp.bfloat16) for kk in ks)
            ids = jnp.broadcast_to((jnp.arange(S) * nseg // S).astype(jnp.int32), (B, S))
            seglen = S // nseg
            pairs = B * N * nseg * (seglen * (seglen + 1) / 2 if causal else seglen * seglen)
            res = {}
            for impl in [None, "portable"]:
                def fwd(q, k, v, impl=impl):
                    return jax_flash.dot_product_attention(q, k, v, is_causal=causal, query_segment_ids=ids,
                                                           key_value_segment_ids=ids, implementation=impl)
                f = jax.jit(fwd)
                res[impl] = _time(f, (q, k, v), rounds=7, calls=10) * 1e3
            tf = lambda ms: 4 * pairs * H / ms / 1e9
            rows.append((H, nseg, causal, res[None], res["portable"], tf(res[None]), tf(res["portable"])))
            print(rows[-1], flush=True)
print("| H | segments | causal | hopper fwd ms | portable fwd ms | hopper TFLOP/s | portable TFLOP/s | ratio |")
print("|---|---|---|---|---|---|---|---|")
for H, ns, c, a, b, ta, tb in rows:
    print(f"| {H} | {ns} | {'yes' if c else 'no'} | {a:.3f} | {b:.3f} | {ta:.0f} | {tb:.0f} | {b / a:.2f} |")
