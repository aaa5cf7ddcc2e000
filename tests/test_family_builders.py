"""The builders of the published sizes against the published configs, with transformers as the oracle."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from waypoint.families import model_args_from_hf_config
from tests.conftest import ROOT

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

GEMMA4_ROPE = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
GEMMA4_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]

# builder -> (transformers config class, the published config.json's fields); the builder must read the same as
# the config (ModelArgs) and count what transformers counts for it
PUBLISHED = {
    "llama.llama3_1_8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          rope_parameters=LLAMA31_ROPE)),
    "llama.llama3_2_1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          tie_word_embeddings=True, rope_parameters={**LLAMA31_ROPE, "factor": 32.0})),
    "llama.llama3_2_3b": ("LlamaConfig", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                          num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          tie_word_embeddings=True, rope_parameters={**LLAMA31_ROPE, "factor": 32.0})),
    "mistral.mistral_7b": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=4096)),
    "mistral.mistral_nemo_12b": ("MistralConfig", dict(hidden_size=5120, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, vocab_size=131072, max_position_embeddings=1024000,
                                 rms_norm_eps=1e-5, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2.qwen2_5_0_5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2.qwen2_5_7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3.qwen3_0_6b": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3.qwen3_8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "gemma.gemma_2b": ("GemmaConfig", dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                       num_key_value_heads=1, vocab_size=256000)),
    "gemma.gemma_7b": ("GemmaConfig", dict(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=256000)),
    "gemma2.gemma2_2b": ("Gemma2Config", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=256000)),
    "gemma2.gemma2_9b": ("Gemma2Config", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=256000)),
    "gemma2.gemma2_27b": ("Gemma2Config", dict(hidden_size=4608, intermediate_size=36864, num_hidden_layers=46, num_attention_heads=32,
                          num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144, vocab_size=256000)),
    "gemma3.gemma3_1b": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=262144, max_position_embeddings=32768, sliding_window=512)),
    "gemma3.gemma3_4b": ("Gemma3TextConfig", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # google/gemma-4-*-it's text_config (the multimodal repos'; transformers' convert_gemma4_weights.py _VARIANTS)
    "gemma4.gemma4_e2b": ("Gemma4TextConfig", dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                          num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
                          hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                          use_double_wide_mlp=True, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
                          sliding_window=512, final_logit_softcapping=30.0, rope_parameters=GEMMA4_ROPE)),
    "gemma4.gemma4_e4b": ("Gemma4TextConfig", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=256, global_head_dim=512, vocab_size=262144,
                          hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
                          layer_types=GEMMA4_LAYERS * 7, sliding_window=512, final_logit_softcapping=30.0,
                          rope_parameters=GEMMA4_ROPE)),
    "gemma4.gemma4_26b_a4b": ("Gemma4TextConfig", dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                              num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
                              global_head_dim=512, attention_k_eq_v=True, vocab_size=262144, hidden_size_per_layer_input=0,
                              enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                              layer_types=GEMMA4_LAYERS * 5, sliding_window=1024, max_position_embeddings=262144,
                              final_logit_softcapping=30.0, use_bidirectional_attention="vision", rope_parameters=GEMMA4_ROPE)),
    "gemma4.gemma4_31b": ("Gemma4TextConfig", dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                          num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
                          attention_k_eq_v=True, vocab_size=262144, hidden_size_per_layer_input=0,
                          layer_types=GEMMA4_LAYERS * 10, sliding_window=1024, max_position_embeddings=262144,
                          final_logit_softcapping=30.0, use_bidirectional_attention="vision", rope_parameters=GEMMA4_ROPE)),
    "phi3.phi3_mini_4k": ("Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047)),
    "phi3.phi4_14b": ("Phi3Config", dict(hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=10, vocab_size=100352, max_position_embeddings=16384,
                      rope_parameters={"rope_type": "default", "rope_theta": 250000.0})),
    "mixtral.mixtral_8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, router_aux_loss_coef=0.02)),
    "qwen3_moe.qwen3_30b_a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_moe.qwen1_5_moe_a2_7b": ("Qwen2MoeConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                    num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, max_position_embeddings=8192,
                                    num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                                    shared_expert_intermediate_size=5632, decoder_sparse_step=1, router_aux_loss_coef=0.001,
                                    use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # the released configs differ from GptOssConfig's defaults in these fields only
    "gpt_oss.gpt_oss_20b": ("GptOssConfig", dict(num_hidden_layers=24, num_local_experts=32)),
    "gpt_oss.gpt_oss_120b": ("GptOssConfig", dict(num_hidden_layers=36, num_local_experts=128)),
}
# the totals the model cards and hub indexes publish, for the sizes where they are printed exactly
PUBLISHED_COUNTS = {"llama.llama3_1_8b": 8_030_261_248, "mistral.mistral_7b": 7_241_732_096, "qwen2.qwen2_5_7b": 7_615_616_512,
                    "gemma.gemma_2b": 2_506_172_416, "gemma.gemma_7b": 8_537_680_896, "phi3.phi3_mini_4k": 3_821_079_552,
                    "mixtral.mixtral_8x7b": 46_702_792_704}


@pytest.mark.parametrize("builder", list(PUBLISHED))
def test_builders_are_the_published_configs(builder):
    import importlib

    import transformers

    module, name = builder.split(".")
    class_name, fields = PUBLISHED[builder]
    config = getattr(transformers, class_name)(**fields)
    with torch.device("meta"):
        ours = getattr(importlib.import_module(f"waypoint.families.{module}"), name)()
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    read = model_args_from_hf_config(config.to_dict())
    assert dataclasses.replace(ours.args, head_dim=ours.args.resolved_head_dim) == dataclasses.replace(read, attn_dropout=0.0)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert count == PUBLISHED_COUNTS.get(builder, count)


def test_meta_build_of_every_family_stays_free_of_dynamo():
    code = ("import sys, torch\nfrom waypoint.families import gemma, llama, phi3, qwen2\n"
            "with torch.device('meta'):\n"
            "    qwen2.qwen2_7b(); gemma.gemma_7b(); phi3.phi3_mini_4k(); llama.llama3_1_8b()\n"
            "assert 'torch._dynamo' not in sys.modules, 'meta build imported torch._dynamo'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
