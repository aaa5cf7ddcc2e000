"""How far within its limits each chat template the tests use renders a conversation.

    python benchmarks/bench_chat_template.py [--turns 1 10 100]

For each template (the families in ``tests/test_chat_data.py``, and gpt-oss's harmony template in
``tests/test_chat_template_harmony.py``) and each conversation length (user and assistant
turns, after a system message where the template takes one): the steps one rendering takes (loop iterations and
macro calls, ``waypoint.text.template_sandbox``), the time per rendering, and the ratio of ``STEP_LIMIT`` to the
steps; then what a hostile template (nested loops) costs before it is stopped. No model or network needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not this folder: the shipped templates, the tests' helpers

from tests.test_chat_data import FAMILIES, SYSTEM  # noqa: E402
from tests.test_chat_template_harmony import HARMONY, HARMONY_MARKED  # noqa: E402
from waypoint.text.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402
from waypoint.text.template_sandbox import STEP_LIMIT  # noqa: E402


def conversation(turns: int, system: bool) -> list[dict]:
    messages = [SYSTEM] if system else []
    for n in range(turns):
        messages += [{"role": "user", "content": f"Question {n}: what is {n} + {n}?"},
                     {"role": "assistant", "content": f"{n} + {n} = {2 * n}."}]
    return messages


def timed(chat: ChatTemplate, messages: list[dict], repeats: int) -> tuple[int, float]:
    started = time.perf_counter()
    for _ in range(repeats):
        chat.render(messages)
    return chat._env.steps_used, (time.perf_counter() - started) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 10, 100, 1000])
    args = parser.parse_args()
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    print(f"{'template':<14}" + "".join(f"{f'{t} turns: steps  ms  limit/steps':>34}" for t in args.turns))
    most = 0
    for family, (template, marked, *_, system) in {**FAMILIES, "gpt-oss": (HARMONY, HARMONY_MARKED, True)}.items():
        row = f"{family:<14}"
        for source in (template, marked):
            chat = ChatTemplate(source, family, specials)
            for turns in args.turns:
                steps, seconds = timed(chat, conversation(turns, system), repeats=3 if turns < 1000 else 1)
                most = max(most, steps / turns)
                if source is template:
                    row += f"{steps:>16,} {seconds * 1e3:>7.2f} {STEP_LIMIT / steps:>9,.0f}"
        print(row)
    print(f"most steps per turn (plain and {{% generation %}}-marked templates): {most:.1f}; "
          f"the limit of {STEP_LIMIT:,} steps fits {STEP_LIMIT / most:,.0f} turns")
    for name, source in (("nested loops", "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"),
                         ("recursive macro", "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                                             "{{ f(60) }}")):
        started = time.perf_counter()
        try:
            ChatTemplate(source, name).render(conversation(1, False))
        except ChatTemplateError:
            pass
        print(f"hostile template ({name}): stopped after {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
