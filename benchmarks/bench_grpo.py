"""A GRPO step, Waypoint's recipe against TRL's GRPOTrainer, split into its parts: native sampler, vLLM colocate, server.

    python benchmarks/bench_grpo.py [--prompts 4] [--n 4] [--new 32] [--steps 3] [--temperature 1.0] [--model DIR]
                                    [--device cpu|cuda] [--dtype fp32|bf16] [--threads N] [--rows native,vllm,...]
                                    [--rounds R]

One model (``--model``, an HF directory; ``assets/tiny_llama`` by default), the prompts of assets/tiny_grpo.jsonl
(repeated to fill the steps) and their reward, ``waypoint.assets.tiny_grpo_rewards.letter_share`` (TRL's signature:
the same function on both sides). A step: ``--prompts`` prompts x ``--n`` completions of up to ``--new`` tokens (EOS
ends one), temperature ``--temperature``, top-p 1, top-k off; loss dapo, beta 0, one iteration; torch's AdamW (lr
1e-2, no weight decay), gradients clipped at 1; no activation checkpointing, no validation, no checkpoint. Rows:

  native      ``recipes/grpo_finetune.py``'s ``main(argv)`` over configs/tiny_grpo.yaml (``generation.engine: native``)
  vllm        the same, ``+generation.engine=vllm``: vLLM in the training process
  server      the same, ``+vllm={vllm_mode: server, ...}``: a vLLM server this bench starts on 127.0.0.1 as
              tests/with_vllm/test_vllm_server.py does (eager, Waypoint's worker extension), and stops
  trl         ``trl.GRPOTrainer`` over ``AutoModelForCausalLM.from_pretrained(--model)``: transformers' ``generate``
  trl-vllm    the same, ``use_vllm=True, vllm_mode="colocate"``
  trl-server  not run (one line): TRL gives a server the weights over vLLM's NCCL weight transfer, CUDA only

Each row runs in a fresh process; those with vLLM under ``WAYPOINT_VLLM_PYTHON`` (default ``.venv-vllm/bin/python``,
scripts/make_vllm_env.sh; trl-vllm needs ``pip install trl==1.16.0`` there) unless this python has vLLM. Neither side's
code is changed: the functions each calls are wrapped with timers (CUDA synchronised), summed per step. Columns,
Waypoint | TRL:

  gen s     ``PolicyEngine.sync`` + ``GRPOStep._sample`` (``generate_groups``, or the engine's ``sample``) |
            ``GRPOTrainer._generate``: the prompts tokenized, ``sync_weights``, generation, completions decoded
  sync s    of gen, vLLM rows: ``PolicyEngine.sync`` (the weights through the family's table into vLLM's
            ``reload_weights``, or written as safetensors for the server to reload; then the probe checked) |
            ``VLLMGeneration.sync_weights`` (``load_weights`` a tensor at a time, the prefix cache reset)
  reward s  ``rewards.scoring.score`` | ``_calculate_rewards``: the reward calls
  logps s   ``GRPOStep.fill_fixed_logps`` | ``_get_per_token_logps_and_entropies`` under no_grad (the old and reference
            log-probs of ``_generate_and_score_completions``). Both compute old log-probs only for vLLM's samples
            (the importance-sampling correction, on by default on both sides) or num_iterations > 1, reference ones
            only for beta > 0: ~0 in the native and trl rows, the same work in the vLLM rows
  train s   ``GRPOStep.backward`` (forward with grad, the fused chunked log-probs, loss, backward) + ``clip_gradients``
            + ``AdamW.step`` | ``training_step`` minus ``_prepare_inputs`` (``compute_loss`` over the full logits,
            backward) + ``_clip_grad_norm`` + ``AdamW.step``
  other s   the step minus gen, reward, logps and train: Waypoint's decoding, packing, advantages, metrics.jsonl;
            TRL's padding, advantages, metrics and logging, dataloader; both sides' scheduler step and zero_grad
  step s    one step's start to the next's (Waypoint: ``sync``, or ``rollouts`` for native; TRL: ``training_step``),
            the mean of ``--steps`` steps after a warm-up step, their min-max beside it
  tokens    completion tokens a step (an early EOS shortens a completion: the sides' work differs by this)
  start s   once a run, not in the steps: the engine's start (``start_engine``; ``VLLMGeneration._init_vllm``; the
            server's, until /health answered). TRL builds its ``LLM`` without ``enforce_eager``, so on the CPU vLLM
            compiles it with inductor (in that start; it then samples compiled); Waypoint's vLLM is eager on the CPU

``/native``: Waypoint native's step time over the row's; ``thr``: torch's threads at the row's end. The last lines
give TRL's times over Waypoint's, row by row. Both sides see the same prompts, in another order, and other samples;
TRL's vLLM row runs under the vLLM python's transformers (5.19 here), the trl row under this one's (5.24). On a CPU
shared with other work, ``--threads 1`` (also ``OMP_NUM_THREADS`` for the row and its server) gives steadier times.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"native": "Waypoint, native", "vllm": "Waypoint, vLLM colocate", "server": "Waypoint, vLLM server",
        "trl": "TRL, transformers", "trl-vllm": "TRL, vLLM colocate", "trl-server": "TRL, vLLM server"}
VLLM_ROWS = ("vllm", "server", "trl-vllm", "trl-server")
PAIRS = (("native", "trl"), ("vllm", "trl-vllm"), ("server", "trl-server"))
COLUMNS = ("gen", "reward", "logps", "train")  # with other, the step; sync is part of gen
TRL_SERVER = ("not run: TRL gives a server the weights over vLLM's NCCL weight transfer, CUDA only "
              "(VLLMClient.init_communicator), and from a GPU other than the server's")
MARK, SEED = "bench_grpo: ", 1234  # the child's result line; both sides' seed


class Done(Exception):
    """The bench's steps are measured: the run stops at the next step's start (no final checkpoint)."""


class Clock:
    """Each step's sums of the wrapped functions' times; ``begin`` at a step's start, ``Done`` after ``steps``."""

    def __init__(self, steps: int, device: str) -> None:
        import torch

        self.limit, self.steps, self.setup, self.started = steps, [], {}, 0.0
        self.wait = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def begin(self) -> None:
        self.wait()
        now = time.perf_counter()
        if self.steps:
            self.steps[-1]["step"] = now - self.started
        if len(self.steps) == self.limit:
            raise Done
        self.steps.append({})
        self.started = now

    def add(self, column: str, value: float) -> None:
        held = self.steps[-1] if self.steps else self.setup  # before the first step: the engine's start
        held[column] = held.get(column, 0.0) + value

    def wrap(self, owner, name: str, column: str | None, begins=False, when=None, count=None) -> None:
        """``owner.name`` timed into ``column`` (where ``when()``), after starting a step if it ``begins`` one;
        ``count(args)``: completion tokens."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if begins:
                self.begin()
            if column is None or (when is not None and not when()):
                return fn(*args, **kwargs)
            self.wait()
            started = time.perf_counter()
            result = fn(*args, **kwargs)  # one that raises (Done: the run ends) adds nothing
            self.wait()
            self.add(column, time.perf_counter() - started)
            if count is not None:
                self.add("tokens", count(args))
            return result
        setattr(owner, name, timed)

    def result(self) -> dict:
        import torch

        for s in self.steps:
            s["train"] = s.get("train", 0.0) - s.pop("inputs", 0.0)  # TRL: training_step without _prepare_inputs
        measured = self.steps[1:]
        out = {k: statistics.fmean(s.get(k, 0.0) for s in measured) for k in (*COLUMNS, "sync", "step", "tokens")}
        out["other"] = out["step"] - sum(out[c] for c in COLUMNS)
        return dict(out, min=min(s["step"] for s in measured), max=max(s["step"] for s in measured),
                    warmup=self.steps[0]["step"], start=self.setup.get("start"), threads=torch.get_num_threads())


def prompts(folder: Path, args) -> tuple[Path, int]:
    """(assets/tiny_grpo.jsonl's records repeated so that one epoch holds every step, vLLM's max_model_len: the
    longest prompt by HF's tokenizer + ``--new`` + a margin, within the model's context)."""
    from transformers import AutoTokenizer

    records = (ROOT / "assets/tiny_grpo.jsonl").read_text().splitlines()
    records = [records[i % len(records)] for i in range(max(args.prompts * (args.steps + 2), len(records)))]
    (path := folder / "prompts.jsonl").write_text("\n".join(records) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    longest = max(len(tokenizer(json.loads(line)["prompt"])["input_ids"]) for line in records)
    context = json.loads((Path(args.model) / "config.json").read_text()).get("max_position_embeddings") or 10 ** 6
    return path, min(longest + args.new + 8, context)


@contextlib.contextmanager
def served(args, limit: int, folder: Path):
    """vLLM's OpenAI server of ``--model`` on 127.0.0.1 with Waypoint's worker extension, as the tests start it:
    (its URL, the seconds until /health answered); its process group stopped on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype",
               {"fp32": "float32", "bf16": "bfloat16"}[args.dtype], "--logprobs-mode", "processed_logprobs",
               "--max-model-len", str(limit), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--worker-extension-cls", "waypoint.sampling.vllm_worker.WaypointWorker"]
    command += ["--enforce-eager"] if args.device == "cpu" else []
    log, url, started = folder / "vllm_server.log", f"http://127.0.0.1:{port}", time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    try:
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2):
                break
            if process.poll() is not None or time.perf_counter() - started > args.timeout:
                tail = (log.read_text().strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"the vLLM server did not start (exit {process.poll()}): {tail}")
            time.sleep(0.5)
        yield url, time.perf_counter() - started
    finally:
        with contextlib.suppress(ProcessLookupError):  # one that exited at start
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ours(row: str, args, clock: Clock, data: Path, out: Path, url: str | None) -> None:
    import torch

    from waypoint.recipes import grpo_finetune as recipe
    from waypoint.sampling.grpo_engine import PolicyEngine
    from waypoint.training import grpo_step

    if row == "native":
        clock.wrap(grpo_step.GRPOStep, "rollouts", None, begins=True)
    else:
        clock.wrap(PolicyEngine, "sync", "gen", begins=True)
        clock.wrap(PolicyEngine, "sync", "sync")  # around the one above: once it has begun the step
        clock.wrap(recipe, "start_engine", "start")
    clock.wrap(grpo_step.GRPOStep, "_sample", "gen")
    clock.wrap(grpo_step, "score", "reward", count=lambda a: sum(len(c) for c in a[4]))  # a[4]: completions' ids
    clock.wrap(grpo_step.GRPOStep, "fill_fixed_logps", "logps")
    for owner, name in ((grpo_step.GRPOStep, "backward"), (recipe, "clip_gradients"), (torch.optim.AdamW, "step")):
        clock.wrap(owner, name, "train")
    argv = ["--config", str(ROOT / "configs/tiny_grpo.yaml"), f"output_dir={out}", f"dataset.source={data}",
            f"checkpointer.checkpoint_dir={args.model}", "validation=null", "progress=off", "epochs=1",
            "save_every_epoch=false", "preemption_signals=[SIGUSR1]", f"batch_size={args.prompts}", "gradient_accumulation_steps=1",
            f"generation.num_generations={args.n}",
            f"generation.max_completion_length={args.new}", f"generation.temperature={args.temperature}",
            f"device={args.device}", f"dtype={args.dtype}", f"seed={SEED}"]
    argv += [] if row == "native" else ["+generation.engine=vllm"]
    argv += [f"+vllm={{vllm_mode: server, vllm_server_base_url: '{url}'}}"] if row == "server" else []
    try:
        status = recipe.main(argv)
    except Done:
        return
    raise RuntimeError(f"the recipe stopped (status {status}) before the bench's steps")


