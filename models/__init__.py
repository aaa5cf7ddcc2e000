"""The native model."""

from models.builders import (from_hf_config, hf_config_dtype, llama2_7b, llama2_13b, llama2_70b, llama3_8b,
                             mistral_7b, model_args_from_hf_config, parse_dtype)
from models.transformer import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer", "from_hf_config", "hf_config_dtype", "llama2_7b", "llama2_13b", "llama2_70b",
           "llama3_8b", "mistral_7b", "model_args_from_hf_config", "parse_dtype"]
