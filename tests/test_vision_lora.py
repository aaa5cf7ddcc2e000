"""LoRA on the parts of the vision towers a plain LoRALinear cannot take, against PEFT: Gemma 4's clamping linears (the
clamps kept around the adapted product, the adapter on the inner ``linear`` of transformers' Gemma4ClippableLinear, as
PEFT wraps it) and Gemma 3's projector, a bare matrix (PEFT's ``target_parameters``). The recipe's adapter loads with
``PeftModel.from_pretrained`` onto transformers' model and computes our logits on images; merged/ folds the update into
the weight and keeps the clamp bounds byte for byte; PEFT's own adapter of the projector loads and merges in ours; what
cannot be adapted is one line."""

from __future__ import annotations

import json

import pytest
import torch

from recipes import lora_finetune
from scripts import make_tiny_vlm
from tests.conftest import ROOT, needs
from tests.test_gemma4_vision import write_colours, write_vlm
from waypoint.checkpointers import HFCheckpointer, load_model
from waypoint.checkpointers.file_formats import read_tensors
from waypoint.checkpointers.peft_adapter import load_adapter
from waypoint.errors import CheckpointError
from waypoint.models.lora import apply_lora, load_adapter_state

pytestmark = needs("peft")
TOWER = "model.vision_tower.encoder.layers."


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """A tiny Gemma 4 VLM whose tower's clamps bind (inputs to +-1, outputs to +-0.1), and colour records for it."""
    directory = tmp_path_factory.mktemp("gemma4_vlm")
    write_vlm(directory / "base", clip=1.0)
    return directory / "base", write_colours(directory / "data.jsonl")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_tiny_vlm.make(tmp_path_factory.mktemp("gemma3_vlm") / "base")


