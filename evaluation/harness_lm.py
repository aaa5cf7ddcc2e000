"""lm-evaluation-harness's model class over a Waypoint model, registered as ``waypoint``.

Its numbers are those of lm-eval's own ``hf`` backend (HFLM) on the same checkpoint, because it does what HFLM
does with the same tokens (``waypoint.evaluation.harness_tokens``):

* ``loglikelihood``: lm-eval's ``TemplateLM`` splits each request as HFLM does (the context's trailing spaces go to
  the continuation; context + continuation encoded whole, the continuation being what follows the context's
  tokens; an empty context becomes the BOS, or the EOS without one). The model reads the last ``max_length`` of
  the tokens but the last one, and the continuation's log-probabilities (fp32 log-softmax) are summed; "greedy" is
  whether each continuation token is the arg-max.
* ``loglikelihood_rolling``: the whole text (with the tokenizer's special tokens) in lm-eval's disjoint rolling
  windows of ``max_length`` tokens after a BOS (EOS) prefix, their loglikelihoods summed.
* ``generate_until``: the context left-truncated to ``max_length - max_gen_toks`` tokens, then our KV-cache
  generation (``waypoint.models.generate``), greedy unless a task asks ``do_sample`` with a temperature, for
  ``max_gen_toks`` tokens at most; it stops at the end-of-sequence token (and ``generation_config.json``'s) or once
  a stop string appears, and the text is cut at the first stop string, as lm-eval cuts HFLM's.

``max_length`` defaults to the model's positions (config.json's ``max_position_embeddings``, as HFLM reads it).
"""

from __future__ import annotations

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from waypoint import console
from waypoint.errors import CheckpointError
from waypoint.evaluation.harness_tokens import HarnessTokens
from waypoint.models.generate import Sampling, generate
from waypoint.text.stop_tokens import stop_token_ids
from waypoint.text.tokenizer import Tokenizer


