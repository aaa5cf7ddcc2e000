"""Checkpoint save/load speed and memory, side by side with a raw write and with transformers.

    python benchmarks/bench_checkpoint.py [--size-gb 1.0] [--shards 4] [--repeats 3]

Builds a Llama-shaped HF checkpoint (bf16, ``--shards`` safetensors shards with an
index), then times each step in a fresh process, ``--repeats`` times, and reports
the best and the spread (this machine's disk swings several-fold between runs):

  raw      write the same bytes to the same number of files, fsync each
  save     HFCheckpointer.save_checkpoint of an in-memory model, durable (fsync), with its manifest
  save-nohash  the same with the manifest's hashing switched off (the manifest's cost)
  paired   raw write and save back to back in one process, the order alternating (see step_paired)
  async    the time training is blocked by an ``async_checkpoint`` save of the same model (WholeStepSaver: the
           copy into reused CPU staging buffers and the checks; the second save, as in a run past its first),
           and the host memory those buffers hold
  load     HFCheckpointer.load_checkpoint + meta-device build + assign, every parameter touched
  hf-save  transformers save_pretrained + sync          (when transformers is installed)
  hf-load  transformers from_pretrained, every parameter touched

Peak RSS is the process's resident peak over the measured part (set-up such as the
in-memory copy a save starts from is excluded by resetting VmHWM before timing).

Loads are measured with the files in the page cache, for both libraries alike. This
machine's disk writes fast right after a write and slowly after a pause (a few seconds
of importing torch and building a model are enough), so every timed write follows an
untimed raw write of the same bytes made in the same process just before the clock
starts (``warm_up``): the set-up of each step, light or heavy, no longer decides how
fast the disk is when its write begins.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not this folder on the path (the benchmarks import each other as benchmarks.NAME, from the root); a checkout
# that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTERMEDIATE, HEADS, VOCAB = 2048, 5632, 16, 32000
CHUNK = 16 * 2**20


def llama_config(n_layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "num_hidden_layers": n_layers, "vocab_size": VOCAB, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def build_checkpoint(path: Path, size_gb: float, shards: int) -> int:
    """Random bf16 weights in HF Llama keys, split into ``shards`` files of about equal size."""
    import torch
    from safetensors.torch import save_file

    per_layer = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
    n_layers = max(1, round((size_gb * 1e9 - 2 * 2 * VOCAB * HIDDEN) / per_layer))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,)})
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes.update({p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    shapes.update({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    path.mkdir(parents=True)
    weight_map, current, size, index = {}, {}, 0, 1
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    gen = torch.Generator().manual_seed(0)
    for key, shape in shapes.items():
        current[key] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += current[key].numel() * 2
        if size >= total * index / shards and index < shards or key == "lm_head.weight":
            save_file(current, path / names[index - 1], metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(current, names[index - 1]))
            current, index = {}, index + 1
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(llama_config(n_layers)))
    return total


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would carry the parent's peak across fork+exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def reset_peak_rss() -> None:
    """Start VmHWM afresh, so the peak covers the measured part only (the harness's set-up is not charged)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def raw_write(files: list[Path], buffers: list[bytes], out: Path) -> None:
    """The reference: the checkpoint's bytes to the same file names, in ``CHUNK`` writes, each file fsynced."""
    out.mkdir()
    for f, buf in zip(files, buffers):
        view = memoryview(buf)
        with open(out / f.name, "wb") as fh:
            for offset in range(0, len(view), CHUNK):  # one giant write() is 2-4x slower here than 16 MiB ones
                fh.write(view[offset: offset + CHUNK])
            fh.flush()
            os.fsync(fh.fileno())


def warm_up(ckpt: Path, out: Path) -> None:
    """An untimed raw write right before a timed one (see the module's docstring); kept until the step ends."""
    files = sorted(ckpt.glob("*.safetensors"))
    raw_write(files, [f.read_bytes() for f in files], out.with_name(out.name + "-warm"))
    reset_peak_rss()


# -- the measured steps, each run in a child process --------------------------------------------
def step_raw(ckpt: Path, out: Path) -> float:
    files = sorted(ckpt.glob("*.safetensors"))
    buffers = [f.read_bytes() for f in files]  # the checkpoint's own bytes, in memory (this disk is faster on zeros)
    warm_up(ckpt, out)
    start = time.perf_counter()
    raw_write(files, buffers, out)
    return time.perf_counter() - start


def step_save(ckpt: Path, out: Path) -> float:
    from waypoint.checkpointers import HFCheckpointer

    checkpointer = HFCheckpointer(ckpt, output_dir=out)
    state = {"model": {k: v.clone() for k, v in checkpointer.load_checkpoint()["model"].items()}}
    warm_up(ckpt, out)
    start = time.perf_counter()
    checkpointer.save_checkpoint(state, step=1)
    return time.perf_counter() - start


def step_async(ckpt: Path, out: Path) -> tuple[float, float]:
    """(seconds training was blocked by the second of two background saves, bytes of staging buffers)."""
    from waypoint.checkpointers import HFCheckpointer
    from waypoint.run.savers import SaveOptions, StepContent, WholeStepSaver
    from waypoint.training.distributed import init_distributed

    checkpointer = HFCheckpointer(ckpt, output_dir=out)
    state = {"model": {k: v.clone() for k, v in checkpointer.load_checkpoint()["model"].items()}}
    saver = WholeStepSaver(init_distributed("cpu"), out, SaveOptions(asynchronous=True), report=lambda line: None)
    saver.save(1, StepContent(state, checkpointer.writer))
    saver.wait()
    warm_up(ckpt, out)
    start = time.perf_counter()
    saver.save(2, StepContent(state, checkpointer.writer))
    blocked = time.perf_counter() - start
    saver.close()
    return blocked, saver.staging_bytes


def step_paired(ckpt: Path, out: Path, rounds: int = 6) -> tuple[float, list]:
    """Raw write and save back to back in one process, ``rounds`` times, the order alternating (save first, then raw
    first, ...): this disk writes the first burst after a pause fast and the second slowly, whoever writes it, so
    each order is summarised apart and their geometric mean is the order-neutral ratio of speeds."""
    from waypoint.checkpointers import HFCheckpointer

    checkpointer = HFCheckpointer(ckpt, output_dir=out)
    state = {"model": {k: v.clone() for k, v in checkpointer.load_checkpoint()["model"].items()}}
    files = sorted(ckpt.glob("*.safetensors"))
    buffers = [f.read_bytes() for f in files]
    out.mkdir()

    def raw(target: Path) -> float:
        start = time.perf_counter()
        raw_write(files, buffers, target)
        return time.perf_counter() - start

    def save(target: Path) -> float:
        start = time.perf_counter()
        checkpointer.save_to(state, target)
        return time.perf_counter() - start

    results = []
    for r in range(rounds):
        save_first = r % 2 == 0
        first, second = (save, raw) if save_first else (raw, save)
        a = first(out / f"a{r}")
        os.sync()
        b = second(out / f"b{r}")
        t_save, t_raw = (a, b) if save_first else (b, a)
        results.append([save_first, t_raw, t_save])
        shutil.rmtree(out / f"a{r}")
        shutil.rmtree(out / f"b{r}")
        os.sync()
    return 0.0, results


def step_save_nohash(ckpt: Path, out: Path) -> float:
    """The same save with the manifest's hashing replaced by nothing: what the manifest costs."""
    import waypoint.checkpointers.commit as commit

    class NoHash:
        def update(self, data) -> None:
            pass

        def hexdigest(self) -> str:
            return ""

    commit.new_hasher = lambda name=commit.HASH: NoHash()
    return step_save(ckpt, out)


def step_load(ckpt: Path, out: Path) -> float:
    import torch

    from waypoint.checkpointers import HFCheckpointer, load_into
    from waypoint.families import from_hf_config

    reset_peak_rss()
    start = time.perf_counter()
    checkpointer = HFCheckpointer(ckpt, output_dir=out)
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = from_hf_config(checkpointer.config)
    load_into(model, state)
    del state
    touched = sum(float(p.detach().sum()) for p in model.parameters())
    assert touched == touched
    return time.perf_counter() - start


def step_hf_save(ckpt: Path, out: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    warm_up(ckpt, out)
    start = time.perf_counter()
    model.save_pretrained(out, max_shard_size=f"{int(sum(f.stat().st_size for f in ckpt.glob('*.safetensors')) / len(list(ckpt.glob('*.safetensors'))) / 1e6) + 1}MB")
    fsync_tree(out)
    return time.perf_counter() - start


def step_hf_load(ckpt: Path, out: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    reset_peak_rss()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    touched = sum(float(p.detach().sum()) for p in model.parameters())
    assert touched == touched
    return time.perf_counter() - start


STEPS = {"raw": step_raw, "save": step_save, "save-nohash": step_save_nohash, "async": step_async, "load": step_load,
         "hf-save": step_hf_save, "hf-load": step_hf_load, "paired": step_paired}


def run_child(step: str, ckpt: Path, work: Path) -> tuple[float, float, float | None]:
    out = work / f"out-{step}"
    shutil.rmtree(out, ignore_errors=True)
    result = subprocess.run([sys.executable, __file__, "--child", step, str(ckpt), str(out)],
                            capture_output=True, text=True, check=False)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + "-warm"), ignore_errors=True)
    os.sync()  # leave no dirty pages behind: on ext4 one file's fsync can wait for everyone's writeback
    if result.returncode:
        raise RuntimeError(f"step {step} failed:\n{result.stderr[-3000:]}")
    return tuple(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--steps", default=None, help="a comma-separated subset of the steps (default: all)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, ckpt, out = args.child
        seconds, extra = STEPS[step](Path(ckpt), Path(out)), None
        if isinstance(seconds, tuple):
            seconds, extra = seconds
        print(json.dumps([seconds, peak_rss_gb(), extra]))
        return

    try:
        import transformers  # noqa: F401  (is it installed?)
        steps = [s for s in STEPS if s != "paired"]
    except ImportError:
        steps = ["raw", "save", "save-nohash", "async", "load"]
    if args.steps:
        unknown = set(args.steps.split(",")) - set(STEPS)
        if unknown:
            parser.error(f"--steps: no step {', '.join(sorted(unknown))}; choose from {', '.join(STEPS)}")
        steps = [s for s in args.steps.split(",") if s != "paired"]
    work = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_checkpoint_"))
    try:
        ckpt = work / "ckpt"
        total = build_checkpoint(ckpt, args.size_gb, args.shards)
        os.sync()
        print(f"checkpoint: {total / 1e9:.3f} GB bf16 in {args.shards} shards at {ckpt}")
        times: dict[str, list[float]] = {s: [] for s in steps}
        rss: dict[str, float] = {}
        staging = 0.0
        for r in range(args.repeats):  # interleaved and rotated, so a slow spell of the disk hits every step alike
            for step in steps[r % len(steps):] + steps[: r % len(steps)]:
                seconds, peak, extra = run_child(step, ckpt, work)
                staging = extra if step == "async" else staging
                times[step].append(seconds)
                rss[step] = max(rss.get(step, 0.0), peak)
        print(f"{'step':8} {'best s':>8} {'median s':>9} {'spread':>7} {'GB/s':>6} {'peak RSS GB':>11}")
        for step in steps:
            best = min(times[step])
            print(f"{step:8} {best:8.3f} {statistics.median(times[step]):9.3f} {max(times[step]) / best:6.2f}x "
                  f"{total / 1e9 / best:6.2f} {rss[step]:11.2f}")
        best = {s: min(t) for s, t in times.items()}
        if {"raw", "save"} <= set(best):
            print(f"save speed / raw write speed: {best['raw'] / best['save']:.2f}x best vs best, "
                  f"{statistics.median(times['raw']) / statistics.median(times['save']):.2f}x median vs median "
                  f"(separate processes, {args.repeats} each)   (target >= 0.9x; raw: {CHUNK >> 20} MiB writes, fsync per file)")
        if not args.steps or "paired" in args.steps.split(","):
            _, _, rounds = run_child("paired", ckpt, work)
            first = statistics.median(r / s_ for save_first, r, s_ in rounds if save_first)
            second = statistics.median(r / s_ for save_first, r, s_ in rounds if not save_first)
            print(f"back to back in one process: {first:.2f}x with the save first, {second:.2f}x with it second, "
                  f"order-neutral {(first * second) ** 0.5:.2f}x (geometric mean; {len(rounds)} rounds)")
        if {"async", "save"} <= set(best):
            print(f"async save: training blocked {best['async']:.3f} s = {best['async'] / best['save']:.1%} of a sync save "
                  f"(target < 10%); extra host memory {staging / 1e9:.2f} GB of staging buffers, reused between saves")
        if {"save", "save-nohash"} <= set(best):
            print(f"manifest (hash while writing) cost: {best['save'] / best['save-nohash'] - 1:+.1%} of save time, best vs best; "
                  f"{statistics.median(times['save']) / statistics.median(times['save-nohash']) - 1:+.1%} median vs median   (target <= 10%)")
        if "load" in best:
            print(f"load peak RSS / model bytes: {rss['load'] / (total / 1e9):.2f}x; "
                  f"limit 1.1 x {total / 1e9:.2f} + 0.5 = {1.1 * total / 1e9 + 0.5:.2f} GB -> "
                  f"{'ok' if rss['load'] <= 1.1 * total / 1e9 + 0.5 else 'OVER'}")
        if {"hf-load", "load", "save", "hf-save"} <= set(best):
            print(f"load time ours / transformers: {best['load'] / best['hf-load']:.2f}x   (target <= 0.5x); "
                  f"save time ours / transformers: {best['save'] / best['hf-save']:.2f}x; "
                  f"transformers load peak RSS {rss['hf-load']:.2f} GB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
