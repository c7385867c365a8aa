"""The :class:`Module` base class: parameter discovery by attribute order.

A module is a plain Python object. Every :class:`~tapeflow.Param` and every
sub-:class:`Module` stored as an attribute (directly, or inside a list, tuple
or dict, to any depth) is discovered in attribute insertion order, so a
module's parameters are listed in the order its ``__init__`` defined them.
No registration call and no ``super().__init__()`` are needed.

Storage identity decides aliasing: a sub-module used in two places, or a
:func:`~tapeflow.tie` d record, appears once in :meth:`Module.parameters`
(under its first path in :meth:`Module.named_parameters`) and once per
registration in :meth:`Module.parameter_records`.

:func:`observe_calls` notes each module call's output while it is open (what
:func:`tfl.nn.summary <tapeflow.nn.summary>` reads); closed, a call pays one
flag read for it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Self, cast

import jax
import numpy as np
from numpy.typing import ArrayLike

from .._core._registry import fmt_spec
from .._core._treescope import Rendering, SubtreeRenderer
from .._core._typing import PyTree
from .._shell import _debug, _render
from .._shell._params import Param, canonical_indices, tie
from .._shell._state import note_mode_read
from .._shell._surface import torch_entry
from .._shell._tensor import Tensor

__all__ = ["Module", "ModuleParameters", "factory_dtype", "observe_calls", "observing"]

observing = 0
"""How many :func:`observe_calls` blocks are open, in any thread (``Module.__call__`` reads it per call)."""

_observing_lock = threading.Lock()
_OBSERVERS: contextvars.ContextVar[tuple[list[tuple[Module, PyTree]], ...]] = contextvars.ContextVar(
    "tapeflow_module_observers", default=()
)


class ModuleParameters(list[Param]):
    """What :meth:`Module.parameters` returns: a list of Params that also names its module.

    PyTorch's idiom ``Optimizer(tx, model.parameters())`` then gives the
    optimizer what ``Optimizer(tx, model)`` gives it: the module's buffers and
    frozen Params (:attr:`Optimizer.non_trainable_params
    <tapeflow.Optimizer.non_trainable_params>`), which a compiled step takes as
    inputs from its first trace on. Anything else about it is a plain list.

    >>> import jax, tapeflow as tfl
    >>> net = tfl.nn.Sequential(tfl.nn.Linear(2, 2), tfl.nn.BatchNorm1d(2))
    >>> ps = net.parameters()
    >>> len(ps), ps.module is net, isinstance(ps, list)
    (4, True, True)
    >>> [v.shape for v in jax.tree.leaves(ps)]  # a list to JAX
    [(2, 2), (2,), (2,), (2,)]
    """

    def __init__(self, params: Sequence[Param], module: Module) -> None:
        super().__init__(params)
        self.module = module


# JAX's pytrees know a list by its exact type: flattened as one, rebuilt as a plain list
jax.tree_util.register_pytree_with_keys(
    cast("type[list[Param]]", ModuleParameters),
    lambda ps: ([(jax.tree_util.SequenceKey(i), p) for i, p in enumerate(ps)], None),
    lambda _, children: list(children),
)


@contextmanager
def observe_calls() -> Iterator[list[tuple[Module, PyTree]]]:
    """A list that gets ``(module, output)`` for each :class:`Module` call returning inside the block.

    Only calls in this thread (or asyncio task) are noted, in the order they
    return (inner calls first); a call that raises is not noted. Blocks nest:
    each open block gets every call. Once every block is closed,
    ``Module.__call__`` is back on its fast path.

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> lin = tfl.nn.Linear(3, 2, key=jax.random.key(0))
    >>> with observe_calls() as calls, tfl.Session() as s:
    ...     _ = lin(s.input(jnp.ones((4, 3))))
    >>> [(type(m).__name__, out.shape) for m, out in calls]
    [('Linear', (4, 2))]
    """
    global observing
    calls: list[tuple[Module, PyTree]] = []
    token = _OBSERVERS.set((*_OBSERVERS.get(), calls))
    with _observing_lock:
        observing += 1
    try:
        yield calls
    finally:
        with _observing_lock:
            observing -= 1
        _OBSERVERS.reset(token)


def factory_dtype(device: object, dtype: object, layer: str) -> np.dtype:
    """The parameter dtype of a layer built with PyTorch's ``device=`` / ``dtype=`` factory arguments.

    ``dtype`` may be None (float32), a NumPy / JAX dtype or a torch dtype;
    float64 is float32 unless JAX runs with x64 (the project's dtype mapping).
    ``device`` may be None or a CPU device: parameters live where JAX puts
    them; any other device is refused (a Session picks the device).

    >>> import jax.numpy as jnp
    >>> bf16 = jnp.bfloat16
    >>> factory_dtype(None, None, "Linear"), factory_dtype("cpu", bf16, "Linear")
    (dtype('float32'), dtype(bfloat16))
    """
    if device is not None and str(getattr(device, "type", device)) != "cpu":
        raise ValueError(
            f"{layer}: device={device!r} is not supported; parameters live on JAX's default device "
            "(pick one for computation with tfl.Session(device=...)); pass device=None"
        )
    if dtype is None:
        return np.dtype(np.float32)
    if type(dtype).__module__.split(".")[0] == "torch":
        dtype = str(dtype).rsplit(".", 1)[-1]
    try:
        return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    except TypeError:
        raise TypeError(f"{layer}: dtype={dtype!r} is not a dtype") from None


def members(obj: object, prefix: str) -> Iterator[tuple[str, Param | Module]]:
    """``(path, obj)`` for each Param / Module inside ``obj`` (containers flattened)."""
    if isinstance(obj, (Param, Module)):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from members(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from members(v, f"{prefix}.{i}")


@torch_entry(bind=("nn",), records="module", opinfo=())
class Module:
    """Base class of tapeflow layers: holds Params and sub-Modules as attributes.

    Subclasses assign :class:`~tapeflow.Param` s and sub-modules in
    ``__init__`` and implement ``forward``; calling the module calls
    ``forward``. Forward code only records ops, so the same module runs
    eagerly inside ``with tfl.Session()`` and inside :func:`tfl.value_and_grad`
    / :func:`tfl.train_step` (pass :meth:`param_dict` or the module itself to
    :class:`tfl.Optimizer`).

    >>> import jax, jax.numpy as jnp, tapeflow as tfl
    >>> class Affine(tfl.nn.Module):
    ...     def __init__(self):
    ...         self.w = tfl.Param(jnp.ones((2, 3)), name="w")
    ...         self.b = tfl.Param(jnp.zeros(3), name="b")
    ...     def forward(self, x):
    ...         return x @ self.w + self.b
    >>> m = Affine()
    >>> [n for n, _ in m.named_parameters()]
    ['w', 'b']
    >>> with tfl.Session() as s:
    ...     m(s.input(jnp.ones((1, 2)))).value.tolist()
    [[2.0, 2.0, 2.0]]
    """

    # -- modes -------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """True in train mode (the default), False in eval mode; :meth:`train` / :meth:`eval` set the whole tree.

        A compiled :func:`tfl.train_step` notes which modules' modes its trace read
        and compiles one program per combination of those modes.
        """
        note_mode_read(self)
        return bool(self.__dict__.get("_training", True))

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__["_training"] = bool(mode)

    def train(self, mode: bool = True) -> Self:
        """Put this module and every sub-module in train mode (``mode=False``: eval mode); returns ``self``.

        The mode decides how mode-dependent layers behave: :class:`~tapeflow.nn.Dropout`
        draws a mask and :class:`~tapeflow.nn.BatchNorm1d` normalizes with the batch
        statistics and updates its running statistics only in train mode *and* in a
        session that records gradients; in eval mode, or in an inference session
        (``grad_enabled=False``), dropout is the identity and batch norm uses its
        running statistics. A ``training=`` argument of a layer's call overrides both.

        >>> import tapeflow as tfl
        >>> net = tfl.nn.Sequential(tfl.nn.Dropout(0.5), tfl.nn.BatchNorm1d(3))
        >>> [m.training for m in net.eval().modules()], net.train().training
        ([False, False, False], True)
        """
        mode = bool(mode)
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Self:
        """``train(False)``: eval mode for this module and every sub-module; returns ``self``."""
        return self.train(False)

    # -- forward -----------------------------------------------------------------
    def forward(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        if not _debug.tracking and not observing:
            return self.forward(*args, **kwargs)
        stack = _debug.module_stack() if _debug.tracking else None  # debug_nans: which module call recorded each op
        if stack is not None:
            stack.append(self)
        try:
            out = self.forward(*args, **kwargs)
        finally:
            if stack is not None:
                stack.pop()
        for calls in _OBSERVERS.get():  # observe_calls: this call's output, once it returned
            calls.append((self, out))
        return out

    # -- discovery ---------------------------------------------------------------
    def named_members(self) -> Iterator[tuple[str, Param | Module]]:
        """Direct Params and sub-Modules, ``(relative path, obj)``, in attribute order (lists and dicts flattened).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> class Stack(tfl.nn.Module):
        ...     def __init__(self):
        ...         self.w = tfl.Param(jnp.ones(2))
        ...         self.blocks = [tfl.nn.Module(), tfl.nn.Module()]
        >>> [name for name, _ in Stack().named_members()]
        ['w', 'blocks.0', 'blocks.1']
        """
        for name, value in list(vars(self).items()):
            yield from members(value, name)

    def is_buffer(self, name: str) -> bool:
        """True when the direct attribute ``name`` was registered with :meth:`register_buffer`."""
        return name in self.__dict__.get("_buffers", ())

    def is_persistent_buffer(self, name: str) -> bool:
        """True for a buffer that :meth:`state_dict` lists (``register_buffer(..., persistent=True)``)."""
        return bool(self.__dict__.get("_buffers", {}).get(name, False))

    def register_buffer(self, name: str, tensor: ArrayLike | Param | None, persistent: bool = True) -> None:
        """Store ``tensor`` as the buffer ``name``: module state that is not a parameter, as PyTorch's.

        A buffer is a non-trainable :class:`~tapeflow.Param` (a state cell: a
        layer updates it with :meth:`Session.assign_state <tapeflow.Session.assign_state>`,
        as BatchNorm's running statistics). :meth:`parameters` does not list it;
        :meth:`buffers` does, :meth:`state_dict` does when ``persistent``, and
        checkpoints and :meth:`param_dict` (the pytree of
        :func:`tfl.value_and_grad(has_state=True) <tapeflow.value_and_grad>`) hold it.
        ``None`` registers no value (the attribute is None).

        >>> import jax.numpy as jnp, tapeflow as tfl
        >>> m = tfl.nn.Module()
        >>> m.register_buffer("steps", jnp.zeros(()))
        >>> [n for n, _ in m.named_buffers()], m.parameters(), list(m.state_dict())
        (['steps'], [], ['steps'])
        """
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"register_buffer: the name must be a non-empty string without '.', got {name!r}")
        if name in vars(self) and not self.is_buffer(name):
            raise KeyError(f"register_buffer: attribute {name!r} already exists and is not a buffer")
        if tensor is None or isinstance(tensor, Param):
            buf = tensor
            if buf is not None and buf.trainable:
                buf = tie(buf, name=buf.name or name, trainable=False)
        else:
            value = tensor.value if isinstance(tensor, Tensor) else tensor
            buf = Param(value, name=name, trainable=False)
        self.__dict__.setdefault("_buffers", {})[name] = bool(persistent)
        setattr(self, name, buf)

    def _walk(self, prefix: str, path: tuple[int, ...], recurse: bool = True) -> Iterator[tuple[str, Param, bool]]:
        path = path + (id(self),)
        bufs = self.__dict__.get("_buffers", ())
        for name, obj in self.named_members():
            full = f"{prefix}{name}"
            if isinstance(obj, Param):
                yield full, obj, name in bufs
            elif recurse and id(obj) not in path:  # a module containing itself is not walked again
                yield from obj._walk(full + ".", path)

    def parameter_records(self) -> list[tuple[str, Param]]:
        """Every registration ``(path, Param)`` in definition order: tied and shared ones, and buffers, included.

        A sub-module stored in two places is listed under both paths; records
        that share a storage are aliases (see :func:`tfl.canonical_indices`).
        Checkpoints (:func:`tfl.save`) store every storage listed here.
        """
        return [(n, p) for n, p, _ in self._walk("", ())]

    @staticmethod
    def _once(recs: list[tuple[str, Param]], remove_duplicate: bool) -> list[tuple[str, Param]]:
        if not remove_duplicate:
            return recs
        canon = canonical_indices([p.storage for _, p in recs])
        return [recs[i] for i, c in enumerate(canon) if c == i]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> list[tuple[str, Param]]:
        """``(path, Param)`` once per storage, named by its first path, in definition order; buffers excluded.

        As ``torch.nn.Module.named_parameters``: ``prefix`` is put before each
        name, ``recurse=False`` lists only this module's direct parameters,
        ``remove_duplicate=False`` lists every registration of a tied storage.

        >>> import tapeflow as tfl
        >>> [(n, p.shape) for n, p in tfl.nn.BatchNorm1d(3).named_parameters()]
        [('weight', (3,)), ('bias', (3,))]
        """
        pre = f"{prefix}." if prefix else ""
        recs = [(pre + n, p) for n, p, buf in self._walk("", (), recurse) if not buf]
        return self._once(recs, remove_duplicate)

    def parameters(self, recurse: bool = True) -> ModuleParameters:
        """Each parameter storage once (its first record), in definition order; buffers excluded.

        The list also names this module (:class:`ModuleParameters`), so an
        optimizer built from it knows the module's buffers as one built from
        the module does.
        """
        return ModuleParameters([p for _, p in self.named_parameters(recurse=recurse)], self)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> list[tuple[str, Param]]:
        """``(path, buffer)`` for each buffer (:meth:`register_buffer`), once per storage, in definition order.

        >>> import tapeflow as tfl
        >>> [n for n, _ in tfl.nn.BatchNorm1d(3).named_buffers()]
        ['running_mean', 'running_var', 'num_batches_tracked']
        """
        pre = f"{prefix}." if prefix else ""
        recs = [(pre + n, p) for n, p, buf in self._walk("", (), recurse) if buf]
        return self._once(recs, remove_duplicate)

    def buffers(self, recurse: bool = True) -> list[Param]:
        """Each buffer once, in definition order (see :meth:`named_buffers`)."""
        return [p for _, p in self.named_buffers(recurse=recurse)]

    def param_dict(self) -> dict[str, Param]:
        """Parameters and buffers by path, each storage once: a params pytree for :func:`tfl.value_and_grad`.

        Buffers are included so that ``value_and_grad(..., has_state=True)`` can
        return the new values of the state cells a forward assigns.
        """
        recs = self._once(self.parameter_records(), True)
        return dict(recs)

    def named_children(self) -> list[tuple[str, Module]]:
        """``(name, module)`` for each direct sub-module, once, in definition order (a list entry: ``name.i``)."""
        out: list[tuple[str, Module]] = []
        seen: set[int] = set()
        for n, obj in self.named_members():
            if isinstance(obj, Module) and id(obj) not in seen:
                seen.add(id(obj))
                out.append((n, obj))
        return out

    def children(self) -> list[Module]:
        """Each direct sub-module once, in definition order."""
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix: str = "") -> list[tuple[str, Module]]:
        """``(path, module)`` for this module and each sub-module once (first path), in definition order."""
        out: list[tuple[str, Module]] = []
        seen: set[int] = set()

        def visit(m: Module, name: str) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            out.append((name, m))
            for n, obj in m.named_members():
                if isinstance(obj, Module):
                    visit(obj, f"{name}.{n}" if name else n)

        visit(self, prefix)
        return out

    def modules(self) -> list[Module]:
        """This module and each sub-module once, in definition order."""
        return [m for _, m in self.named_modules()]

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        """Make every parameter (not the buffers) trainable, or frozen with ``False``; returns ``self``.

        Sets each Param's ``trainable`` flag: a frozen Param records no
        gradient and gets no optimizer slot.

        >>> import tapeflow as tfl
        >>> lin = tfl.nn.Linear(2, 2).requires_grad_(False)
        >>> [p.trainable for p in lin.parameters()]
        [False, False]
        """
        for _, p in self.named_parameters(remove_duplicate=False):
            p.trainable = bool(requires_grad)
        return self

    # -- PyTorch state dicts ---------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and persistent buffers as ``{name: NumPy array}`` in PyTorch's names and layouts.

        The same as :func:`tfl.nn.state_dict(self) <tapeflow.nn.state_dict>`
        (see there for the table of names and layouts).

        >>> import tapeflow as tfl
        >>> {k: v.shape for k, v in tfl.nn.Linear(4, 3).state_dict().items()}
        {'weight': (3, 4), 'bias': (3,)}
        """
        from ._interop import state_dict  # the interop table knows every layer: imported on use

        return state_dict(self)

    def load_state_dict(
        self, state_dict: Mapping[str, object], strict: bool = True, *, transpose: Sequence[str] = ()
    ) -> NamedTuple:
        """Install a PyTorch ``state_dict`` (torch tensors, NumPy or JAX arrays); returns ``(missing_keys, unexpected_keys)``.

        The same as :func:`tfl.nn.load_state_dict(self, ...) <tapeflow.nn.load_state_dict>`
        (all or nothing; ``transpose=`` lists regexes of keys whose 2-D values
        are transposed first, e.g. for transformers' GPT-2 ``Conv1D`` weights).

        >>> import numpy as np, tapeflow as tfl
        >>> lin = tfl.nn.Linear(2, 1)
        >>> f32 = np.float32
        >>> sd = {"weight": np.ones((1, 2), f32), "bias": np.zeros(1, f32)}
        >>> lin.load_state_dict(sd)
        IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        """
        from ._interop import load_state_dict

        return load_state_dict(self, state_dict, strict, transpose=transpose)

    def num_parameters(self) -> int:
        """Number of scalar entries over the distinct storages."""
        total = 0
        for p in self.parameters():
            n = 1
            for d in p.shape:
                n *= d
            total += n
        return total

    # -- repr --------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The text inside ``ClassName(...)`` on the first line of the repr."""
        return ""

    def _repr_children(self) -> list[tuple[str, object]]:
        return list(self.named_members())

    def _repr_lines(self, path: str, seen: dict[int, str]) -> list[str]:
        lines = [f"{type(self).__name__}({self.extra_repr()})"]
        for name, obj in self._repr_children():
            full = f"{path}.{name}" if path else name
            if isinstance(obj, Param):
                flags = "" if obj.trainable else ", frozen"
                lines.append(f"  ({name}): {fmt_spec((obj.shape, obj.dtype))}{flags}  storage=#{obj.storage.uid}")
            elif isinstance(obj, Module):
                if id(obj) in seen:
                    first = seen[id(obj)] or "<root>"
                    lines.append(f"  ({name}): {type(obj).__name__}(...)  # same module as {first}")
                    continue
                seen[id(obj)] = full
                sub = obj._repr_lines(full, seen)
                lines.append(f"  ({name}): {sub[0]}")
                lines.extend("  " + ln for ln in sub[1:])
            else:
                lines.append(f"  ({name}): {getattr(obj, '__name__', None) or repr(obj)}")
        return lines

    def __repr__(self) -> str:
        return "\n".join(self._repr_lines("", {id(self): ""}))

    def __treescope_repr__(self, path: str | None, subtree_renderer: SubtreeRenderer) -> Rendering:
        return _render.render_module(self, path, subtree_renderer)  # treescope picture (tapeflow[viz])
