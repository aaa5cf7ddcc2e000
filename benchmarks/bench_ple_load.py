"""Peak memory of loading a Gemma 4 E4B-shaped checkpoint: the per-layer embedding table is assigned, never copied.

    python benchmarks/bench_ple_load.py [--full-layers] [--dir DIR] [--shard-gb 2]
                                     [--vocab N] [--hidden N] [--layers N] [--per-layer-dim N]
                                     [--intermediate N] [--heads N] [--kv-heads N] [--max-positions N]

Writes an HF checkpoint of a Gemma 4 text model (``gemma4_text``, ``Gemma4ForCausalLM``) of E4B's shape: its keys and
shapes are those of a ``Gemma4ForCausalLM`` built on the meta device from a ``transformers.Gemma4TextConfig`` (the tied
head left out, as ``save_pretrained`` leaves it out), filled with random bf16 values, in safetensors shards of at most
``--shard-gb`` (a tensor larger than that alone in its own, as transformers splits them) with the index json and the
config.json (``config.save_pretrained``) transformers writes. By default the two vocabulary tables are E4B's, in full:
``model.embed_tokens_per_layer.weight`` [262144, 42 * 256] (5.64 GB) and ``model.embed_tokens.weight`` [262144, 2560]
(1.34 GB); the decoder layers keep E4B's count, types, head dims, kv-shared layers and hidden size but are narrowed
(1 attention head, 1 k/v head, intermediate 256): 7.51 GB of weights, a load peak of about 8.3 GB; ``--full-layers``
keeps E4B's widths too (8 heads, 2 k/v heads, intermediate 10240: 14.93 GB of weights, a peak of about 16.3 GB; not
measured here). ``--vocab`` etc. scale further down (the test's run), ``--max-positions`` the rotary tables (E4B's
131072 positions: 0.40 GB of them). The shards are written by hand in safetensors' layout, one chunk of a tensor at a time
(``safetensors.torch.save_file`` holds a whole tensor and its bytes: 11 GB for the table), then every file's header
is checked with ``safetensors.safe_open``. With ``--dir`` the checkpoint is written there once and reused by later
runs of the same shape; without it, in a temporary directory deleted at the end.

Then, in a fresh process, ``waypoint.checkpointers.load_model(path, dtype=bf16)`` (HFCheckpointer, a meta-built
model, ``load_into``), every parameter read once (a memory-mapped one becomes resident), and the rise of the peak
resident set (VmHWM) over the process's resident set after its imports is set against the checkpoint's weight bytes.
The bound claimed: rise <= weights + margin, the margin being

  * the rotary tables the model computes at load (not weights; their bytes measured on the loaded model),
  * the converter's single-source copies whose memory-mapped sources stay resident beside them (the q/k RoPE
    permutes: ``Converter._convert_one`` drops the sources' pages only for groups of several sources; their bytes
    measured, as the parameters not backed by the checkpoint's files, the table never counted),
  * 0.1 GB of slack for the runtime's own allocations during the load (key maps, the reads' reduction buffers);

and the table's storage is a mapping of its shard (read from /proc/self/maps), i.e. assigned, not copied. A second
copy of the table (a cast, a converter op, an initialised embedding) would exceed the bound by the table's bytes.
Prints the figures and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TABLE = "model.embed_tokens_per_layer.weight"
# google/gemma-4-E4B's text model (as Gemma4TextConfig takes it); the rest are Gemma4TextConfig's defaults
E4B = dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=2560, num_hidden_layers=42,
           hidden_size_per_layer_input=256, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2,
           head_dim=256, global_head_dim=512, num_kv_shared_layers=18, sliding_window=512, tie_word_embeddings=True,
           max_position_embeddings=131072)
NARROW = dict(intermediate_size=256, num_attention_heads=1, num_key_value_heads=1)  # the default run's decoder layers
SLACK_GB = 0.1
DONE = "bench_ple_load.json"  # written last: the shape a kept checkpoint was written for
POOL = 1 << 24  # random bf16 values (32 MB) the tensors' bytes are cut from
GB = 1e9


def config_fields(args) -> dict:
    fields = dict(E4B, **({} if args.full_layers else NARROW))
    for flag, key in (("vocab", "vocab_size"), ("hidden", "hidden_size"), ("layers", "num_hidden_layers"),
                      ("per_layer_dim", "hidden_size_per_layer_input"), ("intermediate", "intermediate_size"),
                      ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"),
                      ("max_positions", "max_position_embeddings")):
        if getattr(args, flag) is not None:
            fields[key] = getattr(args, flag)
    fields["vocab_size_per_layer_input"] = fields["vocab_size"]
    fields["num_kv_shared_layers"] = min(fields["num_kv_shared_layers"], fields["num_hidden_layers"] * 3 // 7)  # E4B's 18 of 42
    return fields


def hf_config(fields: dict):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**fields, dtype="bfloat16", architectures=["Gemma4ForCausalLM"])


def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """Key -> shape of what ``Gemma4ForCausalLM(config).save_pretrained`` writes: its state dict (built on the meta
    device: no memory), less the tied keys (the head, when ``tie_word_embeddings``)."""
    import torch
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()
    return {k: tuple(t.shape) for k, t in model.state_dict().items() if k not in tied}


def plan_shards(shapes: dict[str, tuple[int, ...]], max_bytes: int) -> list[list[str]]:
    """Keys in order into shards of at most ``max_bytes`` (one larger tensor alone), as transformers splits them."""
    shards, size = [[]], 0
    for key, shape in shapes.items():
        n = _numel(shape) * 2
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_safetensors_streaming(path: Path, shapes: dict[str, tuple[int, ...]], pool: memoryview) -> int:
    """A bf16 safetensors file of ``shapes`` (the header as the library writes it: ``__metadata__`` first, tensors by
    name, offsets contiguous, padded to 8 bytes), each tensor's bytes written from ``pool`` a chunk at a time."""
    order = sorted(shapes)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in order:
        n = _numel(shapes[key]) * 2
        header[key] = {"dtype": "BF16", "shape": list(shapes[key]), "data_offsets": [offset, offset + n]}
        offset += n
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for i, key in enumerate(order):
            left, start = _numel(shapes[key]) * 2, (i * 4099 * 2) % len(pool)  # each tensor from its own place
            while left:
                chunk = pool[start: start + left]
                f.write(chunk)
                left -= len(chunk)
                start = 0
    return offset


