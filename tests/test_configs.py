"""Every shipped config composes, names importable components, and switches format by config group."""

from __future__ import annotations

import importlib

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT
from waypoint.training.config import parse_config

CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml"))


def targets(node):
    if isinstance(node, dict):
        if "_target_" in node:
            yield node["_target_"]
        for value in node.values():
            yield from targets(value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_composes_and_its_targets_import(path):
    cfg = OmegaConf.to_container(parse_config(["--config", str(path), "device=cpu"]), resolve=True)  # GPU configs, checked here
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
