"""MetaCheckpointer: Meta's original checkpoints, ``consolidated.NN.pth`` + ``params.json`` (+ ``tokenizer.model``).

Llama 2 13B ships 2 model-parallel files and 70B ships 8: on load each tensor is
joined along its model-parallel dimension (column-parallel ``wq wk wv w1 w3 output``
on dim 0, row-parallel ``wo w2`` on dim 1, the embedding on dim 1 for Llama 2's
ParallelEmbedding and dim 0 for Llama 3's VocabParallelEmbedding, norms replicated
and checked equal); save splits them the same way into the same number of files.
A conversion (``write_new``) writes one file unless asked for more, ``params.json`` whose
FFN width derives to the model's, and ``hf_source.json`` when the weights came from an HF checkpoint.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from waypoint import console
from waypoint.checkpointers.base import Checkpointer, Conversion
from waypoint.checkpointers.commit import StagedDir
from waypoint.checkpointers.file_formats import json_bytes, read_json, read_tensors
from waypoint.checkpointers.hf_source import SIDE_FILES, SOURCE_FILE, HFSource
from waypoint.checkpointers.shard_layout import listed_files
from waypoint.converters import CheckpointError, Converter, Group
from waypoint.converters.meta import EMBEDDING, meta_converter, model_parallel_dim, vocab_parallel
from waypoint.families import family_named
from waypoint.lazy import LazyState, spec_of
from waypoint.models import ModelArgs

PARAMS_FILE = "params.json"


def meta_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The FFN width Meta's reference code derives from params.json."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def meta_params(args: ModelArgs) -> dict:
    """params.json whose derived FFN width is the model's (multiple_of chosen to reproduce it)."""
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "norm_eps": args.norm_eps, "rope_theta": args.rope_theta}
    for multiple_of in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        if meta_hidden_dim(args.dim, multiple_of, None) == args.hidden_dim:
            return {**params, "multiple_of": multiple_of, "ffn_dim_multiplier": None}
    return params  # no Meta rule gives this width: the loader takes it from the tensors


def write_model_parallel(stage: StagedDir, names: Sequence[str], converter: Converter, groups: list[Group],
                         native: Mapping[str, torch.Tensor], split: Callable[[str], int | None],
                         cast: Callable[[str, torch.Tensor], torch.Tensor] = lambda key, t: t,
                         passthrough: Mapping[str, torch.Tensor] = {}, order: Mapping[str, int] | None = None) -> None:
    """``native`` as Meta's model-parallel files ``names``, file after file, converting as it goes: the tensors of one
    file are held at a time (each file takes its slice, along ``split(key)``, of every tensor; None: replicated)."""
    n = len(names)
    for index, name in enumerate(console.bar(names, desc="save", leave=False)):
        shard = {}
        for group in groups:
            for key, tensor in converter.apply_groups([group], native, forward=False, where=None).items():
                tensor, dim = cast(key, tensor), split(key)
                # detach(): a new tensor object, without Python attributes to pickle (a dequantized FP8 weight's fp8_source)
                shard[key] = tensor.chunk(n, dim=dim)[index].clone() if dim is not None and n > 1 else tensor.detach().contiguous()
        shard.update((k, t.contiguous()) for k, t in passthrough.items())
        if order is not None:
            shard = dict(sorted(shard.items(), key=lambda item: order[item[0]]))
        stage.write(name, lambda f, shard=shard: torch.save(shard, f))
        del shard


