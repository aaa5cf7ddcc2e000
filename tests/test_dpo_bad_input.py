"""recipes/dpo_finetune.py's bad input: each option out of range, each malformed preference record, a resume whose
data changed under it; one ``error:`` line naming the option, file or record, and nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from recipes.dpo_finetune import main as dpo_finetune
from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "tiny_dpo.yaml"
GOOD = {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "No."}]}

# override -> the error line's start
CASES = [
    ("loss=sigmoid", "error: loss=sigmoid: expected a section {type, beta, label_smoothing, gamma}"),
    ("loss.type=kto", "error: loss.type=kto: expected one of sigmoid, ipo, hinge, simpo"),
    ("loss.beta=0", "error: loss.beta=0: expected a number > 0"),
    ("loss.beta=-0.1", "error: loss.beta=-0.1: expected a number > 0"),
    ("loss.beta=inf", "error: loss.beta=inf: expected a finite number > 0"),  # ran the reference pass, then nan at step 1
    ("loss.beta=nan", "error: loss.beta=nan: expected a finite number > 0"),
    ("loss.gamma_inf_with_simpo", "error: loss.gamma=inf: expected a finite number >= 0"),
    ("loss.beta_inf_with_simpo", "error: loss.beta=inf: expected a finite number > 0"),
    ("loss.label_smoothing=0.5", "error: loss.label_smoothing=0.5: expected a number >= 0 and < 0.5"),
    ("loss.label_smoothing_with_ipo", "error: loss.label_smoothing applies to the sigmoid and simpo losses, not ipo"),
    ("loss.gamma=-1", "error: loss.gamma=-1: expected a number >= 0"),
    ("dataset.max_length=1", "error: dataset.max_length=1: expected an integer >= 2"),
    ("dataset.max_prompt_length=0", "error: dataset.max_prompt_length=0: expected null or an integer >= 1"),
    ("reference_batch_size=0", "error: reference_batch_size=0: expected null or an integer >= 1"),
    ("lora=8", "error: lora=8: expected null (full fine-tuning) or a section {targets, rank, alpha, dropout}"),
    ("quantize_base=int8", "error: quantize_base=int8: expected null or one of nf4"),
    ("quantize_base_without_lora", "error: quantize_base: a 4-bit base is frozen, so it needs a lora section (QLoRA)"),
    ("lora.rank_in_a_dpo_run", "error: lora.rank=0: expected an integer >= 1"),
    ("dataset.source_missing", "error: "),
    ("dataset.record_without_rejected", "error: {data}: record 2 (line 2): "),
    ("dataset.record_with_a_number_for_chosen", "error: {data}: record 1 (line 1): "),
    ("dataset.columns_unknown", "error: columns: "),
]

OVERRIDES = {  # rows whose id is not itself the override
    "loss.label_smoothing_with_ipo": ["loss.type=ipo", "loss.label_smoothing=0.1"],
    "loss.gamma_inf_with_simpo": ["loss.type=simpo", "loss.gamma=inf"],
    "loss.beta_inf_with_simpo": ["loss.type=simpo", "loss.beta=inf"],
    "quantize_base_without_lora": ["quantize_base=nf4"],
    "lora.rank_in_a_dpo_run": ["lora={targets: [q_proj], rank: 0, alpha: 16, dropout: 0.0}"],
    "dataset.source_missing": ["dataset.source={tmp}/nowhere.jsonl"],
    "dataset.record_without_rejected": ["dataset.source={data}"],
    "dataset.record_with_a_number_for_chosen": ["dataset.source={data}"],
    "dataset.columns_unknown": ["dataset.columns={answer: text}"],
}
RECORDS = {
    "dataset.record_without_rejected": [GOOD, {k: v for k, v in GOOD.items() if k != "rejected"}],
    "dataset.record_with_a_number_for_chosen": [{**GOOD, "chosen": 3}],
}


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that report an error (progress bars share it, each redrawn with a carriage return)."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if "error" in line]


def overrides_of(case_id: str, tmp, data) -> list[str]:
    return [o.replace("{tmp}", str(tmp)).replace("{data}", str(data)) for o in OVERRIDES.get(case_id, [case_id])]


@pytest.mark.parametrize("case_id,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_dpo_input_is_one_line_and_writes_nothing(case_id, expected, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS.get(case_id, [GOOD])))
    out = tmp_path / "out"
    try:  # an option the table refuses exits while the config is parsed; the rest return from the run
        status = dpo_finetune(["--config", str(CONFIG), f"output_dir={out}", *overrides_of(case_id, tmp_path, data)])
    except SystemExit as stop:
        status = stop.code
    assert status == 1
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(expected.replace("{data}", str(data))), err
    assert not out.exists() or not any(out.iterdir())


def test_resume_on_changed_data_is_refused_in_one_line(tmp_path, capsys):
    """The data file edited in place (same path, so the config is unchanged) after a checkpoint: the reference
    log-probs in the step were computed from other pairs, and the resume says so."""
    data = tmp_path / "pairs.jsonl"
    shutil.copy(ROOT / "assets" / "tiny_dpo.jsonl", data)
    out = tmp_path / "out"
    args = ["--config", str(CONFIG), f"output_dir={out}", f"dataset.source={data}", "epochs=2", "max_steps_per_epoch=2",
            "validation=null"]
    assert dpo_finetune([*args, "epochs=1"]) == 0
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same pairs in another order
    capsys.readouterr()
    assert dpo_finetune(args) == 1
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "its reference log-probs were computed from other data" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "reference", "step_2"]



def test_resume_on_a_model_changed_in_place_is_refused_in_one_line(tmp_path, capsys):
    """The input checkpoint's weights replaced at the same path (a re-download of another revision): the config is
    unchanged, but the step's reference log-probs belong to the old model."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(ROOT / "assets" / "tiny_llama", model)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((ROOT / "assets" / "tiny_dpo.jsonl").read_text().splitlines(keepends=True)[:24]))
    out = tmp_path / "out"
    args = ["--config", str(CONFIG), f"output_dir={out}", f"dataset.source={data}", f"checkpointer.checkpoint_dir={model}",
            "max_steps_per_epoch=1", "validation=null"]
    assert dpo_finetune([*args, "epochs=1"]) == 0
    last = sorted(model.glob("model-*.safetensors"))[-1]
    save_file({k: v + 0.01 for k, v in load_file(last).items()}, last, metadata={"format": "pt"})
    capsys.readouterr()
    assert dpo_finetune([*args, "epochs=2"]) == 1
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "its reference log-probs were computed from other data, model or template" in err[0], err
