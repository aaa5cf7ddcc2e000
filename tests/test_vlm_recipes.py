"""Vision-language fine-tuning through the real recipes, on the tiny Gemma 3 VLM that ``scripts/make_tiny_vlm.py``
writes and the colour-naming images of ``assets/tiny_vlm``: the full fine-tune learns to name the colour of images
it never saw with the tower frozen byte for byte; its output is the input's files and transformers computes our
logits from it; the LoRA adapter loads in PEFT onto transformers' model with our logits; a preempted run resumes
bit-identical; a bad image stops the run before step 1 in one line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from recipes import full_finetune, generate, lora_finetune
from scripts import make_tiny_vlm
from tests.conftest import ROOT, sigterm_at_step
from waypoint.checkpointers import load_model
from waypoint.checkpointers.file_formats import read_tensors

pytest.importorskip("transformers")
DATA = ROOT / "assets/tiny_vlm"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_vlm.make(tmp_path_factory.mktemp("vlm") / "base")


def run(recipe, base, out, *overrides, stop_at=None):
    config = "tiny_vlm" if recipe is full_finetune else "tiny_vlm_lora"
    with sigterm_at_step(stop_at):
        return recipe.main(["--config", str(ROOT / f"configs/{config}.yaml"), f"checkpointer.checkpoint_dir={base}",
                            f"dataset.source={DATA / 'colours.jsonl'}", f"output_dir={out}", "progress=off", *overrides])


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def inputs(checkpoint, image):
    """transformers' processor's inputs for a question about ``image`` (the oracle's own preprocessing)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt", images=[Image.open(image)])


def answer(checkpoint, image) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert generate.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={checkpoint}",
                              f"image={image}", "prompt=What colour is this?", "max_new_tokens=8"]) == 0
    return out.getvalue().strip()


def test_full_finetune_names_unseen_colours_and_keeps_the_tower(base, tmp_path):
    from transformers import Gemma3ForConditionalGeneration

    assert run(full_finetune, base, tmp_path / "out") == 0
    curve = losses(tmp_path / "out")
    assert curve[-1] < curve[0] / 100, curve
    final = tmp_path / "out/step_120"
    named = {p.stem: answer(final, p) for p in sorted((DATA / "held_out").glob("*.png"))}
    print(f"\ntiny VLM, loss {curve[0]:.3f} -> {curve[-1]:.4f}; held-out images: {named}")
    assert sum(colour.capitalize() in said for colour, said in named.items()) >= 5, named
    before, after = read_tensors(base / "model.safetensors"), read_tensors(final / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("vision_tower."))  # frozen
    assert not torch.equal(before["multi_modal_projector.mm_input_projection_weight"],
                           after["multi_modal_projector.mm_input_projection_weight"])  # the projector trains
    batch = inputs(final, DATA / "held_out/red.png")
    with torch.no_grad():
        theirs = Gemma3ForConditionalGeneration.from_pretrained(final).eval()(**batch).logits
        ours = load_model(final).eval()(batch["input_ids"], pixel_values=batch["pixel_values"],
                                          token_type_ids=batch["token_type_ids"])
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_freeze_vision_false_trains_the_tower(base, tmp_path):
    assert run(full_finetune, base, tmp_path / "out", "freeze_vision=false", "epochs=1", "max_steps_per_epoch=2") == 0
    before, after = read_tensors(base / "model.safetensors"), read_tensors(tmp_path / "out/step_2/model.safetensors")
    assert not torch.equal(before["vision_tower.encoder.layers.0.self_attn.q_proj.weight"],
                           after["vision_tower.encoder.layers.0.self_attn.q_proj.weight"])


def test_lora_adapter_loads_in_peft_with_our_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import Gemma3ForConditionalGeneration

    assert run(lora_finetune, base, tmp_path / "out", "epochs=1", "max_steps_per_epoch=4", "optimizer.lr=2e-2") == 0
    step = tmp_path / "out/step_4"
    config = json.loads((step / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], str) and config["target_modules"].startswith(r"model\.language_model\.")
    batch = inputs(base, DATA / "held_out/blue.png")
    peft = PeftModel.from_pretrained(Gemma3ForConditionalGeneration.from_pretrained(base), step).eval()
    assert not any("vision_tower" in name and "lora_" in name for name, _ in peft.named_parameters())
    with torch.no_grad():
        theirs = peft(**batch).logits
        ours = load_model(step / "merged").eval()(batch["input_ids"], pixel_values=batch["pixel_values"],
                                                  token_type_ids=batch["token_type_ids"])
        unadapted = Gemma3ForConditionalGeneration.from_pretrained(base).eval()(**batch).logits
    assert (ours - theirs).abs().max().item() <= 1e-4 < (unadapted - theirs).abs().max().item()
    before, merged = read_tensors(base / "model.safetensors"), read_tensors(step / "merged/model.safetensors")
    assert before.keys() == merged.keys()
    assert all(torch.equal(before[k], merged[k]) for k in before if not k.startswith("language_model."))


def test_preempted_run_resumes_bit_identical(base, tmp_path):
    short = ("epochs=1", "max_steps_per_epoch=4", "save_every_n_steps=2")
    assert run(full_finetune, base, tmp_path / "straight", *short) == 0
    assert run(full_finetune, base, tmp_path / "stopped", *short, stop_at=3) == 75
    assert run(full_finetune, base, tmp_path / "stopped", *short) == 0
    mine = read_tensors(tmp_path / "stopped/step_4/model.safetensors")
    theirs = read_tensors(tmp_path / "straight/step_4/model.safetensors")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")


@pytest.mark.parametrize("image, says", [("missing.png", "image file not found"), ("bad.png", "not an image"),
                                         ("https://example.com/red.png", "is a URL")])
