"""PyTorch's own test databases as the oracle of tapeflow's PyTorch surface (``from _torch_oracle import ...``).

Two databases ship with PyTorch: ``op_db`` (OpInfo rows, each with sample inputs) and
``module_db`` (ModuleInfo rows, each with constructor and forward inputs). This module loads
them once per process (importing them takes about 8 s), turns each sample into a tapeflow call,
and classifies it:

* ``pass``: the same values, shape, dtype and return structure, and the same gradients of the
  float inputs (and of the module's parameters);
* ``unsupported``: tapeflow raised a clear error (a ``TapeError``, ``TypeError``, ``ValueError``,
  ``IndexError`` or ``NotImplementedError`` whose message names the entry);
* ``silent``: tapeflow returned something else (a value, shape, dtype, structure or gradient);
* ``error``: tapeflow raised, but not a clear error (another exception type, or a message that
  does not name the entry);
* ``skipped``: the sample is outside the harness (PyTorch itself raised, or it is too large).

What is compared, and how:

* dtypes: JAX runs without x64 (the tapeflow side runs under ``jax.enable_x64(False)``, as a
  user's program does), so PyTorch's int64 / float64 / complex128 read as int32 / float32 /
  complex64 (:func:`narrow`); every other dtype must be PyTorch's;
* float values and gradients: PyTorch's float32 result against its own float64 result (the same
  inputs, upcast) gives the error float32 makes on this sample; tapeflow must be within
  ``max(10 x that error, 1e-5)`` absolutely plus ``1e-5`` relatively of the float64 result, and
  non-finite exactly where PyTorch's float32 result is; integer and bool results exactly;
* structure: a PyTorch named pair (``torch.return_types.max``) must be a tuple with the same
  field names, a tuple a tuple, a list a list, a Tensor a tapeflow Tensor, a number a number;
* gradients: PyTorch's ``autograd.grad`` of ``sum(out * cotangent)`` (a fixed random cotangent
  per float output) against ``Session.backward`` of the same loss, for every float input that
  requires grad (and every module parameter, by name).

Bounds (each new shape compiles kernels, so the run is kept to about two minutes of one core; the
choice is deterministic, so the same samples run every time): :data:`MAX_SAMPLES` float32 samples
per row and :data:`MAX_INT_SAMPLES` int64 samples where the row supports int64, picked by
:func:`_samples` (the first sample of each call form first); a sample whose tensors hold more than
:data:`MAX_ELEMENTS` elements is skipped; gradients are compared on the first :data:`MAX_GRAD_SAMPLES`
float32 samples of a row (backward kernels are most of the compile time), values on all; modules take
their first :data:`MAX_MODULE_INPUTS` inputs in training mode and, where ModuleInfo says the modes
differ, their first :data:`MAX_EVAL_INPUTS` in eval mode, gradients on all. PyTorch's random
samples (dropout; OpInfo's ``wrapper_set_seed`` rows, or two draws that differ) compare structure,
shapes and dtypes only.

A sample is named by :func:`describe`: the row, then the call with each tensor as its dtype and
shape, ``var(float32[5, 5, 5], dim=1, unbiased=True, keepdim=True)``. An entry's ``gaps`` keys
match samples by substring of that description (see ``Entry`` in ``tapeflow/_shell/_surface.py``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np
import torch

import tapeflow as tfl
import tapeflow.nn.functional as tfl_F
from tapeflow._shell import _torch  # noqa: F401  (declares every entry and binds the methods)
from tapeflow._shell._surface import SURFACE, Entry

SEED = 0
MAX_SAMPLES = 10
MAX_GRAD_SAMPLES = 5
MAX_INT_SAMPLES = 3
CANDIDATES = 3
MAX_ELEMENTS = 4096
MAX_MODULE_INPUTS = 3
MAX_EVAL_INPUTS = 1
ATOL_FLOOR = 1e-5
RTOL_FLOOR = 1e-5
ERROR_FACTOR = 10.0
# Rows whose (values, indices) leave the index open among equal values (unless stable=True): tapeflow's
# indices must pick PyTorch's values from the input, not equal PyTorch's indices.
TIES_OPEN = frozenset(("topk", "sort"))
CLEAR_ERRORS = (tfl.TapeError, TypeError, ValueError, IndexError, NotImplementedError)

# The modules of issue 41's list; those with a ModuleInfo row are run through module_db.
MODULES = [
    "Linear",
    "Conv1d",
    "Conv2d",
    "ConvTranspose2d",
    "MaxPool1d",
    "MaxPool2d",
    "AvgPool2d",
    "AdaptiveAvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "LayerNorm",
    "GroupNorm",
    "RMSNorm",
    "Dropout",
    "Embedding",
    "Identity",
    "Flatten",
    "Unflatten",
    "ReLU",
    "GELU",
    "SiLU",
    "Tanh",
    "Sigmoid",
    "Softmax",
    "LeakyReLU",
    "ELU",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "GRU",
    "LSTM",
    "GRUCell",
    "LSTMCell",
    "Sequential",
    "ModuleList",
    "ModuleDict",
    "Upsample",
    "CrossEntropyLoss",
    "MSELoss",
    "L1Loss",
    "BCEWithLogitsLoss",
    "NLLLoss",
    "HuberLoss",
]

Kind = Literal["pass", "unsupported", "silent", "error", "skipped"]


@dataclass(frozen=True)
class Outcome:
    """One sample, called through one binding: its class, its description and what was seen."""

    kind: Kind
    sample: str
    binding: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.kind}: {self.binding} on {self.sample}" + (f": {self.detail}" if self.detail else "")


@dataclass
class Report:
    """Every outcome of one table entry (or one module), and the problems a test reports."""

    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0  # CPU time of this process (the machine is shared: wall time says little)

    def count(self, kind: Kind) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def counts(self) -> dict[str, int]:
        return {k: self.count(k) for k in ("pass", "unsupported", "silent", "error", "skipped")}


# --------------------------------------------------------------------------- the databases


@functools.cache
def op_rows() -> dict[str, Any]:
    """OpInfo rows by id: ``name`` for a row without a variant, ``name.variant`` for one with."""
    from torch.testing._internal.common_methods_invocations import op_db

    return {(o.name if not o.variant_test_name else f"{o.name}.{o.variant_test_name}"): o for o in op_db}


@functools.cache
def module_rows() -> dict[str, Any]:
    """ModuleInfo rows by the module class's name (``Linear``, ``GRU``, ...)."""
    from torch.testing._internal.common_modules import module_db

    return {m.module_cls.__name__: m for m in module_db}


