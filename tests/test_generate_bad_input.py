"""Bad input to recipes/generate.py: every case one ``error:`` line naming the option, file or key and what to do,
exit status 1, no traceback. A new check of generate.py gets its row in CASES."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import tiny_llama_config, write_hf_checkpoint
from tests.test_generate import TINY, lora_adapter_of, run_generate
from waypoint.text.template_sandbox import STEP_LIMIT

PROMPT_TOO_LONG = "hello world " * 300  # 1501 tokens


def checkpoint(tmp: Path, **files: str) -> Path:
    """A copy of the tiny checkpoint with ``files`` (name -> text) written into it."""
    shutil.copytree(TINY, tmp / "ckpt")
    for name, text in files.items():
        (tmp / "ckpt" / name).write_text(text)
    return tmp / "ckpt"


def tokenizer_config(tmp: Path, **fields) -> Path:
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    return checkpoint(tmp, **{"tokenizer_config.json": json.dumps({**config, **fields})})


def template_file(tmp: Path, text: str) -> Path:
    (tmp / "template.jinja").write_text(text)
    return tmp / "template.jinja"


def committed_step(tmp: Path) -> Path:
    """The tiny checkpoint committed with a MANIFEST.json, as a run writes a step, then a shard damaged in place."""
    from waypoint.checkpointers.commit import StagedDir

    with StagedDir(tmp / "step_1") as stage:
        for f in sorted(TINY.iterdir()):
            stage.copy_file(f)
    shard = tmp / "step_1" / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1000:-900] = b"\xff" * 100  # the same size: only the hash tells
    shard.write_bytes(bytes(data))
    return tmp / "step_1"


def other_base_adapter(tmp: Path, **shape) -> Path:
    """An adapter trained on another tiny Llama (``shape``: tiny_llama_config's arguments)."""
    write_hf_checkpoint(tmp / "other", tiny_llama_config(**shape))
    return lora_adapter_of(tmp / "other", tmp / "adapter")


def adapter_edit(tmp: Path, change) -> Path:
    """Our adapter of the tiny checkpoint, ``change(config)`` made to its adapter_config.json (manifest removed,
    as PEFT writes adapters)."""
    adapter = lora_adapter_of(TINY, tmp / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    change(config)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "MANIFEST.json").unlink()
    return adapter


def damaged_adapter(tmp: Path) -> Path:
    adapter = lora_adapter_of(TINY, tmp / "adapter")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    return adapter


def vlm_asked_about(tmp: Path, image: bytes | str) -> list[str]:
    """Overrides that ask the tiny Gemma 3 VLM (scripts/make_tiny_vlm.py's) about ``image``: a file of these bytes,
    or the text given as image=."""
    from scripts import make_tiny_vlm

    if isinstance(image, bytes):
        (tmp / "bad.png").write_bytes(image)
        image = str(tmp / "bad.png")
    return [f"checkpoint_dir={make_tiny_vlm.make(tmp / 'vlm')}", f"image={image}", "prompt=What colour is this?"]


BROKEN = "{% for m in messages %}{{ m.content }}"  # no endfor
UNSAFE = "{{ messages[0].content.__class__.__mro__ }}"
HANGS = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"  # hung generate.py before
NO_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
ADAPTER_PATH = r"adapter_model\.safetensors: base_model\.model\.model\.layers\.\d\.self_attn\.[qv]_proj\.lora_[AB]\.weight"
OTHER_BASE = r"the adapter was trained for another base model \(see base_model_name_or_path in its adapter_config\.json\)$"

# (case id, the overrides (a function of a fresh tmp_path), the one error line expected (a regex))
CASES = [
    ("prompt_too_long", lambda t: [f"prompt={PROMPT_TOO_LONG}", "max_new_tokens=400"],
     r"prompt: 1501 tokens, more than the model's 512 positions; shorten it to at most 113 tokens to leave room for "
     r"max_new_tokens=400$"),
    ("prompt_too_long_with_a_template", lambda t: [f"prompt={PROMPT_TOO_LONG}", "chat_template=chatml", "max_new_tokens=600"],
     r"prompt: 15\d\d tokens, more than the model's 512 positions; shorten it to at most 512 tokens$"),
    ("image_for_a_text_model", lambda t: ["prompt=Hi", "image=red.png"],
     r"image=red\.png: \S+ is a text model \(no vision tower\); leave out image=$"),
    # a file that is no image: what to do with image= (a dataset's "or drop the record" means nothing here)
    ("image_not_an_image", lambda t: vlm_asked_about(t, b"not an image"),
     r"image=\S+/bad\.png: \S+/bad\.png is not an image PIL can read \(formats read: PNG, JPEG, .*\); point image= at a "
     r"readable image file \(PNG, JPEG, \.\.\.\)$"),
    ("image_empty", lambda t: vlm_asked_about(t, b""),
     r"image=\S+/bad\.png: \S+/bad\.png is empty \(0 bytes\); point image= at a readable image file \(PNG, JPEG, \.\.\.\)$"),
    ("image_a_url", lambda t: vlm_asked_about(t, "https://example.com/red.png"),  # no data file to be relative to
     r"image=https://example\.com/red\.png: 'https://example\.com/red\.png' is a URL; images are read from local files "
     r"only: download it and give its path$"),
    ("chat_template_unknown", lambda t: ["prompt=Hi", "chat_template=bogus"],
     r"chat_template=bogus: expected null \(the checkpoint's own\), alpaca, chatml, llama3 or a \.jinja file$"),
    ("template_file_does_not_compile", lambda t: ["prompt=Hi", f"chat_template={template_file(t, BROKEN)}"],
     r"template\.jinja: chat template does not compile \(line 1\): .*; choose another chat_template \(alpaca, chatml, llama3 or "
     r"a \.jinja file\), or plain_text=true for plain text$"),
    ("template_file_refused_by_the_sandbox", lambda t: ["prompt=Hi", f"chat_template={template_file(t, UNSAFE)}"],
     r"template\.jinja: chat template refused \(line 1\): SecurityError: access to attribute '__class__' of 'str' "
     r"object is unsafe\.; choose another chat_template"),
    ("own_template_does_not_compile", lambda t: [f"checkpoint_dir={checkpoint(t, **{'chat_template.jinja': BROKEN})}",
                                                 "prompt=Hi"],
     r"ckpt/chat_template\.jinja: chat template does not compile \(line 1\): .*or plain_text=true for plain text$"),
    ("own_template_refused_by_the_sandbox", lambda t: [f"checkpoint_dir={checkpoint(t, **{'chat_template.jinja': UNSAFE})}",
                                                       "prompt=Hi"],
     r"ckpt/chat_template\.jinja: chat template refused \(line 1\): SecurityError: .*or plain_text=true for plain text$"),
    ("template_past_its_limits", lambda t: ["prompt=Hi", f"chat_template={template_file(t, HANGS)}"],
     rf"template\.jinja: chat template stopped \(line 1\): it ran past {STEP_LIMIT:,} steps .*; choose another chat_template"),
    ("template_refuses_the_system_message", lambda t: ["prompt=Hi", "system=Be brief.",
                                                       f"chat_template={template_file(t, NO_SYSTEM)}"],
     r"template\.jinja: chat template failed \(line 1\): TemplateError: System role not supported; leave out system=, or "
     r"choose another chat_template"),
    ("own_template_not_a_string", lambda t: [f"checkpoint_dir={tokenizer_config(t, chat_template=3)}", "prompt=Hi"],
     r"ckpt/tokenizer_config\.json \(chat_template\): expected a string or a list of \{name, template\} objects, got int$"),
    ("own_templates_without_default", lambda t: ["prompt=Hi", "checkpoint_dir=" + str(tokenizer_config(
        t, chat_template=[{"name": "tool_use", "template": "x"}]))],
     r"ckpt/tokenizer_config\.json \(chat_template\): no template named 'default' among tool_use; .*plain_text=true"),
    ("plain_text_and_a_template", lambda t: ["prompt=Hi", "plain_text=true", "chat_template=chatml"],
     r"plain_text=true and chat_template=chatml: choose one$"),
    ("plain_text_not_a_boolean", lambda t: ["prompt=Hi", "plain_text=maybe"], r"plain_text=maybe: expected true or false$"),
    ("step_fails_its_manifest", lambda t: [f"checkpoint_dir={committed_step(t)}", "prompt=Hi"],
     r"checkpoint_dir=.*/step_1: fails its MANIFEST\.json \(model-00002-of-00003\.safetensors does not match its hash\): "
     r"damaged or incomplete; use another step, or copy it again$"),
    ("adapter_fails_its_manifest", lambda t: [f"adapter_dir={damaged_adapter(t)}", "prompt=Hi"],
     r"adapter_dir=.*/adapter: fails its MANIFEST\.json \(adapter_model\.safetensors does not match its hash\)"),
    ("adapter_of_a_narrower_base", lambda t: [f"adapter_dir={other_base_adapter(t)}", "prompt=Hi"],
     rf"{ADAPTER_PATH} has shape \[(4, 64|64, 4)\], but the base's model\.layers\.\d\.self_attn\.[qv]_proj\.weight is "
     rf"\[\d+, 128\]; {OTHER_BASE}"),
    ("adapter_of_a_deeper_base", lambda t: [f"adapter_dir={other_base_adapter(t, hidden=128, head_dim=32, layers=6, vocab=512)}",
                                           "prompt=Hi"],
     rf"adapter_model\.safetensors: base_model\.model\.model\.layers\.[45]\.self_attn\.[qv]_proj\.lora_[AB]\.weight adapts "
     rf"model\.layers\.[45]\.self_attn\.[qv]_proj, which the base model lacks; {OTHER_BASE}"),
    ("checkpoint_dir_missing", lambda t: [f"checkpoint_dir={t / 'nope'}", "prompt=Hi"],
     r"nope: not a recognised checkpoint directory \(no config\.json, .*\)$"),
    ("checkpoint_dir_a_number", lambda t: ["checkpoint_dir=7", "prompt=Hi"], r"checkpoint_dir=7: expected a non-empty string"),
    ("adapter_dir_missing", lambda t: [f"adapter_dir={t / 'nope'}", "prompt=Hi"], r"nope/adapter_config\.json: missing"),
    ("prompt_a_number", lambda t: ["prompt=42"], r"""prompt=42: expected null or a non-empty string \(text Hydra reads as a """
     r"""number or true/false is quoted: key='"42"'\)$"""),
    ("system_a_boolean", lambda t: ["prompt=Hi", "system=true"], r"system=true: expected null or a non-empty string"),
    ("chat_not_a_boolean", lambda t: ["chat=maybe"], r"chat=maybe: expected true or false$"),
    ("nothing_to_do", lambda t: [], r"nothing to do: give prompt=\"\.\.\.\" or chat=true$"),
    ("max_new_tokens_zero", lambda t: ["prompt=Hi", "max_new_tokens=0"], r"max_new_tokens=0: expected an integer >= 1$"),
    ("temperature_negative", lambda t: ["prompt=Hi", "temperature=-1"], r"temperature=-1: expected a number >= 0$"),
    ("top_k_not_a_number", lambda t: ["prompt=Hi", "top_k=x"], r"top_k=x: expected an integer >= 0$"),
    ("top_p_past_one", lambda t: ["prompt=Hi", "top_p=1.5"], r"top_p=1\.5: expected a number > 0 and <= 1$"),
    ("repetition_penalty_zero", lambda t: ["prompt=Hi", "repetition_penalty=0"],
     r"repetition_penalty=0: expected a number > 0$"),
    ("seed_negative", lambda t: ["prompt=Hi", "seed=-1"], r"seed=-1: expected an integer >= 0$"),
    ("device_unknown", lambda t: ["prompt=Hi", "device=gpu"], r"device=gpu: expected cpu, cuda or cuda:N$"),
    ("dtype_unknown", lambda t: ["prompt=Hi", "dtype=fp12"], r"dtype=fp12: expected one of float32, "),
    ("option_unknown", lambda t: ["prompt=Hi", "max_tokens=3"], r"unknown option max_tokens \(did you mean max_new_tokens\?\); to add a new key"),
    ("adapter_rank_is_not_its_config", lambda t: [f"adapter_dir={adapter_edit(t, lambda c: c.update(r=8))}", "prompt=Hi"],
     rf"{ADAPTER_PATH} has shape \[(4, 128|\d+, 4)\], not rank r=8 of adapter_config\.json$"),
]


@pytest.mark.parametrize("make_overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_to_generate_is_one_line(make_overrides, expected, tmp_path, capsys):
    code, _, err = run_generate(capsys, f"checkpoint_dir={TINY}", *make_overrides(tmp_path))
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert re.search(rf"^error: (\S*/)?{expected}", errors[0]), errors[0]  # after the directory of a file
    assert "tokens/s]" not in err, "nothing is generated"


def test_merge_lora_refuses_an_adapter_of_another_base_in_one_line(tmp_path, capsys):
    """scripts/merge_lora.py reads adapters as generate.py does: tensors that do not fit the base are one line."""
    from scripts import merge_lora

    adapter = other_base_adapter(tmp_path)
    capsys.readouterr()
    assert merge_lora.main([str(TINY), str(adapter), str(tmp_path / "merged")]) == 1
    errors = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(rf"{ADAPTER_PATH} has shape .*; {OTHER_BASE}", errors[0]), errors
    assert not (tmp_path / "merged").exists()
