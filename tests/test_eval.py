"""recipes/eval.py and lm-eval's ``waypoint`` model class: on the shipped local tasks (assets/eval_tasks: multiple
choice, generate_until, rolling loglikelihood) our numbers are lm-eval's own ``hf`` backend's on the same checkpoint
(accuracies and generations exactly, each request's loglikelihood within 1e-4 in fp32); a base with an adapter
evaluates as the merged model; the recipe writes lm-eval's results beside the adapter, never over a file.
Nothing is downloaded: the hub and datasets are offline and the tasks read their JSON-lines files."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys

import pytest
import torch

from tests.conftest import LM_EVAL, ROOT
from waypoint.errors import CheckpointError
from tests.test_generate import lora_adapter_of

pytest.importorskip("lm_eval")
pytestmark = LM_EVAL

TINY = ROOT / "assets/tiny_llama"  # 512 positions
TASKS = ROOT / "assets/eval_tasks"
ALL = ["tiny_choice", "tiny_generate", "tiny_wikitext"]
MAX_LENGTH = 128  # the longest document is 546 tokens: five rolling windows


@pytest.fixture(scope="module", autouse=True)
def offline():
    """The hub and datasets offline (the variables for anything started from here, and the flags read at import)."""
    import datasets.config
    import huggingface_hub
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(sys.modules[huggingface_hub.is_offline_mode.__module__], "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(model, manager, tasks=ALL, **options) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, bootstrap_iters=0, log_samples=True, **options)


def responses(results: dict) -> dict:
    """(task, document, request) -> the model's raw answer: a generated text, a loglikelihood or (loglikelihood,
    greedy)."""
    return {(task, sample["doc_id"], i): response[0] for task, samples in results["samples"].items()
            for sample in samples for i, response in enumerate(sample["resps"])}


def largest_difference(ours: dict, theirs: dict) -> float:
    """The largest loglikelihood difference over the requests; generated texts and greedy flags must be equal."""
    assert ours.keys() == theirs.keys()
    worst = 0.0
    for key, mine in ours.items():
        if isinstance(mine, str):
            assert mine == theirs[key], key
            continue
        if isinstance(mine, tuple):
            assert mine[1] == theirs[key][1], key
            mine, other = mine[0], theirs[key][0]
        else:
            other = theirs[key]
        worst = max(worst, abs(mine - other))
    return worst


@pytest.fixture(scope="module")
def hf_model():
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(TINY), device="cpu", dtype="float32", batch_size=1, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def hf_results(hf_model, manager):
    return evaluate(hf_model, manager)


@pytest.fixture(scope="module")
def adapter_and_merged(tmp_path_factory):
    """A seeded random LoRA adapter of the tiny checkpoint, and the two merged offline by scripts/merge_lora.py."""
    from scripts.merge_lora import merge

    tmp = tmp_path_factory.mktemp("adapter")
    adapter = lora_adapter_of(TINY, tmp / "adapter")
    return adapter, merge(TINY, adapter, tmp / "merged")


def test_numbers_equal_lm_evals_hf_backend(hf_results, manager):
    from waypoint.evaluation.harness_lm import WaypointLM

    ours = evaluate(WaypointLM.from_checkpoint(str(TINY), max_length=MAX_LENGTH, batch_size=4), manager)
    difference = largest_difference(responses(ours), responses(hf_results))
    assert difference < 1e-4, difference
    mine, theirs = ours["results"], hf_results["results"]
    for task, metric in [("tiny_choice", "acc,none"), ("tiny_choice", "acc_norm,none"), ("tiny_generate", "exact_match,strip")]:
        assert mine[task][metric] == theirs[task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isclose(mine["tiny_wikitext"][metric], theirs["tiny_wikitext"][metric], rel_tol=1e-6), metric
    assert len(responses(ours)) == 8 * 4 + 6 + 3
    print(f"\nmax |loglikelihood difference| {difference:.2e} over {len(responses(ours)) - 6} requests; "
          f"acc {mine['tiny_choice']['acc,none']} (hf {theirs['tiny_choice']['acc,none']}), "
          f"acc_norm {mine['tiny_choice']['acc_norm,none']}, exact_match {mine['tiny_generate']['exact_match,strip']}")


def test_greedy_generation_with_a_repetition_penalty_is_hflms(hf_model, hf_results, manager):
    """A task's repetition_penalty changes greedy decoding in transformers, and in ours the same way."""
    from waypoint.evaluation.harness_lm import WaypointLM

    penalized = {"repetition_penalty": 1.3}
    theirs = responses(evaluate(hf_model, manager, ["tiny_generate"], limit=3, gen_kwargs=penalized))
    ours = responses(evaluate(WaypointLM.from_checkpoint(str(TINY), max_length=MAX_LENGTH), manager, ["tiny_generate"],
                              limit=3, gen_kwargs=penalized))
    assert ours == theirs
    assert any(text != responses(hf_results)[key] for key, text in ours.items()), "the penalty changes the text"


