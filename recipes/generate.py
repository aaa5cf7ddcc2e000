"""Talk to a model: generate from a prompt, or chat on stdin, streaming tokens as they come.

    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=outputs/tiny_chat/step_300 prompt="Hi"
    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=... chat=true      # a conversation on stdin
    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=BASE adapter_dir=outputs/run/step_N
    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=outputs/tiny_vlm/step_120 \
        image=assets/tiny_vlm/held_out/red.png prompt="What colour is this?"     # a vision-language model

``checkpoint_dir`` is any checkpoint the checkpointers read (HF, Meta, native; a run's ``step_N`` or its ``merged/``;
a torchrun run's sharded step; on disk or an object-store URL, copied to the local cache first);
``adapter_dir`` a PEFT LoRA adapter (ours or PEFT's) merged onto it for the session. Each reply ends with the
tokens per second; generation stops at the end-of-sequence and the template's end-of-turn tokens.

What is refused, in one ``error:`` line, before the weights are read where it can be:

* A directory with a ``MANIFEST.json`` (every step and ``merged/`` a run writes) that fails verification, as resume
  refuses it: a damaged step would load and print nonsense.
* A chat template that does not compile or render. Prompts go through the checkpoint's chat template (or
  ``chat_template``: a built-in name or a .jinja file); a checkpoint without one (a base model) takes them as plain
  text, with a ``note:`` saying so; ``plain_text=true`` asks for plain text whatever the checkpoint has.
* An adapter whose tensors do not fit the base (it was trained for another one). An adapter whose
  ``adapter_config.json`` names another base, with tensors that fit, is merged with a ``warning:`` line.

Length: the model has ``max_seq_len`` positions (config.json's ``max_position_embeddings``) for the prompt and the
reply. In a chat, the oldest turns are dropped (a system message stays), with a ``note:``, until the conversation
and ``max_new_tokens`` fit. When the newest message alone leaves less room than ``max_new_tokens``, the reply is
cut to the positions left, with a ``note:``. A prompt longer than all the positions is refused: ``prompt=`` in one
``error:`` line saying how many tokens it has and how many fit; a message typed in a chat is not sent (a ``note:``
says so) and the chat goes on.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from waypoint.cli.command import run_command  # noqa: E402
from waypoint.cli.config import parse_config  # noqa: E402
from waypoint.cli.image_prompt import ImagePrompt  # noqa: E402
from waypoint.cli.inference_model import build, note, open_adapter, open_checkpoint  # noqa: E402
from waypoint.cli.option_checks import GENERATE  # noqa: E402
from waypoint.errors import CheckpointError  # noqa: E402
from waypoint.models import Transformer  # noqa: E402
from waypoint.models.generate import Sampling, generate  # noqa: E402
from waypoint.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, ChatTemplateError, load_chat_template  # noqa: E402
from waypoint.text.stop_tokens import end_of_turn, end_of_turn_text, stop_token_ids  # noqa: E402
from waypoint.text.tokenizer import load_tokenizer  # noqa: E402

Messages = list[dict[str, str]]


class PromptTooLong(CheckpointError):
    """A prompt longer than the model's positions."""


def load(cfg) -> tuple[Transformer, Path]:
    """The checkpoint's model, with ``adapter_dir``'s LoRA merged in, for inference; and the directory holding its
    tokenizer."""
    checkpointer, _, tokenizer_dir, read_state = open_checkpoint(cfg.checkpoint_dir)
    return build(checkpointer, read_state(), open_adapter(cfg.get("adapter_dir")), cfg.device, cfg.dtype), tokenizer_dir


def chat_template(cfg, tokenizer) -> ChatTemplate | None:
    """The template prompts are rendered with, or None for plain text (``plain_text=true``, or a checkpoint without
    a template, which a note says). A template that does not compile, or fails on a first message, is refused."""
    if cfg.get("plain_text"):
        if cfg.get("chat_template"):
            raise CheckpointError(f"plain_text=true and chat_template={cfg.chat_template}: choose one")
        return None
    if cfg.get("chat_template") is None and tokenizer.chat_template is None:
        note(f"note: {tokenizer.directory} has no chat template (a base model?): prompts go in as plain text; "
             f"chat_template={'|'.join(sorted(BUILTIN_TEMPLATES))}|FILE.jinja gives them one")
        return None
    choose = f"choose another chat_template ({', '.join(sorted(BUILTIN_TEMPLATES))} or a .jinja file), or plain_text=true"
    try:
        template = load_chat_template(tokenizer, cfg.get("chat_template"))
    except ChatTemplateError as e:
        raise CheckpointError(f"{e}; {choose} for plain text") from e
    try:
        template.render(opening(cfg, "Hi"), add_generation_prompt=True)
    except ChatTemplateError as e:  # a template that refuses a system message: it may do without
        raise CheckpointError(f"{e}; {'leave out system=, or ' if cfg.get('system') else ''}{choose} for plain text") from e
    return template


def opening(cfg, text: str) -> Messages:
    return ([{"role": "system", "content": cfg.system}] if cfg.get("system") else []) + [{"role": "user", "content": text}]


