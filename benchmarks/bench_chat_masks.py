"""How long finding a conversation's assistant turns (its training mask) takes, per published chat template.

    python benchmarks/bench_chat_masks.py [--pairs 10 100] [--repeats 3]

For each template in assets/chat_templates/ and each length (user/assistant turn pairs with reasoning, after a
system message where the template takes one): the seconds ``ChatTemplate.assistant_spans`` takes, and how: in one
rendering of a marked copy (``waypoint.text.generation_marks``, the Qwen3 family) or by the rendering-based
derivation, whose time grows with the square of the length or faster. For marked templates the derivation's time is
given beside it (the ratio in one run). No model or network needed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

from waypoint.text.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402

CONTROLS = ["<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<end_of_turn>",
            "<start_of_turn>", "<|end|>", "<|return|>", "<|start|>", "<|message|>", "<|channel|>", "<turn|>", "<|turn>",
            "<｜end▁of▁sentence｜>", "<｜Assistant｜>", "<｜User｜>", "<|assistant|>", "<|user|>"]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def conversation(pairs: int, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}] if system else []
    for n in range(pairs):
        messages += [{"role": "user", "content": f"Question {n}: what is {n} + {n}?"},
                     {"role": "assistant", "reasoning_content": f"Add {n} to itself.", "content": f"{2 * n}."}]
    return messages


def seconds(call, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'template':<26}{'how':<12}" + "".join(f"{f'{p} pairs (s)':>16}{'derived (s)':>13}" for p in args.pairs))
    for path in sorted((ROOT / "assets/chat_templates").glob("*.jinja")):
        chat = ChatTemplate(path.read_text(encoding="utf-8"), path.name, SPECIALS, CONTROLS)
        how = "marked copy" if chat._marked is not None else "derived"
        row = f"{path.stem:<26}{how:<12}"
        for pairs in args.pairs:
            try:
                messages = conversation(pairs, system=True)
                chat.render(messages)
            except ChatTemplateError:  # a template without a system turn
                messages = conversation(pairs, system=False)
            try:
                spent = seconds(lambda: chat.assistant_spans(messages), args.repeats)
                derived = seconds(lambda: chat._derive_spans(messages), 1) if chat._marked is not None else None
            except ChatTemplateError as e:
                row += f"{'error: ' + str(e)[:40]:>29}"
                continue
            row += f"{spent:>16.3f}" + (f"{derived:>13.3f}" if derived is not None else f"{'':>13}")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
