"""Command line -> composed Hydra config: ``--config configs/X.yaml key=value ...``.

The compose API runs over the config file's directory, so config groups there
(``configs/checkpointer/hf.yaml``) can be switched from the command line
(``checkpointer=hf``) as well as single keys (``checkpointer.output_dir=...``).

After composing, every string value starting with ``hf://`` (``hf://org/name[@revision]``,
``hf://datasets/org/name[/file]``) is replaced by the local path of a hub snapshot, downloaded
when not cached (``waypoint.training.hub``); interpolations are resolved first, so copies such as
``model.config: ${checkpointer.checkpoint_dir}`` follow.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from waypoint.converters.errors import CheckpointError


def parse_config(argv: list[str] | None = None, description: str | None = None) -> DictConfig:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="path to a YAML config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option, +new_key=value")
    args = parser.parse_args(argv)
    path = Path(args.config)
    if not path.is_file():
        parser.error(f"--config {path}: file not found")
    with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
        cfg = compose(config_name=path.stem, overrides=args.overrides)
    OmegaConf.resolve(cfg)
    if _has_hf_uri(cfg):
        from waypoint.training.hub import resolve_hf_uris  # imports huggingface_hub only when needed

        try:
            resolve_hf_uris(cfg)
        except (CheckpointError, FileNotFoundError) as e:  # before the recipe's own error handling
            if os.environ.get("WAYPOINT_DEBUG"):
                raise
            parser.exit(1, f"error: {str(e).splitlines()[0]}\n")
    return cfg


def _has_hf_uri(node) -> bool:
    container = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
    if isinstance(container, dict):
        return any(_has_hf_uri(v) for v in container.values())
    if isinstance(container, list):
        return any(_has_hf_uri(v) for v in container)
    return isinstance(container, str) and container.startswith("hf://")
