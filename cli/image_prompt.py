"""``image=PATH`` for recipes/generate.py: a conversation about an image with a vision-language checkpoint.

The image is read and checked, and the checkpoint's image settings found, before the weights are read (each
problem one line naming the option). The first user message then holds an image part before its text, as a chat
template expects (``[{"type": "image"}, {"type": "text", "text": ...}]``); the rendered prompt's image placeholder is
expanded and the pixel values made as the checkpoint's HF processor makes them; the model reads them in the
prompt's first forward, each time the conversation (still holding that message) is prompted."""

from __future__ import annotations

from pathlib import Path

import torch

from waypoint.errors import CheckpointError, first_line


class ImagePrompt:
    def __init__(self, path: str, checkpoint_dir: Path, tokenizer, model_args) -> None:
        from waypoint.vision.gemma3_images import Gemma3Images
        from waypoint.vision.image_files import load_image

        if model_args.vision is None:
            raise CheckpointError(f"image={path}: {checkpoint_dir} is a text model (no vision tower); leave out image=")
        if model_args.vision.tower != "siglip":
            raise CheckpointError(f"image={path}: generate takes images for Gemma 3 checkpoints so far "
                                  f"({checkpoint_dir} has a {model_args.vision.tower} tower)")
        try:
            self.processor = Gemma3Images.from_checkpoint(checkpoint_dir, tokenizer)
            self.pixel_values = self.processor.pixel_values([load_image(path, f"image={path}")])
        except (OSError, ValueError) as e:
            raise CheckpointError(first_line(e)) from e

    @staticmethod
    def content(text: str) -> list[dict]:
        return [{"type": "image"}, {"type": "text", "text": text}]

    def text(self, rendered: str) -> str:
        """The rendered prompt with its image placeholder expanded, as the processor expands it."""
        return self.processor.expand(rendered)

    def inputs(self, prompt: list[int]) -> dict[str, torch.Tensor] | None:
        """The prompt's image inputs for the model (None when the image's message has left the conversation)."""
        types = self.processor.token_type_ids(prompt)
        if not any(types):
            return None
        return {"pixel_values": self.pixel_values, "token_type_ids": torch.tensor([types])}
