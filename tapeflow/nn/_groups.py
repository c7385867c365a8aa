"""Parameter groups of a model for training recipes: one label per storage, and the weight-decay mask.

:func:`param_labels` gives every parameter the optimizer updates a label
chosen by a rule, keyed exactly as :class:`~tapeflow.Optimizer` keys its
optax params pytree (each trainable storage under its first name), so the
result goes straight into ``optax.multi_transform(transforms, labels)`` or an
optax ``mask=``. :func:`decay_mask` is the usual weight-decay split built on
it: matrices decay; biases, norm scales and embedding tables do not.

An optimizer keeps one slot per storage, so a tied weight (``tfl.tie``,
``Embedding.tied_output()``) takes one label however many names it has: the
rule sees each name, and two names of one storage with different labels are
an error that names both.

>>> import jax, optax, tapeflow as tfl
>>> emb = tfl.nn.Embedding(16, 8, key=jax.random.key(0))
>>> model = tfl.nn.Sequential(emb, tfl.nn.LayerNorm(8), emb.tied_output())
>>> decay_mask(model)  # the tied table is the head's weight too: it decays
{'0.weight': True, '1.weight': False, '1.bias': False}
>>> tx = optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask(model))
>>> opt = tfl.Optimizer(tx, model)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeAlias

from .._shell._params import Param
from .._train._slots import records_of
from ._layers import Embedding
from ._module import Module
from ._norm import BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RMSNorm

__all__ = ["NO_DECAY_MODULES", "LabelRule", "decay_mask", "param_labels"]

LabelRule: TypeAlias = Callable[[str, Param], Hashable]
"""``rule(name, param) -> label``: called once per registration (name) of each storage the optimizer updates."""

NO_DECAY_MODULES: tuple[type[Module], ...] = (LayerNorm, BatchNorm1d, BatchNorm2d, GroupNorm, RMSNorm)
"""The modules whose Params :func:`decay_mask` never decays (norm scales and shifts); Embedding unless asked."""

Patterns: TypeAlias = "str | Iterable[str]"
"""One ``fnmatch`` pattern over parameter names (``"wpe.*"``), or several."""


def _registrations(model: Module) -> Iterator[tuple[str, Module]]:
    """``(path, owning module)`` of every Param registration, over every path (shared sub-modules included)."""

    def walk(m: Module, prefix: str, open_: tuple[int, ...]) -> Iterator[tuple[str, Module]]:
        open_ = open_ + (id(m),)
        for name, obj in m.named_members():
            if isinstance(obj, Param):
                yield prefix + name, m
            elif isinstance(obj, Module) and id(obj) not in open_:  # as Module: a cycle is not walked again
                yield from walk(obj, f"{prefix}{name}.", open_)

    yield from walk(model, "", ())


def _slots(model: Module, where: str) -> tuple[list[str], dict[str, list[tuple[str, Param]]]]:
    """The optimizer's slot keys of ``model`` and, for each, every registration ``(path, Param)`` of its storage."""
    if not (isinstance(model, Module) or callable(getattr(model, "parameter_records", None))):
        raise TypeError(
            f"{where}: expected a tfl.nn.Module, got {type(model).__name__}; for a dict of Params, build the "
            "labels dict by hand (one label per key)"
        )
    recs, names = records_of(model)  # exactly what tfl.Optimizer(tx, model) keys its params pytree by
    keys = names or []
    key_of = {id(p.storage): k for k, p in zip(keys, recs)}
    regs: dict[str, list[tuple[str, Param]]] = {k: [] for k in keys}
    for path, p in model.parameter_records():
        k = key_of.get(id(p.storage))
        if k is not None:
            regs[k].append((path, p))
    return keys, regs


