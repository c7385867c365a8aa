"""Input validation at the shell: a rejected call raises a clear error and changes nothing."""

from __future__ import annotations

import warnings
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tapeflow as tfl
from tapeflow._serialization._meta import SessionEntry, _schema
from tapeflow._shell._random import RNG_COUNTER_RANGE, RNG_SEED_RANGE

# -- 1. set_rng_state ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 2**63}, r"seed .*\[-2\*\*63, 2\*\*63\)"),
        ({"seed": -(2**63) - 1}, r"seed .*\[-2\*\*63, 2\*\*63\)"),
        ({"seed": True}, r"seed .*bool"),
        ({"seed": 1.5}, r"seed .*float"),
        ({"counter": 2**80}, r"counter .*\[0, 2\*\*63\)"),
        ({"counter": -1}, r"counter .*\[0, 2\*\*63\)"),
        ({"counter": False}, r"counter .*bool"),
        ({"seed": 3, "counter": 2**63}, r"counter"),  # a bad counter leaves the good seed unset too
    ],
)
def test_set_rng_state_rejects_out_of_range_and_changes_nothing(kwargs: dict[str, object], match: str) -> None:
    s = tfl.Session(seed=1)
    s.normal((2,))
    with pytest.raises(ValueError, match=match):
        s.set_rng_state(**kwargs)  # type: ignore[arg-type]
    assert (s.seed, s.rng_counter) == (1, 1)
    s.normal((2,))  # later draws still work
    assert s.rng_counter == 2


def test_set_rng_state_accepts_the_range_ends_and_draws_there() -> None:
    s = tfl.Session()
    s.set_rng_state(seed=-(2**63), counter=2**63 - 2)
    assert (s.seed, s.rng_counter) == (-(2**63), 2**63 - 2)
    assert s.normal((2,)).shape == (2,)  # the last draw: the counter reaches 2**63 - 1, still in range
    assert s.rng_counter == 2**63 - 1
    with pytest.raises(tfl.TapeError, match="last value"):
        s.normal((2,))
    s.set_rng_state(seed=2**63 - 1, counter=2**40)
    assert s.normal((2,)).shape == (2,)
    assert s.rng_counter == 2**40 + 1
    s.set_rng_state(seed=np.int64(5), counter=np.int64(0))
    assert (s.seed, s.rng_counter) == (5, 0)


def test_checkpoint_meta_uses_the_session_rng_bounds() -> None:
    assert RNG_SEED_RANGE == (-(2**63), 2**63)
    assert RNG_COUNTER_RANGE == (0, 2**63)
    lows = {name: lo for name, _, lo in _schema(SessionEntry)}
    assert lows == {"seed": RNG_SEED_RANGE[0], "rng_counter": RNG_COUNTER_RANGE[0]}


# -- 2. rejected random draws ---------------------------------------------------------


@pytest.mark.parametrize("method", ["normal", "rand_uniform"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "not-a-dtype"])
def test_rejected_draw_changes_nothing(method: str, dtype: object) -> None:
    s = tfl.Session(seed=0)
    s.normal((1,))
    before = (s.rng_counter, len(s.tape))
    with pytest.raises(tfl.TapeError, match=method):
        getattr(s, method)((2,), dtype=dtype)
    assert (s.rng_counter, len(s.tape)) == before


@pytest.mark.parametrize("shape", [(-1,), (2.0,), (True,), 2.5, "ab"])
def test_rejected_draw_shape_changes_nothing(shape: object) -> None:
    s = tfl.Session(seed=0)
    with pytest.raises(tfl.TapeError, match="shape"):
        s.normal(shape)  # type: ignore[arg-type]
    assert (s.rng_counter, len(s.tape)) == (0, 0)


def test_draw_names_the_dtype() -> None:
    s = tfl.Session()
    with pytest.raises(tfl.TapeError, match=r"normal.*int32"):
        s.normal((2,), dtype=jnp.int32)


# -- 3. exact-rational carrier -----------------------------------------------------------


