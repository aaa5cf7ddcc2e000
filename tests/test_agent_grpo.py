"""recipes/grpo_finetune.py with tools (issue 54, items 4-6): multi-turn rollouts through the recipe, TRL's tool
metrics, an environment's reward and instances reaching the reward functions, tool output out of the loss, and a
stopped and rerun run bitwise equal to an uninterrupted one.

The policy is a tiny Qwen3 taught the calculator traces of assets/tiny_agent.jsonl first (its first 8, so that it
calls tools on those 8 questions; a random tiny model never writes a call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes.full_finetune import main as full_finetune
from recipes.grpo_finetune import main as grpo_finetune
from scripts import make_tiny
from tests.conftest import ROOT, sigterm_at_step
from waypoint.checkpointers.commit import verify

QUESTIONS = 8
FAST = ["epochs=1", "max_steps_per_epoch=3", "batch_size=2", "gradient_accumulation_steps=1", "progress=off",
        "generation.num_generations=4", "save_every_epoch=false", "save_every_n_steps=1", "keep_last_n_checkpoints=null",
        "validation=null"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Qwen3 that calls the calculator on the first 8 questions, those questions as GRPO prompts). 120 steps
    at a constant lr after the warmup: its 3 GRPO steps below then call a tool in 7 or 8 rollouts of 8 and get the
    answer in 6-8 (measured); 150 steps of the shipped cosine decay, 25% more compute, called in 4-7 and got 1."""
    root = tmp_path_factory.mktemp("agent")
    traces, prompts = root / "traces.jsonl", root / "prompts.jsonl"
    lines = (ROOT / "assets/tiny_agent.jsonl").read_text().splitlines()[:QUESTIONS]
    traces.write_text("\n".join(lines) + "\n")
    prompts.write_text("".join(line + "\n" for line in
                               (ROOT / "assets/tiny_agent_grpo.jsonl").read_text().splitlines()[:QUESTIONS]))
    base = make_tiny.make("qwen3", root / "base")
    assert full_finetune(["--config", str(ROOT / "configs/tiny_chat.yaml"), f"checkpointer.checkpoint_dir={base}",
                          f"output_dir={root / 'sft'}", "dataset.template=null", f"dataset.source={traces}",
                          "dataset.max_seq_len=1280", "epochs=120", "optimizer.lr=5e-3", "+lr_scheduler.min_lr_ratio=1.0",
                          "save_every_epoch=false", "progress=off", "validation=null"]) == 0
    return root / "sft" / "step_120", prompts


def run(agent, out: Path, *more: str, stop_at: int | None = None) -> int:
    checkpoint, prompts = agent
    with sigterm_at_step(stop_at):
        return grpo_finetune(["--config", str(ROOT / "configs/tiny_agent_grpo.yaml"), f"output_dir={out}",
                              f"checkpointer.checkpoint_dir={checkpoint}", f"dataset.source={prompts}", *FAST, *more])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "resumed")} for r in rows]


