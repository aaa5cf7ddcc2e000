"""Command line -> composed Hydra config: ``--config configs/X.yaml key=value ...``.

The compose API runs over the config file's directory, so config groups there
(``configs/checkpointer/hf.yaml``) can be switched from the command line
(``checkpointer=hf``) as well as single keys (``checkpointer.output_dir=...``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf


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
    return cfg
