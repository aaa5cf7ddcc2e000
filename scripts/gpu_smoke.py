"""Every recipe on a GPU, on tiny checkpoints: one line a case, in a few minutes.

    python scripts/gpu_smoke.py [--device cuda] [--only lora,dpo-lora] [--workdir DIR] [--jobs 4] [--list]

Each case is the real command a user types (``python recipes/lora_finetune.py --config configs/tiny_lora.yaml
device=cuda ...``, ``torchrun --nproc_per_node 1 ...``), run in its own process for a few steps, down to its final
save: the checkpoint, ``merged/`` and the export check are where device bugs live (every LoRA-family recipe once
trained on an H200 and died at its first save). Cases: full fine-tuning (fp32, bf16, asynchronous saves), chat,
LoRA (fp32, bf16, asynchronous saves with every step merged), QLoRA (NF4), DPO (full, LoRA, QLoRA), generation and
lm-eval over what they wrote, torchrun FSDP2 on one GPU (full and LoRA), and the mixture-of-experts and quantized
families (Qwen3-MoE, DeepSeek-V3 with LoRA on its latent attention, gpt-oss in MXFP4 with LoRA on its experts kept packed, a block-FP8
Qwen3 kept in FP8), whose tiny checkpoints are written by transformers' own classes (``tests/conftest.py``).

Prints ``PASS``, ``FAIL`` or ``SKIP`` (what is missing, e.g. lm-eval or transformers) with the case, its seconds and,
for a failure, the error's line; each case's whole output is in ``DIR/logs/CASE.log``. Exit status 1 if a case
failed. ``--device cpu`` runs the same cases here (what CI cannot do on a GPU, it can do on the CPU: tests call it so).

A GPU machine without this project's dependencies: carry them as wheels (hydra-core, omegaconf,
antlr4-python3-runtime, blake3, torchao, jinja2, safetensors, ...: ``pip download --no-deps`` for that machine's
Python) and install them before the run; the script says which imports are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "safetensors", "hydra", "omegaconf", "blake3", "jinja2", "tokenizers", "tqdm", "fsspec")
SHORT = ["epochs=1", "max_steps_per_epoch=3", "batch_size=4", "lr_scheduler.num_warmup_steps=1"]


@dataclass
class Case:
    """``argv`` after the interpreter (``{out}``, ``{base}``, ``{work}`` and ``{device}`` filled in); ``base``: the
    tiny checkpoint it trains (a family written by transformers, or the shipped tiny Llama); ``after``: the case whose
    output it reads; ``needs``: modules without which it is skipped."""

    name: str
    argv: list[str]
    base: str = "tiny"
    after: str | None = None
    needs: tuple[str, ...] = ()
    torchrun: bool = False
    extra: list[str] = field(default_factory=list)


def recipe(name: str, config: str, *extra: str, short: bool = True) -> list[str]:
    return [f"recipes/{name}.py", "--config", f"configs/{config}.yaml", "device={device}", "output_dir={out}",
            "checkpointer.checkpoint_dir={base}", *(SHORT if short else []), *extra]


FAMILY = ("transformers",)
CASES = [
    Case("full", recipe("full_finetune", "tiny")),
    Case("full-bf16", recipe("full_finetune", "tiny", "dtype=bf16")),
    Case("full-async", recipe("full_finetune", "tiny", "async_checkpoint=true", "save_every_n_steps=1")),
    Case("chat", recipe("full_finetune", "tiny_chat")),
    Case("lora", recipe("lora_finetune", "tiny_lora")),
    Case("lora-bf16", recipe("lora_finetune", "tiny_lora", "dtype=bf16")),
    Case("lora-async", recipe("lora_finetune", "tiny_lora", "async_checkpoint=true", "save_every_n_steps=1",
                              "save_merged=every")),
    Case("qlora-nf4", recipe("lora_finetune", "tiny_qlora"), needs=("torchao",)),
    Case("dpo", recipe("dpo_finetune", "tiny_dpo")),
    Case("dpo-lora", recipe("dpo_finetune", "tiny_dpo_lora")),
    Case("dpo-qlora", recipe("dpo_finetune", "tiny_dpo_qlora"), needs=("torchao",)),
    Case("grpo", recipe("grpo_finetune", "tiny_grpo", "batch_size=2")),
    Case("grpo-lora-beta-bf16", recipe("grpo_finetune", "tiny_grpo_lora", "batch_size=2", "loss.beta=0.04", "dtype=bf16")),
    Case("grpo-qlora", recipe("grpo_finetune", "tiny_grpo_lora", "batch_size=2", "quantize_base=nf4"), needs=("torchao",)),
    Case("torchrun-grpo", recipe("grpo_finetune", "tiny_grpo", "batch_size=2"), torchrun=True),
    Case("generate", ["recipes/generate.py", "--config", "configs/generate.yaml", "device={device}",
                      "checkpoint_dir={work}/full/step_3", "prompt=What is the capital of Peru?", "max_new_tokens=8"],
         after="full"),
    Case("generate-lora-merged", ["recipes/generate.py", "--config", "configs/generate.yaml", "device={device}",
                                  "checkpoint_dir={work}/lora/step_3/merged", "prompt=Hello", "max_new_tokens=8"],
         after="lora"),
    Case("eval", ["recipes/eval.py", "--config", "configs/eval.yaml", "device={device}", "checkpoint_dir={work}/full/step_3",
                  "limit=2", "output={work}/eval/results.json"], after="full", needs=("lm_eval",)),
    Case("torchrun-full", recipe("full_finetune", "tiny"), torchrun=True),
    Case("torchrun-lora", recipe("lora_finetune", "tiny_lora"), torchrun=True),
    Case("qwen3-moe-full", recipe("full_finetune", "tiny"), base="qwen3_moe", needs=FAMILY),
    Case("qwen3-moe-lora", recipe("lora_finetune", "tiny_lora", "lora.targets=[q_proj,v_proj,output_proj]"),
         base="qwen3_moe", needs=FAMILY),
    Case("deepseek-v3-full-bf16", recipe("full_finetune", "tiny", "dtype=bf16"), base="deepseek_v3", needs=FAMILY),
    Case("deepseek-v3-lora", recipe("lora_finetune", "tiny_lora", "lora.targets=[q_a_proj,kv_b_proj,output_proj]"),
         base="deepseek_v3", needs=FAMILY),
    Case("gpt-oss-mxfp4-full", recipe("full_finetune", "tiny"), base="gpt_oss_mxfp4", needs=FAMILY),
    Case("gpt-oss-mxfp4-lora-experts", recipe("lora_finetune", "tiny_lora", "lora.targets=[q_proj,experts_gate_up]",
                                              "+quantize_base=mxfp4", "dtype=bf16"), base="gpt_oss_mxfp4", needs=FAMILY),
    Case("qwen3-fp8-lora", recipe("lora_finetune", "tiny_lora", "lora.targets=[q_proj,v_proj]", "+quantize_base=fp8",
                                  "dtype=bf16"), base="qwen3_fp8", needs=FAMILY),
    # hybrid Gated DeltaNet + gated attention: packed (the state restarts per document), LoRA on DeltaNet's projections
    Case("qwen3.5-full-packed", recipe("full_finetune", "tiny", "packed=true"), base="qwen3_5", needs=FAMILY),
    Case("qwen3.5-lora-bf16", recipe("lora_finetune", "tiny_lora", "lora.targets=[in_proj_qkv,out_proj,q_proj,w2]", "dtype=bf16"),
         base="qwen3_5", needs=FAMILY),
    Case("qwen3.5-moe-lora", recipe("lora_finetune", "tiny_lora", "lora.targets=[in_proj_qkv,in_proj_z,q_proj,v_proj]"),
         base="qwen3_5_moe", needs=FAMILY),
    Case("qwen3.5-grpo-lora", recipe("grpo_finetune", "tiny_grpo_lora", "batch_size=2",
                                     "lora.targets=[in_proj_qkv,out_proj,q_proj,w2]"), base="qwen3_5", needs=FAMILY),
    Case("qwen3-next-full-bf16", recipe("full_finetune", "tiny", "dtype=bf16"), base="qwen3_next", needs=FAMILY),
    # Gemma 4 with every feature: per-layer embeddings, kv-shared layers, keys as values, experts beside the MLP
    Case("gemma4-full-bf16", recipe("full_finetune", "tiny", "dtype=bf16", "enable_activation_checkpointing=true"),
         base="gemma4", needs=FAMILY),
    Case("gemma4-lora-experts", recipe("lora_finetune", "tiny_lora", "lora.targets=[q_proj,v_proj,input_gate,experts_gate_up]",
                                       "lora.dropout=0.0"), base="gemma4", needs=FAMILY),
    Case("gemma4-qlora", recipe("lora_finetune", "tiny_qlora", "lora.targets=[q_proj,k_proj,w1,w2]"), base="gemma4",
         needs=("transformers", "torchao")),
    # vision-language: the tiny Gemma 3 VLM (scripts/make_tiny_vlm.py) on the colour images, the tower frozen
    Case("vlm-full-bf16", recipe("full_finetune", "tiny_vlm", "dtype=bf16"), base="tiny_vlm"),
    Case("vlm-lora", recipe("lora_finetune", "tiny_vlm_lora"), base="tiny_vlm"),
    Case("vlm-qlora", recipe("lora_finetune", "tiny_vlm_lora", "+quantize_base=nf4",
                             "+nf4={{block_size: 64, scaler_block_size: 8, output: false}}"), base="tiny_vlm", needs=("torchao",)),
    Case("vlm-generate-image", ["recipes/generate.py", "--config", "configs/generate.yaml", "device={device}",
                                "checkpoint_dir={work}/vlm-full-bf16/step_3", "image=assets/tiny_vlm/held_out/red.png",
                                "prompt=What colour is this?", "max_new_tokens=8"], base="tiny_vlm", after="vlm-full-bf16"),
    Case("torchrun-vlm", recipe("full_finetune", "tiny_vlm"), base="tiny_vlm", torchrun=True),
]
# the Gemma 4 base: every feature on, its per-layer table at the tiny tokenizer's vocabulary
GEMMA4 = dict(vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
              num_global_key_value_heads=1, hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4,
              top_k_experts=2, moe_intermediate_size=32)


def write_base(kind: str, path: Path) -> Path:
    """A tiny checkpoint of ``kind`` written by transformers (the tests' own writers), with the tiny tokenizer."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import tiny_family_config, write_family_checkpoint, write_fp8_checkpoint, write_mxfp4_checkpoint

    family = {"qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", "gpt_oss_mxfp4": "gpt_oss", "qwen3_fp8": "qwen3",
              "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next", "gemma4": "gemma4"}[kind]
    config = tiny_family_config(family, vocab_size=512, max_position_embeddings=256, **(GEMMA4 if kind == "gemma4" else {}))
    if kind == "gpt_oss_mxfp4":
        write_mxfp4_checkpoint(path, config)
    elif kind == "qwen3_fp8":
        write_fp8_checkpoint(path, config)
    else:
        write_family_checkpoint(path, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets/tiny_llama" / name, path / name)
    return path


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(("error:", "Error", "RuntimeError", "AssertionError", "torch.", "ValueError", "TypeError",
                            "NotImplementedError", "KeyError", "waypoint.")) or "Error:" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def run_case(case: Case, work: Path, device: str, bases: dict[str, Path], timeout: int) -> tuple[str, str, float]:
    skip = missing(case.needs)
    if skip:
        return "SKIP", f"needs {', '.join(skip)}", 0.0
    base = bases.get(case.base)
    if base is None:
        return "SKIP", f"no {case.base} checkpoint (see its log)", 0.0
    fill = dict(out=str(work / case.name), base=str(base), work=str(work), device=device)
    argv = [a.format(**fill) for a in case.argv]
    if case.torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *argv]
    else:
        command = [sys.executable, *argv]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "WAYPOINT_DEBUG": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log, code = log + f"\ntimed out after {timeout} s", -1
    seconds = time.perf_counter() - started
    (work / "logs" / f"{case.name}.log").write_text(" ".join(command) + "\n\n" + log)
    if code != 0:
        return "FAIL", f"exit {code}: {last_error(log)}", seconds
    return "PASS", "", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--only", default=None, help="comma-separated case names (--list shows them)")
    parser.add_argument("--workdir", default=None, help="where the runs write (default: a new temporary directory)")
    parser.add_argument("--jobs", type=int, default=4, help="cases run at once (default 4)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds a case may take (default 240)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for case in CASES:
            print(case.name)
        return 0
    names = [n for n in (args.only or "").split(",") if n]
    unknown = [n for n in names if n not in {c.name for c in CASES}]
    if unknown:
        print(f"error: --only {unknown[0]}: no such case; --list shows them", file=sys.stderr)
        return 2
    absent = missing(NEEDED)
    if absent:
        print(f"error: missing Python packages {', '.join(absent)}: pip install -e . (or carry their wheels)", file=sys.stderr)
        return 2
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: torch {torch.__version__} sees no CUDA device; --device cpu runs the "
              "cases on the CPU", file=sys.stderr)
        return 2
    cases = [c for c in CASES if not names or c.name in names]
    for case in list(cases):  # what a chosen case reads runs first
        if case.after and case.after not in {c.name for c in cases}:
            cases.insert(0, next(c for c in CASES if c.name == case.after))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="waypoint-gpu-smoke-"))
    if work.exists() and any(work.iterdir()):
        print(f"error: --workdir {work}: not empty; name a new or empty directory", file=sys.stderr)
        return 2
    (work / "logs").mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and args.device.startswith("cuda") else args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"gpu smoke: {len(cases)} cases on {device} ({name}), torch {torch.__version__}; logs in {work / 'logs'}", flush=True)

    bases: dict[str, Path] = {"tiny": ROOT / "assets/tiny_llama"}
    if any(c.base == "tiny_vlm" for c in cases):  # written natively (scripts/make_tiny_vlm.py): no transformers needed
        sys.path.insert(0, str(ROOT))
        from scripts.make_tiny_vlm import make

        bases["tiny_vlm"] = make(work / "bases" / "tiny_vlm")
    for kind in sorted({c.base for c in cases} - {"tiny", "tiny_vlm"}):
        if missing(FAMILY):
            break
        try:
            bases[kind] = write_base(kind, work / "bases" / kind)
        except Exception as e:  # a transformers without that family: its cases are skipped, the rest go on
            (work / "logs" / f"base-{kind}.log").write_text(f"{e.__class__.__name__}: {e}")
    results: dict[str, tuple[str, str, float]] = {}
    started = time.perf_counter()

    def one(case: Case) -> None:
        results[case.name] = run_case(case, work, device, bases, args.timeout)
        status, why, seconds = results[case.name]
        print(f"{status}  {case.name:<28} {seconds:6.1f} s" + (f"  {why}" if why else ""), flush=True)

    first = [c for c in cases if c.after is None and not c.torchrun]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, first))
    for case in cases:  # what reads another case's output, and torchrun (it wants the machine to itself), after
        if case not in first:
            if case.after and results.get(case.after, ("FAIL",))[0] != "PASS":
                results[case.name] = ("SKIP", f"{case.after} did not pass", 0.0)
                print(f"SKIP  {case.name:<28} {0.0:6.1f} s  {case.after} did not pass", flush=True)
                continue
            one(case)
    counts = {s: sum(1 for r in results.values() if r[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {time.perf_counter() - started:.0f} s "
          f"on {device} ({name})")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
