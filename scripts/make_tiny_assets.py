"""Write the embedded default assets: a tiny instruction set and a tiny HF Llama checkpoint.

    python scripts/make_tiny_assets.py [--out-dir assets]

Writes ``<out-dir>/tiny_alpaca.jsonl`` (400 alpaca records made by simple rules a
tiny model learns fast) and ``<out-dir>/tiny_llama/`` (a byte-level BPE
``tokenizer.json`` trained on that data, its ``tokenizer_config.json``, and a
randomly initialised ``LlamaForCausalLM`` saved by transformers as three
safetensors shards with an index). Every seed is fixed: two runs with the same
library versions write the same bytes. The result is checked by loading it back
with transformers and with ``waypoint.text.tokenizer``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from waypoint.data.instruct_dataset import TEMPLATES, InstructDataset  # noqa: E402
from waypoint.text.tokenizer import load_tokenizer  # noqa: E402

NUM_RECORDS = 400
DATA_SEED = 0
MODEL_SEED = 0
VOCAB_SIZE = 512
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
MAX_SHARD_SIZE = "1500KB"  # the 3.48 MB of fp32 weights split into exactly 3 shards (1300KB..1700KB all do)
NUM_SHARDS = 3
MAX_FOLDER_BYTES = 6_000_000
MAX_SEQ_LEN = 128  # configs/tiny.yaml: every item must fit untruncated

# Small closed sets, so the randomly initialised 0.9M-parameter model learns the mappings within the
# 100 steps of configs/tiny.yaml (with 40 longer words and sums up to 98 the loss fell 31% there, not 54%).
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "bread",
    "lemon", "house", "water", "green", "chair", "music",
)
OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
    ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("old", "new"), ("wet", "dry"),
)


def make_records(rng: random.Random) -> list[dict[str, str]]:
    """``NUM_RECORDS`` records, the five rules in turn, then shuffled."""
    opposite = {a: b for a, b in OPPOSITES} | {b: a for a, b in OPPOSITES}

    def reverse():
        word = rng.choice(WORDS)
        return "Reverse the letters of the word.", word, word[::-1]

    def upper():
        word = rng.choice(WORDS)
        return "Write the word in upper case.", word, word.upper()

    def add():
        a, b = rng.randrange(10), rng.randrange(10)
        return "Add the two numbers.", f"{a} and {b}", str(a + b)

    def repeat():
        word = rng.choice(WORDS)
        return "Repeat the word three times.", word, " ".join([word] * 3)

    def antonym():
        word = rng.choice(sorted(opposite))
        return f"What is the opposite of {word}?", "", opposite[word]

    rules = (reverse, upper, add, repeat, antonym)
    records = []
    for i in range(NUM_RECORDS):
        instruction, input_, output = rules[i % len(rules)]()
        records.append({"instruction": instruction, "input": input_, "output": output})
    rng.shuffle(records)
    return records


def write_dataset(records: list[dict[str, str]], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def train_tokenizer(records: list[dict[str, str]]):
    """A byte-level BPE (GPT-2 style, lossless) trained on the prompts and responses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template = TEMPLATES["alpaca"]
    texts = [template.format(r["instruction"], r["input"]) + r["output"] for r in records]
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    # Like Llama's own tokenizer.json: transformers adds BOS by default (text.tokenizer adds it itself).
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def write_tokenizer(tokenizer, directory: Path) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # transformers v5 loads it as TokenizersBackend
        **SPECIAL_TOKENS,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_model(tokenizer, directory: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=128, intermediate_size=352,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["bos_token"]),
        eos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["eos_token"]),
        pad_token_id=tokenizer.token_to_id(SPECIAL_TOKENS["pad_token"]),
        dtype="float32",
    )
    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory, max_shard_size=MAX_SHARD_SIZE)
    return model


def check(directory: Path, dataset_path: Path, model) -> None:
    """Load everything back the way users will, and fail loudly if anything is off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    expected = [f"model-{i:05d}-of-{NUM_SHARDS:05d}.safetensors" for i in range(1, NUM_SHARDS + 1)]
    assert shards == expected, f"shards {shards} != {expected}"
    size = sum(p.stat().st_size for p in directory.iterdir())
    assert size < MAX_FOLDER_BYTES, f"{directory} holds {size} bytes, over {MAX_FOLDER_BYTES}"

    ours = load_tokenizer(directory)
    theirs = AutoTokenizer.from_pretrained(directory)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    assert len(theirs) == ours.vocab_size == model.config.vocab_size
    dataset = InstructDataset(dataset_path, ours, max_seq_len=10**6)
    longest = 0
    for i in range(len(dataset)):
        record, item = dataset.records[i], dataset[i]
        text = TEMPLATES["alpaca"].format(record["instruction"], record["input"]) + record["output"]
        assert theirs(text)["input_ids"] == ours.encode(text), f"record {i}: transformers encodes differently"
        assert ours.decode(item["tokens"]) == text, f"record {i}: no round trip"
        longest = max(longest, len(item["tokens"]))
    assert longest <= MAX_SEQ_LEN, f"longest item has {longest} tokens, over {MAX_SEQ_LEN}"

    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([dataset[0]["tokens"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits), "reloaded model computes other logits"
    print(f"checked: transformers loads tokenizer and model; {len(dataset)} records, longest {longest} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "assets")
    args = parser.parse_args(argv)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    dataset_path = args.out_dir / "tiny_alpaca.jsonl"
    model_dir = args.out_dir / "tiny_llama"
    if model_dir.exists():
        shutil.rmtree(model_dir)  # no stale shards from an earlier layout
    model_dir.mkdir()

    records = make_records(random.Random(DATA_SEED))
    write_dataset(records, dataset_path)
    tokenizer = train_tokenizer(records)
    write_tokenizer(tokenizer, model_dir)
    model = write_model(tokenizer, model_dir)

    for path in [dataset_path, *sorted(model_dir.iterdir())]:
        print(f"{path.stat().st_size:>10,d}  {path}")
    check(model_dir, dataset_path, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
