"""The data side: tokenizers, the instruction dataset, collation and the resumable batch order."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import ROOT
from waypoint.data.collate import padded_collate
from waypoint.data.data_order import batches_per_epoch, epoch_permutation, iterate_batches
from waypoint.data.instruct_dataset import TEMPLATES, InstructDataset
from waypoint.text.tokenizer import load_tokenizer

TINY_LLAMA = ROOT / "assets" / "tiny_llama"
TINY_ALPACA = ROOT / "assets" / "tiny_alpaca.jsonl"
TEXTS = ["Reverse the letters of the word.", "  two  spaces\nand a newline\n\n", "café, naïve 🙂 {braces}", ""]

RECORDS = [
    {"instruction": "Reverse the letters of the word.", "input": "garden", "output": "nedrag"},
    {"instruction": "What is the opposite of hot?", "input": "", "output": "cold"},
    {"instruction": "Write the word in upper case.", "output": "no input key"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_LLAMA)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


class CountingTokenizer:
    """Wraps a tokenizer and counts ``encode`` calls, to show what was tokenized."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.bos_id, self.eos_id, self.pad_id = inner.bos_id, inner.eos_id, inner.pad_id

    def encode(self, text, add_bos=True, add_eos=False):
        self.calls += 1
        return self.inner.encode(text, add_bos=add_bos, add_eos=add_eos)


# Tokenizers ----------------------------------------------------------------------------------------

def test_tiny_tokenizer_special_ids_and_round_trip(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (512, 1, 2, 3)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_id and tokenizer.eos_id not in ids
        assert tokenizer.encode(text, add_bos=False) == ids[1:]
        with_eos = tokenizer.encode(text, add_bos=False, add_eos=True)
        assert with_eos == ids[1:] + [tokenizer.eos_id]
        assert tokenizer.decode(with_eos) == text
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_tiny_tokenizer_matches_transformers(tokenizer):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(TINY_LLAMA)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 3)
    for text in TEXTS:
        assert tokenizer.encode(text, add_bos=False) == theirs(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.encode(text) == theirs(text)["input_ids"]  # its post-processor adds BOS too


@pytest.mark.parametrize("config, expected", [
    (None, (1, 2, 2)),  # well-known names; no pad token defined -> pad is eos
    ({"bos_token": {"content": "<s>", "special": True}, "eos_token": "<pad>", "pad_token": {"content": "<unk>"}},
     (1, 3, 0)),
    ({"bos_token": None, "eos_token": "</s>"}, (None, 2, 2)),  # an explicit null means "none": no BOS added
])
def test_special_tokens_from_tokenizer_config(tmp_path, tokenizer, config, expected):
    shutil.copy(TINY_LLAMA / "tokenizer.json", tmp_path)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == expected
    body = tokenizer.encode("hi", add_bos=False)
    assert tok.encode("hi", add_eos=True) == ([] if expected[0] is None else [expected[0]]) + body + [expected[1]]


def test_pad_from_tokenizer_json_padding_when_config_names_none(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(TINY_LLAMA / "tokenizer.json"))
    backend.enable_padding(pad_id=0, pad_token="<unk>")
    backend.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).pad_id == 0


