"""Diagnose ring attention compiles on GPUs: one configuration per process (a compiler
crash kills only its process). Usage: python ring_gpu_probe.py CAUSAL LAYOUT [bwd]"""
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash

causal, layout = sys.argv[1] == "1", sys.argv[2]
bwd = len(sys.argv) > 3
gpus = jax.devices()
n = len(gpus)
mesh = jax.make_mesh((n,), ("s",), axis_types=(AxisType.Explicit,), devices=gpus)
x = jax.random.normal(jax.random.key(0), (1, 1024, 4, 128), jnp.float32).astype(jnp.bfloat16)
s = NamedSharding(mesh, P(None, "s"))
q = jax.device_put(x, s)
ring = lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="s", causal=causal, layout=layout)
with jax.set_mesh(mesh):
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))) if bwd else jax.jit(ring)
    out = jax.block_until_ready(f(q, q, q))
print("OK", sys.argv[1:], os.environ.get("XLA_FLAGS", ""))
