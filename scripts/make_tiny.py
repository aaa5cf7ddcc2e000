"""Write a tiny random checkpoint of a model family, in that family's Hugging Face layout, to try it on a laptop.

    python scripts/make_tiny.py qwen3_5 outputs/tiny_qwen3_5

``--list`` names every kind it makes (one per family, and the multimodal repos of Gemma 3, Gemma 4 and Qwen3.5/3.6).
Each is the family's own shape at toy size (64 wide, 2 layers, random weights, seeded), made without transformers:
the native model built from the tiny config, saved through the family's converter with the config.json the family
writes (``model.safetensors``); the tiny Llama's tokenizer (``assets/tiny_llama``) with the special tokens of the
family's chat template added; that template, the release's own text (``assets/chat_templates``, where a verified
copy ships); and for a multimodal repo the image processor's files its processor reads. transformers'
``AutoModelForCausalLM`` (``*ForConditionalGeneration`` for multimodal repos) and ``AutoTokenizer`` load it. Its last
line is a fine-tune to try on it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import difflib  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from waypoint.checkpointers.base import Conversion, write_directory  # noqa: E402
from waypoint.checkpointers.hf_checkpointer import HFCheckpointer  # noqa: E402
from waypoint.checkpointers.hf_source import HFSource  # noqa: E402
from waypoint.cli.command import OneLineParser, run_command  # noqa: E402
from waypoint.cli.shipped import data_root  # noqa: E402
from waypoint.errors import CheckpointError  # noqa: E402
from waypoint.families import checked_model_args, family_named  # noqa: E402
from waypoint.models.transformer import Transformer  # noqa: E402

HYBRID = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
GEMMA4 = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=64, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8)
# the chat templates' tokens: (special ones, plain added ones), as the releases' tokenizers hold them
QWEN_TOKENS = (("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
               ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"))
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GEMMA3_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>", "<end_of_image>")
GEMMA4_TOKENS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>", "<|tool_call>",
                 "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|image>", "<image|>",
                 "<|audio|>", "<|audio>", "<audio|>", "<|video|>")
DEEPSEEK_TOKENS = tuple(f"<｜{t}｜>" for t in ("User", "Assistant", "end▁of▁sentence", "tool▁calls▁begin", "tool▁calls▁end",
                                              "tool▁call▁begin", "tool▁call▁end", "tool▁outputs▁begin", "tool▁outputs▁end",
                                              "tool▁output▁begin", "tool▁output▁end", "tool▁sep"))


@dataclass(frozen=True)
class Kind:
    """One kind of tiny checkpoint: a family, its tiny config.json fields, its chat template and its tokens."""

    family: str
    text: dict  # the family's config.json fields over TEXT
    template: str | None  # a file under assets/ (None: no verified copy of the release's template ships)
    special: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    vision: str | None = None  # the multimodal repo's kind: "gemma3", "gemma4" or "qwen" (VISION)
    end_of_turn: str | None = None  # the token that ends an assistant turn (generation_config.json's eos_token_id)
    note: str = ""
    about: str = ""


TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False)
NO_TEMPLATE = "no chat template (no verified copy of the release's ships): train with configs/tiny.yaml or dataset.template=chatml"
KINDS: dict[str, Kind] = {
    "llama": Kind("llama", {}, "chat_templates/llama3_2.jinja", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                                                  "<|eom_id|>", "<|python_tag|>"), end_of_turn="<|eot_id|>",
                  about="Llama 3.2 (Llama 3.2 Instruct's template)"),
    "mistral": Kind("mistral", dict(sliding_window=None), None, note=NO_TEMPLATE, about="Mistral 7B v0.3"),
    "qwen2": Kind("qwen2", dict(tie_word_embeddings=True), "chat_templates/qwen2_5.jinja", *QWEN_TOKENS, end_of_turn="<|im_end|>",
                  about="Qwen2.5 (Qwen2.5 Instruct's template)"),
    "qwen3": Kind("qwen3", dict(head_dim=16, tie_word_embeddings=True), "chat_templates/qwen3.jinja", *QWEN_TOKENS,
                  end_of_turn="<|im_end|>", about="Qwen3 dense"),
    "gemma": Kind("gemma", dict(head_dim=16, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True), "chat_templates/gemma.jinja",
                  GEMMA3_TOKENS[:2], end_of_turn="<end_of_turn>", note="its template refuses a system turn: train with configs/tiny.yaml",
                  about="Gemma (1)"),
    "gemma2": Kind("gemma2", dict(head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=64,
                                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0), "chat_templates/gemma.jinja",
                   GEMMA3_TOKENS[:2], end_of_turn="<end_of_turn>", note="its template refuses a system turn: train with configs/tiny.yaml",
                   about="Gemma 2"),
    "gemma3": Kind("gemma3", dict(head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=64,
                                  layer_types=["sliding_attention", "full_attention"]), "tiny_vlm/chat_template.jinja",
                   GEMMA3_TOKENS, end_of_turn="<end_of_turn>", about="Gemma 3 text (Gemma3ForCausalLM, as gemma-3-1b)"),
    "phi3": Kind("phi3", {}, "chat_templates/phi3.jinja", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                 end_of_turn="<|end|>", about="Phi-3 (fused qkv_proj and gate_up_proj)"),
    "mixtral": Kind("mixtral", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), None,
                    note=NO_TEMPLATE, about="Mixtral (4 experts, top-2)"),
    "qwen3_moe": Kind("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                        norm_topk_prob=True), "chat_templates/qwen3.jinja", *QWEN_TOKENS,
                      end_of_turn="<|im_end|>", about="Qwen3-MoE (4 experts, top-2)"),
    "qwen2_moe": Kind("qwen2_moe", dict(QWEN_MOE, num_experts_per_tok=2), None, note=NO_TEMPLATE,
                      about="Qwen2-MoE (routed experts and a gated shared one)"),
    "gpt_oss": Kind("gpt_oss", dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
                    "chat_templates/gpt_oss.jinja", ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                                                     "<|call|>", "<|constrain|>"), end_of_turn="<|return|>",
                    about="gpt-oss (dense experts, attention sinks; harmony template)"),
    "deepseek_v2": Kind("deepseek_v2", dict(num_key_value_heads=4, first_k_dense_replace=1, moe_intermediate_size=16,
                                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
                                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            topk_method="greedy"), None, note=NO_TEMPLATE,
                        about="DeepSeek-V2-Lite (latent attention, shared experts)"),
    "deepseek_v3": Kind("deepseek_v3", dict(num_key_value_heads=4, first_k_dense_replace=1, moe_intermediate_size=16,
                                            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                            v_head_dim=16), "chat_templates/deepseek_v3.jinja", DEEPSEEK_TOKENS,
                        ("<think>", "</think>"), end_of_turn="<｜end▁of▁sentence｜>",
                        about="DeepSeek-V3 (latent attention, grouped sigmoid routing)"),
    "qwen3_5": Kind("qwen3_5", HYBRID, "chat_templates/qwen3_5.jinja", QWEN_TOKENS[0] + QWEN_VISION_TOKENS, QWEN_TOKENS[1],
                    end_of_turn="<|im_end|>", about="Qwen3.5/3.6 dense text (Gated DeltaNet + gated attention)"),
    "qwen3_5_moe": Kind("qwen3_5_moe", dict(HYBRID, **QWEN_MOE), "chat_templates/qwen3_6.jinja",
                        QWEN_TOKENS[0] + QWEN_VISION_TOKENS, QWEN_TOKENS[1], end_of_turn="<|im_end|>",
                        about="Qwen3.5/3.6 MoE text, as Qwen3.6-35B-A3B"),
    "qwen3_next": Kind("qwen3_next", dict(HYBRID, **QWEN_MOE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                       "chat_templates/qwen3_next_instruct.jinja", *QWEN_TOKENS, end_of_turn="<|im_end|>",
                       about="Qwen3-Next (hybrid, fused DeltaNet projections, experts)"),
    "gemma4": Kind("gemma4", GEMMA4, "chat_templates/gemma4_small.jinja", GEMMA4_TOKENS, end_of_turn="<turn|>",
                   about="Gemma 4 text, as E2B/E4B (per-layer embeddings; Gemma4ForCausalLM)"),
    # the multimodal repos: the text model under text_config, the vision tower beside it
    "gemma3_vl": Kind("gemma3", dict(hidden_size=128, intermediate_size=256, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                                     layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                                     rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                      for t in ("full_attention", "sliding_attention")}),
                      "tiny_vlm/chat_template.jinja", GEMMA3_TOKENS, vision="gemma3", end_of_turn="<end_of_turn>",
                      about="Gemma 3 with images (Gemma3ForConditionalGeneration; configs/tiny_vlm.yaml)"),
    "gemma4_vl": Kind("gemma4", GEMMA4, "chat_templates/gemma4_small.jinja", GEMMA4_TOKENS, vision="gemma4",
                      end_of_turn="<turn|>", about="Gemma 4 with images (Gemma4ForConditionalGeneration, as E2B/E4B)"),
    "qwen3_5_vl": Kind("qwen3_5", HYBRID, "chat_templates/qwen3_5.jinja", QWEN_TOKENS[0] + QWEN_VISION_TOKENS, QWEN_TOKENS[1],
                       vision="qwen", end_of_turn="<|im_end|>", about="Qwen3.5/3.6 dense with images (Qwen3_5ForConditionalGeneration)"),
    "qwen3_5_moe_vl": Kind("qwen3_5_moe", dict(HYBRID, **QWEN_MOE), "chat_templates/qwen3_6.jinja",
                           QWEN_TOKENS[0] + QWEN_VISION_TOKENS, QWEN_TOKENS[1], vision="qwen", end_of_turn="<|im_end|>",
                           about="Qwen3.5/3.6 MoE with images (Qwen3_5MoeForConditionalGeneration)"),
}
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # the tiny Llama's <s>, </s>, <pad>
# each multimodal repo's: config.json's vision_config, its fields naming token ids (by the token), the tokens
# tokenizer_config.json names, and the image processor's files (what transformers and waypoint.vision read)
VISION = {
    "gemma3": dict(
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=28,
                           patch_size=7, model_type="siglip_vision_model", vision_use_head=False),
        ids=dict(image_token_index="<image_soft_token>", boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>"),
        tokens=dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"),
        files={"preprocessor_config.json": dict(  # PIL's bilinear = 2; mean and std 0.5: pixels to [-1, 1]
            image_processor_type="Gemma3ImageProcessor", processor_class="Gemma3Processor", size={"height": 28, "width": 28},
            resample=2, do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5] * 3,
            image_std=[0.5] * 3, do_convert_rgb=None, do_pan_and_scan=None),
            "processor_config.json": dict(processor_class="Gemma3Processor", image_seq_length=4)},
        mm_tokens_per_image=4),
    "gemma4": dict(  # 4-pixel patches pooled 3 x 3: at most 70 tokens an image
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, patch_size=4, position_embedding_size=256, pooling_kernel_size=3, model_type="gemma4_vision"),
        ids=dict(image_token_id="<|image|>", boi_token_id="<|image>", eoi_token_id="<image|>", video_token_id="<|video|>",
                 audio_token_id="<|audio|>", boa_token_id="<|audio>", eoa_token_index="<audio|>"),
        tokens=dict(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>", audio_token="<|audio|>",
                    boa_token="<|audio>", eoa_token="<audio|>"),
        files={"preprocessor_config.json": dict(image_processor_type="Gemma4ImageProcessor", processor_class="Gemma4Processor",
                                                patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)},
        audio_config=None),
    "qwen": dict(  # sides rounded to 8 pixels (4-pixel patches merged 2 x 2), at most 32 x 32: 16 tokens an image
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
                           spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, model_type="qwen3_5_vision"),
        ids=dict(image_token_id="<|image_pad|>", video_token_id="<|video_pad|>", vision_start_token_id="<|vision_start|>",
                 vision_end_token_id="<|vision_end|>"),
        tokens=dict(image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                    vision_end_token="<|vision_end|>"),
        files={"preprocessor_config.json": dict(
            image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen3VLProcessor", patch_size=4, temporal_patch_size=2,
            merge_size=2, size={"shortest_edge": 64, "longest_edge": 1024}, image_mean=[0.5] * 3, image_std=[0.5] * 3)}),
}


def multimodal_config(vision: str, family, text: dict, tokenizer: Tokenizer) -> dict:
    """A multimodal repo's config.json around ``text`` (its text_config), as transformers' *Config writes it."""
    fields = {k: v for k, v in VISION[vision].items() if k not in ("ids", "tokens", "files")}
    return {"architectures": [family.architecture.replace("ForCausalLM", "ForConditionalGeneration")],
            "model_type": family.hf_model_types[1], "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"],
            **fields, **{key: tokenizer.token_to_id(token) for key, token in VISION[vision]["ids"].items()}}


def tokenizer_of(kind: Kind) -> Tokenizer:
    """The tiny Llama's byte-level BPE with the kind's tokens added (its <s>, </s>, <pad> stay BOS, EOS and pad)."""
    tokenizer = Tokenizer.from_file(str(data_root() / "assets/tiny_llama/tokenizer.json"))
    tokenizer.add_special_tokens(list(kind.special))
    tokenizer.add_tokens(list(kind.added))
    return tokenizer


def config_of(kind: Kind, tokenizer: Tokenizer) -> dict:
    """The tiny config.json the model is built from (the family then writes its own)."""
    family = family_named(kind.family)
    vocab_size = -(-tokenizer.get_vocab_size() // 8) * 8
    text = {"model_type": family.hf_model_types[0], **TEXT, **kind.text, "vocab_size": vocab_size, **SPECIAL_IDS}
    if family.name == "gemma4":
        text["vocab_size_per_layer_input"] = vocab_size
    return text if kind.vision is None else multimodal_config(kind.vision, family, text, tokenizer)


def written_config(kind: Kind, config: dict, args) -> dict:
    """The config.json the family writes for ``args`` (in a multimodal repo: its text_config)."""
    family = family_named(kind.family)
    fields = {**family.hf_config(args), **SPECIAL_IDS}
    if kind.vision is None:
        return {**fields, "dtype": "float32"}
    del fields["architectures"]
    return {**config, "text_config": {**fields, "model_type": config["text_config"]["model_type"]}, "dtype": "float32"}


def make(name: str, out: Path, seed: int = 0) -> Path:
    """The tiny checkpoint ``name`` (a key of KINDS) written as the new folder ``out``."""
    kind, assets = KINDS[name], data_root() / "assets"
    family = family_named(kind.family)
    tokenizer = tokenizer_of(kind)
    config = config_of(kind, tokenizer)
    args = checked_model_args(config, f"the tiny {name} config")
    written = written_config(kind, config, args)
    if checked_model_args(written, f"the config.json {family.name} writes") != args:
        raise CheckpointError(f"{name}: the config.json family {family.name!r} writes reads back as another model; "
                              "fix its hf_config (families/)")
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    prefixes = family.hf_prefixes[-1] if kind.vision else None  # where transformers 5 keeps the text model and the tower
    conversion = Conversion(args, family.model_types[0], HFSource(written, prefixes=prefixes))
    end = [tokenizer.token_to_id(kind.end_of_turn)] if kind.end_of_turn else []
    tokenizer_config = json.loads((assets / "tiny_llama/tokenizer_config.json").read_text())
    if kind.vision:
        tokenizer_config["extra_special_tokens"] = VISION[kind.vision]["tokens"]
    files = {"tokenizer.json": tokenizer.to_str(pretty=True), "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {**SPECIAL_IDS, "eos_token_id": [SPECIAL_IDS["eos_token_id"], *end]},
             **(VISION[kind.vision]["files"] if kind.vision else {})}
    if kind.template:
        files["chat_template.jinja"] = (assets / kind.template).read_text(encoding="utf-8")

    def write(stage) -> None:
        HFCheckpointer.write_new(stage, model.state_dict(), conversion)
        for file, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False) + "\n"
            stage.write_bytes(file, text.encode("utf-8"))
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty folder given: written in its place
    return write_directory(out, write)


def try_line(name: str, out: Path) -> str:
    """A fine-tune to try on the checkpoint ``make`` wrote at ``out``."""
    kind = KINDS[name]
    config = "tiny_vlm" if kind.vision else "tiny_chat" if kind.template and not kind.note else "tiny"
    extra = " dataset.template=null" if config == "tiny_chat" else " dataset.max_seq_len=160" if kind.vision == "gemma4" else ""
    return f"python recipes/full_finetune.py --config configs/{config}.yaml checkpointer.checkpoint_dir={out} output_dir={out}_run{extra}"


def listing() -> str:
    width = max(map(len, KINDS)) + 2
    return "\n".join(f"{name:<{width}}{kind.about}" + (f"; {kind.note}" if kind.note else "") for name, kind in KINDS.items())


def kind_name(text: str) -> str:
    """The KIND argument's check: a name of KINDS (a bad one is one line naming the close ones)."""
    if text in KINDS:
        return text
    near = difflib.get_close_matches(text, list(KINDS), n=3, cutoff=0.5)
    raise argparse.ArgumentTypeError(f"unknown kind {text!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                                     + " (--list names them all)")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser.for_script(__doc__)
    parser.add_argument("kind", nargs="?", type=kind_name, metavar="KIND", help="what to make (--list names them)")
    parser.add_argument("out", nargs="?", type=Path, metavar="OUT", help="the folder to write (new or empty)")
    parser.add_argument("--list", action="store_true", help="name every kind this makes, and what each is")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.kind is None or args.out is None:
        parser.error("name a KIND and an OUT folder (--list names the kinds)")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out}: not empty; name a new or empty folder")

    def run() -> int:
        print(f"wrote {make(args.kind, args.out, args.seed)}")
        print(f"try: {try_line(args.kind, args.out)}")
        return 0
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
