"""Talk to a model: generate from a prompt, or chat on stdin, streaming tokens as they come.

    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=outputs/tiny_chat/step_150 prompt="Hi"
    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=... chat=true      # a conversation on stdin
    python recipes/generate.py --config configs/generate.yaml checkpoint_dir=BASE adapter_dir=outputs/run/step_N

``checkpoint_dir`` is any checkpoint the checkpointers read (HF, Meta, native; a run's ``step_N`` or its ``merged/``;
a torchrun run's sharded step; on disk or an object-store URL, copied to the local cache first);
``adapter_dir`` a PEFT LoRA adapter (ours or PEFT's) merged onto it for the session. Prompts go through the
checkpoint's chat template (or ``chat_template``: a built-in name or a .jinja file) when it has one, as plain text
otherwise; generation stops at the end-of-sequence and the template's end-of-turn tokens. Each reply ends with the
tokens per second.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from waypoint.checkpointers import checkpointer_for, load_into  # noqa: E402
from waypoint.checkpointers.peft_adapter import load_adapter  # noqa: E402
from waypoint.checkpointers.sharded_checkpoint import holds_sharded_model  # noqa: E402
from waypoint.cli.command import run_command  # noqa: E402
from waypoint.cli.config import parse_config  # noqa: E402
from waypoint.cli.option_checks import GENERATE  # noqa: E402
from waypoint.models import Transformer, parse_dtype  # noqa: E402
from waypoint.models.generate import Sampling, generate  # noqa: E402
from waypoint.models.lora import merge_state_dict  # noqa: E402
from waypoint.run.object_store import local_copy  # noqa: E402
from waypoint.run.recipe_state import sharded_step_model  # noqa: E402
from waypoint.text.chat_template import ChatTemplateError, load_chat_template  # noqa: E402
from waypoint.text.stop_tokens import end_of_turn, end_of_turn_text, stop_token_ids  # noqa: E402
from waypoint.text.tokenizer import load_tokenizer  # noqa: E402


def load(cfg) -> tuple[Transformer, Path]:
    """The checkpoint's model, with ``adapter_dir``'s LoRA merged in, in ``dtype`` on ``device``, for inference; and
    the directory holding its tokenizer (a torchrun step's is its run's input)."""
    directory = local_copy(cfg.checkpoint_dir, say=lambda line: print(line, file=sys.stderr))  # s3://...: a local copy
    if holds_sharded_model(directory):  # a torchrun step: the run's model class and input, the weights from the shards
        checkpointer, loaded, _ = sharded_step_model(directory)
        state, tokenizer_dir = loaded["model"], checkpointer.checkpoint_dir
    else:
        checkpointer = checkpointer_for(directory, output_dir=directory.parent)
        state, tokenizer_dir = checkpointer.load_checkpoint()["model"], directory
    args = checkpointer.model_args()
    if cfg.get("adapter_dir"):
        adapter_dir = local_copy(cfg.adapter_dir, say=lambda line: print(line, file=sys.stderr))
        adapter, config = load_adapter(adapter_dir, checkpointer.hf_converter())
        state = merge_state_dict(state, adapter, float(config["lora_alpha"]) / int(config["r"]))
    with torch.device("meta"):
        model = Transformer(args)
    load_into(model, state, parse_dtype(cfg.dtype))
    return model.to(cfg.device).eval(), Path(tokenizer_dir)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, description=__doc__.splitlines()[0], example="configs/generate.yaml", checks=GENERATE)

    def run() -> int:
        model, tokenizer_dir = load(cfg)
        tokenizer = load_tokenizer(tokenizer_dir)
        try:
            template = load_chat_template(tokenizer, cfg.get("chat_template"))
        except ChatTemplateError:
            if cfg.get("chat_template"):
                raise
            template = None  # a base model: plain text
        stops = stop_token_ids(tokenizer, template)
        # the template's end of turn as text, where no single token of the tokenizer is it (a base tokenizer)
        turn_text = end_of_turn_text(template) if template is not None and end_of_turn(template, tokenizer) is None else None
        sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty)
        generator = torch.Generator().manual_seed(cfg.seed)
        messages = [{"role": "system", "content": cfg.system}] if cfg.get("system") else []

        def reply(text: str) -> str:
            messages.append({"role": "user", "content": text})
            if template is not None:
                prompt = tokenizer.encode_with_offsets(template.render(messages, add_generation_prompt=True))[0]
            else:
                prompt = tokenizer.encode(text, add_bos=True)
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
            tokens = generate(model, prompt, cfg.max_new_tokens, sampling, stops, stream, generator)
            seconds = time.perf_counter() - started
            print(flush=True)
            print(f"[{len(tokens)} tokens, {len(tokens) / seconds:.1f} tokens/s]", file=sys.stderr)
            messages.append({"role": "assistant", "content": shown})
            return shown

        if cfg.get("prompt"):
            reply(cfg.prompt)
        if cfg.chat:
            print("chat: type a message, an empty line or Ctrl-D ends", file=sys.stderr)
            for line in sys.stdin:
                if not line.strip():
                    break
                reply(line.rstrip("\n"))
        elif not cfg.get("prompt"):
            print("error: nothing to do: give prompt=\"...\" or chat=true", file=sys.stderr)
            return 1
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