@functools.cache
def session() -> tfl.Session:
    """The one eager session every sample records on (reset after each)."""
    return tfl.Session(lazy=False)


# --------------------------------------------------------------------------- conversions

_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32)}
_NARROW[np.dtype(np.complex128)] = np.dtype(np.complex64)
_NARROW[np.dtype(np.uint64)] = np.dtype(np.uint32)


def narrow(dtype: np.dtype) -> np.dtype:
    """The dtype tapeflow gives where PyTorch gives ``dtype`` (JAX without x64: no 64-bit types)."""
    return _NARROW.get(np.dtype(dtype), np.dtype(dtype))


def np_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (``torch.bfloat16`` as JAX's ``bfloat16``)."""
    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)


def _host(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(np_dtype(torch.bfloat16))
    return t.numpy()


def _shape_text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in t.shape)}]"


def _text(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return _shape_text(obj)
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__
    if isinstance(obj, torch.Size):
        return repr(tuple(obj))
    if isinstance(obj, list):
        return "[" + ", ".join(_text(v) for v in obj) + "]"
    if isinstance(obj, tuple):
        return "(" + ", ".join(_text(v) for v in obj) + ("," if len(obj) == 1 else "") + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in obj.items()) + "}"
    if callable(obj) and hasattr(obj, "__name__"):
        return obj.__name__
    return repr(obj)


def describe(row: str, args: tuple[object, ...], kwargs: dict[str, object]) -> str:
    """The name gaps match: ``row(arg, ..., key=value)``, tensors written as ``dtype[shape]``."""
    parts = [_text(a) for a in args] + [f"{k}={_text(v)}" for k, v in kwargs.items()]
    return f"{row}({', '.join(parts)})"


def _elements(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, (list, tuple)):
        return sum(_elements(v) for v in obj)
    if isinstance(obj, dict):
        return sum(_elements(v) for v in obj.values())
    return 0


