"""`Ok` / `Err`: the result type of fallible tape constructors.

`record` never raises for bad input; it returns the tape it was given together
with an `Err` that says what went wrong. Both types are tiny immutable records
that work with structural pattern matching::

    >>> import tapeflow as tfl
    >>> match tfl.Ok(3):
    ...     case tfl.Ok(value=v):
    ...         print("node", v)
    ...     case tfl.Err(error=e):
    ...         print("failed:", e)
    node 3
"""

from __future__ import annotations

from typing import Final, Generic, NoReturn, TypeVar

T = TypeVar("T")

__all__ = ["Err", "Ok", "Result", "TapeError"]


class TapeError(ValueError):
    """Raised when an `Err` is unwrapped, or a session op fails its checks."""


class Ok(Generic[T]):
    """A successful result holding `value` (for `record`: the new node id).

    >>> r = Ok(5)
    >>> r.is_ok, r.value, r.error
    (True, 5, None)
    """

    __slots__ = ("value",)
    __match_args__ = ("value",)
    value: T
    is_ok: Final = True
    error: Final = None

    def __init__(self, value: T) -> None:
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("Ok is immutable")

    def unwrap(self) -> T:
        """Return the value."""
        return self.value

    def __eq__(self, other: object) -> bool:
        return type(other) is Ok and other.value == self.value

    def __hash__(self) -> int:
        return hash((Ok, self.value))

    def __repr__(self) -> str:
        return f"Ok({self.value!r})"


class Err:
    """A failed result holding a human-readable `error` message.

    >>> r = Err("mul: shapes (2,) and (3,) do not broadcast")
    >>> r.is_ok, r.value
    (False, None)
    """

    __slots__ = ("error",)
    __match_args__ = ("error",)
    error: str
    is_ok: Final = False
    value: Final = None

    def __init__(self, error: str) -> None:
        object.__setattr__(self, "error", str(error))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("Err is immutable")

    def unwrap(self) -> NoReturn:
        """Raise `TapeError` with the message."""
        raise TapeError(self.error)

    def __eq__(self, other: object) -> bool:
        return type(other) is Err and other.error == self.error

    def __hash__(self) -> int:
        return hash((Err, self.error))

    def __repr__(self) -> str:
        return f"Err({self.error!r})"


Result = Ok[T] | Err
