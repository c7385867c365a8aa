"""Where a NaN or an infinity came from: :func:`nonfinite_origin` and :class:`NonFiniteError`.

A tape holds every forward value (or, for a lazy recording, the leaf values
they are computed from), so the first op that made a non-finite value can be
found exactly, after the fact, at no cost to a step that had none:

* **forward**: when the root is not finite, the origin is the first node, in
  recording order, whose output is not finite, whose operands all are, and
  from which non-finite values reach the root. A non-finite value that an op
  turns finite again (an intentional ``-inf`` attention mask under a softmax)
  reaches nothing and is never blamed.
* **backward**: when the root is finite but a gradient is not, the origin is
  the first VJP, in backward order, whose incoming cotangent was finite and
  whose output cotangent was not (``sqrt`` at 0; ``log`` of an untaken
  ``where`` branch, where a zero cotangent meets an infinite derivative).

>>> import jax.numpy as jnp, tapeflow as tfl
>>> t, x = tfl.leaf(tfl.Tape.empty(), jnp.array([4.0, -1.0]), requires_grad=True)
>>> t, y = tfl.record(t, "sqrt", (x,))
>>> t, z = tfl.record(t, "sum", (y.value,))
>>> o = tfl.nonfinite_origin(t, z.value)
>>> o.phase, o.op, o.node, o.operands[0].finite
('forward', 'sqrt', 1, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax.numpy as jnp
import numpy as np

from . import _registry as R
from ._backward import add_cotangents, node_cotangents, root_and_seed, sweep
from ._node import PENDING, Node
from ._result import TapeError
from ._tape import Tape, computed_values, node_id
from ._typing import Array, ArrayLike

__all__ = ["NonFiniteError", "OperandInfo", "Origin", "all_finite", "nonfinite_origin"]

Phase = Literal["forward", "backward"]


def _inexact(dtype: np.dtype) -> bool:
    return dtype != R.OBJECT and bool(jnp.issubdtype(dtype, jnp.inexact))


def _host(v: object) -> np.ndarray:
    """``v`` on the host, low-precision floats (bfloat16, float16) widened to float64."""
    a = np.asarray(v)
    return a if a.dtype.kind in "fc" and a.dtype.itemsize >= 4 else a.astype(np.float64)


def _finite(v: object) -> bool:
    """Whether every entry of ``v`` is finite (integer, boolean and exact-rational values always are)."""
    dtype = np.dtype(getattr(v, "dtype", None) or np.asarray(v).dtype)
    if not _inexact(dtype):
        return True
    return bool(np.isfinite(_host(v)).all())


def all_finite(values: Sequence[object]) -> bool:
    """Whether every array in ``values`` is finite (one pass each, on the host).

    >>> import jax.numpy as jnp
    >>> all_finite([jnp.ones(2), jnp.array(jnp.inf)])
    False
    """
    return all(_finite(v) for v in values)


@dataclasses.dataclass(frozen=True)
class OperandInfo:
    """One value an origin read or made: its role, shape, dtype, whether finite, and its range.

    ``min``/``max`` ignore NaNs (both are NaN when every entry is); ``nan``
    and ``inf`` count the entries of each kind.

    >>> import jax.numpy as jnp
    >>> str(OperandInfo.of("operand 0", jnp.array([1.0, jnp.nan])))
    'operand 0: float32[2], not finite (1 NaN, 0 inf), min 1, max 1'
    """

    role: str
    shape: tuple[int, ...]
    dtype: np.dtype
    finite: bool
    min: float
    max: float
    nan: int = 0
    inf: int = 0

    @classmethod
    def of(cls, role: str, value: object) -> OperandInfo:
        a = np.asarray(value)
        shape, dtype = tuple(a.shape), np.dtype(a.dtype)
        if dtype == R.OBJECT:
            return cls(role, shape, dtype, True, float("nan"), float("nan"))
        f = a.astype(np.complex128 if dtype.kind == "c" else np.float64)
        nan, inf = int(np.isnan(f).sum()), int(np.isinf(f).sum())
        real = np.real(f)
        ok = real[~np.isnan(real)]
        lo = float(ok.min()) if ok.size else float("nan")
        hi = float(ok.max()) if ok.size else float("nan")
        return cls(role, shape, dtype, nan == 0 and inf == 0, lo, hi, nan, inf)

    def __str__(self) -> str:
        state = "finite" if self.finite else f"not finite ({self.nan} NaN, {self.inf} inf)"
        return f"{self.role}: {R.fmt_spec((self.shape, self.dtype))}, {state}, min {self.min:g}, max {self.max:g}"


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a non-finite value was first made (see :func:`nonfinite_origin`).

    * ``phase``: ``"forward"`` or ``"backward"``.
    * ``op``: the registry name of the op (its VJP in the backward phase),
      ``"input"`` or ``"param"`` for a leaf whose value is not finite, or
      ``"seed"`` for a non-finite seed.
    * ``node``: the node id; ``operands``: an :class:`OperandInfo` per value the
      op read and one for what it made (``"output"``, or per cotangent).
    * ``where`` (``"file.py:LINE"``), ``module`` (``"blocks.1.attn"``) and
      ``name`` (a Param's or input's name): filled in by a session, None here.
    * ``hint``: what probably went wrong and how to fix it, when the op tells.
    * ``masked_by``: the node id of a ``where`` whose untaken branch sent the
      zero cotangent that met an infinite derivative (the "double where" trap),
      and ``masked_where``, its line.
    """

    phase: Phase
    op: str
    node: int
    operands: tuple[OperandInfo, ...]
    where: str | None = None
    module: str | None = None
    name: str | None = None
    hint: str | None = None
    masked_by: int | None = None
    masked_where: str | None = None

    def describe(self) -> str:
        """The origin in a few lines (what :class:`NonFiniteError` prints)."""
        if self.op in ("input", "param"):
            what = f"{self.op} {self.name!r}" if self.name else f"an {self.op}" if self.op == "input" else "a param"
            head = f"{what} (node #{self.node}) holds a non-finite value"
        elif self.op == "seed":
            head = f"the backward seed of node #{self.node} is not finite"
        elif self.phase == "forward":
            head = f"op {self.op!r} (node #{self.node}) made the first non-finite value from finite operands"
        else:
            head = (
                f"the VJP of op {self.op!r} (node #{self.node}) made the first non-finite cotangent from a finite one"
            )
        at = [f"at {self.where}"] if self.where else []
        if self.module:
            at.append(f"in module {self.module!r}")
        lines = [f"{self.phase}: {head}" + (" " + " ".join(at) if at else "")]
        lines += [f"  {o}" for o in self.operands]
        if self.masked_by is not None:
            line = f" at {self.masked_where}" if self.masked_where else ""
            lines.append(
                f"  the cotangent reaching it is 0 where its derivative is infinite (0 * inf = NaN): it came through "
                f"the untaken branch of where (node #{self.masked_by}{line}). Mask the operand before the op, e.g. "
                "tfl.where(m, x, 1.0), so the untaken branch is finite too"
            )
        if self.hint:
            lines.append(f"  {self.hint}")
        return "\n".join(lines)


