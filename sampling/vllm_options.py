"""The ``vllm`` section of a GRPO config: TRL 1.16's ``GRPOConfig`` names and defaults for what they mean here.

``generation.engine: vllm`` (or TRL's top-level ``use_vllm: true``) samples the completions with vLLM instead of the
policy's own decode loop; this section says how. Every option is checked before the model loads, in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from waypoint.training.sampling_correction import SamplingCorrection

ENGINES = ("native", "vllm")
MODES = ("colocate", "server")  # vLLM in the training process, or a server the user started (sampling.vllm_server)


@dataclass(frozen=True)
class VLLMOptions:
    """How vLLM samples (``vllm_mode`` ... ``vllm_importance_sampling_clip_min``: TRL's names and defaults)."""

    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None  # server mode: its URL, or http://vllm_server_host:vllm_server_port
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0  # seconds: the wait for the server to answer at start, and for each request
    # server mode (ours): where each sync's weights are written for the server to read (None: output_dir/.vllm_weights,
    # or a temporary directory for an object-store output_dir); the server must see it (this machine, or a shared disk)
    vllm_server_weights_dir: str | None = None
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    vllm_enable_sleep_mode: bool = False
    vllm_max_model_length: int | None = None  # None: the prompt and completion lengths of the run
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None  # TRL's deprecated name of clip_max
    # after each weight sync, the engine's log-probs of a probe sequence must be ours within this (None: by dtype)
    vllm_sync_tolerance: float | None = None
    # vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, GPUs): a request samples the same whatever else is in its
    # batch, so a resumed run samples what the uninterrupted one did; slower. (Its CPU backend is batch-invariant as is.)
    vllm_batch_invariant: bool = False
    # a LoRA policy given to vLLM as its adapter (true) or merged (false); null: the adapter on a GPU or a server, merged
    # on the CPU, where vLLM's LoRA kernels sampled 2.7x slower than the merged model (benchmarks/bench_vllm_sampling.py)
    vllm_push_adapters: bool | None = None

    def __post_init__(self) -> None:
        if self.vllm_mode not in MODES:
            raise ValueError(f"vllm_mode={self.vllm_mode!r}: expected colocate or server")
        url = self.vllm_server_base_url
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://")) and "://" != url[-3:]):
            raise ValueError(f"vllm_server_base_url={url!r}: expected a URL such as http://10.0.0.5:8000, or null")
        if not (isinstance(self.vllm_server_host, str) and self.vllm_server_host and "/" not in self.vllm_server_host):
            raise ValueError(f"vllm_server_host={self.vllm_server_host!r}: expected a host name or address")
        port = self.vllm_server_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"vllm_server_port={port!r}: expected a port number (1-65535)")
        timeout = self.vllm_server_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"vllm_server_timeout={timeout!r}: expected seconds > 0")
        if self.vllm_server_weights_dir is not None and not (isinstance(self.vllm_server_weights_dir, str)
                                                             and self.vllm_server_weights_dir):
            raise ValueError(f"vllm_server_weights_dir={self.vllm_server_weights_dir!r}: expected a directory, or null")
        if not (isinstance(self.vllm_gpu_memory_utilization, (int, float)) and 0 < self.vllm_gpu_memory_utilization <= 1):
            raise ValueError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization!r}: expected a number in (0, 1]")
        if self.vllm_tensor_parallel_size != 1:
            raise ValueError(f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size!r}: only 1 is supported yet")
        if self.vllm_push_adapters not in (None, True, False):
            raise ValueError(f"vllm_push_adapters={self.vllm_push_adapters!r}: expected true, false or null")
        for name in ("vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        length = self.vllm_max_model_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
            raise ValueError(f"vllm_max_model_length={length!r}: expected an integer >= 2, or null")
        tolerance = self.vllm_sync_tolerance
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not math.isfinite(tolerance) or tolerance <= 0):
            raise ValueError(f"vllm_sync_tolerance={tolerance!r}: expected a number > 0, or null")
        self.correction  # noqa: B018 (checks the importance-sampling options)

    def adapters_unwanted(self, device: str) -> str | None:
        """Why a LoRA policy goes to vLLM merged although vLLM could take its adapter (``vllm_push_adapters``), or None."""
        if self.vllm_push_adapters is False:
            return "vllm.vllm_push_adapters=false"
        if self.vllm_push_adapters is None and self.vllm_mode == "colocate" and not device.startswith("cuda"):
            return ("on the CPU vLLM's LoRA kernels sample about 2.7x slower than the merged model; "
                    "vllm.vllm_push_adapters=true pushes the adapter")
        return None

    @property
    def server_url(self) -> str:
        """The server's base URL, without a trailing slash."""
        return (self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}").rstrip("/")

    @property
    def correction(self) -> SamplingCorrection:
        clip_max = self.vllm_importance_sampling_clip_max if self.vllm_importance_sampling_cap is None \
            else self.vllm_importance_sampling_cap
        return SamplingCorrection(self.vllm_importance_sampling_correction, self.vllm_importance_sampling_mode,
                                  clip_max, self.vllm_importance_sampling_clip_min)


def vllm_options(section) -> VLLMOptions:
    """The ``vllm`` section (a mapping, or None) as options; an unknown key or a bad value: ``ValueError`` naming it
    as ``vllm.<key>``."""
    given = dict(section or {})
    known = {f.name for f in fields(VLLMOptions)}
    for key in given:
        if key not in known:
            raise ValueError(f"vllm.{key}: no such option (options: {', '.join(sorted(known))})")
    try:
        return VLLMOptions(**given)
    except ValueError as e:
        raise ValueError(f"vllm.{e}") from None
