"""A tool's JSON schema, as the model sees the tool in the chat template, from its type hints and docstring.

It mirrors transformers' ``get_json_schema`` (``transformers/utils/chat_template_utils.py``, 5.24) without importing
it: its docstring regexes verbatim (Google style; a trailing ``(choices: [...])`` becomes an ``enum``), its type
mapping (int, float, str, bool, None, Any, list, tuple, dict, Enum, Literal, Union; PIL images as "image", torch
tensors as "audio"), hints resolved by ``typing.get_type_hints`` (postponed annotations work), an untyped first
``self``/``cls`` skipped, the same schema, key order included. ``tool_schema(f) == get_json_schema(f)`` wherever
transformers returns a schema, except where this module deliberately refuses more, because TRL calls a tool as
``tools[f.__name__](**arguments)`` and the schema must describe that call:

* variadic (``*args``, ``**kwargs``) and positional-only arguments are refused: the model passes arguments by name
  (transformers describes ``*values: int`` as one integer argument named ``values``, which no call can pass);
* a callable without ``__name__`` is refused (transformers names it "operation"; TRL could not key it);
* ``(choices: ...)`` must be a JSON list (transformers iterates any JSON: ``"tea"`` gives ``["t", "e", "a"]``).

It accepts more in one place: a return annotation that is not a type at all (``-> [int]``) is left out of the
schema like any other return hint with no JSON schema (transformers crashes with "unhashable type" there).
Everything wrong is a ``ToolSchemaError``: one line naming the tool (module.qualname), what is wrong and what to do.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import sys
import types
import typing
from typing import Any, Literal, Union

# transformers' docstring regexes: the description, the Args: block, one argument in it, the Returns: block.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(
    r"""
(?:^|\n)  # the start of the block, or a newline
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*  # the indentation and the argument's name, skipping a "(type)"
(.*?)\s*  # its description, over as many lines as it takes
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)  # up to the next "name:" not indented deeper, or the end
""",
    re.DOTALL | re.VERBOSE,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

# The Python types a JSON value can be written as (in an "enum"), and the bare types with a schema of their own.
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**_SCALARS, list: "array", tuple: "array", dict: "object"}
_SUPPORTED = "use int, float, str, bool, an Enum, Literal[...], or list, tuple, dict or Union of those, or write the \
tool's schema by hand"


class ToolSchemaError(ValueError):
    """A callable that cannot be offered to the model as a tool: one line saying which, what is wrong, what to do."""


class _Unsupported(Exception):
    """A type hint (or a part of one) with no JSON schema: which, why, and what to do."""

    def __init__(self, hint, why: str, fix: str = _SUPPORTED):
        super().__init__(hint, why, fix)
        self.hint, self.why, self.fix = hint, why, fix


def tool_name(func) -> str:
    """The name the model calls the tool by: ``func.__name__``, as TRL keys its tool dict."""
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        raise _error(func, "has no __name__, the name the model would call it by", "pass a function or a method")
    return name


def tool_schema(func) -> dict:
    """``{"type": "function", "function": {"name", "description", "parameters", ["return"]}}`` for ``func``, as
    transformers' ``get_json_schema`` writes it (see the module's docstring); ``ToolSchemaError`` where it refuses."""
    name = tool_name(func)
    doc = inspect.getdoc(func)
    if not doc:
        raise _error(func, "has no docstring", "write one: a description, then 'Args:' with a line per argument "
                     "(the model reads them)")
    description, arg_docs, returns_doc = _parse_docstring(doc.strip())
    try:  # evaluating a postponed annotation runs its text, which can raise anything
        hints = typing.get_type_hints(func)
        params = inspect.signature(func).parameters
    except Exception as e:
        raise _error(func, f"its type hints or signature cannot be read ({type(e).__name__}: {e})",
                     "annotate with types importable where it is defined, and pass a function or a method") from e

    first = next(iter(params.values()), None)
    receiver = first.name if first and first.name in ("self", "cls") and first.annotation is first.empty else None
    required = []
    for param in params.values():
        if param.name == receiver:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            stars = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise _error(func, f"argument '{stars}{param.name}' is variadic, but the model passes arguments by name",
                         "take a list[...] or dict[...] argument instead")
        if param.kind is param.POSITIONAL_ONLY:
            raise _error(func, f"argument '{param.name}' is positional-only, but the model passes arguments by "
                         "name", "remove the '/' from the signature")
        if param.annotation is param.empty:
            raise _error(func, f"argument '{param.name}' has no type hint",
                         "annotate it (the model sees its type in the schema)")
        if param.default is param.empty:
            required.append(param.name)

    properties = {}
    for arg, hint in hints.items():
        if arg not in ("return", receiver):
            try:
                properties[arg] = _type_schema(hint)
            except _Unsupported as e:
                which = "which" if e.hint is hint else f"and {_show(e.hint)}"
                raise _error(func, f"argument '{arg}' has type hint {_show(hint)}, {which} {e.why}", e.fix) from None
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise _error(func, f"argument '{arg}' has no description in the docstring's Args: section",
                         f"add a line '{arg}: what it is' there (the model reads it)")
        text = arg_docs[arg]
        if choices := _CHOICES.search(text):
            schema["enum"] = _choices(func, arg, choices.group(1))
            text = text[: choices.start()].strip()
        schema["description"] = text

    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        try:
            function["return"] = _type_schema(hints["return"])
        except _Unsupported:
            pass  # the model never writes the return value: left out rather than described wrongly
        else:
            if returns_doc is not None:
                function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """The description, each argument's description (continuation lines joined with a space), and Returns:."""
    args_block = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    arg_docs = {}
    if args_block:
        lines = "\n".join(line for line in args_block.group(1).split("\n") if line.strip())
        arg_docs = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(lines)}
    return _DESCRIPTION.search(doc).group(1).strip(), arg_docs, returns.group(1).strip() if returns else None