class NonFiniteError(TapeError):
    """A step's loss or a gradient was not finite; raised with nothing updated.

    Carries the :class:`Origin` (``err.origin``, None when none was found) and
    its fields: ``phase``, ``op``, ``node``, ``where``, ``module`` and
    ``operands``.

    >>> import tapeflow as tfl
    >>> issubclass(tfl.NonFiniteError, tfl.TapeError)
    True
    """

    def __init__(self, message: str, origin: Origin | None = None) -> None:
        text = message if origin is None else f"{message}\n{origin.describe()}"
        super().__init__(text)
        self.origin = origin
        self.phase: Phase | None = None if origin is None else origin.phase
        self.op: str | None = None if origin is None else origin.op
        self.node: int | None = None if origin is None else origin.node
        self.where: str | None = None if origin is None else origin.where
        self.module: str | None = None if origin is None else origin.module
        self.operands: tuple[OperandInfo, ...] = () if origin is None else origin.operands


# --------------------------------------------------------------------------- hints


def _below(v: object, bound: float, strict: bool = True) -> bool:
    a = np.asarray(v)
    if a.dtype == R.OBJECT or a.dtype.kind == "c":
        return False
    a = a.astype(np.float64)
    return bool((a < bound).any() if strict else (a <= bound).any())


def _forward_hint(nd: Node, xs: Sequence[object]) -> str | None:
    """What a built-in op's non-finite output most likely means, and the usual fix."""
    op = nd.op
    if op == "sqrt" and _below(xs[0], 0.0):
        return "sqrt of a negative number: clamp it first, e.g. tfl.sqrt(tfl.maximum(x, 0.0))"
    if op == "log" and _below(xs[0], 0.0, strict=False):
        return "log of zero or a negative number: add a small epsilon, e.g. tfl.log(x + 1e-8), or use log_softmax"
    if op == "div" and len(xs) == 2 and not np.all(np.asarray(xs[1], dtype=np.float64) != 0):
        both = np.any((np.asarray(xs[0], dtype=np.float64) == 0) & (np.asarray(xs[1], dtype=np.float64) == 0))
        return ("0 / 0" if both else "division by zero") + ": guard the denominator, e.g. x / (y + 1e-8)"
    if op == "exp":
        limit = float(np.log(float(jnp.finfo(nd.dtype).max))) if _inexact(nd.dtype) else 88.7
        return f"exp overflowed (it overflows {R.fmt_spec(nd.spec)} above {limit:.1f}): subtract the max first, or use softmax/logsumexp"
    if op == "pow":
        return "pow of a negative base to a fractional power, or of 0 to a negative power"
    if op == "cross_entropy" and len(xs) == 2:
        logits, labels = np.asarray(xs[0]), np.asarray(xs[1])
        classes = logits.shape[-1] if logits.ndim else 0
        if labels.size and (labels.min() < 0 or labels.max() >= classes):
            return (
                f"a label is out of range: labels span [{labels.min()}, {labels.max()}] but the logits have "
                f"{classes} classes (valid labels are 0..{classes - 1})"
            )
    return None


