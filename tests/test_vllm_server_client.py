"""vllm.vllm_mode=server without vLLM: the client (sampling/vllm_server.py) against a stand-in that answers on
127.0.0.1 as vLLM 0.32's server does (its routes and reply shapes), or as a broken one would. What it sends (each
completion its own seeded request; the weights staged, reloaded, then deleted) and every way a server can fail a
run (down, slow, not in development mode, another dtype, context, log-prob mode or model, garbage, a refused
reload) is one line before anything trains. (A real vLLM server: tests/with_vllm/test_vllm_server.py.)"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from waypoint.errors import CheckpointError
from waypoint.models.generate import Sampling
from waypoint.sampling.vllm_options import VLLMOptions
from waypoint.sampling.vllm_server import QUALNAME, SYNC_FOLDER, VLLMServer

MODEL = ROOT / "assets/tiny_llama"


class StandIn(BaseHTTPRequestHandler):
    """vLLM's routes; ``self.server.spec`` says how to answer, ``self.server.seen`` keeps what was asked."""

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        spec = self.server.spec
        if self.path == "/health":
            return self._reply(200, None, raw=b"")
        if self.path.startswith("/server_info"):
            if not spec.get("dev_mode", True):
                return self._reply(404, {"detail": "Not Found"})
            return self._reply(200, spec.get("server_info", {"vllm_config": {"model_config": {
                "model": spec.get("model", str(MODEL)), "dtype": spec.get("dtype", "torch.float32"),
                "max_model_len": spec.get("max_model_len", 256), "logprobs_mode": spec.get("logprobs_mode", "processed_logprobs"),
                "skip_tokenizer_init": False},
                "parallel_config": {"worker_extension_cls": spec.get("extension", QUALNAME)},
                "lora_config": spec.get("lora_config")},
                "vllm_env": {"VLLM_BATCH_INVARIANT": spec.get("batch_invariant", False),
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING": spec.get("lora_updating", False)}}))
        if self.path == "/v1/models":
            return self._reply(200, {"object": "list", "data": [{"id": "tiny", "root": str(MODEL)}]})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802
        spec, body = self.server.spec, json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.seen.append((self.path, body))
        if self.path == "/collective_rpc":
            folder = Path(body["kwargs"]["weights_path"])
            self.server.staged.append({p.name: p.stat().st_size for p in folder.iterdir()})
            from safetensors import safe_open

            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(f, "pt") as opened:
                    self.server.keys.extend(opened.keys())
            if "reload_error" in spec:
                return self._reply(500, {"error": {"message": spec["reload_error"], "type": "InternalServerError"}})
            return self._reply(200, {"results": [None]})
        if self.path in ("/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return self._reply(200, None, raw=b"" if self.path == "/reset_prefix_cache" else b"Success: done.")
        if self.path == "/v1/completions":
            time.sleep(spec.get("delay", 0))
            if spec.get("garbage"):
                return self._reply(200, None, raw=b"<html>proxy error</html>")
            if body.get("prompt_logprobs") is not None:
                logps = [None] + [{str(t): {"logprob": -1.5, "rank": 1}} for t in body["prompt"][1:]]
                return self._reply(200, {"choices": [{"index": 0, "text": "", "prompt_logprobs": logps, "token_ids": [0]}]})
            tokens = [body["seed"] % 100, 7, body["prompt"][0]][: body["max_tokens"]]
            return self._reply(200, {"choices": [{"index": 0, "text": "x", "token_ids": tokens,
                                                  "logprobs": {"token_logprobs": [-0.25] * len(tokens)}}]})
        return self._reply(404, {"detail": "Not Found"})


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    server.spec, server.seen, server.staged, server.keys = {}, [], [], []
    server.block_on_close = False  # a reply held back (the slow server) does not hold the test
    server.handle_error = lambda request, address: None  # nor its write to a client gone, printed into another test
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def options(server=None, port: int | None = None, timeout: float = 5.0) -> VLLMOptions:
    url = f"http://127.0.0.1:{server.server_address[1] if server else port}"
    return VLLMOptions(vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=timeout)


def client(server, tmp_path: Path, dtype=torch.float32, max_model_len=128, timeout=5.0) -> VLLMServer:
    return VLLMServer(MODEL, dtype, options(server, timeout=timeout), max_model_len, tmp_path / "weights")


def test_samples_one_seeded_request_per_completion_and_reads_tokens_and_logps(stand_in, tmp_path):
    engine = client(stand_in, tmp_path)
    tokens, logps = engine.sample([[1, 5, 6], [1, 9]], [[11, 12], [13]], 3, Sampling(temperature=0.7, top_k=5),
                                  stop_ids=[2], stop_strings=["\n"])
    assert tokens == [[11, 7, 1], [12, 7, 1], [13, 7, 1]] and logps == [[-0.25] * 3] * 3
    sent = [body for path, body in stand_in.seen if path == "/v1/completions"]
    assert sorted(b["seed"] for b in sent) == [11, 12, 13]
    one = next(b for b in sent if b["seed"] == 13)
    assert one["prompt"] == [1, 9] and one["model"] == "tiny" and one["max_tokens"] == 3 and one["temperature"] == 0.7
    assert one["top_k"] == 5 and one["ignore_eos"] and one["stop_token_ids"] == [2] and one["stop"] == ["\n"]
    assert one["logprobs"] == 0 and one["return_token_ids"] and one["include_stop_str_in_output"]
    assert engine.probe_logps([1, 5, 6, 7]) == [-1.5] * 3


def test_a_sync_stages_the_inputs_names_reloads_them_then_deletes_them(stand_in, tmp_path):
    from waypoint.checkpointers.formats import checkpointer_for

    checkpointer = checkpointer_for(MODEL)
    native = checkpointer.load_checkpoint()["model"]
    engine = client(stand_in, tmp_path)
    engine.push(checkpointer.served_tensors(native))
    on_disk = set()
    from safetensors import safe_open

    for f in MODEL.glob("*.safetensors"):
        with safe_open(f, "pt") as opened:
            on_disk |= set(opened.keys())
    assert sorted(stand_in.keys) == sorted(on_disk)  # the input's own names: the declarative table run backwards
    rpc = [body for path, body in stand_in.seen if path == "/collective_rpc"]
    assert rpc[0]["method"] == "waypoint_reload" and rpc[0]["kwargs"]["weights_path"].endswith(SYNC_FOLDER)
    assert [p for p, _ in stand_in.seen][-1] == "/reset_prefix_cache"
    assert not (tmp_path / "weights").exists(), "the staged weights outlived the sync"
    # a directory of the user's is used, never removed
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep")
    stand_in.spec = {"extension": ""}  # a server without our worker extension: vLLM's own reload
    VLLMServer(MODEL, torch.float32, VLLMOptions(vllm_mode="server", vllm_server_base_url=engine.url), 128,
               tmp_path / "mine").push(checkpointer.served_tensors(native))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert [body for path, body in stand_in.seen if path == "/collective_rpc"][-1]["method"] == "reload_weights"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BROKEN = {  # id: (the stand-in's spec, what the client is asked, the line)
    "down": (None, "start", r"no vLLM server answers at http://127\.0\.0\.1:\d+ within vllm\.vllm_server_timeout=1 s "
                            r"\(.*refused.*\); start it as: VLLM_SERVER_DEV_MODE=1 python -m vllm\.entrypoints\.openai\.api_server "
                            r"--model .*tiny_llama --dtype "
                            r"float32 --logprobs-mode processed_logprobs --max-model-len 128 --worker-extension-cls "
                            r"waypoint\.sampling\.vllm_worker\.WaypointWorker, or set "
                            r"vllm\.vllm_server_base_url, or generation\.engine=native$"),
    "not_dev_mode": ({"dev_mode": False}, "start", r"has no /server_info: it was started without VLLM_SERVER_DEV_MODE=1"),
    "not_vllm": ({"server_info": {"hello": 1}}, "start", r"answered /server_info without vLLM's config: is it a vLLM server"),
    "dtype": ({"dtype": "torch.bfloat16"}, "start", r"computes in bfloat16, the policy in float32; start it as: "),
    "logprobs_mode": ({"logprobs_mode": "raw_logprobs"}, "start", r"gives raw_logprobs log-probs, not processed_logprobs"),
    "context": ({"max_model_len": 64}, "start", r"takes 64 tokens, the run's prompts and completions up to 128"),
    "another_model": ({"model": "{other}"}, "start", r"serves .*/other, another model than the run's .*tiny_llama "
                                                     r"\(hidden_size 32 there, \d+ here\)"),
    "slow": ({"delay": 3}, "sample", r"the vLLM server at http://127\.0\.0\.1:\d+ failed while sampling: /v1/completions: "
                                     r"no answer within vllm\.vllm_server_timeout=1 s; set generation\.engine=native"),
    "garbage": ({"garbage": True}, "sample", r"failed while sampling: /v1/completions answered something that is not JSON"),
    "reload_refused": ({"reload_error": "size mismatch for embed_tokens.weight: copying a param with shape [256, 64]"},
                       "push", r"failed while reloading the policy's weights: /collective_rpc answered HTTP 500: size mismatch for "
                               r"embed_tokens\.weight"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_broken_server_is_one_line(case, stand_in, tmp_path):
    spec, doing, says = BROKEN[case]
    if spec and spec.get("model") == "{other}":
        other = tmp_path / "other"
        other.mkdir()
        config = json.loads((MODEL / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
        spec = {"model": str(other)}
    stand_in.spec = spec or {}
    opts = options(port=closed_port(), timeout=1) if case == "down" else options(stand_in, timeout=1)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        engine = VLLMServer(MODEL, torch.float32, opts, 128, tmp_path / "weights")
        if doing == "sample":
            engine.sample([[1, 5]], [[3]], 4, Sampling(temperature=1.0), stop_ids=[])
        elif doing == "push":
            engine.push(iter([("model.embed_tokens.weight", torch.zeros(4, 4))]))
    message = str(caught.value)
    assert "\n" not in message and re.search(says, message), message
    assert message.startswith("generation.engine=vllm: ") and time.monotonic() - started < 10
    assert not (tmp_path / "weights").exists()


def test_a_lora_policy_is_loaded_as_an_adapter_where_the_server_takes_them(stand_in, tmp_path):
    engine = client(stand_in, tmp_path)
    assert engine.adapter_problem(4) == "the server was started without --enable-lora"
    stand_in.spec = {"lora_config": {"max_lora_rank": 8}}
    engine = client(stand_in, tmp_path)
    assert engine.adapter_problem(4).startswith("the server was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    stand_in.spec["lora_updating"] = True
    engine = client(stand_in, tmp_path)
    assert engine.adapter_problem(16) == "the server's --max-lora-rank 8 is below the adapter's rank 16"
    assert engine.adapter_problem(8) is None
    for lora_id in (1, 2):
        engine.use_adapter(tmp_path / f"adapter_{lora_id}", lora_id)
    calls = [(path, body.get("lora_name")) for path, body in stand_in.seen if "lora_adapter" in path]
    assert calls == [("/v1/load_lora_adapter", "policy-1"), ("/v1/load_lora_adapter", "policy-2"),
                     ("/v1/unload_lora_adapter", "policy-1")]
    engine.sample([[1, 5]], [[3]], 2, Sampling(temperature=1.0), stop_ids=[])
    assert stand_in.seen[-1][1]["model"] == "policy-2"


def test_batch_invariant_sampling_asks_for_a_server_started_so(stand_in, tmp_path):
    asked = VLLMOptions(vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{stand_in.server_address[1]}",
                        vllm_batch_invariant=True)
    with pytest.raises(CheckpointError, match=r"runs without its batch-invariant kernels \(vllm\.vllm_batch_invariant asks "
                                              r"for them\): start it with VLLM_BATCH_INVARIANT=1 in its environment; "):
        VLLMServer(MODEL, torch.float32, asked, 128, tmp_path / "weights")
    stand_in.spec = {"batch_invariant": True}
    VLLMServer(MODEL, torch.float32, asked, 128, tmp_path / "weights")


def test_a_run_with_no_server_is_one_line_before_its_first_step(tmp_path):
    from tests.recipe_runs import run_recipe
    from tests.test_dpo_bad_input import error_lines
    from tests.test_grpo_finetune import args

    out = tmp_path / "out"
    done = run_recipe("grpo", args("tiny_grpo", out, "+generation.engine=vllm",
                                   f"+vllm={{vllm_mode: server, vllm_server_port: {closed_port()}, vllm_server_host: "
                                   "127.0.0.1, vllm_server_timeout: 1}"))
    err = error_lines(done.stderr)
    assert done.returncode == 1 and len(err) == 1 and err[0].startswith("error: generation.engine=vllm: no vLLM server "
                                                                        "answers at http://127.0.0.1:"), err
    assert not list(out.glob("step_*")) and not (out / ".vllm_weights").exists()