@register_model("waypoint")
class WaypointLM(TemplateLM):
    """``WaypointLM(model, tokenizer, ...)`` over a loaded model; ``WaypointLM.from_checkpoint(checkpoint_dir,
    adapter_dir=..., ...)`` or ``simple_evaluate(model="waypoint", model_args="checkpoint_dir=...")`` loads one."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, max_length: int | None = None, batch_size: int = 1,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, stop_ids: list[int] | None = None,
                 seed: int = 1234, info: dict | None = None) -> None:
        super().__init__()
        positions = model.args.max_seq_len
        if max_length is not None and not 1 < int(max_length) <= positions:
            raise CheckpointError(f"max_length={max_length}: expected 2 .. {positions} (the model's positions)")
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise CheckpointError(f"batch_size={batch_size}: expected an integer >= 1")
        self.model = model.eval()
        self.text_tokenizer = tokenizer
        self.tokens = HarnessTokens(tokenizer, add_bos_token)
        self.add_bos_token = add_bos_token
        self._max_length = int(max_length or positions)
        self._batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, None)
        self._device = next(model.parameters()).device
        self.generator = torch.Generator(device=self._device).manual_seed(seed)
        self.info = dict(info or {})

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, adapter_dir: str | None = None, device: str = "cpu",
                        dtype: str = "fp32", **options) -> "WaypointLM":
        from waypoint.cli.inference_model import load_for_inference

        loaded = load_for_inference(checkpoint_dir, adapter_dir, device, dtype)
        info = {"checkpoint_dir": str(checkpoint_dir), "adapter_dir": adapter_dir and str(adapter_dir), "dtype": dtype}
        return cls(loaded.model, loaded.tokenizer, info=info, **options)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "WaypointLM":
        extra = {k: v for k, v in (additional_config or {}).items() if k in ("batch_size", "device") and v is not None}
        return cls.from_checkpoint(**{**arg_dict, **extra})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "WaypointLM":
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # what lm-eval asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.text_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.text_tokenizer.bos_id
        return bos if bos is not None else self.text_tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.text_tokenizer.directory or "waypoint").replace("/", "__")

    def get_model_info(self) -> dict:
        return {**self.info, "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "max_length": self.max_length, "add_bos_token": self.add_bos_token}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """HFLM's ``tok_encode``: the tokenizer's special tokens unless asked otherwise, or unless the text already
        starts with the prefix token's text."""
        prefix = self.tokens.text_of("bos_token" if self.text_tokenizer.bos_id is not None else "eos_token")
        add = add_special_tokens if add_special_tokens is not None else not (prefix and string.startswith(prefix))
        ids = self.tokens.encode(string, add)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _prompt(self, context: str, room: int) -> list[int]:
        """HFLM's ``tok_batch_encode`` of one context: no special tokens where it starts with the BOS's text."""
        bos = self.tokens.text_of("bos_token") if self.text_tokenizer.bos_id is not None else None
        return self.tokens.encode(context, not (bos and context.startswith(bos)))[-room:]

    # scoring
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None
                              ) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) per (request, context ids,
        continuation ids), the longest first in batches, right-padded (the model is causal: padding after a
        sequence changes none of its logits)."""
        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        order = Collator(requests, sort_fn=longest_first)
        results = []
        progress = console.bar(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=override_bs or self.batch_size):
            inputs, continuations = [], []
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"loglikelihood: a request with {len(context)} context and {len(continuation)} "
                                     f"continuation tokens (1 or more each, the continuation at most max_length="
                                     f"{self.max_length})")
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
                continuations.append(continuation)
            width = max(map(len, inputs))
            batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs], device=self.device)
            logits = self.model(batch)
            for (request, _, _), ids, continuation, row in zip(chunk, inputs, continuations, logits):
                scored = row[len(ids) - len(continuation):len(ids)].float().log_softmax(-1)
                target = torch.tensor(continuation, device=self.device)
                answer = (float(scored.gather(1, target[:, None]).sum()), bool((scored.argmax(-1) == target).all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                progress.update(1)
        progress.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (text,) in (request.args for request in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text), max_seq_len=self.max_length,
                                                         prefix_token=self.prefix_token_id, context_len=1)
            mine = [(None, *lm_utils.make_disjoint_window(window)) for window in rolling]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, start = [], 0
        for request, count in zip(requests, counts):
            totals.append(sum(score for score, _ in scores[start:start + count]))
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        eos = self.tokens.text_of("eos_token")
        for request in console.bar(requests, disable=disable_tqdm, desc="Running generate_until requests"):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room <= 0:
                raise CheckpointError(f"max_length={self.max_length}: no room for a prompt before the {new_tokens} new "
                                      "tokens a task asks for (its max_gen_toks); raise max_length")
            prompt = self._prompt(context, room)
            if not prompt:
                raise ValueError("generate_until: an empty prompt, and a tokenizer without special tokens to start it")
            out: list[int] = []

            def stopped(token: int) -> bool:  # a stop string in the text so far (cut where it starts, below)
                out.append(token)
                text = self.text_tokenizer.decode(out)
                return any(stop and stop in text for stop in until)

            tokens = generate(self.model, prompt, new_tokens, sampling(kwargs), self.stop_ids, stopped, self.generator)
            answer = postprocess_generated_text(self.tokens.decode(tokens), until, None)
            answers.append(answer)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answer)
        return answers


SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p", "repetition_penalty"}


def sampling(kwargs: dict) -> Sampling:
    """Greedy, as HFLM's ``do_sample=False`` (lm-eval's default), with the task's ``repetition_penalty`` (which
    transformers applies to greedy decoding too); with ``do_sample`` and a temperature, sampled with the task's
    ``temperature``, ``top_k`` and ``top_p`` (a sample is ours, not transformers', which would also take
    generation_config.json's defaults). Other generation options are refused rather than silently left out."""
    other = sorted(k for k in set(kwargs) - SAMPLING_KEYS if not (k == "num_beams" and kwargs[k] == 1))
    if other:
        raise CheckpointError(f"a task's generation_kwargs has {', '.join(other)}, which the waypoint model does not "
                              f"support (it takes until, max_gen_toks, {', '.join(sorted(SAMPLING_KEYS))})")
    penalty = float(kwargs.get("repetition_penalty") or 1.0)
    temperature = float(kwargs.get("temperature") or 0.0)
    if not kwargs.get("do_sample") or temperature == 0.0:
        return Sampling(repetition_penalty=penalty)
    return Sampling(temperature, int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0), penalty)
