"""Generation against transformers: greedy tokens identical to ``generate`` for every family (fp32, KV cache), the
cached step's logits equal to a full forward, and the sampling processors equal to transformers' own. recipes/generate.py:
a merged adapter is PEFT's, a prompt and a chat fit the model's positions, an adapter of another base warns (its bad
input is tests/test_generate_bad_input.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from waypoint.checkpointers import load_model
from waypoint.models.generate import Sampling, generate
from waypoint.models.kv_cache import KVCache
from tests.conftest import ROOT, tiny_family_config, write_family_checkpoint
from tests.test_families import FAMILIES

NEW_TOKENS = 12


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_is_transformers_token_for_token(name, tmp_path):
    fam, overrides, _ = FAMILIES[name]
    hf_model = write_family_checkpoint(tmp_path / "in", tiny_family_config(fam, **overrides), packed=name.endswith("-packed"))
    model = load_model(tmp_path / "in")
    prompt = torch.randint(1, 128, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = generate(model, prompt, NEW_TOKENS)
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs, name


def test_cached_steps_give_the_full_forward_logits(tmp_path):
    """A sliding window shorter than the sequence and the local rope of Gemma 3: the cache must apply both."""
    write_family_checkpoint(tmp_path / "in", tiny_family_config("gemma3"))
    model = load_model(tmp_path / "in").eval()
    tokens = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(len(model.layers))
        stepped = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 11)]
    assert cache.length == 11
    assert (torch.cat(stepped, dim=1) - full).abs().max().item() <= 1e-5


def test_sampling_processors_are_transformers():
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from waypoint.models import generate as gen

    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    seen = torch.tensor([3, 7, 7, 20])
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    theirs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                                  TopPLogitsWarper(0.8)])(seen[None], logits[None].clone())[0]
    draws = {gen.next_token(logits, seen, sampling, torch.Generator().manual_seed(s)) for s in range(300)}
    allowed = set(torch.nonzero(theirs > float("-inf")).flatten().tolist())
    assert draws <= allowed and len(draws) > 1, (draws, allowed)
    # the same distribution: our draws follow transformers' probabilities
    counts = torch.bincount(torch.tensor([gen.next_token(logits, seen, sampling, torch.Generator().manual_seed(s))
                                          for s in range(2000)]), minlength=50).float() / 2000
    assert (counts - theirs.softmax(-1)).abs().max().item() < 0.05
    assert gen.next_token(logits, seen, Sampling(), None) == int(logits.argmax())
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_generation_stops_at_a_stop_token_and_streams(tmp_path):
    write_family_checkpoint(tmp_path / "in", tiny_family_config("llama"))
    model = load_model(tmp_path / "in")
    free = generate(model, [1, 2, 3], 8)
    streamed = []
    stopped = generate(model, [1, 2, 3], 8, stop_ids=[free[3]], on_token=streamed.append)
    assert stopped == free[:free.index(free[3]) + 1] == streamed


# -- recipes/generate.py ---------------------------------------------------------------------------------------------

def lora_adapter_of(base: Path, directory: Path, recorded_base: str | None = None) -> Path:
    """A committed PEFT adapter (q_proj, v_proj; rank 4, alpha 8; seeded random) for the HF checkpoint ``base``,
    recording ``recorded_base`` (default: ``base``) as its base_model_name_or_path."""
    from waypoint.checkpointers import HFCheckpointer
    from waypoint.models.lora import apply_lora
    from tests.conftest import save_adapter

    model = load_model(base)
    apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05 if "lora_B" in name else 0.1, generator=generator)
    converter = HFCheckpointer(base, output_dir=directory.parent).converter
    return save_adapter(directory, model, converter, recorded_base or str(base))


def run_generate(capsys, *overrides: str) -> tuple[int, str, str]:
    """recipes/generate.py in process with configs/generate.yaml and ``overrides``: (exit status, stdout, stderr)."""
    from recipes import generate as recipe

    capsys.readouterr()
    try:
        code = recipe.main(["--config", str(ROOT / "configs/generate.yaml"), *overrides])
    except SystemExit as stop:  # a bad option: parse_config exits
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_recipe_with_a_peft_adapter_is_transformers_and_peft(tmp_path, capsys, monkeypatch):
    """Base + adapter in the recipe: the greedy reply is PeftModel.generate's on the same base and adapter, and a
    chat on stdin goes on from it."""
    import io

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from recipes import generate as recipe
    from waypoint.text.tokenizer import load_tokenizer

    base = ROOT / "assets/tiny_llama"
    lora_adapter_of(base, tmp_path / "adapter")
    prompt = "Give three tips for staying healthy."
    code = recipe.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={base}",
                        f"adapter_dir={tmp_path / 'adapter'}", f"prompt={prompt}", "max_new_tokens=10"])
    out, err = capsys.readouterr()
    assert code == 0 and "tokens/s]" in err and "warning" not in err  # the adapter's own base: no warning
    assert f"note: {base} has no chat template (a base model?): prompts go in as plain text" in err
    tokenizer = load_tokenizer(base)
    ids = tokenizer.encode(prompt, add_bos=True)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base).eval(), tmp_path / "adapter").eval()
    theirs = peft.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_id,
                           pad_token_id=tokenizer.pad_id)[0, len(ids):].tolist()
    assert out.rstrip("\n") == tokenizer.decode([t for t in theirs if t != tokenizer.eos_id])

    monkeypatch.setattr("sys.stdin", io.StringIO("And one more?\n\n"))
    assert recipe.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={base}", "chat=true",
                        "chat_template=chatml", "max_new_tokens=5", "temperature=0.8", "top_p=0.9"]) == 0
    assert capsys.readouterr().err.count("tokens/s]") == 1
    assert recipe.main(["--config", str(ROOT / "configs/generate.yaml"), f"checkpoint_dir={base}"]) == 1
    assert "nothing to do" in capsys.readouterr().err


TINY = ROOT / "assets/tiny_llama"  # 512 positions; "hello world " is 5 tokens of its tokenizer


def test_a_prompt_near_the_end_of_the_positions_gets_a_shorter_reply(capsys):
    code, _, err = run_generate(capsys, f"checkpoint_dir={TINY}", "prompt=" + "hello world " * 100, "max_new_tokens=128")
    assert code == 0, err
    assert "note: the prompt has 501 tokens of the model's 512 positions: 12 new tokens at most this time " \
           "(max_new_tokens=128)" in err
    assert 1 <= int(re.search(r"\[(\d+) tokens, ", err).group(1)) <= 12


def test_fit_drops_whole_turns_and_keeps_the_system_message():
    from recipes.generate import PromptTooLong, fit

    def tokens(turns):  # a token per character
        return [0] * sum(len(m["content"]) for m in turns)
    turns = [{"role": "system", "content": "s" * 5}] + [{"role": ("user", "assistant")[i % 2], "content": c * 10}
                                                         for i, c in enumerate("abcde")]
    prompt, room, kept = fit(turns, tokens, 42, 8)  # 55 tokens and 8 new do not fit: the oldest turn goes
    assert [m["content"][0] for m in kept] == ["s", "c", "d", "e"] and len(prompt) == 35 and room == 8
    assert fit(turns, tokens, 40, 8)[1:] == (8, turns[:1] + turns[-1:])  # every turn before the newest goes
    assert fit(turns, tokens, 20, 8)[1:] == (6, turns[:1] + turns[-1:])  # and then the reply is cut
    with pytest.raises(PromptTooLong, match="^15 tokens, more than the model's 14 positions; shorten it to at most 7 "
                                            "tokens to leave room for max_new_tokens=8$"):
        fit(turns, tokens, 14, 8)


def test_a_chat_leaves_out_its_oldest_turns_and_a_message_too_long(capsys, monkeypatch):
    """A chat goes on where the model's positions run out: the oldest turns leave, with a note; a message longer
    than every position is not sent, with a note, and the next one is."""
    import io

    long, too_long = "hello world " * 50, "hello world " * 120
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{long}\n{long}\n{too_long}\nok\n\n"))
    code, _, err = run_generate(capsys, f"checkpoint_dir={TINY}", "chat=true", "chat_template=chatml",
                                "system=Be brief.", "max_new_tokens=5")
    assert code == 0, err
    assert err.count("note: the 2 oldest messages left the conversation to fit the model's 512 positions with "
                     "max_new_tokens=5") == 1
    assert "note: that message is 6" in err and "tokens, more than the model's 512 positions; shorten it to at most " \
           "508 tokens to leave room for max_new_tokens=5; it was not sent" in err
    assert err.count("tokens/s]") == 3 and "error" not in err


def test_plain_text_asks_for_it_whatever_the_template(tmp_path, capsys):
    import shutil

    shutil.copytree(TINY, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text("{% for m in messages %}")  # does not compile
    code, _, err = run_generate(capsys, f"checkpoint_dir={tmp_path / 'ckpt'}", "prompt=Hi", "plain_text=true",
                                "max_new_tokens=3")
    assert code == 0 and "tokens/s]" in err and "note" not in err, err


def test_an_adapter_of_another_base_is_merged_with_a_warning(tmp_path, capsys):
    """An adapter whose adapter_config.json names another base (by name, or by the model class PEFT records) merges
    when its tensors fit, with one warning line; recipes/generate.py and scripts/merge_lora.py alike."""
    import json
    import shutil

    from scripts import merge_lora

    shutil.copytree(TINY, tmp_path / "other_llama")  # the same shapes, another model
    adapter = lora_adapter_of(tmp_path / "other_llama", tmp_path / "adapter")
    code, _, err = run_generate(capsys, f"checkpoint_dir={TINY}", f"adapter_dir={adapter}", "prompt=Hi", "max_new_tokens=3")
    warnings = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("warning:")]  # after a progress bar
    assert code == 0 and "tokens/s]" in err and warnings == [
        f"warning: {adapter / 'adapter_config.json'}: base_model_name_or_path is '{tmp_path / 'other_llama'}', not {TINY}; "
        "merged anyway, but an adapter merged onto another base model gives nonsense: check that the adapter belongs to "
        "this base"], err
    assert merge_lora.main([str(TINY), str(adapter), str(tmp_path / "merged")]) == 0
    assert capsys.readouterr().err.count("warning: ") == 1

    config = json.loads((adapter / "adapter_config.json").read_text())  # as PEFT writes it: no manifest
    config.update(base_model_name_or_path="someone/tiny_llama", auto_mapping={
        "base_model_class": "Qwen2ForCausalLM", "parent_library": "transformers.models.qwen2.modeling_qwen2"})
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "MANIFEST.json").unlink()
    code, _, err = run_generate(capsys, f"checkpoint_dir={TINY}", f"adapter_dir={adapter}", "prompt=Hi", "max_new_tokens=3")
    warnings = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1 and "base_model_name_or_path" not in warnings[0], err
    assert ": it was trained on a Qwen2ForCausalLM, the base is a LlamaForCausalLM; merged anyway" in warnings[0]


# -- the inference bundle --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,eos,turn", [("llama3", "<|end_of_text|>", "<|eot_id|>"), ("gemma", "<eos>", "<end_of_turn>"),
                                             ("phi3", "<|endoftext|>", "<|end|>")])
def test_generation_config_stops_at_the_templates_end_of_turn(tmp_path, family, eos, turn):
    """A base model's generation config stops at end-of-sequence only: a chat run's checkpoints add the template's
    end-of-turn token, which transformers' GenerationConfig reads back (and vLLM from it)."""
    import json

    from transformers import GenerationConfig

    from waypoint.text.chat_template import load_chat_template
    from waypoint.text.inference_bundle import generation_config
    from waypoint.text.stop_tokens import stop_token_ids
    from waypoint.text.tokenizer import load_tokenizer
    from tests.test_chat_data import FAMILIES as TEMPLATES, write_checkpoint_tokenizer

    d = write_checkpoint_tokenizer(tmp_path / "tok", family, template=TEMPLATES[family][0])
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}))
    tokenizer = load_tokenizer(d)
    template = load_chat_template(tokenizer)
    ids = [tokenizer.encode_with_offsets(t)[0][0] for t in (eos, turn)]
    data, note = generation_config(d, tokenizer, template)
    assert json.loads(data)["eos_token_id"] == ids and "written from the chat template" in note
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[0], "temperature": 0.6}))
    data, note = generation_config(d, tokenizer, template)
    assert json.loads(data)["eos_token_id"] == ids and json.loads(data)["temperature"] == 0.6 and f"adds {turn}" in note
    (d / "generation_config.json").write_bytes(data)
    assert GenerationConfig.from_pretrained(d).eos_token_id == ids
    assert generation_config(d, tokenizer, template) is None, "a config that already stops there is kept as it is"
    assert ids == stop_token_ids(tokenizer, template)[:2]
