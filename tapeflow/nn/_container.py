"""Containers: :class:`Sequential`, :class:`ModuleList` and :class:`ModuleDict`, named as PyTorch names their entries.

Each keeps its entries in one ordered dict ``name -> entry`` and lists them
through :meth:`Module.named_members`, so parameter paths, state-dict keys,
the repr and :func:`tfl.nn.summary <tapeflow.nn.summary>` all read
``0.weight`` (or the dict key) as in ``torch.nn``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, overload

from .._shell._params import Param
from .._shell._surface import torch_entry
from .._shell._tensor import Operand
from ._module import Module, members

__all__ = ["ModuleDict", "ModuleList", "Sequential"]


class _Container(Module):
    """Shared storage and discovery: entries in ``self.__dict__["_entries"]`` (name -> module or callable)."""

    def _store(self, entries: Iterable[tuple[str, object]]) -> None:
        self.__dict__["_entries"] = {}
        for k, m in entries:
            self._put(str(k), m)

    def _put(self, name: str, m: object) -> None:
        self._check(name, m)
        self._entries[name] = m

    def _check(self, name: str, m: object) -> None:
        if not isinstance(m, Module):
            raise TypeError(f"{type(self).__name__}: entry {name!r} ({type(m).__name__}) is not a tfl.nn.Module")

    @property
    def _entries(self) -> dict[str, Any]:  # Modules (ModuleList, ModuleDict) or callables (Sequential)
        return self.__dict__.setdefault("_entries", {})

    def named_members(self) -> Iterator[tuple[str, Param | Module]]:
        for k, m in self._entries.items():
            yield from members(m, k)
        for name, value in list(vars(self).items()):  # attributes a subclass adds
            if name != "_entries":
                yield from members(value, name)

    def _repr_children(self) -> list[tuple[str, object]]:
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)


@torch_entry(bind=("nn",), records="module", opinfo=())
class Sequential(_Container):
    """Apply modules (or plain callables such as ``tfl.relu``) in order, as ``torch.nn.Sequential``.

    Entries are named ``0``, ``1``, ... (or by the keys of one ``OrderedDict``
    argument) everywhere: in the repr, in :meth:`named_parameters` (``0.weight``)
    and in PyTorch state dicts (Flax's layout adds ``layers.``, as
    ``nnx.Sequential`` does). A module passed twice is one set of parameters.
    Indexing with an int gives an entry, with a slice a new ``Sequential``.

    >>> import jax.numpy as jnp, tapeflow as tfl
    >>> net = tfl.nn.Sequential(
    ...     tfl.nn.Linear(3, 4), tfl.nn.ReLU(), tfl.nn.Linear(4, 1)
    ... )
    >>> [n for n, _ in net.named_parameters()]
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> with tfl.Session() as s:
    ...     net(s.input(jnp.ones((2, 3)))).shape
    (2, 1)
    >>> from collections import OrderedDict
    >>> named = tfl.nn.Sequential(OrderedDict(fc=tfl.nn.Linear(2, 2)))
    >>> [n for n, _ in named.named_parameters()]
    ['fc.weight', 'fc.bias']
    """

    def __init__(self, *args: Callable[..., Operand] | Mapping[str, Callable[..., Operand]]) -> None:
        if len(args) == 1 and isinstance(args[0], Mapping):
            self._store(args[0].items())
        else:
            self._store((str(i), m) for i, m in enumerate(args))

    def _check(self, name: str, m: object) -> None:
        if not callable(m):
            raise TypeError(f"Sequential: entry {name} ({type(m).__name__}) is not callable")

    @property
    def layers(self) -> list[Callable[..., Operand]]:
        """The entries, in order."""
        return list(self._entries.values())

    def forward(self, input: Operand) -> Operand:
        for m in self._entries.values():
            input = m(input)
        return input

    def __iter__(self) -> Iterator[Callable[..., Operand]]:
        return iter(list(self._entries.values()))

    @overload
    def __getitem__(self, idx: int) -> Callable[..., Operand]: ...
    @overload
    def __getitem__(self, idx: slice) -> Sequential: ...
    def __getitem__(self, idx: int | slice) -> Callable[..., Operand] | Sequential:
        items = list(self._entries.items())
        if isinstance(idx, slice):
            return Sequential(OrderedDict(items[idx]))
        return items[idx][1]

    def append(self, module: Callable[..., Operand]) -> Sequential:
        """Add ``module`` at the end (named by its position); returns ``self``."""
        self._put(str(len(self._entries)), module)
        return self


@torch_entry(bind=("nn",), records="module", opinfo=())
class ModuleList(_Container):
    """A list of modules, named ``0``, ``1``, ... as ``torch.nn.ModuleList``; it has no forward.

    >>> import tapeflow as tfl
    >>> blocks = tfl.nn.ModuleList([tfl.nn.Linear(2, 2) for _ in range(2)])
    >>> _ = blocks.append(tfl.nn.LayerNorm(2))
    >>> len(blocks), [n for n, _ in blocks.named_parameters()][-2:]
    (3, ['2.weight', '2.bias'])
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        self._store((str(i), m) for i, m in enumerate(modules or ()))

    def _renumber(self, mods: list[Module]) -> None:
        self._store((str(i), m) for i, m in enumerate(mods))

    @overload
    def __getitem__(self, idx: int) -> Module: ...
    @overload
    def __getitem__(self, idx: slice) -> ModuleList: ...
    def __getitem__(self, idx: int | slice) -> Module | ModuleList:
        mods = list(self._entries.values())
        return ModuleList(mods[idx]) if isinstance(idx, slice) else mods[idx]

    def __setitem__(self, idx: int, module: Module) -> None:
        mods = list(self._entries.values())
        mods[idx] = module
        self._renumber(mods)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._entries.values()))

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end; returns ``self``."""
        self._put(str(len(self._entries)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        """Append each of ``modules``; returns ``self``."""
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before ``index``."""
        mods = list(self._entries.values())
        mods.insert(index, module)
        self._renumber(mods)


@torch_entry(bind=("nn",), records="module", opinfo=())
class ModuleDict(_Container):
    """Modules by name, in insertion order, as ``torch.nn.ModuleDict``; it has no forward.

    >>> import tapeflow as tfl
    >>> heads = tfl.nn.ModuleDict(
    ...     {"cls": tfl.nn.Linear(4, 2), "reg": tfl.nn.Linear(4, 1)}
    ... )
    >>> list(heads), [n for n, _ in heads.named_parameters()][:2]
    (['cls', 'reg'], ['cls.weight', 'cls.bias'])
    """

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None) -> None:
        self._store(modules.items() if isinstance(modules, Mapping) else (modules or ()))

    def __getitem__(self, key: str) -> Module:
        return self._entries[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self._put(str(key), module)

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def keys(self) -> list[str]:
        """The names, in insertion order."""
        return list(self._entries)

    def values(self) -> list[Module]:
        """The modules, in insertion order."""
        return list(self._entries.values())

    def items(self) -> list[tuple[str, Module]]:
        """``(name, module)`` pairs, in insertion order."""
        return list(self._entries.items())

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        """Add or replace entries from a mapping or ``(name, module)`` pairs."""
        for k, m in modules.items() if isinstance(modules, Mapping) else modules:
            self._put(str(k), m)
