"""Trace-time argument checks: every bad input becomes a ValueError/TypeError that names
the argument, before anything reaches a kernel."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256


def check_dtype(name, x):
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_same_dtype(names, xs):
    dts = {jnp.dtype(x.dtype) for x in xs}
    if len(dts) != 1:
        listed = ", ".join(f"{n}={x.dtype}" for n, x in zip(names, xs))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {listed}")


def check_head_dim(name, h):
    if not 1 <= h <= MAX_HEAD_DIM:
        raise ValueError(f"{name} head dim (last axis) must be in [1, {MAX_HEAD_DIM}], got {h}")


def check_nonempty(name, axis_name, n):
    if n < 1:
        raise ValueError(f"{name} must have {axis_name} >= 1, got {n}")


def check_scale(scale):
    if scale is None:
        return
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a Python or NumPy real number (static), got {type(scale).__name__}"
        )
    if not np.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")


def check_softcap(softcap):
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive real number or None, got {type(softcap).__name__}")
    if not (float(softcap) > 0 and np.isfinite(float(softcap))):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")
    return float(softcap)


def check_flag(name, value):
    """A static on/off argument: a Python or NumPy bool, never a truthy stand-in (causal="no"
    would otherwise mean causal) nor a traced array."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (Python or NumPy, static), got {type(value).__name__} {value!r}")
    return bool(value)


def _is_int(x):
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def normalize_window(name, window):
    """None | int | (left, right) with left/right int >= 0 or None -> (left, right) with -1 = unbounded."""
    if window is None:
        return -1, -1
    if _is_int(window):
        window = (window, window)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{name} must be an int or a (left, right) pair of ints, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if w is None:
            out.append(-1)
            continue
        if not _is_int(w):
            raise TypeError(f"{name} {side} size must be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(f"{name} {side} size must be >= 0, got {w}")
        if w >= 2**31 - 1:
            out.append(-1)  # wider than any sequence: unbounded
            continue
        out.append(int(w))
    return tuple(out)


def check_lengths(name, lens, batch):
    """Integer lengths of shape [batch] -> int32 array (or None)."""
    if lens is None:
        return None
    lens = jnp.asarray(lens)
    if not jnp.issubdtype(lens.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {lens.dtype}")
    if lens.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one length per batch element), got {lens.shape}")
    return lens.astype(jnp.int32)


def check_q_offset(q_offset):
    if isinstance(q_offset, str):
        if q_offset != "bottom_right":
            raise ValueError(f"q_offset must be an int or 'bottom_right', got {q_offset!r}")
        return 0, True
    if not _is_int(q_offset):
        raise TypeError(f"q_offset must be an int or 'bottom_right', got {type(q_offset).__name__}")
    return int(q_offset), False


def check_segment_ids(names, ids, shapes):
    """Packed-sequence segment ids: both or neither; integer arrays of exactly the given shapes
    -> (int32, int32) or (None, None)."""
    given = [x is not None for x in ids]
    if not any(given):
        return None, None
    if not all(given):
        missing = names[given.index(False)]
        raise ValueError(f"{names[0]} and {names[1]} go together; {missing} is missing "
                         "(pass the same array twice for self-attention)")
    out = []
    for name, x, shape in zip(names, ids, shapes):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            raise TypeError(f"{name} must be an integer array, got {x.dtype}")
        if x.shape != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {x.shape}")
        out.append(x.astype(jnp.int32))
    return tuple(out)


BIAS_DTYPES = SUPPORTED_DTYPES  # read natively by the CPU kernels; other floats are cast to float32


def check_broadcastable(name, x, full, full_names):
    """bias (float) or mask (bool) broadcastable (NumPy rules) to `full` -> the array with
    leading 1s added up to len(full) dims (every dim then 1 or the full size)."""
    x = jnp.asarray(x)
    if name == "mask":
        if x.dtype != jnp.bool_:
            raise TypeError(f"mask must be a boolean array (True = attend), got {x.dtype}; pass an "
                            "additive mask as bias")
    elif not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    elif jnp.dtype(x.dtype) not in BIAS_DTYPES:
        x = x.astype(jnp.float32)
    full = tuple(full)
    if x.ndim > len(full) or any(d not in (1, f) for d, f in zip(x.shape[::-1], full[::-1])):
        raise ValueError(f"{name} of shape {x.shape} is not broadcastable to {full_names} = {full}")
    return x.reshape((1,) * (len(full) - x.ndim) + x.shape)


def check_dropout(rate, rng):
    """dropout_rate (static real in [0, 1)) and dropout_rng (needed when rate > 0) ->
    (rate as a float, the key or None). A rate of 0 ignores the key (no dropout, no RNG)."""
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, numbers.Real):
        raise TypeError(f"dropout_rate must be a Python float in [0, 1) (static, not a traced array), "
                        f"got {type(rate).__name__}")
    rate = float(rate)
    if not 0.0 <= rate < 1.0:  # NaN fails this too
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return 0.0, None
    if rng is None:
        raise ValueError("dropout_rate > 0 requires dropout_rng (a JAX PRNG key, e.g. jax.random.key(0))")
    rng = jnp.asarray(rng)
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"dropout_rng must be a single PRNG key (shape ()), got shape {rng.shape}; "
                             "use jax.vmap for one key per example")
        return rate, rng
    raw_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    if rng.dtype != jnp.uint32 or rng.shape != raw_shape:
        raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key) or a raw uint32{list(raw_shape)} "
                        f"key (jax.random.PRNGKey), got {rng.dtype}{list(rng.shape)}")
    return rate, rng