def _walk(obj: object, fn: Callable[[torch.Tensor], object], memo: dict[int, object]) -> object:
    """``obj`` with each tensor replaced by ``fn(tensor)`` (a tensor met twice is converted once)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, list):
        return [_walk(v, fn, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_walk(v, fn, memo) for v in obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn, memo) for k, v in obj.items()}
    return obj


def _wants_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and t.is_floating_point()


class _Inputs:
    """One sample's arguments three ways: PyTorch float32 (as given), PyTorch float64, tapeflow tensors.

    ``grads32`` / ``grads64`` / ``leaves`` list, in the same order, the float inputs whose
    gradients are compared.
    """

    def __init__(self, args: object, s: tfl.Session | None) -> None:
        self.grads32: list[torch.Tensor] = []
        self.grads64: list[torch.Tensor] = []
        self.leaves: list[tfl.Tensor] = []
        self.args32 = _walk(args, self._note32, {})
        self.args64 = _walk(args, self._up, {})
        self.tapeflow = None if s is None else _walk(args, functools.partial(self._leaf, s), {})

    def _note32(self, t: torch.Tensor) -> torch.Tensor:
        if _wants_grad(t):
            self.grads32.append(t)
        return t

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        out = t.detach().double().requires_grad_(t.requires_grad)
        if _wants_grad(t):
            self.grads64.append(out)
        return out

    def _leaf(self, s: tfl.Session, t: torch.Tensor) -> tfl.Tensor:
        value = _host(t)
        value = value.astype(narrow(value.dtype))
        leaf = s.input(value, requires_grad=_wants_grad(t))
        if _wants_grad(t):
            self.leaves.append(leaf)
        return leaf


def convert_value(obj: object) -> object:
    """A constructor argument as tapeflow takes it: torch dtypes as NumPy dtypes, tensors as arrays."""
    if isinstance(obj, torch.dtype):
        return np_dtype(obj)
    if isinstance(obj, torch.Tensor):
        v = _host(obj)
        return v.astype(narrow(v.dtype))
    if isinstance(obj, torch.device):
        return obj.type
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(convert_value(v) for v in obj)
    if isinstance(obj, dict):
        return {k: convert_value(v) for k, v in obj.items()}
    return obj


def _convert_kwargs(obj: object) -> object:
    """Sample arguments other than tensors: torch dtypes as NumPy dtypes (tensors are already leaves)."""
    if isinstance(obj, torch.dtype):
        return np_dtype(obj)
    if isinstance(obj, torch.device):
        return obj.type
    if isinstance(obj, list):
        return [_convert_kwargs(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_convert_kwargs(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _convert_kwargs(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- comparison


class Different(Exception):
    """A silent difference: what differs, where."""


def _fields(obj: object) -> tuple[str, ...] | None:
    got = getattr(type(obj), "__match_args__", None) or getattr(obj, "_fields", None)
    return tuple(got) if got is not None else None


def _is_named(obj: object) -> bool:
    return type(obj).__module__ == "torch.return_types"


def _flat_outputs(
    where: str, t32: object, t64: object, out: object, found: list[tuple[str, torch.Tensor, torch.Tensor, object]]
) -> None:
    """Check ``out``'s structure against PyTorch's ``t32``, and list each tensor with its path."""
    if isinstance(t32, torch.Tensor):
        if not isinstance(out, tfl.Tensor):
            raise Different(f"{where}: PyTorch returns a Tensor, tapeflow a {type(out).__name__}")
        found.append((where, t32, t64, out))
        return
    if _is_named(t32):
        names = _fields(t32)
        if not isinstance(out, tuple) or _fields(out) != names:
            got = _fields(out) if isinstance(out, tuple) else type(out).__name__
            raise Different(f"{where}: PyTorch returns the named tuple {type(t32).__name__}{names}, tapeflow {got}")
    if isinstance(t32, (tuple, list)):
        kind = tuple if isinstance(t32, tuple) else list
        if not isinstance(out, kind):
            raise Different(f"{where}: PyTorch returns a {kind.__name__}, tapeflow a {type(out).__name__}")
        if len(out) != len(t32):
            raise Different(f"{where}: PyTorch returns {len(t32)} items, tapeflow {len(out)}")
        for i, (a, b, c) in enumerate(zip(t32, t64, out)):
            _flat_outputs(f"{where}[{i}]", a, b, c, found)
        return
    if t32 is None:
        if out is not None:
            raise Different(f"{where}: PyTorch returns None, tapeflow {type(out).__name__}")
        return
    if isinstance(t32, (bool, int, float, complex)):
        kind = type(t32)
        if type(out) is not kind and not (kind is int and isinstance(out, int) and not isinstance(out, bool)):
            raise Different(f"{where}: PyTorch returns a {kind.__name__}, tapeflow a {type(out).__name__} ({out!r})")
        if not _close_scalar(t32, t64, out):
            raise Different(f"{where}: {out!r} != PyTorch's {t32!r}")
        return
    raise Different(f"{where}: the harness cannot compare a {type(t32).__name__} output")


def _close_scalar(t32: object, t64: object, out: object) -> bool:
    if isinstance(t32, (bool, int)):
        return out == t32
    return bool(_close(np.asarray(t32), np.asarray(t64), np.asarray(out)))


def _close(a32: np.ndarray, a64: np.ndarray, got: np.ndarray) -> bool:
    """``got`` within the tolerance PyTorch's own float32 error gives (see the module docstring)."""
    a32, a64, got = (np.asarray(v, np.complex128 if np.iscomplexobj(v) else np.float64) for v in (a32, a64, got))
    finite = np.isfinite(a32)
    if not np.array_equal(a32[~finite], got[~finite], equal_nan=True):
        return False
    if not np.all(np.isfinite(got[finite])):
        return False
    ref = np.where(np.isfinite(a64), a64, a32)[finite]
    own = np.abs(a32[finite] - ref)
    atol = max(ERROR_FACTOR * float(own.max(initial=0.0)), ATOL_FLOOR)
    return bool(np.all(np.abs(got[finite] - ref) <= atol + RTOL_FLOOR * np.abs(ref)))


