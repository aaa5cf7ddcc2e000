"""scripts/check_readme.py holds the README's demos to what the text promises: every generate command that asks the
tiny chat model the Peru question (after SFT, and after DPO from that SFT) must print the taught answer and stop
right after it (the reply's last line, on stdout, is the answer). The check itself runs them: python scripts/check_readme.py."""

from __future__ import annotations

from scripts import check_readme
from tests.conftest import ROOT

PERU = 'prompt="What is the capital of Peru?"'


def test_every_peru_demo_in_the_readme_is_held_to_the_answer_and_its_stop():
    demos = [c for c in check_readme.commands((ROOT / "README.md").read_text(encoding="utf-8"))
             if "recipes/generate.py" in c and PERU in c]
    assert any("tiny_chat/" in c for c in demos) and any("tiny_dpo/" in c for c in demos), demos
    for demo in demos:
        wanted = [want for key, want in check_readme.REPLY.items() if key in demo]
        assert wanted == ["The capital of Peru is Lima."], demo
