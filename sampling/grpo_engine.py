"""A GRPO run's sampling engine: which one the config asks for, refused in one line before the first step where it
cannot serve the run, and kept in step with the policy (``PolicyEngine.sync``: pushed, then checked on a probe).

``generation.engine: native`` (the default) samples with the policy's own decode loop (``models.sample_group``);
``generation.engine: vllm``, or TRL's top-level ``use_vllm: true``, with vLLM in the training process
(``sampling.vllm_engine``) or a vLLM server (``vllm.vllm_mode: server``, ``sampling.vllm_server``), configured by the
``vllm`` section (``sampling.vllm_options``).
"""

from __future__ import annotations

import atexit
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from waypoint.checkpointers.extra_state import split_extra_state
from waypoint.errors import CheckpointError
from waypoint.models.dtypes import parse_dtype
from waypoint.models.lora import MergedState, lora_modules
from waypoint.sampling.adapter_push import ADAPTERS_FOLDER, AdapterPush
from waypoint.sampling.vllm_options import VLLMOptions, vllm_options

PROBE_TOKENS = 32  # the probe sequence: the first training prompt's first tokens


def engine_choice(cfg) -> str:
    """``native`` or ``vllm``: ``generation.engine``, or ``vllm`` where TRL's ``use_vllm`` is true."""
    generation = cfg.get("generation") or {}
    engine, use_vllm = generation.get("engine"), cfg.get("use_vllm")
    if (use_vllm is True and engine == "native") or (use_vllm is False and engine == "vllm"):
        raise CheckpointError(f"use_vllm={str(use_vllm).lower()} and generation.engine={engine} disagree: keep one of them")
    return "vllm" if use_vllm is True else engine or "native"


class PolicyEngine:
    """vLLM as a run's sampler, given the policy's weights (``sync``) whenever they changed since the last sync."""

    def __init__(self, engine, checkpointer, probe: list[int], family: str, options: VLLMOptions, adapters=None) -> None:
        self.engine, self.checkpointer, self.probe, self.family, self.options = engine, checkpointer, probe, family, options
        self.adapters = adapters  # a LoRA policy pushed as its adapter (sampling.adapter_push), else its weights
        # a server may hold what another run pushed: under adapters, the frozen base goes to it once, first
        self.base_pending = adapters is not None and getattr(engine, "outlives_runs", False)
        self.synced_step: int | None = None

    def sync(self, model: torch.nn.Module, step: int, when: str) -> dict[str, float]:
        """Push the policy as it is after ``step`` optimizer steps (nothing where it already has), then check it on
        the probe; the metrics ``sampling/weight_sync_s`` and ``sampling/weight_sync_logp_gap``."""
        if self.synced_step == step:
            return {}
        started = time.perf_counter()
        native = split_extra_state(model.state_dict())[0]
        if self.adapters is not None:  # the base as the engine loaded it (frozen), the adapter a new request
            if self.base_pending:
                self.engine.push(self.checkpointer.served_tensors({k: v for k, v in native.items() if ".lora_" not in k}))
                self.base_pending = False
            self.engine.use_adapter(*self.adapters.write(model))
        else:
            scalings = {name: m.scaling for name, m in lora_modules(model).items()}
            if scalings:  # LoRA: the base with each adapter's update folded in, a tensor at a time as the engine reads it
                native = MergedState(native, scalings)
            self.engine.push(self.checkpointer.served_tensors(native))
        seconds = time.perf_counter() - started
        gap = self.engine.check(self.probe, self._policy_logps(model), self.family, when)
        self.synced_step = step
        return {"sampling/weight_sync_s": seconds, "sampling/weight_sync_logp_gap": gap}

    @torch.no_grad()
    def _policy_logps(self, model: torch.nn.Module) -> list[float]:
        device = next(model.parameters()).device
        tokens = torch.tensor([self.probe], device=device)
        labels = tokens.clone()
        labels[:, 0] = -100
        was_training = model.training
        model.eval()
        try:
            return model(tokens, labels=labels, per_token=True, temperature=1.0)[0][0].tolist()
        finally:
            model.train(was_training)


