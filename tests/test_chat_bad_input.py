"""Bad input on the chat data path: every case a one-line error naming the file (and record), before the first
step; a template cannot hang a run. A new check on this path gets its row in CASES."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import ROOT, tiny_llama_config, write_hf_checkpoint
from tests.test_chat_data import CHATML, CONVERSATIONS, write_checkpoint_tokenizer, write_jsonl
from waypoint.text.template_sandbox import STEP_LIMIT
from waypoint.data.chat_dataset import ChatDataset
from waypoint.data.data_checks import check_data
from waypoint.text.tokenizer import load_tokenizer

GOOD = {"messages": CONVERSATIONS[0]}


def records(*bad, at=1, total=3):
    """``total`` good records with ``bad`` at record ``at`` (1-based)."""
    rows = [GOOD] * total
    rows[at - 1: at] = list(bad)
    return rows


def template_file(tmp_path, source, name="template.jinja"):
    (tmp_path / name).write_text(source)
    return {"template": str(tmp_path / name)}


CHATML_LOOP = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"

# id: (data rows or raw bytes, dataset kwargs (a function of tmp_path), the model's vocab size, expected error)
CASES = {
    "role_not_a_string": (records({"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "x"}]}),
                          {}, 500, r"d\.jsonl: record 1 \(line 1\): message 1: unknown role \['user'\]"),
    "binary_file": (b"\xff\xfe\x00garbage", {}, 500, r"d\.jsonl: line 1: not UTF-8 text \(byte 0xff at offset 0\)"),
    "binary_after_good_lines": (json.dumps(GOOD).encode() + b"\n" + b"\x80\n", {}, 500, r"d\.jsonl: line 2: not UTF-8 text"),
    "system_not_a_string": ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}], "system": 3}],
                            {}, 500, r"d\.jsonl: record 1 \(line 1\): 'system' must be a string, got int"),
    "template_fails_on_a_late_record": (
        records({"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]}, at=66, total=80),
        lambda p: template_file(p, "{% if messages[0].content == 'boom' %}{{ raise_exception('boom is not allowed') }}"
                                   "{% endif %}" + CHATML_LOOP),
        500, r"d\.jsonl: record 66 \(line 66\): .*template\.jinja: chat template failed \(line 1\): .*boom is not allowed"),
    "nested_loops": (records(), lambda p: template_file(p, "{% for a in range(100000) %}{% for b in range(100000) %}"
                                                           "{% endfor %}{% endfor %}" + CHATML_LOOP),
                     500, rf"d\.jsonl: record 1 \(line 1\): .*template\.jinja: chat template stopped \(line 1\): it ran past "
                          rf"{STEP_LIMIT:,} steps"),
    "recursive_macro": (records(), lambda p: template_file(p, "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                                              "{% endmacro %}{{ f(60) }}" + CHATML_LOOP),
                        500, r"template\.jinja: chat template stopped \(line 1\): it ran past"),
    "string_bomb": (records(), lambda p: template_file(p, "{{ 'x' * 10 ** 10 }}" + CHATML_LOOP),
                    500, r"template\.jinja: chat template stopped \(line 1\): repeating 1 items 10,000,000,000 times is past "
                         r"the limit of 16,777,216 characters"),
    "doubling_loop": (records(), lambda p: template_file(p, "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}" + CHATML_LOOP),
                      500, r"template\.jinja: chat template stopped \(line 1\): a str of [\d,]+ items is past the limit"),
    "template_does_not_compile": (records(), lambda p: template_file(p, "{% for m in messages %}"), 500,
                                  r"template\.jinja: chat template does not compile \(line 1\)"),
    "unknown_template_name": (records(), {"template": "vicuna"}, 500, r"template: unknown chat template 'vicuna'"),
    "every_turn_cut_off": (records(), {"max_seq_len": 8}, 500,
                           r"dataset: no record supervises a token within max_seq_len=8 .*raise dataset\.max_seq_len"),
    "ids_past_the_embedding": (records(), {}, 300,
                               r"d\.jsonl: record 1 \(line 1\): token id \d+ \(.*\) is past the model's embedding of 300 rows "
                               r"\(the tokenizer at .* has \d+ ids\)"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_checkpoint_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml", CHATML))


@pytest.mark.parametrize("case", CASES)
def test_bad_chat_input_is_one_line_naming_the_file(case, tmp_path, tokenizer):
    data, options, vocab_size, expected = CASES[case]
    path = tmp_path / "d.jsonl"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        write_jsonl(path, data)
    options = options(tmp_path) if callable(options) else options
    started = time.perf_counter()
    with pytest.raises(ValueError) as error:
        dataset = ChatDataset(path, tokenizer, **{"max_seq_len": 256, **options})
        check_data(dataset, tokenizer, vocab_size, "dataset", say=print)
    message = str(error.value)
    assert "\n" not in message and re.search(expected, message), message
    assert time.perf_counter() - started < 60  # bounded: the limits stop a hostile template (about a second)


def test_skip_bad_records_counts_a_record_the_template_refuses(tmp_path, tokenizer, capsys):
    data, options, _, _ = CASES["template_fails_on_a_late_record"]
    dataset = ChatDataset(write_jsonl(tmp_path / "d.jsonl", data), tokenizer, 256, skip_bad_records=True, **options(tmp_path))
    assert (len(dataset), dataset.skipped) == (79, 1)
    assert "skipped 1 malformed record(s) (skip_bad_records); first: " in capsys.readouterr().out


def test_a_template_past_its_limits_is_never_skipped(tmp_path, tokenizer):
    data, options, _, expected = CASES["nested_loops"]
    with pytest.raises(ValueError, match=expected):
        ChatDataset(write_jsonl(tmp_path / "d.jsonl", data), tokenizer, 256, skip_bad_records=True, **options(tmp_path))


def test_records_that_supervise_nothing_are_counted(tmp_path, tokenizer):
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    dataset = ChatDataset(write_jsonl(tmp_path / "d.jsonl", [GOOD, long, GOOD]), tokenizer, 64)
    notes = []
    check_data(dataset, tokenizer, 500, "dataset", say=notes.append)
    assert notes == ["note: dataset: 1 of 3 records supervise no token within max_seq_len=64 (the turns trained on start "
                     "past it); they add nothing to the loss"]


def test_sharegpt_system_field_is_the_system_turn(tmp_path, tokenizer):
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    system = "You are terse."
    sharegpt = ChatDataset(write_jsonl(tmp_path / "s.jsonl", [{"conversations": turns, "system": system}]), tokenizer, 256)
    openai = ChatDataset(write_jsonl(tmp_path / "o.jsonl", [{"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]),
        tokenizer, 256)
    assert sharegpt[0] == openai[0]
    # a conversation that starts with its own system turn keeps it, once
    own = [{"from": "system", "value": system}] + turns
    assert ChatDataset(write_jsonl(tmp_path / "t.jsonl", [{"conversations": own, "system": "other"}]), tokenizer, 256)[0] == openai[0]


@pytest.mark.parametrize("case", ["template_fails_on_a_late_record", "nested_loops", "every_turn_cut_off"])
def test_the_recipe_stops_before_its_first_step_in_one_line(case, tmp_path, capsys):
    """Through the recipe: one ``error:`` line, exit 1, no step trained (no metrics, no checkpoint)."""
    from recipes.full_finetune import main

    data, options, _, expected = CASES[case]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    options = options(tmp_path) if callable(options) else options
    overrides = [f"dataset.{key}={value}" for key, value in options.items()]
    out = tmp_path / "out"
    code = main(["--config", str(ROOT / "configs/tiny_chat.yaml"), f"output_dir={out}", f"dataset.source={path}",
                 f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}", *overrides])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(expected, err[0]), err[0]
    assert not list(out.glob("step_*")) and not (out / "metrics.jsonl").exists()


def test_a_tokenizer_from_another_model_is_refused_before_the_first_step(tmp_path, capsys):
    """The tiny tokenizer (512 ids) over a model with 128 embedding rows: one line with both sizes, not an
    IndexError inside F.embedding at step 1."""
    from recipes.full_finetune import main

    write_hf_checkpoint(tmp_path / "small_vocab", tiny_llama_config(vocab=128))
    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={tmp_path / 'out'}",
                 f"checkpointer.checkpoint_dir={tmp_path / 'small_vocab'}", f"tokenizer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
                 f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "error" in line]
    assert code == 1 and len(err) == 1 and err[0].startswith("error: "), err
    assert "is past the model's embedding of 128 rows (the tokenizer at" in err[0] and "has 512 ids)" in err[0], err[0]


def test_large_numbers_that_build_nothing_render():
    """The size limit applies to what builds text or items (padding widths, repeats, powers), not to any number
    a template holds: a default, an index, a namespace value, a range's step."""
    from waypoint.text.chat_template import ChatTemplate

    source = ("{{ x|default(100000000) }} {{ 'abc'.find('b', 0, 10**9) }} {% set ns = namespace(n=10**9) %}{{ ns.n }} "
              "{{ range(0, 10**9, 10**8)|list|length }} {{ 'ab'.center(6) }}")
    assert ChatTemplate(source, "t.jinja").render([]) == "100000000 1 1000000000 10   ab  "


