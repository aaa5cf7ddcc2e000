"""Every bad option is one line naming it, before anything is read or written."""

from __future__ import annotations

import pytest

from recipes.full_finetune import main as full_finetune
from recipes.lora_finetune import main as lora_finetune
from tests.conftest import ROOT

CASES = [
    ("bach_size=4", "error: unknown option bach_size (did you mean batch_size?); to add a new key, write +bach_size=..."),
    ("checkpointer.chekpoint_dir=x", "error: unknown option checkpointer.chekpoint_dir (did you mean checkpointer.checkpoint_dir"),
    ("batch_size=abc", "error: batch_size=abc: expected an integer >= 1"),
    ("batch_size=0", "error: batch_size=0: expected an integer >= 1"),
    ("gradient_accumulation_steps=1.5", "error: gradient_accumulation_steps=1.5: expected an integer >= 1"),
    ("epochs=-1", "error: epochs=-1: expected an integer >= 1"),
    ("max_steps_per_epoch=0", "error: max_steps_per_epoch=0: expected null or an integer >= 1"),
    ("save_every_n_steps=0", "error: save_every_n_steps=0: expected null or an integer >= 1"),
    ("keep_last_n_checkpoints=-2", "error: keep_last_n_checkpoints=-2: expected null or an integer >= 1"),
    ("dtype=fp8", "error: dtype=fp8: expected one of float32, fp32, bfloat16, bf16, float16, fp16"),
    ("output_dtype=int8", "error: output_dtype=int8: expected null or one of float32"),
    ("checkpointer.output_quantization=mxfp8", "error: checkpointer.output_quantization=mxfp8: expected null or one of input, requantize, none"),
    ("device=cuda:7", "error: device=cuda:7: expected "),
    ("device=tpu", "error: device=tpu: expected cpu, cuda or cuda:N"),
    ("optimizer.lr=-0.1", "error: optimizer.lr=-0.1: expected a number >= 0"),
    ("overwrite=yes", "error: overwrite=yes: expected true or false"),
    ("on_nonfinite=ignore", "error: on_nonfinite=ignore: expected one of stop, skip_step"),
    ("preemption_signals=[SIGFOO]", "error: preemption_signals=['SIGFOO']: expected a list of signal names"),
    ("checkpointer=foo", "error: checkpointer=foo: no such option in "),
    ("batch_size=[", "error: cannot parse the override 'batch_size=['"),
    ("+batch_size=4", "error: +batch_size: batch_size is already in the config; drop the +"),
    ("dataset.max_seq_len=${nope}", "error: "),
    ("output_dir=hf://org/name", "error: output_dir=hf://org/name: expected a local directory or an object-store URL"),
    ("output_dir=file:///tmp/x", "error: output_dir=file:///tmp/x: expected a local path without file://"),
    ("log_dir=S3://bucket/tb", "error: log_dir=S3://bucket/tb: expected null or a local directory for TensorBoard event files"),
    ("progress=bars", "error: progress=bars: expected one of auto, bar, lines, off"),
    ("progress_every_n_steps=0", "error: progress_every_n_steps=0: expected an integer >= 1"),
    ("metric_loggers=5", "error: metric_loggers=5: expected a map of name: tracker section"),  # more in test_trackers.py
    ("+eval=5", "error: eval=5: expected null or a section {tasks: [...], every_n_steps: N}"),
    ("+eval={tasks:[tiny_choice],every_n_steps:0}", "error: eval.every_n_steps=0: expected an integer >= 1"),
    ("+eval={tasks:[tiny_choice],every_n_steps:2,limt:3}", "error: eval.limt: no such option of eval"),
    ("resume=", "error: resume=: expected auto, true, false or the path of a step_N checkpoint"),
    ("seed=-1", "error: seed=-1: expected an integer >= 0"),
    ("strict=maybe", "error: strict=maybe: expected true or false"),
    ("clip_grad_norm=-1", "error: clip_grad_norm=-1: expected null or a number > 0"),
    ("enable_activation_checkpointing=2", "error: enable_activation_checkpointing=2: expected true or false"),
    ("save_every_epoch=no", "error: save_every_epoch=no: expected true or false"),
    ("requeue=1", "error: requeue=1: expected true or false"),
    ("async_checkpoint=sure", "error: async_checkpoint=sure: expected true or false"),
    ("verify_export=0", "error: verify_export=0: expected true or false"),
    ("fused_loss=x", "error: fused_loss=x: expected true or false"),
    ("optimizer.weight_decay=-1", "error: optimizer.weight_decay=-1: expected a number >= 0"),
    ("lr_scheduler.num_warmup_steps=-5", "error: lr_scheduler.num_warmup_steps=-5: expected an integer >= 0"),
    ("packed=yes", "error: packed=yes: expected true or false"),
    ("+freeze_vision=maybe", "error: freeze_vision=maybe: expected true or false"),
    ("+quantize_base=nf4", "error: quantize_base=nf4: expected null (a 4-bit base is frozen: QLoRA is recipes/lora_finetune.py)"),
    ("validation=0.1", "error: validation=0.1: expected a section {source or fraction, every_n_steps}"),
    ("model=null", "error: model=null: expected a section with a _target_"),
    ("tokenizer=null", "error: tokenizer=null: expected a section with a _target_"),
    ("dataset=null", "error: dataset=null: expected a section with a _target_"),
    ("optimizer=null", "error: optimizer=null: expected a section with a _target_"),
    ("lr_scheduler=null", "error: lr_scheduler=null: expected a section with a _target_"),
    # torchtune's _component_ (tests/test_torchtune_checkpointer_port.py): its own classes, and a clash with _target_
    ("+model._component_=torchtune.models.llama3_2.llama3_2_1b", "error: model._component_: torchtune.models.llama3_2."
     "llama3_2_1b is torchtune's own, which Waypoint does not use; write _target_: waypoint.checkpointers.build_model"),
    ("+checkpointer._component_=torchtune.training.FullModelMetaCheckpointer", "error: checkpointer: both _target_ "
     "(waypoint.checkpointers.HFCheckpointer) and _component_ (torchtune.training.FullModelMetaCheckpointer) are given"),
]

