"""A tool's JSON schema (``waypoint.agents.tool_schema``) against its oracle, transformers' ``get_json_schema``.

This module uses postponed annotations (``from __future__ import annotations``, as the project does), so most tools
here have string annotations; ``EAGER`` holds tools compiled without it. Each good tool's schema equals the
oracle's, key order included (chat templates write it with ``tojson``); each bad tool is refused by both, with one
line naming it; the few places the module deliberately differs are pinned with what the oracle does there.
"""

from __future__ import annotations

import collections.abc  # noqa: F401 (named by a string hint)
import enum
import functools
import inspect
import json
import typing  # noqa: F401 (named by a string hint)
from typing import Any, Literal, Optional, Union

import PIL.Image
import pytest
import torch

from waypoint.agents.tool_schema import ToolSchemaError, tool_name, tool_schema


def oracle(func) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(func)


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point:
    """A custom class: no JSON schema."""


class Empty(enum.Enum):
    pass


# --- Tools the oracle accepts -------------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.

    Returns:
        Their sum.
    """
    return a + b


def scale(x: float, factor: float = 2.0) -> float:
    """Scale a number.

    Args:
        x: The number.
        factor: What to multiply it by.
    """
    return x * factor


def greet(name: str, shout: bool = False) -> str:
    """Greet someone by name.

    Args:
        name: Who to greet.
        shout: Whether to greet in capitals.
    """
    return name.upper() if shout else name


def total(values: list[int], weights: list = None) -> int:  # a None default, no Optional: still "array"
    """Sum a list of integers.

    Args:
        values: The integers to sum.
        weights: Optional weights, one per value.
    """
    return sum(values)


def histogram(counts: dict[str, int], normalize: Optional[bool] = None, extra: dict = None) -> dict[str, float]:
    """Turn counts into a histogram.

    Args:
        counts: How many times each key was seen.
        normalize: Whether the histogram sums to one.
        extra: Anything else.

    Returns:
        The frequency of each key.
    """
    return {}


def find(query: str, limit: int | None = None, tags: list[str] | None = None) -> list[str] | None:
    """Find documents.

    Args:
        query: The text to look for.
        limit: At most this many results.
        tags: Only documents with these tags.

    Returns:
        The documents' ids, or None when the index is empty.
    """
    return None


def convert(value: Union[int, float, str], to: Literal["int", "float", "str"], fallback: int | str | None = None):
    """Convert a value.

    Args:
        value: The value to convert.
        to: The type to convert it to.
        fallback: What to return when it does not convert.
    """


def move(point: tuple[int, int], unit: Literal[1, "m", True, None], path: tuple = ()) -> tuple[float, str]:
    """Move to a point.

    Args:
        point: The (x, y) to move to.
        unit: The unit of both coordinates.
        path: The points to pass on the way.

    Returns:
        The distance, and its unit.
    """
    return 0.0, "m"


def weather(city: str, unit: str = "celsius", days: int = 1) -> dict:  # the choices' strings are stripped
    """Get the weather forecast for a city.

    Args:
        city: The city's name.
        unit: The unit of the temperatures (choices: ["celsius", " fahrenheit "])
        days: How many days ahead (CHOICES: [1, 2, 3])

    Returns:
        The forecast.
    """
    return {}


def search(query: str, filters: dict[str, list[str]], mode: Literal["any", "all"] = "any") -> list[dict[str, Any]]:
    """Search the knowledge base
    for documents, with filters.

    Args:
        query (str): The query, in plain words;
            it may span
            several lines.
        filters (dict): Field values to keep, for example:
            colour: [red, blue]
            size: [small]
        mode: Whether a document must match any
            or all of the filters (choices: ["any",
            "all"])

    Returns:
        The matching documents, best first,
        each a dict of its fields.

    Raises:
        ValueError: When the query is empty.
    """
    return []


async def fetch_page(url: str, timeout: float = 10.0) -> str:
    """Fetch a web page.

    Args:
        url: The page's address.
        timeout: Seconds to wait for it.

    Returns:
        Its text.
    """
    return ""


def paint(color: Color, level: Level, shade: Optional[Color] = None) -> None:
    """Paint the wall.

    Args:
        color: The colour.
        level: How much paint.
        shade: An optional second colour.
    """


def log(message: str, payload: Any = None, items: Optional[list[int]] = None, either: list[int] | dict[str, int] = None
        ) -> Any:
    """Log a message.

    Args:
        message: What to log.
        payload: Anything attached.
        items: Some numbers.
        either: A list or a dict.

    Returns:
        Whatever the logger returns.
    """


def caption(image: PIL.Image.Image, audio: torch.Tensor | None = None) -> Point:
    """Caption a picture (transformers maps PIL images to "image", torch tensors to "audio").

    Args:
        image: The picture.
        audio: A sound to go with it.

    Returns:
        A custom class, which transformers leaves out of the schema.
    """


def untyped_return(x: int):
    """No return hint, though the docstring has a Returns: section.

    Args:
        x: A number.

    Returns:
        Something.
    """


def no_args() -> str:
    """Say what time it is."""
    return "noon"


class Calculator:
    """Tools as an environment's methods, as TRL collects them: bound to an instance, ``self`` left out."""

    def divide(self, a: float, b: float = 1.0) -> float:
        """Divide two numbers.

        Args:
            a: The dividend.
            b: The divisor.

        Returns:
            The quotient.
        """
        return a / b

    async def remember(self, key: str, value: int | float) -> None:
        """Store a value.

        Args:
            key: Its name.
            value: The value.
        """

    @classmethod
    def named(cls, name: str) -> str:
        """Look a calculator up by name.

        Args:
            name: Its name.
        """
        return name


