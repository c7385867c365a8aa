"""Device selection through JAX's device API (no silent fallbacks)."""

from __future__ import annotations

import functools

import jax

__all__ = ["default_device", "device_of", "resolve_device"]

_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def resolve_device(device: str | jax.Device) -> jax.Device:
    """Turn ``"cpu"``, ``"gpu"``/``"cuda"``, ``"gpu:1"``, ``"tpu"`` or a ``jax.Device`` into a device.

    An unknown name, or a platform JAX has no devices for, raises ``ValueError``
    at once; there is no silent fallback to another platform.

    >>> resolve_device("cpu").platform
    'cpu'
    """
    if isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu' or 'gpu', or a jax.Device; got {device!r}")
    name, _, idx = device.lower().partition(":")
    platform = _ALIASES.get(name)
    if platform is None:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'gpu' (or 'cuda'), 'tpu', 'gpu:N' or a jax.Device")
    try:
        devs = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(
            f"device {device!r} was requested but JAX has no {platform} backend here ({e}). "
            f"Available devices: {', '.join(str(d) for d in jax.devices())}. "
            "Install the matching jaxlib (e.g. pip install 'tapeflow[cuda12]') or pick another device."
        ) from None
    if not devs:
        raise ValueError(f"device {device!r} was requested but JAX reports no {platform} devices")
    i = 0
    if idx:
        if not idx.isdigit():
            raise ValueError(f"bad device index in {device!r}; expected e.g. '{name}:0'")
        i = int(idx)
        if i >= len(devs):
            raise ValueError(f"device {device!r} does not exist: JAX has {len(devs)} {platform} device(s)")
    return devs[i]


def default_device() -> jax.Device:
    """JAX's default device: ``jax.default_device`` when set (a device or a platform name), else ``jax.devices()[0]``.

    Without that setting this is an accelerator when one is present; inside
    ``with jax.default_device(d):`` it is ``d``.

    >>> default_device() == jax.devices()[0]
    True
    >>> with jax.default_device(jax.devices("cpu")[0]):
    ...     default_device().platform
    'cpu'
    """
    dev = getattr(jax.config, "jax_default_device", None)
    if dev is None:
        return jax.devices()[0]
    return resolve_device(dev)  # a platform name such as "cpu", or a jax.Device as it is


@functools.cache
def _array_type() -> type:
    """The concrete class of ``jax.Array`` values (found on first use: importing tapeflow starts no backend).

    Evaluated at compile time, so a first call inside a trace still finds the array class, not a tracer's.
    """
    with jax.ensure_compile_time_eval():
        return type(jax.numpy.zeros(()))


class _NotYet:
    """Stands for the array class until :func:`device_of` first meets a concrete array."""


_concrete: type = _NotYet
_SINGLE = jax.sharding.SingleDeviceSharding


def concrete_array_type() -> type:
    """The class of concrete ``jax.Array`` values (an exact ``type(x) is`` test skips the ABC checks on hot paths).

    >>> import jax.numpy as jnp
    >>> type(jnp.ones(2)) is concrete_array_type()
    True
    """
    return _array_type()


def device_of(x: object) -> jax.Device | None:
    """The one device the concrete array ``x`` lives on; None for host data, tracers and arrays on several devices.

    >>> import jax.numpy as jnp
    >>> device_of(jnp.ones(2)) == jax.devices()[0], device_of([1.0])
    (True, None)
    """
    global _concrete
    if type(x) is _concrete:  # the common case, without an ABC check (it is on every step's hot path)
        sh = x.sharding  # type: ignore[attr-defined]
        if type(sh) is _SINGLE:
            for d in sh.device_set:
                return d
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        _concrete = _array_type()
        try:
            devs = x.devices()
        except Exception:
            return None
        if len(devs) == 1:
            return next(iter(devs))
    return None