@pytest.mark.parametrize(
    ("elements", "bad"),
    [(["ab", "c"], "str"), ([Fraction(1, 2), 0.5], "float"), ([1, None], "NoneType"), ([True, 1], "bool")],
)
def test_object_arrays_hold_only_fractions_and_ints(elements: list[object], bad: str) -> None:
    s = tfl.Session()
    x = np.array(elements, dtype=object)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfl.RationalFallbackWarning)
        with pytest.raises(tfl.TapeError, match=rf"{bad}.*Fraction"):
            s.input(x)
        assert len(s.tape) == 0
        h = s.input(np.array([Fraction(1, 3), 2], dtype=object))
        with pytest.raises(tfl.TapeError, match=rf"{bad}.*Fraction"):
            h + x
        assert len(s.tape) == 1
        assert (h + h).value.tolist() == [Fraction(2, 3), 4]


# -- 4. complex values ----------------------------------------------------------------------

COMPLEX = "complex values are not supported yet"


def test_complex_input_is_refused() -> None:
    s = tfl.Session()
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        s.input(jnp.ones(2, jnp.complex64))
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        s.input(np.array([1 + 2j]))
    assert len(s.tape) == 0


def test_complex_param_is_refused() -> None:
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        tfl.Param(jnp.ones(2, jnp.complex64))
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        tfl.Storage(np.array([1j]))


@pytest.mark.parametrize("const", [1j, np.complex64(1j), np.array([1j, 2j]), [1j, 2j]])
def test_complex_constant_operand_is_refused(const: object) -> None:
    s = tfl.Session()
    x = s.input(jnp.ones(2))
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        s.apply("mul", x, const)
    assert len(s.tape) == 1


def test_complex_backward_seed_is_refused() -> None:
    s = tfl.Session()
    x = s.input(jnp.ones(2), requires_grad=True)
    y = x * 2.0
    with pytest.raises(tfl.TapeError, match=COMPLEX):
        s.backward(y, seed=jnp.ones(2, jnp.complex64))
    assert s.backward(y, seed=jnp.ones(2))[x].tolist() == [2.0, 2.0]


# -- 5. raw errors become clear ones --------------------------------------------------------


def test_int_constant_out_of_dtype_range() -> None:
    s = tfl.Session()
    x = s.input(jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(tfl.TapeError, match=r"add.*1099511627776.*int32.*(cast|jax_enable_x64)"):
        x + 2**40
    with pytest.raises(tfl.TapeError, match=r"int32"):
        s.apply("add", x, -(2**31) - 1)
    assert len(s.tape) == 1
    assert (x + (2**31 - 1)).dtype == jnp.int32


def test_optimizer_params_none() -> None:
    with pytest.raises(TypeError, match="Optimizer: params is None; pass a list, a dict of name -> Param, or a module"):
        tfl.Optimizer(optax.sgd(0.1), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Optimizer: params is int"):
        tfl.Optimizer(optax.sgd(0.1), 3)  # type: ignore[arg-type]


def test_optimizer_keys_that_stringify_alike() -> None:
    a, b = tfl.Param(jnp.ones(2)), tfl.Param(jnp.zeros(2))
    with pytest.raises(TypeError, match=r"1.*'1'"):
        tfl.Optimizer(optax.sgd(0.1), {1: a, "1": b})  # type: ignore[dict-item]
    opt = tfl.Optimizer(optax.sgd(0.1), {1: a, 2: b})  # type: ignore[dict-item]
    assert opt.slot_keys == ["1", "2"]


def test_trainable_must_be_bool() -> None:
    with pytest.raises(TypeError, match="trainable must be a bool"):
        tfl.Param(jnp.ones(2), trainable="no")  # type: ignore[arg-type]
    p = tfl.Param(jnp.ones(2), trainable=np.bool_(False))
    assert p.trainable is False
    with pytest.raises(TypeError, match="trainable must be a bool"):
        tfl.tie(p, trainable=1)  # type: ignore[arg-type]
    assert tfl.tie(p, trainable=True).trainable is True


def test_int64_input_out_of_int32_range_without_x64() -> None:
    big = np.array([2**40 + 5])
    with jax.enable_x64(False):
        s = tfl.Session()
        with pytest.raises(tfl.TapeError, match=r'int32.*jax\.config\.update\("jax_enable_x64", True\)'):
            s.input(big)
        with pytest.raises(tfl.TapeError, match="jax_enable_x64"):
            s.input(np.array([2**63 - 1], dtype=np.uint64))
        assert len(s.tape) == 0
        assert s.input(np.array([2**31 - 1, -(2**31)])).value.tolist() == [2**31 - 1, -(2**31)]
    s = tfl.Session()  # x64 on (conftest): the value fits
    assert s.input(big).value.tolist() == [2**40 + 5]