# Compiled without ``from __future__ import annotations`` (dont_inherit): the annotations are objects, not strings.
EAGER_SOURCE = '''
import enum
from typing import Literal, Optional

class Size(enum.Enum):
    SMALL = "s"
    LARGE = "l"

def order(size: Size, extras: Optional[list[str]] = None, pay: Literal["card", "cash"] = "card") -> dict[str, int]:
    """Order a coffee.

    Args:
        size: The cup's size.
        extras: Milk, sugar, ...
        pay: How to pay.

    Returns:
        The bill.
    """

def rate(stars: int | float, note: str = None) -> None:
    """Rate the coffee.

    Args:
        stars: One to five (choices: [1, 2, 3, 4, 5])
        note: Anything to add.
    """
'''
EAGER = {"__name__": "eager_tools"}
exec(compile(EAGER_SOURCE, "<eager_tools>", "exec", dont_inherit=True), EAGER)

GOOD = [add, scale, greet, total, histogram, find, convert, move, weather, search, fetch_page, paint, log, caption,
        untyped_return, no_args, Calculator().divide, Calculator().remember, Calculator.named, EAGER["order"],
        EAGER["rate"],
        Calculator.divide]  # the plain function: transformers skips an untyped first `self` (TRL passes bound methods)


def _id(func) -> str:
    """A stable test id: bound methods as ``Class().method``, a partial by the function it wraps."""
    if isinstance(func, functools.partial):
        return f"partial({func.func.__name__})"
    bound_to = getattr(func, "__self__", None)
    if bound_to is not None and not isinstance(bound_to, type):
        return f"{type(bound_to).__name__}().{func.__name__}"
    return func.__qualname__


def _hint_id(hint) -> str:
    return hint if isinstance(hint, str) else inspect.formatannotation(hint).replace(f"{__name__}.", "")


def test_eager_tools_have_object_annotations():
    assert EAGER["order"].__annotations__["size"] is EAGER["Size"]
    assert add.__annotations__["a"] == "int"  # and this module's are strings


@pytest.mark.parametrize("func", GOOD, ids=_id)
def test_schema_is_the_oracles(func):
    ours, theirs = tool_schema(func), oracle(func)
    assert ours == theirs
    assert json.dumps(ours) == json.dumps(theirs)  # key order too: templates write the schema with tojson
    assert tool_name(func) == func.__name__ == ours["function"]["name"]
    assert "self" not in ours["function"]["parameters"]["properties"]


