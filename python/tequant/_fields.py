"""Field checks shared by the recipe dataclasses (python/tequant/recipe.py): each raises
TypeError / ValueError with "<Owner>.<field> must be <expected>, got <value>".
Tested through tests/test_recipe.py.
"""
import numbers
from typing import Any


def _where(owner: Any, name: str) -> str:
    return f"{type(owner).__name__}.{name}"


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def _check_bool(owner: Any, name: str) -> None:
    value = getattr(owner, name)
    # Strings like "yes" or ints are truthy too; only a real bool says what the user meant.
    if not isinstance(value, bool):
        raise TypeError(f"{_where(owner, name)} must be a bool, {_got(value)}")


def _check_int(owner: Any, name: str, minimum: int) -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_where(owner, name)} must be an int >= {minimum}, {_got(value)}")
    if value < minimum:
        raise ValueError(f"{_where(owner, name)} must be an int >= {minimum}, got {value!r}")
    # numpy integers are accepted; store a plain int so equal recipes hash and repr alike.
    object.__setattr__(owner, name, int(value))


def _check_instance(owner: Any, name: str, cls: type) -> Any:
    value = getattr(owner, name)
    if not isinstance(value, cls):
        raise TypeError(f"{_where(owner, name)} must be a {cls.__name__}, {_got(value)}")
    return value