def trl(row: str, args, clock: Clock, data: Path, out: Path, limit: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from waypoint.assets.tiny_grpo_rewards import letter_share

    clock.wrap(GRPOTrainer, "training_step", "train", begins=True)
    clock.wrap(GRPOTrainer, "_prepare_inputs", "inputs")  # taken off train: generation, scoring, old log-probs
    clock.wrap(GRPOTrainer, "_generate", "gen")
    clock.wrap(GRPOTrainer, "_calculate_rewards", "reward", count=lambda a: sum(len(c) for c in a[4]))
    clock.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "logps", when=lambda: not torch.is_grad_enabled())
    clock.wrap(GRPOTrainer, "_clip_grad_norm", "train")
    clock.wrap(torch.optim.AdamW, "step", "train")
    if row == "trl-vllm":
        from trl.generation.vllm_generation import VLLMGeneration

        clock.wrap(VLLMGeneration, "_init_vllm", "start")
        clock.wrap(VLLMGeneration, "sync_weights", "sync")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=args.prompts * args.n, num_generations=args.n,
                        max_completion_length=args.new, temperature=args.temperature, top_p=1.0, top_k=0,
                        max_steps=args.steps + 2, learning_rate=1e-2, weight_decay=0.0, optim="adamw_torch",
                        max_grad_norm=1.0, gradient_checkpointing=False, logging_steps=1, report_to=[],
                        save_strategy="no", disable_tqdm=True, use_cpu=args.device == "cpu", bf16=args.dtype == "bf16",
                        seed=SEED, use_vllm=row == "trl-vllm", vllm_mode="colocate", vllm_max_model_length=limit)
    dataset = Dataset.from_list([json.loads(line) for line in data.read_text().splitlines()])
    trainer = GRPOTrainer(model=model, reward_funcs=letter_share, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(args.model))
    try:
        trainer.train()
    except Done:
        return
    raise RuntimeError("GRPOTrainer.train ended before the bench's steps")


