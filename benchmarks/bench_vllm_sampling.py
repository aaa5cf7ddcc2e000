"""GRPO's sampling, native against vLLM: a step's prompts x completions, and the weight sync that vLLM adds.

    .venv-vllm/bin/python benchmarks/bench_vllm_sampling.py [--prompts 16] [--n 8] [--prompt 64] [--new 128]
                                                             [--repeats 3] [--device cpu|cuda] [--lora 16]

Run in vLLM's environment (``bash scripts/make_vllm_env.sh``). One random-weight Llama-shaped model (bench_generate's
shape: vocab 32000, hidden 512, 4 layers, heads 8/4), saved once by transformers; ``--prompts`` random prompts of
``--prompt`` tokens, ``--n`` completions each of ``--new`` tokens, no reachable end, temperature 0.8, top-k 50,
top-p 0.95, fp32:

  group    ``waypoint.models.sample_group.generate_group``: a prompt's group at a time (GRPO before 2026-11-29)
  native   ``generate_groups``: ``--batch`` prompts' groups in one decode loop (a micro-batch's, as GRPO samples now)
  vllm     ``waypoint.sampling.vllm_engine.VLLMEngine.sample``: the step's prompts x completions as one batch of
           seeded requests (``enforce_eager`` on the CPU)
  sync     ``PolicyEngine.sync``: the policy pushed through the family's table, then the probe checked
  lora     with ``--lora RANK`` adapters on every projection (random B): the sync of the merged weights, and of the
           PEFT adapter into an engine started with LoRA (``AdapterPush``), and sampling with that adapter

one warm-up, then the median of ``--repeats`` timed calls; generated tokens/s and vLLM's ratio over native side by
side in one run. The engine's start (once a run) is printed apart.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

CONFIG = {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": False}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="prompts the native sampler decodes together")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lora", type=int, default=16, help="the adapters' rank (0: no LoRA rows)")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from waypoint.checkpointers.formats import checkpointer_for
    from waypoint.checkpointers.load_model import model_from
    from waypoint.models.generate import Sampling
    from waypoint.models.sample_group import generate_group, generate_groups
    from waypoint.sampling.grpo_engine import PolicyEngine
    from waypoint.sampling.vllm_engine import VLLMEngine
    from waypoint.sampling.vllm_options import VLLMOptions

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
        checkpointer = checkpointer_for(path)
        device = torch.device(args.device)
        model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32").to(device)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, CONFIG["vocab_size"], (args.prompt,), generator=g).tolist() for _ in range(args.prompts)]
        sampling = Sampling(temperature=0.8, top_k=50, top_p=0.95)
        tokens = args.prompts * args.n * args.new

        def group():
            for i, prompt in enumerate(prompts):
                generate_group(model, prompt, args.n, args.new, sampling, generator=torch.Generator().manual_seed(i))

        def native():
            for first in range(0, len(prompts), args.batch):
                chunk = range(first, min(first + args.batch, len(prompts)))
                generate_groups(model, [prompts[i] for i in chunk], args.n, args.new, sampling,
                                generators=[torch.Generator().manual_seed(i) for i in chunk])

        started = time.perf_counter()
        engine = VLLMEngine(path, torch.float32, VLLMOptions(), args.prompt + args.new + 8, seed=0, device=device)
        start_s = time.perf_counter() - started
        seeds = [[i * args.n + r for r in range(args.n)] for i in range(args.prompts)]
        served = PolicyEngine(engine, checkpointer, prompts[0][:32], checkpointer.model_type, VLLMOptions())
        step = iter(range(1, 10 ** 6))

        vllm_s = timed(lambda: engine.sample(prompts, seeds, args.new, sampling, stop_ids=[]), args.repeats)
        sync_s = timed(lambda: served.sync(model, next(step), "in the benchmark"), args.repeats)
        native_s = timed(native, args.repeats)
        group_s = timed(group, args.repeats)
        rows = [("group", group_s, native_s / group_s, ""), ("native", native_s, 1.0, f"({args.batch} prompts a loop)"),
                ("vllm", vllm_s, native_s / vllm_s, "")]  # (sampler, s a step, its speed over native's, a note)
        syncs = [("sync", sync_s, "the whole model pushed, then the probe checked")]
        if args.lora:
            from waypoint.models.lora import apply_lora
            from waypoint.sampling.adapter_push import AdapterPush

            apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], args.lora,
                       2 * args.lora)
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "lora_B" in name:
                        parameter.normal_(0, 0.02)
            syncs.append(("lora merged", timed(lambda: served.sync(model, next(step), "in the benchmark"), args.repeats),
                          f"rank {args.lora}: the base with the adapters folded in, whole"))
            adapters = AdapterPush(model, checkpointer.hf_converter(), Path(tmp) / "adapters")
            lora_engine = VLLMEngine(path, torch.float32, VLLMOptions(), args.prompt + args.new + 8, seed=0, device=device,
                                     max_lora_rank=adapters.max_lora_rank)
            pushed = PolicyEngine(lora_engine, checkpointer, prompts[0][:32], checkpointer.model_type, VLLMOptions(), adapters)
            syncs.append(("lora adapter", timed(lambda: pushed.sync(model, next(step), "in the benchmark"), args.repeats),
                          f"rank {args.lora}: the PEFT adapter written, a new LoRARequest"))
            lora_s = timed(lambda: lora_engine.sample(prompts, seeds, args.new, sampling, stop_ids=[]), args.repeats)
            rows.append(("vllm+lora", lora_s, native_s / lora_s, f"(rank {args.lora} adapter, vLLM's LoRA kernels)"))

    print(f"{args.prompts} prompts x {args.n} completions x {args.new} tokens (prompt {args.prompt}), {args.device}, "
          f"fp32, torch threads {torch.get_num_threads()}; vLLM's start: {start_s:.1f} s")
    print(f"{'sampler':<10} {'s / step':>9} {'tokens/s':>10} {'/native':>8}")
    for name, seconds, ratio, note in rows:
        print(f"{name:<10} {seconds:>9.2f} {tokens / seconds:>10.0f} {ratio:>8.2f}  {note}".rstrip())
    print(f"{'sync':<14} {'s / step':>9}")
    for name, seconds, note in syncs:
        print(f"{name:<14} {seconds:>9.3f}  {note}")


if __name__ == "__main__":
    main()