def _check_tensor(where: str, t32: torch.Tensor, t64: torch.Tensor, out: tfl.Tensor, values: bool = True) -> None:
    value = out.value
    want = narrow(np_dtype(t32.dtype))
    if tuple(value.shape) != tuple(t32.shape):
        raise Different(f"{where}: shape {tuple(value.shape)} != PyTorch's {tuple(t32.shape)}")
    if np.dtype(value.dtype) != want:
        raise Different(f"{where}: dtype {np.dtype(value.dtype)} != {want} (PyTorch's {t32.dtype})")
    if not values:
        return
    a32, got = _host(t32), np.asarray(value)
    if t32.is_floating_point() or t32.is_complex():
        if not _close(a32, _host(t64), got):
            raise Different(f"{where}: values differ: {_diff(a32, got)}")
    elif not np.array_equal(a32, got):
        raise Different(f"{where}: values differ: {_diff(a32, got)}")


def _diff(want: np.ndarray, got: np.ndarray) -> str:
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return f"shapes {got.shape} vs {want.shape}"
    bad = np.argwhere(~np.isclose(got.astype(np.float64), want.astype(np.float64), equal_nan=True))
    if not len(bad):
        return "within rounding, but outside PyTorch's own float32 error"
    i = tuple(int(v) for v in bad[0])
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    return (
        f"{len(bad)} of {want.size} elements, first at {i}: {got[i]!r} vs PyTorch's {want[i]!r}; max |diff| {err:.3g}"
    )


def _cotangents(outputs: list[tuple[str, torch.Tensor, torch.Tensor, object]], seed: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(t32.shape).astype(np.float32) if t32.requires_grad and t32.is_floating_point() else None
        for _, t32, _, _ in outputs
    ]


def _torch_grads(outs: list[torch.Tensor], cots: list[np.ndarray | None], wrt: list[torch.Tensor]) -> list[np.ndarray]:
    terms = [(o * torch.from_numpy(c).to(o.dtype)).sum() for o, c in zip(outs, cots) if c is not None]
    got = torch.autograd.grad(sum(terms), wrt, allow_unused=True)
    return [np.zeros(tuple(w.shape), np.float64) if g is None else _host(g) for g, w in zip(got, wrt)]


def _tapeflow_backward(outs: list[object], cots: list[np.ndarray | None]) -> tfl.Grads:
    """``Session.backward`` of ``sum(out * cotangent)``: one output is seeded with its cotangent directly."""
    used = [(o, c) for o, c in zip(outs, cots) if c is not None]
    if len(used) == 1:
        ((o, c),) = used
        return session().backward(o, seed=c)  # type: ignore[arg-type]
    return session().backward(_tapeflow_loss(outs, cots))


def _tapeflow_loss(outs: list[object], cots: list[np.ndarray | None]) -> tfl.Tensor:
    loss = None
    for o, c in zip(outs, cots):
        if c is not None:
            term = tfl.numpy.sum(o * c)
            loss = term if loss is None else loss + term
    assert loss is not None
    return loss


def _grad_of(grads: tfl.Grads, key: object, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.asarray(grads[key])
    except KeyError:
        return np.zeros(shape, np.float32)


# --------------------------------------------------------------------------- running a sample


def _clear(exc: BaseException, name: str) -> bool:
    """A clear refusal: one of the exception types a user can act on, and its message names the entry.

    A module may be named as its class (``MaxPool1d``) or its function (``max_pool1d``).
    """
    text = str(exc).lower()
    snake = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower()
    return isinstance(exc, CLEAR_ERRORS) and (name.lower() in text or snake in text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text[:300]}"


class _TorchShim(types.SimpleNamespace):
    """``torch`` inside an OpInfo row's lambda, run for tapeflow: ``torch.<f>`` is ``tfl.<f>``."""

    def __getattr__(self, name: str) -> object:
        return getattr(tfl, name)


_SHIM_GLOBALS = {
    "torch": _TorchShim(nn=types.SimpleNamespace(functional=tfl_F)),
    "F": tfl_F,
    "np": np,
}


def _lambda_for_tapeflow(fn: types.FunctionType) -> Callable[..., object]:
    """The row's lambda with ``torch`` and ``F`` meaning tapeflow (a method call stays a method call)."""
    glob = dict(fn.__globals__)
    glob.update(_SHIM_GLOBALS)
    return types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)


def bindings(entry: Entry, row: Any) -> list[tuple[str, Callable[..., object] | None]]:
    """The callables a row's samples run through: ``(label, fn)``; fn None means "the input's method".

    A row whose op is a lambda (``lambda x, *a: x.view(*a)``) runs that lambda with tapeflow in
    place of torch (its body says which binding it calls). Otherwise each binding the entry
    declares runs, once per distinct function.
    """
    op = row.op
    if getattr(op, "__name__", "") == "<lambda>" and isinstance(op, types.FunctionType):
        return [("OpInfo's lambda", _lambda_for_tapeflow(op))]
    if SURFACE.get(entry.name) is not entry:  # an entry outside the table (the harness's own tests)
        return [(f"{entry.name}()", entry.fn)]
    out: list[tuple[str, Callable[..., object] | None]] = []
    seen: list[object] = []
    name = entry.name
    for b in ("F", "tfl", "method", "property"):
        if b not in entry.bind:
            continue
        if b == "F":
            fn = getattr(tfl_F, name, None)
            label = f"F.{name}"
        elif b == "tfl":
            fn = getattr(tfl, name, None)
            label = f"tfl.{name}"
        else:
            fn = getattr(tfl.Tensor, name, None)
            fn = getattr(fn, "fget", fn)
            label = f"x.{name}"
        if fn is None:
            out.append((label, functools.partial(_missing, label)))
            continue
        if any(fn is s for s in seen):
            continue
        seen.append(fn)
        out.append((label, None if b in ("method", "property") else fn))
    return out


