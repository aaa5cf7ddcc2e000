"""The native model."""

from waypoint.models.builders import (HF_MODEL_TYPES, from_hf_config, gemma_2b, gemma_7b, hf_config_dtype, llama2_7b, llama2_13b,
                                      llama2_70b, llama3_1_8b, llama3_8b, mistral_7b, model_args_from_hf_config, parse_dtype,
                                      phi3_mini_4k, qwen2_7b)
from waypoint.models.transformer import ModelArgs, Transformer

__all__ = ["HF_MODEL_TYPES", "ModelArgs", "Transformer", "from_hf_config", "gemma_2b", "gemma_7b", "hf_config_dtype",
           "llama2_7b", "llama2_13b", "llama2_70b", "llama3_1_8b", "llama3_8b", "mistral_7b", "model_args_from_hf_config",
           "parse_dtype", "phi3_mini_4k", "qwen2_7b"]
