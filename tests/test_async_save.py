"""``async_checkpoint: true`` on one process: steps written in the background, bit-identical to synchronous saves,
a preemption waiting for the save in flight, and a background failure stopping the run with nothing committed."""

from __future__ import annotations

import errno
import json

import torch

from waypoint.checkpointers.commit import verify
from tests.conftest import ROOT, sigterm_at_step
from tests.test_resume import losses, weights

ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
        f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=2", "max_steps_per_epoch=4",
        "model.attn_dropout=0.1", "keep_last_n_checkpoints=null", "save_every_n_steps=2"]


def run(out, *more, stop_at=None):
    from recipes import full_finetune

    with sigterm_at_step(stop_at):
        return full_finetune.main([*ARGS, f"output_dir={out}", *more])


def test_async_saves_train_and_resume_exactly_like_sync_saves(tmp_path, capsys):
    assert run(tmp_path / "sync", "async_checkpoint=false") == 0
    assert run(tmp_path / "async", "async_checkpoint=true", stop_at=3) == 75  # step 2 in the background, then SIGTERM
    out = capsys.readouterr().out
    assert "saving step_2 in the background" in out
    assert verify(tmp_path / "async/step_2").ok and verify(tmp_path / "async/step_3").ok
    assert run(tmp_path / "async", "async_checkpoint=true") == 0
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for step in ("step_2", "step_6", "step_8"):  # written in the background, and the final one
        mine, theirs = weights(tmp_path / "async" / step), weights(tmp_path / "sync" / step)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), step
    a = torch.load(tmp_path / "async/step_6/recipe_state.pt", weights_only=True)
    s = torch.load(tmp_path / "sync/step_6/recipe_state.pt", weights_only=True)
    assert all(torch.equal(a["optimizer"]["state"][k]["exp_avg"], s["optimizer"]["state"][k]["exp_avg"])
               for k in s["optimizer"]["state"])
    assert a["rng"]["torch"].equal(s["rng"]["torch"])


def test_a_failed_background_save_stops_the_run_with_nothing_committed(tmp_path, capsys, monkeypatch):
    import waypoint.checkpointers.commit as commit

    close = commit.HashingFile.close_durably

    def full_disk(self):
        if "step_4" in str(self._file.name):
            raise OSError(errno.ENOSPC, "No space left on device")
        return close(self)
    monkeypatch.setattr(commit.HashingFile, "close_durably", full_disk)
    assert run(tmp_path, "async_checkpoint=true") == 1
    err = capsys.readouterr().err
    assert "error: could not write" in err and "step_4: No space left on device" in err
    assert len(err.strip().splitlines()) == 1 or "Traceback" not in err
    assert verify(tmp_path / "step_2").ok and not (tmp_path / "step_4").exists()
    assert not list(tmp_path.glob(".step_*")), "a half-written step was left behind"
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) <= 6, "the run went on long after its save failed"


def test_lora_async_saves_hold_the_adapters_and_merged_models_of_their_step(tmp_path):
    """Adapters, their optimizer state and the merged model (save_merged=every) written in the background are those
    of the step they were staged at, bitwise the synchronous run's."""
    from recipes import lora_finetune

    lora = ["--config", str(ROOT / "configs/tiny_lora.yaml"), f"checkpointer.checkpoint_dir={ROOT / 'assets/tiny_llama'}",
            f"dataset.source={ROOT / 'assets/tiny_alpaca.jsonl'}", "epochs=1", "max_steps_per_epoch=6",
            "save_every_n_steps=2", "keep_last_n_checkpoints=null", "save_merged=every"]
    for mode in ("false", "true"):
        assert lora_finetune.main([*lora, f"output_dir={tmp_path / mode}", f"async_checkpoint={mode}"]) == 0
    for step in ("step_2", "step_4", "step_6"):
        for sub in ("", "merged"):
            mine, theirs = weights(tmp_path / "true" / step / sub), weights(tmp_path / "false" / step / sub)
            assert mine and mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), (step, sub)
