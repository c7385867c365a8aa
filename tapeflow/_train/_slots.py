"""How an :class:`~tapeflow.Optimizer` lays out its slots.

The registrations of a parameter collection (a Param, a sequence, a mapping by
name, a module's trainable parameters) in slot order, and which part of an
optax state belongs to which slot (:func:`slot_index_tree`), found with optax's
own :func:`optax.tree_utils.tree_map_params`.

>>> import jax.numpy as jnp, tapeflow as tfl
>>> params = {"w": tfl.Param(jnp.zeros(2)), "b": tfl.Param(jnp.zeros(()))}
>>> recs, names = records_of(params)
>>> names, [r.shape for r in recs]
(['w', 'b'], [(2,), ()])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeAlias, cast

import optax
from optax.tree_utils import tree_map_params

from .._core._typing import OptState, PyTree
from .._shell._params import Param

__all__ = ["NamedParameters", "ParamCollection", "SlotKey", "non_trainable_of", "records_of", "slot_index_tree"]

SlotKey: TypeAlias = "str | int"
"""The key of one slot in the optax params pytree: the first name of its storage (mapping), else its position."""


class NamedParameters(Protocol):
    """A collection that names its parameters, as a ``tfl.nn.Module`` does (this layer sits below ``nn``)."""

    def named_parameters(self) -> Sequence[tuple[str, Param]]: ...


ParamCollection: TypeAlias = "Param | Sequence[Param] | Mapping[str, Param] | NamedParameters"
"""What :class:`~tapeflow.Optimizer` accepts: one Param, a sequence, a mapping ``name -> Param``, or a module."""


def records_of(params: ParamCollection) -> tuple[list[Param], list[str] | None]:
    """Flatten the user's parameter collection into registrations (+ names for a mapping)."""
    if hasattr(params, "named_parameters") and callable(params.named_parameters):
        # a module's trainable parameters: state cells (BatchNorm's running statistics) and frozen Params get no slot
        named = [(n, p) for n, p in params.named_parameters() if getattr(p, "trainable", True)]
        return [p for _, p in named], [n for n, _ in named]
    if isinstance(params, Param):
        return [params], None
    if isinstance(params, Mapping):
        first: dict[str, object] = {}
        for k in params:
            other = first.setdefault(str(k), k)
            if other is not k:
                raise TypeError(
                    f"Optimizer: the keys {other!r} and {k!r} both name the slot {str(k)!r}; "
                    "use keys that are distinct as strings"
                )
        names = list(first)
        recs = list(params.values())
    elif params is None or not isinstance(params, Iterable):
        raise TypeError(
            f"Optimizer: params is {'None' if params is None else type(params).__name__}; pass a list, a dict of name -> Param, or a module"
        )
    else:
        recs = list(cast("Iterable[Param]", params))
        names = None
    for i, p in enumerate(recs):
        if not isinstance(p, Param):
            where = names[i] if names else f"position {i}"
            raise TypeError(f"Optimizer: {where} holds {type(p).__name__}, expected a tfl.Param")
    return recs, names


def non_trainable_of(params: ParamCollection) -> list[Param]:
    """The Params of a module that its optimizer gets no slot for: frozen parameters, then buffers.

    A forward reads them (and writes buffers such as BatchNorm's running
    statistics) without training them. A Param, a sequence or a mapping names
    only what is trained: nothing, unless it is a module's ``parameters()``
    list, which names its module (``nn.ModuleParameters``).

    >>> import tapeflow as tfl
    >>> [p.name for p in non_trainable_of(tfl.nn.BatchNorm1d(2))]
    ['running_mean', 'running_var', 'num_batches_tracked']
    >>> len(non_trainable_of(tfl.nn.BatchNorm1d(2).parameters()))
    3
    """
    owner: object = getattr(params, "module", params) if isinstance(params, list) else params
    named = getattr(owner, "named_parameters", None)
    if not callable(named):
        return []
    frozen = [p for _, p in named() if not getattr(p, "trainable", True)]
    buffers = getattr(owner, "named_buffers", None)
    return frozen + ([p for _, p in buffers()] if callable(buffers) else [])


def _below_params_root(x: object) -> bool:
    # The optimizer's params pytree is one flat dict or list; everything inside it
    # (an array, optax.masked's MaskedNode, a per-parameter tuple) is one parameter's part.
    return not isinstance(x, (dict, list))


def _slot_of(_: object, k: object) -> int:
    if not isinstance(k, int):  # the params copy is not shaped like the params tree
        raise TypeError(f"a per-parameter part of the state does not line up with the params tree (got {k!r})")
    return k


def _not_a_slot(_: object) -> int:
    return -1


def slot_index_tree(tx: optax.GradientTransformation, state: OptState, params_index: PyTree) -> PyTree:
    """Which parameter each part of an optax ``state`` belongs to.

    ``params_index`` is the optimizer's params pytree (a flat dict or list) with
    each parameter replaced by its slot index. The result is a prefix of
    ``state``: every copy of the params tree inside ``state`` (Adam's ``mu`` and
    ``nu``, a momentum trace, ``MultiSteps``' accumulators, the inner states of
    ``optax.masked`` / ``multi_transform``, with ``MaskedNode`` s) holds, for each
    parameter, its slot index; every other part (step counts, hyperparameters,
    per-label dicts) is ``-1``. The copies are found with
    :func:`optax.tree_utils.tree_map_params`, which initializes ``tx`` on a
    placeholder to learn where its state holds params-shaped trees; nothing is
    guessed from container types or sizes.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.adam(1e-3)
    >>> state = tx.init({"w": jnp.zeros(2), "b": jnp.zeros(())})
    >>> slot_index_tree(tx, state, {"w": 0, "b": 1})[0]
    ScaleByAdamState(count=-1, mu={'b': 1, 'w': 0}, nu={'b': 1, 'w': 0})

    Raises whatever ``tree_map_params`` raises when ``tx.init`` cannot run on its
    placeholder (e.g. ``multi_transform`` with a callable that inspects the
    params) or ``state`` does not have the structure ``tx.init`` gives.
    """
    return tree_map_params(
        tx, _slot_of, state, params_index, transform_non_params=_not_a_slot, is_leaf=_below_params_root
    )