def write_checkpoint(path: Path, fields: dict, shard_bytes: int) -> dict:
    """The checkpoint at ``path`` (config.json, shards, index); what it holds: its shapes, bytes and files."""
    import torch
    from safetensors import safe_open

    config = hf_config(fields)
    shapes = hf_shapes(config)
    path.mkdir(parents=True, exist_ok=True)
    for old in [path / DONE, *path.glob("model-*-of-*.safetensors")]:  # a kept directory of another shape
        old.unlink(missing_ok=True)
    gen = torch.Generator().manual_seed(0)
    pool = memoryview((torch.randn(POOL, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy())
    shards = plan_shards(shapes, shard_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors_streaming(path / name, {k: shapes[k] for k in keys}, pool)
        weight_map.update(dict.fromkeys(keys, name))
        with safe_open(path / name, framework="pt") as f:  # the library reads what was written
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            if got != {k: shapes[k] for k in keys} or f.metadata() != {"format": "pt"}:
                raise SystemExit(f"{name}: safetensors reads other keys or shapes than were written")
    index = {"metadata": {"total_parameters": sum(_numel(s) for s in shapes.values()), "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(path)
    (path / DONE).write_text(json.dumps({"fields": fields, "shard_bytes": shard_bytes}))  # last: the checkpoint is whole
    return describe(path)


def describe(path: Path) -> dict:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    shapes = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(path / name, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    weights = sum(_numel(s) * 2 for s in shapes.values())
    return {"weights_gb": weights / GB, "table_gb": _numel(shapes[TABLE]) * 2 / GB, "table_shape": list(shapes[TABLE]),
            "embed_shape": list(shapes["model.embed_tokens.weight"]), "tensors": len(shapes),
            "files": len(set(index["weight_map"].values())), "largest_other_gb": max(
                _numel(s) * 2 for k, s in shapes.items() if k != TABLE) / GB}


def existing(path: Path, fields: dict, shard_bytes: int) -> bool:
    """Whether ``path`` already holds this shape's checkpoint, whole (a ``--dir`` reused)."""
    try:
        return json.loads((path / DONE).read_text()) == {"fields": fields, "shard_bytes": shard_bytes}
    except (OSError, ValueError):
        return False


# -- the measured load, in a fresh process ---------------------------------------------------------------------

def status_gb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GB
    return 0.0


def file_mappings() -> list[tuple[int, int, str]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[3] != "00:00":
            low, high = (int(x, 16) for x in fields[0].split("-"))
            out.append((low, high, fields[5]))
    return out


def mapped_from(t, mappings) -> str | None:
    """The file whose mapping holds ``t``'s bytes, or None (heap memory: a copy)."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    return next((Path(name).name for low, high, name in mappings if low <= start and end <= high), None)


def child(path: Path) -> dict:
    import torch

    from waypoint.checkpointers import load_model
    import waypoint.families  # noqa: F401  (imported before the baseline, as load_model imports it)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here: the imports are the baseline
    baseline = status_gb("VmRSS")
    started = time.perf_counter()
    model = load_model(path, dtype=torch.bfloat16)
    load_s, after_load = time.perf_counter() - started, status_gb("VmHWM") - baseline
    started = time.perf_counter()
    for p in model.parameters():  # every weight read: memory-mapped pages become resident (a bf16 sum copies nothing)
        float(p.detach().sum())
    read_s, rise = time.perf_counter() - started, status_gb("VmHWM") - baseline
    maps = file_mappings()
    table = model.per_layer.embeddings.weight
    params = dict(model.named_parameters())  # the tied head once
    copied = {k: p.numel() * p.element_size() for k, p in params.items()  # the table's never counted in the margin
              if mapped_from(p, maps) is None and p is not table}
    buffers = {k: b.numel() * b.element_size() for k, b in model.named_buffers() if mapped_from(b, maps) is None}
    return {"baseline_gb": baseline, "load_s": load_s, "read_s": read_s, "rise_after_load_gb": after_load, "rise_gb": rise,
            "table_dtype": str(table.dtype).removeprefix("torch."), "table_mapped_from": mapped_from(table, maps),
            "held_gb": sum(p.numel() * p.element_size() for p in params.values()) / GB,
            "copied_gb": sum(copied.values()) / GB, "copied_keys": sorted({k.split(".")[-2] for k in copied}),
            "derived_buffers_gb": sum(buffers.values()) / GB, "derived_buffers": sorted(buffers)}


def fresh_process(argv: list[str]) -> str:
    """This script with ``argv`` in a fresh Python process: its stdout (the tests fork it with the imports done)."""
    result = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"the load failed:\n{result.stderr[-3000:]}")
    return result.stdout


def run_child(path: Path) -> dict:
    return json.loads(fresh_process(["--child", str(path)]).strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-layers", action="store_true", help="E4B's decoder widths too (14.93 GB of weights)")
    for flag in ("vocab", "hidden", "layers", "per-layer-dim", "intermediate", "heads", "kv-heads", "max-positions"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="write the checkpoint here (kept, reused by a later run of its shape)")
    parser.add_argument("--workdir", default=None, help="where the temporary checkpoint goes without --dir")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child))))
        return
    fields = config_fields(args)
    work = None if args.dir else Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_ple_load_"))
    ckpt = Path(args.dir) if args.dir else work / "ckpt"
    try:
        started = time.perf_counter()
        reused = existing(ckpt, fields, int(args.shard_gb * GB))
        info = describe(ckpt) if reused else write_checkpoint(ckpt, fields, int(args.shard_gb * GB))
        write_s = time.perf_counter() - started
        shape = {k: fields[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "hidden_size_per_layer_input",
                                        "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "global_head_dim", "num_kv_shared_layers", "max_position_embeddings")}
        print(f"checkpoint ({'reused' if reused else f'written in {write_s:.0f} s'}, {ckpt}): Gemma 4 text, "
              f"{'E4B' if args.full_layers else 'E4B tables, narrowed decoder layers'}: "
              + ", ".join(f"{k} {v}" for k, v in shape.items()))
        print(f"  {info['tensors']} bf16 tensors in {info['files']} files, {info['weights_gb']:.3f} GB; "
              f"{TABLE} {info['table_shape']} {info['table_gb']:.3f} GB; model.embed_tokens.weight {info['embed_shape']}; "
              f"largest other tensor {info['largest_other_gb']:.3f} GB")
        r = run_child(ckpt)
        margin = r["derived_buffers_gb"] + r["copied_gb"] + SLACK_GB
        bound = info["weights_gb"] + margin
        ok = r["rise_gb"] <= bound and r["table_mapped_from"] is not None
        print(f"load_model(bf16) in a fresh process: {r['load_s']:.2f} s, every parameter read {r['read_s']:.2f} s; "
              f"baseline (after imports) {r['baseline_gb']:.3f} GB")
        print(f"  peak RSS - baseline: {r['rise_after_load_gb']:.3f} GB after the load, {r['rise_gb']:.3f} GB after every "
              f"parameter was read = {r['rise_gb'] / info['weights_gb']:.3f}x the weights ({info['weights_gb']:.3f} GB), "
              f"{r['rise_gb'] / info['table_gb']:.3f}x the table ({info['table_gb']:.3f} GB)")
        where = f"memory-mapped from {r['table_mapped_from']}" if r["table_mapped_from"] else "NOT mapped from its file: a copy"
        print(f"  table: {r['table_dtype']}, {where}")
        print(f"  margin {margin:.3f} GB = rotary tables {r['derived_buffers_gb']:.3f} ({', '.join(r['derived_buffers']) or '-'}) "
              f"+ copied parameters {r['copied_gb']:.3f} ({', '.join(r['copied_keys']) or '-'}) + slack {SLACK_GB:.3f}")
        print(f"  bound: rise {r['rise_gb']:.3f} <= weights {info['weights_gb']:.3f} + margin {margin:.3f} = {bound:.3f} GB "
              f"-> {'within' if ok else 'OVER'} (over the weights by {r['rise_gb'] - info['weights_gb']:+.3f} GB; "
              f"a second table would add {info['table_gb']:.3f})")
        print(json.dumps({"shape": shape, "full_layers": args.full_layers, **info, **r, "slack_gb": SLACK_GB,
                          "margin_gb": margin, "bound_gb": bound, "within": ok}))
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