def test_a_record_longer_than_the_models_positions_is_refused_before_the_first_step(tmp_path, capsys):
    """The tiny Llama has 512 positions: a record of more, with dataset.max_seq_len above them, stopped the run at its
    first step with the model's traceback."""
    from recipes import full_finetune

    long = {"messages": [{"role": "user", "content": "word " * 1500}, {"role": "assistant", "content": "ok"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, long] + [GOOD] * 8)
    out = tmp_path / "out"
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny_chat.yaml"), f"output_dir={out}",
                               f"dataset.source={data}", "dataset.max_seq_len=4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert re.fullmatch(rf"error: {re.escape(str(data))}: record 2 \(line 2\): \d+ tokens, past the model's 512 positions "
                        r"\(max_position_embeddings in its config\.json\); set dataset\.max_seq_len to at most 512", err[0]), err
    assert not out.exists() or not any(out.glob("step_*"))
    short = write_jsonl(tmp_path / "short.jsonl", [GOOD] * 10)
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny_chat.yaml"), f"output_dir={tmp_path / 'packed'}",
                               f"dataset.source={short}", "dataset.max_seq_len=600", "packed=true", "epochs=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[-1].startswith("error: dataset.max_seq_len=600: packed sequences would be longer than the "
                                            "model's 512 positions; set it to at most 512"), err