def tensor_bytes(step: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(step.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def whole(agent, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole")
    assert run(agent, out) == 0
    return out


def test_a_multi_turn_run_logs_trls_tool_metrics_and_the_environments_reward(whole):
    train = [r for r in records(whole) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert {"tools/call_frequency", "tools/failure_frequency", "rewards/Calculator/mean"} <= train[0].keys()
    assert all(r["tools/call_frequency"] > 0 for r in train)  # the policy calls its tools, so rollouts have turns
    assert any(r["rewards/Calculator/mean"] > 0 for r in train)  # some call returned the answer
    assert verify(whole / "step_3").ok


def test_stopped_and_rerun_is_bitwise_the_uninterrupted_run(agent, whole, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(agent, out, stop_at=2) == 75
    assert run(agent, out) == 0
    assert "resuming from step_2" in capsys.readouterr().out
    assert tensor_bytes(out / "step_3") == tensor_bytes(whole / "step_3")
    assert without_timing(records(out)) == without_timing(records(whole))  # the same rollouts, tools and rewards


def test_reward_functions_get_the_rollouts_messages_and_environments(agent, tmp_path, monkeypatch):
    """TRL's reward call with tools: completions are the rollout's messages (assistant turns parsed, tool results),
    environments each rollout's own instance, reset with its record."""
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "peek_rewards.py").write_text(
        "import json\n"
        f"def peek(prompts, completions, environments, answer, **kw):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        for c, e, a in zip(completions, environments, answer):\n"
        "            f.write(json.dumps({'messages': c, 'env_answer': e.answer, 'answer': a, 'env': id(e)}) + '\\n')\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert run(agent, tmp_path / "out", "reward_funcs=[peek_rewards.peek]", "max_steps_per_epoch=1") == 0
    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(rows) == 2 * 4 and len({r["env"] for r in rows}) == 8  # a new environment for every rollout
    assert all(r["env_answer"] == r["answer"] for r in rows)
    assert all(r["messages"][0]["role"] == "assistant" for r in rows)
    called = [r["messages"] for r in rows if len(r["messages"]) > 1]
    assert called, "no rollout called a tool"
    for messages in called:  # a call answered with its result, or a malformed one with an error
        assert messages[1]["role"] == "tool"
        assert messages[1]["content"].startswith("{'error'") or (
            messages[1]["name"] in ("add", "multiply") and messages[0]["tool_calls"][0]["function"]["name"] ==
            messages[1]["name"])
    assert any(not m[1]["content"].startswith("{'error'") for m in called), "no call succeeded"


def test_tool_output_is_out_of_the_loss(agent, tmp_path, monkeypatch):
    """Every rollout the step trains on: its labels are its completion's tokens but -100 exactly at the tools'."""
    from waypoint.models.fused_loss import IGNORE_INDEX
    from waypoint.training import grpo_step

    packed = []
    original = grpo_step.GRPOStep._pack

    def spy(self, prompts, completions, keep, advantages, model_masks=None):
        rollout = original(self, prompts, completions, keep, advantages, model_masks)
        packed.append((prompts, completions, model_masks, rollout))
        return rollout

    monkeypatch.setattr(grpo_step.GRPOStep, "_pack", spy)
    assert run(agent, tmp_path / "out", "max_steps_per_epoch=1") == 0
    tools = 0
    for prompts, completions, masks, rollout in packed:
        for row, (prompt, completion, mask) in enumerate(zip(prompts, completions, masks)):
            assert len(mask) == len(completion)
            labels = rollout.labels[row, len(prompt): len(prompt) + len(completion)].tolist()
            assert labels == [t if m else IGNORE_INDEX for t, m in zip(completion, mask)]
            tools += mask.count(0)
    assert tools > 0  # some rollout has tool output


def test_an_engine_samples_every_turn_with_its_rows_seeds_and_tool_tokens_score_nothing(tmp_path):
    """With an engine in the policy's place (vLLM): each rollout's first turn is one request seeded as a single-turn
    row is (base + r), each later turn one request from the rollout's own history seeded turn_seed(base + r, t), and
    the engine's log-probs line up with the completion, 0 at the tools' tokens."""
    from waypoint.agents.tool_loop import ToolTurns
    from waypoint.agents.tool_schema import tool_schema
    from waypoint.agents.toolbox import ToolSet
    from waypoint.models.fused_loss import IGNORE_INDEX
    from waypoint.models.sample_group import group_seed
    from waypoint.text.chat_template import load_chat_template
    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.training.distributed import Distributed
    from waypoint.training.grpo_loss import GRPOLossOptions
    from waypoint.training.grpo_step import GRPOStep, RolloutOptions, group_generator, turn_seed

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: A number.
            b: Another.
        """
        return a + b

    directory = make_tiny.make("qwen3", tmp_path / "qwen3")
    tokenizer = load_tokenizer(directory)
    turns = ToolTurns(ToolSet([add], None, [tool_schema(add)], False, None), load_chat_template(tokenizer), tokenizer,
                      200, 2048, 3)
    encode = lambda text: list(tokenizer.encode_with_offsets(text)[0])  # noqa: E731
    call = encode('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    answer = encode("It is 5.<|im_end|>")
    requests = []

    class Engine:
        def sample(self, prompts, seeds, max_tokens, sampling, stop_ids, stop_strings):
            requests.append(seeds)
            out = [call if tokenizer.decode_with_special_tokens(p).endswith("assistant\n") and "<tool_response>" not in
                   tokenizer.decode_with_special_tokens(p) else answer for p in prompts]
            return out, [[-0.5] * len(ids) for ids in out]

    user = [{"role": "user", "content": "What is 2 plus 3?"}]
    items = [{"prompt_ids": turns.prompt_ids(user), "prompt": user, "columns": {}, "index": i} for i in range(2)]
    step = GRPOStep(RolloutOptions(num_generations=2, max_completion_length=200), GRPOLossOptions(),
                    [lambda completions, **kw: [float(len(c)) for c in completions]], None, tokenizer,
                    [tokenizer.eos_id], conversational=True, device=torch.device("cpu"), dist=Distributed(),
                    engine=Engine(), turns=turns)
    rollouts, metrics = step.rollouts(None, [items], seed=7)
    bases = [group_seed(group_generator(7, i)) for i in range(2)]
    rows = [b + r for b in bases for r in range(2)]
    assert requests == [[[s] for s in rows], [[turn_seed(s, 1)] for s in rows]]
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    rollout, prompt = rollouts[0], len(items[0]["prompt_ids"])
    for row in range(4):
        labels = rollout.labels[row, prompt:]
        scored = rollout.sampling_logps[row, prompt - 1:]
        trained = labels != IGNORE_INDEX
        assert trained.sum() == len(call) + len(answer)
        assert torch.equal(scored[: len(labels)] != 0, trained[: len(scored)])  # the engine's log-probs, model tokens only


class Hinting:
    """An environment whose reset returns text for the prompt (TRL: appended to the last user message)."""

    def reset(self, answer: str = "", **row) -> str:
        return f" Hint: {answer}."

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: A number.
            b: Another.
        """
        return a + b


@pytest.mark.parametrize("kind, content", [("qwen3", "What is 2 plus 3?"),
                                           ("qwen3_5", [{"type": "text", "text": "What is 2 plus 3?"}])],
                         ids=["text", "parts"])  # Qwen3's template writes no list content; Qwen3.5's does
def test_what_reset_returns_is_appended_to_the_prompt(tmp_path, kind, content):
    from waypoint.agents.tool_loop import ToolTurns
    from waypoint.agents.tool_schema import tool_schema
    from waypoint.agents.toolbox import ToolSet
    from waypoint.text.chat_template import load_chat_template
    from waypoint.text.tokenizer import load_tokenizer
    from waypoint.training.distributed import Distributed
    from waypoint.training.grpo_loss import GRPOLossOptions
    from waypoint.training.grpo_step import GRPOStep, RolloutOptions

    tokenizer = load_tokenizer(make_tiny.make(kind, tmp_path / kind))
    template = load_chat_template(tokenizer)
    turns = ToolTurns(ToolSet([], Hinting, [tool_schema(Hinting().add)], False, None), template, tokenizer, 50, 2048, 1)
    prompts = []

    class Engine:
        def sample(self, rows, seeds, max_tokens, sampling, stop_ids, stop_strings):
            prompts.extend(rows)
            return [[tokenizer.eos_id]] * len(rows), [[0.0]] * len(rows)

    user = [{"role": "user", "content": content}]
    items = [{"prompt_ids": turns.prompt_ids(user), "prompt": user, "columns": {"answer": "5"}, "index": 0}]
    step = GRPOStep(RolloutOptions(num_generations=2, max_completion_length=50), GRPOLossOptions(),
                    [lambda completions, **kw: [0.0, 1.0]], None, tokenizer, [tokenizer.eos_id], conversational=True,
                    device=torch.device("cpu"), dist=Distributed(), engine=Engine(), turns=turns)
    step.rollouts(None, [items], seed=0)
    expected = content + " Hint: 5." if isinstance(content, str) else content + [{"type": "text", "text": " Hint: 5."}]
    hinted = template.render([{"role": "user", "content": expected}], True, turns.toolset.schemas)
    assert [tokenizer.decode_with_special_tokens(p) for p in prompts] == [hinted, hinted]
    assert "What is 2 plus 3? Hint: 5." in hinted
