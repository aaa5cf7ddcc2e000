"""Bad input to scripts/inspect.py and scripts/convert.py (and the other scripts' output options): exactly one
stderr line, ``error: ...``, naming the file, URL or option and what to do, a non-zero exit, and nothing written (no
folder named ``s3:`` either). A new check of a script gets its row in CASES. Below the table: a recipe's outputs
that no store takes, and its store (output_dir or input) out of reach.

Rows whose input lies in an object store use moto's S3 server on 127.0.0.1 (``tests/s3_server.py``), started once
for the module and only when such a row runs."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from scripts import convert, download, inspect as inspect_script, make_tiny, make_tiny_vlm, merge_lora, plot_metrics
from tests.conftest import ROOT
from tests.s3_server import free_port

TINY = ROOT / "assets/tiny_llama"
SHARD = "model-00001-of-00003.safetensors"
UNREADABLE = rf"in/{re.escape(SHARD)}: unreadable safetensors header \(Error while deserializing header: "
NOT_READ = rf"in/{re.escape(SHARD)}: unreadable weight file \(Error while deserializing header: "
NO_CREDENTIALS = (r"no usable credentials \(Unable to locate credentials; NoCredentialsError\); set AWS_ACCESS_KEY_ID and "
                  r"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile of ~/\.aws/credentials$")
NO_PROFILE = (r"no usable credentials \(AWS profile 'no-such-profile' not found; ProfileNotFound\); set AWS_PROFILE to a "
              r"profile of ~/\.aws/config or ~/\.aws/credentials, or unset it$")
NO_ENDPOINT = (r"cannot connect to http://127\.0\.0\.1:\d+ \(EndpointConnectionError\); set AWS_ENDPOINT_URL to the "
               r"store's endpoint \(unset for AWS S3\) and check that it is reachable$")
A_URL = r"this command writes a local directory, not a URL; give a local path \(and copy the result to the store afterwards\)$"


def garbage(path):
    path.write_bytes(b"not a safetensors file\n" * 40)


def truncated(path):
    path.write_bytes(path.read_bytes()[:-100])


def pickled(path):  # a PyTorch pickle under a .safetensors name
    torch.save({"w": torch.zeros(4)}, path)


NO_ACCESS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
             "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE")


def cut_off_from_the_store(request, monkeypatch, tmp_path, how: str) -> None:
    """For this test: a machine with no AWS credentials (``how="credentials"``), with credentials and an endpoint
    that is a closed port on 127.0.0.1, tried once (``"endpoint"``), or with AWS_PROFILE naming no profile (``"profile"``). s3fs keeps a client per set of options, made
    with the environment of its time: none is kept across the change, either way."""
    S3FileSystem = pytest.importorskip("s3fs").S3FileSystem
    for key in NO_ACCESS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {"AWS_SHARED_CREDENTIALS_FILE": tmp_path / "no-credentials", "AWS_CONFIG_FILE": tmp_path / "no-config",
                       "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(key, str(value))
    if how == "endpoint":
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}.items():
            monkeypatch.setenv(key, value)
    if how == "profile":  # a profile that none of the (empty) AWS files holds, keys or not
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_PROFILE": "no-such-profile"}.items():
            monkeypatch.setenv(key, value)
    S3FileSystem.clear_instance_cache()
    request.addfinalizer(S3FileSystem.clear_instance_cache)


class Setup:
    """What a row's setup may use: ``tmp_path`` (the working directory), a damaged copy of the tiny checkpoint
    on disk or in a store, and a machine cut off from the store."""

    def __init__(self, tmp_path, request, monkeypatch):
        self.tmp, self.request, self.monkeypatch = tmp_path, request, monkeypatch

    def local(self, damage) -> str:
        shutil.copytree(TINY, self.tmp / "in")
        damage(self.tmp / "in" / SHARD)
        return str(self.tmp / "in")

    def stored(self, damage) -> str:
        """The damaged copy uploaded to a new bucket: its URL."""
        from tests.s3_server import new_bucket
        from waypoint.run.object_store import ObjectStore

        self.request.getfixturevalue("endpoint")
        store = ObjectStore(f"s3://{new_bucket()}/in")
        for path in sorted(TINY.iterdir()):
            store.fs.put_file(str(path), store.path(path.name))
        damaged = self.tmp / "damaged"
        shutil.copy(TINY / SHARD, damaged)
        damage(damaged)
        store.fs.put_file(str(damaged), store.path(SHARD))
        damaged.unlink()
        return store.url

    def no_bucket(self) -> str:
        self.request.getfixturevalue("endpoint")
        return "s3://no-such-bucket/in"

    def cut_off(self, how: str) -> str:
        """A URL of a store this machine cannot use: no credentials, or its endpoint a closed port."""
        cut_off_from_the_store(self.request, self.monkeypatch, self.tmp, how)
        return "s3://bucket/in"

    def occupied(self) -> str:
        (self.tmp / "out").mkdir()
        (self.tmp / "out" / "keep.txt").write_text("mine")
        return "out"


SCRIPTS = {"inspect": inspect_script, "convert": convert, "merge_lora": merge_lora, "download": download,
           "plot_metrics": plot_metrics, "make_tiny_vlm": make_tiny_vlm, "make_tiny": make_tiny}

# (case id, setup -> argv (the script's name first), the one error line's expected regex)
CASES = [
    ("inspect_garbage_shard", lambda s: ["inspect", s.local(garbage)], UNREADABLE + "header too large"),
    ("inspect_truncated_shard", lambda s: ["inspect", s.local(truncated)], UNREADABLE + "incomplete metadata"),
    ("inspect_pickle_as_safetensors", lambda s: ["inspect", s.local(pickled)], UNREADABLE),
    ("inspect_not_a_checkpoint", lambda s: ["inspect", str(TINY / SHARD)], r"\.safetensors: not a recognised checkpoint directory"),
    ("inspect_missing", lambda s: ["inspect", str(s.tmp / "nowhere")], r"nowhere: not a recognised checkpoint directory"),
    ("inspect_garbage_shard_in_store", lambda s: ["inspect", s.stored(garbage)],
     rf"inputs/s3/wp-\w+/{UNREADABLE}header too large"),
    ("inspect_truncated_shard_in_store", lambda s: ["inspect", s.stored(truncated)], rf"inputs/s3/wp-\w+/{UNREADABLE}"),
    ("inspect_missing_bucket", lambda s: ["inspect", s.no_bucket()],
     r"s3://no-such-bucket/in: could not read it: .*; check the bucket, the credentials and AWS_ENDPOINT_URL"),
    ("inspect_store_without_credentials", lambda s: ["inspect", s.cut_off("credentials")],
     rf"s3://bucket/in: could not read it: {NO_CREDENTIALS}"),
    ("inspect_store_unreachable", lambda s: ["inspect", s.cut_off("endpoint")], rf"s3://bucket/in: could not read it: {NO_ENDPOINT}"),
    ("inspect_store_with_a_missing_profile", lambda s: ["inspect", s.cut_off("profile")],
     rf"s3://bucket/in: could not read it: {NO_PROFILE}"),
    ("convert_garbage_shard", lambda s: ["convert", s.local(garbage), "out", "--to", "native"], NOT_READ + "header too large"),
    ("convert_truncated_shard", lambda s: ["convert", s.local(truncated), "out", "--to", "native"], NOT_READ + "incomplete"),
    ("convert_pickle_as_safetensors", lambda s: ["convert", s.local(pickled), "out", "--to", "hf"], NOT_READ),
    ("convert_truncated_shard_in_store", lambda s: ["convert", s.stored(truncated), "out", "--to", "meta"],
     rf"inputs/s3/wp-\w+/{NOT_READ}"),
    ("convert_store_without_credentials", lambda s: ["convert", s.cut_off("credentials"), "out", "--to", "native"],
     rf"s3://bucket/in: could not read it: {NO_CREDENTIALS}"),
    ("convert_store_unreachable", lambda s: ["convert", s.cut_off("endpoint"), "out", "--to", "native"],
     rf"s3://bucket/in: could not read it: {NO_ENDPOINT}"),
    ("convert_to_s3", lambda s: ["convert", str(TINY), "s3://bucket/path", "--to", "native"], rf"OUT_DIR s3://bucket/path: {A_URL}"),
    ("convert_to_S3", lambda s: ["convert", str(TINY), "S3://bucket/path", "--to", "hf"], rf"OUT_DIR S3://bucket/path: {A_URL}"),
    ("convert_to_gs", lambda s: ["convert", str(TINY), "gs://bucket/path", "--to", "hf"], rf"OUT_DIR gs://bucket/path: {A_URL}"),
    ("convert_to_memory", lambda s: ["convert", str(TINY), "memory://path", "--to", "meta"], rf"OUT_DIR memory://path: {A_URL}"),
    ("convert_to_file_url", lambda s: ["convert", str(TINY), f"file://{s.tmp}/out", "--to", "hf"],
     r"OUT_DIR file://\S+/out: a file:// URL; give the path itself \(/\S+/out\)$"),
    ("convert_missing_input", lambda s: ["convert", str(s.tmp / "nowhere"), "out", "--to", "hf"],
     r"nowhere: not a recognised checkpoint directory"),
    ("convert_wrong_from", lambda s: ["convert", str(TINY), "out", "--to", "hf", "--from", "meta"],
     r"--from meta: \S+tiny_llama holds a hf checkpoint$"),
    ("convert_output_inside_input", lambda s: ["convert", s.local(lambda p: None), "in/out", "--to", "hf"],
     r"the output in/out lies inside the input \S+/in, which this command reads; choose an output outside it$"),
    ("convert_non_empty_output", lambda s: ["convert", str(TINY), s.occupied(), "--to", "hf"],
     r"out: not empty; choose another directory or pass --overwrite$"),
    ("merge_lora_to_s3", lambda s: ["merge_lora", str(TINY), str(TINY), "s3://bucket/merged"], rf"OUT_DIR s3://bucket/merged: {A_URL}"),
    ("download_to_S3", lambda s: ["download", "org/name", "--output-dir", "S3://bucket/x"], rf"--output-dir S3://bucket/x: {A_URL}"),
    ("convert_to_unknown_format", lambda s: ["convert", str(TINY), "out", "--to", "gguf"],
     r"argument --to: invalid choice: 'gguf' \(choose from 'hf', 'meta', 'native'\)"),
    ("convert_unknown_model_type", lambda s: ["convert", str(TINY), "out", "--to", "hf", "--model-type", "LLAMA9"],
     r"argument --model-type: unknown model_type 'LLAMA9'; known: LLAMA2, "),
    ("convert_no_shards", lambda s: ["convert", str(TINY), "out", "--to", "hf", "--num-shards", "0"],
     r"argument --num-shards: '0': expected a number of files >= 1"),  # kept the input's 3 files before
    ("convert_negative_shards", lambda s: ["convert", str(TINY), "out", "--to", "meta", "--num-shards", "-2"],
     r"argument --num-shards: '-2': expected a number of files >= 1"),  # wrote 1 file before
    ("download_unknown_format", lambda s: ["download", "org/name", "--format", "gguf"], r"argument --format: invalid choice: 'gguf'"),
    ("download_unknown_weights", lambda s: ["download", "org/name", "--weights", "pt"], r"argument --weights: invalid choice: 'pt'"),
    ("download_unknown_repo_type", lambda s: ["download", "org/name", "--repo-type", "space"],
     r"argument --repo-type: invalid choice: 'space'"),
    ("merge_lora_missing_adapter", lambda s: ["merge_lora", str(TINY), str(s.tmp / "nowhere"), "merged"],
     r"nowhere/adapter_config\.json: missing"),
    ("plot_metrics_not_a_run", lambda s: ["plot_metrics", str(s.tmp / "nowhere")],
     r"nowhere/metrics\.jsonl: no such file \(is \S+/nowhere a training run's output_dir\?\)$"),
    ("plot_metrics_several_runs_without_out", lambda s: ["plot_metrics", "a", "b"], r"several runs: name the PNG with --out"),
    ("plot_metrics_out_not_a_run", lambda s: ["plot_metrics", str(s.tmp / "nowhere"), "--out", "m.png"],
     r"nowhere/metrics\.jsonl: no such file"),
    ("plot_metrics_smoothing_of_one", lambda s: ["plot_metrics", str(s.tmp / "nowhere"), "--smooth", "1"],
     r"argument --smooth: 1: must be at least 0 and below 1"),
    ("make_tiny_vlm_into_a_folder_with_files", lambda s: ["make_tiny_vlm", str(TINY)],
     r"tiny_llama: not empty; name a new or empty folder \(see "),
    ("make_tiny_vlm_seed_not_a_number", lambda s: ["make_tiny_vlm", "out", "--seed", "x"], r"argument --seed: invalid int value: 'x'"),
    ("make_tiny_unknown_kind", lambda s: ["make_tiny", "qwen35", "out"],
     r"argument KIND: unknown kind 'qwen35'; did you mean qwen3_5, qwen3, qwen3_5_vl\? \(--list names them all\)"),
    ("make_tiny_without_a_folder", lambda s: ["make_tiny", "llama"], r"name a KIND and an OUT folder \(--list names the kinds\)"),
    ("make_tiny_into_a_folder_with_files", lambda s: ["make_tiny", "llama", str(TINY)], r"tiny_llama: not empty; name a new or empty folder"),
    ("make_tiny_seed_not_a_number", lambda s: ["make_tiny", "llama", "out", "--seed", "x"], r"argument --seed: invalid int value: 'x'"),
    ("convert_bad_shard_size", lambda s: ["convert", str(TINY), "out", "--to", "hf", "--max-shard-size", "0"],
     r"argument --max-shard-size: invalid size value: '0' \(see "),
]


@pytest.fixture(scope="module")
def endpoint():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3fs import S3FileSystem

    from tests.s3_server import s3_server

    S3FileSystem.clear_instance_cache()  # no client of another module's server (s3fs keeps one per set of options)
    with s3_server() as url:
        yield url
    S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("setup,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_writes_nothing(setup, expected, tmp_path, request, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "cache"))
    argv = setup(Setup(tmp_path, request, monkeypatch))
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()
    script = SCRIPTS[argv[0]]
    try:
        code = script.main(argv[1:])
    except SystemExit as usage:  # argparse: a malformed command line
        code = usage.code
    err = capsys.readouterr().err
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert code and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert re.search(expected, errors[0]), errors[0]
    assert sorted(p for p in os.listdir(tmp_path) if p != "cache") == [p for p in before if p != "cache"], "something was written"


@pytest.mark.parametrize("how", ["credentials", "endpoint", "profile"])
@pytest.mark.parametrize("key", ["output_dir", "checkpointer.checkpoint_dir"])
def test_no_credentials_or_no_endpoint_is_one_line_naming_the_url(key, how, request, tmp_path, monkeypatch, capsys):
    """A run whose output_dir or input is in a store this machine cannot use: no botocore traceback."""
    from recipes.full_finetune import main

    cut_off_from_the_store(request, monkeypatch, tmp_path, how)
    monkeypatch.setenv("WAYPOINT_CACHE", str(tmp_path / "cache"))
    given = {"output_dir": tmp_path / "out", "checkpointer.checkpoint_dir": ROOT / "assets/tiny_llama", key: "s3://bucket/run"}
    assert main(["--config", str(ROOT / "configs/tiny.yaml"), f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}",
                 *(f"{k}={v}" for k, v in given.items())]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    doing = "take the run's lock object" if key == "output_dir" else "read it"
    problem = {"credentials": NO_CREDENTIALS, "endpoint": NO_ENDPOINT, "profile": NO_PROFILE}[how]
    assert len(errors) == 1 and re.match(rf"error: s3://bucket/run: could not {doing}: {problem}", errors[0]), errors
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override,expected", [
    ("output_dir=file://{tmp}/out", "output_dir=file://{tmp}/out: expected a local path without file:// (or an object-store URL"),
    ("output_dir=HF://org/name", "output_dir=HF://org/name: expected a local directory or an object-store URL such as s3://"),
    ("log_dir=S3://bucket/tb", "log_dir=S3://bucket/tb: expected null or a local directory for TensorBoard event files, not a URL")],
    ids=["file_url", "hub", "log_dir"])
def test_a_run_output_that_no_store_takes_is_refused_in_one_line(override, expected, tmp_path, monkeypatch, capsys):
    """Never a local folder named after a scheme (``file:``, ``S3:``)."""
    from recipes.full_finetune import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(ROOT / "configs/tiny.yaml"), override.format(tmp=tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1 and len(err) == 1 and err[0].startswith(f"error: {expected.format(tmp=tmp_path)}"), err
    assert not os.listdir(tmp_path)
