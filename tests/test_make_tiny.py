"""scripts/make_tiny.py: every kind it makes (each family, and the multimodal repos) is what transformers reads as that
family, with our native model's logits (text, and with an image for the multimodal ones); its tokenizer and the
family's chat template render a conversation as transformers' ``apply_chat_template`` does, and generation stops at
the template's end of turn; the full fine-tune takes one, with its own template."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from scripts import make_tiny
from tests.conftest import ROOT, on_test_device
from tests.recipe_runs import run_recipe, run_script
from waypoint.checkpointers import load_model
from waypoint.families import family_named
from waypoint.text.chat_template import load_chat_template
from waypoint.text.stop_tokens import stop_token_ids
from waypoint.text.tokenizer import load_tokenizer

pytest.importorskip("transformers")

TEMPLATED = [name for name, kind in make_tiny.KINDS.items() if kind.template]
MULTIMODAL = [name for name, kind in make_tiny.KINDS.items() if kind.vision]
CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of Peru?"},
                {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "And of Chile?"}]
NO_SYSTEM = {"gemma", "gemma2"}  # their templates refuse a system turn


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> the folder make_tiny wrote (each made once for the module, when a test first asks)."""
    folders = {}

    def get(name: str):
        if name not in folders:
            folders[name] = make_tiny.make(name, tmp_path_factory.mktemp(name) / "tiny")
        return folders[name]
    return get


@pytest.fixture(scope="module")
def models(made):
    """name -> (its folder, transformers' model of it, ours), each loaded once for the module."""
    import transformers

    loaded = {}

    def get(name: str):
        if name not in loaded:
            path = made(name)
            config = json.loads((path / "config.json").read_text())
            cls = getattr(transformers, config["architectures"][0]) if "text_config" in config else transformers.AutoModelForCausalLM
            loaded[name] = path, *on_test_device(cls.from_pretrained(path, dtype=torch.float32).eval(), load_model(path).eval())
        return loaded[name]
    return get


@pytest.mark.parametrize("name", list(make_tiny.KINDS))
def test_transformers_reads_each_kind_as_its_family_with_our_logits(models, name):
    path, hf, ours = models(name)
    family = family_named(make_tiny.KINDS[name].family)
    assert type(hf).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    assert (type(hf).__name__ == family.architecture) == (name not in MULTIMODAL)
    tokens = torch.randint(4, hf.config.get_text_config().vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    tokens = on_test_device(tokens)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        diff = (ours(tokens) - expected).abs().max().item()
    assert diff <= 1e-5 and expected.abs().max() > 0.1, (name, diff)
    assert sum(p.numel() for p in ours.parameters()) < 2_000_000


@pytest.mark.parametrize("name", MULTIMODAL)
def test_each_multimodal_kind_reads_an_image_with_transformers_logits(models, name):
    """The checkpoint's processor files, as ``waypoint.vision`` reads them, make the inputs of an image; transformers'
    model and ours give the same logits on them."""
    from waypoint.vision.processors import image_processor_for

    path, hf, ours = models(name)
    tokenizer = load_tokenizer(path)
    processor = image_processor_for(path, tokenizer)
    image = Image.open(ROOT / "assets/tiny_vlm/images/blue_0.png")  # 48 x 36: resized by each processor
    ids = tokenizer.encode(f"Look: {processor.expansion(image)} Which colour?")
    assert ids.count(processor.image_token_id) > 1
    inputs = {**processor.model_inputs([image]), processor.token_type_key: torch.tensor([processor.token_types(ids)])}
    tokens, inputs = on_test_device(torch.tensor([ids]), inputs)
    with torch.no_grad():
        expected = hf(input_ids=tokens, **inputs).logits
        diff = (ours(tokens, **inputs) - expected).abs().max().item()
    assert diff <= 1e-5, (name, diff)


@pytest.mark.parametrize("name", TEMPLATED)
def test_the_family_template_renders_as_transformers_and_stops_at_its_end_of_turn(made, name):
    from transformers import AutoTokenizer

    path = made(name)
    kind = make_tiny.KINDS[name]
    messages = CONVERSATION[1:] if name in NO_SYSTEM else CONVERSATION
    theirs = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    tokenizer = load_tokenizer(path)
    template = load_chat_template(tokenizer)
    assert template.text == (ROOT / "assets" / kind.template).read_text(encoding="utf-8")
    ours = tokenizer.encode_with_offsets(template.render(messages, add_generation_prompt=True))[0]
    assert ours == theirs["input_ids"]
    end = tokenizer.encode_with_offsets(kind.end_of_turn)[0]
    assert len(end) == 1 and end[0] in stop_token_ids(tokenizer, template)
    for token in kind.special + kind.added:  # each one token, as in the release's tokenizer
        assert len(tokenizer.encode_with_offsets(token)[0]) == 1, token


def test_one_full_fine_tune_step_on_a_tiny_qwen3_5_with_its_own_template(made, tmp_path):
    from transformers import AutoModelForCausalLM

    path = made("qwen3_5")
    done = run_recipe("full", ["--config", str(ROOT / "configs/tiny_chat.yaml"), f"checkpointer.checkpoint_dir={path}",
                               "dataset.template=null", f"output_dir={tmp_path / 'run'}", "epochs=1", "max_steps_per_epoch=1",
                               "batch_size=2", "progress=off"])
    assert done.returncode == 0, done.stderr[-2000:]
    step = tmp_path / "run/step_1"
    assert (step / "chat_template.jinja").read_text() == (ROOT / "assets/chat_templates/qwen3_5.jinja").read_text()
    assert type(AutoModelForCausalLM.from_pretrained(step)).__name__ == "Qwen3_5ForCausalLM"


def test_list_names_every_kind_and_the_written_folder_names_a_run_to_try(tmp_path):
    listed = run_script("make_tiny", ["--list"])
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(make_tiny.KINDS)
    assert all(kind.note in listed.stdout for kind in make_tiny.KINDS.values())
    done = run_script("make_tiny", ["mistral", str(tmp_path / "m"), "--seed", "3"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (f"try: python recipes/full_finetune.py --config configs/tiny.yaml "
                                            f"checkpointer.checkpoint_dir={tmp_path / 'm'} output_dir={tmp_path / 'm'}_run")
    assert not (tmp_path / "m/chat_template.jinja").exists()  # no verified copy of Mistral's ships
