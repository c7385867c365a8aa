"""PyTorch and Flax NNX weights in and out, through one table of per-layer names and layouts.

:func:`load_state_dict` / :func:`state_dict` speak PyTorch's ``state_dict``;
:func:`load_nnx_state` / :func:`nnx_state` speak Flax NNX's ``nnx.State``. All
four walk a module with :func:`_records` over :data:`TABLE`, and both imports
go through :func:`_load`, so a layer's names and layout transforms, the
shape/dtype checks and the tie rule each live in one place. Neither torch nor
flax is imported unless you hand in their objects (or ask :func:`nnx_state`
for an ``nnx.State``). The naming table, the checks and the tie rule are
documented on :func:`load_state_dict`.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core._registry import fmt_spec
from .._core._typing import PyTree
from .._shell._commit import commit
from .._shell._params import Param, Storage
from ._container import Sequential
from ._conv import Conv2d
from ._layers import Embedding, Linear, MultiHeadAttention, TiedLinear
from ._module import Module
from ._norm import BatchNorm1d, BatchNorm2d, LayerNorm
from ._recurrent import GRUCell, LSTMCell

__all__ = ["TABLE", "IncompatibleKeys", "load_nnx_state", "load_state_dict", "nnx_state", "state_dict"]

Framework = Literal["torch", "flax"]
_FRAMEWORKS = {"torch": "PyTorch", "flax": "Flax NNX"}


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True, eq=False)
class Layout:
    """A layout transform both ways between tapeflow's Params and one foreign tensor.

    ``out(ctx, *values)`` makes the foreign tensor from the Params' values;
    ``into(ctx, foreign)`` returns the Params' values. ``ctx(module)`` is the
    layer setting the transform needs (the head count), None for most.

    >>> TRANSPOSE.into(None, TRANSPOSE.out(None, np.ones((3, 2))))[0].shape
    (3, 2)
    """

    name: str
    out: Callable[..., np.ndarray]
    into: Callable[..., tuple[np.ndarray, ...]]
    ctx: Callable[[Module], Hashable] = lambda m: None


def _heads(m: Module) -> Hashable:
    return getattr(m, "num_heads", None)


SAME = Layout("as stored", lambda c, a: a, lambda c, a: (a,))
TRANSPOSE = Layout("transposed", lambda c, a: a.T, lambda c, a: (a.T,))
HWIO = Layout("OIHW -> HWIO", lambda c, a: a.transpose(2, 3, 1, 0), lambda c, a: (a.transpose(3, 2, 0, 1),))
INT64 = Layout("int64", lambda c, a: a.astype(np.int64), lambda c, a: (a,))
PACKED = Layout(  # q, k, v stacked along axis 0 (PyTorch's in_proj_weight / in_proj_bias)
    "q, k, v stacked",
    lambda c, q, k, v: np.concatenate([q, k, v], axis=0),
    lambda c, a: tuple(np.split(a, 3, axis=0)),
)
HEADS_IN = Layout(
    "(out, in) -> (in, H, out/H)",
    lambda h, a: a.T.reshape(a.shape[1], h, -1),
    lambda h, a: (a.reshape(a.shape[0], -1).T,),
    _heads,
)
HEADS_BIAS = Layout("(E,) -> (H, E/H)", lambda h, a: a.reshape(h, -1), lambda h, a: (a.reshape(-1),), _heads)
HEADS_OUT = Layout(
    "(out, in) -> (H, in/H, out)",
    lambda h, a: a.T.reshape(h, -1, a.shape[0]),
    lambda h, a: (a.reshape(-1, a.shape[-1]).T,),
    _heads,
)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Entry:
    """One foreign tensor of a layer: its ``key``, the layer's Params it holds (attribute paths), its layout."""

    key: str | None  # None: no counterpart (neither exported nor expected; the Param keeps its value)
    params: tuple[str, ...]
    layout: Layout = SAME


def _e(key: str | None, *params: str, layout: Layout = SAME) -> Entry:
    return Entry(key, params or (str(key),), layout)