def _backward_hint(nd: Node) -> str | None:
    if nd.op == "sqrt":
        return "sqrt's derivative 1 / (2 sqrt(x)) is infinite at x = 0: use tfl.sqrt(x + eps) where x may be 0"
    if nd.op == "log":
        return "log's derivative 1 / x is infinite at x = 0"
    if nd.op == "pow":
        return "the derivative of x ** p is infinite at x = 0 for p < 1"
    if nd.op == "div":
        return "the derivative of x / y is infinite where y = 0"
    return None


# --------------------------------------------------------------------------- the search


def _forward_origin(nodes: Sequence[Node], values: list[Array], root: int) -> Origin | None:
    memo: dict[int, bool] = {}

    def finite(i: int) -> bool:
        f = memo.get(i)
        if f is None:
            f = memo[i] = _finite(values[i])
        return f

    if finite(root):
        return None
    bad, stack = {root}, [root]
    while stack:  # the non-finite region connected to the root through non-finite values
        for p in nodes[stack.pop()].parents:
            if p not in bad and not finite(p):
                bad.add(p)
                stack.append(p)
    i = min(bad)  # its parents are all finite: a smaller non-finite parent would be in the region
    nd = nodes[i]
    if nd.op is None:
        return Origin("forward", "input", i, (OperandInfo.of("value", values[i]),))
    xs = [values[p] for p in nd.parents]
    infos = tuple(OperandInfo.of(f"operand {k} (#{p})", values[p]) for k, p in enumerate(nd.parents))
    return Origin("forward", nd.op, i, (*infos, OperandInfo.of("output", values[i])), hint=_forward_hint(nd, xs))


