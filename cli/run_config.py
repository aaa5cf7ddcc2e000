"""A run's config on this machine, and as the user gave it.

Inputs named by object-store URLs (``checkpointer.checkpoint_dir=s3://...``, a dataset) are copied to the local
cache on every machine and the config points at the copies (:func:`cache_inputs`); an object-store ``output_dir``
becomes its local mirror, the URL kept as ``output_store`` (:func:`use_run_dir`). What a checkpoint records is the
config as given (:func:`config_as_given`: the URLs), so a run resumed on another machine (another cache) has the
same config as the one it continues.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from waypoint.run.object_store import input_copy_path, is_url, local_copy
from waypoint.run.output_dir import RunDir


# sections whose URLs are servers the run talks to, no inputs to download: the trackers' (metric_loggers) and a vLLM
# server's (vllm.vllm_server_base_url)
SERVERS = ("metric_loggers", "vllm")


def cache_inputs(cfg, dist, say=print) -> None:
    """Inputs named by object-store URLs (the checkpoint, a dataset: any config string but ``output_dir`` and the
    servers' sections, ``SERVERS``: a tracking or vLLM server's ``http://`` URL is no input to download) are
    copied to ``$WAYPOINT_CACHE/inputs/...`` on every machine with a size check (files already there with the object's size are
    kept), and the config points at the copies; a URL inside one already copied (the checkpoint's tokenizer,
    interpolated from it) points inside that copy."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for section in SERVERS:
        config.pop(section, None)
    found = sorted({v for k, v in _strings(config) if k != "output_dir" and is_url(v)}, key=len)
    local: dict[str, Path] = {}
    for url in found:
        inside = next((u for u in local if url.startswith(u.rstrip("/") + "/")), None)
        if inside is not None:
            local[url] = local[inside] / url[len(inside.rstrip("/")) + 1:]
            continue
        local[url] = input_copy_path(url)
        dist.run_on_each_machine(lambda url=url: local_copy(url, say) and None)
    if local:
        _replace(cfg, {u: str(p) for u, p in local.items()})
        with open_dict(cfg):
            cfg.input_copies = {str(p): u for u, p in local.items()}


def use_run_dir(cfg: DictConfig, run_dir: RunDir) -> None:
    """The config's ``output_dir`` where the run works on this machine (an object store's mirror), the URL beside it."""
    if run_dir.store:
        with open_dict(cfg):
            cfg.output_dir, cfg.output_store = str(run_dir.path), run_dir.store


def config_as_given(cfg) -> dict:
    """The resolved config as the user gave it: object-store URLs where the run uses local copies and mirrors, so
    a run resumed on another machine (another cache) has the same config as the one it continues."""
    config = OmegaConf.to_container(cfg, resolve=True)
    copies = config.pop("input_copies", None) or {}
    store = config.pop("output_store", None)

    def back(node):
        if isinstance(node, dict):
            return {k: back(v) for k, v in node.items()}
        if isinstance(node, list):
            return [back(v) for v in node]
        return copies.get(node, node) if isinstance(node, str) else node
    config = back(config)
    if store:
        config["output_dir"] = store
    return config


def _strings(node, key: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif isinstance(node, str):
        yield key, node


def _replace(node, mapping: dict[str, str], top: bool = True) -> None:
    """Every string value of a (resolved) config found in ``mapping``, replaced in place (the servers' sections aside)."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for k, v in list(items):
        if top and k in SERVERS:
            continue
        if isinstance(v, (DictConfig, ListConfig)):
            _replace(v, mapping, top=False)
        elif isinstance(v, str) and v in mapping and k != "output_dir":
            node[k] = mapping[v]
