"""Preference data: pairs tokenized exactly as TRL 1.16's DPOTrainer tokenizes them (its own ``_prepare_dataset`` on
the same records is the oracle), batched as its ``DataCollatorForPreference`` batches them, truncated as it
truncates, malformed records refused in one line, other field names, parquet, the pairs' digest, the data checks, and
the embedded set."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset, Subset

from tests.conftest import ROOT, TRL_ORACLE
from waypoint.errors import CheckpointError
from waypoint.text.chat_template import BUILTIN_TEMPLATES
from waypoint.text.tokenizer import load_tokenizer
from waypoint.data.collate import preference_collate
from waypoint.data.data_checks import check_data
from waypoint.data.preference_dataset import PreferenceDataset, extract_prompt

TINY = ROOT / "assets" / "tiny_llama"
ASSET = ROOT / "assets" / "tiny_dpo.jsonl"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Answer briefly."}

# One set per TRL format (TRL tells the format from a dataset's first record), with the cases its code treats apart.
STANDARD = [
    {"prompt": "What is two plus two?", "chosen": " Two plus two is four.", "rejected": " I do not know."},
    {"prompt": "Two plus two is fo", "chosen": "ur.", "rejected": "ur!"},  # the prompt's end merges with the answer
    {"prompt": "Where is Lima?", "chosen": " Lima is in Peru.</s>", "rejected": " No."},  # EOS written already
    {"prompt": "", "chosen": "Blue.", "rejected": "Green."},  # no prompt text: BOS alone
    {"prompt": "Same?", "chosen": " Yes.", "rejected": " Yes."},  # chosen identical to rejected
]
CONVERSATIONAL = [
    {"prompt": [user("What is the capital of Peru?")], "chosen": [assistant("The capital of Peru is Lima.")],
     "rejected": [assistant("I do not know.")]},
    {"prompt": [SYSTEM, user("hi"), assistant("Hello."), user("Colour of the sky?")],
     "chosen": [assistant("Blue.")], "rejected": [assistant("Green, maybe, or not at all.")]},
    {"prompt": [user("Two answers?")], "chosen": [assistant("One."), assistant("Two.")],
     "rejected": [assistant("No.")]},
]
IMPLICIT_CONVERSATIONAL = [
    {"chosen": [user("What color is grass?"), assistant("Grass is green.")],
     "rejected": [user("What color is grass?"), assistant("I do not know.")]},
    {"chosen": [SYSTEM, user("a"), assistant("b"), user("c"), assistant("d")],
     "rejected": [SYSTEM, user("a"), assistant("b"), user("c"), assistant("e")]},
    {"chosen": [user("Same?"), assistant("Yes.")], "rejected": [user("Same?"), assistant("Yes.")]},  # equal
    {"chosen": [user("More?"), assistant("Once.")],  # one a prefix of the other: TRL keeps the last shared message out
     "rejected": [user("More?"), assistant("Once."), assistant("Twice.")]},
]
IMPLICIT_STANDARD = [
    {"chosen": "Question: What color is grass? Answer: Grass is green.",
     "rejected": "Question: What color is grass? Answer: I do not know."},  # the space before goes to the completions
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "Same text.", "rejected": "Same text."},  # equal: the last character is the completion
    {"chosen": "Short", "rejected": "Short and long"},  # a prefix
    {"chosen": " blue", "rejected": " green"},  # they part right after a leading space: an empty prompt
]
FORMATS = {"standard": STANDARD, "conversational": CONVERSATIONAL, "implicit_conversational": IMPLICIT_CONVERSATIONAL,
           "implicit_standard": IMPLICIT_STANDARD}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The tiny checkpoint's tokenizer as transformers reads it (tokenizer_config.json's tokens), with our chatml."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((TINY / "tokenizer_config.json").read_text())
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"), bos_token=config["bos_token"],
                                     eos_token=config["eos_token"], pad_token=config["pad_token"],
                                     unk_token=config["unk_token"])
    theirs.chat_template = BUILTIN_TEMPLATES["chatml"]
    return theirs


def trl_batch(pairs, pad_id, max_length):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=pad_id, max_length=max_length)
    return collate([{f"{key}_ids": ids for key, ids in pair.items()} for pair in pairs])


def trl_pairs(records, hf_tokenizer, tmp_path, max_length=None):
    """TRL's own preprocessing of ``records``: ``DPOTrainer._prepare_dataset`` (prompt extraction, EOS, tokenize_fn,
    the drop of pairs whose prompt fills max_length) on a datasets.Dataset."""
    pytest.importorskip("trl")
    from datasets import Dataset as HFDataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=max_length, report_to=[], use_cpu=True)
    prepared = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=hf_tokenizer), HFDataset.from_list(records),
                                           hf_tokenizer, args, "train")
    return [{key: prepared[i][f"{key}_ids"] for key in ("prompt", "chosen", "rejected")} for i in range(len(prepared))]


# TRL oracle ---------------------------------------------------------------------------------------------------

@TRL_ORACLE
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ids_equal_trls_dpo_trainer(tmp_path, tokenizer, hf_tokenizer, fmt):
    records = FORMATS[fmt]
    theirs = trl_pairs(records, hf_tokenizer, tmp_path)
    dataset = PreferenceDataset(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, max_length=1024,
                                template="chatml")
    assert len(dataset) == len(records) == len(theirs)
    assert [dataset[i] for i in range(len(dataset))] == theirs
    assert (dataset.truncated_prompts, dataset.truncated_completions, dataset.dropped, dataset.skipped) == (0, 0, 0, 0)
    assert all(isinstance(t, int) for i in range(len(dataset)) for key in dataset[i] for t in dataset[i][key])
    assert dataset.where[1] == f"{tmp_path / 'd.jsonl'}: record 2 (line 2)"
    if fmt.startswith("implicit"):
        from trl.data_utils import extract_prompt as trl_extract_prompt

        for record in records:
            assert extract_prompt(record["chosen"], record["rejected"]) == tuple(trl_extract_prompt(record).values())


@TRL_ORACLE
def test_a_prompt_merging_with_its_completion_is_cut_where_trl_cuts_it(tmp_path, tokenizer, hf_tokenizer):
    """'... is fo' + 'ur.': 'o' and 'u' are read as one token 'ou', so the tokenized prompt is not a prefix of the
    prompt + completion; the completion starts where they part (common_prefix_length), as in TRL: its 'o' is left
    out of the prompt and read with the completion."""
    record = STANDARD[1]
    dataset = PreferenceDataset(write_jsonl(tmp_path / "d.jsonl", [record]), tokenizer, max_length=64)
    whole = tokenizer.encode(record["prompt"], add_bos=True)
    assert dataset[0]["prompt"] == whole[: len(dataset[0]["prompt"])] and len(dataset[0]["prompt"]) < len(whole)
    assert dataset[0]["prompt"] + dataset[0]["chosen"] == tokenizer.encode(record["prompt"] + record["chosen"],
                                                                           add_eos=True)
    assert tokenizer.decode(dataset[0]["chosen"]) == "our." and tokenizer.decode(dataset[0]["prompt"]).endswith(" f")
    assert dataset.template is None  # standard records need no chat template


LONG = {"prompt": "A much longer question, about many things at once: the sky, the sea, the grass?",
        "chosen": " Blue.", "rejected": " Red."}


@TRL_ORACLE
@pytest.mark.parametrize("max_length", [12, 20, 48])
@pytest.mark.parametrize("records", [STANDARD + [LONG], IMPLICIT_STANDARD], ids=["standard", "implicit"])
def test_batches_equal_trls_collator(tmp_path, tokenizer, hf_tokenizer, max_length, records):
    """Our dataset + preference_collate against TRL's _prepare_dataset + DataCollatorForPreference with the same
    max_length (its keep_start cut and its drop of pairs whose prompt fills max_length): per row, once the padding is
    removed, the same tokens, the same completion positions and completion lengths."""
    theirs = trl_pairs(records, hf_tokenizer, tmp_path, max_length=max_length)
    dataset = PreferenceDataset(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, max_length=max_length)
    assert len(dataset) == len(theirs) and len(dataset) + dataset.dropped == len(records)
    their_batch = trl_batch(theirs, tokenizer.pad_id, max_length)
    ours = preference_collate([dataset[i] for i in range(len(dataset))], tokenizer.pad_id)
    assert set(ours) == {"tokens", "labels", "mask", "completion_tokens"}
    assert ours["tokens"].dtype == ours["labels"].dtype == ours["completion_tokens"].dtype == torch.long
    assert ours["mask"].dtype == torch.bool and ours["tokens"].shape == (2 * len(dataset), ours["tokens"].shape[1])
    assert ours["tokens"].shape[1] == int(ours["mask"].sum(1).max())  # padded to the longest row, no more
    for row in range(2 * len(dataset)):
        keep = their_batch["attention_mask"][row].bool()
        n = int(ours["mask"][row].sum())
        assert ours["mask"][row, :n].all() and not ours["mask"][row, n:].any()
        assert ours["tokens"][row, :n].tolist() == their_batch["input_ids"][row][keep].tolist()
        completion = their_batch["completion_mask"][row][keep].bool()
        assert (ours["labels"][row, :n] != -100).tolist() == completion.tolist()
        assert ours["labels"][row, :n][completion].tolist() == ours["tokens"][row, :n][completion].tolist()
        assert (ours["tokens"][row, n:] == tokenizer.pad_id).all() and (ours["labels"][row, n:] == -100).all()
        assert int(ours["completion_tokens"][row]) == int(completion.sum())


@TRL_ORACLE
def test_conversations_equal_trls_collator(tmp_path, tokenizer, hf_tokenizer):
    theirs = trl_pairs(CONVERSATIONAL, hf_tokenizer, tmp_path, max_length=80)
    dataset = PreferenceDataset(write_jsonl(tmp_path / "d.jsonl", CONVERSATIONAL), tokenizer, max_length=80,
                                template="chatml")
    assert len(dataset) == len(theirs) == 2 and dataset.dropped == 1  # the long system + multi-turn prompt
    their_batch = trl_batch(theirs, tokenizer.pad_id, 80)
    ours = preference_collate([dataset[i] for i in range(len(dataset))], tokenizer.pad_id)
    for row in range(4):
        keep = their_batch["attention_mask"][row].bool()
        n = int(ours["mask"][row].sum())
        assert ours["tokens"][row, :n].tolist() == their_batch["input_ids"][row][keep].tolist()
        assert (ours["labels"][row, :n] != -100).tolist() == their_batch["completion_mask"][row][keep].bool().tolist()


def test_collate_orders_chosen_then_rejected():
    pairs = [{"prompt": [1, 5], "chosen": [6, 7], "rejected": [8]}, {"prompt": [1], "chosen": [9], "rejected": [10, 11, 12]}]
    batch = preference_collate(pairs, pad_id=0)
    assert batch["tokens"].tolist() == [[1, 5, 6, 7], [1, 9, 0, 0], [1, 5, 8, 0], [1, 10, 11, 12]]
    assert batch["labels"].tolist() == [[-100, -100, 6, 7], [-100, 9, -100, -100], [-100, -100, 8, -100],
                                        [-100, 10, 11, 12]]
    assert batch["mask"].sum(1).tolist() == [4, 2, 3, 4]
    assert batch["completion_tokens"].tolist() == [2, 1, 1, 3]
    with pytest.raises(ValueError, match="preference_collate: empty batch"):
        preference_collate([], 0)


# Truncation ---------------------------------------------------------------------------------------------------

def test_truncation_keeps_the_prompts_end_cuts_completions_and_drops_full_prompts(tmp_path, tokenizer, capsys):
    long_prompt = "Tell me, in one word, what color the sky is on a clear summer day at noon?"
    records = [
        {"prompt": long_prompt, "chosen": " Blue, like the sea on a clear day.", "rejected": " No."},
        {"prompt": "Hi?", "chosen": " Hello there, and welcome to this place, my friend.", "rejected": " No."},
        {"prompt": "Hi?", "chosen": " Yes.", "rejected": " No."},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    full = PreferenceDataset(path, tokenizer, max_length=1024)
    assert capsys.readouterr().out == ""  # nothing cut: no note
    whole = [full[i] for i in range(3)]
    assert len(whole[0]["prompt"]) > 12 and len(whole[1]["chosen"]) > 10

    cut = PreferenceDataset(path, tokenizer, max_length=14, max_prompt_length=8)
    assert cut[0]["prompt"] == whole[0]["prompt"][-8:]  # the last tokens of the prompt, the BOS gone
    assert cut[0]["chosen"] == whole[0]["chosen"][:14 - 8] and cut[0]["rejected"] == whole[0]["rejected"]
    room = 14 - len(whole[1]["prompt"])
    assert cut[1] == {"prompt": whole[1]["prompt"], "chosen": whole[1]["chosen"][:room], "rejected": whole[1]["rejected"]}
    assert cut[2] == whole[2]
    assert (cut.truncated_prompts, cut.truncated_completions, cut.dropped) == (1, 2, 0)
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and len(out.strip().splitlines()) == 1
    assert "cut 1 prompt(s) to their last max_prompt_length=8 tokens" in out
    assert "cut the completions of 2 pair(s) to max_length=14" in out

    dropped = PreferenceDataset(path, tokenizer, max_length=len(whole[0]["prompt"]))  # the first prompt fills it
    assert len(dropped) == 2 and dropped.dropped == 1 and dropped.where[0].endswith("record 2 (line 2)")
    out = capsys.readouterr().out
    assert f"dropped 1 pair(s) whose prompt alone has max_length={len(whole[0]['prompt'])} tokens or more" in out
    assert len(out.strip().splitlines()) == 1

    with pytest.raises(ValueError, match=r"d\.jsonl: no usable preference pairs \(3 dropped"):
        PreferenceDataset(path, tokenizer, max_length=2)


def test_settings_are_checked(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", STANDARD)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_length must be a positive integer"):
            PreferenceDataset(path, tokenizer, max_length=bad)
    with pytest.raises(ValueError, match="max_prompt_length must be a positive integer or null"):
        PreferenceDataset(path, tokenizer, max_length=10, max_prompt_length=0)


# Malformed records ----------------------------------------------------------------------------------------------

GOOD = {"prompt": [user("hi")], "chosen": [assistant("Hello.")], "rejected": [assistant("No.")]}
BAD = [
    (["not", "an", "object"], r"expected an object, got list"),
    ({"prompt": "q", "rejected": " r"}, r"missing key 'chosen'"),
    ({"prompt": "q", "chosen": " c"}, r"missing key 'rejected'"),
    ({"prompt": 3, "chosen": " c", "rejected": " r"}, r"'prompt' must be a string or a list of messages, got int"),
    ({"prompt": "q", "chosen": [assistant("c")], "rejected": " r"}, r"'chosen' must be a string, as 'prompt' is, got list"),
    ({"prompt": [user("q")], "chosen": [assistant("c")], "rejected": "r"},
     r"'rejected' must be a list of messages, as 'prompt' is, got str"),
    ({"prompt": "q", "chosen": "", "rejected": " r"}, r"'chosen' is empty"),
    ({"prompt": [user("q")], "chosen": [assistant("c")], "rejected": []}, r"'rejected' is empty"),
    ({"prompt": [user("q")], "chosen": [assistant("")], "rejected": [assistant("r")]},
     r"'chosen' is empty \(no assistant message has content\)"),
    ({"prompt": [], "chosen": [assistant("c")], "rejected": [assistant("r")]}, r"'prompt' is an empty list of messages"),
    ({"prompt": [{"role": "user"}], "chosen": [assistant("c")], "rejected": [assistant("r")]},
     r"'prompt': message 1: missing key 'content'"),
    ({"prompt": [user("q")], "chosen": [{"role": "robot", "content": "c"}], "rejected": [assistant("r")]},
     r"'chosen': message 1: unknown role 'robot'"),
    ({"prompt": [user("q")], "chosen": [assistant("c")], "rejected": [{"role": "assistant", "content": 3}]},
     r"'rejected': message 1: 'content' must be a string, got int"),
    ({"prompt": [user("q")], "chosen": [assistant("c"), user("more")], "rejected": [assistant("r")]},
     r"'chosen': message 2 has role 'user'; a completion is assistant messages only"),
    ({"prompt": [user("q")], "chosen": ["c"], "rejected": [assistant("r")]},
     r"'chosen': message 1: expected an object, got str"),
    ({"chosen": 3, "rejected": "r"}, r"'chosen' must be a string or a list of messages, got int"),
    ({"chosen": "same start", "rejected": [user("same start")]},
     r"'chosen' and 'rejected' must both be strings or both lists of messages, got str and list"),
    ({"chosen": "abc", "rejected": "xyz"}, r"no prompt in 'chosen' and 'rejected': their first characters differ"),
    ({"chosen": [user("a"), assistant("b")], "rejected": [user("x"), assistant("y")]},
     r"no prompt in 'chosen' and 'rejected': their first messages differ"),
    ({"chosen": [assistant("b")], "rejected": [assistant("b")]}, r"no prompt in 'chosen' and 'rejected': they are one "
                                                                 r"message each"),
    ({"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("c"), user("d"), assistant("e")]},
     r"'rejected': message 2 after the prompt they share has role 'user'"),
    ({"chosen": "", "rejected": "r"}, r"'chosen' is empty"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_bad_records_are_one_line_errors_or_skipped_and_counted(tmp_path, tokenizer, capsys, bad, match):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, bad, GOOD, bad])
    with pytest.raises(ValueError, match=r"d\.jsonl: record 2 \(line 2\): " + match) as info:
        PreferenceDataset(path, tokenizer, max_length=256, template="chatml")
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    dataset = PreferenceDataset(path, tokenizer, max_length=256, template="chatml", skip_bad_records=True)
    assert (len(dataset), dataset.skipped) == (2, 2)
    assert [w.split(": ")[-1] for w in dataset.where] == ["record 1 (line 1)", "record 3 (line 3)"]
    out = capsys.readouterr().out
    assert out.count("skipped 2 malformed record(s) (skip_bad_records); first: ") == 1
    assert len(out.strip().splitlines()) == 1


def test_only_bad_records_leave_no_usable_pairs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q"}])
    with pytest.raises(ValueError, match=r"d\.jsonl: no usable preference pairs$"):
        PreferenceDataset(path, tokenizer, max_length=64, skip_bad_records=True)


def test_conversations_need_a_chat_template_and_its_limits_are_never_skipped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [STANDARD[0], GOOD])
    with pytest.raises(ValueError, match=r"tiny_llama: the checkpoint has no chat template.*chatml, llama3"):
        PreferenceDataset(path, tokenizer, max_length=64, skip_bad_records=True)
    standard_only = PreferenceDataset(write_jsonl(tmp_path / "s.jsonl", STANDARD), tokenizer, max_length=64)
    assert standard_only.template is None
    named = PreferenceDataset(tmp_path / "s.jsonl", tokenizer, max_length=64, template="chatml")
    assert named.template is not None and [named[i] for i in range(5)] == [standard_only[i] for i in range(5)]
    (tmp_path / "huge.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ 'x' * 20000000 }}")
    with pytest.raises(ValueError, match=r"d\.jsonl: record 2 \(line 2\): .*huge\.jinja: chat template stopped"):
        PreferenceDataset(path, tokenizer, max_length=64, template=str(tmp_path / "huge.jinja"), skip_bad_records=True)


# Field names, roles and parquet ---------------------------------------------------------------------------------

def test_columns_role_names_and_parquet_give_the_same_items(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = CONVERSATIONAL[:2]
    plain = PreferenceDataset(write_jsonl(tmp_path / "a.jsonl", records), tokenizer, 256, template="chatml")
    names = {"system": "system", "user": "human", "assistant": "gpt"}

    def mapped(messages):
        return [{"speaker": names[m["role"]], "text": m["content"]} for m in messages]

    other = [{"question": mapped(r["prompt"]), "preferred": mapped(r["chosen"]), "dispreferred": mapped(r["rejected"]),
              "id": n} for n, r in enumerate(records)]
    columns = {"prompt": "question", "chosen": "preferred", "rejected": "dispreferred", "role": "speaker",
               "content": "text"}
    pq.write_table(pa.Table.from_pylist(other), tmp_path / "b.parquet")
    from_parquet = PreferenceDataset(tmp_path / "b.parquet", tokenizer, 256, template="chatml", columns=columns)
    assert [from_parquet[i] for i in range(2)] == [plain[i] for i in range(2)]
    assert from_parquet.where == [f"{tmp_path / 'b.parquet'}: record 1", f"{tmp_path / 'b.parquet'}: record 2"]
    strings = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in STANDARD]
    from_strings = PreferenceDataset(write_jsonl(tmp_path / "c.jsonl", strings), tokenizer, 256,
                                     columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert [from_strings[i] for i in range(5)] == [PreferenceDataset(write_jsonl(tmp_path / "s.jsonl", STANDARD),
                                                                     tokenizer, 256)[i] for i in range(5)]
    with pytest.raises(ValueError, match=r"d\.jsonl: record 1 \(line 1\): missing key 'preferred'"):
        PreferenceDataset(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, 256, template="chatml", columns=columns)


def test_unknown_columns_option_is_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"columns: expected names for prompt, chosen, rejected, role, content, got "
                                         r"\{'messages': 'dialog'\}"):
        PreferenceDataset(tmp_path / "x.jsonl", tokenizer, 64, columns={"messages": "dialog"})


# Fingerprint ----------------------------------------------------------------------------------------------------

def test_the_pairs_digest_follows_every_id_and_their_order(tmp_path, tokenizer):
    """What a run fingerprints its reference log-probs with (``preference_step.pairs_digest``): the pairs' ids in order,
    so another record, order, or a truncation that cuts, gives another digest."""
    from waypoint.training.preference_step import pairs_digest

    path = write_jsonl(tmp_path / "d.jsonl", STANDARD)
    first = pairs_digest(PreferenceDataset(path, tokenizer, 64))
    assert pairs_digest(PreferenceDataset(path, tokenizer, 64)) == first
    assert pairs_digest(PreferenceDataset(path, tokenizer, 64, max_prompt_length=2)) != first
    changed = [dict(STANDARD[0], rejected=" I do not know it.")] + STANDARD[1:]
    assert pairs_digest(PreferenceDataset(write_jsonl(tmp_path / "e.jsonl", changed), tokenizer, 64)) != first
    swapped = [STANDARD[1], STANDARD[0]] + STANDARD[2:]
    assert pairs_digest(PreferenceDataset(write_jsonl(tmp_path / "f.jsonl", swapped), tokenizer, 64)) != first


# Data checks ----------------------------------------------------------------------------------------------------

def test_check_data_refuses_ids_past_the_vocabulary_naming_the_pair(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " c"}] + STANDARD)
    dataset = PreferenceDataset(path, tokenizer, 64)
    notes = []
    check_data(dataset, tokenizer, tokenizer.vocab_size, "dataset", notes.append)
    assert notes == []
    top = max(max(dataset[1][k]) for k in ("prompt", "chosen", "rejected"))
    assert max(max(dataset[0][k]) for k in ("prompt", "chosen", "rejected")) < top
    with pytest.raises(CheckpointError, match=rf"d\.jsonl: record 2 \(line 2\): token id {top} .* past the model's "
                                              rf"embedding of {top} rows .*tokenizer belongs to another model"):
        check_data(dataset, tokenizer, top, "dataset", notes.append)
    with pytest.raises(CheckpointError, match=r"d\.jsonl: record 2 \(line 2\): token id"):  # a split's part names it too
        check_data(Subset(dataset, [1, 2]), tokenizer, top, "dataset", notes.append)


class Pairs(Dataset):
    def __init__(self, items):
        self.items_, self.where, self.max_length = items, [f"p.jsonl: record {n + 1}" for n in range(len(items))], 4

    def __len__(self):
        return len(self.items_)

    def __getitem__(self, index):
        return self.items_[index]


def test_check_data_notes_pairs_with_an_empty_completion(tokenizer):
    notes = []
    pairs = Pairs([{"prompt": [1, 5], "chosen": [6], "rejected": []}, {"prompt": [1], "chosen": [6], "rejected": [7]}])
    check_data(pairs, tokenizer, 512, "dataset", notes.append)
    assert notes == ["note: dataset: 1 of 2 pairs have an empty chosen or rejected completion within max_length=4 "
                     "(its log-prob is 0)"]
    nothing = Pairs([{"prompt": [], "chosen": [6], "rejected": [7]}])  # no prompt: a first token is not predicted
    with pytest.raises(CheckpointError, match=r"dataset: no pair has a completion token to train on within max_length=4"):
        check_data(nothing, tokenizer, 512, "dataset", notes.append)
    check_data(nothing, tokenizer, 512, "validation", notes.append, required=False)
    assert notes[-1] == ("note: validation: 1 of 1 pairs have both completions empty within max_length=4; they add "
                         "nothing to the loss")
    with pytest.raises(CheckpointError, match=r"p\.jsonl: record 2: token id 600"):
        check_data(Pairs([pairs[1], {"prompt": [1], "chosen": [600], "rejected": [7]}]), tokenizer, 512, "d", notes.append)


# The embedded set -------------------------------------------------------------------------------------------------

def test_embedded_preference_set(tokenizer):
    text = ASSET.read_text(encoding="utf-8")
    assert text.isascii()
    records = [json.loads(line) for line in text.splitlines()]
    kinds = [("prompt" in r) * 2 + isinstance(r["chosen"], list) for r in records]
    counts = {kind: kinds.count(kind) for kind in set(kinds)}
    assert 150 <= counts[3] and 3 <= counts[2] <= 5 and 3 <= counts[1] + counts[0] <= 8 and counts[0] >= 1
    dataset = PreferenceDataset(ASSET, tokenizer, max_length=256, template="chatml")
    assert len(dataset) == len(records) and dataset.truncated_completions == dataset.dropped == 0
    assert max(len(dataset[i]["prompt"]) + max(len(dataset[i]["chosen"]), len(dataset[i]["rejected"]))
               for i in range(len(dataset))) <= 128
    for r in records:  # questions and answers short
        texts = [r["chosen"], r["rejected"]] + ([r["prompt"]] if "prompt" in r else [])
        for t in texts:
            for content in ([t] if isinstance(t, str) and "prompt" in r else
                            [m["content"] for m in t] if isinstance(t, list) else [t.split(" Answer: ")[-1]]):
                assert len(tokenizer.encode(content, add_bos=False)) < 40, content
    spec = importlib.util.spec_from_file_location("make_tiny_dpo", ROOT / "scripts" / "make_tiny_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "".join(json.dumps(r) + "\n" for r in module.make_records()) == text  # the generator's output, committed
