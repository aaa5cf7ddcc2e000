"""A tiny random Gemma 3 vision-language model in Hugging Face's layout, for trying vision-language fine-tuning on a
laptop (``configs/tiny_vlm.yaml``):

    python scripts/make_tiny_vlm.py outputs/tiny_vlm_base

It writes what ``google/gemma-3-4b-it`` ships, at toy size: ``config.json`` (Gemma3ForConditionalGeneration: a
2-layer Gemma 3 text model, a 2-layer SigLIP tower on 28-pixel images, 4 tokens an image), ``model.safetensors``
(the text model under ``language_model.``, the tower under ``vision_tower.``, as transformers writes them), the tiny
Llama's tokenizer with Gemma 3's special tokens added, Gemma 3's chat template, and the image processor's
``preprocessor_config.json`` / ``processor_config.json``. transformers' ``Gemma3ForConditionalGeneration`` and
``AutoProcessor`` load it; Waypoint needs no transformers to make it."""

from __future__ import annotations

import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import json  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from waypoint.checkpointers.hf_source import disk_key  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402
from waypoint.cli.shipped import data_root  # noqa: E402
from waypoint.families import gemma3  # noqa: E402
from waypoint.families.gemma import gemma_args  # noqa: E402
from waypoint.families.vision_rules import GEMMA3_PREFIXES, gemma3_config  # noqa: E402
from waypoint.models.transformer import Transformer  # noqa: E402
from waypoint.models.vision_args import VisionArgs  # noqa: E402

SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
IMAGE_SIZE, TOKENS_PER_IMAGE = 28, 4
# transformers' Gemma3ImageProcessor fields (PIL's bilinear = 2; mean and std 0.5: pixels to [-1, 1])
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 2, "do_resize": True, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": None, "do_pan_and_scan": None}


def tiny_args(vocab_size: int, image_token_id: int) -> object:
    vision = VisionArgs(tower="siglip", dim=64, n_layers=2, n_heads=2, hidden_dim=128, image_size=IMAGE_SIZE, patch_size=7,
                        image_token_id=image_token_id, tokens_per_image=TOKENS_PER_IMAGE)
    return gemma_args(vocab_size=vocab_size, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256,
                      max_seq_len=512, sandwich_norms=True, qk_norm=True, attn_scale=32 ** -0.5, sliding_window=64,
                      full_attention_layers=(1,), rope_theta=10000.0, local_rope_theta=10000.0, vision=vision)


def make(out: Path, seed: int = 0) -> Path:
    assets = data_root() / "assets"
    tokenizer = Tokenizer.from_file(str(assets / "tiny_llama/tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    vocab_size = -(-tokenizer.get_vocab_size() // 8) * 8
    args = tiny_args(vocab_size, ids["<image_soft_token>"])
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    converter = gemma3.FAMILY.converter(args)
    hf = converter.from_native({k: v for k, v in model.state_dict().items() if k != "output.weight"})
    out.mkdir(parents=True, exist_ok=True)
    save_file({disk_key(GEMMA3_PREFIXES[1], k): v.contiguous() for k, v in hf.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    config = gemma3_config(args, gemma3.FAMILY.hf_config(args), ids["<start_of_image>"], ids["<end_of_image>"])
    config["text_config"] |= {"bos_token_id": 1, "eos_token_id": [2, ids["<end_of_turn>"]], "pad_token_id": 3}
    (out / "config.json").write_text(json.dumps(config | {"dtype": "float32"}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = json.loads((assets / "tiny_llama/tokenizer_config.json").read_text())
    tokenizer_config |= {"chat_template": (assets / "tiny_vlm/chat_template.jinja").read_text(),
                         "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                  "image_token": "<image_soft_token>"}}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(tokenizer_config["chat_template"])  # where a processor reads it
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                           "image_seq_length": TOKENS_PER_IMAGE}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, ids["<end_of_turn>"]],
                                                            "pad_token_id": 3}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out}: not empty; name a new or empty folder")

    def run() -> int:
        print(f"wrote {make(args.out, args.seed)}")
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