def start_engine(cfg, checkpointer, dataset, longest: int, lora, dist, say: Callable[[str], None],
                 loss_type: str = "dapo", model: torch.nn.Module | None = None, converter=None) -> PolicyEngine | None:
    """The run's vLLM engine (None for the native sampler), refused in one line where it cannot serve this run."""
    if engine_choice(cfg) == "native":
        if cfg.get("vllm"):
            say("note: the vllm section is unused: generation.engine is native (set generation.engine=vllm to use it)")
        return None
    try:
        options = vllm_options(cfg.get("vllm"))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    correction = options.correction
    if loss_type == "vespo" and correction.enabled and correction.sequence_level:
        raise CheckpointError(f"loss.loss_type=vespo weighs sequences itself: set vllm.vllm_importance_sampling_mode to "
                              f"token_truncate or token_mask (not {correction.mode}), as TRL requires")
    refusals = [(dist.enabled, "under torchrun (one process per engine is not built yet)"),
                (bool(cfg.get("quantize_base")), f"over a quantize_base={cfg.get('quantize_base')} base (vLLM would "
                 "serve the merged weights, not the 4-bit base the policy computes with)"),
                (getattr(checkpointer, "name", None) != "hf",
                 f"from a {getattr(checkpointer, 'label', 'non-HF')} checkpoint (vLLM loads Hugging Face directories: "
                 "convert it with scripts/convert.py --to hf)")]
    for refused, why in refusals:
        if refused:
            raise CheckpointError(f"generation.engine=vllm cannot sample {why}; set generation.engine=native")
    if checkpointer.quantized.method is not None:
        raise CheckpointError(f"generation.engine=vllm cannot sample from a {checkpointer.quantized.method} checkpoint "
                              "yet; set generation.engine=native")
    first = list(dataset[0]["prompt_ids"])
    probe = (first * 2 if len(first) < 2 else first)[:PROBE_TOKENS]
    dtype = parse_dtype(cfg.dtype)
    server = None
    if options.vllm_mode == "server":
        from waypoint.sampling.vllm_server import VLLMServer

        weights_dir = Path(options.vllm_server_weights_dir or Path(cfg.output_dir) / ".vllm_weights")
        server = VLLMServer(checkpointer.checkpoint_dir, dtype, options, max_model_len=longest, weights_dir=weights_dir)
    adapters, unserved = _adapter_push(model, converter, options, cfg.device, server) if lora else (None, "")
    if server is not None:
        engine, where = server, f"the vLLM server at {options.server_url} (each sync's weights written to {weights_dir})"
    else:
        from waypoint.sampling.vllm_engine import VLLMEngine

        engine = VLLMEngine(checkpointer.checkpoint_dir, dtype, options, max_model_len=longest, seed=cfg.seed,
                            device=torch.device(cfg.device), max_lora_rank=adapters and adapters.max_lora_rank)
        where = "vLLM in this process"
    bounds = f"[{correction.clip_min or 0:g}, {'inf' if correction.clip_max is None else format(correction.clip_max, 'g')}]"
    say(f"sampling: {where} ({checkpointer.model_type}, {cfg.dtype}); importance-sampling correction "
        + (f"{correction.mode}, ratios within {bounds}" if correction.enabled else "off"))
    if cfg.device.startswith("cuda") and not options.vllm_batch_invariant:
        say("sampling: vLLM's GPU kernels are not batch-invariant: a resumed run samples close to, not exactly, what the "
            "uninterrupted run would have (vllm.vllm_batch_invariant=true: exactly, slower)")
    if adapters:
        say(f"sampling: vLLM is given the adapter (PEFT's, rank {adapters.rank}) before every step, over the base it loaded")
    elif lora:
        say(f"sampling: vLLM is given the merged weights (base + adapters) before every step ({unserved})")
    return PolicyEngine(engine, checkpointer, probe, checkpointer.model_type, options, adapters)


def _adapter_push(model: torch.nn.Module, converter, options: VLLMOptions, device: str,
                  server) -> tuple[AdapterPush | None, str]:
    """A LoRA policy's adapter, pushed as a new LoRA request each sync where vLLM (``server``, else vLLM in this
    process) serves it: (the push, ""); else (None, why the merged weights go instead)."""
    why = options.adapters_unwanted(device) or AdapterPush.why_not(model, converter)
    if not why and server is not None:
        why = server.adapter_problem(next(iter(lora_modules(model).values())).rank)
    if why:
        return None, why
    # a server reads the adapters from beside the weights it reloads; vLLM in this process from a folder of its own
    folder = server.weights_dir / ADAPTERS_FOLDER if server is not None else \
        Path(tempfile.mkdtemp(prefix="waypoint-vllm-adapters-"))
    push = AdapterPush(model, converter, folder)
    atexit.register(push.close)
    return push, ""
