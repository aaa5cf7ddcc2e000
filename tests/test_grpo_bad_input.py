"""recipes/grpo_finetune.py's bad input: each option out of range, each malformed prompt record, each reward function
that cannot be had; one ``error:`` line naming the option, file, record or function, and nothing written."""

from __future__ import annotations

import json

import pytest

from recipes.grpo_finetune import main as grpo_finetune
from tests.conftest import ROOT
from tests.test_dpo_bad_input import error_lines

CONFIG = ROOT / "configs" / "tiny_grpo.yaml"
GOOD = {"prompt": "Write the letter a.", "letter": "a"}

# override -> the error line's start
CASES = [
    ("reward_funcs=[]", "error: reward_funcs: none given; name at least one reward function (or an environment_factory"),
    ("reward_funcs_unknown_module", "error: reward_funcs: no_such_rewards.f: no module no_such_rewards"),
    ("reward_funcs_unknown_builtin", "error: reward_funcs: answer_matches: not a built-in reward"),
    ("reward_funcs_bad_option", "error: reward_funcs: answer_match: no option colum (options: column, normalize)"),
    ("reward_weights=[1,x]", "error: reward_weights=[1, 'x']: expected null (all 1) or a list of finite numbers"),
    ("reward_weights=[nan]", "error: reward_weights=[nan]: expected null (all 1) or a list of finite numbers"),
    ("reward_weights_too_many", "error: reward_weights: 2 weights for 1 reward_funcs"),
    ("reward_timeout=0", "error: reward_timeout=0: expected a number > 0"),
    ("reward_timeout=inf", "error: reward_timeout=inf: expected a finite number > 0"),
    ("generation=8", "error: generation=8: expected a section {num_generations"),
    ("generation_greedy", "error: generation.temperature=0 samples every completion of a group alike"),
    ("generation.num_generations=1", "error: generation.num_generations=1: expected an integer >= 2"),
    ("generation.max_completion_length=0", "error: generation.max_completion_length=0: expected an integer >= 1"),
    ("generation.max_completion_length_past_the_model", "error: the longest prompt and generation.max_completion_length=600"),
    ("generation.temperature=-1", "error: generation.temperature=-1: expected a number >= 0"),
    ("generation.top_p=0", "error: generation.top_p=0: expected a number > 0 and <= 1"),
    ("generation.top_k=-1", "error: generation.top_k=-1: expected an integer >= 0"),
    ("generation.repetition_penalty=0", "error: generation.repetition_penalty=0: expected a number > 0"),
    ("generation.stop_strings=[\"\"]", "error: generation.stop_strings=['']: expected null or a list of non-empty strings"),
    ("generation.mask_truncated_completions=maybe", "error: generation.mask_truncated_completions=maybe: expected true or false"),
    ("generation.unknown_key", "error: generation.min_p: no such option"),
    ("generation.engine=vlm", "error: generation.engine=vlm: expected one of native, vllm"),
    ("use_vllm=maybe", "error: use_vllm=maybe: expected true or false"),
    ("use_vllm_disagrees", "error: use_vllm=true and generation.engine=native disagree: keep one of them"),
    ("vllm=3", "error: vllm=3: expected null or a section {vllm_mode,"),
    ("vllm_mode_unknown", "error: vllm.vllm_mode='remote': expected colocate or server"),
    ("vllm_server_url", "error: vllm.vllm_server_base_url='localhost:8000': expected a URL such as http://10.0.0.5:8000"),
    ("vllm_server_port", "error: vllm.vllm_server_port=70000: expected a port number (1-65535)"),
    ("vllm_server_timeout", "error: vllm.vllm_server_timeout=0: expected seconds > 0"),
    ("vllm_batch_invariant", "error: vllm.vllm_batch_invariant='yes': expected true or false"),
    ("vllm_unknown_key", "error: vllm.vllm_gpu_mem: no such option (options: vllm_batch_invariant, vllm_enable_sleep_mode,"),
    ("vllm_bad_sampling_mode", "error: vllm.vllm_importance_sampling_mode='token': expected one of token_truncate,"),
    ("vllm_bad_clip", "error: vllm.vllm_importance_sampling_clip_min (4.0) must be less than "
                      "vllm_importance_sampling_clip_max (3.0)"),
    ("vllm_tensor_parallel", "error: vllm.vllm_tensor_parallel_size=2: only 1 is supported yet"),
    ("vllm_memory", "error: vllm.vllm_gpu_memory_utilization=1.5: expected a number in (0, 1]"),
    ("loss.loss_type=ppo", "error: loss.loss_type=ppo: expected one of grpo, bnpo"),
    ("loss.importance_sampling_level=word", "error: loss.importance_sampling_level=word: expected one of token, sequence"),
    ("loss.scale_rewards=prompt", "error: loss.scale_rewards=prompt: expected group, batch, none"),
    ("loss.beta=-0.1", "error: loss.beta=-0.1: expected a number >= 0"),
    ("loss.beta=nan", "error: loss.beta=nan: expected a finite number >= 0"),
    ("loss.epsilon=-1", "error: loss.epsilon=-1: expected a number >= 0"),
    ("loss.epsilon_high=inf", "error: loss.epsilon_high=inf: expected null or a finite number >= 0"),
    ("loss.delta=-2", "error: loss.delta=-2: expected null or a number >= 0"),
    ("loss.num_iterations=0", "error: loss.num_iterations=0: expected an integer >= 1"),
    ("loss.unknown_key", "error: loss.epsilon_low: no such option"),
    ("dataset.max_prompt_length=0", "error: dataset.max_prompt_length=0: expected null or an integer >= 1"),
    ("lora=8", "error: lora=8: expected null (full fine-tuning) or a section {targets, rank, alpha, dropout}"),
    ("quantize_base=int8", "error: quantize_base=int8: expected null or one of nf4"),
    ("quantize_base_without_lora", "error: quantize_base: a 4-bit base is frozen, so it needs a lora section (QLoRA)"),
    ("dataset.source_missing", "error: "),
    ("tools_unknown_module", "error: tools: no_such_tools.f: no module no_such_tools in the working directory"),
    ("tools=3", "error: tools=3: expected null or a list of module.function paths"),
    ("environment_factory_missing", "error: environment_factory: waypoint.assets.tiny_agent_tools.Abacus: "
                                    "waypoint.assets.tiny_agent_tools"),
    ("tool_timeout=0", "error: tool_timeout=0: expected a number > 0"),
    ("generation.max_tool_calling_iterations=-1", "error: generation.max_tool_calling_iterations=-1: expected null or an "
                                                  "integer >= 0"),
    ("tools_with_text_prompts", "error: tools: tool calling needs conversational prompts"),
    ("dataset.record_without_prompt", "error: {data}: record 2 (line 2): missing key 'prompt'"),
    ("dataset.record_with_a_number_for_prompt", "error: {data}: record 1 (line 1): 'prompt' must be a string or a non-empty list"),
    ("dataset.record_ending_with_the_answer", "error: {data}: record 1 (line 1): 'prompt' ends with an assistant message"),
    ("dataset.columns_unknown", "error: columns: "),
]

