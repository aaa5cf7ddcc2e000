"""Downloads from the Hugging Face hub: the real huggingface_hub client against a hub on 127.0.0.1.

Nothing leaves the machine: in-process calls pass ``endpoint=`` and a temporary ``cache_dir``;
subprocesses get ``HF_ENDPOINT`` and ``HF_HOME`` pointing at the local server and a temporary dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.recipe_runs import Finished, run_recipe
from tests.hub_server import HubServer
from waypoint.cli import hub as hubmod
from waypoint.cli.hub import HubError, default_patterns, download, parse_hf_uri, read_source, resolve_hf_uri

TOKEN = "hf_waypointSecretToken0123456789"
TINY = ROOT / "assets/tiny_llama"
SAFETENSORS_FILES = {"config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"}
HF_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_HOME",
           "HF_ENDPOINT", "HF_HUB_ENABLE_HF_TRANSFER")


def _tiny_repo(path: Path, with_bin: bool = True, with_original: bool = True) -> None:
    """assets/tiny_llama, plus a .bin copy of its weights and Meta-style original/ files."""
    shutil.copytree(TINY, path)
    if with_bin:
        index = json.loads((TINY / "model.safetensors.index.json").read_text())
        names = {f: f.replace("model", "pytorch_model", 1).replace(".safetensors", ".bin") for f in set(index["weight_map"].values())}
        for st, bin_name in names.items():
            torch.save(load_file(TINY / st), path / bin_name)
        index["weight_map"] = {k: names[f] for k, f in index["weight_map"].items()}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    if with_original:
        (path / "original").mkdir()
        (path / "original/consolidated.00.pth").write_bytes(b"not really a checkpoint")
        (path / "original/params.json").write_text('{"dim": 64}')
        (path / "original/tokenizer.model").write_bytes(b"dummy")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    _tiny_repo(root / "models/org/tiny")
    _tiny_repo(root / "models/org/gated", with_bin=False, with_original=False)
    # its own gated repo for the token test: an earlier test's refused download may still have
    # requests in flight (huggingface_hub's worker threads) for org/gated when that test starts
    _tiny_repo(root / "models/org/gated-cli", with_bin=False, with_original=False)
    (root / "datasets/org/alpaca/data").mkdir(parents=True)
    shutil.copy(ROOT / "assets/tiny_alpaca.jsonl", root / "datasets/org/alpaca/data/tiny_alpaca.jsonl")
    (root / "datasets/org/alpaca/README.md").write_text("# tiny alpaca\n")
    (root / "datasets/org/multi").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        shutil.copy(ROOT / "assets/tiny_alpaca.jsonl", root / "datasets/org/multi" / name)
    with HubServer(root, gated={"org/gated": TOKEN, "org/gated-cli": TOKEN}) as server:
        yield server


@pytest.fixture
def clean_env(monkeypatch, hub):
    """No token, offline switch or cache location from the machine leaks into in-process calls."""
    for var in HF_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    hub.clear()
    return hub


def sub_env(hub: HubServer, hf_home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), **extra)
    return env


def run(args: list[str], env: dict, timeout: int = 120) -> Finished:
    """``python SCRIPT ARGS`` in exactly the environment ``env``, in a process forked for it (``tests/launch.py``): the
    hub client, imported there, reads that environment."""
    unset = {k: None for k in os.environ if k not in env}
    return run_recipe(str(ROOT / args[0]), args[1:], env={**unset, **env}, cwd=ROOT, timeout=timeout)


def fetched(hub: HubServer) -> set[str]:
    return {r.file for r in hub.downloads()}


def touched(hub: HubServer) -> set[str]:
    """Every repository file the client asked about (HEAD or GET)."""
    return {r.file for r in hub.requests() if r.file is not None}


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]


# -- file choice --------------------------------------------------------------------------
def test_default_patterns_choose_one_copy_of_the_weights():
    both = ["config.json", "model.safetensors", "pytorch_model.bin", "original/consolidated.00.pth", "original/params.json"]
    _, ignore, root = default_patterns(both)
    assert "*.bin" in ignore and "original/*" in ignore and "*.safetensors" not in ignore and root == ""
    _, ignore, _ = default_patterns(both, weights="bin")
    assert "*.safetensors" in ignore and "*.bin" not in ignore
    _, ignore, _ = default_patterns(["config.json", "pytorch_model.bin"])
    assert "*.bin" not in ignore
    assert default_patterns(both, fmt="meta") == (["original/consolidated.*.pth", "original/params.json",
                                                    "original/tokenizer.model"], None, "original")
    assert default_patterns(["consolidated.00.pth", "params.json"], fmt="meta")[2] == ""
    with pytest.raises(HubError, match="no Meta-format checkpoint"):
        default_patterns(["config.json", "model.safetensors"], fmt="meta")
    with pytest.raises(HubError, match="no bin weights"):
        default_patterns(["config.json", "model.safetensors"], weights="bin")
    assert parse_hf_uri("hf://datasets/org/d@v1/data/x.json") == hubmod.HfUri("org/d", "dataset", "v1", "data/x.json")
    assert parse_hf_uri("hf://org/m@0123abcd") == hubmod.HfUri("org/m", "model", "0123abcd", None)
    for bad in ("hf://org", "hf://datasets/org", "hf://org/m@", "/data/x"):
        with pytest.raises(HubError):
            parse_hf_uri(bad)


def test_download_with_default_patterns_fetches_only_safetensors(clean_env, tmp_path):
    hub = clean_env
    snap = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    assert fetched(hub) == SAFETENSORS_FILES
    assert not {f for f in touched(hub) if f.endswith(".bin") or f.startswith("original/")}
    assert set(snap.files) == set(snap.fetched) == SAFETENSORS_FILES
    for name in SAFETENSORS_FILES:
        assert (snap.path / name).read_bytes() == (TINY / name).read_bytes()
    sha = hub.repo("models", "org/tiny").sha
    expected = {"repo_id": "org/tiny", "repo_type": "model", "revision": sha, "requested_revision": "main"}
    assert read_source(snap.path) == expected == read_source(snap.path / "config.json")
    assert snap.path == tmp_path / "cache/models--org--tiny/snapshots" / sha

    hub.clear()  # the same again: one request to resolve "main", nothing fetched
    again = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    assert again.path == snap.path and again.fetched == () and [r.path for r in hub.requests()] == ["/api/models/org/tiny"]

    hub.clear()  # the other copy of the weights, on request
    bins = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False, weights="bin")
    assert {f for f in fetched(hub) if "model" in f} == {"pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin",
                                                          "pytorch_model-00003-of-00003.bin", "pytorch_model.bin.index.json"}
    assert read_source(bins.path)["revision"] == sha


def test_custom_patterns_and_meta_format(clean_env, tmp_path):
    hub = clean_env
    snap = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False, allow_patterns=["*.json"],
                    ignore_patterns=["original/*"])
    assert fetched(hub) == {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                            "tokenizer_config.json", "pytorch_model.bin.index.json"}

    hub.clear()
    meta = download("org/tiny", local_dir=tmp_path / "meta", endpoint=hub.url, token=False, fmt="meta")
    assert fetched(hub) == {"original/consolidated.00.pth", "original/params.json", "original/tokenizer.model"}
    assert meta.path == (tmp_path / "meta/original").absolute()
    assert (meta.path / "consolidated.00.pth").read_bytes() == b"not really a checkpoint"
    assert read_source(meta.path)["revision"] == read_source(snap.path)["revision"]
    assert (tmp_path / "meta" / hubmod.SOURCE_FILE).is_file()


def test_interrupted_download_resumes_with_a_range_request(clean_env, tmp_path, monkeypatch):
    """The server drops the connection half-way through a file, once: the client asks for the rest.

    The client writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and resumes from
    the last whole chunk; with the tiny files here the chunk is made 64 KiB, as if the file were large."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub = clean_env
    name = "model-00002-of-00003.safetensors"
    size = (TINY / name).stat().st_size
    hub.cut_once.add(("org/tiny", name))
    snap = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    gets = [r for r in hub.downloads() if r.file == name]
    assert [(r.range, r.status) for r in gets] == [(None, 200), (f"bytes={gets[1].range[6:-1]}-", 206)], gets
    kept = int(gets[1].range[6:-1])  # what the client had written when the connection dropped
    assert 0 < kept <= size // 2 and gets[0].body_bytes == size // 2 and gets[1].body_bytes == size - kept
    assert (snap.path / name).read_bytes() == (TINY / name).read_bytes()
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


