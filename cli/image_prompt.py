"""``image=PATH`` for recipes/generate.py: a conversation about an image with a vision-language checkpoint.

The image is read and checked, and the checkpoint's image processor found (``vision.processors``), before the
weights are read (each problem one line naming the option). The first user message then holds an image part before
its text, as a chat template expects (``[{"type": "image"}, {"type": "text", "text": ...}]``); the rendered
prompt's placeholder is expanded and the image's inputs made as the checkpoint's HF processor makes them (Gemma 3's
pixel values; Qwen3.5's patches and grid); the model reads them in the prompt's first forward, each time the
conversation (still holding that message) is prompted."""

from __future__ import annotations

from pathlib import Path

import torch

from waypoint.errors import CheckpointError, first_line

# what to do about an image= file that is no usable image (a dataset's advice, "drop the record", has no meaning here)
READABLE = "point image= at a readable image file (PNG, JPEG, ...)"


class ImagePrompt:
    def __init__(self, path: str, checkpoint_dir: Path, tokenizer, model_args) -> None:
        from waypoint.vision.image_files import load_image
        from waypoint.vision.processors import image_processor_for

        if model_args.vision is None:
            raise CheckpointError(f"image={path}: {checkpoint_dir} is a text model (no vision tower); leave out image=")
        try:
            self.processor = image_processor_for(checkpoint_dir, tokenizer)
            image = load_image(path, f"image={path}", fix=READABLE)
            self.expansion = self.processor.expansion(image)
            self.images = self.processor.model_inputs([image])
        except (OSError, ValueError) as e:
            raise CheckpointError(first_line(e)) from e

    @staticmethod
    def content(text: str) -> list[dict]:
        return [{"type": "image"}, {"type": "text", "text": text}]

    def text(self, rendered: str) -> str:
        """The rendered prompt with its image placeholder expanded, as the processor expands it."""
        return rendered.replace(self.processor.placeholder, self.expansion, 1)

    def inputs(self, prompt: list[int]) -> dict[str, torch.Tensor] | None:
        """The prompt's image inputs for the model (None when the image's message has left the conversation)."""
        types = self.processor.token_types(prompt)
        if not any(types):
            return None
        return {**self.images, self.processor.token_type_key: torch.tensor([types])}