def param_labels(model: Module, rule: LabelRule) -> dict[str, Hashable]:
    """One label per parameter the optimizer updates: ``rule(name, param)``, keyed as :class:`~tapeflow.Optimizer` keys it.

    The keys are those of ``tfl.Optimizer(tx, model)``'s optax params pytree
    (:attr:`Optimizer.slot_keys <tapeflow.Optimizer.slot_keys>`): each
    trainable storage once, under its first name; frozen Params and state
    cells (BatchNorm's running statistics) have no slot and no label. So the
    result works as ``optax.multi_transform(transforms, param_labels(model,
    rule))`` or as an optax ``mask=``.

    ``rule`` is called for every registration (every name, in
    ``model.parameter_records()`` order) of each such storage. A storage is
    one slot, so all its names must get one label: two names of one storage
    (a :func:`~tapeflow.tie` d weight) with different labels raise a
    ``ValueError`` that names both.

    >>> import jax, optax, tapeflow as tfl
    >>> model = tfl.nn.MLP([4, 8, 2], key=jax.random.key(0))
    >>> def kind(name, p):
    ...     return "matrix" if p.ndim >= 2 else "vector"
    >>> labels = param_labels(model, kind)
    >>> labels  # doctest: +NORMALIZE_WHITESPACE
    {'layers.0.weight': 'matrix', 'layers.0.bias': 'vector',
     'layers.1.weight': 'matrix', 'layers.1.bias': 'vector'}
    >>> rules = {"matrix": optax.adam(1e-3), "vector": optax.sgd(1e-2)}
    >>> tx = optax.multi_transform(rules, labels)
    >>> list(tfl.Optimizer(tx, model).state.inner_states)
    ['matrix', 'vector']
    """
    if not callable(rule):
        raise TypeError(f"param_labels: rule must be a function (name, param) -> label, got {type(rule).__name__}")
    keys, regs = _slots(model, "param_labels")
    out: dict[str, Hashable] = {}
    for key in keys:
        first: tuple[str, Hashable] | None = None
        for path, p in regs[key]:
            label = rule(path, p)
            if first is None:
                first = (path, label)
            elif label != first[1]:
                raise ValueError(
                    f"param_labels: {first[0]!r} and {path!r} are one storage (tied, storage #{p.storage.uid}), but "
                    f"rule labelled them {first[1]!r} and {label!r}; an optimizer keeps one slot per storage, so a "
                    "tied weight takes one label. Make rule give every name of a storage the same label (it can "
                    "decide by param.storage or param.ndim rather than by name), or untie the Params"
                )
        if first is not None:
            out[key] = first[1]
    return out


def _patterns(value: Patterns, what: str) -> tuple[str, ...]:
    pats = (value,) if isinstance(value, str) else tuple(value)
    bad = next((p for p in pats if not isinstance(p, str)), None)
    if bad is not None:
        raise TypeError(
            f"decay_mask: {what} holds {type(bad).__name__} {bad!r}; it takes parameter names or fnmatch "
            "patterns over them (strings such as 'wpe.weight' or '*.bias')"
        )
    return pats


def _some(names: list[str], n: int = 12) -> str:
    """``names`` for a message: all of them, or the first ``n`` and how many more."""
    shown = ", ".join(repr(x) for x in names[:n])
    return shown if len(names) <= n else f"{shown}, ... ({len(names) - n} more)"


