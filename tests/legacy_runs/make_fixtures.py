"""Writes the legacy-run fixtures in this directory (tests/legacy_runs/), with the code of the checkout it runs in.

Run from the repository root of a checkout of commit 50ee614 (the code before the ``run/`` redesign), on an
x86-64 CPU with AVX2; 2 CPU cores suffice (under a minute):

    WAYPOINT_CACHE=$(mktemp -d) PYTHONPATH=$PWD python tests/legacy_runs/make_fixtures.py

It writes:

- ``input/``: a micro Llama (vocab 512, hidden 32, 2 layers, 2 heads, 1 key/value head) saved by transformers'
  own ``LlamaForCausalLM.save_pretrained`` in 2 safetensors shards with an index, seed 0, with the tokenizer files
  of ``assets/tiny_llama`` (whose bos/eos/pad ids, 1/2/3, config.json repeats);
- ``data.jsonl``: the first 24 records of ``assets/tiny_alpaca.jsonl``;
- for each run kind (``full``, ``lora``, ``torchrun``, ``s3``): ``<kind>/step_4/``, the checkpoint that kind's
  run wrote after step 4 (the middle of its second epoch), and ``<kind>/expected.json``: the command, the
  sha256 of every weight file of the run's final step (step_6), and every step's loss, grad_norm and lr as
  the run's ``metrics.jsonl`` holds them.

Every recipe runs with the environment ``PINNED`` (recorded in each expected.json, and used again by the test):
float results on a CPU depend on the instruction set the kernels use (measured: the final weights differ in their
last bits between ATen's AVX512 and AVX2 kernels, and between MKL's AVX512 and AVX2 code paths), so the runs
use ATen's AVX2 kernels and MKL's conditional numerical reproducibility mode ``AVX2,STRICT`` on one thread, which
any x86-64 CPU with AVX2 computes alike.

Each run is ONE uninterrupted run of the recipe (every step is kept: keep_last_n_checkpoints=null), started in a
scratch working directory holding ``input/`` and ``data.jsonl`` with relative paths, so that the config each
checkpoint records names ``input`` and ``data.jsonl`` and a test can resume it from any directory laid out the
same way. tests/test_legacy_runs.py resumes each ``step_4`` with the recorded command and checks that the
rest of the run is bit-exactly this one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

WRITER_COMMIT = "50ee614"
FIXTURE_STEP, FINAL_STEP, TOTAL_STEPS = "step_4", "step_6", 6
RECORDS = 24
# 24 records, 4 samples a step (one process x 4, or two x 2), 3 steps an epoch, 2 epochs: saves at steps 2, 3
# (epoch end), 4 and 6; step_4 is the second epoch's first step, with two more to go in it.
COMMON = ["checkpointer.checkpoint_dir=input", "dataset.source=data.jsonl", "epochs=2", "max_steps_per_epoch=3",
          "save_every_n_steps=2", "keep_last_n_checkpoints=null"]
KINDS = {
    "full": dict(recipe="full_finetune", config="configs/tiny.yaml", launcher=None,
                 args=["output_dir=out", *COMMON, "batch_size=4"]),
    "lora": dict(recipe="lora_finetune", config="configs/tiny_lora.yaml", launcher=None,
                 args=["output_dir=out", *COMMON, "batch_size=4"]),
    "torchrun": dict(recipe="full_finetune", config="configs/tiny.yaml",
                     launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                     args=["output_dir=out", *COMMON, "batch_size=2"]),
    "s3": dict(recipe="full_finetune", config="configs/tiny.yaml", launcher=None,
               args=["output_dir={output_dir}", *COMMON, "batch_size=4"]),  # {output_dir}: s3://<bucket>/run
}
# The same numbers on any x86-64 CPU with AVX2 (see the docstring); set before each recipe's process starts.
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_input(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3, dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="150KB")
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
    assert (path / "model.safetensors.index.json").is_file()
    tokenizer = ROOT / "assets/tiny_llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, path / name)
    written = json.loads((path / "config.json").read_text())
    reference = json.loads((tokenizer / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"):
        assert written[key] == reference[key], (key, written[key], reference[key])


def write_data(path: Path) -> None:
    lines = (ROOT / "assets/tiny_alpaca.jsonl").read_text().splitlines(keepends=True)[:RECORDS]
    path.write_text("".join(lines))


def command(kind: str, output_dir: str | None = None) -> list[str]:
    spec = KINDS[kind]
    args = [a.format(output_dir=output_dir) for a in spec["args"]]
    return [sys.executable, *(spec["launcher"] or []), str(ROOT / f"recipes/{spec['recipe']}.py"),
            "--config", str(ROOT / spec["config"]), *args]


def run(kind: str, workdir: Path, env: dict, output_dir: str | None = None) -> str:
    cmd = command(kind, output_dir)
    print(f"[{kind}] cd {workdir} && {' '.join(cmd)}", flush=True)
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env, **PINNED})
    if result.returncode != 0:
        sys.exit(f"[{kind}] exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result.stdout


def weight_files(step: Path, kind: str) -> list[Path]:
    """The files of a final step that hold weights: the model's shards and index; for LoRA the adapter's weights and
    every file of ``merged/`` (the merged model in the input's files, with the input's side files). Not
    recipe_state.pt (its recorded config holds paths and versions) nor the commit protocol's MANIFEST.json
    files (bookkeeping: the hashes of the files checked here, and a format of its own)."""
    if kind == "lora":
        return [step / "adapter_model.safetensors",
                *sorted(p for p in (step / "merged").rglob("*") if p.is_file() and p.name != "MANIFEST.json")]
    return sorted(p for p in step.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))


def metrics(lines: str) -> list[dict]:
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    steps = [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, TOTAL_STEPS + 1)), steps
    return steps


def check_recorded_config(step: Path) -> None:
    """The checkpoint's recorded config names the inputs by the relative paths it was given."""
    import torch

    config = torch.load(step / "recipe_state.pt", map_location="cpu", weights_only=False)["config"]
    assert config["checkpointer"]["checkpoint_dir"] == "input", config["checkpointer"]
    assert config["dataset"]["source"] == "data.jsonl", config["dataset"]