class MetaCheckpointer(Checkpointer):
    """Load and save Meta-format checkpoints, single- or multi-file (model parallel); ``checkpoint_files`` and
    torchtune's resume options as for ``HFCheckpointer``."""

    name, label = "meta", "Meta"
    loads_with = "Meta's reference code (llama-models)"
    description_files = frozenset({PARAMS_FILE, SOURCE_FILE})
    copies_description = True  # params.json and hf_source.json are copied as they are

    def __init__(self, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                 checkpoint_files: list[str] | str = "auto", model_type: str | None = None,
                 output_dtype: str | torch.dtype | None = None, *,
                 recipe_checkpoint: str | None = None, adapter_checkpoint: str | None = None,
                 resume_from_checkpoint: bool = False, should_load_recipe_state: bool = False) -> None:
        super().__init__(checkpoint_dir, output_dir, output_dtype, recipe_checkpoint=recipe_checkpoint,
                         adapter_checkpoint=adapter_checkpoint, resume_from_checkpoint=resume_from_checkpoint,
                         should_load_recipe_state=should_load_recipe_state)
        self.params = read_json(self.checkpoint_dir / PARAMS_FILE)
        self.model_type = model_type or ("LLAMA3" if self.params.get("vocab_size", 0) >= 128000 else "LLAMA2")
        self.family = family_named("llama")  # Meta's reference layout is Llama's
        if checkpoint_files in (None, "auto"):
            files = sorted(p.name for p in self.checkpoint_dir.glob("consolidated.*.pth"))
        else:  # names, absolute paths inside checkpoint_dir or torchtune's {filename_format, max_filename}
            files = listed_files(self.checkpoint_dir, checkpoint_files)
        if not files:
            raise CheckpointError(f"{self.checkpoint_dir}: no consolidated.*.pth files")
        self._files = tuple(files)
        self.converter = meta_converter()
        self.split_dims: dict[str, int | None] | None = None  # meta key -> model-parallel dim (None: replicated)
        self._args: ModelArgs | None = None
        self.passthrough: dict[str, torch.Tensor] = {}
        self.key_order: list[str] = []

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return (path / PARAMS_FILE).is_file() and any(path.glob("consolidated.*.pth"))

    @property
    def files(self) -> tuple[str, ...]:
        return self._files

    def model_args(self) -> ModelArgs:
        """From params.json and the tensors' shapes (read memory-mapped: no weight is paged in)."""
        if self._args is None:
            with torch.device("cpu"):
                self.load_checkpoint()
        return self._args

    def hf_source(self) -> HFSource | None:
        source = HFSource.read(self.checkpoint_dir)
        return source.with_tensors_from(self.checkpoint_dir) if source is not None else None

    # -- load ---------------------------------------------------------------------
    def _load_model(self) -> dict[str, torch.Tensor]:
        shards = []
        with console.byte_bar(sum((self.checkpoint_dir / f).stat().st_size for f in self.files), "load", leave=False) as bar:
            for name in self.files:
                shards.append(read_tensors(self.checkpoint_dir / name, self.unmapped))
                bar.update((self.checkpoint_dir / name).stat().st_size)
        keys = list(shards[0])
        for name, shard in zip(self.files[1:], shards[1:]):
            if set(shard) != set(keys):
                odd = sorted(set(shard) ^ set(keys))[0]
                raise CheckpointError(f"{self.checkpoint_dir / name}: keys differ from {self.files[0]} (e.g. {odd!r})")
        dim = self.params["dim"]
        meta, self.split_dims = LazyState({}, {}), {}
        self.passthrough = {}  # tensors the model does not use (``rope.freqs``): written back as they came
        self.key_order = keys
        self.input_dtypes = {key: shards[0][key].dtype for key in keys}
        for key in keys:
            if self.converter.is_ignored(key):
                self.passthrough[key] = shards[0][key]
                continue
            parts = [shard[key] for shard in shards]
            split = self._split_dim(key, parts[0], dim)
            self.split_dims[key] = split
            self._join(meta, key, parts, split)
        self._args = self._model_args(meta)
        return self.converter.to_native(meta, where={k: self.files[0] for k in meta})

    def _split_dim(self, key: str, part: torch.Tensor, dim: int) -> int | None:
        if len(self.files) == 1 or part.ndim == 1:
            return None
        split = model_parallel_dim(key, vocab_parallel_embedding=key == EMBEDDING and part.shape[1] == dim)
        if split is not None:
            return split
        raise CheckpointError(f"{self.checkpoint_dir}: unknown Meta key {key!r} in model-parallel files")

    def _join(self, meta: LazyState, key: str, parts: list[torch.Tensor], split: int | None) -> None:
        """``meta[key]``: the one tensor of the model-parallel ``parts``. Replicated parts are checked equal now;
        split ones are checked to join (on the meta device) and joined when read, one tensor at a time."""
        if split is None:
            for name, part in zip(self.files[1:], parts[1:]):
                if not torch.equal(part, parts[0]):
                    raise CheckpointError(f"{self.checkpoint_dir / name}: replicated {key!r} differs from {self.files[0]}")
            meta[key] = parts[0]
            return
        try:
            joined = torch.cat([torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts], dim=split)
        except RuntimeError as e:
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise CheckpointError(f"{self.checkpoint_dir}: {key!r} does not join along dim {split}: shapes {shapes}") from e
        meta.put(key, lambda: torch.cat(parts, dim=split), (joined.shape, joined.dtype))

    def _model_args(self, meta: Mapping[str, torch.Tensor]) -> ModelArgs:
        p = self.params
        vocab, dim = spec_of(meta, "tok_embeddings.weight")[0]
        hidden = spec_of(meta, "layers.0.feed_forward.w1.weight")[0][0]
        n_layers = 1 + max(int(k.split(".")[1]) for k in meta if k.startswith("layers."))
        problems = []
        if dim != p["dim"]:
            problems.append(f"dim {p['dim']} but tok_embeddings.weight has width {dim}")
        if p.get("n_layers", n_layers) != n_layers:
            problems.append(f"n_layers {p['n_layers']} but the files hold {n_layers} layers")
        if p.get("vocab_size", -1) > 0 and p["vocab_size"] != vocab:
            problems.append(f"vocab_size {p['vocab_size']} but tok_embeddings.weight has {vocab} rows")
        if "multiple_of" in p and meta_hidden_dim(dim, p["multiple_of"], p.get("ffn_dim_multiplier")) != hidden:
            problems.append(f"an FFN width of {meta_hidden_dim(dim, p['multiple_of'], p.get('ffn_dim_multiplier'))} "
                            f"but layers.0.feed_forward.w1.weight has {hidden}")
        n_heads = p["n_heads"]
        n_kv = p.get("n_kv_heads") or n_heads
        wk_rows = spec_of(meta, "layers.0.attention.wk.weight")[0][0]
        if wk_rows != n_kv * (dim // n_heads):
            problems.append(f"n_kv_heads {n_kv} but layers.0.attention.wk.weight has {wk_rows} rows")
        if problems:
            raise CheckpointError(f"{self.checkpoint_dir / PARAMS_FILE} is inconsistent with the tensors: {problems[0]}")
        # Llama 3.1+: Meta's apply_scaling (factor 8, or rope_scaling_factor; low 1, high 4, over 8192 positions)
        scaling = ({"rope_type": "llama3", "rope_factor": float(p.get("rope_scaling_factor", 8.0)), "rope_low_freq_factor": 1.0,
                    "rope_high_freq_factor": 4.0, "rope_original_max_seq_len": 8192} if p.get("use_scaled_rope") else {})
        return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab, hidden_dim=hidden,
                         norm_eps=p.get("norm_eps", 1e-5), rope_theta=float(p.get("rope_theta", 10000.0)),
                         max_seq_len=8192 if vocab >= 128000 else 4096, **scaling)

    # -- save like the input -----------------------------------------------------------
    def _model_writer(self, native: Mapping[str, torch.Tensor], adapted: frozenset[str] = frozenset()):  # nothing quantized
        if self.split_dims is None:
            raise CheckpointError("save_checkpoint needs load_checkpoint first: the input's model-parallel split is unknown")
        groups = self.converter.plan(self.converter.native_keys_to_save(native), "native")
        produced = {key for g in groups for key in g.targets}
        missing = sorted(set(self.split_dims) - produced)
        extra = sorted(produced - set(self.split_dims))
        if missing or extra:
            raise CheckpointError("state dict does not match the input checkpoint: "
                                  + (f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the input does not"))
        order = {key: i for i, key in enumerate(self.key_order)}  # the input's key order

        def write(stage: StagedDir) -> None:
            write_model_parallel(stage, self.files, self.converter, groups, native, self.split_dims.get,
                                 self.cast_for_output, self.passthrough, order)
            for side in SIDE_FILES:  # a block-FP8 source's scales, a multimodal one's vision tower, travel with it
                if (self.checkpoint_dir / side).is_file():
                    stage.copy_file(self.checkpoint_dir / side)
        return write

    # -- a new Meta checkpoint ------------------------------------------------------------
    @classmethod
    def write_new(cls, stage: StagedDir, native: Mapping[str, torch.Tensor], conversion: Conversion) -> None:
        """Model-parallel files are not shards: one unless ``num_shards`` asks for more."""
        converter, args = meta_converter(), conversion.args
        n = conversion.num_shards if conversion.resharded else 1
        try:
            groups = converter.plan(converter.native_keys_to_save(native), "native")
        except CheckpointError as e:  # a key Llama's reference layout has no place for
            raise CheckpointError(f"--to meta: Meta's reference layout holds Llama-architecture models; this "
                                  f"{conversion.model_type} model has more ({e}); convert it to hf or native") from e
        splits = {key: model_parallel_dim(key, vocab_parallel(args.vocab_size)) for g in groups for key in g.targets}
        for g in groups:
            for source, key in zip(g.sources, g.targets):
                shape = spec_of(native, source)[0]
                if splits[key] is not None and shape[splits[key]] % n:
                    raise CheckpointError(f"--num-shards {n}: {key} {tuple(shape)} does not split evenly into {n} model-parallel files")
        write_model_parallel(stage, [f"consolidated.{i:02d}.pth" for i in range(n)], converter, groups, native, splits.get)
        stage.write_bytes(PARAMS_FILE, json_bytes(meta_params(args)))
        if conversion.source is not None:
            stage.write_bytes(SOURCE_FILE, json_bytes(conversion.source.to_json()))
            conversion.source.write_tensors(stage)
