"""Sharding and ring attention on several real GPUs (run with tools/gpu_session.sh on a
multi-GPU machine). Checks batch / head / sequence (ring) sharding, forward and backward,
against one GPU, lists the HLO collectives, and times ring attention on one long sequence
against one GPU doing the whole sequence. Prints tables; writes JSON to $OUT if set."""

import os

# NVLink multicast stays off (the device docs: it can take shared GPUs out of service).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_flash  # noqa: E402

F32 = jnp.float32
# JF_PLATFORM=cpu JF_SMALL=1 (with 8 host devices) is a dry run of this script on a CPU.
gpus = jax.devices(os.environ.get("JF_PLATFORM", "gpu"))[: int(os.environ.get("JF_NDEV", "64"))]
SMALL = bool(os.environ.get("JF_SMALL"))
n = len(gpus)
results = {"devices": [d.device_kind for d in gpus], "jax": jax.__version__, "checks": [], "scaling": []}


def collectives(hlo):
    return sorted(set(re.findall(r"\b(all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter)(?:-start)?\(", hlo)))


def rand(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(jnp.bfloat16)


def mesh_of(name):
    return jax.make_mesh((n,), (name,), axis_types=(AxisType.Explicit,), devices=gpus)


def loss_of(fn, do):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32) * do)


# --------------------------------------------------------------- correctness vs one GPU
B, T, N, K, H = (4, 64, 8, 4, 16) if SMALL else (4, 4096, 8, 4, 128)
q, k, v = rand((B, T, N, H), 0), rand((B, T, K, H), 1), rand((B, T, K, H), 2)
do = jax.random.normal(jax.random.key(3), (B, T, N, H), F32)
attn = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True)
want = jax.jit(attn)(q, k, v)
want_g = jax.jit(jax.grad(loss_of(attn, do), argnums=(0, 1, 2)))(q, k, v)

cases = {
    "data": ("d", P("d"), attn, None),
    "heads": ("h", P(None, None, "h"), attn, None),
    "seq_ring_zigzag": ("s", P(None, "s"), lambda q, k, v: jax_flash.ring_attention(
        q, k, v, axis_name="s", causal=True, layout="zigzag"), "zigzag"),
}
print(f"# {n} x {gpus[0].device_kind}, jax {jax.__version__}: bf16 B={B} T=S={T} N={N} K={K} H={H} causal")
print("| sharding | max |out - 1 GPU| | max |grad - 1 GPU| | forward collectives | backward collectives |")
print("|---|---|---|---|---|")
for name, (axis, spec, fn, layout) in cases.items():
    mesh = mesh_of(axis)
    lay = (lambda x: jax_flash.zigzag(x, n)) if layout else (lambda x: x)
    unlay = (lambda x: jax_flash.unzigzag(x, n)) if layout else (lambda x: x)
    s = NamedSharding(mesh, spec)
    args = [jax.device_put(lay(x), s) for x in (q, k, v)]
    do_s = jax.device_put(lay(do), s)
    with jax.set_mesh(mesh):
        f = jax.jit(fn)
        g = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(fn(q, k, v).astype(F32) * do), argnums=(0, 1, 2)))
        got = f(*args)
        got_g = g(*args, do_s)
        hf = collectives(f.lower(*args).compile().as_text())
        hg = collectives(g.lower(*args, do_s).compile().as_text())
    e_out = float(jnp.max(jnp.abs(jnp.asarray(unlay(jax.device_get(got)), F32) - want.astype(F32))))
    e_g = max(float(jnp.max(jnp.abs(jnp.asarray(unlay(jax.device_get(a)), F32) - b.astype(F32)))) for a, b in zip(got_g, want_g))
    scale = max(float(jnp.max(jnp.abs(b.astype(F32)))) for b in want_g)
    ok = e_out < 2e-2 and e_g < 2e-2 * max(1.0, scale)
    results["checks"].append(dict(sharding=name, out_err=e_out, grad_err=e_g, grad_scale=scale,
                                  fwd_collectives=hf, bwd_collectives=hg, ok=ok))
    print(f"| {name} | {e_out:.2e} | {e_g:.2e} (max |grad| {scale:.1f}) | {', '.join(hf) or 'none'} | {', '.join(hg) or 'none'} |")


# --------------------------------------------------------------------- ring scaling
def timed(fn, args, rounds=3):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


S, N2, H2 = (256, 2, 16) if SMALL else (131072, 16, 128)
print(f"\n# ring attention scaling: one sequence, S={S}, N={N2}, H={H2}, bf16, causal (zigzag)")
print("| GPUs | fwd ms | fwd+bwd ms | fwd speedup | fwd+bwd speedup | fwd+bwd efficiency |")
print("|---|---|---|---|---|---|")
ql, kl, vl = rand((1, S, N2, H2), 4), rand((1, S, N2, H2), 5), rand((1, S, N2, H2), 6)
dol = rand((1, S, N2, H2), 7)
one_f = jax.jit(attn)
one_fb = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
t1f, t1fb = timed(one_f, (ql, kl, vl)), timed(one_fb, (ql, kl, vl, dol))
print(f"| 1 | {t1f * 1e3:.0f} | {t1fb * 1e3:.0f} | 1.00 | 1.00 | 1.00 |")
mesh = mesh_of("s")
s = NamedSharding(mesh, P(None, "s"))
args = [jax.device_put(jax_flash.zigzag(x, n), s) for x in (ql, kl, vl, dol)]
ring = lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="s", causal=True, layout="zigzag")
with jax.set_mesh(mesh):
    rf = jax.jit(ring)
    rfb = jax.jit(lambda q, k, v, do: jax.vjp(ring, q, k, v)[1](do))
    tnf, tnfb = timed(rf, args[:3]), timed(rfb, args)
print(f"| {n} | {tnf * 1e3:.0f} | {tnfb * 1e3:.0f} | {t1f / tnf:.2f} | {t1fb / tnfb:.2f} | {t1fb / tnfb / n:.2f} |")
results["scaling"] = [dict(gpus=1, fwd_ms=t1f * 1e3, fwd_bwd_ms=t1fb * 1e3),
                      dict(gpus=n, fwd_ms=tnf * 1e3, fwd_bwd_ms=tnfb * 1e3)]
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "multi_gpu.json"), "w") as fh:
        json.dump(results, fh, indent=1)
print("ALL OK" if all(c["ok"] for c in results["checks"]) else "MISMATCH")