def _missing(label: str, *args: object, **kwargs: object) -> object:
    raise _Missing(f"the entry declares {label}, but there is no such name")


class _Missing(Exception):
    """A binding the entry declares is not there (an ``error``: the table and the exports disagree)."""


def _call(entry: Entry, label: str, fn: Callable[..., object] | None, inp: object, args: Any, kwargs: Any) -> object:
    if fn is not None:
        return fn(inp, *args, **kwargs)
    if "property" in entry.bind and not args and not kwargs:
        return getattr(inp, entry.name)
    if not isinstance(inp, tfl.Tensor):
        raise _NotApplicable(f"{label} needs a Tensor input")
    return getattr(inp, entry.name)(*args, **kwargs)


class _NotApplicable(Exception):
    pass


def _torch_call(row: Any, inp: object, args: Any, kwargs: Any) -> object:
    return row.op(inp, *args, **kwargs)


def run_sample(entry: Entry, row_id: str, row: Any, sample: Any, grads: bool, index: int) -> list[Outcome]:
    """Every binding's outcome on one sample."""
    desc = describe(row_id, (sample.input, *sample.args), dict(sample.kwargs))
    if _elements((sample.input, sample.args, sample.kwargs)) > MAX_ELEMENTS:
        return [Outcome("skipped", desc, "-", f"more than {MAX_ELEMENTS} elements")]
    try:
        ref = _reference(row_id, row, sample)
    except Exception as exc:
        return [Outcome("skipped", desc, "-", f"PyTorch raised {_first_line(exc)}")]
    s = session()
    results = []
    for label, fn in bindings(entry, row):
        results.append(_run_binding(entry, ref, sample, desc, label, fn, grads, index, s))
    return [r for r in results if r is not None]


@dataclass
class _Reference:
    """PyTorch's results on one sample: float32 (as given), float64 (inputs upcast), and whether it is random."""

    t32: object
    t64: object
    random: bool
    ties: bool  # (values, indices) whose indices PyTorch leaves open among equal values (topk, unstable sort)


def _reference(row_id: str, row: Any, sample: Any) -> _Reference:
    packed = (sample.input, tuple(sample.args), dict(sample.kwargs))
    conv = _Inputs(packed, None)
    torch.manual_seed(SEED)
    t32 = _torch_call(row, *conv.args32)  # type: ignore[misc]
    torch.manual_seed(SEED + 1)
    again = _torch_call(row, *conv.args32)  # type: ignore[misc]
    t64 = _torch_call(row, *conv.args64)  # type: ignore[misc]
    # OpInfo wraps its random ops in wrapper_set_seed (the same draws on every call): random all the same
    random = not _same(t32, again) or "wrapper_set_seed" in getattr(getattr(row.op, "__code__", None), "co_names", ())
    ties = row.name in TIES_OPEN and not sample.kwargs.get("stable", False)
    return _Reference(t32, t64, random, ties)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b) or a.numel() == 0)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _picks_same_values(where: str, x: np.ndarray, values: np.ndarray, theirs: np.ndarray, mine: np.ndarray) -> None:
    """Indices that differ from PyTorch's only among equal values: they pick PyTorch's values from the input."""
    if np.array_equal(theirs, mine):
        return
    for axis in range(x.ndim):
        try:
            if not np.array_equal(np.take_along_axis(x, theirs, axis), values):
                continue
            if np.array_equal(np.take_along_axis(x, mine, axis), values):
                return
        except (IndexError, ValueError):
            continue
    raise Different(f"{where}: indices differ and do not pick PyTorch's values: {_diff(theirs, mine)}")


def _compare(
    ref: _Reference, out: object, sample_input: object
) -> list[tuple[str, torch.Tensor, torch.Tensor, object]]:
    """Check ``out`` against PyTorch's (structure, shapes, dtypes, values); the tensors, for the gradient check."""
    found: list[tuple[str, torch.Tensor, torch.Tensor, object]] = []
    _flat_outputs("out", ref.t32, ref.t64, out, found)
    pairs = ref.ties and _is_named(ref.t32) and _fields(ref.t32) == ("values", "indices")
    for where, a, b, o in found:
        if pairs and where == "out[1]" and isinstance(sample_input, torch.Tensor):
            _check_tensor(where, a, b, o, values=False)  # type: ignore[arg-type]
            vals = _host(ref.t32[0])  # type: ignore[index]
            _picks_same_values(where, _host(sample_input), vals, _host(a), np.asarray(o.value))  # type: ignore[attr-defined]
        else:
            _check_tensor(where, a, b, o, values=not ref.random)  # type: ignore[arg-type]
    return found


