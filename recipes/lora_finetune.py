"""LoRA fine-tuning of a Llama-family model; adapters in PEFT's format, the merged model in the input's format and files.

    python recipes/lora_finetune.py --config configs/tiny_lora.yaml [key=value ...]

The same loop, config keys, logging, resume and preemption handling as recipes/full_finetune.py, with the
LoRA differences:

- the base model is always loaded from ``checkpointer.checkpoint_dir`` (frozen); ``apply_lora`` wraps the
  ``lora.targets``, and only the adapter parameters reach the optimizer;
- ``quantize_base: nf4`` (QLoRA) holds the frozen base linears in 4 bits (torchao's NF4Tensor), each quantized
  as the checkpoint's tensor is read; the merged model is still computed from the input's full-precision
  weights, and step checkpoints never hold the 4-bit base (a resume quantizes the input again, identically);
  ``quantize_base: mxfp4`` holds a MoE model's experts in MXFP4 the same way (gpt-oss: the file's own values);
  ``quantize_base: fp8`` holds a block-FP8 checkpoint's linears in FP8, as the file's own bytes where it can;
- ``output_dir/step_N`` holds ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's format:
  ``PeftModel.from_pretrained(base, step_N)`` loads it), ``recipe_state.pt`` and ``MANIFEST.json``;
- the merged model (W + alpha/r * B @ A) goes to ``step_N/merged/``: a complete checkpoint in the input's
  format, file names and key -> file map, with the input's side files and its own ``MANIFEST.json``. It is a
  subdirectory (not files beside the adapter) because transformers treats a directory holding
  ``adapter_config.json`` as an adapter to load onto ``base_model_name_or_path``, not as a model.
  ``save_merged: final`` (default) writes it in the last checkpoint only, ``every`` in each one, ``never``
  in none; ``save_adapter_weights_only: true`` also skips it. ``step_N/merged`` is staged inside
  ``step_N`` before ``step_N`` is committed, so both appear together or not at all;
- resuming takes the base from ``checkpointer.checkpoint_dir`` and the adapter, optimizer, scheduler, RNG and
  data position from ``step_N``: the result is bit-identical to an uninterrupted run;
- under ``torchrun`` the base is sharded (FSDP2) like the full recipe's model, the adapters and their optimizer
  state are gathered whole into the same files as a single process writes (so a run resumes on any number of
  processes), and the merged model is gathered and written one output file at a time.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed: its root holds `waypoint`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from waypoint.cli.entry import run_recipe
from waypoint.cli.hub_source import base_model_name
from waypoint.cli.option_checks import COMMON, LORA
from waypoint.cli.run_config import config_as_given
from waypoint.data.collate import batch_collate
from waypoint.data.data_order import iterate_batches, optimizer_steps_per_epoch
from waypoint.data.run_data import run_data
from waypoint.evaluation.during_training import TrainingEval
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.preemption import PreemptionWatch
from waypoint.run.progress import TrainingProgress
from waypoint.run.recipe_state import capture_recipe_state
from waypoint.run.resume import RunStart, refusing
from waypoint.run.run_outputs import RunOutputs, merged_note
from waypoint.run.step_content import adapter_step
from waypoint.training.distributed import Distributed
from waypoint.training.loss import forward_backward
from waypoint.training.nonfinite import check_weights_finite, clip_gradients, step_is_finite
from waypoint.training.recipe_model import load_adapters, load_model
from waypoint.training.seed import seed_everything
from waypoint.training.validation import evaluate

# beside waypoint.run.resume.BREAKING_KEYS: another adapter (targets, rank, alpha, dropout) or another base (4-bit or not)
LORA_BREAKING = ("lora", "quantize_base", "nf4")


def train(cfg: DictConfig, dist: Distributed) -> int:
    """The run; ``run_recipe`` has checked the config, started the process group (under torchrun) and holds
    ``output_dir`` for it."""
    device, main = dist.device, dist.is_main
    say = print if main else (lambda *a, **k: None)  # noqa: E731
    config = config_as_given(cfg)  # what each checkpoint records (URLs, not this machine's local copies)
    # Where the run lives (an object-store run: the store and this machine's mirror of it).
    run_dir = RunDir(Path(cfg.output_dir), cfg.get("output_store"))
    if not dist.enabled and cfg.get("mixed_precision"):
        say("note: mixed_precision applies under torchrun (FSDP2); one process computes in dtype")
    save_merged = "never" if cfg.get("save_adapter_weights_only", False) else cfg.get("save_merged", "final")
    max_lora_rank = cfg.get("max_lora_rank", 16)

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    start = RunStart(run_dir, cfg.resume, cfg.overwrite, config, dist, check=refusing(LORA_BREAKING))
    seed_everything(cfg.seed)
    # lm-eval tasks scored as it trains (eval: {tasks, every_n_steps}); resolved now, so a bad task fails here
    training_eval = TrainingEval.from_config(cfg.get("eval"), dist.world_size)

    # Model: the base (always the input checkpoint) on the meta device with the adapters added, sharded
    # (FSDP2) under torchrun, given the base's tensors (each rank its piece) and fresh adapter weights.
    # With quantize_base: nf4 (QLoRA) the frozen linears (mxfp4: the MoE experts) become 4-bit placeholders first,
    # each quantized as its tensor is read: the full-precision base is never in memory.
    lora = cfg.lora
    loaded = load_model(cfg, dist, start, lora, say)
    model, checkpointer, wrapped = loaded.model, loaded.checkpointer, loaded.wrapped
    say(f"merged models are written in {checkpointer.output_dtype_note()}")
    # The merge reads the base again from the input (lazily, a tensor at a time): the full-precision
    # original, not the model's 4-bit or dtype-cast copy.
    original, sources = loaded.original, loaded.report.sources
    converter = load_adapters(model, checkpointer, start)  # names the adapter's modules as HF does
    base_name = base_model_name(checkpointer.checkpoint_dir)
    own_layout = checkpointer.adapter_layout()  # Meta/native inputs get the adapter in their own keys too
    trainable = [p for p in model.parameters() if p.requires_grad]
    say(f"lora: {len(wrapped)} layers ({', '.join(lora.targets)}), rank {lora.rank}, alpha {lora.alpha}: "
        f"{sum(p.numel() for p in trainable):,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters")
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data: a global batch of batch_size x gradient_accumulation_steps x processes samples per step.
    tokenizer = instantiate(cfg.tokenizer)
    # the dataset (validation held out, packed on request); a chat dataset's template also goes into each checkpoint
    def make_dataset(**source):  # the config's dataset (with source=: a validation file)
        return instantiate(cfg.dataset, tokenizer=tokenizer, **source)
    dataset, validation = run_data(make_dataset, tokenizer, checkpointer, cfg.get("validation"), cfg.seed,
                                   packed_to=cfg.dataset.max_seq_len if cfg.get("packed", False) else None,
                                   vocab_size=model.args.vocab_size, say=say,
                                   max_positions=getattr(model.args, "max_seq_len", None))
    collate = lambda batch: batch_collate(batch, pad_id=tokenizer.pad_id)  # noqa: E731
    accumulate = cfg.gradient_accumulation_steps
    steps_per_epoch = optimizer_steps_per_epoch(len(dataset), cfg.batch_size, accumulate, dist.world_size,
                                                cfg.max_steps_per_epoch)
    plan = RunPlan(steps_per_epoch, cfg.epochs, cfg.batch_size, accumulate, dist.world_size, cfg.seed,
                   save_every_n_steps=cfg.save_every_n_steps or 0, save_every_epoch=cfg.save_every_epoch)

    # Optimizer over the adapter parameters only.
    optimizer = instantiate(cfg.optimizer, params=trainable)
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=plan.total_steps)

    # A resumed run gets its optimizer, scheduler, random states and data position back; a fresh one starts at 0.
    position = start.restore(optimizer, scheduler, model, plan, say)
    if position is None:
        return 0
    global_step, start_epoch, start_step = position
    # rank 0's logs and the checkpoints (the adapters are small: gathered whole, written by rank 0), from the resumed step on
    outputs = RunOutputs(cfg, config, run_dir, start, dist, global_step, sharded=False, say=say)
    metrics = outputs.metrics

    def save(epoch: int, step_in_epoch: int, final: bool, preempted: bool) -> Path:
        check_weights_finite(model, global_step, dist.any)  # a checkpoint is never written from nan or inf weights
        recipe = capture_recipe_state(plan, global_step, epoch, step_in_epoch, scheduler, config, dist, outputs.trackers)
        content = adapter_step(model, optimizer, recipe, checkpointer, converter=converter, base_name=base_name,
                               max_lora_rank=max_lora_rank, layout=own_layout, original=original, sources=sources,
                               merge=save_merged == "every" or (save_merged == "final" and final), dist=dist,
                               verify=outputs.verify, report=tqdm.write)
        return outputs.saver.save(global_step, content, final=final or preempted)

    loss_chunk = None if cfg.get("fused_loss", True) else 0  # None: chunks sized by the vocabulary; 0: full logits
    preemption = PreemptionWatch(cfg.preemption_signals)
    # a bar on a terminal, a plain line every progress_every_n_steps in a log (progress: auto | bar | lines | off)
    progress = TrainingProgress(plan.total_steps, global_step, cfg.get("progress_every_n_steps", 10), shown=main)
    first_step = global_step + 1
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate,
                                  start_batch=first * accumulate, rank=dist.rank, world_size=dist.world_size)
        for step_in_epoch in range(first, plan.steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(accumulate)]
            loss_sum, tokens, aux_loss = forward_backward(model, micro_batches, device, dist, loss_chunk)
            grad_norm = clip_gradients(trainable, cfg.clip_grad_norm)
            global_step += 1
            # A nan or inf stops the run here, before the weights change (or, with on_nonfinite=skip_step, skips the update).
            if step_is_finite(global_step, loss_sum, grad_norm, model, cfg.get("on_nonfinite", "stop"), tqdm.write,
                              updated=global_step > first_step):
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            record = dict(step=global_step, epoch=epoch, loss=loss_sum, lr=scheduler.get_last_lr()[0],
                          grad_norm=grad_norm, tokens_per_s=tokens / (time.perf_counter() - started))
            if aux_loss is not None:  # mixture of experts: the load-balancing loss, logged beside the loss it joins
                record["aux_loss"] = aux_loss
            if start.checkpoint and global_step == first_step:  # where a plot marks the resumed segment
                record["resumed"] = True
            if main:
                metrics.write(**record)
            if validation and validation.due(global_step, plan.total_steps):
                record["val_loss"] = evaluate(model, validation.dataset, cfg.batch_size, collate, device, dist)
                if main:
                    metrics.write(step=global_step, val_loss=record["val_loss"])
            if training_eval and training_eval.due(global_step, plan.total_steps):
                scores = training_eval.run(model, tokenizer)  # the model and the random states as they were
                if main:
                    metrics.write(step=global_step, **scores)
            progress.update(global_step, loss=f"{loss_sum:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))

            # Checkpoints at optimizer-step boundaries only; a signal on any rank stops every rank here.
            if outputs.step_end(plan, global_step, epoch, step_in_epoch, preemption, save):
                return outputs.stop(global_step, preemption, progress)
    outputs.finish(progress)
    saved = outputs.saved
    say(f"done: the adapter is {run_dir.stored_at(saved)}{saved} (PEFT format: PeftModel.from_pretrained(base, '{saved}') "
        f"loads it){merged_note(checkpointer, saved)}")
    return 0


CHECKS = COMMON | LORA  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0], example="configs/tiny_lora.yaml", checks=CHECKS)


if __name__ == "__main__":
    sys.exit(main())
