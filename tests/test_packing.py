"""Packing: a packed batch's per-token losses are its samples' own (attention within a sample, positions restarting
per sample), for every attention variant; the packed recipe trains, and resumes bit-exactly after a SIGTERM."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from recipes import full_finetune
from waypoint.families import from_hf_config
from waypoint.data.collate import padded_collate
from waypoint.training.loss import IGNORE_INDEX
from waypoint.data.packing import PackedDataset
from tests.conftest import ROOT, sigterm_at_step, tiny_family_config

TINY = ROOT / "assets/tiny_llama"


class Samples(torch.utils.data.Dataset):
    def __init__(self, lengths, vocab=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for n in lengths:
            tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
            prompt = n // 3
            self.items.append({"tokens": tokens, "labels": [IGNORE_INDEX] * prompt + tokens[prompt:]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_packs_are_greedy_in_order_with_positions_and_documents_per_sample():
    packed = PackedDataset(Samples([5, 4, 3, 9, 2, 20]), max_seq_len=12)
    assert packed.packs == [[0, 1, 2], [3, 4], [5]]
    item = packed[0]
    assert item["positions"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert item["document_ids"] == [0] * 5 + [1] * 4 + [2] * 3
    firsts = [0, 5, 9]
    assert all(item["labels"][i] == IGNORE_INDEX for i in firsts), "no sample is predicted from the one before"
    assert len(packed[2]["tokens"]) == 12, "a sample longer than a pack is cut to it"
    assert 0 < packed.fill <= 1


def per_token_losses(model, tokens, labels, **packed):
    logits = model(tokens, **packed)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(labels.shape[0], -1)


@pytest.mark.parametrize("fam", ["llama", "mistral", "qwen3", "gemma2", "gemma3", "mixtral"])
def test_packed_losses_equal_each_sample_alone(fam):
    """GQA, a sliding window shorter than the samples (mistral 5, qwen3/gemma 4), q/k norms, soft-capping, a local
    rope, experts: the losses of the packed tokens equal those of each sample run alone (fp32)."""
    torch.manual_seed(0)
    model = from_hf_config(tiny_family_config(fam).to_dict()).eval()
    model.init_weights(0.1)
    samples = Samples([7, 11, 3, 9, 6, 13])
    packed = PackedDataset(samples, max_seq_len=24)
    batch = padded_collate([packed[i] for i in range(len(packed))], pad_id=0)
    with torch.no_grad():
        together = per_token_losses(model, batch["tokens"], batch["labels"], positions=batch["positions"],
                                    document_ids=batch["document_ids"])
        worst, checked = 0.0, 0
        for row, pack in enumerate(packed.packs):
            start = 0
            for index in pack:
                item = samples[index]
                n = len(item["tokens"])
                alone = per_token_losses(model, torch.tensor([item["tokens"]]), torch.tensor([item["labels"]]))[0]
                mine = together[row, start:start + n - 1]
                supervised = torch.tensor(item["labels"][1:]) != IGNORE_INDEX
                worst = max(worst, (mine[supervised] - alone[supervised]).abs().max().item())
                checked += int(supervised.sum())
                start += n
        plain = per_token_losses(model, batch["tokens"], batch["labels"])  # without the masks: samples leak
    print(f"\n{fam}: packed vs alone, max |loss diff| over {checked} tokens = {worst:.3g}")
    assert checked > 20 and worst <= 1e-5
    assert (plain - together).abs().max().item() > 1e-3, "the document masks and positions must matter"


def run(out, stop_at=None):
    with sigterm_at_step(stop_at):
        return full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={TINY}",
                                   f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={out}", "epochs=1",
                                   "max_steps_per_epoch=6", "batch_size=2", "packed=true", "dataset.max_seq_len=256",
                                   "lr_scheduler.num_warmup_steps=1"])


def test_packed_recipe_trains_and_resumes_bit_exactly(tmp_path, capsys):
    assert run(tmp_path / "straight") == 0
    assert "packed into" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    assert run(tmp_path / "stopped", stop_at=3) == 75
    assert run(tmp_path / "stopped") == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "stopped/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    from waypoint.checkpointers.file_formats import read_tensors
    a = {k: t for f in sorted((tmp_path / "straight/step_6").glob("*.safetensors")) for k, t in read_tensors(f).items()}
    b = {k: t for f in sorted((tmp_path / "stopped/step_6").glob("*.safetensors")) for k, t in read_tensors(f).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # switching packing on or off is a different data order: refused on resume
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={TINY}",
                               f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={tmp_path / 'stopped'}",
                               "epochs=2", "max_steps_per_epoch=6", "batch_size=2", "packed=false",
                               "dataset.max_seq_len=256", "lr_scheduler.num_warmup_steps=1"])
    assert code == 1 and "packed" in capsys.readouterr().err


# -- validation ----------------------------------------------------------------------------------------------------

def test_validation_fraction_is_held_out_deterministically_and_evaluated(tmp_path, capsys):
    from waypoint.data.validation_split import split

    train, validation = split({"fraction": 0.25, "every_n_steps": 2}, Samples([3] * 40), make=None, seed=5)
    again, _ = split({"fraction": 0.25, "every_n_steps": 2}, Samples([3] * 40), make=None, seed=5)
    assert len(validation.dataset) == 10 and len(train) == 30 and train.indices == again.indices
    assert not set(train.indices) & set(validation.dataset.indices), "held-out records never train"
    assert [validation.due(s, 7) for s in range(1, 8)] == [False, True, False, True, False, True, True]
    with pytest.raises(Exception, match="either source .* or fraction"):
        split({"every_n_steps": 2}, Samples([3] * 4), make=None, seed=0)

    out = tmp_path / "run"
    code = full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={TINY}",
                               f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", f"output_dir={out}", "epochs=1",
                               "max_steps_per_epoch=4", "batch_size=4", "validation={fraction: 0.1, every_n_steps: 2}",
                               "progress_every_n_steps=2"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and val[1]["val_loss"] < val[0]["val_loss"]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train step ")]  # not a terminal: lines
    assert [line.split()[2] for line in shown] == ["2/4", "4/4"] and all(", val " in line for line in shown), shown