OVERRIDES = {  # rows whose id is not itself the override
    "reward_funcs_unknown_module": ["reward_funcs=[no_such_rewards.f]"],
    "reward_funcs_unknown_builtin": ["reward_funcs=[answer_matches]"],
    "reward_funcs_bad_option": ["reward_funcs=[{name: answer_match, colum: letter}]"],
    "reward_weights_too_many": ["reward_weights=[1.0,2.0]"],
    "generation_greedy": ["generation.temperature=0"],
    "generation.engine=vlm": ["+generation.engine=vlm"],
    "use_vllm=maybe": ["+use_vllm=maybe"],
    "use_vllm_disagrees": ["+use_vllm=true", "+generation.engine=native"],
    "vllm=3": ["+vllm=3"],
    "vllm_mode_unknown": ["+generation.engine=vllm", "+vllm={vllm_mode: remote}"],
    "vllm_server_url": ["+generation.engine=vllm", "+vllm={vllm_mode: server, vllm_server_base_url: 'localhost:8000'}"],
    "vllm_server_port": ["+generation.engine=vllm", "+vllm={vllm_mode: server, vllm_server_port: 70000}"],
    "vllm_server_timeout": ["+generation.engine=vllm", "+vllm={vllm_mode: server, vllm_server_timeout: 0}"],
    "vllm_batch_invariant": ["+generation.engine=vllm", "+vllm={vllm_batch_invariant: 'yes'}"],
    "vllm_unknown_key": ["+generation.engine=vllm", "+vllm={vllm_gpu_mem: 0.5}"],
    "vllm_bad_sampling_mode": ["+generation.engine=vllm", "+vllm={vllm_importance_sampling_mode: token}"],
    "vllm_bad_clip": ["+generation.engine=vllm", "+vllm={vllm_importance_sampling_clip_min: 4.0}"],
    "vllm_tensor_parallel": ["+generation.engine=vllm", "+vllm={vllm_tensor_parallel_size: 2}"],
    "vllm_memory": ["+generation.engine=vllm", "+vllm={vllm_gpu_memory_utilization: 1.5}"],
    "generation.max_completion_length_past_the_model": ["generation.max_completion_length=600"],
    "generation.unknown_key": ["+generation.min_p=0.1"],
    "loss.unknown_key": ["+loss.epsilon_low=0.1"],
    "quantize_base_without_lora": ["quantize_base=nf4"],
    "dataset.source_missing": ["dataset.source={tmp}/nowhere.jsonl"],
    "tools_unknown_module": ["+tools=[no_such_tools.f]"],
    "tools=3": ["+tools=3"],
    "environment_factory_missing": ["+environment_factory=waypoint.assets.tiny_agent_tools.Abacus"],
    "tool_timeout=0": ["+tool_timeout=0"],
    "generation.max_tool_calling_iterations=-1": ["+generation.max_tool_calling_iterations=-1"],
    "tools_with_text_prompts": ["+tools=[waypoint.assets.tiny_agent_tools.add]"],
    "dataset.record_without_prompt": ["dataset.source={data}"],
    "dataset.record_with_a_number_for_prompt": ["dataset.source={data}"],
    "dataset.record_ending_with_the_answer": ["dataset.source={data}", "dataset.template=chatml"],
    "dataset.columns_unknown": ["dataset.columns={answer: text}"],
}
RECORDS = {
    "dataset.record_without_prompt": [GOOD, {"question": "Write b.", "letter": "b"}],
    "dataset.record_with_a_number_for_prompt": [{**GOOD, "prompt": 3}],
    "dataset.record_ending_with_the_answer": [{**GOOD, "prompt": [{"role": "user", "content": "a?"},
                                                                 {"role": "assistant", "content": "a"}]}],
}


def overrides_of(case_id: str, tmp, data) -> list[str]:
    return [o.replace("{tmp}", str(tmp)).replace("{data}", str(data)) for o in OVERRIDES.get(case_id, [case_id])]


@pytest.mark.parametrize("case_id,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_grpo_input_is_one_line_and_writes_nothing(case_id, expected, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS.get(case_id, [GOOD] * 16)))
    out = tmp_path / "out"
    try:  # an option the table refuses exits while the config is parsed; the rest return from the run
        status = grpo_finetune(["--config", str(CONFIG), f"output_dir={out}", *overrides_of(case_id, tmp_path, data)])
    except SystemExit as stop:
        status = stop.code
    assert status == 1
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(expected.replace("{data}", str(data))), err
    assert not out.exists() or not any(out.iterdir())