def expected(kind: str, final: Path, metrics_text: str, stdout: str) -> dict:
    import platform

    import torch

    spec = KINDS[kind]
    assert "resuming from" not in stdout
    files = weight_files(final, kind)
    assert files and all(p.is_file() for p in files), files
    return {
        "written_by": f"waypoint commit {WRITER_COMMIT} (before the run/ redesign), tests/legacy_runs/make_fixtures.py",
        "recipe": spec["recipe"],
        "config": spec["config"],
        "launcher": spec["launcher"],
        "env": PINNED,
        "written_with": {"torch": torch.__version__, "machine": platform.machine(),
                         "host_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "args": spec["args"],
        "fixture_step": FIXTURE_STEP,
        "final_step": FINAL_STEP,
        "weights_sha256": {p.relative_to(final).as_posix(): sha256(p) for p in files},
        "metrics": metrics(metrics_text),
    }


def keep(kind: str, step: Path, record: dict) -> None:
    target = HERE / kind
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    shutil.copytree(step, target / FIXTURE_STEP)
    (target / "expected.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"[{kind}] kept {FIXTURE_STEP}: {sorted(p.relative_to(target / FIXTURE_STEP).as_posix() for p in (target / FIXTURE_STEP).rglob('*') if p.is_file())}")


def local_kind(kind: str, scratch: Path, env: dict) -> None:
    workdir = scratch / kind
    workdir.mkdir()
    shutil.copytree(HERE / "input", workdir / "input")
    shutil.copyfile(HERE / "data.jsonl", workdir / "data.jsonl")
    stdout = run(kind, workdir, env)
    out = workdir / "out"
    steps = sorted(p.name for p in out.glob("step_*"))
    assert steps == ["step_2", "step_3", "step_4", "step_6"], steps
    if kind == "torchrun":
        assert (out / FIXTURE_STEP / "sharded").is_dir(), "torchrun's intermediate steps are DCP-sharded"
    check_recorded_config(out / FIXTURE_STEP)
    keep(kind, out / FIXTURE_STEP, expected(kind, out / FINAL_STEP, (out / "metrics.jsonl").read_text(), stdout))


def s3_kind(scratch: Path, env: dict) -> None:
    import boto3

    from tests.s3_server import new_bucket, s3_server

    workdir = scratch / "s3"
    workdir.mkdir()
    shutil.copytree(HERE / "input", workdir / "input")
    shutil.copyfile(HERE / "data.jsonl", workdir / "data.jsonl")
    with s3_server():
        bucket = new_bucket()
        stdout = run("s3", workdir, env, output_dir=f"s3://{bucket}/run")
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run/")
                for o in page.get("Contents", [])]
        print(f"[s3] the store holds {sorted(keys)}")
        assert f"run/{FIXTURE_STEP}/MANIFEST.json" in keys and f"run/{FINAL_STEP}/MANIFEST.json" in keys
        store = scratch / "s3_store"  # the objects of the run's prefix, as the store holds them
        for key in keys:
            target = store / key[len("run/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
    assert not (workdir / "out").exists()
    check_recorded_config(store / FIXTURE_STEP)
    keep("s3", store / FIXTURE_STEP, expected("s3", store / FINAL_STEP, (store / "metrics.jsonl").read_text(), stdout))


def check_imports(env: dict) -> None:
    """The recipes' subprocesses import this checkout's code (not another editable install's)."""
    code = ("import waypoint.checkpointers, waypoint.training.metrics, waypoint.models, recipes.full_finetune; "
            "print(waypoint.checkpointers.__file__, waypoint.training.metrics.__file__, waypoint.models.__file__, "
            "recipes.full_finetune.__file__)")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}).stdout.split()
    assert got and all(Path(f).resolve().is_relative_to(ROOT) for f in got), got


def check_commit() -> None:
    """This checkout is commit 50ee614 with no tracked file changed: the fixtures are that code's output."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if not head.startswith(WRITER_COMMIT) or changed:
        sys.exit(f"run this from a clean checkout of {WRITER_COMMIT} (this is {head[:7]}"
                 f"{', with changes: ' + changed if changed else ''}); fixtures written by other code test nothing")


def main() -> None:
    check_commit()
    scratch = Path(tempfile.mkdtemp(prefix="legacy_runs_"))
    env = {"WAYPOINT_CACHE": str(scratch / "cache")}  # the object-store run's local mirror (and any input copies)
    check_imports(env)
    try:
        for name in ("input",):
            shutil.rmtree(HERE / name, ignore_errors=True)
        write_input(HERE / "input")
        write_data(HERE / "data.jsonl")
        for kind in ("full", "lora", "torchrun"):
            local_kind(kind, scratch, env)
        s3_kind(scratch, env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
