"""Multi-turn rollouts with tools (issue 54, item 4): given the model's turns, the ids, the tool mask and the messages
the reward functions receive are those TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) builds, run on the same
tokenizer, template and tools."""

from __future__ import annotations

import json
import types

import pytest

from scripts import make_tiny
from tests.conftest import TRL_ORACLE
from waypoint.agents.tool_loop import AgentRollout, ToolTurns
from waypoint.agents.tool_schema import tool_schema
from waypoint.agents.toolbox import ToolSet
from waypoint.text.chat_template import load_chat_template
from waypoint.text.tokenizer import load_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def explode(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot do {x}")


def shout(text: str) -> str:
    """Repeat a text many times.

    Args:
        text: The text.
    """
    return text * 400


TOOLS = [add, multiply, explode, shout]
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
END = "<|im_end|>"

# each rollout: its question, then the model's turns in order (as text, its special tokens written out)
SCRIPTS = {
    "reasoning, one call, then the answer": [
        "What is 2 plus 3?",
        "<think>\nadd them\n</think>\n\n" + CALL.format("add", '{"a": 2, "b": 3}') + END, "It is 5." + END],
    "parallel calls, then an unknown tool, then the answer": [
        "What is 1 plus 1, and 2 times 4?",
        CALL.format("add", '{"a": 1, "b": 1}') + "\n" + CALL.format("multiply", '{"a": 2, "b": 4}') + END,
        "Checking " + CALL.format("nope", "{}") + END, "2 and 8." + END],
    "no tool at all": ["What is 2 plus 2?", "4." + END],
    "a tool that raises, and missing arguments": [
        "Explode?", CALL.format("explode", '{"x": 1}') + END, CALL.format("add", '{"a": 1}') + END, "Sorry." + END],
    "a result past the completion budget ends the rollout": [
        "Shout hi.", CALL.format("shout", '{"text": "hi "}') + END, "never sampled" + END],
    "calls on every turn, stopped by max_tool_calling_iterations": [
        "Count.", *[CALL.format("add", '{"a": %d, "b": 1}' % k) + END for k in range(6)]],
}
MAX_COMPLETION, MAX_ITERATIONS = 400, 3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 with Qwen3's published template; its tokenizer's EOS is <|im_end|>, as Qwen3's is."""
    directory = make_tiny.make("qwen3", tmp_path_factory.mktemp("qwen3-agent"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": END}))
    return directory


def trl_rollouts(directory, scripts):
    """TRL 1.16's loop over the scripted turns: (prompt ids, completion ids, tool masks, completions)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import (get_training_chat_template, is_chat_template_prefix_preserving,
                                         parse_response, qwen3_template)
    from trl.trainer.grpo_trainer import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.response_template = qwen3_template  # what add_response_schema sets for Qwen3's template
    chat_template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
    prompts = [[{"role": "user", "content": turns[0]}] for turns in scripts]
    prompt_ids = [tokenizer.apply_chat_template(p, tools=TOOLS, chat_template=chat_template, add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for p in prompts]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn = [1] * len(scripts)

    def generate(prefixes, images, fields, num_generations, has_tool_images=False):
        out = []
        for prefix in prefixes:
            i = next(k for k, ids in enumerate(prompt_ids) if prefix[: len(ids)] == ids)
            turn[i] += 1
            out.append(encode(scripts[i][turn[i]]))
        return out, None

    fake = types.SimpleNamespace(
        _sync_tool_dicts=[{f.__name__: f for f in TOOLS} for _ in scripts], _async_tool_dicts=[{} for _ in scripts],
        max_tool_calling_iterations=MAX_ITERATIONS, use_vllm=False, _is_vlm=False, tools=TOOLS,
        environment_factories=None, max_completion_length=MAX_COMPLETION, processing_class=tokenizer,
        chat_template=chat_template, chat_template_kwargs={}, _tokenizer=tokenizer,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096)),
        _generate_single_turn=generate)
    fake._get_tool_suffix_ids = types.MethodType(GRPOTrainer._get_tool_suffix_ids, fake)
    completion_ids = [encode(turns[1]) for turns in scripts]
    completions = [[parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=TOOLS)]
                   for i, ids in enumerate(completion_ids)]
    mask, completions, completion_ids, _, calls, failures, _ = GRPOTrainer._tool_call_loop(
        fake, prompts, prompt_ids, completion_ids, completions, None, None, {})
    return prompt_ids, completion_ids, mask, completions, calls, failures


def our_rollouts(directory, scripts):
    tokenizer = load_tokenizer(directory)
    toolset = ToolSet(TOOLS, None, [tool_schema(f) for f in TOOLS], False, None)
    turns = ToolTurns(toolset, load_chat_template(tokenizer), tokenizer, MAX_COMPLETION, 4096, MAX_ITERATIONS)
    encode = lambda text: list(tokenizer.encode_with_offsets(text)[0])  # noqa: E731
    rollouts = [AgentRollout(turns.prompt_ids([{"role": "user", "content": s[0]}]), toolset.toolbox({}, 0)[0])
                for s in scripts]

    def sample(prefixes, which, turn, most):
        assert all(p[: len(rollouts[i].prompt)] == rollouts[i].prompt for p, i in zip(prefixes, which))
        return [encode(scripts[i][1 + turn])[:most] for i in which], None

    turns.run(rollouts, [encode(s[1]) for s in scripts], None, sample)
    return rollouts, turns


@TRL_ORACLE
def test_the_rollouts_are_the_ones_trls_tool_loop_builds(qwen3):
    scripts = list(SCRIPTS.values())
    prompt_ids, completion_ids, mask, completions, calls, failures = trl_rollouts(qwen3, scripts)
    rollouts, _ = our_rollouts(qwen3, scripts)
    for name, rollout, prompt, ids, tool_mask, messages in zip(SCRIPTS, rollouts, prompt_ids, completion_ids, mask,
                                                              completions):
        assert rollout.prompt == prompt, name
        assert rollout.completion == ids, name
        assert rollout.model_mask == tool_mask, name
        assert rollout.messages == messages, name
    assert sum(r.toolbox.calls for r in rollouts) == calls
    assert sum(r.toolbox.failures for r in rollouts) == failures
    # what the cases are there for
    by_name = dict(zip(SCRIPTS, rollouts))
    assert [m["content"] for m in by_name["parallel calls, then an unknown tool, then the answer"].messages
            if m["role"] == "tool"] == ["2", "8", "{'error': 'Tool nope not found.'}"]
    assert by_name["no tool at all"].model_mask == [1] * len(by_name["no tool at all"].completion)
    shouted = by_name["a result past the completion budget ends the rollout"]
    assert len(shouted.messages) == 1 and 0 not in shouted.model_mask
    counted = by_name["calls on every turn, stopped by max_tool_calling_iterations"]
    assert sum(m["role"] == "tool" for m in counted.messages) == MAX_ITERATIONS


def test_tool_output_is_in_the_sequence_but_never_the_models(qwen3):
    rollouts, turns = our_rollouts(qwen3, [SCRIPTS["reasoning, one call, then the answer"]])
    rollout = rollouts[0]
    tokenizer = turns.tokenizer
    tool_part = tokenizer.decode_with_special_tokens([t for t, m in zip(rollout.completion, rollout.model_mask) if not m])
    model_part = tokenizer.decode_with_special_tokens([t for t, m in zip(rollout.completion, rollout.model_mask) if m])
    assert tool_part == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert model_part == SCRIPTS["reasoning, one call, then the answer"][1] + "It is 5." + END


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Tiny checkpoints of the families whose templates write tool calls in another format than Qwen3's."""
    root = tmp_path_factory.mktemp("families")
    return {name: make_tiny.make(name, root / name) for name in ("qwen3_5", "llama", "gpt_oss", "gemma4")}


@pytest.mark.parametrize("name, format_name", [("qwen3_5", "qwen3_5"), ("llama", "llama3"), ("gpt_oss", "harmony"),
                                               ("gemma4", "gemma4")])
def test_each_familys_rollout_is_its_templates_rendering_of_the_conversation(families, name, format_name):
    """The model's turns written as the template writes them (a call to add, then the answer): the rollout's text is
    the template's rendering of the whole conversation, the call is read back, the result's tokens are out of the
    model's mask, and the turn is where each format ends it (gpt-oss at <|call|>, Gemma 4 at <|tool_response>)."""
    tokenizer = load_tokenizer(families[name])
    template = load_chat_template(tokenizer)
    toolset = ToolSet([add], None, [tool_schema(add)], False, None)
    turns = ToolTurns(toolset, template, tokenizer, 400, 4096, 4)
    assert turns.format.name == format_name
    user = [{"role": "user", "content": "What is 2 plus 3?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    result = {"role": "tool", "name": "add", "content": "5"}
    render = lambda messages, prompt: template.render(template.with_arguments_it_takes(messages), prompt,  # noqa: E731
                                                     toolset.schemas)
    stops = [t for t in (turns.end_of_turn, *turns.format.turn_ends) if t]

    def model_turn(before: str, after: str) -> str:  # what the model writes: the rendering's new text to its stop
        text = after[len(before):]
        return text[: min(text.index(s) + len(s) for s in stops if s in text)]

    first = model_turn(render(user, True), render(user + [call], False))
    last = model_turn(render(user + [call, result], True), render(user + [call, result, {"role": "assistant",
                                                                                         "content": "It is 5."}], False))
    encode = lambda text: list(tokenizer.encode_with_offsets(text)[0])  # noqa: E731
    rollout = AgentRollout(turns.prompt_ids(user), toolset.toolbox({}, 0)[0])
    turns.run([rollout], [encode(first)], None, lambda prefixes, which, turn, most: ([encode(last)], None))
    whole = render(user + [call, result, {"role": "assistant", "content": "It is 5."}], False)
    decode = tokenizer.decode_with_special_tokens
    assert decode(rollout.prompt + rollout.completion) == whole[: whole.rindex(last) + len(last)]
    assert rollout.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert rollout.messages[1] == result and rollout.messages[2]["content"] == "It is 5."
    tool_text = decode([t for t, m in zip(rollout.completion, rollout.model_mask) if not m])
    assert "5" in tool_text and "It is 5." not in tool_text
    assert decode([t for t, m in zip(rollout.completion, rollout.model_mask) if m]) == first + last