@pytest.mark.parametrize("add_bos_token", [None, True, False])
@pytest.mark.parametrize("post_processor", [True, False], ids=["bos_post_processor", "no_post_processor"])
def test_tokens_are_hflms(add_bos_token, post_processor, tmp_path):
    """What each request is encoded to (tok_encode with and without special tokens, context/continuation split,
    generation prompts) is HFLM's, for each add_bos_token, with a tokenizer that adds a BOS and one that adds none."""
    from lm_eval.models.huggingface import HFLM

    from waypoint.evaluation.harness_lm import WaypointLM

    checkpoint = TINY
    if not post_processor:
        checkpoint = tmp_path / "ckpt"
        shutil.copytree(TINY, checkpoint)
        tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
        (checkpoint / "tokenizer.json").write_text(json.dumps({**tokenizer, "post_processor": None}))
    theirs = HFLM(pretrained=str(checkpoint), device="cpu", dtype="float32", add_bos_token=add_bos_token)
    ours = WaypointLM.from_checkpoint(str(checkpoint), add_bos_token=add_bos_token)
    assert ours.prefix_token_id == theirs.prefix_token_id and ours.eot_token_id == theirs.eot_token_id
    texts = ["Question: what is it?\nAnswer:", "<s>hello world", " leading space", "hello</s> world", ""]
    for text in texts:
        for add in (None, True, False):
            assert ours.tok_encode(text, add_special_tokens=add) == theirs.tok_encode(text, add_special_tokens=add), (text, add)
        if text:
            assert ours._prompt(text, 100) == theirs.tok_batch_encode([text])[0][0].tolist(), text
            assert ours._encode_pair(text, " yes") == theirs._encode_pair(text, " yes"), text


@pytest.mark.parametrize("config", [{}, {"clean_up_tokenization_spaces": True},
                                    {"clean_up_tokenization_spaces": True,
                                     "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}],
                         ids=["no_clean_up", "clean_up_ignored_for_bpe", "clean_up_forced"])
def test_generated_text_is_decoded_as_hflm_decodes_it(config, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from waypoint.evaluation.harness_lm import WaypointLM

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(TINY, checkpoint)
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **config}))
    theirs = HFLM(pretrained=str(checkpoint), device="cpu", dtype="float32")
    ours = WaypointLM.from_checkpoint(str(checkpoint))
    ids = ours.tok_encode("hello , world . isn't it ? we 're here </s> ok", add_special_tokens=False) + [ours.eot_token_id]
    assert ours.tokens.decode(ids) == theirs.tok_decode(ids)
    assert (" ," not in ours.tokens.decode(ids)) == (len(config) == 2)  # cleaned up where forced only


def test_base_with_an_adapter_evaluates_as_the_merged_model(adapter_and_merged, hf_results, manager):
    from waypoint.evaluation.harness_lm import WaypointLM

    adapter, merged = adapter_and_merged
    tasks = ["tiny_choice", "tiny_wikitext"]
    with_adapter = responses(evaluate(WaypointLM.from_checkpoint(str(TINY), str(adapter), max_length=MAX_LENGTH), manager, tasks))
    of_merged = responses(evaluate(WaypointLM.from_checkpoint(str(merged), max_length=MAX_LENGTH), manager, tasks))
    assert largest_difference(with_adapter, of_merged) < 1e-5
    base = {key: value for key, value in responses(hf_results).items() if key[0] in tasks}
    assert largest_difference(with_adapter, base) > 1e-3, "the adapter changes the model"


def run_eval(capsys, *overrides: str) -> tuple[int, str, str]:
    """recipes/eval.py in process with configs/eval.yaml and ``overrides``: (exit status, stdout, stderr)."""
    from recipes import eval as recipe

    capsys.readouterr()
    try:
        code = recipe.main(["--config", str(ROOT / "configs/eval.yaml"), f"include_path=[{TASKS}]", "bootstrap_iters=0",
                            *overrides])
    except SystemExit as stop:  # a bad option: parse_config exits
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_recipe_prints_the_table_and_writes_results_beside_the_adapter_never_over_a_file(adapter_and_merged, manager,
                                                                                          capsys):
    from waypoint.checkpointers.commit import verify
    from waypoint.evaluation.harness_lm import WaypointLM

    adapter, merged = adapter_and_merged
    for name in ("eval_results.json", "eval_results_2.json"):
        code, out, err = run_eval(capsys, f"checkpoint_dir={TINY}", f"adapter_dir={adapter}", "tasks=[tiny_choice,tiny_wikitext]",
                                  f"max_length={MAX_LENGTH}", "limit=4")
        assert code == 0, err[-3000:]
        assert "|tiny_choice  |" in out and "|tiny_wikitext|" in out and "acc_norm" in out, out
        assert f"results: {adapter / name}" in err
    first, second = (json.loads((adapter / n).read_text()) for n in ("eval_results.json", "eval_results_2.json"))
    assert first["results"] == second["results"] and first["config"]["adapter_dir"] == str(adapter)
    expected = evaluate(WaypointLM.from_checkpoint(str(merged), max_length=MAX_LENGTH), manager, ["tiny_choice", "tiny_wikitext"],
                        limit=4)["results"]
    assert first["results"]["tiny_choice"]["acc,none"] == expected["tiny_choice"]["acc,none"]
    assert math.isclose(first["results"]["tiny_wikitext"]["word_perplexity,none"],
                        expected["tiny_wikitext"]["word_perplexity,none"], rel_tol=1e-6)
    assert verify(adapter).ok, "the results beside a committed step leave its manifest whole"


