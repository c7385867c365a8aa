"""Mixed precision: which dtype each float operand of an op is computed in.

A :class:`Precision` policy (``Session(compute_dtype=jnp.bfloat16)``) keeps
parameters in their own dtype (float32 master copies) and casts operands as
ops are recorded, each cast an ordinary ``astype`` node, so gradients flow
back through it and reach a parameter in its own dtype:

* losses, reductions and normalizations (ops declared ``precision="float32"``,
  see :data:`~tapeflow._core._registry.OpPrecision`) are computed in float32 (or
  wider, if an operand already is);
* ops that only move or select elements (``precision="layout"``) keep their
  operands' dtypes, and ``astype`` does what it is asked;
* an op whose float operands are all scalars (0-d: a loss times a loss
  scale, a sum of weighted losses) computes in float32, as ``torch.autocast``
  leaves such arithmetic to type promotion: it costs nothing and the compute
  dtype would only lose range (``2.0**16`` is ``inf`` in float16);
* every other op, user ops included, computes its float operands in the
  compute dtype, so float32 and the compute dtype mix instead of being rejected.

Inside :func:`keep_dtypes` no operand is cast, as without a policy: state
updates (running statistics) are computed there, in the state cell's own dtype.

>>> import jax.numpy as jnp, numpy as np
>>> p = Precision(jnp.bfloat16)
>>> f32, bf16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
>>> p.targets("matmul", [((2, 3), f32), ((3, 4), bf16)])
[dtype(bfloat16), None]
>>> p.targets("mean", [((2, 3), bf16)])
[dtype('float32')]
>>> p.targets("mul", [((), f32), ((), bf16)])   # scalars only: float32
[None, dtype('float32')]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _registry as R
from ._checks import as_dtype, is_floating_dtype
from ._result import Err, TapeError
from ._tape import Tape, append_op, check_op
from ._typing import DTypeLike, NodeId

__all__ = ["DynamicScaleState", "Precision", "cast_operands", "dtypes_kept", "dynamic_loss_scale", "keep_dtypes"]

_F32 = np.dtype(np.float32)

_KEEP: contextvars.ContextVar[bool] = contextvars.ContextVar("tapeflow_keep_dtypes", default=False)


@contextlib.contextmanager
def keep_dtypes(keep: bool = True) -> Iterator[None]:
    """Inside the block (``keep=True``), a policy casts no operand: each op computes in its operands' dtypes.

    State updates run here, so a running statistic moves in its own dtype
    (float32 under a bfloat16 policy, as PyTorch updates its buffers) on every
    path alike: the scope is read when an op is recorded. ``keep=False``
    applies the policy again inside (a checkpointed block's own recording).

    >>> import jax.numpy as jnp, numpy as np
    >>> p = Precision(jnp.bfloat16)
    >>> with keep_dtypes():
    ...     p.targets("mul", [((2,), np.dtype("float32")), ((2,), np.dtype("float32"))])
    [None, None]
    """
    token = _KEEP.set(keep)
    try:
        yield
    finally:
        _KEEP.reset(token)


def dtypes_kept() -> bool:
    """Whether ops recorded now keep their operands' dtypes (inside :func:`keep_dtypes`)."""
    return _KEEP.get()


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy: the dtype ops compute in (see the module docstring)."""

    compute_dtype: np.dtype

    def __init__(self, compute_dtype: DTypeLike) -> None:
        dt = as_dtype(compute_dtype)
        if dt is None:
            raise TapeError(f"Session: compute_dtype {compute_dtype!r} is not a dtype; use e.g. jnp.bfloat16")
        if not is_floating_dtype(dt):
            raise TapeError(f"Session: compute_dtype must be a floating dtype (bfloat16, float16), got {dt}")
        object.__setattr__(self, "compute_dtype", dt)

    def target(self, opname: str) -> np.dtype | None:
        """The dtype ``opname`` computes its float operands in (None: as they are), from its ``precision``."""
        d = R.REGISTRY.get(opname)
        if d is None or d.precision == "layout":
            return None
        return _F32 if d.precision == "float32" else self.compute_dtype

    def targets(self, opname: str, specs: Sequence[R.Spec]) -> list[np.dtype | None]:
        """For each operand, the dtype to cast it to first, or None to use it as it is."""
        if _KEEP.get():
            return [None] * len(specs)
        want = self.target(opname)
        floats = [(sh, dt) for sh, dt in specs if dt != R.OBJECT and jnp.issubdtype(dt, jnp.floating)]
        if want is not None and floats and all(len(sh) == 0 for sh, _ in floats):
            # scalar arithmetic (loss scaling, weighted losses): float32's range, or the widest operand's
            for _, dt in floats:
                want = np.dtype(jnp.promote_types(want, jnp.promote_types(dt, _F32)))
        out: list[np.dtype | None] = []
        for _, dt in specs:
            if want is None or dt == R.OBJECT or not jnp.issubdtype(dt, jnp.floating) or dt == want:
                out.append(None)
            elif want == _F32 and dt.itemsize > 4:
                out.append(None)  # already wider than float32: never narrowed for a loss
            else:
                out.append(want)
        return out


def cast_operands(
    tape: Tape,
    ids: Sequence[NodeId],
    targets: Sequence[np.dtype | None],
    requires_grad: bool = True,
    lazy: bool = False,
) -> tuple[Tape, list[NodeId]]:
    """Record an ``astype`` node for each operand with a target dtype; returns the new tape and the ids to use.

    ``lazy=True`` records them without computing (a lazy session's pending nodes).

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.ones(2), requires_grad=True)
    >>> t, (y,) = cast_operands(t, [x], [np.dtype(jnp.bfloat16)])
    >>> t[y].op, t[y].dtype, t[y].requires_grad
    ('astype', dtype(bfloat16), True)
    """
    out: list[NodeId] = []
    for i, dt in zip(ids, targets):
        if dt is not None:
            nd = tape[i]
            entry = check_op("astype", {"dtype": dt}, (nd.spec,))
            if isinstance(entry, str):
                raise TapeError(entry)
            tape, r = append_op(tape, "astype", entry, (i,), [nd], requires_grad, lazy)
            if isinstance(r, Err):
                raise TapeError(r.error)
            i = r.value
        out.append(i)
    return tape, out


# --------------------------------------------------------------------------- dynamic loss scaling


class DynamicScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`: the current ``scale``, finite steps in a row, the inner state."""

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    inner_state: optax.OptState


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    factor: float = 2.0,
    period: int = 2000,
    min_scale: float = 1.0,
) -> optax.GradientTransformation:
    """Dynamic loss scaling for float16 training, as an optax transformation around ``inner``.

    Multiply the loss by the current scale (:attr:`DynamicScaleState.scale`,
    read with ``opt.state.scale``) before ``backward``; both are scalars, so
    the product is computed in float32 under any policy (a scale above
    float16's largest value, 65504, stays finite). This transformation
    divides the gradients by it, and then either applies ``inner`` (all
    finite: after ``period`` such steps in a row the scale grows by ``factor``)
    or skips the step (zero updates, ``inner``'s state kept, the scale shrinks
    by ``factor``, never below ``min_scale``; ``skipped`` counts these steps).
    The skip is written here, not taken from ``optax.apply_if_finite`` (which
    keeps no scale and applies updates again after ``max_consecutive_errors``
    skips): one all-finite test over the unscaled gradients selects, with
    ``jnp.where``, between ``inner.update`` on those gradients and the skip, so
    a skipped step runs ``inner.update`` on zeros and discards its result.

    >>> import jax.numpy as jnp, optax, tapeflow as tfl
    >>> w = tfl.Param(jnp.array([1.0, 2.0]))
    >>> scaled = tfl.dynamic_loss_scale(optax.sgd(0.5), initial_scale=8.0)
    >>> opt = tfl.Optimizer(scaled, [w])
    >>> with tfl.Session(compute_dtype=jnp.float16) as s:
    ...     loss = tfl.sum(w * w) * opt.state.scale
    ...     opt.step(s.backward(loss))  # gradient 2w, unscaled
    >>> w.value.tolist(), float(opt.state.scale)
    ([0.0, 0.0], 8.0)
    """

    def init(params: optax.Params) -> DynamicScaleState:
        return DynamicScaleState(
            jnp.asarray(initial_scale, jnp.float32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            inner.init(params),
        )

    def update(
        updates: optax.Updates, state: DynamicScaleState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, DynamicScaleState]:
        grads = jax.tree_util.tree_map(lambda g: g / state.scale.astype(g.dtype), updates)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
        safe = jax.tree_util.tree_map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        new_updates, new_inner = inner.update(safe, state.inner_state, params)
        new_updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new_inner, state.inner_state)
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= period
        scale = jnp.where(
            finite, jnp.where(grow, state.scale * factor, state.scale), jnp.maximum(state.scale / factor, min_scale)
        )
        return new_updates, DynamicScaleState(
            scale, jnp.where(grow, 0, good), state.skipped + (~finite).astype(jnp.int32), new_inner
        )

    return optax.GradientTransformation(init, update)
