"""Command line -> composed Hydra config: ``--config configs/X.yaml key=value ...``.

The compose API runs over the config file's directory, so config groups there
(``configs/checkpointer/hf.yaml``) can be switched from the command line
(``checkpointer=hf``) as well as single keys (``checkpointer.output_dir=...``).

After composing, every string value starting with ``hf://`` (``hf://org/name[@revision]``,
``hf://datasets/org/name[/file]``) is replaced by the local path of a hub snapshot, downloaded
when not cached (``waypoint.cli.hub``); interpolations are resolved first, so copies such as
``model.config: ${checkpointer.checkpoint_dir}`` follow.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from waypoint.checkpointers.torchtune_compat import CHECKPOINTERS, resume_options_note
from waypoint.errors import CheckpointError, first_line
from waypoint.cli.command import DEBUG, OneLineParser
from waypoint.cli.option_checks import COMMON, Check, check_options
from waypoint.cli.shipped import data_root, find_config, shipped_asset


def parse_config(argv: list[str] | None = None, description: str | None = None, example: str = "configs/tiny.yaml",
                 checks: Mapping[str, tuple[bool, Check]] = COMMON) -> DictConfig:
    """The composed, resolved and checked config; a problem with it exits with one ``error:`` line."""
    parser = OneLineParser(description=description)
    parser.add_argument("--config", required=True, help=f"path to a YAML config, e.g. {example}")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option, +new_key=value")
    args = parser.parse_args(argv)
    try:
        path = find_config(args.config)  # a file, or a shipped config by name (`waypoint ls`)
    except LookupError as e:
        parser.error(f"--config {e}")
    try:
        notes: list[str] = []
        cfg = compose_config(path, args.overrides, notes)
        if int(os.environ.get("RANK", "0")) == 0:
            for note in notes:
                print(note)
        check_options(cfg, checks)  # before any download: a bad option (or output_dir=hf://...) costs nothing
        if _has_hf_uri(cfg):
            from waypoint.cli.hub import resolve_hf_uris  # imports huggingface_hub only when needed

            resolve_hf_uris(cfg)
    except (CheckpointError, FileNotFoundError) as e:  # before the recipe's own error handling
        if os.environ.get(DEBUG):
            raise
        parser.exit(1, f"error: {first_line(e)}\n")
    return cfg


def shipped_groups(path: Path) -> list[str]:
    """A config outside the shipped ``configs/`` (one ``waypoint cp`` copied out to edit) still finds the shipped config
    groups (``checkpointer: hf``, ``+metric_logger=wandb``): Hydra searches its own folder first, then those."""
    shipped = (data_root() / "configs").resolve()
    quoted = str(shipped).replace("\\", "\\\\").replace("'", "\\'")  # a path with spaces or commas stays one path
    return [] if path.parent.resolve() == shipped else [f"hydra.searchpath=['file://{quoted}']"]


def compose_config(path: Path, overrides: list[str], notes: list[str] | None = None) -> DictConfig:
    """Hydra's compose and OmegaConf's resolve, their errors as one line naming the option; torchtune's
    ``_component_`` read as ``_target_`` (``torchtune_components``), the note about it appended to ``notes``."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
            cfg = compose(config_name=path.stem, overrides=[*shipped_groups(path), *overrides])
        OmegaConf.resolve(cfg)
        found = [torchtune_components(cfg), resume_options_note(cfg, prefix="")]  # torchtune's top-level one too
        if notes is not None:
            notes += [note for note in found if note]
        _use_shipped_assets(cfg)
        return cfg
    except MissingConfigException as e:
        found = re.search(r"Could not find '([^']+)'", str(e))
        options = re.findall(r"^\t(\S+)$", str(e).split("Config search path")[0], flags=re.M)
        if found and "/" in found.group(1):
            group, option = found.group(1).rsplit("/", 1)
            raise CheckpointError(f"{group}={option}: no such option in {path.parent / group}"
                                  + (f" (available: {', '.join(options)})" if options else "")) from None
        raise CheckpointError(f"{path}: {first_line(e)}") from None
    except OverrideParseException as e:
        raise CheckpointError(f"cannot parse the override {_bad_override(overrides)!r}: {first_line(e)}") from None
    except HydraException as e:
        unknown = re.match(r"Could not override '([^']+)'", str(e))
        if unknown:
            key = unknown.group(1)
            near = difflib.get_close_matches(key, _known_keys(path), n=2, cutoff=0.6)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise CheckpointError(f"unknown option {key}{hint}; to add a new key, write +{key}=...") from None
        present = re.search(r"An item is already at '([^']+)'", str(e))
        if present:
            raise CheckpointError(f"+{present.group(1)}: {present.group(1)} is already in the config; drop the +") from None
        raise CheckpointError(f"{path}: {first_line(e)}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise CheckpointError(f"{path}: {key + ': ' if key else ''}{first_line(e)}") from None


# What to write instead of torchtune's own classes, by section (its checkpointers map to ours: CHECKPOINTERS)
TORCHTUNE_INSTEAD = {
    "model": "_target_: waypoint.checkpointers.build_model with checkpoint_dir: ${checkpointer.checkpoint_dir} "
             "(the model the checkpoint describes)",
    "tokenizer": "_target_: waypoint.text.tokenizer.load_tokenizer with checkpoint_dir: ${checkpointer.checkpoint_dir}",
    "dataset": "_target_: waypoint.data.instruct_dataset.InstructDataset (source, template, max_seq_len), or a "
               "chat dataset as configs/tiny_chat.yaml has",
    "lr_scheduler": "_target_: waypoint.training.lr_schedule.warmup_cosine with num_warmup_steps",
    "optimizer": "_target_: torch.optim.AdamW with lr, weight_decay",
    "loss": "nothing: the recipes compute the loss (fused_loss: true chunks it, as CEWithChunkedOutputLoss does); "
            "drop the section",
    "metric_logger": "metric_loggers: {} (README: Experiment trackers) and log_dir for TensorBoard; drop the section",
    "profiler": "nothing (Waypoint has no profiler section); drop it",
}


def torchtune_components(cfg: DictConfig) -> str | None:
    """Every section naming its class with torchtune's ``_component_`` gets it as Hydra's ``_target_``, torchtune's
    checkpointers as ours; one note line says so (None: nothing read so). A torchtune class Waypoint has no twin for
    is one error line saying what to write instead."""
    found: list[tuple[str, DictConfig, str]] = []

    def walk(node, where: str) -> None:
        if isinstance(node, DictConfig):
            if "_component_" in node:
                found.append((where, node, node["_component_"]))
            for k in list(node.keys()):
                walk(node._get_node(k), f"{where}.{k}" if where else str(k))
        elif isinstance(node, ListConfig):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
    walk(cfg, "")
    mapped = []
    for where, node, component in found:
        key = where or "the config"
        target = CHECKPOINTERS.get(component, component)
        if not isinstance(component, str) or not component:
            raise CheckpointError(f"{key}._component_={component!r}: expected a class or function's import path")
        if component.startswith("torchtune.") and component not in CHECKPOINTERS:
            section = where.split(".")[-1].split("[")[0]
            instead = TORCHTUNE_INSTEAD.get(section, "the matching section of a shipped config (waypoint ls; "
                                                     "configs/tiny.yaml shows each)")
            raise CheckpointError(f"{key}._component_: {component} is torchtune's own, which Waypoint does not use; "
                                  f"write {instead}")
        if node.get("_target_") not in (None, target):
            raise CheckpointError(f"{key}: both _target_ ({node['_target_']}) and _component_ ({component}) are given; "
                                  "keep one (a config group such as checkpointer: hf gives _target_)")
        with open_dict(node):
            node["_target_"] = target
            del node["_component_"]
        mapped.append(f"{key} ({component} -> {target})" if target != component else key)
    if not mapped:
        return None
    return f"note: _component_ (torchtune's name) read as _target_ in {', '.join(mapped)}"


def _use_shipped_assets(node) -> None:
    """Each ``assets/...`` value the current directory does not have, the shipped one (``cli.shipped``)."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for k, v in list(items):
        if isinstance(v, (DictConfig, ListConfig)):
            _use_shipped_assets(v)
        elif isinstance(v, str) and shipped_asset(v) != v:
            node[k] = shipped_asset(v)


def _bad_override(overrides: list[str]) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            return override
    return " ".join(overrides)


def _known_keys(path: Path) -> list[str]:
    """Every dotted key of a value in the config file as it is, for suggestions."""
    with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name=path.stem, overrides=shipped_groups(path)), resolve=False)
    keys: list[str] = []

    def walk(node: Mapping, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{k}.")
            elif k not in ("_target_", "_component_"):
                keys.append(prefix + str(k))
    walk(cfg, "")
    return keys


def _has_hf_uri(node) -> bool:
    container = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
    if isinstance(container, dict):
        return any(_has_hf_uri(v) for v in container.values())
    if isinstance(container, list):
        return any(_has_hf_uri(v) for v in container)
    return isinstance(container, str) and container.startswith("hf://")
