"""Initial values as ``jax.random`` draws them, without compiling a program per parameter shape.

``jax.random.uniform(key, shape)`` compiles one XLA program per shape, and
XLA takes a tenth of a second or more for each (the threefry hash unrolls into
a large kernel): building a model with a handful of layer shapes spent most of
its first second compiling random draws. The draws of this module compute
exactly the same values (bit for bit on the same backend: the tests compare
them with ``jax.random``) from **one** compiled kernel per distribution, which
hashes a fixed-size chunk of counters starting at any offset; a parameter's
values are its chunks, concatenated and reshaped. ``split`` hashes its few
counters with NumPy (integer arithmetic, exact) and compiles nothing, and
``keys`` hands the split keys out one by one (unpacking a key array would
compile an ``unstack``).

They take this path for threefry keys (``jax.random.key``, or raw ``uint32[2]``
keys under the default implementation) with ``jax_threefry_partitionable`` on
(JAX's default), float32 values and shapes of fewer than 2**32 elements;
anything else is handed to ``jax.random`` as it is.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from tapeflow.nn import init
>>> key = jax.random.key(0)
>>> ours = init.uniform(key, (3, 5), minval=-1.0)
>>> bool(np.array_equal(ours, jax.random.uniform(key, (3, 5), minval=-1.0)))
True
>>> theirs = jax.random.normal(key, (7,))
>>> bool(np.array_equal(init.normal(key, (7,)), theirs))
True
>>> ours = jax.random.key_data(init.split(key, 3))
>>> bool(np.array_equal(ours, jax.random.key_data(jax.random.split(key, 3))))
True
>>> k1, k2 = init.keys(key, 2)  # split into separate keys, nothing compiled

**The default seed stream.** A layer built without ``key=`` (as PyTorch code
builds it) takes :func:`next_key`: the ``i``-th layer built since
:func:`manual_seed` ``(seed)`` gets ``jax.random.fold_in(jax.random.key(seed), i)``
(seed 0 at import), so a script that builds its model in the same order gets the
same initial values on every run; ``manual_seed`` resets the stream, as
``torch.manual_seed`` does (the values are JAX's, not PyTorch's).

>>> init.manual_seed(3)
>>> a = init.next_key()
>>> init.manual_seed(3)
>>> again = init.next_key()
>>> bool((jax.random.key_data(again) == jax.random.key_data(a)).all())
True
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from .._core import _compile_log
from .._core._typing import Array, DTypeLike, PRNGKey

__all__ = ["CHUNK", "keys", "manual_seed", "next_key", "normal", "require_key", "split", "uniform"]

CHUNK = 1 << 16
"""Values one kernel call draws: a parameter of ``n`` values takes ``ceil(n / CHUNK)`` calls."""

_F32 = np.dtype(np.float32)
_ONE_BITS = np.array(1.0, np.float32).view(np.uint32)
_NORMAL_LO = np.nextafter(np.float32(-1.0), np.float32(0.0), dtype=np.float32)  # as jax.random.normal draws


def _chunk_bits(kd: Array, start: Array) -> Array:
    """The 32 random bits of counters ``start .. start + CHUNK`` under key data ``kd`` (partitionable threefry)."""
    lo = start + lax.iota(np.uint32, CHUNK)
    b1, b2 = threefry2x32_p.bind(kd[0], kd[1], jnp.zeros(CHUNK, np.uint32), lo)
    return b1 ^ b2


def _unit(bits: Array, minval: Array, maxval: Array) -> Array:
    """``jax.random.uniform``'s map of float32 bits to ``[minval, maxval)``, op for op."""
    fb = lax.shift_right_logical(bits, jnp.array(32 - 23, np.uint32)) | jnp.asarray(_ONE_BITS)
    floats = lax.bitcast_convert_type(fb, jnp.float32) - jnp.array(1.0, jnp.float32)
    return lax.max(minval, floats * (maxval - minval) + minval)


def _uniform_chunk(kd: Array, start: Array, minval: Array, maxval: Array) -> Array:
    _compile_log.traced("init_uniform_chunk", "initializer uniform", "init uniform", (), group=None)
    return _unit(_chunk_bits(kd, start), minval, maxval)


def _normal_chunk(kd: Array, start: Array) -> Array:
    _compile_log.traced("init_normal_chunk", "initializer normal", "init normal", (), group=None)
    u = _unit(_chunk_bits(kd, start), jnp.asarray(_NORMAL_LO), jnp.array(1.0, jnp.float32))
    return lax.mul(jnp.array(np.sqrt(2), jnp.float32), lax.erf_inv(u))


_uniform_chunk.__name__ = "init_uniform_chunk"
_normal_chunk.__name__ = "init_normal_chunk"
_UNIFORM = jax.jit(_uniform_chunk)
_NORMAL = jax.jit(_normal_chunk)


_stream_lock = threading.Lock()
_stream = [0, 0]  # [seed, how many keys drawn since manual_seed(seed)]


