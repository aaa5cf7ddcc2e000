"""A LoRA policy's adapter as vLLM is given it (sampling/adapter_push.py), without vLLM: the PEFT adapter the run's
checkpoints hold, a new folder and id each push; and which adapters vLLM cannot serve (the merged weights go instead).
(vLLM serving it: tests/with_vllm/test_vllm_sampling.py.)"""

from __future__ import annotations

import json

import torch

from tests.conftest import ROOT
from waypoint.checkpointers.formats import checkpointer_for
from waypoint.checkpointers.load_model import model_from
from waypoint.checkpointers.peft_adapter import load_adapter
from waypoint.models.lora import adapter_state, apply_lora
from waypoint.sampling.adapter_push import AdapterPush


def lora_model(targets):
    checkpointer = checkpointer_for(ROOT / "assets/tiny_llama")
    model = model_from(checkpointer, checkpointer.load_checkpoint()["model"], "fp32")
    apply_lora(model, targets, rank=4, alpha=8)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return model, checkpointer.hf_converter()


def test_each_push_is_the_peft_adapter_as_the_model_holds_it_under_a_new_id(tmp_path):
    model, converter = lora_model(["q_proj", "v_proj", "w2"])
    assert AdapterPush.why_not(model, converter) is None
    push = AdapterPush(model, converter, tmp_path / "adapters")
    assert push.max_lora_rank == 8  # vLLM's smallest --max-lora-rank that holds rank 4
    first, id1 = push.write(model)
    read = load_adapter(first, converter)[0]
    mine = adapter_state(model)
    assert read.keys() == mine.keys() and all(torch.equal(read[k], mine[k]) for k in mine)
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    second, id2 = push.write(model)
    assert id2 == id1 + 1 and second != first and first.is_dir()  # the last one stays readable until the next is in use
    changed = load_adapter(second, converter)[0]
    assert any(not torch.equal(changed[k], read[k]) for k in read)
    push.close()
    assert not (tmp_path / "adapters").exists()


def test_an_adapter_vllm_cannot_serve_says_why():
    model, converter = lora_model(["q_proj", "output"])  # the head: not a LoRA module vLLM serves
    why = AdapterPush.why_not(model, converter)
    assert why is not None and why.startswith("target module(s) lm_head are not supported LoRA modules"), why


def test_the_adapter_goes_where_vllm_samples_fast_with_it_unless_the_config_says():
    from waypoint.sampling.vllm_options import VLLMOptions

    assert VLLMOptions().adapters_unwanted("cuda") is None
    assert VLLMOptions().adapters_unwanted("cpu").startswith("on the CPU vLLM's LoRA kernels sample about 2.7x slower")
    assert VLLMOptions(vllm_mode="server").adapters_unwanted("cpu") is None  # a server started with --enable-lora
    assert VLLMOptions(vllm_push_adapters=True).adapters_unwanted("cpu") is None
    assert VLLMOptions(vllm_push_adapters=False).adapters_unwanted("cuda") == "vllm.vllm_push_adapters=false"
