"""Peak memory of loading a mixture-of-experts checkpoint, against its size and against a dense one.

    python benchmarks/bench_moe_load.py [--size-mb 400] [--workdir DIR]

Writes a Mixtral-shaped checkpoint of about ``--size-mb`` in each expert layout (the hub's per-expert keys,
stacked on load, and transformers' packed ``gate_up_proj``, split on load) and a Llama-shaped dense one of
the same size, in safetensors shards of 100 MB, then loads each in a fresh process as a run does
(``HFCheckpointer.load_checkpoint`` into a meta-built model with ``load_into``, every parameter read once) and
prints the rise of the peak resident set over the load (imports excluded) against the checkpoint's bytes. Stacking copies each layer's
experts into one tensor while the source files stay memory-mapped; the converter drops each copied layer's mapped
pages from the process (``waypoint.lazy.release_pages``), so no more than one layer's experts are held twice and
the rise stays about 1x the checkpoint, as for a dense model whose mapped tensors are assigned as they are.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIM, EXPERT_HIDDEN, EXPERTS, VOCAB = 512, 1024, 8, 8192


def config(kind: str, n_layers: int) -> dict:
    common = dict(hidden_size=DIM, num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5,
                  max_position_embeddings=4096, tie_word_embeddings=False, dtype="float32")
    if kind == "dense":  # the same bytes per layer as the MoE one: one MLP 8 times as wide
        return dict(common, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=n_layers,
                    intermediate_size=EXPERT_HIDDEN * EXPERTS)
    return dict(common, model_type="mixtral", architectures=["MixtralForCausalLM"], num_hidden_layers=n_layers,
                intermediate_size=EXPERT_HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2)


def build(path: Path, kind: str, size_mb: float) -> int:
    """A random checkpoint of ``kind`` (dense, per_expert, packed): the native model's weights written through its
    family's converter in that layout, in 100 MB shards with an index."""
    import torch

    from waypoint.checkpointers.commit import StagedDir
    from waypoint.checkpointers.shard_layout import plan_layout, write_files
    from waypoint.families import family_of, model_args_from_hf_config
    from waypoint.models import Transformer

    per_layer = 4 * (3 * EXPERTS * EXPERT_HIDDEN * DIM + DIM * DIM * 2 + 2 * DIM * DIM // 4)
    n_layers = max(1, round((size_mb * 1e6 - 8 * VOCAB * DIM) / per_layer))
    cfg = config(kind, n_layers)
    args = model_args_from_hf_config(cfg)
    torch.manual_seed(0)
    model = Transformer(args)
    converter = family_of(cfg).converter(args)
    if kind == "packed":
        converter.variant = "packed"
    tensors = converter.from_native(model.state_dict())
    layout = plan_layout({k: t.numel() * t.element_size() for k, t in tensors.items()}, max_shard_bytes=100_000_000)
    with StagedDir(path) as stage:
        write_files(stage, layout, lambda name: {k: tensors[k] for k in layout.keys_in(name)}, lambda *_: {"format": "pt"})
        stage.write_bytes("config.json", json.dumps(cfg).encode())
    return sum(t.numel() * t.element_size() for t in tensors.values())


def child(path: Path) -> None:
    """bench_checkpoint's load step (HFCheckpointer into a meta-built model, every parameter read) on ``path``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.bench_checkpoint
    from benchmarks.bench_checkpoint import peak_rss_gb, step_load
    import waypoint.checkpointers  # noqa: F401  (imported before the baseline, as step_load imports them)
    import waypoint.families  # noqa: F401

    before = next(int(line.split()[1]) * 1024 / 1e9 for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))  # what step_load's reset of the peak starts from
    seconds = step_load(path, path.parent / "unused")
    print(json.dumps([seconds, peak_rss_gb() - before]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=400.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child))
        return
    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_moe_load_"))
    try:
        print(f"{'layout':11} {'checkpoint MB':>13} {'load s':>7} {'RSS rise MB':>11} {'rise / size':>11}")
        for kind in ("dense", "per_expert", "packed"):
            path = work / kind
            size = build(path, kind, args.size_mb)
            result = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"loading {kind} failed:\n{result.stderr[-3000:]}")
            seconds, rss = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{kind:11} {size / 1e6:13.0f} {seconds:7.2f} {rss * 1e3:11.0f} {rss * 1e9 / size:10.2f}x")
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