def test_a_bad_image_stops_the_run_before_step_1(base, tmp_path, capsys, image, says):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG but not really")
    record = json.loads((DATA / "colours.jsonl").read_text().splitlines()[0])
    good = str(DATA / record["images"][0])
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({**record, "images": [good]}) + "\n" + json.dumps({**record, "images": [image]}) + "\n")
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny_vlm.yaml"), f"checkpointer.checkpoint_dir={base}",
                               f"dataset.source={data}", f"output_dir={tmp_path / 'out'}", "progress=off"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and says in err[0] and "data.jsonl" in err[0], err
    assert not any((tmp_path / "out").glob("step_*"))


def test_two_processes_train_what_one_does(base, tmp_path):
    """torchrun (FSDP2; the tower in the root unit, frozen): 2 processes compute 1's losses, the tower stays as it came."""
    from tests.recipe_runs import run_recipe

    short = (f"checkpointer.checkpoint_dir={base}", f"dataset.source={DATA / 'colours.jsonl'}", "epochs=1",
             "max_steps_per_epoch=2", "progress=off", "optimizer._target_=torch.optim.SGD")
    assert run(full_finetune, base, tmp_path / "one", *short[2:], "batch_size=8") == 0
    done = run_recipe("full", ["--config", str(ROOT / "configs/tiny_vlm.yaml"), f"output_dir={tmp_path / 'two'}",
                               "batch_size=4", *short], processes=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "one"), losses(tmp_path / "two"))) < 1e-5
    before, after = read_tensors(base / "model.safetensors"), read_tensors(tmp_path / "two/step_2/model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("vision_tower."))


def test_qlora_holds_the_language_model_in_nf4_and_the_tower_as_it_came(base, tmp_path, capsys):
    code = run(lora_finetune, base, tmp_path / "out", "epochs=1", "max_steps_per_epoch=2", "+quantize_base=nf4",
               "+nf4={block_size: 64, scaler_block_size: 8, output: false}")
    out = capsys.readouterr().out
    assert code == 0 and "nf4: 14 frozen base weights" in out, out[-2000:]  # the 2 layers' 7 linears; no tower's
    before, merged = read_tensors(base / "model.safetensors"), read_tensors(tmp_path / "out/step_2/merged/model.safetensors")
    assert before.keys() == merged.keys()
    assert all(torch.equal(before[k], merged[k]) for k in before if not k.startswith("language_model."))


def test_lora_on_the_tower_by_transformers_names_loads_in_peft(base, tmp_path):
    """``vision.out_proj`` and ``vision.fc1`` (transformers' names in the tower) beside the language model's: PEFT puts
    the adapter on both parts of Gemma3ForConditionalGeneration and computes our merged model's logits on an image;
    merged/ holds the tower's adapted weights."""
    from peft import PeftModel
    from transformers import Gemma3ForConditionalGeneration

    assert run(lora_finetune, base, tmp_path / "out", "epochs=1", "max_steps_per_epoch=3", "optimizer.lr=2e-2",
               "lora.targets=[q_proj,v_proj,vision.out_proj,vision.fc1]") == 0
    step = tmp_path / "out/step_3"
    config = json.loads((step / "adapter_config.json").read_text())
    peft = PeftModel.from_pretrained(Gemma3ForConditionalGeneration.from_pretrained(base), step).eval()
    wrapped = {name.split(".lora_")[0] for name, _ in peft.named_parameters() if ".lora_" in name}
    assert any("vision_tower" in n and n.endswith("self_attn.out_proj") for n in wrapped), sorted(wrapped)[:6]
    assert any("vision_tower" in n and n.endswith("mlp.fc1") for n in wrapped)
    assert not any("vision_tower" in n and n.endswith("q_proj") for n in wrapped), config["target_modules"]
    batch = inputs(base, DATA / "held_out/green.png")
    with torch.no_grad():
        theirs = peft(**batch).logits
        ours = load_model(step / "merged").eval()(batch["input_ids"], pixel_values=batch["pixel_values"],
                                                  token_type_ids=batch["token_type_ids"])
    assert (ours - theirs).abs().max().item() <= 1e-4
    before, merged = read_tensors(base / "model.safetensors"), read_tensors(step / "merged/model.safetensors")
    assert not torch.equal(before["vision_tower.encoder.layers.0.self_attn.out_proj.weight"],
                           merged["vision_tower.encoder.layers.0.self_attn.out_proj.weight"])
    assert torch.equal(before["vision_tower.encoder.layers.0.self_attn.q_proj.weight"],
                       merged["vision_tower.encoder.layers.0.self_attn.q_proj.weight"])


def test_tower_targets_that_do_not_fit_are_one_line(base):
    from waypoint.errors import CheckpointError
    from waypoint.models.lora import apply_lora

    with pytest.raises(CheckpointError, match=r"vision\.nope") as e:
        apply_lora(load_model(base), ["q_proj", "vision.nope"], rank=2, alpha=4)
    assert "\n" not in str(e.value) and "vision.qkv" in str(e.value)  # transformers' names are offered too
    with pytest.raises(CheckpointError, match="vision tower, which this model does not have"):
        apply_lora(load_model(ROOT / "assets/tiny_llama"), ["q_proj", "vision.q_proj"], rank=2, alpha=4)


def test_packing_images_is_refused_in_one_line(base, tmp_path, capsys):
    """A pack would lose its rows' images (and their bidirectional masks): refused before step 1, not trained silently."""
    assert run(full_finetune, base, tmp_path / "out", "packed=true") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: packed: true does not pack conversations with images yet; set packed: false"], err