class _Found(Exception):
    def __init__(self, origin: Origin) -> None:
        super().__init__()
        self.origin = origin


def _backward_origin(nodes: Sequence[Node], values: list[Array], root: int, seed: Array) -> Origin | None:
    if not _finite(seed):
        return Origin("backward", "seed", root, (OperandInfo.of("seed", seed),))
    senders: dict[int, list[int]] = {}

    def pull(i: int, nd: Node, g: Array, mask: tuple[bool, ...]) -> Sequence[Array]:
        assert nd.opdef is not None
        parents = nd.parents
        cts = node_cotangents(nodes, values, i, g, mask)
        if _finite(g) and not all_finite(cts):
            raise _Found(_vjp_origin(nodes, values, i, g, cts, mask, senders.get(i, [])))
        for p, m in zip(parents, mask):
            if m:
                senders.setdefault(p, []).append(i)
        return cts

    try:
        sweep(nodes, root, seed, None, pull, add_cotangents, None)
    except _Found as f:
        return f.origin
    return None


def _vjp_origin(
    nodes: Sequence[Node],
    values: list[Array],
    i: int,
    g: Array,
    cts: Sequence[Array],
    mask: tuple[bool, ...],
    senders: list[int],
) -> Origin:
    nd = nodes[i]
    assert nd.op is not None
    infos = [OperandInfo.of("incoming cotangent", g), OperandInfo.of("forward output", values[i])]
    infos += [OperandInfo.of(f"operand {k} (#{p})", values[p]) for k, p in enumerate(nd.parents)]
    ks = [k for k, m in enumerate(mask) if m]
    infos += [OperandInfo.of(f"cotangent of operand {k}", c) for k, c in zip(ks, cts)]
    masked = next((s for s in senders if nodes[s].op == "where"), None) if np.any(np.asarray(g) == 0) else None
    return Origin("backward", nd.op, i, tuple(infos), hint=_backward_hint(nd), masked_by=masked)


def nonfinite_origin(tape: Tape, root: object, seed: ArrayLike | None = None) -> Origin | None:
    """The first op whose output (forward) or VJP (backward) made a non-finite value reaching ``root``'s gradients.

    ``root`` is a node id or ``Ok``; ``seed`` as in :func:`~tapeflow.backward`.
    Returns None when the root and every gradient of the tape's leaves are
    finite. Pure: it reads the tape (computing a lazy recording's pending
    values op by op) and changes nothing. The rules are in this module's
    docstring.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> x0 = jnp.array([0.0, 1.0])
    >>> t, x = tfl.leaf(tfl.Tape.empty(), x0, requires_grad=True)
    >>> t, y = tfl.record(t, "sqrt", (x,))
    >>> t, z = tfl.record(t, "sum", (y.value,))
    >>> o = tfl.nonfinite_origin(t, z.value)
    >>> o.phase, o.op, o.operands[-1].inf
    ('backward', 'sqrt', 1)
    """
    r = node_id(tape, root, "nonfinite_origin", "root")
    r, seed_v = root_and_seed(tape, r, seed)
    nodes = list(tape.nodes)[: r + 1]  # nothing after the root reaches it
    pending = {i for i, nd in enumerate(nodes) if nd.value is PENDING}  # a lazy recording's: computed op by op
    given = [nd.value for nd in nodes if nd.value is not PENDING]
    values = computed_values(nodes, pending, given, "nonfinite_origin")
    origin = _forward_origin(nodes, values, r)
    if origin is None and nodes[r].requires_grad:
        origin = _backward_origin(nodes, values, r, seed_v)
    return origin