def test_a_schema_in_full():
    """One schema written out by hand, so the suite does not rest on the oracle alone: choices, continuation lines
    (joined in arguments, kept in Returns:), a "(type)" after a name, a default making an argument optional."""
    assert tool_schema(search)["function"] == {
        "name": "search",
        "description": "Search the knowledge base\nfor documents, with filters.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "The query, in plain words; it may span several lines."},
                "filters": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    "description": "Field values to keep, for example: colour: [red, blue] size: [small]",
                },
                "mode": {
                    "type": "string",
                    "enum": ["any", "all"],
                    "description": "Whether a document must match any or all of the filters",
                },
            },
            "required": ["query", "filters"],
        },
        "return": {
            "type": "array",
            "items": {"type": "object", "additionalProperties": {}},
            "description": "The matching documents, best first,\n    each a dict of its fields.",  # kept as written
        },
    }


class Flags(enum.Flag):
    READ = 1
    WRITE = 2


HINTS = [int, float, str, bool, None, Any, list, tuple, dict, list[float], list[list[str]], dict[str, Any],
         dict[int, str], tuple[str, float, bool], tuple[()], Optional[str], Union[str, None, int], Union[int, float],
         Union[list, tuple], Union[str, Literal["x"]], Union[list[int], Literal["all"], None], Literal["a", 2, 2.5],
         Literal[False], Optional[Literal["a", "b"]], Flags, Level, Color | None, "Optional[dict[str, list[int]]]"]
NO_SCHEMA = [Point, Optional[Point], dict[str, Point], tuple[int], tuple[str, ...], Literal[Color.RED], Empty,
             list[None], type[int], "collections.abc.Sequence[int]", "typing.Callable[[int], int]"]


@pytest.mark.parametrize("hint, has_schema", [pytest.param(h, True, id=_hint_id(h)) for h in HINTS]
                         + [pytest.param(h, False, id=f"{_hint_id(h)} (none)") for h in NO_SCHEMA])
def test_each_hint_as_the_oracle_maps_it(hint, has_schema):
    """One argument of each type, then the same type as the return value (left out where it has no schema)."""

    def tool(x):
        """A tool.

        Args:
            x: The argument.

        Returns:
            The result.
        """

    tool.__annotations__ = {"x": hint}
    if has_schema:
        assert json.dumps(tool_schema(tool)) == json.dumps(oracle(tool))
    else:
        with pytest.raises(Exception):
            oracle(tool)
        with pytest.raises(ToolSchemaError, match="argument 'x' has type hint"):
            tool_schema(tool)
    tool.__annotations__ = {"x": int, "return": hint}
    assert json.dumps(tool_schema(tool)) == json.dumps(oracle(tool))
    assert ("return" in tool_schema(tool)["function"]) is has_schema


# --- Tools both refuse --------------------------------------------------------------------------------------------


def no_docstring(x: int) -> int:
    return x


def blank_docstring(x: int) -> int:
    """ """
    return x


def add_untyped(a: int, b) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def undocumented_arg(a: int, b: int = 0) -> int:
    """Add two numbers.

    Args:
        a: The first.
    """
    return a + b


def args_only_docstring(x: int) -> int:
    """Args:
    x: The number (without a description first, transformers finds no Args: section).
    """
    return x


def untyped_varargs(x: int, *rest) -> int:
    """Sum numbers.

    Args:
        x: The first.
        rest: The others.
    """
    return x


def custom_class(origin: Point) -> float:
    """Distance from a point.

    Args:
        origin: The point.
    """
    return 0.0


def list_of_custom(points: list[Point]) -> float:
    """Length of a path.

    Args:
        points: The path.
    """
    return 0.0


def one_tuple(pair: tuple[int]) -> int:
    """A one-element tuple.

    Args:
        pair: A tuple of one int.
    """
    return 0


def open_tuple(values: tuple[int, ...]) -> int:
    """A tuple of any length.

    Args:
        values: Some ints.
    """
    return 0


def enum_literal(color: Literal[Color.RED]) -> int:
    """A Literal of an Enum member, not a JSON scalar.

    Args:
        color: The colour.
    """
    return 0


def empty_enum(choice: Empty) -> int:
    """An Enum without members.

    Args:
        choice: Nothing can match.
    """
    return 0


def list_of_none(values: list[None]) -> int:
    """``list[None]``: None inside a generic stays None, not NoneType, and transformers has no schema for it.

    Args:
        values: Nones.
    """
    return 0