def manual_seed(seed: int) -> None:
    """Restart the default seed stream at ``seed``: the next layer built without ``key=`` gets key 0 of it.

    >>> import tapeflow as tfl
    >>> tfl.nn.init.manual_seed(0)
    >>> w1 = tfl.nn.Linear(2, 2).weight.value
    >>> tfl.nn.init.manual_seed(0)
    >>> bool((tfl.nn.Linear(2, 2).weight.value == w1).all())
    True
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__}")
    with _stream_lock:
        _stream[0], _stream[1] = int(seed), 0


def next_key() -> PRNGKey:
    """The next key of the default seed stream: ``jax.random.fold_in(jax.random.key(seed), i)``, ``i`` counting up.

    >>> import jax, tapeflow as tfl
    >>> tfl.nn.init.manual_seed(5)
    >>> k = tfl.nn.init.next_key()
    >>> first = jax.random.fold_in(jax.random.key(5), 0)
    >>> bool((jax.random.key_data(k) == jax.random.key_data(first)).all())
    True
    """
    with _stream_lock:
        seed, i = _stream
        _stream[1] += 1
    if 0 <= seed < 2**32 and i < 2**32 and str(getattr(jax.config, "jax_default_prng_impl", "")) == "threefry2x32":
        # jax.random.key(seed) holds (0, seed); fold_in(key, i) hashes the counter pair (0, i): no program compiled
        b1, b2 = _threefry(np.uint32(0), np.uint32(seed), np.zeros(1, np.uint32), np.array([i], np.uint32))
        return jax.random.wrap_key_data(jax.device_put(np.array([b1[0], b2[0]], np.uint32)), impl="threefry2x32")
    return jax.random.fold_in(jax.random.key(seed), i)


def require_key(key: PRNGKey | None, layer: str) -> PRNGKey:
    """``key``, or the default seed stream's :func:`next_key` when ``key`` is None (``layer`` names the caller)."""
    del layer  # kept in the signature: callers name themselves for errors a key check may raise
    return next_key() if key is None else key


def _key_data(key: PRNGKey) -> np.ndarray | None:
    """The ``uint32[2]`` data of a single threefry key, or None when this module's path does not apply."""
    if not getattr(jax.config, "jax_threefry_partitionable", False):  # a context-manager flag: read as attribute
        return None
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32" or key.shape != ():
            return None
        data = jax.random.key_data(key)
    elif (
        str(getattr(jax.config, "jax_default_prng_impl", "")) == "threefry2x32"
        and key.shape == (2,)
        and key.dtype == np.uint32
    ):
        data = key
    else:
        return None
    if isinstance(data, jax.core.Tracer):
        return None
    return np.asarray(data, np.uint32)


def _shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)


def _draw(kd: np.ndarray, shape: tuple[int, ...], call: object) -> Array:
    n = math.prod(shape)
    chunks = [np.asarray(call(kd, np.uint32(s))) for s in range(0, n, CHUNK)]  # type: ignore[operator]
    flat = np.concatenate(chunks)[:n] if chunks else np.zeros(0, np.float32)
    return jax.device_put(flat.reshape(shape))  # jnp.asarray would compile a copy per shape


def uniform(
    key: PRNGKey, shape: Sequence[int] | int, dtype: DTypeLike = jnp.float32, minval: float = 0.0, maxval: float = 1.0
) -> Array:
    """``jax.random.uniform(key, shape, dtype, minval, maxval)``, the same values, from one compiled kernel."""
    shape = _shape(shape)
    kd = _key_data(key)
    if kd is None or np.dtype(dtype) != _F32 or math.prod(shape) >= 2**32:
        return jax.random.uniform(key, shape, dtype, minval, maxval)
    lo, hi = np.float32(minval), np.float32(maxval)
    return _draw(kd, shape, lambda k, s: _UNIFORM(k, s, lo, hi))


def normal(key: PRNGKey, shape: Sequence[int] | int, dtype: DTypeLike = jnp.float32) -> Array:
    """``jax.random.normal(key, shape, dtype)``, the same values, from one compiled kernel."""
    shape = _shape(shape)
    kd = _key_data(key)
    if kd is None or np.dtype(dtype) != _F32 or math.prod(shape) >= 2**32:
        return jax.random.normal(key, shape, dtype)
    return _draw(kd, shape, _NORMAL)


def _rotl(x: np.ndarray, d: int) -> np.ndarray:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def _threefry(k0: np.uint32, k1: np.uint32, x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011), as JAX hashes its counters: uint32 in, uint32 out."""
    ks = (k0, k1, np.uint32(k0 ^ k1 ^ np.uint32(0x1BD11BDA)))
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    with np.errstate(over="ignore"):
        x0, x1 = x0 + ks[0], x1 + ks[1]
        for i in range(5):
            for r in rotations[i % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r) ^ x0
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _split_data(kd: np.ndarray, num: int) -> np.ndarray:
    b1, b2 = _threefry(kd[0], kd[1], np.zeros(num, np.uint32), np.arange(num, dtype=np.uint32))
    return np.stack([b1, b2], axis=1)


def _wrap(key: PRNGKey, data: np.ndarray) -> Array:
    """Key data as keys of ``key``'s kind (typed keys, or raw ``uint32`` arrays)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.device_put(data), impl="threefry2x32")
    return jax.device_put(data)


def _count(num: object) -> bool:
    return isinstance(num, (int, np.integer)) and not isinstance(num, bool) and 0 <= int(num) < 2**32


def split(key: PRNGKey, num: int = 2) -> Array:
    """``jax.random.split(key, num)``, the same keys, hashed with NumPy (nothing compiled)."""
    kd = _key_data(key)
    if kd is None or not _count(num):
        return jax.random.split(key, num)
    return _wrap(key, _split_data(kd, int(num)))


def keys(key: PRNGKey, num: int) -> list[PRNGKey]:
    """``list(jax.random.split(key, num))``: the keys one by one (unpacking a key array compiles an unstack)."""
    kd = _key_data(key)
    if kd is None or not _count(num):
        return list(jax.random.split(key, num))
    return [_wrap(key, row) for row in _split_data(kd, int(num))]