def train(base, out, data, targets, *overrides):
    return lora_finetune.main(["--config", str(ROOT / "configs/tiny_vlm_lora.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={data}", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2",
                               "batch_size=2", "progress=off", "dataset.max_seq_len=256", f"lora.targets=[{targets}]",
                               *overrides])


def with_adapter(base, step, targets):
    """Our model of ``base`` as LoRA trains it, the adapter of ``step`` loaded into its LoRA layers."""
    checkpointer = HFCheckpointer(base, output_dir=step.parent / "unused")
    checkpointer.load_checkpoint()  # it learns how the repo nests its parts (the adapter's module names)
    model = load_model(base)
    apply_lora(model, targets, rank=16, alpha=32)
    load_adapter_state(model, load_adapter(step, checkpointer.hf_converter())[0])
    return model.eval()


def test_lora_on_gemma4s_clamping_tower_loads_in_peft(gemma4, tmp_path):
    """``vision.q_proj`` and ``vision.down_proj`` of Gemma 4's clamping tower: PEFT wraps the inner ``linear`` of those
    two only and computes, on images, what our merged model and our LoRA model compute (each within 1e-4); without the
    clamps PEFT's logits are others, so the clamps are in the product; merged/ keeps every bound byte for byte."""
    from peft import PeftModel
    from transformers import Gemma4ForConditionalGeneration

    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.data.collate import vision_collate
    from waypoint.data.vision_chat_dataset import VisionChatDataset

    base, data = gemma4
    targets = ["q_proj", "v_proj", "vision.q_proj", "vision.down_proj"]
    assert train(base, tmp_path / "out", data, ",".join(targets), "optimizer.lr=5e-2") == 0
    step = tmp_path / "out/step_2"
    assert f"base_model.model.{TOWER}0.self_attn.q_proj.linear.lora_A.weight" in read_tensors(step / "adapter_model.safetensors")
    peft = PeftModel.from_pretrained(Gemma4ForConditionalGeneration.from_pretrained(base), step).eval()
    wrapped = {name.split(".lora_")[0] for name, _ in peft.named_parameters() if ".lora_" in name}
    assert {n.split(TOWER)[1] for n in wrapped if TOWER in n} == {
        f"{i}.{m}.linear" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
    tokenizer = load_tokenizer(base)
    records = VisionChatDataset(data, tokenizer, max_seq_len=256)
    batch = vision_collate([records[0], records[3]], tokenizer.pad_id)
    images = {k: batch[k] for k in ("pixel_values", "image_position_ids", "mm_token_type_ids")}
    with torch.no_grad():
        theirs = peft(input_ids=batch["tokens"], **images).logits
        merged = load_model(step / "merged").eval()(batch["tokens"], **images)
        live = with_adapter(base, step, targets)(batch["tokens"], **images)
        for name, bound in peft.named_buffers():
            if TOWER in name and name.endswith(("_min", "_max")):
                bound.mul_(float("inf"))  # -inf, +inf: no clamp
        unclamped = peft(input_ids=batch["tokens"], **images).logits
    assert (merged - theirs).abs().max().item() <= 1e-4 and (live - theirs).abs().max().item() <= 1e-4
    assert (unclamped - theirs).abs().max().item() > 1e-3
    before, after = read_tensors(base / "model.safetensors"), read_tensors(step / "merged/model.safetensors")
    assert before.keys() == after.keys()
    assert not torch.equal(before[f"{TOWER}0.self_attn.q_proj.linear.weight"], after[f"{TOWER}0.self_attn.q_proj.linear.weight"])
    assert torch.equal(before[f"{TOWER}0.self_attn.k_proj.linear.weight"], after[f"{TOWER}0.self_attn.k_proj.linear.weight"])
    bounds = [k for k in before if k.endswith(("_min", "_max"))]
    assert len(bounds) == 2 * 7 * 4 and all(torch.equal(before[k], after[k]) for k in bounds)


def test_lora_on_gemma3s_projector_loads_in_peft(gemma3, tmp_path):
    """``vision.mm_input_projection_weight``: the adapter names it in ``target_parameters`` (PEFT's ParamWrapper on the
    projector module), PEFT computes on an image what our merged model and our LoRA model compute, merged/ holds the
    adapted matrix, the projector's norm as it came."""
    from peft import PeftModel
    from peft.tuners.lora import ParamWrapper
    from transformers import Gemma3ForConditionalGeneration

    from tests.test_vlm_recipes import DATA, inputs

    targets = ["q_proj", "vision.mm_input_projection_weight"]
    assert train(gemma3, tmp_path / "out", DATA / "colours.jsonl", ",".join(targets), "optimizer.lr=2e-2") == 0
    step = tmp_path / "out/step_2"
    config = json.loads((step / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["model.multi_modal_projector.mm_input_projection_weight"]
    peft = PeftModel.from_pretrained(Gemma3ForConditionalGeneration.from_pretrained(gemma3), step).eval()
    assert isinstance(peft.base_model.model.model.multi_modal_projector, ParamWrapper)
    batch = inputs(gemma3, DATA / "held_out/green.png")
    images = {"pixel_values": batch["pixel_values"], "token_type_ids": batch["token_type_ids"]}
    with torch.no_grad():
        theirs = peft(**batch).logits
        merged = load_model(step / "merged").eval()(batch["input_ids"], **images)
        live = with_adapter(gemma3, step, targets)(batch["input_ids"], **images)
    assert (merged - theirs).abs().max().item() <= 1e-4 and (live - theirs).abs().max().item() <= 1e-4
    before, after = read_tensors(gemma3 / "model.safetensors"), read_tensors(step / "merged/model.safetensors")
    matrix, norm = "multi_modal_projector.mm_input_projection_weight", "multi_modal_projector.mm_soft_emb_norm.weight"
    assert (before[matrix] - after[matrix]).abs().max().item() > 1e-3 and torch.equal(before[norm], after[norm])


def test_peft_adapter_of_the_projector_merges_in_ours(gemma3, tmp_path):
    """An adapter PEFT itself wrote (``target_parameters`` by the projector's short name, the language model's q_proj
    beside it) reads into our native keys and merges onto the base as PEFT's ``merge_and_unload`` does."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForConditionalGeneration

    from waypoint.models.lora import merge_state_dict

    config = LoraConfig(r=2, lora_alpha=6, target_modules=r"model\.language_model\..*\.q_proj",
                        target_parameters=["mm_input_projection_weight"])
    peft = get_peft_model(Gemma3ForConditionalGeneration.from_pretrained(gemma3), config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    peft.save_pretrained(tmp_path / "adapter")
    checkpointer = HFCheckpointer(gemma3, output_dir=tmp_path / "unused")
    state = checkpointer.load_checkpoint()["model"]
    adapter, _ = load_adapter(tmp_path / "adapter", checkpointer.hf_converter(), state)
    assert {"projector.lora_A.weight", "projector.lora_B.weight", "layers.0.attn.q_proj.lora_A.weight"} <= adapter.keys()
    merged = merge_state_dict({k: state[k] for k in state}, adapter, 3.0)
    theirs = peft.merge_and_unload().state_dict()
    assert (merged["projector.weight"] - theirs["model.multi_modal_projector.mm_input_projection_weight"]).abs().max() <= 1e-6
    assert not torch.equal(merged["projector.weight"], state["projector.weight"])


def test_image_side_targets_that_cannot_be_are_one_line(gemma3, gemma4):
    """Dropout with the projector (PEFT's ParamWrapper refuses it), the projector of a model that has none, a tower
    linear this tower lacks: each one line naming the target and what to do or choose."""
    cases = [(gemma3, ["q_proj", "vision.mm_input_projection_weight"], 0.1, "lora.dropout must be 0 with the target vision.projector"),
             (gemma4[0], ["q_proj", "vision.projector"], 0.0, "image side has no projector; its targets: vision.q_proj"),
             (gemma3, ["q_proj", "vision.gate_proj"], 0.0, "image side has no gate_proj; its targets: vision.q_proj")]
    for base, targets, dropout, message in cases:
        with pytest.raises(CheckpointError, match=message) as e:
            apply_lora(load_model(base), targets, rank=2, alpha=4, dropout=dropout)
        assert "\n" not in str(e.value)