@dataclass(frozen=True)
class LayerMap:
    """A layer's entries per framework (None: no counterpart there), the sub-modules they cover, child renames.

    ``flax_prefix``: a prefix added to child paths in Flax names
    (``nnx.Sequential`` keeps its entries in ``layers``). Params the entries do not name, and
    sub-modules not in ``owns``, are walked as for any module.
    """

    torch: tuple[Entry, ...] | None = ()
    flax: tuple[Entry, ...] | None = ()
    owns: tuple[str, ...] = ()
    flax_prefix: str = ""


_BN = LayerMap(
    torch=(
        _e("weight"),
        _e("bias"),
        _e("running_mean"),
        _e("running_var"),
        _e("num_batches_tracked", layout=INT64),
    ),
    flax=(
        _e("scale", "weight"),
        _e("bias"),
        _e("mean", "running_mean"),
        _e("var", "running_var"),
        _e(None, "num_batches_tracked"),
    ),
)
_CELL = LayerMap(torch=tuple(_e(n) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")), flax=None)
_QKV = ("q_proj", "k_proj", "v_proj")

TABLE: dict[type[Module], LayerMap] = {
    Linear: LayerMap(torch=(_e("weight"), _e("bias")), flax=(_e("kernel", "weight", layout=TRANSPOSE), _e("bias"))),
    TiedLinear: LayerMap(torch=(_e("weight"),), flax=(_e("kernel", "weight", layout=TRANSPOSE),)),
    Embedding: LayerMap(torch=(_e("weight"),), flax=(_e("embedding", "weight"),)),
    LayerNorm: LayerMap(torch=(_e("weight"), _e("bias")), flax=(_e("scale", "weight"), _e("bias"))),
    Conv2d: LayerMap(torch=(_e("weight"), _e("bias")), flax=(_e("kernel", "weight", layout=HWIO), _e("bias"))),
    BatchNorm1d: _BN,
    BatchNorm2d: _BN,
    GRUCell: _CELL,
    LSTMCell: _CELL,
    MultiHeadAttention: LayerMap(
        torch=(
            _e("in_proj_weight", *(f"{p}.weight" for p in _QKV), layout=PACKED),
            _e("in_proj_bias", *(f"{p}.bias" for p in _QKV), layout=PACKED),
            _e("out_proj.weight"),
            _e("out_proj.bias"),
        ),
        flax=tuple(
            e
            for f, p in zip(("query", "key", "value"), _QKV)
            for e in (
                _e(f"{f}.kernel", f"{p}.weight", layout=HEADS_IN),
                _e(f"{f}.bias", f"{p}.bias", layout=HEADS_BIAS),
            )
        )
        + (_e("out.kernel", "out_proj.weight", layout=HEADS_OUT), _e("out.bias", "out_proj.bias")),
        owns=(*_QKV, "out_proj"),
    ),
    Sequential: LayerMap(flax_prefix="layers."),
}
"""Each tapeflow layer's foreign names and layouts (the table on :func:`load_state_dict`); subclasses inherit."""


# --------------------------------------------------------------------------- the walk


@dataclass(frozen=True, eq=False)
class _Rec:
    """One foreign key of a module: the Params it holds and how their layout maps."""

    key: str
    params: tuple[Param, ...]
    layout: Layout
    ctx: Hashable
    where: str  # "Linear at 'layers.0'", for messages


def _rule(m: Module) -> LayerMap:
    for cls in type(m).__mro__:
        rule = TABLE.get(cls)
        if rule is not None:
            return rule
    return LayerMap()


def _resolve(m: Module, path: str) -> Param | None:
    obj: object = m
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, Param) else None


def _records(module: Module, fw: Framework) -> list[_Rec]:
    """Every foreign key of ``module`` in definition order (a module used twice: under both paths)."""
    if not isinstance(module, Module):
        raise TypeError(f"expected a tfl.nn.Module, got {type(module).__name__}")
    out: list[_Rec] = []

    def visit(m: Module, prefix: str, path: frozenset[int]) -> None:
        rule = _rule(m)
        entries = rule.torch if fw == "torch" else rule.flax
        where = f"{type(m).__name__} at {prefix[:-1] or '<root>'!r}"
        if entries is None:
            raise ValueError(f"{where} has no {_FRAMEWORKS[fw]} counterpart in tfl.nn's interop table")
        named: set[str] = set()
        for e in entries:
            named.update(e.params)
            ps = [_resolve(m, p) for p in e.params]
            if e.key is not None and all(p is not None for p in ps):
                out.append(
                    _Rec(prefix + e.key, tuple(p for p in ps if p is not None), e.layout, e.layout.ctx(m), where)
                )
        add = rule.flax_prefix if fw == "flax" else ""
        for name, obj in m.named_members():
            if isinstance(obj, Param):
                if m.is_buffer(name) and not m.is_persistent_buffer(name):
                    continue  # register_buffer(..., persistent=False): not state-dict state, as in PyTorch
                if name not in named:
                    out.append(_Rec(prefix + name, (obj,), SAME, None, where))
            elif name.split(".")[0] not in rule.owns and id(obj) not in path:
                visit(obj, f"{prefix}{add}{name}.", path | {id(obj)})

    visit(module, "", frozenset({id(module)}))
    seen: dict[str, _Rec] = {}
    for r in out:
        if r.key in seen:
            raise ValueError(f"two parameters map to the key {r.key!r} ({seen[r.key].where} and {r.where})")
        seen[r.key] = r
    return out


# --------------------------------------------------------------------------- export


def _export(module: Module, fw: Framework) -> dict[str, np.ndarray]:
    """``{key: NumPy array}`` in ``fw``'s names and layouts; a tied storage is one array (flax: listed once)."""
    out: dict[str, np.ndarray] = {}
    made: dict[tuple[Hashable, ...], np.ndarray] = {}
    listed: set[Storage] = set()
    for r in _records(module, fw):
        sts = tuple(p.storage for p in r.params)
        if fw == "flax" and all(st in listed for st in sts):
            continue  # nnx.state lists a shared Variable once, under its first path
        listed.update(sts)
        k = (*(id(st) for st in sts), id(r.layout), r.ctx)  # the records keep the storages alive
        if k not in made:
            made[k] = np.array(r.layout.out(r.ctx, *(np.asarray(p.value) for p in r.params)), order="C")
        out[r.key] = made[k]
    return out


def state_dict(module: Module, layout: Framework = "torch") -> dict[str, np.ndarray]:
    """The module's parameters and state as ``{name: NumPy array}`` in PyTorch's names and layouts.

    ``torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})``
    accepts it when the PyTorch model's names match (see the table on :func:`load_state_dict`).
    A tied storage appears under each of its names as one array.
    ``layout="flax"`` gives Flax NNX's names and layouts as a flat dict with
    dotted keys (:func:`nnx_state` nests them).

    >>> import jax, tapeflow as tfl
    >>> emb = tfl.nn.Embedding(5, 3, key=jax.random.key(0))
    >>> head = tfl.nn.Linear(3, 3, key=jax.random.key(1))
    >>> lm = tfl.nn.Sequential(emb, head, emb.tied_output())
    >>> sd = tfl.nn.state_dict(lm)
    >>> {k: v.shape for k, v in sd.items()}
    {'0.weight': (5, 3), '1.weight': (3, 3), '1.bias': (3,), '2.weight': (5, 3)}
    >>> sd["0.weight"] is sd["2.weight"]  # one storage: one array, both names
    True
    >>> sd["1.weight"].shape  # Linear: (out, in) as PyTorch
    (3, 3)
    """
    _check_layout(layout)
    return _export(module, layout)


def nnx_state(module: Module) -> PyTree:
    """The module's parameters and state nested by path in Flax NNX's names and layouts, for ``nnx.update``.

    An ``nnx.State`` when flax is importable, else the same nested dict; list
    indices are ints, as in ``nnx.state(model)``. A tied storage is listed
    once (its first path), as ``nnx.state`` lists a shared Variable.

    >>> import jax, tapeflow as tfl
    >>> mlp = tfl.nn.MLP([3, 4, 2], key=jax.random.key(0))
    >>> st = tfl.nn.nnx_state(mlp)
    >>> # nnx.Linear's kernel is (in, out)
    >>> sorted(st["layers"]), st["layers"][1]["kernel"].shape
    ([0, 1], (4, 2))
    """
    nested: dict[int | str, PyTree] = {}  # list indices as ints, as nnx.state gives them
    for key, arr in _export(module, "flax").items():
        parts: list[int | str] = [int(p) if p.isdigit() else p for p in key.split(".")]
        d = nested
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = jnp.asarray(arr)
    try:
        nnx = importlib.import_module("flax.nnx")
    except ImportError:
        return nested
    return nnx.State(nested)


# --------------------------------------------------------------------------- import


class IncompatibleKeys(NamedTuple):
    """What :func:`load_state_dict` / :func:`load_nnx_state` did not match, as PyTorch's ``load_state_dict`` returns.

    >>> IncompatibleKeys(["bias"], [])
    IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _check_layout(layout: object) -> None:
    if layout not in _FRAMEWORKS:
        raise ValueError(f"layout must be 'torch' or 'flax', got {layout!r}")


def _token(kind: str, ptr: int, v: Any) -> Hashable:
    """What makes two values one tensor: the memory they view and how (identity for an empty one)."""
    if ptr == 0 or not int(np.prod(v.shape)):
        return ("id", id(v))
    strides = tuple(v.stride()) if kind == "torch" else v.strides
    return (kind, ptr, tuple(v.shape), strides, str(v.dtype))


def _source(key: str, v: Any) -> tuple[np.ndarray, Hashable]:
    """A mapping value as ``(NumPy array, identity token)``; torch tensors without importing torch."""
    if type(v).__module__.split(".")[0] == "torch" and hasattr(v, "detach"):
        torch = sys.modules["torch"]
        if v.is_meta:
            raise ValueError(
                f"{key!r}: a torch tensor on the meta device holds a shape but no data; load real weights "
                "(e.g. torch_model.to_empty(device='cpu') and initialize or load it first)"
            )
        if v.layout != torch.strided:
            raise ValueError(f"{key!r}: a torch {v.layout} tensor is not dense; pass it as tensor.to_dense()")
        token = _token("torch", v.data_ptr(), v)
        t = v.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(jnp.bfloat16), token
        try:
            return t.numpy(), token
        except TypeError as e:
            raise ValueError(f"{key!r}: a torch {t.dtype} tensor has no NumPy counterpart ({e})") from None
    if isinstance(v, np.ndarray):
        return v, _token("numpy", v.__array_interface__["data"][0], v)
    if isinstance(v, (jax.Array, np.generic)):
        return np.asarray(v), ("id", id(v))
    raise ValueError(f"{key!r}: expected an array (NumPy, JAX or torch), got {type(v).__name__}")


def _fits(a: np.ndarray, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    return a.size == 0 or (int(a.min()) >= info.min and int(a.max()) <= info.max)


def _refusal(module: Module, fw: Framework, errors: Sequence[str]) -> ValueError:
    """The one error of a refused import: every problem, one per line, and that nothing was changed."""
    return ValueError(
        f"cannot load the {_FRAMEWORKS[fw]} weights into {type(module).__name__} (nothing was changed):\n  "
        + "\n  ".join(dict.fromkeys(errors))
    )


def _load(
    module: Module, src: Mapping[str, tuple[np.ndarray, Hashable]], fw: Framework, strict: bool
) -> IncompatibleKeys:
    """The one import: check shapes, dtypes and ties of every key, then install all or nothing."""
    recs = _records(module, fw)
    keys = {r.key for r in recs}
    unexpected = [k for k in src if k not in keys]
    errors: list[str] = []
    fills: dict[Storage, tuple[np.ndarray, Hashable, str]] = {}  # storage -> (value, provenance, key)
    by_token: dict[Hashable, list[_Rec]] = {}
    for r in recs:
        if r.key not in src:
            continue
        arr, token = src[r.key]
        want = r.layout.out(r.ctx, *(np.broadcast_to(np.zeros((), p.dtype), p.shape) for p in r.params))
        ints = arr.dtype.kind in "iu" and want.dtype.kind in "iu"
        if arr.shape != want.shape or (arr.dtype != want.dtype and not ints):
            mine = ", ".join(fmt_spec((p.shape, p.dtype)) for p in r.params)
            errors.append(
                f"{r.key!r}: got {fmt_spec((arr.shape, arr.dtype))}, expected {fmt_spec((want.shape, want.dtype))} "
                f"({r.where} holds {mine}; {_FRAMEWORKS[fw]} layout: {r.layout.name})"
            )
            continue
        by_token.setdefault(token, []).append(r)
        for i, (p, v) in enumerate(zip(r.params, r.layout.into(r.ctx, arr))):
            if ints and not _fits(v, p.dtype):
                errors.append(f"{r.key!r}: values in [{v.min()}, {v.max()}] do not fit {p.dtype} ({r.where})")
            prov = (token, id(r.layout), r.ctx, i)
            prev = fills.setdefault(p.storage, (v, prov, r.key))
            if prev[1] != prov:
                errors.append(
                    f"{prev[2]!r} and {r.key!r} are one storage here (tied with tfl.tie) but the "
                    f"{'state dict' if fw == 'torch' else 'state'} gives them as different tensors; pass the same "
                    "tensor under both names, or only one of the names (equal values do not make a tie)"
                )
    for group in by_token.values():
        if len({tuple(id(p.storage) for p in r.params) for r in group}) > 1:
            names = ", ".join(repr(r.key) for r in group)
            errors.append(
                f"{names} are one tensor in the {'state dict' if fw == 'torch' else 'state'} (tied) but separate "
                "storages here; tie them with tfl.tie (e.g. Embedding.tied_output()) so they stay one parameter"
            )
    missing = [r.key for r in recs if r.key not in src and not all(p.storage in fills for p in r.params)]
    if strict and missing:
        errors.append(f"missing keys: {', '.join(map(repr, missing))}")
    if strict and unexpected:
        errors.append(f"unexpected keys: {', '.join(map(repr, unexpected))}")
    if errors:
        raise _refusal(module, fw, errors)
    new = [(st, jnp.asarray(np.array(v, dtype=st.dtype))) for st, (v, _, _) in fills.items()]  # copies: no aliasing
    commit(new, where=f"load the {_FRAMEWORKS[fw]} weights into {type(module).__name__}")
    return IncompatibleKeys(missing, unexpected)


def load_state_dict(
    module: Module,
    state_dict: Mapping[str, object],
    strict: bool = True,
    *,
    layout: Framework = "torch",
    transpose: str | Sequence[str] = (),
) -> IncompatibleKeys:
    r"""Install a PyTorch-style ``state_dict`` (torch tensors, NumPy or JAX arrays) into ``module``.

    Returns ``IncompatibleKeys(missing_keys, unexpected_keys)``; with
    ``strict=True`` (the default) either being non-empty is an error, with
    ``strict=False`` missing parameters keep their values and unexpected keys
    are ignored. ``layout="flax"`` reads the flat dotted keys of
    ``state_dict(module, layout="flax")``.

    **Names.** A key is the tapeflow attribute path of a layer (``encoder.layers.1``)
    joined with the layer's own name below (``TABLE``; a subclass inherits its
    base's row). Any other Module contributes its Params under their attribute
    names, as stored (``MLP``: ``layers.0.weight``, as a ``ModuleList`` named ``layers``).

    | tapeflow layer (its Params) | PyTorch name: layout | Flax NNX name: layout |
    | --- | --- | --- |
    | `Linear` (`weight` (out, in), `bias`) | `weight`: (out, in); `bias` | `kernel`: transposed to (in, out); `bias` |
    | `TiedLinear` (`weight` (V, d)) | `weight`: (V, d), as `nn.Linear(d, V, bias=False)` | `kernel`: transposed to (d, V) |
    | `Embedding` (`weight`) | `weight` | `embedding` |
    | `LayerNorm` (`weight`, `bias`) | `weight`, `bias` | `scale`, `bias` |
    | `Conv2d` (`weight` OIHW, `bias`) | `weight`: OIHW; `bias` | `kernel`: HWIO; `bias` |
    | `BatchNorm1d/2d` | `weight`, `bias`, `running_mean`, `running_var`, `num_batches_tracked` (int64) | `scale`, `bias`, `mean`, `var`; no counter (kept, not exported) |
    | `GRUCell`, `LSTMCell` | `weight_ih`, `weight_hh`, `bias_ih`, `bias_hh`: as stored | none: an error |
    | `MultiHeadAttention` (`q/k/v_proj`, `out_proj`) | `in_proj_weight` (3E, E): q, k, v weights stacked; `in_proj_bias` (3E,); `out_proj.weight`, `out_proj.bias` | `query`/`key`/`value`: `kernel` (E, H, E/H), `bias` (H, E/H); `out`: `kernel` (H, E/H, E), `bias` |
    | `Sequential` (entries `0`, `1`, ...) | `0`, `1`, ..., as `torch.nn.Sequential` | `layers.0`, `layers.1`, ..., as `nnx.Sequential` |

    Every other layer (``Conv1d``, ``MultiheadAttention``, ``GRU``, ...) stores
    its Params under PyTorch's names and layouts, so they map as stored.
    Buffers (:meth:`Module.register_buffer`) are state-dict entries unless
    registered with ``persistent=False``.

    **Foreign layouts.** ``transpose=`` takes regular expressions (one, or a
    list); every key that one of them matches in full (``re.fullmatch``) has its
    2-D value transposed before the checks. transformers' GPT-2 stores its
    ``Conv1D`` weights as ``(in, out)``; load them into ``Linear`` layers with
    ``transpose=[r".*\.(c_attn|c_proj|c_fc)\.weight"]``. A pattern that matches
    no key is an error (a misspelt pattern would otherwise load nothing transposed).

    A Param set to None (``bias=False``, ``affine=False``) has no key, as in
    PyTorch. Hyperparameters (eps, momentum, padding, heads, causal) are not
    state: build the tapeflow model with the same ones.

    **Checks.** Every shape and dtype is checked (floats exactly; an integer
    value loads into an integer Param when it fits, so PyTorch's int64 counter
    fills BatchNorm's int32 one), and the tie rule, before anything is written;
    then every storage is written in one unit: an error raises ``ValueError``,
    lists every problem and changes nothing. The values are copied, never aliased.

    **Ties: identity decides.** Two keys holding *the same tensor* (the same
    object; a torch tensor with the same ``data_ptr``, shape, strides and
    dtype; a NumPy array viewing the same memory the same way, as
    ``t.numpy()`` of one tensor twice does) must be one tapeflow storage
    (made with :func:`tfl.tie`, e.g. :meth:`Embedding.tied_output`), else it is
    an error. Conversely a tied destination given two *different* tensors is an
    error even when their values are equal: equal values never make a tie. Pass
    one tensor under both names, or only one of the names: a key is not missing
    when its storage got a value under another name, so a checkpoint that kept
    one name per tied storage loads with ``strict=True``. :func:`state_dict`
    lists a tied storage under each of its names as one array; :func:`nnx_state`
    lists it once, under its first path, as ``nnx.state`` lists a shared Variable.

    >>> import jax, numpy as np, tapeflow as tfl
    >>> lin = tfl.nn.Linear(3, 2, key=jax.random.key(0))
    >>> w = np.arange(6, dtype=np.float32).reshape(2, 3)  # (out, in), as PyTorch
    >>> sd = {"weight": w, "bias": np.zeros(2, np.float32)}
    >>> tfl.nn.load_state_dict(lin, sd)
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    >>> lin.weight.value.tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    >>> tfl.nn.load_state_dict(lin, {"weight": w, "extra": w}, strict=False)
    IncompatibleKeys(missing_keys=['bias'], unexpected_keys=['extra'])
    >>> # (in, out), as GPT-2's Conv1D stores it
    >>> conv1d_style = {"weight": w.T, "bias": np.zeros(2, np.float32)}
    >>> tfl.nn.load_state_dict(lin, conv1d_style, transpose="weight")
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    >>> try:  # doctest: +NORMALIZE_WHITESPACE
    ...     tfl.nn.load_state_dict(lin, conv1d_style)
    ... except ValueError as e:
    ...     print(str(e).splitlines()[1].strip())
    'weight': got float32[3,2], expected float32[2,3]
      (Linear at '<root>' holds float32[2,3]; PyTorch layout: as stored)
    """
    _check_layout(layout)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict expects a mapping of names to arrays, got {type(state_dict).__name__}")
    patterns = _patterns(transpose)
    src: dict[str, tuple[np.ndarray, Hashable]] = {}
    errors: list[str] = []
    used: set[re.Pattern[str]] = set()
    for k, v in state_dict.items():
        try:
            arr, token = _source(str(k), v)
        except ValueError as e:  # every unreadable key is named, not only the first
            errors.append(str(e))
            continue
        hits = [p for p in patterns if p.fullmatch(str(k))]
        if hits:
            used.update(hits)
            if arr.ndim != 2:
                errors.append(f"{str(k)!r}: transpose= matched it, but its value has shape {arr.shape}, not 2-D")
                continue
            arr = arr.T
        src[str(k)] = (arr, token)
    errors += [f"transpose= pattern {p.pattern!r} matches no key of the state dict" for p in patterns if p not in used]
    if errors:
        raise _refusal(module, layout, errors)
    return _load(module, src, layout, strict)


def _patterns(transpose: str | Sequence[str]) -> list[re.Pattern[str]]:
    """``transpose=`` as compiled patterns (one string, or a sequence of them)."""
    items = [transpose] if isinstance(transpose, str) else list(transpose)
    out = []
    for p in items:
        if not isinstance(p, str):
            raise TypeError(f"load_state_dict: transpose= takes regular expressions (str), got {type(p).__name__}")
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"load_state_dict: transpose= pattern {p!r} is not a regular expression ({e})") from None
    return out


def _flatten_nnx(state: Mapping[Any, object], prefix: str, out: dict[str, tuple[np.ndarray, Hashable]]) -> None:
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            _flatten_nnx(v, key + ".", out)
        elif any(c.__name__ == "RngState" for c in type(v).__mro__):
            continue  # flax's random-key state: tapeflow draws from its session
        elif type(v).__module__.split(".")[0] == "flax" and hasattr(v, "get_value"):
            arr, _ = _source(key, v.get_value())
            out[key] = (arr, ("id", id(v)))  # a Variable is its own identity
        else:
            out[key] = _source(key, v)


def load_nnx_state(module: Module, state: Mapping[Any, object], strict: bool = True) -> IncompatibleKeys:
    """Install a Flax NNX state (``nnx.state(model)``, or a nested dict of arrays) into ``module``.

    Paths and layouts map as the table on :func:`load_state_dict` says (``nnx.Linear``'s
    ``kernel`` is (in, out) as tapeflow's ``Linear.weight``; ``nnx.Conv``'s HWIO
    kernel becomes OIHW); the checks, the tie rule and the result are those of
    :func:`load_state_dict`. Flax's random-key state (``RngState``) is skipped.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> ln = tfl.nn.LayerNorm(3)
    >>> state = {"scale": jnp.full(3, 2.0), "bias": jnp.ones(3)}
    >>> tfl.nn.load_nnx_state(ln, state)
    IncompatibleKeys(missing_keys=[], unexpected_keys=[])
    >>> ln.weight.value.tolist()
    [2.0, 2.0, 2.0]
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"load_nnx_state expects nnx.state(model) or a nested mapping, got {type(state).__name__}")
    src: dict[str, tuple[np.ndarray, Hashable]] = {}
    _flatten_nnx(state, "", src)
    return _load(module, src, "flax", strict)
