"""The Hopper kernels through JAX on small shapes, for compute-sanitizer on the GPU machine: plain
launches (label "plain": the forward, the backward's row statistics / main / dQ conversion
kernels, the deterministic mode) and the optional inputs (segment ids, bias / mask: forward and
backward, dbias summed over each kind of broadcast axis; dropout; S = 336 takes the TMA-staged
bias / mask tiles at H <= 128). The harnesses of tools/sanitize.sh run the plain kernels without
JAX. Checks only jax_flash's kernels:
  compute-sanitizer --tool memcheck --error-exitcode 99 --kernel-name kns=jax_flash \
      python3 tools/sanitize_extras.py
  (racecheck likewise; each case's output is also compared with the portable kernels')
  --only=TEXT runs the cases whose label contains TEXT (e.g. --only=TMA).
  --list prints every case's full label ("H=64 T=200 S=333 causal=False bias f32 [1,N,T,S]") and
  runs nothing; --exact=LABEL runs that one case. One process per case, so a crash names its case:
    python3 tools/sanitize_extras.py --list | while read -r c; do
      compute-sanitizer --tool memcheck --error-exitcode 99 --kernel-name kns=jax_flash \
          python3 tools/sanitize_extras.py --exact="$c" > /dev/null 2>&1; echo "rc $? $c"; done
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


ONLY = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), "")
EXACT = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--exact=")), None)
LIST = "--list" in sys.argv[1:]


def case(H, T, S, causal, kw, label, B=2):
    full = f"H={H} T={T} S={S} causal={causal} {label}" + (f" B={B}" if B != 2 else "")
    if ONLY not in label or (EXACT is not None and full != EXACT):
        return
    if LIST:
        print(full)
        return
    ks = jax.random.split(jax.random.key(H + T + S), 3)
    q = jax.random.normal(ks[0], (B, T, 2, H), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, S, 1, H), jnp.bfloat16) for kk in ks[1:])

    def attend(q, k, v, impl):
        if kw.get("deterministic"):  # flash_attention's option: [..., T, H] operands, no GQA
            qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2)))
            out = jax_flash.flash_attention(qt, kt, vt, causal=causal, deterministic=True,
                                            kernel="portable" if impl == "portable" else "auto")
            return jnp.swapaxes(out, 1, 2)
        return jax_flash.dot_product_attention(q, k, v, is_causal=causal, implementation=impl, **kw)

    def loss(q, k, v, impl):
        out = attend(q, k, v, impl)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(H, dtype=jnp.float32)))

    res = {impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, impl)
           for impl in (None, "portable")}
    (a, ga), (b, gb) = res[None], res["portable"]
    err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(ga, gb))
    print(f"{full}: loss {float(a):.4f} vs portable {float(b):.4f}, "
          f"max grad diff {err:.3g}", flush=True)


rng = np.random.default_rng(0)
# More key-block tiles than SMs on the persistent non-causal schedule: H = 64 / 128 convert dQ early,
# beside the main launch's last round (v83 / v84); H = 256 with >= 32 steps per tile runs the split
# tail's second launch (v82b).
case(64, 300, 12000, False, {}, "plain rounds: early dQ conversion", B=3)
case(128, 300, 12000, False, {}, "plain rounds: early dQ conversion", B=3)
case(256, 2100, 9000, False, {}, "plain rounds: split tail")
for H in (64, 128, 256):
    T, S = 200, 333
    for causal in (False, True):
        case(H, T, S, causal, {}, "plain")
        case(H, T, S, causal, dict(deterministic=True), "plain deterministic")
    qseg = jnp.asarray(np.sort(rng.integers(0, 4, (2, T))), jnp.int32)
    kseg = jnp.asarray(np.sort(rng.integers(0, 4, (2, S))), jnp.int32)
    for causal in (False, True):
        case(H, T, S, causal, dict(query_segment_ids=qseg, key_value_segment_ids=kseg), "sorted segments")
    useg_q = jnp.asarray(rng.integers(0, 3, (2, T)), jnp.int32)
    useg_k = jnp.asarray(rng.integers(0, 3, (2, S)), jnp.int32)
    case(H, T, S, True, dict(query_segment_ids=useg_q, key_value_segment_ids=useg_k), "unsorted segments")
    bias = jax.random.normal(jax.random.key(7), (1, 2, T, S), jnp.float32)
    mask = jax.random.bernoulli(jax.random.key(8), 0.7, (2, 1, T, S))
    case(H, T, S, False, dict(bias=bias), "bias f32 [1,N,T,S]")
    case(H, T, S, True, dict(bias=bias.astype(jnp.bfloat16), mask=mask), "bias bf16 + mask")
    case(H, T, S, False, dict(mask=mask, query_segment_ids=qseg, key_value_segment_ids=kseg), "mask + segments")
    case(H, T, S, True, dict(bias=bias[:, :, :, :1]), "dense bwd: dbias over keys")
    case(H, T, S, False, dict(bias=bias[:, :, :1, :], mask=mask), "dense bwd: dbias over rows + mask")
    for causal in (False, True):
        case(H, T, S, causal, dict(dropout_rate=0.2, dropout_rng=jax.random.key(11)), "dropout")
    S2 = 336  # rows of 16-byte multiples: the bias / mask tiles come by TMA (dense_tma.h) at H <= 128
    bias2 = jax.random.normal(jax.random.key(9), (1, 2, T, S2), jnp.float32)
    mask2 = jax.random.bernoulli(jax.random.key(10), 0.7, (2, 1, T, S2))
    case(H, T, S2, False, dict(bias=bias2), "TMA tiles: bias f32 [1,N,T,S]")
    case(H, T, S2, True, dict(bias=bias2.astype(jnp.bfloat16), mask=mask2), "TMA tiles: bias bf16 + mask")