# -- hf:// in a config, the recipe end to end ---------------------------------------------
def test_parse_config_resolves_every_hf_value(clean_env, tmp_path, monkeypatch):
    from waypoint.cli.config import parse_config

    hub = clean_env
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cfg = parse_config(["--config", str(ROOT / "configs/tiny.yaml"), "checkpointer.checkpoint_dir=hf://org/tiny",
                        "dataset.source=hf://datasets/org/alpaca"])
    values = []

    def walk(node):
        for v in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else []):
            values.append(v) if isinstance(v, str) else walk(v)

    from omegaconf import OmegaConf

    walk(OmegaConf.to_container(cfg))
    snapshot = str(tmp_path / "hf/hub/models--org--tiny/snapshots" / hub.repo("models", "org/tiny").sha)
    assert not [v for v in values if v.startswith("hf://")]
    assert cfg.checkpointer.checkpoint_dir == snapshot
    assert values.count(snapshot) >= 3, values  # the checkpointer, the model and the tokenizer follow the interpolation
    assert cfg.dataset.source.endswith("/snapshots/" + hub.repo("datasets", "org/alpaca").sha + "/data/tiny_alpaca.jsonl")
    assert fetched(hub) == SAFETENSORS_FILES | {"data/tiny_alpaca.jsonl"}


