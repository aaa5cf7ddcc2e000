"""scripts/check_readme.py holds the README's demos to what the text promises: every generate command that asks the
tiny chat model the Peru question (after SFT, and after DPO from that SFT) must print the taught answer and stop
right after it (the reply's last line, on stdout, is the answer). The check itself runs them: python scripts/check_readme.py.
The DPO demo's held-out figures, quoted from its metrics.jsonl, are held to the run too (HELD_OUT). The README's claims
that the code can answer without running a demo are held here: which families read images."""

from __future__ import annotations

import json
import re

from scripts import check_readme
from tests.conftest import ROOT
from waypoint.families import family_of

README = (ROOT / "README.md").read_text(encoding="utf-8")

PERU = 'prompt="What is the capital of Peru?"'


def test_every_peru_demo_in_the_readme_is_held_to_the_answer_and_its_stop():
    demos = [c for c in check_readme.commands(README)
             if "recipes/generate.py" in c and PERU in c]
    assert any("tiny_chat/" in c for c in demos) and any("tiny_dpo/" in c for c in demos), demos
    for demo in demos:
        wanted = [want for key, want in check_readme.REPLY.items() if key in demo]
        assert wanted == ["The capital of Peru is Lima."], demo


def test_the_dpo_demo_is_held_to_the_held_out_figures_the_readme_quotes():
    prose = " ".join(README.split())
    for key, (_, beta, (reference, after, margin)) in check_readme.HELD_OUT.items():
        assert any(key in c for c in check_readme.commands(README)), key
        assert f"(beta {beta}, " in prose and f"`val_logps/chosen` {reference} at the reference, {after} after)" in prose
        assert f"by a margin of {margin} (`val_rewards/margins`)" in prose


def test_the_grpo_demo_is_held_to_the_val_reward_its_quoted_line_shows():
    """The README quotes a progress line of the tiny GRPO run with step 16's val_reward: the check holds the run's
    output to it (every val_reward gets a line; the README's figures had never been printed)."""
    (command,) = [c for c in check_readme.commands(README) if "configs/tiny_grpo.yaml" in c]
    (want,) = [want for key, want in check_readme.EXPECT.items() if key in command]
    assert re.search(rf"\ntrain step 16/80 \(20%\): .*, {want}, ", README)
    assert f"0.179, {want.split()[1]}, 0.75 at steps 8, 16, 24" in README  # the figures its text quotes


def test_held_out_figures_are_the_last_held_out_records(tmp_path):
    """The held-out figures of a preference run's metrics.jsonl: its last val_* record's, the reference's log-prob
    recovered from the reward (beta times the policy's less the reference's); a drift shows in the first decimal."""
    rows = [{"step": 9, "loss": 0.3, "logps/chosen": -80.0},
            {"step": 9, "val_logps/chosen": -89.98, "val_rewards/chosen": 0.0948, "val_rewards/margins": 1.165},
            {"step": 36, "val_logps/chosen": -88.2445, "val_rewards/chosen": 0.2681, "val_rewards/margins": 4.1622},
            {"step": 36, "loss": 0.02, "logps/chosen": -70.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_readme.held_out(tmp_path / "metrics.jsonl", 0.1) == (-90.9, -88.2, 4.2)
    rows[2].update({"val_logps/chosen": -90.75, "val_rewards/chosen": 0.008, "val_rewards/margins": 4.36})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_readme.held_out(tmp_path / "metrics.jsonl", 0.1) == (-90.8, -90.8, 4.4)


def family_rows() -> list[list[str]]:
    """The cells of each row of the README's family table (family, checkpoints, what the native model does, not
    supported, logit diff)."""
    table = README.split("\n| family (HF `model_type`) |", 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in table.splitlines()[2:]]


def test_the_family_table_says_which_families_read_images():
    """A family whose multimodal repos read images (``Family.vision``: Gemma 3, Gemma 4, Qwen3.5/3.6) says so in what its
    native model does and is not called text only; a text family never mentions images; images are not out of scope."""
    rows = family_rows()
    assert len(rows) > 10, rows
    for family_cell, _, does, unsupported, _ in rows:
        families = [family_of({"model_type": t}) for t in re.findall(r"`([a-z0-9_]+)`", family_cell)]
        assert families and len({f.name for f in families}) == 1, family_cell
        reads_images = families[0].vision is not None
        assert ("images" in does) == reads_images and "text only" not in unsupported, (family_cell, does, unsupported)
    out_of_scope = README.split("\nOut of scope:", 1)[1].split(" (MoE models", 1)[0]
    assert "vision" not in out_of_scope, out_of_scope


def test_commands_side_by_side_wait_for_every_earlier_one_they_share_something_with():
    """--jobs: a command waits for the earlier commands that write or read its outputs/ folders (named in it or in its
    config), a root file it names, or torchrun's port; one whose config is not there yet waits for all before it."""
    plan = ["python recipes/full_finetune.py --config configs/tiny_chat.yaml",             # 0: outputs/tiny_chat
            "python scripts/make_tiny_vlm.py outputs/tiny_vlm_base",                      # 1
            "python recipes/full_finetune.py --config configs/tiny_vlm.yaml",             # 2: its config reads 1's
            "python recipes/generate.py --config configs/generate.yaml checkpoint_dir=outputs/tiny_chat/step_300",
            "waypoint run --nproc-per-node 2 full_finetune --config tiny output_dir=outputs/a",   # 4
            "torchrun --nproc_per_node 2 recipes/full_finetune.py --config configs/tiny.yaml output_dir=outputs/b",
            "waypoint cp tiny_lora mine.yaml",                                             # 6
            "waypoint run lora_finetune --config mine.yaml output_dir=outputs/c",        # 7: mine.yaml not there yet
            "waypoint ls                                   # the recipes"]                # 8
    waits = check_readme.after(plan, ROOT)
    assert waits[1] == set() and waits[2] == {1} and waits[3] == {0}
    assert waits[5] == {4}  # tiny.yaml's own output_dir too, and the port
    assert waits[7] == set(range(7)) and waits[8] == {7}