def unresolved_hint(x: NotDefinedAnywhere) -> int:  # noqa: F821 (a postponed annotation naming nothing)
    """A postponed annotation that does not resolve.

    Args:
        x: Something.
    """
    return 0


def choices_not_json(drink: str) -> str:
    """Drink something.

    Args:
        drink: What to drink (choices: [tea, coffee])
    """
    return drink


def choices_a_number(drink: str) -> str:
    """Drink something.

    Args:
        drink: What to drink (choices: 5)
    """
    return drink


BAD = [no_docstring, blank_docstring, add_untyped, undocumented_arg, args_only_docstring, untyped_varargs,
       custom_class, list_of_custom, one_tuple, open_tuple, enum_literal, empty_enum, list_of_none, unresolved_hint,
       choices_not_json, choices_a_number, functools.partial(add, 1)]


@pytest.mark.parametrize("func", BAD, ids=_id)
def test_refused_by_both(func):
    with pytest.raises(ToolSchemaError) as caught:  # and no other exception
        tool_schema(func)
    message = str(caught.value)
    assert "\n" not in message
    qualname = getattr(func, "__qualname__", None)
    assert message.startswith(f"tools: {func.__module__}.{qualname}: " if qualname else f"tools: {func!r}: ")
    with pytest.raises(Exception):
        oracle(func)


def test_message_names_the_tool_the_problem_and_the_fix():
    with pytest.raises(ToolSchemaError) as caught:
        tool_schema(add_untyped)
    assert str(caught.value) == (f"tools: {add_untyped.__module__}.add_untyped: argument 'b' has no type hint; "
                                 "annotate it (the model sees its type in the schema)")
    with pytest.raises(ToolSchemaError) as caught:
        tool_schema(list_of_custom)
    assert str(caught.value).startswith(f"tools: {__name__}.list_of_custom: argument 'points' has type hint "
                                        f"list[{__name__}.Point], and {__name__}.Point is a custom class or object")
    with pytest.raises(ToolSchemaError, match="argument 'b' has no description in the docstring's Args: section"):
        tool_schema(undocumented_arg)
    with pytest.raises(ToolSchemaError, match="has no docstring"):
        tool_schema(no_docstring)
    with pytest.raises(ToolSchemaError, match="NameError"):
        tool_schema(unresolved_hint)
    with pytest.raises(ToolSchemaError, match="has no __name__"):
        tool_name(functools.partial(add, 1))


# --- Where the module deliberately differs from the oracle ----------------------------------------------------------


def typed_varargs(*values: int) -> int:
    """Sum numbers.

    Args:
        values: The numbers.
    """
    return sum(values)


def typed_kwargs(**options: str) -> str:
    """Join options.

    Args:
        options: The options.
    """
    return ""


def positional_only(x: int, /) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


def choices_a_string(drink: str) -> str:
    """Drink something.

    Args:
        drink: What to drink (choices: "tea")
    """
    return drink


def not_a_type_return(x: int) -> [int]:
    """A return annotation that is not a type.

    Args:
        x: A number.
    """
    return [x]


@pytest.mark.parametrize("func, theirs", [
    # transformers describes each as a keyword argument, but TRL's call tool(**arguments) could not pass it
    (typed_varargs, {"values": {"type": "integer", "description": "The numbers."}}),
    (typed_kwargs, {"options": {"type": "string", "description": "The options."}}),
    (positional_only, {"x": {"type": "integer", "description": "The number."}}),
    # transformers iterates the JSON string into its characters
    (choices_a_string, {"drink": {"type": "string", "enum": ["t", "e", "a"], "description": "What to drink"}}),
], ids=lambda x: _id(x) if callable(x) else "oracle")
def test_refused_where_the_oracle_accepts(func, theirs):
    with pytest.raises(ToolSchemaError, match=r"variadic|positional-only|not a JSON list"):
        tool_schema(func)
    assert oracle(func)["function"]["parameters"]["properties"] == theirs


def test_a_return_annotation_that_is_no_type_is_left_out():
    assert tool_schema(not_a_type_return)["function"] == {
        "name": "not_a_type_return",
        "description": "A return annotation that is not a type.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "A number."}},
                       "required": ["x"]},
    }
    with pytest.raises(TypeError, match="unhashable"):  # where transformers crashes
        oracle(not_a_type_return)