@pytest.mark.slow
def test_hf_uri_config_downloads_fine_tunes_and_then_serves_from_the_cache(hub, tmp_path):
    hub.clear()
    env = sub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN)
    args = [str(ROOT / "recipes/full_finetune.py"), "--config", str(ROOT / "configs/tiny.yaml"),
            "checkpointer.checkpoint_dir=hf://org/tiny", "dataset.source=hf://datasets/org/alpaca/data/tiny_alpaca.jsonl",
            "epochs=1", "max_steps_per_epoch=3"]
    first = run([*args, f"output_dir={tmp_path / 'run1'}"], env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "run1/step_3/model-00002-of-00003.safetensors").is_file()
    assert fetched(hub) == SAFETENSORS_FILES | {"data/tiny_alpaca.jsonl"}
    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests())  # the token is used ...

    hub.clear()
    second = run([*args, f"output_dir={tmp_path / 'run2'}"], env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (tmp_path / "run2/step_3").is_dir()
    assert hub.downloads() == [] and not [r for r in hub.requests() if r.file]  # nothing fetched, not even a HEAD
    assert sorted(r.path for r in hub.requests()) == ["/api/datasets/org/alpaca", "/api/models/org/tiny"]

    # ... and never written anywhere: output, logs, checkpoints, the cache and the recorded source
    for result in (first, second):
        assert TOKEN not in result.stdout + result.stderr
    for path in [*(tmp_path / "run1").rglob("*"), *(tmp_path / "run2").rglob("*"), *(tmp_path / "hf").rglob("*")]:
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    assert (tmp_path / "run1/metrics.jsonl").is_file()


# -- errors -------------------------------------------------------------------------------
def one_line_error(**kwargs) -> str:
    with pytest.raises(HubError) as info:
        download(**kwargs) if "repo_id" in kwargs else resolve_hf_uri(**kwargs)
    message = str(info.value)
    assert "\n" not in message and TOKEN not in message, message
    return message


def test_gated_missing_repository_revision_and_file_errors_are_one_line(clean_env, tmp_path):
    hub = clean_env
    common = dict(cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    message = one_line_error(repo_id="org/gated", **common)
    assert "org/gated is a gated repository" in message and f"{hub.url}/org/gated" in message and "HF_TOKEN" in message
    message = one_line_error(repo_id="org/gated", **{**common, "token": "hf_someoneElsesToken123"})
    assert "the token in use lacks access to it" in message and f"{hub.url}/org/gated" in message and "hf_someoneElsesToken123" not in message
    assert download("org/gated", **{**common, "token": TOKEN}).files  # the right token opens it

    assert one_line_error(repo_id="org/nope", **common) == f"repository org/nope not found on {hub.url}"
    hub.missing_status = 401  # what the real hub answers anonymous users: missing, private or gated alike
    try:
        message = one_line_error(repo_id="org/nope", **common)
    finally:
        hub.missing_status = 404
    assert "org/nope not found" in message and "gated" in message and f"{hub.url}/org/nope" in message
    assert one_line_error(repo_id="org/tiny", revision="v9", **common) == f"revision 'v9' not found in org/tiny on {hub.url}"
    message = one_line_error(uri="hf://datasets/org/alpaca/data/nope.jsonl", **common)
    assert message.startswith("file or folder data/nope.jsonl not found in dataset org/alpaca"), message
    message = one_line_error(uri="hf://datasets/org/multi", **common)
    assert "2 data files (a.jsonl, b.jsonl)" in message
    assert hub.downloads() == [r for r in hub.downloads() if r.path.startswith("/org/gated/")]


def test_patterns_that_match_no_file_are_one_line(clean_env, tmp_path):
    """--allow-patterns / --ignore-patterns that leave nothing to fetch say so, and fetch nothing."""
    hub = clean_env
    common = dict(cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    assert re.fullmatch(r"no file of org/tiny \(commit \w+\) matches allow_patterns=\['\*\.gguf'\] ignore_patterns=None",
                        one_line_error(repo_id="org/tiny", allow_patterns=["*.gguf"], **common))
    assert "ignore_patterns=['*']" in one_line_error(repo_id="org/tiny", ignore_patterns=["*"], **common)
    assert hub.downloads() == []


def test_no_network_and_not_enough_disk(clean_env, tmp_path, monkeypatch):
    hub = clean_env
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    message = one_line_error(repo_id="org/tiny", cache_dir=tmp_path / "cache", endpoint=closed, token=False)
    assert message.startswith(f"cannot reach the Hugging Face hub at {closed}") and "HF_HUB_OFFLINE=1" in message

    with monkeypatch.context() as m:
        m.setattr(hubmod, "free_disk_bytes", lambda path: 1000)
        message = one_line_error(repo_id="org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    assert message.startswith("not enough free disk space for org/tiny") and "need 3.51 MB" in message and "1.00 kB free" in message
    assert hub.downloads() == [] and not list((tmp_path / "cache").rglob("blobs/*"))

    snap = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    cached = download("org/tiny", cache_dir=tmp_path / "cache", endpoint=closed, token=False)  # network gone: the cache serves
    assert cached.path == snap.path and cached.fetched == ()


def test_recipe_config_error_is_one_line(clean_env, tmp_path, monkeypatch, capsys):
    from waypoint.cli.config import parse_config

    monkeypatch.setenv("HF_ENDPOINT", clean_env.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(hubmod, "_stored_token", lambda: False)
    with pytest.raises(SystemExit) as info:
        parse_config(["--config", str(ROOT / "configs/tiny.yaml"), "checkpointer.checkpoint_dir=hf://org/gated"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert error_line(err).startswith("error: org/gated is a gated repository and no token is set (HF_TOKEN, or `hf auth login`): "
                                      "accept its licence at")


# -- the command line: token, offline ------------------------------------------------------
def test_cli_token_is_used_and_never_printed_or_recorded(hub, tmp_path):
    hub.clear()
    out = tmp_path / "gated"
    ok = run(["scripts/download.py", "org/gated-cli", "--output-dir", str(out)], sub_env(hub, tmp_path / "hf", HF_TOKEN=TOKEN))
    assert ok.returncode == 0, ok.stderr[-2000:]
    gated = [r for r in hub.requests() if "/org/gated-cli" in r.path]  # (not a straggler of an earlier test's client)
    assert gated and all(r.authorization == f"Bearer {TOKEN}" for r in gated), [r for r in gated if r.authorization != f"Bearer {TOKEN}"]
    assert f"next: python recipes/full_finetune.py --config configs/YOUR_CONFIG.yaml checkpointer.checkpoint_dir={out}" in ok.stdout
    assert json.loads((out / "waypoint_source.json").read_text())["repo_id"] == "org/gated-cli"
    for path in [*out.rglob("*"), *(tmp_path / "hf").rglob("*")]:
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path

    wrong = "hf_notTheRightOne0123456789"
    bad = run(["scripts/download.py", "org/gated-cli", "--hf-token", wrong], sub_env(hub, tmp_path / "hf"))
    assert bad.returncode == 1 and "lacks access" in error_line(bad.stderr) and f"{hub.url}/org/gated-cli" in bad.stderr
    typo = run(["scripts/download.py", "org/gated-cli", "--hf-tokn", TOKEN], sub_env(hub, tmp_path / "hf"))
    assert typo.returncode == 2 and "unrecognized arguments" in typo.stderr
    for result in (ok, bad, typo):
        assert TOKEN not in result.stdout + result.stderr and wrong not in result.stdout + result.stderr


def test_offline_serves_the_cache_without_a_request(clean_env, tmp_path):
    hub = clean_env
    snap = download("org/tiny", cache_dir=tmp_path / "hf/hub", endpoint=hub.url, token=False)
    hub.clear()
    env = sub_env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")
    offline = run(["scripts/download.py", "hf://org/tiny"], env)
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert f"files: {snap.path}\n" in offline.stdout and "nothing to fetch" in offline.stdout
    missing = run(["scripts/download.py", "org/other"], env)
    assert missing.returncode == 1
    assert error_line(missing.stderr).startswith("error: HF_HUB_OFFLINE=1 is set and org/other is not in the cache")
    assert hub.requests() == []


def test_cli_dataset_repository_and_next_command(clean_env, tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("waypoint_download_script", ROOT / "scripts/download.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("HF_ENDPOINT", clean_env.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert script.main(["org/alpaca", "--repo-type", "dataset"]) == 0
    out = capsys.readouterr().out
    snapshot = tmp_path / "hf/hub/datasets--org--alpaca/snapshots" / clean_env.repo("datasets", "org/alpaca").sha
    assert f"dataset.source={snapshot}/data/tiny_alpaca.jsonl" in out
    assert fetched(clean_env) == {"README.md", "data/tiny_alpaca.jsonl"}  # a dataset comes whole unless patterns say otherwise
    assert read_source(snapshot / "data/tiny_alpaca.jsonl")["repo_type"] == "dataset"


@pytest.mark.slow
def test_hf_uri_under_torchrun_downloads_each_file_once(hub, tmp_path):
    """Two ranks resolve hf:// at the same time; the hub cache's locks let one download and the other reuse it."""
    hub.clear()
    env = {**{k: None for k in HF_VARS}, **sub_env(hub, tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "checkpointer.checkpoint_dir=hf://org/tiny",
            "dataset.source=hf://datasets/org/alpaca/data/tiny_alpaca.jsonl", "epochs=1", "max_steps_per_epoch=2",
            "batch_size=4", f"output_dir={tmp_path / 'run'}"]
    result = run_recipe("full", args, processes=2, env=env)  # ranks forked as torchrun starts them (tests/launch.py)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run/step_2/model-00002-of-00003.safetensors").is_file()
    gets = [r.file for r in hub.downloads()]
    assert sorted(gets) == sorted(SAFETENSORS_FILES | {"data/tiny_alpaca.jsonl"}), gets
