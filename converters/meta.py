"""Meta's reference layout (``consolidated.NN.pth`` + ``params.json``) <-> native keys.

The native model uses Meta's interleaved RoPE layout, so no permutation is needed:
the table is renames only.
"""

from __future__ import annotations

from waypoint.converters.table import Converter, Rule

# How model-parallel files split each weight (Meta's ColumnParallelLinear / RowParallelLinear)
COLUMN_PARALLEL = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                   "feed_forward.w1.weight", "feed_forward.w3.weight", "output.weight")
ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")
EMBEDDING = "tok_embeddings.weight"


def vocab_parallel(vocab_size: int) -> bool:
    """Llama 3's reference code splits the embedding by vocabulary rows (VocabParallelEmbedding); Llama 2's by
    its columns (ParallelEmbedding)."""
    return vocab_size >= 128000


def model_parallel_dim(key: str, vocab_parallel_embedding: bool) -> int | None:
    """The dim along which Meta's model-parallel files split ``key`` (None: replicated in every file)."""
    if key == EMBEDDING:
        return 0 if vocab_parallel_embedding else 1
    if key.endswith(COLUMN_PARALLEL):
        return 0
    if key.endswith(ROW_PARALLEL):
        return 1
    return None


def meta_converter(tied: bool = False) -> Converter:
    layer, native = "layers.{i}.", "layers.{i}."
    return Converter(
        rules=[
            Rule("tok_embeddings.weight", "tok_embeddings.weight"),
            Rule(layer + "attention_norm.weight", native + "sa_norm.weight"),
            Rule(layer + "attention.wq.weight", native + "attn.q_proj.weight"),
            Rule(layer + "attention.wk.weight", native + "attn.k_proj.weight"),
            Rule(layer + "attention.wv.weight", native + "attn.v_proj.weight"),
            Rule(layer + "attention.wo.weight", native + "attn.output_proj.weight"),
            Rule(layer + "ffn_norm.weight", native + "mlp_norm.weight"),
            Rule(layer + "feed_forward.w1.weight", native + "mlp.w1.weight"),
            Rule(layer + "feed_forward.w3.weight", native + "mlp.w3.weight"),
            Rule(layer + "feed_forward.w2.weight", native + "mlp.w2.weight"),
            Rule("norm.weight", "norm.weight"),
            Rule("output.weight", "output.weight"),
        ],
        ignore=(r"^rope\.freqs$",),
        tied_embeddings=tied,
        hf_embedding_key="tok_embeddings.weight",
        hf_head_key="output.weight",
    )
