"""The record every model family fills in, once, in its own file.

Everything that differs between families is here: which HF ``model_type`` values it reads, the defaults
its transformers config class gives fields a ``config.json`` leaves out, the fields the native model cannot
reproduce, ``config.json -> ModelArgs``, the converter's rules, ``ModelArgs -> config.json`` for export,
and which native layers LoRA may target. Checkpointers, the PEFT adapter writer and ``convert.py`` look
families up (``waypoint.families``) and never test a family's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from waypoint.converters.table import Converter, Rule
from waypoint.families.hf_config import IGNORE, HFConfig
from waypoint.models.args import ModelArgs

LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "output")
# The HF module names of an adapter that vLLM loads and applies for a Llama-like model: the last name of each of its
# model's linear layers (its LoRA-able modules), a fused one (qkv_proj, gate_up_proj) read as the modules its
# packed_modules_mapping packs into it (vllm/lora/utils.py get_supported_lora_modules, vllm/lora/worker_manager.py).
# Not lm_head: vLLM has no LoRA on the head. A family whose vLLM model has other layers declares its own.
VLLM_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True)
class Family:
    name: str  # "qwen3": the file's name
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads
    model_types: tuple[str, ...]  # checkpointer model_type names (torchtune's), the first one canonical
    architecture: str  # transformers' *ForCausalLM class, written as config.json's "architectures"
    defaults: Mapping[str, Any]  # the transformers config class's value of each field a config.json may leave out
    model_args: Callable[[HFConfig], ModelArgs]  # config.json (defaults filled in) -> ModelArgs
    rules: Callable[[ModelArgs], list[Rule]]  # the HF <-> native table for these shapes
    hf_config: Callable[[ModelArgs], dict[str, Any]]  # ModelArgs -> the family's config.json fields
    # config.json fields whose only value the native model reproduces is the one given (e.g. attention_bias: False);
    # any other value is a one-line error naming the field
    fixed: Mapping[str, Any] = field(default_factory=dict)
    lora_targets: tuple[str, ...] = LLAMA_LORA_TARGETS  # native module names whose LoRA PEFT can name
    ignore: tuple[str, ...] = IGNORE  # HF keys that carry no weights
    # how a multimodal repo nests the text model's keys: each a {prefix on disk: the converter's prefix} (found by its
    # first prefix; Gemma 3's {"language_model.": ""}); keys under none of them (a vision tower) pass through untouched
    hf_prefixes: tuple[Mapping[str, str], ...] = ()
    # where transformers' multimodal model keeps the text model's modules (what PEFT names an adapter's), by the
    # converter's prefix: Qwen3.5's {"model.": "model.language_model."}; used when a checkpoint is nested (hf_prefixes)
    nested_modules: Mapping[str, str] = field(default_factory=dict)
    nested_config: str | None = None  # where a multimodal config.json keeps the text model's fields ("text_config")
    model_type_of: Callable[[HFConfig], str] | None = None  # which of model_types a config is (default: the first)
    # on-disk layouts of some weights (MoE experts: per-expert or packed keys), each with its own rules, the
    # first being what a conversion without a source writes
    layouts: Callable[[ModelArgs], dict[str, list[Rule]]] | None = None
    # LoRA targets on stacked expert weights -> the HF parameter PEFT names (``target_parameters``), in the order the
    # transformers module registers them (which decides PEFT's nesting of its wrappers)
    lora_parameters: Mapping[str, str] = field(default_factory=dict)
    lora_halves: frozenset[str] = frozenset()  # of those, the ones whose HF parameter holds gate and up as halves
    vllm_lora_modules: frozenset[str] = VLLM_LORA_MODULES  # the adapter modules vLLM serves for this family (above)
    # HF keys of layers the native model does not run, carried untouched through a fine-tune (DeepSeek-V3's
    # multi-token-prediction layer ``model.layers.{num_hidden_layers}.*``): config.json -> their key regex, or None
    carried: Callable[[Mapping[str, Any]], str | None] | None = None
    # HF keys that hold buffers, not parameters (DeepSeek's e_score_correction_bias): left out of an index's
    # ``total_parameters``, as transformers' ``num_parameters()`` leaves them out
    buffers: tuple[str, ...] = ()
    # a multimodal config.json (the outer one) -> its image side (models.vision_args.VisionArgs), or None: text only
    vision: Callable[[Mapping[str, Any]], Any] | None = None

    def carried_keys(self, config: Mapping[str, Any]) -> re.Pattern | None:
        """The compiled ``carried`` regex for a config.json, or None."""
        if self.carried is None:
            return None
        pattern = self.carried(config.get(self.nested_config) or config if self.nested_config else config)
        return re.compile(pattern) if pattern else None

    def converter(self, args: ModelArgs) -> Converter:
        return Converter(rules=self.rules(args), ignore=self.ignore, tied_embeddings=args.tie_embeddings,
                         variants=self.layouts(args) if self.layouts else {}, lora_parameters=dict(self.lora_parameters), lora_halves=self.lora_halves,
                         buffers=self.buffers, vllm_lora_modules=self.vllm_lora_modules)
