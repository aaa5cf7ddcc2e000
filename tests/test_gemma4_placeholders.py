"""Gemma 4's placeholder tokens (image, video, audio) as transformers' ``Gemma4Model`` takes them: looked up as the pad
token in the embeddings and the per-layer embeddings, with their media or without (text that merely contains one, as
a generation that emits one feeds it back). Our logits against ``Gemma4ForConditionalGeneration``'s on a tiny random
multimodal Gemma 4, each placeholder kind alone, beside images, and at transformers' default ids (outside this tiny
vocabulary, where an ordinary lookup could not even index)."""

from __future__ import annotations

import pytest
import torch

from tests.test_gemma4_vision import AUDIO, IMAGES, PREPROCESSOR, TEXT, VISION
from waypoint.vision.gemma4_images import from_preprocessor_config, preprocess

IMAGE, VIDEO, AUDIO_TOKEN = 260, 261, 262


@pytest.fixture(scope="module", params=[0, 8], ids=["no-ple", "ple"])
def models(request, tmp_path_factory):
    """(transformers' model, ours) for video and audio ids inside the vocabulary, with and without per-layer inputs."""
    return _models(tmp_path_factory, request.param, video_token_id=VIDEO, audio_token_id=AUDIO_TOKEN)


def _models(tmp_path_factory, per_layer: int, **ids):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from waypoint.checkpointers import load_model

    text = dict(TEXT, hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=300, pad_token_id=3)
    config = Gemma4Config(text_config=text, vision_config=VISION, audio_config=AUDIO, image_token_id=IMAGE, **ids)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("gemma4_placeholders")
    hf.save_pretrained(path)
    return hf, load_model(path).eval()


def _diff(hf, ours, tokens, **media) -> torch.Tensor:
    """Per position, max |ours - transformers'| over the vocabulary."""
    with torch.no_grad():
        expected = hf(input_ids=tokens, **media).logits
        got = ours(tokens, **media)
    return (got - expected).abs().amax(-1)


@pytest.mark.parametrize("placeholder", [IMAGE, VIDEO, AUDIO_TOKEN], ids=["image", "video", "audio"])
def test_a_placeholder_without_its_media_is_the_pad_token(models, placeholder):
    hf, ours = models
    tokens = torch.tensor([[5, 9, placeholder, 17, placeholder, 8, 40], [placeholder, 7, 33, 60, 61, 62, placeholder]])
    diff = _diff(hf, ours, tokens)
    print(f"\nplaceholder {placeholder}: max |native - transformers| logit = {diff.max():.3g}")
    assert diff.max() <= 1e-5
    # looked up as an ordinary token instead (the code before): the logits move at and after each placeholder
    ours._text_tokens = lambda t: t
    try:
        ordinary = _diff(hf, ours, tokens)
    finally:
        del ours._text_tokens
    assert ordinary[tokens == placeholder].min() > 1e-3


def test_video_and_audio_placeholders_beside_images(models):
    hf, ours = models
    inputs = preprocess([IMAGES[0], IMAGES[7]], from_preprocessor_config(PREPROCESSOR))
    n = inputs["num_soft_tokens_per_image"].tolist()
    row = [5, VIDEO, *[IMAGE] * n[0], 17, AUDIO_TOKEN, *[IMAGE] * n[1], 8, VIDEO, 40]
    tokens = torch.tensor([row])
    media = dict(pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"],
                 mm_token_type_ids=(tokens == IMAGE).long())
    assert _diff(hf, ours, tokens, **media).max() <= 1e-5


def test_transformers_default_ids_outside_the_vocabulary(tmp_path_factory):
    """Gemma4Config's default video and audio ids (258884, 258881) in a 300-token model: transformers looks them up
    as the pad token; so do we, where an ordinary lookup would index past the table."""
    hf, ours = _models(tmp_path_factory, 8)
    assert (ours.args.vision.video_token_id, ours.args.vision.audio_token_id) == (258884, 258881)
    tokens = torch.tensor([[5, 258884, 17, 258881, IMAGE, 40]])
    assert _diff(hf, ours, tokens).max() <= 1e-5