def decay_mask(
    model: Module, *, embeddings: bool = False, include: Patterns = (), exclude: Patterns = ()
) -> dict[str, bool]:
    """Which parameters weight decay applies to: ``True`` for weights of 2 or more dimensions, keyed as :func:`param_labels`.

    Not decayed: parameters with fewer than 2 dimensions (biases, norm
    scales), the Params of :data:`NO_DECAY_MODULES` (``LayerNorm``,
    ``BatchNorm1d``, ``BatchNorm2d``) and, unless ``embeddings=True``,
    :class:`~tapeflow.nn.Embedding` tables. Use it as
    ``optax.adamw(lr, weight_decay=0.1, mask=decay_mask(model))`` with
    ``tfl.Optimizer(tx, model)``.

    **Tied weights** have one slot, so one answer: a storage of 2 or more
    dimensions decays unless *every* one of its registrations belongs to a
    no-decay module. A table tied to an output head (``Embedding.tied_output()``,
    a :class:`~tapeflow.nn.TiedLinear`) is also a projection's weight, so it
    decays, as nanoGPT decays its tied ``wte`` / ``lm_head`` weight; an
    untied table (a position embedding) does not. ``embeddings=True`` decays
    every table too: then every weight of 2 or more dimensions decays, which
    is exactly nanoGPT's ``configure_optimizers`` split.

    ``include`` / ``exclude``: parameter names or ``fnmatch`` patterns over
    them (``"wpe.weight"``, ``"*.bias"``) that force a parameter into
    (``include``) or out of (``exclude``) weight decay, whatever the rules
    above say; a pattern matches a storage when it matches any of its names. A
    pattern that matches no parameter the optimizer updates, and a storage
    matched by both, raise a ``ValueError``.

    >>> import jax, tapeflow as tfl
    >>> class TinyGPT(tfl.nn.Module):
    ...     def __init__(self, key):
    ...         k1, k2, k3 = jax.random.split(key, 3)
    ...         self.wte = tfl.nn.Embedding(16, 8, key=k1)
    ...         self.wpe = tfl.nn.Embedding(4, 8, key=k2)
    ...         self.fc = tfl.nn.Linear(8, 8, key=k3)
    ...         self.ln_f = tfl.nn.LayerNorm(8)
    ...         self.lm_head = self.wte.tied_output()
    >>> model = TinyGPT(jax.random.key(0))
    >>> decay_mask(model)  # doctest: +NORMALIZE_WHITESPACE
    {'wte.weight': True, 'wpe.weight': False, 'fc.weight': True, 'fc.bias': False,
     'ln_f.weight': False, 'ln_f.bias': False}
    >>> mask = decay_mask(model, embeddings=True)  # nanoGPT's split
    >>> [k for k, v in mask.items() if v]
    ['wte.weight', 'wpe.weight', 'fc.weight']
    >>> mask = decay_mask(model, exclude="wte.*", include="fc.bias")
    >>> [k for k, v in mask.items() if v]
    ['fc.weight', 'fc.bias']
    """
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    no_decay = NO_DECAY_MODULES if embeddings else (*NO_DECAY_MODULES, Embedding)
    keys, regs = _slots(model, "decay_mask")
    owner = dict(_registrations(model))
    every = [path for key in keys for path, _ in regs[key]]
    for what, pats in (("include", inc), ("exclude", exc)):
        unmatched = [pat for pat in pats if not any(fnmatch.fnmatchcase(path, pat) for path in every)]
        if unmatched:
            raise ValueError(
                f"decay_mask: {what} pattern {unmatched[0]!r} matches no parameter the optimizer updates (frozen "
                f"Params and state cells have no slot); the names are {_some(every)}"
            )
    decide: dict[int, bool] = {}
    for key in keys:
        paths = [path for path, _ in regs[key]]
        hit = [[pat for pat in pats if any(fnmatch.fnmatchcase(path, pat) for path in paths)] for pats in (inc, exc)]
        if hit[0] and hit[1]:
            raise ValueError(
                f"decay_mask: {key!r} (names {paths}) matches include pattern {hit[0][0]!r} and exclude pattern "
                f"{hit[1][0]!r}; a parameter either decays or not: narrow one of the patterns"
            )
        p = regs[key][0][1]
        if hit[0] or hit[1]:
            decide[id(p.storage)] = bool(hit[0])
        else:
            decide[id(p.storage)] = p.ndim >= 2 and not all(isinstance(owner.get(path), no_decay) for path in paths)
    return {k: bool(v) for k, v in param_labels(model, lambda _, p: decide[id(p.storage)]).items()}