LORA_CASES = [
    ("lora.rank=0", "error: lora.rank=0: expected an integer >= 1"),
    ("lora.dropout=1", "error: lora.dropout=1: expected a number >= 0 and < 1"),
    ("save_merged=sometimes", "error: save_merged=sometimes: expected one of final, every, never"),
    ("lora.targets=[]", "error: lora.targets=[]: expected a non-empty list of names"),
    ("lora.alpha=-1", "error: lora.alpha=-1: expected a number > 0"),
    ("max_lora_rank=0", "error: max_lora_rank=0: expected an integer >= 1"),
    ("save_adapter_weights_only=2", "error: save_adapter_weights_only=2: expected true or false"),
    ("+quantize_base=int8", "error: quantize_base=int8: expected null or one of nf4"),
    ("+nf4.block_size=0", "error: nf4.block_size=0: expected an even integer >= 2"),
    ("+nf4.scaler_block_size=0", "error: nf4.scaler_block_size=0: expected an integer >= 1"),
    ("+nf4.output=fp4", "error: nf4.output=fp4: expected true or false"),
]


@pytest.mark.parametrize("override,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_option_is_one_line_and_touches_nothing(override, expected, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        full_finetune(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", override])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(expected), err
    assert not out.exists()


@pytest.mark.parametrize("override,expected", LORA_CASES, ids=[c[0] for c in LORA_CASES])
def test_bad_lora_option_is_one_line(override, expected, tmp_path, capsys):
    with pytest.raises(SystemExit):
        lora_finetune(["--config", str(ROOT / "configs/tiny_lora.yaml"), f"output_dir={tmp_path / 'out'}", override])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(expected), err


def test_help_names_each_recipes_own_config(capsys):
    for main, config in ((full_finetune, "configs/tiny.yaml"), (lora_finetune, "configs/tiny_lora.yaml")):
        with pytest.raises(SystemExit) as shown:
            main(["--help"])
        assert shown.value.code == 0 and f"e.g. {config}" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as missing:
        full_finetune([])
    assert missing.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the following arguments are required: --config (see "), err


@pytest.mark.parametrize("override,expected", [
    ("+dataset.max_seq_lne=64", "error: dataset.max_seq_lne: InstructDataset has no option 'max_seq_lne' (did you mean "
                                "max_seq_len?)"),
    ("+optimizer.lrr=0.1", "error: optimizer.lrr: AdamW has no option 'lrr' (did you mean lr?)"),
    ("+dataset.zzz=1", "error: dataset.zzz: InstructDataset has no option 'zzz' (it takes source, "),
], ids=["dataset", "optimizer", "nothing-near"])
def test_an_option_the_class_does_not_take_is_named_with_the_nearest(override, expected, tmp_path, capsys):
    """A key the configured class does not take reached its constructor, after the model had loaded: Python's
    TypeError named neither the section nor what was meant. Now refused with the options, before anything is read."""
    out = tmp_path / "out"
    try:
        code = full_finetune(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", override])
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(expected), err
    assert not out.exists()