def fit(messages: Messages, tokens: Callable[[Messages], list[int]], positions: int, max_new_tokens: int
        ) -> tuple[list[int], int, Messages]:
    """(the prompt's tokens, how many new tokens fit after it, the messages it holds) for ``messages`` ending with
    the user's newest: the oldest turns (a user message and its reply; a system message stays) go until the prompt
    and ``max_new_tokens`` fit in ``positions``, then the reply is cut to the room left. Raises PromptTooLong when
    the newest message alone takes every position."""
    keep = 1 if messages[0]["role"] == "system" else 0
    while True:
        prompt = tokens(messages)
        if len(prompt) + max_new_tokens - 1 <= positions or len(messages) - keep < 3:  # the newest alone
            break
        messages = messages[:keep] + messages[keep + 2:]
    if len(prompt) > positions:
        fits = positions - max_new_tokens + 1 if max_new_tokens < positions else positions
        room = f" to leave room for max_new_tokens={max_new_tokens}" if fits < positions else ""
        raise PromptTooLong(f"{len(prompt)} tokens, more than the model's {positions} positions; "
                            f"shorten it to at most {fits} tokens{room}")
    return prompt, min(max_new_tokens, positions - len(prompt) + 1), messages


CHECKS = GENERATE  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, description=__doc__.splitlines()[0], example="configs/generate.yaml", checks=CHECKS)

    def run() -> int:
        if not cfg.get("prompt") and not cfg.chat:
            print("error: nothing to do: give prompt=\"...\" or chat=true", file=sys.stderr)
            return 1
        checkpointer, _, tokenizer_dir, read_state = open_checkpoint(cfg.checkpoint_dir)
        adapter_dir = open_adapter(cfg.get("adapter_dir"))
        tokenizer = load_tokenizer(tokenizer_dir)
        template = chat_template(cfg, tokenizer)
        positions = checkpointer.model_args().max_seq_len
        messages = opening(cfg, "")[:-1]  # the system message, if any: the conversation so far
        # image=: read and checked now; the first message holds it (cli.image_prompt)
        picture = ImagePrompt(cfg.image, tokenizer_dir, tokenizer, checkpointer.model_args()) if cfg.get("image") else None
        if picture is not None and template is None:
            raise CheckpointError(f"image={cfg.image}: a conversation about an image needs a chat template; leave out plain_text")

        def tokens(turns: Messages) -> list[int]:
            if template is None:  # plain text: the message alone, without the conversation
                return tokenizer.encode(turns[-1]["content"], add_bos=True)
            rendered = template.render(turns, add_generation_prompt=True)
            return tokenizer.encode_with_offsets(picture.text(rendered) if picture is not None else rendered)[0]

        def fitted(text: str) -> tuple[list[int], int, Messages]:
            """``fit`` for the user's ``text`` after the conversation so far, with a note for what it leaves out."""
            content = picture.content(text) if picture is not None and not any(m["role"] == "user" for m in messages) else text
            asked = (messages if template is not None else []) + [{"role": "user", "content": content}]
            prompt, room, turns = fit(asked, tokens, positions, cfg.max_new_tokens)
            if len(turns) < len(asked):
                note(f"note: the {len(asked) - len(turns)} oldest messages left the conversation to fit the model's "
                     f"{positions} positions with max_new_tokens={cfg.max_new_tokens}")
            if room < cfg.max_new_tokens:
                note(f"note: the prompt has {len(prompt)} tokens of the model's {positions} positions: "
                     f"{room} new tokens at most this time (max_new_tokens={cfg.max_new_tokens})")
            return prompt, room, turns

        if cfg.get("prompt"):  # a prompt too long is refused before the weights are read
            try:
                first = fitted(cfg.prompt)
            except PromptTooLong as e:
                raise CheckpointError(f"prompt: {e}") from None
        model = build(checkpointer, read_state(), adapter_dir, cfg.device, cfg.dtype)
        stops = stop_token_ids(tokenizer, template)
        # the template's end of turn as text, where no single token of the tokenizer is it (a base tokenizer)
        turn_text = end_of_turn_text(template) if template is not None and end_of_turn(template, tokenizer) is None else None
        sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty)
        generator = torch.Generator().manual_seed(cfg.seed)

        def reply(prompt: list[int], room: int, turns: Messages) -> str:
            shown, out = "", []

            def stream(token: int) -> bool:
                nonlocal shown
                out.append(token)
                now = tokenizer.decode([t for t in out if t not in stops]).rstrip("\ufffd")  # whole characters only
                ended = bool(turn_text) and turn_text in now
                if ended:
                    now = now[:now.index(turn_text)]
                elif turn_text:  # hold back what may be the start of the end-of-turn text
                    now = now[:len(now) - next((k for k in range(len(turn_text) - 1, 0, -1) if now.endswith(turn_text[:k])), 0)]
                if now.startswith(shown):
                    print(now[len(shown):], end="", flush=True)
                    shown = now
                return ended

            started = time.perf_counter()
            generated = generate(model, prompt, room, sampling, stops, stream, generator,
                                 images=picture.inputs(prompt) if picture is not None else None)
            seconds = time.perf_counter() - started
            print(flush=True)
            print(f"[{len(generated)} tokens, {len(generated) / seconds:.1f} tokens/s]", file=sys.stderr)
            messages[:] = turns + [{"role": "assistant", "content": shown}]
            return shown

        if cfg.get("prompt"):
            reply(*first)
        if cfg.chat:
            print("chat: type a message, an empty line or Ctrl-D ends", file=sys.stderr)
            for line in sys.stdin:
                if not line.strip():
                    break
                try:
                    asked = fitted(line.rstrip("\n"))
                except PromptTooLong as e:  # the chat goes on
                    note(f"note: that message is {e}; it was not sent")
                    continue
                reply(*asked)
        return 0
    return run_command(run, also=(ValueError,))


if __name__ == "__main__":
    sys.exit(main())