def child(row: str, args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = Clock(args.steps + 1, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data, limit = prompts(folder, args)
        if row.startswith("trl"):
            trl(row, args, clock, data, folder / "out", limit)
        elif row == "server":
            with served(args, limit, folder) as (url, start_s):
                ours(row, args, clock, data, folder / "out", url)
            clock.setup["start"] = start_s
        else:
            ours(row, args, clock, data, folder / "out", None)
    return clock.result()


def run_child(python: str, row: str, args) -> dict | str:
    """The row in a fresh process under ``python``: its figures, or one line saying why there are none."""
    forwarded = [f"--{k}={getattr(args, k)}" for k in ("prompts", "n", "new", "steps", "temperature", "model",
                                                         "device", "dtype", "threads", "timeout")]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}  # a server's too
    with subprocess.Popen([python, __file__, "--child", row, *forwarded], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as run:
        try:
            stdout, stderr = run.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            run.terminate()  # the child stops its vLLM server on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.communicate(timeout=60)
            run.kill()
            return f"did not finish in {args.timeout} s (--timeout)"
    got = next((json.loads(line[len(MARK):]) for line in reversed(stdout.splitlines()) if line.startswith(MARK)), {})
    if "error" in got or not got:
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]  # the recipe's own line
        why = got.get("error") or (stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return why + (f" ({errors[-1]})" if errors else "")
    return got


def median_run(runs: list[dict | str]) -> dict | str:
    """A row's round of median step time (its split kept whole), or why it has none."""
    timed = sorted((r for r in runs if isinstance(r, dict)), key=lambda r: r["step"])
    return timed[(len(timed) - 1) // 2] if timed else runs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step")
    parser.add_argument("--n", type=int, default=4, help="completions a prompt (num_generations)")
    parser.add_argument("--new", type=int, default=32, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=3, help="measured steps, after one warm-up step")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--model", default=str(ROOT / "assets/tiny_llama"), help="an HF model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=0, help="torch's threads in each row (0: its default)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"some of {','.join(ROWS)}")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a row may take")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every row, interleaved; the median's shown")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    if args.child:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (--timeout)"))  # a server stopped on the way out
        try:
            got = child(args.child, args)
        except Exception as e:  # noqa: BLE001 - the row's one line
            where = f" (under {sys.executable})" if isinstance(e, ImportError) else ""
            got = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}{where}"}
        print(MARK + json.dumps(got), flush=True)
        os._exit(0)  # no engine teardown at exit (vLLM's can hang); a server is stopped already
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if [r for r in rows if r not in ROWS]:
        parser.error(f"--rows: {args.rows}: rows are {', '.join(ROWS)}")
    python = sys.executable if importlib.util.find_spec("vllm") else \
        os.environ.get("WAYPOINT_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")
    print(f"{Path(args.model).name}: {args.prompts} prompts x {args.n} completions x up to {args.new} tokens, temperature "
          f"{args.temperature}, {args.device}, {args.dtype}, torch threads {args.threads or 'default'}; mean of "
          f"{args.steps} steps after a warm-up step, each row in a fresh process (median of {args.rounds}); vLLM rows "
          f"under {python}")
    runs: dict[str, list[dict | str]] = {row: [] for row in rows}
    for _ in range(args.rounds):  # rounds interleaved: a busy spell of a shared machine falls on every row alike
        for row in rows:
            if row == "trl-server":
                runs[row].append(TRL_SERVER)
            elif row in VLLM_ROWS and not Path(python).exists():
                runs[row].append(f"no vLLM here, nor {python} (bash scripts/make_vllm_env.sh, or set WAYPOINT_VLLM_PYTHON)")
            else:
                runs[row].append(run_child(python if row in VLLM_ROWS else sys.executable, row, args))
    results = {row: median_run(got) for row, got in runs.items()}
    native = results.get("native")
    print(f"{'':24} {'gen s':>6} {'sync s':>6} {'reward s':>8} {'logps s':>7} {'train s':>7} {'other s':>7} {'step s':>6} "
          f"{'min-max':>11} {'tokens':>6} {'/native':>7} {'start s':>7} {'thr':>3}")
    for row, r in results.items():
        if isinstance(r, str):
            print(f"{ROWS[row]:24} {r}")
            continue
        ratio = f"{native['step'] / r['step']:7.2f}" if isinstance(native, dict) else f"{'-':>7}"
        start = f"{r['start']:7.1f}" if r["start"] is not None else f"{'-':>7}"
        print(f"{ROWS[row]:24} {r['gen']:6.3f} {r['sync']:6.3f} {r['reward']:8.4f} {r['logps']:7.3f} {r['train']:7.3f} "
              f"{r['other']:7.3f} {r['step']:6.3f} {r['min']:5.2f}-{r['max']:<5.2f} {r['tokens']:6.0f} {ratio} {start} "
              f"{r['threads']:3d}")
    for ours_row, trl_row in PAIRS:
        a, b = results.get(ours_row), results.get(trl_row)
        if isinstance(a, dict) and isinstance(b, dict):
            parts = ", ".join(f"{c} {b[c] / a[c]:.2f}x" for c in ("gen", "logps", "train") if min(a[c], b[c]) > 0.01)
            print(f"TRL / Waypoint, {ROWS[ours_row][10:]}: the step {b['step'] / a['step']:.2f}x the time ({parts})")


if __name__ == "__main__":
    main()