def _run_binding(
    entry: Entry,
    ref: _Reference,
    sample: Any,
    desc: str,
    label: str,
    fn: Callable[..., object] | None,
    grads: bool,
    index: int,
    s: tfl.Session,
) -> Outcome | None:
    packed = (sample.input, tuple(sample.args), dict(sample.kwargs))
    try:
        with jax.enable_x64(False), s:
            conv = _Inputs(packed, s)
            inp, args, kwargs = conv.tapeflow  # type: ignore[misc]
            args, kwargs = _convert_kwargs(args), _convert_kwargs(kwargs)
            try:
                out = _call(entry, label, fn, inp, args, kwargs)
            except _NotApplicable:
                return None
            except Exception as exc:
                kind: Kind = "unsupported" if _clear(exc, entry.name) else "error"
                return Outcome(kind, desc, label, _first_line(exc))
            try:
                found = _compare(ref, out, sample.input)
                if grads and conv.grads32 and not ref.random:
                    _check_grads(found, conv, index)
            except Different as d:
                return Outcome("silent", desc, label, str(d))
            except Exception as exc:
                return Outcome("error", desc, label, f"in the comparison: {_first_line(exc)}")
        return Outcome("pass", desc, label, "random: structure, shapes and dtypes compared" if ref.random else "")
    finally:
        s.reset()


def _check_grads(found: list[tuple[str, torch.Tensor, torch.Tensor, object]], conv: _Inputs, index: int) -> None:
    cots = _cotangents(found, SEED + index)
    if all(c is None for c in cots):
        return
    g32 = _torch_grads([a for _, a, _, _ in found], cots, conv.grads32)
    g64 = _torch_grads([b for _, _, b, _ in found], cots, conv.grads64)
    got = _tapeflow_backward([o for *_, o in found], cots)
    for i, (leaf, a, b) in enumerate(zip(conv.leaves, g32, g64)):
        mine = _grad_of(got, leaf, a.shape)
        if mine.shape != a.shape:
            raise Different(f"gradient of input {i}: shape {mine.shape} != PyTorch's {a.shape}")
        if not _close(a, b, mine):
            raise Different(f"gradient of input {i} {a.shape}: {_diff(a, mine)}")


def _form(sample: Any) -> str:
    """A sample's call form: tensors as their dtype and rank, numbers as their type, strings and None as they are."""

    def text(obj: object) -> str:
        if isinstance(obj, torch.Tensor):
            return f"{obj.dtype}:{obj.dim()}d"
        if isinstance(obj, (list, tuple)):
            return "(" + ",".join(text(v) for v in obj) + ")"
        if isinstance(obj, dict):
            return "{" + ",".join(f"{k}={text(v)}" for k, v in obj.items()) + "}"
        if obj is None or isinstance(obj, str):
            return repr(obj)
        return type(obj).__name__

    return text((sample.input, *sample.args)) + text(dict(sample.kwargs))


def _samples(row: Any, dtype: torch.dtype, limit: int) -> list[Any]:
    """Up to ``limit`` of the row's samples: the first of each call form, in PyTorch's order, then the rest.

    The first ``CANDIDATES x limit`` samples the row generates (after ``torch.manual_seed(SEED)``) are
    the candidates, so the choice is the same on every run.
    """
    torch.manual_seed(SEED)
    grad = dtype.is_floating_point and row.supports_autograd
    it = iter(row.sample_inputs("cpu", dtype, requires_grad=grad))
    pool = []
    for _ in range(CANDIDATES * limit):
        try:
            pool.append(next(it))
        except StopIteration:
            break
    seen: set[str] = set()
    first, rest = [], []
    for sample in pool:
        form = _form(sample)
        (rest if form in seen else first).append(sample)
        seen.add(form)
    return (first + rest)[:limit]


def check_entry(name: str | Entry) -> Report:
    """Run every OpInfo row of the entry ``name``, classify its samples, and list the problems."""
    entry = SURFACE[name] if isinstance(name, str) else name
    report = Report(entry.name)
    start = time.process_time()
    rows = op_rows()
    for row_id in entry.opinfo:
        row = rows.get(row_id)
        if row is None:
            near = difflib.get_close_matches(row_id, list(rows), n=4, cutoff=0.6)
            report.problems.append(f"opinfo row {row_id!r} is not in PyTorch's op_db (rows near it: {near})")
            continue
        plans = [(torch.float32, MAX_SAMPLES, True)]
        if row.supports_dtype(torch.int64, "cpu"):
            plans.append((torch.int64, MAX_INT_SAMPLES, False))
        for dtype, limit, grads in plans:
            for i, sample in enumerate(_samples(row, dtype, limit)):
                report.outcomes.extend(run_sample(entry, row_id, row, sample, grads and i < MAX_GRAD_SAMPLES, i))
    report.seconds = time.process_time() - start
    _judge(report, entry.gaps)
    return report


