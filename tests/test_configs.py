"""Every shipped config composes, names importable components, and switches format by config group."""

from __future__ import annotations

import importlib

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from waypoint.cli.config import parse_config
from waypoint.cli.grpo_option_checks import GRPO
from waypoint.cli.option_checks import COMMON, LORA, PREFERENCE
from waypoint.rewards import resolve

CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.stem not in ("generate", "eval"))  # training configs


def targets(node):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"]
        for value in node.values():
            yield from targets(value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_composes_and_its_targets_import(path):
    raw = OmegaConf.load(path)
    checks = COMMON | LORA if raw.get("lora") else COMMON  # each with its recipe's checks
    if "PreferenceDataset" in raw.dataset._target_:  # recipes/dpo_finetune.py's
        checks = checks | PREFERENCE
    if "PromptDataset" in raw.dataset._target_:  # recipes/grpo_finetune.py's: its reward functions import too
        checks = checks | GRPO
        resolve(raw.reward_funcs)
    cfg = OmegaConf.to_container(parse_config(["--config", str(path), "device=cpu"], checks=checks), resolve=True)  # GPU configs, checked here
    for key in ("output_dir", "seed", "epochs", "batch_size", "gradient_accumulation_steps", "checkpointer", "dataset",
                "optimizer", "resume", "save_every_n_steps", "keep_last_n_checkpoints"):
        assert key in cfg, f"{path.name} lacks {key}"
    for target in targets(cfg):
        module, _, name = target.rpartition(".")
        assert hasattr(importlib.import_module(module), name), f"{path.name}: {target} does not exist"


@pytest.mark.parametrize("group,target", [("meta", "waypoint.checkpointers.MetaCheckpointer"), ("native", "waypoint.checkpointers.NativeCheckpointer"),
                                          ("hf", "waypoint.checkpointers.HFCheckpointer")])
def test_checkpointer_group_switches_format(group, target):
    cfg = parse_config(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer={group}", "checkpointer.checkpoint_dir=/x"])
    assert cfg.checkpointer._target_ == target and cfg.checkpointer.checkpoint_dir == "/x"


def test_a_saved_config_with_moved_builder_names_maps_to_the_current_ones():
    """Checkpoints written before builders moved into their family's file resume with the same model target."""
    from waypoint.run.recipe_state import MOVED, current_names

    saved = {"model": {"_target_": "models.llama2_7b"}, "other": [{"_target_": "waypoint.models.gemma_2b"}]}
    assert current_names(saved) == {"model": {"_target_": "waypoint.families.llama.llama2_7b"},
                                    "other": [{"_target_": "waypoint.families.gemma.gemma_2b"}]}
    for new in MOVED.values():
        module, _, name = new.rpartition(".")
        assert hasattr(importlib.import_module(module), name), new


def test_a_saved_config_naming_a_moved_module_maps_to_its_new_package():
    """Checkpoints written before the text and data sides left waypoint.training (their tokenizer's and dataset's
    _target_) resume with the same targets as today's configs."""
    from waypoint.run.recipe_state import MOVED_MODULES, current_names

    saved = {"tokenizer": {"_target_": "waypoint.training.tokenizer.load_tokenizer", "checkpoint_dir": "x"},
             "dataset": {"_target_": "waypoint.training.chat_dataset.ChatDataset"}}
    today = parse_config(["--config", str(ROOT / "configs/tiny.yaml")])
    assert current_names(saved) == {"tokenizer": {"_target_": today.tokenizer._target_, "checkpoint_dir": "x"},
                                    "dataset": {"_target_": "waypoint.data.chat_dataset.ChatDataset"}}
    for new in MOVED_MODULES.values():
        importlib.import_module(new.rstrip("."))


def test_generate_config_composes_with_its_own_checks():
    from waypoint.cli.option_checks import GENERATE

    cfg = parse_config(["--config", str(ROOT / "configs/generate.yaml"), "prompt=hi", "temperature=0.7"], checks=GENERATE)
    assert cfg.prompt == "hi" and cfg.temperature == 0.7 and cfg.max_new_tokens >= 1
    with pytest.raises(SystemExit):
        parse_config(["--config", str(ROOT / "configs/generate.yaml"), "top_p=1.5"], checks=GENERATE)