def _type_schema(hint) -> dict:
    """The JSON schema of one resolved type hint, as transformers maps it; ``_Unsupported`` where it has none."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if hint is Any:
            return {}
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema(hint, [member.value for member in hint])
        if isinstance(hint, type) and hint in _BARE:
            return {"type": _BARE[hint]}
        if _is_class(hint, "PIL.Image", "Image"):
            return {"type": "image"}
        if _is_class(hint, "torch", "Tensor"):
            return {"type": "audio"}
        raise _Unsupported(hint, "is a custom class or object, with no JSON schema")
    if origin is Union or origin is types.UnionType:
        subtypes = [_type_schema(arg) for arg in args if arg is not type(None)]
        if len(subtypes) == 1:
            schema = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):  # a list of type names
            names = sorted({s["type"] for s in subtypes})
            schema = {"type": names[0] if len(names) == 1 else names}
        else:
            schema = {"anyOf": subtypes}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is Literal:
        return _enum_schema(hint, list(args))
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1:
            raise _Unsupported(hint, "is a tuple of one element", "use list[...], or the element itself")
        if ... in args:
            raise _Unsupported(hint, "is a tuple of any length", "use list[...]")
        return {"type": "array", "prefixItems": [_type_schema(arg) for arg in args]} if args else {"type": "array"}
    if origin is dict:  # JSON object keys are strings: only the values' type is described
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _type_schema(args[1])
        return schema
    raise _Unsupported(hint, "has no JSON schema")


def _enum_schema(hint, values: list) -> dict:
    """An "enum" of JSON scalars, its "type" each of their JSON types once, in the order they first appear."""
    if not values:
        raise _Unsupported(hint, "is an Enum without members (no value can match it)", "give it members")
    if any(type(value) not in _SCALARS for value in values):
        raise _Unsupported(hint, "has values that are not JSON scalars", "make them int, float, str, bool or None")
    names = list(dict.fromkeys(_SCALARS[type(value)] for value in values))
    return {"type": names[0] if len(names) == 1 else names, "enum": values}


def _choices(func, arg: str, text: str) -> list:
    """The values of an argument's ``(choices: [...])``, a JSON list (its strings stripped, as transformers does)."""
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, list):
        raise _error(func, f"argument '{arg}' has '(choices: {text})', which is not a JSON list",
                     'write it as (choices: ["tea", "coffee"]) at the end of its description')
    return [value.strip() if isinstance(value, str) else value for value in values]


def _is_class(hint, module: str, name: str) -> bool:
    """Whether ``hint`` is ``module.name``, found without importing it (a hint to it has imported it)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and hint is cls


_show = inspect.formatannotation  # a hint as written: "list[int]", "Optional[my_tools.Point]"


def _error(func, problem: str, fix: str) -> ToolSchemaError:
    """The error for ``func``, on one line: ``tools: module.qualname: what is wrong; what to do``."""
    qualname = getattr(func, "__qualname__", None)
    where = f"{getattr(func, '__module__', None)}.{qualname}" if isinstance(qualname, str) else repr(func)
    return ToolSchemaError(" ".join(f"tools: {where}: {problem}; {fix}".split()))