def _judge(report: Report, gaps: dict[str, str] | Any) -> None:
    """The report's problems: silent and unclear outcomes, refusals no gap lists, gaps no refusal matches."""
    used = set()
    for o in report.outcomes:
        if o.kind in ("silent", "error"):
            report.problems.append(o.line())
        elif o.kind == "unsupported":
            keys = [k for k in gaps if k in o.sample]
            used.update(keys)
            if not keys:
                report.problems.append(f"{o.line()} (no gap lists it: add a gaps entry whose key is in the sample)")
    for k in gaps:
        if k not in used:
            report.problems.append(f"stale gap {k!r}: no refused sample matches it (reason: {gaps[k]})")


# --------------------------------------------------------------------------- modules


def _tapeflow_module_arg(obj: object) -> object:
    """A torch module passed to a constructor (``TransformerEncoder(layer, 2)``), rebuilt as tapeflow's."""
    if isinstance(obj, torch.nn.TransformerEncoderLayer):
        attn = obj.self_attn
        act = obj.activation
        act_name = getattr(act, "__name__", type(act).__name__).lower()
        return tfl.nn.TransformerEncoderLayer(
            attn.embed_dim,
            attn.num_heads,
            dim_feedforward=obj.linear1.out_features,
            dropout=obj.dropout.p,
            activation="gelu" if "gelu" in act_name else "relu",
            layer_norm_eps=obj.norm1.eps,
            batch_first=attn.batch_first,
            norm_first=obj.norm_first,
            bias=obj.linear1.bias is not None,
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tapeflow_module_arg(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _tapeflow_module_arg(v) for k, v in obj.items()}
    name = getattr(obj, "__name__", None)
    if callable(obj) and name and getattr(torch.nn.functional, name, None) is obj:  # activation=F.gelu
        return getattr(tfl_F, name)
    return convert_value(obj)


def module_gaps(name: str) -> dict[str, str]:
    """A module's gaps: those of its table entry (``records="module"``, named ``name`` or ``nn.<name>``), if any."""
    for key in (name, f"nn.{name}"):
        e = SURFACE.get(key)
        if e is not None and e.records == "module":
            return dict(e.gaps)
    return {}


def _module_desc(name: str, mi: Any, training: bool) -> str:
    c, f = mi.constructor_input, mi.forward_input
    ctor = describe(name, tuple(c.args), dict(c.kwargs))
    fwd = describe("", tuple(f.args), dict(f.kwargs))
    return f"{ctor}{fwd} [{'train' if training else 'eval'}]" + (f" {mi.desc}" if mi.desc else "")


def _random_in_training(tm: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    probe = copy.deepcopy(tm)
    with torch.no_grad():
        torch.manual_seed(SEED)
        a = probe(*args, **kwargs)
        torch.manual_seed(SEED + 1)
        b = probe(*args, **kwargs)
    return not _same(a, b)


def check_module(name: str) -> Report:
    """Run the ModuleInfo inputs of ``torch.nn.<name>`` through ``tfl.nn.<name>`` (train and eval modes)."""
    report = Report(name)
    start = time.process_time()
    info = module_rows()[name]
    for training in (True, False) if info.train_and_eval_differ else (True,):
        torch.manual_seed(SEED)
        inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=training)
        for i, mi in enumerate(inputs[: MAX_MODULE_INPUTS if training else MAX_EVAL_INPUTS]):
            report.outcomes.append(_run_module_input(name, info, mi, training, i))
    report.seconds = time.process_time() - start
    _judge(report, module_gaps(name))
    return report


def _run_module_input(name: str, info: Any, mi: Any, training: bool, index: int) -> Outcome:
    desc = _module_desc(name, mi, training)
    label = f"tfl.nn.{name}"
    c, f = mi.constructor_input, mi.forward_input
    if _elements((c.args, c.kwargs, f.args, f.kwargs)) > MAX_ELEMENTS:
        return Outcome("skipped", desc, label, f"more than {MAX_ELEMENTS} elements")
    try:
        torch.manual_seed(SEED)
        tm = info.module_cls(*c.args, **c.kwargs).train(training)
        conv = _Inputs((tuple(f.args), dict(f.kwargs)), None)
        fargs, fkw = conv.args32  # type: ignore[misc]
        random = training and _random_in_training(tm, fargs, fkw)
        tm64 = copy.deepcopy(tm).double()
        before = {k: v.detach().clone() for k, v in tm.state_dict().items()}
        t32 = tm(*fargs, **fkw)
        a64, k64 = conv.args64  # type: ignore[misc]
        t64 = tm64(*a64, **k64)
    except Exception as exc:
        return Outcome("skipped", desc, label, f"PyTorch raised {_first_line(exc)}")
    cls = getattr(tfl.nn, name, None)
    if cls is None:
        return Outcome("error", desc, label, f"tfl.nn has no {name}")
    s = session()
    try:
        with jax.enable_x64(False):
            try:
                m = cls(*_tapeflow_module_arg(tuple(c.args)), **_tapeflow_module_arg(dict(c.kwargs)))  # type: ignore[arg-type]
                m.load_state_dict({k: convert_value(v) for k, v in before.items()})
                m.train(training)
            except Exception as exc:
                kind: Kind = "unsupported" if _clear(exc, name) else "error"
                return Outcome(kind, desc, label, f"building it: {_first_line(exc)}")
            with s:
                conv = _Inputs((tuple(f.args), dict(f.kwargs)), s)
                args, kwargs = conv.tapeflow  # type: ignore[misc]
                try:
                    out = m(*args, **_convert_kwargs(kwargs))  # type: ignore[operator]
                except Exception as exc:
                    kind = "unsupported" if _clear(exc, name) else "error"
                    return Outcome(kind, desc, label, _first_line(exc))
                try:
                    found = _compare(_Reference(t32, t64, random, False), out, None)
                    _check_parameters(tm, m)
                    if not random:
                        _check_module_grads(tm, tm64, m, found, conv, index)
                    _check_state(tm, m)
                except Different as d:
                    return Outcome("silent", desc, label, str(d))
                except Exception as exc:
                    return Outcome("error", desc, label, f"in the comparison: {_first_line(exc)}")
        return Outcome("pass", desc, label, "random: structure, shapes and dtypes compared" if random else "")
    finally:
        s.reset()


def _check_module_grads(
    tm: torch.nn.Module,
    tm64: torch.nn.Module,
    m: Any,
    found: list[tuple[str, torch.Tensor, torch.Tensor, object]],
    conv: _Inputs,
    index: int,
) -> None:
    theirs = dict(tm.named_parameters())
    mine = dict(m.named_parameters())
    cots = _cotangents(found, SEED + index)
    if all(c is None for c in cots):
        return
    names = list(theirs)
    wrt32 = conv.grads32 + [theirs[k] for k in names]
    p64 = dict(tm64.named_parameters())
    wrt64 = conv.grads64 + [p64[k] for k in names]
    g32 = _torch_grads([a for _, a, _, _ in found], cots, wrt32)
    g64 = _torch_grads([b for _, _, b, _ in found], cots, wrt64)
    got = _tapeflow_backward([o for *_, o in found], cots)
    keys: list[tuple[str, object]] = [(f"input {i}", leaf) for i, leaf in enumerate(conv.leaves)]
    keys += [(f"parameter {k}", mine[k]) for k in names]
    for (what, key), a, b in zip(keys, g32, g64):
        try:
            value = np.asarray(got[key])
        except KeyError:
            value = np.zeros(a.shape, np.float32)
        if value.shape != a.shape:
            raise Different(f"gradient of {what}: shape {value.shape} != PyTorch's {a.shape}")
        if not _close(a, b, value):
            raise Different(f"gradient of {what} {a.shape}: {_diff(a, value)}")


def _check_parameters(tm: torch.nn.Module, m: Any) -> None:
    """``named_parameters()`` has PyTorch's names and shapes."""
    theirs = dict(tm.named_parameters())
    mine = dict(m.named_parameters())
    if sorted(theirs) != sorted(mine):
        raise Different(f"named_parameters(): {sorted(mine)} != PyTorch's {sorted(theirs)}")
    for k, p in theirs.items():
        shape = tuple(np.shape(getattr(mine[k], "value", mine[k])))
        if shape != tuple(p.shape):
            raise Different(f"parameter {k}: shape {shape} != PyTorch's {tuple(p.shape)}")


def _check_state(tm: torch.nn.Module, m: Any) -> None:
    """After the forward, the state dict (running statistics included) has PyTorch's keys and values."""
    theirs = tm.state_dict()
    mine = m.state_dict()
    if sorted(theirs) != sorted(mine):
        raise Different(f"state_dict keys after forward: {sorted(mine)} != PyTorch's {sorted(theirs)}")
    for k, v in theirs.items():
        a = _host(v)
        got = np.asarray(getattr(mine[k], "value", mine[k]))
        if got.shape != a.shape:
            raise Different(f"state_dict[{k!r}] after forward: shape {got.shape} != PyTorch's {a.shape}")
        if np.issubdtype(a.dtype, np.floating):
            if not _close(a, a, got):
                raise Different(f"state_dict[{k!r}] after forward: {_diff(a, got)}")
        elif not np.array_equal(a, got):
            raise Different(f"state_dict[{k!r}] after forward: {_diff(a, got)}")


# --------------------------------------------------------------------------- what the tests run


def opinfo_entries() -> list[str]:
    """The table entries with OpInfo rows, in declaration order."""
    return [n for n, e in SURFACE.items() if e.opinfo]


def module_names() -> list[str]:
    """The modules of the issue's list that have a ModuleInfo row (needs the database)."""
    rows = module_rows()
    return [n for n in MODULES if n in rows]