def test_a_task_file_runs_from_any_directory(tmp_path, capsys, monkeypatch):
    """A task given as its YAML file, from another working directory: its data is found beside it, and only that
    file is indexed (not lm-eval's own tasks)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_eval(capsys, f"checkpoint_dir={TINY}", f"tasks=[{TASKS / 'tiny_choice.yaml'}]", "include_path=null",
                              "limit=2", "output=results/tiny.json")
    assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "results/tiny.json").read_text())["results"]["tiny_choice"]["sample_len"] == 2


def test_the_model_class_is_registered_for_lm_eval_by_name(manager):
    """``simple_evaluate(model="waypoint", model_args="checkpoint_dir=...")``, as lm-eval builds its own backends."""
    importlib.import_module("waypoint.evaluation.harness_lm")  # registers the class

    results = evaluate("waypoint", manager, ["tiny_choice"], model_args=f"checkpoint_dir={TINY},max_length={MAX_LENGTH}",
                       limit=2)
    assert results["config"]["checkpoint_dir"] == str(TINY) and results["results"]["tiny_choice"]["sample_len"] == 2


def test_eval_while_training_logs_the_scores_eval_py_gives_and_changes_no_step(tmp_path, manager):
    """``eval: {tasks, every_n_steps}`` in the full recipe: scores at steps 2 and 3 (the last) in metrics.jsonl, the
    last equal to WaypointLM's on the final checkpoint; every training record and the final weights bitwise those of
    the same run without evaluation (the random states are put back)."""
    from recipes import full_finetune
    from waypoint.evaluation.harness_lm import WaypointLM

    def run(out, *extra):
        assert full_finetune.main(["--config", str(ROOT / "configs/tiny.yaml"), f"output_dir={out}", "epochs=1",
                                   "max_steps_per_epoch=3", "batch_size=2", *extra]) == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    with_eval = run(tmp_path / "eval", f"+eval={{tasks:[tiny_choice],every_n_steps:2,include_path:[{TASKS}],limit:4}}")
    plain = run(tmp_path / "plain")
    scores = [r for r in with_eval if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in scores] == [2, 3] and set(scores[0]) == {"step", "eval/tiny_choice/acc", "eval/tiny_choice/acc_norm"}
    drop = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs if "loss" in r]  # noqa: E731
    assert drop(with_eval) == drop(plain)
    for name in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        assert (tmp_path / "eval/step_3" / name).read_bytes() == (tmp_path / "plain/step_3" / name).read_bytes()
    results = evaluate(WaypointLM.from_checkpoint(str(tmp_path / "plain/step_3")), manager, ["tiny_choice"], limit=4)
    assert scores[-1]["eval/tiny_choice/acc"] == results["results"]["tiny_choice"]["acc,none"]


def test_eval_while_training_puts_the_random_states_and_the_mode_back(manager, monkeypatch):
    import random

    import torch.utils.collect_env

    from lm_eval import simple_evaluate

    from waypoint.checkpointers import load_model
    from waypoint.evaluation.during_training import TrainingEval
    from waypoint.evaluation.harness_lm import WaypointLM
    from waypoint.text.tokenizer import load_tokenizer

    model, tokenizer = load_model(TINY, dtype=torch.float32).train(), load_tokenizer(TINY)
    training_eval = TrainingEval.from_config({"tasks": ["tiny_choice"], "every_n_steps": 5, "include_path": [str(TASKS)],
                                              "limit": 2}, world_size=1)
    assert [training_eval.due(s, 12) for s in (4, 5, 10, 11, 12)] == [False, True, True, False, True]
    torch.manual_seed(7)
    random.seed(7)
    before = torch.get_rng_state(), random.getstate()
    described = []  # lm-eval's description of the environment (pip list, nvidia-smi...): not gathered at each eval
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: described.append(1) or "env")
    assert set(training_eval.run(model, tokenizer)) == {"eval/tiny_choice/acc", "eval/tiny_choice/acc_norm"}
    assert model.training and torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert described == []
    # the negative controls: lm-eval seeds the global generators itself, and describes the environment
    results = simple_evaluate(model=WaypointLM(model, tokenizer), tasks=["tiny_choice"], task_manager=manager, limit=2,
                              bootstrap_iters=0)
    assert not torch.equal(torch.get_rng_state(), before[0])
    assert described == [1] and results["pretty_env_info"] == "env"
    with pytest.raises(CheckpointError, match=r"^eval: evaluating while training is single-process; under torchrun"):
        TrainingEval.from_config({"tasks": ["tiny_choice"], "every_n_steps": 5}, world_size=2)
