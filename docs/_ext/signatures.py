"""Griffe extension for the API reference: every class shows how it is constructed.

mkdocstrings-python (with ``merge_init_into_class``) shows a class's signature
from its ``__init__``. Griffe reads the source statically, so a class whose
``__init__`` it cannot see gets no signature line: a ``NamedTuple`` (its
constructor is made by ``typing``) or a class that relies on ``object``'s.
This extension gives each such class the ``__init__`` Python itself reports
(:func:`inspect.signature` of the imported class), so the page shows
``StepStats(grad_norm, update_norm)`` as PyTorch's reference shows
``Linear(in_features, out_features, bias=True, ...)``.

Exception and warning classes are left as they are: Python reports no
signature for them (their constructor is ``BaseException``'s ``*args``), and
tapeflow raises them rather than asking users to build them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any, ForwardRef

import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _classes(obj: griffe.Object) -> Iterator[griffe.Class]:
    if obj.is_class:
        yield obj  # type: ignore[misc]
    for member in obj.members.values():
        if not member.is_alias:
            yield from _classes(member)  # type: ignore[arg-type]


def runtime(path: str) -> Any:
    """The object at a dotted ``path`` (``tapeflow.nn.Linear``), imported; None when it cannot be."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _annotation(a: object) -> str | None:
    if a is inspect.Parameter.empty:
        return None
    if isinstance(a, ForwardRef):
        return a.__forward_arg__
    return a if isinstance(a, str) else inspect.formatannotation(a)


def synthesized_init(cls: type) -> griffe.Function | None:
    """An ``__init__`` with the parameters ``inspect.signature(cls)`` reports; None where Python reports none."""
    if issubclass(cls, BaseException):
        return None
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    params = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for p in sig.parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        params.append(
            griffe.Parameter(p.name, annotation=_annotation(p.annotation), kind=_KINDS[p.kind], default=default)
        )
    return griffe.Function("__init__", parameters=griffe.Parameters(*params), returns="None")


class ClassSignatures(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            try:
                if "__init__" in cls.all_members:
                    continue
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            obj = runtime(cls.path)
            init = synthesized_init(obj) if inspect.isclass(obj) else None
            if init is not None:
                cls.set_member("__init__", init)