def test_tokenizer_config_naming_unknown_token_is_an_error(tmp_path):
    shutil.copy(TINY_LLAMA / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|eot_id\|>' is not in tokenizer\.json"):
        load_tokenizer(tmp_path)


def train_sentencepiece(directory):
    import sentencepiece

    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=60, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()


def test_sentencepiece_tokenizer(tmp_path):
    train_sentencepiece(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (60, 1, 2, 3)
    ids = tok.encode("the lazy fox 42", add_eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:] and 2 not in ids[:-1]
    assert tok.decode(ids) == "the lazy fox 42"
    assert tok.encode("the lazy fox 42", add_bos=False) == ids[1:-1]


def test_tokenizer_json_is_preferred_over_tokenizer_model(tmp_path):
    train_sentencepiece(tmp_path)
    shutil.copy(TINY_LLAMA / "tokenizer.json", tmp_path)
    assert load_tokenizer(tmp_path).vocab_size == 512


def test_missing_tokenizer_names_the_directory_and_both_files(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message
    assert "\n" not in message


# Dataset -------------------------------------------------------------------------------------------

def test_labels_mask_exactly_the_prompt(tmp_path, tokenizer):
    dataset = InstructDataset(write_jsonl(tmp_path / "d.jsonl", RECORDS), tokenizer, max_seq_len=512)
    assert len(dataset) == 3
    for record, item in zip(RECORDS, (dataset[i] for i in range(3))):
        prompt = TEMPLATES["alpaca"].format(record["instruction"], record.get("input", ""))
        prompt_ids = tokenizer.encode(prompt, add_bos=False)
        response_ids = tokenizer.encode(record["output"], add_bos=False) + [tokenizer.eos_id]
        assert item["tokens"] == [tokenizer.bos_id] + prompt_ids + response_ids
        assert item["labels"] == [-100] * (1 + len(prompt_ids)) + response_ids
        supervised = [t for t in item["labels"] if t != -100]
        assert tokenizer.decode(supervised) == record["output"]
        assert supervised[-1] == tokenizer.eos_id
    assert "### Input:\ngarden\n\n" in tokenizer.decode(dataset[0]["tokens"])
    assert "### Input:" not in tokenizer.decode(dataset[1]["tokens"])


def test_train_on_input_supervises_everything(tmp_path, tokenizer):
    dataset = InstructDataset(write_jsonl(tmp_path / "d.jsonl", RECORDS), tokenizer, 512, train_on_input=True)
    assert dataset[0]["labels"] == dataset[0]["tokens"]
    # TRL's name for the opposite: completion_only_loss
    source = tmp_path / "d.jsonl"
    assert InstructDataset(source, tokenizer, 512, completion_only_loss=False)[0] == dataset[0]
    only = InstructDataset(source, tokenizer, 512, completion_only_loss=True)[0]
    assert only == InstructDataset(source, tokenizer, 512)[0] and only["labels"] != only["tokens"]
    with pytest.raises(ValueError, match=r"^dataset: train_on_input=true and completion_only_loss=true contradict"):
        InstructDataset(source, tokenizer, 512, train_on_input=True, completion_only_loss=True)


def test_truncation_and_json_list_source(tmp_path, tokenizer):
    (tmp_path / "d.json").write_text(json.dumps(RECORDS))
    full = InstructDataset(tmp_path / "d.json", tokenizer, max_seq_len=512)[0]
    cut = InstructDataset(tmp_path / "d.json", tokenizer, max_seq_len=10)[0]
    assert len(full["tokens"]) > 10
    assert cut == {"tokens": full["tokens"][:10], "labels": full["labels"][:10]}
    assert full == InstructDataset(write_jsonl(tmp_path / "d.jsonl", RECORDS), tokenizer, 512)[0]


def test_tokenizes_once_when_read(tmp_path, tokenizer):
    """Tokenized before the first step (so the data can be checked against the model), and only then."""
    counting = CountingTokenizer(tokenizer)
    dataset = InstructDataset(TINY_ALPACA, counting, max_seq_len=128)
    assert counting.calls == 2 * len(dataset)  # prompt and response of each record
    assert dataset[7] == InstructDataset(TINY_ALPACA, tokenizer, max_seq_len=128)[7]
    assert counting.calls == 2 * len(dataset)


@pytest.mark.parametrize("write, match", [
    (lambda p: write_jsonl(p / "d.jsonl", RECORDS[:2] + [{"instruction": "x", "input": ""}]),
     r"d\.jsonl: record 3 \(line 3\): missing key 'output'$"),
    (lambda p: (p / "d.json").write_text(json.dumps([RECORDS[0], {"output": "y"}])) and p / "d.json",
     r"d\.json: record 2: missing key 'instruction'$"),
    (lambda p: (p / "d.jsonl").write_text(json.dumps(RECORDS[0]) + "\n\n{oops\n") and p / "d.jsonl",
     r"d\.jsonl: line 3: invalid JSON"),
    (lambda p: write_jsonl(p / "d.jsonl", [RECORDS[0], {"instruction": "x", "output": 5}]),
     r"d\.jsonl: record 2 \(line 2\): 'output' must be a string"),
    (lambda p: (p / "d.json").write_text(json.dumps({"instruction": "x"})) and p / "d.json",
     r"d\.json: expected a JSON list of records"),
    (lambda p: (p / "d.csv").write_text("a,b") and p / "d.csv", r"d\.csv: unsupported dataset file type"),
])
def test_bad_records_are_one_line_errors_naming_file_and_record(tmp_path, tokenizer, write, match):
    path = write(tmp_path)
    with pytest.raises(ValueError, match=match) as info:
        InstructDataset(path, tokenizer, max_seq_len=128)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


DEEP = 200_000  # levels of [ in a damaged file: json's parser recurses once per level


@pytest.mark.parametrize("kind", ["instruct", "chat", "preference"])
def test_json_nested_too_deep_is_one_line_naming_the_file(kind, tmp_path, tokenizer):
    """A data file nested 200,000 levels deep (a .json list, or one line of a .jsonl): one line naming the file (and
    line), not \"maximum recursion depth exceeded while decoding a JSON array\"."""
    from waypoint.data.chat_dataset import ChatDataset
    from waypoint.data.preference_dataset import PreferenceDataset

    deep = "[" * DEEP + "]" * DEEP
    if kind == "chat":
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + deep + "\n")
        expected = rf"^{path}: line 2: JSON nested too deeply to read \(past about 900 levels of \[ and {{\)"
    else:
        path = tmp_path / "d.json"
        path.write_text(deep)
        expected = rf"^{path}: JSON nested too deeply to read \(past about 900 levels of \[ and {{\); a dataset record"
    make = {"instruct": lambda: InstructDataset(path, tokenizer, max_seq_len=128),
            "chat": lambda: ChatDataset(path, tokenizer, 128, template="chatml"),
            "preference": lambda: PreferenceDataset(path, tokenizer, 128, template="chatml")}
    with pytest.raises(ValueError, match=expected) as info:
        make[kind]()
    assert "\n" not in str(info.value)


def test_json_nested_deep_never_crashes_the_interpreter_with_the_recursion_limit_raised(tmp_path):
    """Up to Python 3.11 json's C parser recurses as deep as the recursion limit lets it: a program that raised the
    limit (some libraries do) died with SIGSEGV on such a file. The reader bounds the parse, and puts the limit back.
    In a child process: a crash must not take the test run with it."""
    import subprocess
    import sys

    path = tmp_path / "d.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    child = ("import sys; sys.setrecursionlimit(10**6)\n"
             "from waypoint.data.records import read_file\n"
             "try:\n    read_file(__import__('pathlib').Path(sys.argv[1]))\n"
             "except ValueError as e:\n    print(e)\n"
             "print(sys.getrecursionlimit())\n")
    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == [f"{path}: JSON nested too deeply to read (past about 900 levels of [ and {{); "
                                        "a dataset record is an object a few levels deep: check the file", "1000000"]


def test_json_nested_too_deep_through_the_recipe_is_one_line(tmp_path, capsys):
    from recipes.full_finetune import main

    path = tmp_path / "deep.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    code = main(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={tmp_path / 'out'}", f"dataset.source={path}",
                 f"checkpointer.checkpoint_dir={TINY_LLAMA}"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == (f"error: {path}: JSON nested too deeply to read (past about 900 levels of [ and {{); "
                                 "a dataset record is an object a few levels deep: check the file"), err


def test_missing_dataset_file_and_unknown_template(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        InstructDataset(tmp_path / "nope.jsonl", tokenizer, max_seq_len=128)
    with pytest.raises(ValueError, match=r"unknown template 'chatml'; known: alpaca"):
        InstructDataset(TINY_ALPACA, tokenizer, max_seq_len=128, template="chatml")


def test_embedded_dataset_fits_the_tiny_config_untruncated(tokenizer):
    dataset = InstructDataset(TINY_ALPACA, tokenizer, max_seq_len=10**6)
    assert len(dataset) == 400
    assert max(len(dataset[i]["tokens"]) for i in range(len(dataset))) <= 128


# Collate -------------------------------------------------------------------------------------------

def test_padded_collate_pads_right_to_the_longest():
    batch = [{"tokens": [5, 6, 7], "labels": [-100, 6, 7]}, {"tokens": [8], "labels": [8]}]
    out = padded_collate(batch, pad_id=0)
    assert out["tokens"].dtype == out["labels"].dtype == torch.long
    assert out["tokens"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["mask"].tolist() == [[True, True, True], [True, False, False]]  # padding apart, prompts included
    assert padded_collate(batch, pad_id=9, ignore_index=-1)["labels"].tolist() == [[-100, 6, 7], [8, -1, -1]]
    with pytest.raises(ValueError, match="empty batch"):
        padded_collate([], pad_id=0)


# Batch order ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_dataset(tokenizer):
    class FirstN(torch.utils.data.Dataset):  # 45 records: 5 full batches of 8, 5 records dropped
        def __init__(self):
            self.inner = InstructDataset(TINY_ALPACA, tokenizer, max_seq_len=128)

        def __len__(self):
            return 45

        def __getitem__(self, i):
            return self.inner[i]

    return FirstN()


def run(dataset, tokenizer, **kwargs):
    collate = lambda b: padded_collate(b, pad_id=tokenizer.pad_id)  # noqa: E731
    return list(iterate_batches(dataset, batch_size=8, collate_fn=collate, **kwargs))


def test_resuming_at_batch_k_yields_exactly_the_tail(small_dataset, tokenizer):
    full = run(small_dataset, tokenizer, seed=3, epoch=1)
    assert [i for i, _ in full] == [0, 1, 2, 3, 4] == list(range(batches_per_epoch(45, 8)))
    for k in (1, 3, 5):
        tail = run(small_dataset, tokenizer, seed=3, epoch=1, start_batch=k)
        assert [i for i, _ in tail] == list(range(k, 5))
        for (_, a), (_, b) in zip(tail, full[k:], strict=True):
            assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def test_skipped_batches_are_not_read(tokenizer):
    dataset = InstructDataset(TINY_ALPACA, tokenizer, max_seq_len=128)
    read = []

    class Counting:
        def __len__(self):
            return len(dataset)

        def __getitem__(self, index):
            read.append(index)
            return dataset[index]

    batches = iterate_batches(Counting(), 8, seed=0, epoch=0, collate_fn=lambda b: b, start_batch=48)
    assert [i for i, _ in batches] == [48, 49] and len(read) == 8 * 2


def test_order_depends_on_seed_and_epoch_only():
    base = epoch_permutation(400, seed=1234, epoch=0)
    assert sorted(base) == list(range(400))
    assert epoch_permutation(400, seed=1234, epoch=0) == base
    assert epoch_permutation(400, seed=1234, epoch=1) != base
    assert epoch_permutation(400, seed=1235, epoch=0) != base


def test_epochs_and_shuffle_off(small_dataset, tokenizer):
    epoch0 = run(small_dataset, tokenizer, seed=3, epoch=0)
    epoch1 = run(small_dataset, tokenizer, seed=3, epoch=1)
    assert not torch.equal(epoch0[0][1]["tokens"], epoch1[0][1]["tokens"])
    ordered = list(iterate_batches(list(range(45)), 8, seed=3, epoch=0, collate_fn=list, shuffle=False))
    assert ordered[1] == (1, list(range(8, 16))) and len(ordered) == 5


def test_bad_batch_arguments_fail_at_the_call():
    with pytest.raises(ValueError, match="start_batch"):
        iterate_batches(list(range(10)), 3, seed=0, epoch=0, collate_fn=list, start_batch=4)
    with pytest.raises(ValueError, match="batch_size"):
        iterate_batches(list(range(10)), 0, seed=0, epoch=0, collate_fn=list)


def test_parquet_records_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from waypoint.data.instruct_dataset import read_records

    rows = [{"instruction": "Add.", "input": "1 2", "output": "3"}, {"instruction": "Say hi.", "input": "", "output": "hi"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.parquet") == rows
    pq.write_table(pa.Table.from_pylist([{"instruction": "x", "input": ""}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: record 1.*output"):
        read_records(tmp_path / "bad.parquet")
