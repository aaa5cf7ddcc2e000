"""Multi-turn rollouts with tools, as TRL 1.16's ``GRPOTrainer._tool_call_loop`` runs them: the model writes a turn;
its tool calls (parsed in the family's format, ``waypoint.agents.tool_call_formats``) are made
(``waypoint.agents.toolbox``); their results are appended as the chat template renders tool messages, and the model
continues from there, until a turn calls no tool or ``max_tool_calling_iterations`` turns have called them.

What a rollout is (TRL's): the prompt's ids, then one completion holding every model turn and every tool result in
order, concatenated as ids (never re-tokenized, so the policy is trained on exactly what it sampled); a mask marking
the model's tokens (1) and the tools' (0), which stay in the sequence but out of the loss; and the completion as
messages (each assistant turn parsed, each tool result a ``{"role": "tool", "name", "content"}``), which is what the
reward functions receive. A tool result's tokens are what the template writes between an assistant turn that called
a tool and the next generation prompt (``suffix_ids``, TRL's ``_get_tool_suffix_ids``). Results that would push the
completion past ``max_completion_length`` tokens, or the sequence to the model's positions, are dropped and the
rollout ends there (TRL's rollback); a later turn is cut to what is left of the budget.

Where we differ from TRL: a tool call the model wrote malformed (bad JSON, no name, cut off) is answered with an
error message, as a failed call is, instead of ending the rollout with the call left as text; and each rollout's
environment is new (``ToolSet.toolbox``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from waypoint.agents.tool_call_formats import ParsedTurn, ToolCallFormat, detect_format
from waypoint.agents.toolbox import Toolbox, ToolError, ToolSet
from waypoint.text.chat_template import ChatTemplate
from waypoint.text.stop_tokens import end_of_turn

PREFIX_TOKENS = 32  # the prompt's last tokens a turn is parsed after (a generation prompt that opens a block)


@dataclass
class AgentRollout:
    """One rollout: ``prompt`` (ids), ``completion`` (ids: model turns and tool results), ``model_mask`` (1 at the
    model's tokens, 0 at the tools'), ``logps`` (an engine's log-probs of the completion, 0 at tool tokens; None for
    the native sampler), ``messages`` (the completion as messages), ``toolbox`` (its tools and environment)."""

    prompt: list[int]
    toolbox: Toolbox
    completion: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    logps: list[float] | None = None
    messages: list[dict] = field(default_factory=list)


class ToolTurns:
    """A run's multi-turn machinery: its tools (``ToolSet``), the chat template and tokenizer that render and
    parse turns, and the limits."""

    def __init__(self, toolset: ToolSet, template: ChatTemplate | None, tokenizer, max_completion_length: int,
                 max_positions: int, max_iterations: int | None) -> None:
        if template is None:
            raise ToolError("tools: tool calling needs conversational prompts (a list of messages, rendered with the "
                            "chat template); these prompts are plain text")
        self.toolset, self.template, self.tokenizer = toolset, template, tokenizer
        self.format: ToolCallFormat | None = detect_format(template.render_or_none)
        if self.format is None:
            raise ToolError(f"tools: {template.source}: the chat template writes no tool call in a format Waypoint "
                            "can read back (Qwen, Qwen3.5, Llama 3, gpt-oss, Gemma 4); use a model whose template "
                            "renders tool calls, or set dataset.template to one")
        self.end_of_turn = end_of_turn(template, tokenizer)  # the token the model ends a turn with (<|im_end|>)
        self.max_completion_length, self.max_positions = max_completion_length, max_positions
        self.max_iterations = max_iterations if max_iterations is not None else float("inf")

    def stop_ids(self) -> list[int]:
        """The ids that end a model turn in this format, beyond the template's end of turn."""
        out = []
        for text in self.format.turn_ends:
            ids = self.tokenizer.encode_with_offsets(text)[0]
            if len(ids) == 1:
                out.append(ids[0])
        return out

    # Rendering -----------------------------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's prompt ids, its generation prompt included, with the tools' schemas."""
        text = self.template.render(messages, add_generation_prompt=True, tools=self.toolset.schemas)
        return list(self.tokenizer.encode_with_offsets(text)[0])

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids the template writes for ``tool_messages`` after the assistant turn that called them, up to the
        next generation prompt. TRL's ``_get_tool_suffix_ids``: a one-call conversation rendered without them and
        with them (and the generation prompt); what follows the first, cut after its last end-of-sequence token.
        Where the template renders the calling turn differently once results follow it (Qwen3 drops an empty
        reasoning block; Gemma 4 keeps the turn open), where the turn ends is found from the call's own text: the
        longest run of the first rendering, from the call's name on, that the second holds (TRL swaps such a
        template for a patched copy instead)."""
        name = tool_messages[0]["name"]
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        dummy = self.template.with_arguments_it_takes(
            [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
        before = self.template.render(dummy)
        after = self.template.render(dummy + tool_messages, add_generation_prompt=True)
        ends = [t for t in (self.tokenizer.special_tokens.get("eos_token"), self.end_of_turn) if t]
        start = before.rfind(name)
        if after.startswith(before):
            held, at = before[max(start, 0):], max(start, 0)
        else:
            tail, origin = before[start:] if start >= 0 else "", after.find("dummy")
            length = len(tail)
            while length > len(name) and after.find(tail[:length], origin) < 0:
                length -= 1
            at = after.find(tail[:length], origin) if length > len(name) else -1
            if at < 0:
                raise self._not_appendable()
            held = tail[:length]
        last = max((held.rindex(t) + len(t) for t in ends if t in held), default=len(held))
        cut = at + last
        ids, offsets = self.tokenizer.encode_with_offsets(after)
        if cut < len(after) and not any(s == cut for s, _ in offsets):
            raise self._not_appendable()
        return [token for token, (s, _) in zip(ids, offsets) if s >= cut]

    def _not_appendable(self) -> ToolError:
        return ToolError(f"tools: {self.template.source}: cannot tell where the chat template ends the turn that called "
                         "a tool, so results cannot be appended to what the model wrote; set dataset.template to a "
                         "template that renders tool calls")

    def parse(self, ids: list[int], prefix: list[int]) -> ParsedTurn:
        decode = self.tokenizer.decode_with_special_tokens
        return self.format.parse(decode(ids), decode(prefix[-PREFIX_TOKENS:]), self.toolset.schemas)

    # The loop ------------------------------------------------------------------------------------------------------

    def run(self, rollouts: list[AgentRollout], first: list[list[int]], first_logps: list[list[float]] | None,
            sample: Callable[[list[list[int]], list[int], int, int], tuple[list[list[int]], list | None]],
            stop: Callable[[], bool] | None = None) -> None:
        """Fill each rollout from its first turn (``first[i]``, and an engine's ``first_logps[i]``): tools called and
        later turns sampled by ``sample(prefixes, rollout indices, turn, max_tokens) -> (turns, log-probs or
        None)``, each rollout's from its own prefix. ``stop``: polled while a tool runs (a preemption)."""
        pending: dict[int, ParsedTurn] = {}
        for i, (rollout, ids) in enumerate(zip(rollouts, first)):
            rollout.completion, rollout.model_mask = list(ids), [1] * len(ids)
            rollout.logps = list(first_logps[i]) if first_logps is not None else None
            if ids:
                parsed = self.parse(ids, rollout.prompt)
                rollout.messages.append(parsed.message)
                if _calls(parsed):
                    pending[i] = parsed
        turn = 0
        while pending and turn < self.max_iterations:
            turn += 1
            prefixes, suffixes = {}, {}
            for i, parsed in pending.items():
                rollout = rollouts[i]
                before = len(rollout.messages)
                results = self._call(rollout.toolbox, parsed, stop)
                rollout.messages.extend(results)
                suffix = self.suffix_ids(results)
                if suffix and rollout.completion and rollout.completion[-1] == suffix[0]:
                    suffix = suffix[1:]  # the model wrote the hand-over itself (Gemma 4 stops at <|tool_response>)
                prefix = rollout.prompt + rollout.completion + suffix
                if len(prefix) - len(rollout.prompt) > self.max_completion_length or len(prefix) >= self.max_positions:
                    del rollout.messages[before:]  # the results do not fit: the rollout ends as it is
                    continue
                prefixes[i], suffixes[i] = prefix, suffix
            if not prefixes:
                break
            order = list(prefixes)
            budget = {i: self.max_completion_length - (len(prefixes[i]) - len(rollouts[i].prompt)) for i in order}
            turns, logps = sample([prefixes[i] for i in order], order, turn, max(budget.values()))
            pending = {}
            for k, i in enumerate(order):
                rollout, ids = rollouts[i], list(turns[k][: budget[i]])
                rollout.completion += suffixes[i] + ids
                rollout.model_mask += [0] * len(suffixes[i]) + [1] * len(ids)
                if rollout.logps is not None:
                    rollout.logps += [0.0] * len(suffixes[i]) + list(logps[k][: len(ids)])
                if ids:
                    parsed = self.parse(ids, prefixes[i])
                    rollout.messages.append(parsed.message)
                    if _calls(parsed):
                        pending[i] = parsed

    @staticmethod
    def _call(toolbox: Toolbox, parsed: ParsedTurn, stop) -> list[dict]:
        """The tool messages answering a turn's calls, in order (a malformed call answered with its error)."""
        out = []
        for call in parsed.message.get("tool_calls") or ():
            function = call.get("function", {})
            name = function.get("name", "unknown")
            out.append({"role": "tool", "name": name, "content": toolbox.call(name, function.get("arguments"), stop)})
        for name, why in parsed.errors:
            toolbox.calls += 1
            out.append({"role": "tool", "name": name, "content": toolbox.failed(name, why)})
        return out


def _calls(parsed: ParsedTurn) -> bool:
    return bool(parsed.message.get("tool_calls") or parsed.errors)
