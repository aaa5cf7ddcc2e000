"""The jinja environment a chat template runs in: transformers' sandbox, with limits.

A chat template is untrusted input (it comes with a checkpoint from the Hub). jinja's
``ImmutableSandboxedEnvironment`` keeps it away from Python's internals, set up as transformers sets it up
(``utils/chat_template_utils.py``): ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` tag, the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (which
refuses ``_``-names), and a ``tojson`` filter that does not escape HTML.

The sandbox does not keep a template from running for ever or filling memory, so each rendering has limits:

* ``STEP_LIMIT`` steps, a step being one loop iteration or one macro call: the compiled template counts them
  (``StepCounting`` adds a call at the start of every loop body and every macro body), so nested loops
  (``range`` alone is capped at 100,000 items by jinja) and recursive macros stop, wherever they spend their time.
* ``SIZE_LIMIT`` characters (or items) for the rendered text and for any value the template builds: checked
  before ``*`` repeats a string or list, ``**`` builds a huge number, ``%`` or ``format`` pads to a width, or a
  call or filter gets a width or count beyond the limit, and after every call and filter.

Real templates render a conversation in a few hundred steps (``benchmarks/bench_chat_template.py`` measures the
templates the tests use); the limits are thousands of times that.
"""

from __future__ import annotations

import functools
import json
import math
import re
from contextlib import contextmanager
from datetime import datetime

STEP_LIMIT = 250_000
SIZE_LIMIT = 1 << 24  # 16.8M characters: four times a million-token context

_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


class TemplateLimitError(Exception):
    """A rendering that ran past ``STEP_LIMIT`` or built a value past ``SIZE_LIMIT``."""


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"{what} is past the limit of {SIZE_LIMIT:,} characters")


def _check_size(value):
    if isinstance(value, (str, bytes, list, tuple, dict, set)) and len(value) > SIZE_LIMIT:
        raise _too_big(f"a {type(value).__name__} of {len(value):,} items")
    return value


def _check_widths(text: str) -> None:
    """Refuse a ``%`` or ``{:...}`` format whose width or precision builds more than ``SIZE_LIMIT`` characters."""
    for match in _FORMAT_WIDTH.finditer(text):
        for number in match.groups():
            if number and int(number) > SIZE_LIMIT:
                raise _too_big(f"a format width of {int(number):,}")


# What takes an integer as the size of what it builds (a width, a count of items): str's padding methods and the
# filters that pad or split into that many pieces. Other integers (indices, counts to replace) build nothing.
SIZING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
SIZING_FILTERS = frozenset({"center", "indent", "batch", "slice"})


def _check_arguments(args, kwargs, sizing: bool = True) -> None:
    for value in (*args, *kwargs.values()):
        _check_size(value)
        if sizing and isinstance(value, int) and not isinstance(value, bool) and abs(value) > SIZE_LIMIT:
            raise _too_big(f"an argument of {value:,}")


def _repeat(left, right):
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > SIZE_LIMIT:
            raise _too_big(f"repeating {len(seq):,} items {n:,} times")
    return _check_size(left * right)


def _power(left, right):
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        digits = right * math.log10(abs(left))
        if digits > SIZE_LIMIT:
            raise _too_big(f"a number of {digits:,.0f} digits")
    return left ** right


def _modulo(left, right):
    if isinstance(left, str):
        _check_widths(left)
        if "*" in left:  # widths taken from the arguments
            _check_arguments(right if isinstance(right, tuple) else (right,), {})
    return _check_size(left % right)


def _limited_filter(name: str, function):
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def limited(*args, **kwargs):
        _check_arguments(args[1:], kwargs, sizing=name in SIZING_FILTERS)
        if args and isinstance(args[0], str) and function.__name__ == "do_format":
            _check_widths(args[0])
        return _check_size(function(*args, **kwargs))
    return limited


def sandboxed_environment():
    """A sandboxed jinja environment like transformers' (``_cached_compile_jinja_template``), with the limits."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        from jinja2.compiler import CodeGenerator
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from e

    class StepCounting(CodeGenerator):
        """Compiles a call to ``environment.count_step()`` into the start of every loop body and macro body."""

        def enter_frame(self, frame):
            super().enter_frame(frame)
            self.writeline("environment.count_step()")

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = StepCounting
        intercepted_binops = frozenset({"*", "**", "%"})
        steps_left = STEP_LIMIT
        steps_used = 0  # by the last rendering

        def count_step(self):
            self.steps_left -= 1
            if self.steps_left < 0:
                raise TemplateLimitError(f"it ran past {STEP_LIMIT:,} steps (loop iterations and macro calls) "
                                         "in one rendering")

        def call_binop(self, context, operator_, left, right):
            if operator_ == "*":
                return _repeat(left, right)
            if operator_ == "**":
                return _power(left, right)
            if operator_ == "%":
                return _modulo(left, right)
            return super().call_binop(context, operator_, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _check_arguments(args, kwargs, sizing=isinstance(getattr(__obj, "__self__", None), str)
                             and getattr(__obj, "__name__", "") in SIZING_METHODS)
            if getattr(__obj, "__name__", "") == "replace" and isinstance(getattr(__obj, "__self__", None), str) \
                    and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
                old, new = args[0], args[1]
                grows = (__obj.__self__.count(old) if old else len(__obj.__self__) + 1) * (len(new) - len(old))
                if len(__obj.__self__) + grows > SIZE_LIMIT:
                    raise _too_big(f"a replacement building {len(__obj.__self__) + grows:,} characters")
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):  # str.format and format_map, as the template reads them
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_widths(value.__self__)
            return wrapped

        @contextmanager
        def limits(self):
            """One rendering's step budget."""
            self.steps_left = STEP_LIMIT
            try:
                yield
            finally:
                self.steps_used, self.steps_left = STEP_LIMIT - self.steps_left, STEP_LIMIT

    class GenerationTracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span its body renders to."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks = None
            self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            rendered = caller()
            if self._spans is not None:
                start = sum(len(block) for block in self._blocks)
                self._spans.append((start, start + len(rendered)))
            return rendered

        @contextmanager
        def track(self, blocks, spans):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks, self._spans = None, None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # dict() without the class itself (no attribute tricks through it)
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # refuses dunder and private names
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):  # {% set ns.name = value %}: where a value can grow from one loop to the next
            TemplateNamespace._check(name)
            _check_size(value)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _limited_filter(name, function) for name, function in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def render_limited(env, template, variables: dict, blocks: list[str]) -> str:
    """``template`` rendered with ``variables`` within one rendering's limits, its pieces appended to ``blocks``."""
    size = 0
    with env.limits():
        for block in template.generate(**variables):
            blocks.append(block)
            size += len(block)
            if size > SIZE_LIMIT:
                raise _too_big(f"the rendered text ({size:,} characters so far)")
    return "".join(blocks)

