"""DPO training step speed and memory: our preference step against TRL's DPOTrainer, on the same model and pairs.

    python benchmarks/bench_dpo.py [--device cpu|cuda] [--dtype fp32|bf16] [--shape small] [--rounds N] [--steps N]
                                [--pairs-per-step N] [--prompt-len N] [--completion-len N] [--threads N] [--quick]

A random Llama (``LlamaForCausalLM``, seeded) written with ``save_pretrained`` to a temporary directory, and
synthetic pairs: seeded random token ids, each pair a prompt of ``--prompt-len / 2 .. --prompt-len`` tokens and
chosen and rejected completions of ``--completion-len / 2 .. --completion-len`` tokens, each ending with EOS (so
the rows of a batch are padded, and padding is not counted in tokens/s). Every step takes the next batch of
``--pairs-per-step`` pairs (2 x that many rows, chosen then rejected); the bench's pairs are those batches. Rows:

  waypoint (precomputed ref)      the native model from the checkpoint (``checkpointers.load_into``), the recipe's
                                  step (``training.preference_step.preference_forward_backward``, sigmoid loss,
                                  beta 0.1) against a reference table ``reference_pass`` computed before the loop
  TRL (precompute_ref_log_probs)  ``AutoModelForCausalLM.from_pretrained`` of the same checkpoint and
                                  ``trl.DPOTrainer(precompute_ref_log_probs=True)``: its reference pass at
                                  construction; a step is ``trainer.compute_loss`` + ``backward``
  waypoint + ref forward/step     ours with a second native model as reference, its log-probs computed under
                                  ``torch.no_grad`` on each step's batch (``policy_logps``, what reference_pass does)
  TRL (ref model)                 DPOTrainer's default: ``precompute_ref_log_probs=False``, a reference model
                                  (its own copy from the checkpoint) run forward in every ``compute_loss``

TRL sees the pairs as text through its own pipeline: each token id written as a word of a word-level tokenizer
whose vocabulary is the model's (``t<id>``; id 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``), so DPOTrainer's
``_prepare_dataset`` tokenizes them back into the same ids; every batch's ``input_ids``, ``attention_mask`` and
``completion_mask`` is asserted equal to our ``pair_collate``'s ``tokens``, ``mask`` and completion labels.

A step is forward + backward over the batch's chosen and rejected rows, ``AdamW.step`` (foreach, lr 1e-4, both
sides the same) and ``zero_grad``, as in bench_train.py; the batches are collated and on the device before the
clock starts. TRL runs with ``gradient_checkpointing=False`` (its config's default is True) unless
``--activation-checkpointing`` turns it on for both sides; with ``--dtype bf16`` both models hold bf16 weights
(TRL with ``bf16=True``). Each row runs in a fresh process, the rows interleaved round by round (ours, TRL, ours,
TRL, ...); in each, warm-up steps, then the median timed step, tokens/s two ways, and the peak memory over all the steps (warm-up included: the optimizer's state is allocated by the first):
on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (everything allocated: weights,
gradients, optimizer state, activations); on CPU the process's peak resident set (VmHWM, reset just before the
loop) minus its resident set then (the weights, made resident before, are not in it; freed heap is returned to
the system first, ``malloc_trim``). Figures are medians over rounds; the ratios are ours / TRL's, round by round.
tokens/s is given both ways, labelled: ``med`` is the median over the timed steps of each step's real tokens over
its time (robust to a slow step, and what the ``step s`` column, the median step time, goes with); ``all`` is all the
timed steps' real tokens over their summed time (what a run of those steps gets, slow steps included). They differ
where the step times are uneven (a first step that allocates, a GPU's clock ramping up); on a GPU they once
disagreed by 1.8x. The goal (``goal,`` line) is judged on ``all``, the throughput a run sees; both ratios are printed.
On a CPU shared with other work, ``--threads 1`` gives steadier times: with torch's default threads, every parallel
region waits for a thread another process holds up (measured on 2 busy cores: the round-to-round spread of the
tokens/s ratio 0.9-1.9x with the default, 2.12-2.24x with one thread).

On CPU, TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) scores every position, prompt and padding
included, in torch tiles of [positions, vocab] fp32 with several temporaries each (it keeps only the completion
positions, and uses its Triton kernel, on CUDA and XPU): measured on ``small``, that is about 40% of its step time
and 0.8 GB of its peak. CPU figures therefore overstate what ours saves on a GPU; run ``--device cuda`` for those.

The reference pass's one-time cost is printed apart: ``reference_pass`` over the bench's pairs (batch
``--pairs-per-step``), and TRL's precompute at construction (``_precompute_ref_logps``, which also writes the
log-probs to an Arrow cache file).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (vocab, hidden, intermediate, layers, heads, kv heads)
    "small": (32000, 512, 1376, 4, 8, 4),  # the CPU default
    "medium": (32000, 1024, 2816, 8, 16, 8),  # the CUDA default
    "vocab128k": (128256, 512, 1376, 2, 8, 4),  # Llama 3's vocabulary: the output projection dominates
    "tiny": (2048, 64, 176, 2, 4, 2),  # --quick
}
DEFAULTS = {  # device: shape, pairs per step, prompt length, completion length, timed steps, warm-up steps, rounds
    "cpu": ("small", 2, 256, 256, 3, 1, 2),
    "cuda": ("medium", 8, 256, 256, 10, 3, 3),
}
QUICK = ("tiny", 2, 32, 32, 2, 1, 1)
IMPLS = ("ours", "trl", "ours-ref", "trl-ref")  # the interleaving order within a round
LABELS = {"ours": "waypoint (precomputed ref)", "trl": "TRL (precompute_ref_log_probs)",
          "ours-ref": "waypoint + ref forward/step", "trl-ref": "TRL (ref model)"}
PAD, EOS, UNK, FIRST_ID = 0, 1, 2, 3  # the word-level tokenizer's special ids; random tokens from FIRST_ID up
BETA, LR = 0.1, 1e-4
GOAL_SPEED, GOAL_MEMORY = 1.5, 0.6


# -- the model and the pairs ----------------------------------------------------------------------------------------

def hf_config(shape: str) -> dict:
    vocab, hidden, inter, layers, heads, kv = SHAPES[shape]
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "pad_token_id": PAD,
            "eos_token_id": EOS, "bos_token_id": None}


def write_checkpoint(path: Path, shape: str, dtype_name: str) -> None:
    """A random LlamaForCausalLM (seed 0, transformers' own initialisation) saved with ``save_pretrained``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf_config(shape)))
    model.to(torch_dtype(dtype_name)).save_pretrained(path)


def make_pairs(n: int, vocab: int, prompt_len: int, completion_len: int, seed: int = 1) -> list[dict]:
    """``n`` pairs of random token ids: a prompt of prompt_len/2..prompt_len tokens, chosen and rejected completions
    of completion_len/2..completion_len tokens, the last one EOS."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def ids(longest: int, eos: bool) -> list[int]:
        n_tokens = int(torch.randint(max(longest // 2, 1), longest + 1, (), generator=g))
        out = torch.randint(FIRST_ID, vocab, (n_tokens,), generator=g).tolist()
        return out[:-1] + [EOS] if eos else out

    return [{"prompt": ids(prompt_len, False), "chosen": ids(completion_len, True), "rejected": ids(completion_len, True)}
            for _ in range(n)]


def word(i: int) -> str:
    return {PAD: "<pad>", EOS: "</s>", UNK: "<unk>"}.get(i, f"t{i}")


def word_tokenizer(vocab: int):
    """A word-level tokenizer whose ids are the model's: word ``t<i>`` is id i; no special tokens added."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({word(i): i for i in range(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def as_text(pair: dict) -> dict:
    """The pair as TRL's standard (non-conversational) preference format; each completion starts with a space, so
    prompt + completion splits into the prompt's words and then the completion's, and ends with EOS, so TRL adds none."""
    return {"prompt": " ".join(map(word, pair["prompt"])),
            **{side: " " + " ".join(map(word, pair[side])) for side in ("chosen", "rejected")}}


# -- measuring ------------------------------------------------------------------------------------------------------

def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def proc_status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def touch(*models) -> None:
    """Every weight read once: memory-mapped checkpoint pages resident before the baseline, on both sides alike."""
    for model in models:
        for p in model.parameters():
            float(p.detach().float().sum())


def time_loop(step, batches: list, warmup: int, steps: int, device, parameters) -> dict:
    """Run ``step(batch) -> loss`` + AdamW over ``batches`` in turn; the median timed step, tokens/s, peak memory."""
    import torch

    from waypoint.lazy import release_heap

    optimizer = torch.optim.AdamW(parameters, lr=LR, foreach=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()
    if device.type == "cuda":
        sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        release_heap()
        reset_peak_rss()
        before = proc_status_mb("VmRSS")
    times, step_tokens, losses = [], [], []
    for i in range(warmup + steps):
        batch, n_tokens = batches[i % len(batches)]
        sync()
        start = time.perf_counter()
        losses.append(step(batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            step_tokens.append(n_tokens)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        over, absolute = peak, peak
    else:
        absolute = proc_status_mb("VmHWM")
        over = absolute - before
    return {**throughput(times, step_tokens), "peak_mb": over, "before_mb": before, "absolute_mb": absolute,
            "losses": losses}


def throughput(times: list[float], step_tokens: list[int]) -> dict:
    """The timed steps' figures: the median step time, tokens/s of the median step (each step's tokens over its
    time, the median of those) and tokens/s over all of them (their tokens over their summed time)."""
    return {"median_s": statistics.median(times),
            "median_tokens_per_s": statistics.median(n / t for n, t in zip(step_tokens, times)),
            "tokens_per_s": sum(step_tokens) / sum(times)}


def child(impl: str, ckpt: Path, args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), torch_dtype(args.dtype)
    vocab = SHAPES[args.shape][0]
    per_step = args.pairs_per_step
    pairs = make_pairs(per_step * (args.warmup + args.steps), vocab, args.prompt_len, args.completion_len)
    torch.manual_seed(0)
    if impl.startswith("ours"):
        return child_ours(impl, ckpt, pairs, device, dtype, args)
    return child_trl(impl, ckpt, pairs, device, dtype, args)


def child_ours(impl: str, ckpt: Path, pairs: list[dict], device, dtype, args) -> dict:
    import torch

    from waypoint.checkpointers import checkpointer_for, load_into
    from waypoint.models.transformer import Transformer
    from waypoint.training.distributed import Distributed
    from waypoint.training.preference_loss import PreferenceLoss
    from waypoint.training.preference_step import (IndexedPairs, pair_collate, policy_logps,
                                                   preference_forward_backward, reference_pass)

    def native():
        checkpointer = checkpointer_for(ckpt)
        with torch.device("meta"):
            model = Transformer(checkpointer.model_args())
        load_into(model, checkpointer.load_checkpoint()["model"], dtype=dtype, device=device)
        return model

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = native()
    model.activation_checkpointing = args.activation_checkpointing
    dist, loss = Distributed(device=device), PreferenceLoss("sigmoid", BETA)
    indexed, collate, per_step = IndexedPairs(pairs), pair_collate(PAD), args.pairs_per_step
    batches = [collate([indexed[i] for i in range(start, start + per_step)]) for start in range(0, len(pairs), per_step)]
    out = {}
    if impl == "ours":
        sync()
        started = time.perf_counter()
        table = reference_pass(model, indexed, per_step, collate, device, dist).to(device)
        sync()
        out["ref_pass_s"] = time.perf_counter() - started
        reference_model = None
    else:
        table, reference_model = None, native().eval().requires_grad_(False)
    touch(*(m for m in (model, reference_model) if m is not None))
    model.train()

    def step(batch):
        reference = table
        if reference_model is not None:  # this batch's reference log-probs, as reference_pass computes them
            with torch.no_grad():
                chosen, rejected = policy_logps(reference_model, batch, device)
            reference = torch.zeros(len(pairs), 2, device=device)
            reference[batch["index"].to(device)] = torch.stack([chosen, rejected], dim=1)
        value, _, _, _ = preference_forward_backward(model, [batch], reference, loss, device, dist)
        return value

    timed = [(b, int(b["mask"].sum())) for b in batches]
    return {**out, **time_loop(step, timed, args.warmup, args.steps, device, [p for p in model.parameters() if p.requires_grad])}


def child_trl(impl: str, ckpt: Path, pairs: list[dict], device, dtype, args) -> dict:
    import torch
    from datasets import Dataset, disable_progress_bars
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from waypoint.training.preference_step import IndexedPairs, pair_collate

    disable_progress_bars()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timing = {}

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            sync()
            started = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            sync()
            timing["ref_pass_s"] = time.perf_counter() - started
            return out

    per_step = args.pairs_per_step
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="bench_dpo_trl_") as out_dir:
        config = DPOConfig(output_dir=out_dir, per_device_train_batch_size=per_step, precompute_ref_batch_size=per_step,
                           precompute_ref_log_probs=impl == "trl", max_length=None, loss_type=["sigmoid"], beta=BETA,
                           learning_rate=LR, use_cpu=device.type == "cpu", bf16=args.dtype == "bf16",
                           gradient_checkpointing=args.activation_checkpointing, report_to=[], seed=0,
                           disable_tqdm=True)
        trainer = TimedDPOTrainer(model=model, args=config, train_dataset=Dataset.from_list([as_text(p) for p in pairs]),
                                  processing_class=word_tokenizer(SHAPES[args.shape][0]))
        if args.activation_checkpointing:  # the Trainer turns it on in train(), which the bench does not call
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs)
        ours = pair_collate(PAD)
        indexed = IndexedPairs(pairs)
        batches = []
        for start in range(0, len(pairs), per_step):
            rows = range(start, start + per_step)
            batch = trainer.data_collator([trainer.train_dataset[i] for i in rows])
            mine = ours([indexed[i] for i in rows])  # the same token ids on both sides, padding and completions too
            assert torch.equal(batch["input_ids"], mine["tokens"]), f"batch {start // per_step}: input_ids differ"
            assert torch.equal(batch["attention_mask"].bool(), mine["mask"]), f"batch {start // per_step}: masks differ"
            assert torch.equal(batch["completion_mask"].bool(), mine["labels"] != -100), \
                f"batch {start // per_step}: completion positions differ"
            batches.append((trainer._prepare_inputs(batch), int(mine["mask"].sum())))
        if trainer.ref_model is not None:
            touch(trainer.ref_model)
        touch(trainer.model)
        trainer.model.train()

        def step(batch):
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            return loss.item()

        parameters = [p for p in trainer.model.parameters() if p.requires_grad]
        return {**timing, **time_loop(step, batches, args.warmup, args.steps, device, parameters)}


def run_child(impl: str, ckpt: Path, args) -> dict | str:
    """One row's figures from a fresh process, or the reason it failed."""
    command = [sys.executable, __file__, "--child", impl, str(ckpt), "--device", args.device, "--dtype", args.dtype,
               "--shape", args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--pairs-per-step", str(args.pairs_per_step), "--prompt-len", str(args.prompt_len),
               "--completion-len", str(args.completion_len)]
    if args.activation_checkpointing:
        command.append("--activation-checkpointing")
    if args.threads:
        command += ["--threads", str(args.threads)]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if run.returncode:
        lines = run.stderr.strip().splitlines()
        return " | ".join(lines[-3:]) if lines else f"exit status {run.returncode}"
    return json.loads(run.stdout.strip().splitlines()[-1])


# -- the report -----------------------------------------------------------------------------------------------------

def median_of(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


ALL, MED = "tokens_per_s", "median_tokens_per_s"  # tokens/s over all timed steps; of the median step


def speed_ratio(mine: list[dict], theirs: list[dict], key: str = ALL) -> float:
    """tokens/s (``key``) of ``mine`` over ``theirs``, round by round (the same round ran both), the median."""
    return statistics.median(m[key] / t[key] for m, t in zip(mine, theirs))


def spread(mine: list[dict], theirs: list[dict], key: str = ALL) -> str:
    """The lowest and highest round's tokens/s ratio (a shared machine drifts), or nothing for one round."""
    ratios = sorted(m[key] / t[key] for m, t in zip(mine, theirs))
    return f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""


def memory_ratio(mine: list[dict], theirs: list[dict]) -> float:
    return median_of(mine, "peak_mb") / median_of(theirs, "peak_mb")


def report(runs: dict[str, list[dict]], args) -> None:
    cuda = args.device == "cuda"
    memory = "peak MB" if cuda else "peak+ MB"
    print(f"{'':32} {'step s':>8} {'tok/s med':>9} {'tok/s all':>9} {memory:>9} {'before MB':>10} {'first loss':>11} "
          f"{'last loss':>10}   vs TRL precomputed: {'tok/s med (rounds)':>19} {'tok/s all (rounds)':>19} {'peak':>6}")
    base = runs.get("trl")
    for impl, rs in runs.items():
        ratios = ""
        if base and impl != "trl":
            ratios = (f"   {'':20}{f'{speed_ratio(rs, base, MED):.2f}x{spread(rs, base, MED)}':>19} "
                      f"{f'{speed_ratio(rs, base):.2f}x{spread(rs, base)}':>19} {memory_ratio(rs, base):5.2f}x")
        print(f"{LABELS[impl]:32} {median_of(rs, 'median_s'):8.3f} {median_of(rs, MED):9.0f} {median_of(rs, ALL):9.0f} "
              f"{median_of(rs, 'peak_mb'):9.0f} {median_of(rs, 'before_mb'):10.0f} {rs[0]['losses'][0]:11.5f} "
              f"{rs[0]['losses'][-1]:10.5f}{ratios}")
    print("step s: the median timed step; tok/s med: the median step's tokens/s (each step's tokens over its time); "
          "tok/s all: all timed steps' tokens over their summed time (the goal's)")
    if cuda:
        print("peak MB: torch.cuda.max_memory_allocated over the steps (weights, gradients, optimizer state, activations); "
              "before MB: allocated before the first step")
    else:
        print("peak+ MB: the peak resident set over the steps minus the resident set before them (before MB: weights, "
              "libraries; absolute peaks " + ", ".join(f"{LABELS[i]} {median_of(rs, 'absolute_mb'):.0f}"
                                                       for i, rs in runs.items()) + " MB)")
    for mine, theirs, label in (("ours-ref", "trl-ref", "with a reference forward per step, waypoint / TRL"),
                                ("ours-ref", "ours", "waypoint: reference forward per step / precomputed"),
                                ("trl-ref", "trl", "TRL: ref model / precompute_ref_log_probs")):
        if mine in runs and theirs in runs:
            step = median_of(runs[mine], "median_s") / median_of(runs[theirs], "median_s")
            print(f"{label}: {step:.2f}x the median step time, "
                  f"{speed_ratio(runs[mine], runs[theirs], MED):.2f}x the tokens/s of the median step"
                  f"{spread(runs[mine], runs[theirs], MED)}, {speed_ratio(runs[mine], runs[theirs]):.2f}x over all "
                  f"steps{spread(runs[mine], runs[theirs])}, "
                  f"{memory_ratio(runs[mine], runs[theirs]):.2f}x the peak memory")
    n_pairs = args.pairs_per_step * (args.warmup + args.steps)
    passes = [f"{LABELS[i].split(' (')[0]} {'reference_pass' if i == 'ours' else 'precompute_ref_log_probs'} "
              f"{median_of(runs[i], 'ref_pass_s'):.2f} s ({n_pairs / median_of(runs[i], 'ref_pass_s'):.1f} pairs/s)"
              for i in ("ours", "trl") if i in runs]
    if passes:
        print(f"reference pass, once before training, {n_pairs} pairs in batches of {args.pairs_per_step}: "
              + "; ".join(passes) + (" (TRL's includes writing its Arrow cache)" if "trl" in runs else ""))
    if "ours" in runs and "trl" in runs:
        speed, mem = speed_ratio(runs["ours"], runs["trl"]), memory_ratio(runs["ours"], runs["trl"])
        print(f"goal, waypoint vs TRL both precomputed: >= {GOAL_SPEED}x TRL's tokens/s over all timed steps: "
              f"{speed:.2f}x{spread(runs['ours'], runs['trl'])} "
              f"{'PASS' if speed >= GOAL_SPEED else 'MISS'}; <= {GOAL_MEMORY}x its peak memory: {mem:.2f}x "
              f"{'PASS' if mem <= GOAL_MEMORY else 'MISS'}")


def prepare_workdir(workdir: str | None) -> tuple[Path | None, Path | None]:
    """(the directory the bench's own temporary directory goes in, the outermost directory this made or None). A
    directory that does not exist is made, as ``mkdir -p`` would, and said so (what it made is removed again at the end
    if still empty); one that exists
    is used as it is: the bench writes only its own ``bench_dpo_*`` directory in it, removed at the end. A path that
    cannot be one exits with one line naming it."""
    if workdir is None:
        return None, None
    path = Path(workdir).expanduser()
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            sys.exit(f"error: --workdir {workdir}: not writable")
        return path, None
    if path.exists():
        sys.exit(f"error: --workdir {workdir}: exists and is not a directory")
    made = path.absolute()
    while not made.parent.exists():
        made = made.parent
    try:
        path.mkdir(parents=True)
    except OSError as e:
        sys.exit(f"error: --workdir {workdir}: cannot create it ({e.strerror or e})")
    print(f"created --workdir {workdir} (it did not exist)")
    return path, made


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--shape", default=None, choices=list(SHAPES), help="default: small on cpu, medium on cuda")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"which rows to run, of {', '.join(IMPLS)}")
    parser.add_argument("--rounds", type=int, default=None, help="run every row this many times, interleaved; medians")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (their memory counts)")
    parser.add_argument("--pairs-per-step", type=int, default=None, help="pairs per batch (2x that many rows)")
    parser.add_argument("--prompt-len", type=int, default=None, help="longest prompt (each pair: half that to it)")
    parser.add_argument("--completion-len", type=int, default=None, help="longest completion, EOS included")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="both sides checkpoint every block (TRL's own default; off otherwise)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads in every row's process (default: torch's; on a shared CPU, 1 is "
                             "steadier: no thread waits for one that another process holds up)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run: shape tiny, 2 pairs, 2 steps, 1 round")
    parser.add_argument("--workdir", default=None,
                        help="where the temporary checkpoint goes (in a bench_dpo_* directory of its own, removed at the "
                             "end); made if it does not exist")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULTS[args.device]
    for key, value in zip(("shape", "pairs_per_step", "prompt_len", "completion_len", "steps", "warmup", "rounds"),
                          defaults):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args)))
        return
    impls = [i for i in IMPLS if i in args.impls.split(",")]
    if unknown := sorted(set(args.impls.split(",")) - set(IMPLS)):
        sys.exit(f"unknown impl {', '.join(unknown)}; impls: {', '.join(IMPLS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here")
    workdir, created = prepare_workdir(args.workdir)
    vocab, hidden, _, layers, heads, kv = SHAPES[args.shape]
    threads = f", {args.threads} thread(s)" if args.threads else ""
    print(f"device {args.device}{threads}, {args.dtype}; {args.shape}: vocab {vocab}, hidden {hidden}, {layers} layers, heads "
          f"{heads}/{kv}; {args.pairs_per_step} pairs a step ({2 * args.pairs_per_step} rows), prompts "
          f"{max(args.prompt_len // 2, 1)}-{args.prompt_len} + completions {max(args.completion_len // 2, 1)}-"
          f"{args.completion_len} tokens; sigmoid loss, beta {BETA}; step = forward + backward + AdamW (foreach); "
          f"activation checkpointing {'on' if args.activation_checkpointing else 'off'} (both sides); median of "
          f"{args.steps} timed steps after {args.warmup} warm-up, each row in a fresh process, {args.rounds} round(s) "
          f"interleaved")
    try:
        run_rounds(impls, args, workdir)
    finally:
        if created:  # what this made, innermost first, as long as the bench left it empty
            for folder in [workdir.absolute(), *workdir.absolute().parents]:
                if any(folder.iterdir()):
                    break
                folder.rmdir()
                if folder == created:
                    break


def run_rounds(impls: list[str], args, workdir: Path | None) -> None:
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_dpo_") as work:
        ckpt = Path(work) / "ckpt"
        write_checkpoint(ckpt, args.shape, args.dtype)
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}
        for _ in range(args.rounds):
            for impl in list(impls):
                r = run_child(impl, ckpt, args)
                if isinstance(r, str):
                    print(f"{LABELS[impl]:32} failed: {r}")
                    runs.pop(impl)
                    impls.remove(impl)
                else:
                    runs[impl].append(r)
    if runs:
        report(runs, args)


if __name__ == "__main__":
    main()
