"""Online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO, GSPO...) of a model, full or LoRA/QLoRA; outputs in the input's format.

    python recipes/grpo_finetune.py --config configs/tiny_grpo.yaml [key=value ...]

The third stage after supervised fine-tuning and preference tuning: prompts only (TRL's formats), completions sampled
from the policy as it trains, scored by reward functions. The same loop, config keys, checkpoints, resume, preemption
and torchrun support as the other recipes, with what online RL adds:

- a step takes ``batch_size`` prompts per micro-batch (``gradient_accumulation_steps`` micro-batches per process) and
  samples ``generation.num_generations`` completions of each from the policy with its KV cache, a micro-batch's
  prompts in one decode loop (``waypoint.models.sample_group``), deterministically from the run's seed and the step: the sampling generator is
  part of every step's recipe_state.pt, so a resumed run samples what the uninterrupted one sampled; or, with
  ``generation.engine: vllm``, by vLLM in this process or a vLLM server, given the policy's weights before every step and checked on a
  probe sequence, its samples corrected as TRL corrects them (``waypoint.sampling``, README: Sampling with vLLM);
- ``reward_funcs`` score them (``waypoint.rewards``: built-ins, or ``module.function`` from the working directory, TRL's
  signature), ``reward_weights`` weigh them, and the rewards become group advantages (``loss.scale_rewards``); each
  reward call is bounded by ``reward_timeout`` seconds, and a preemption signal that arrives while the step samples
  or scores drops its samples and saves the last whole step;
- the loss is TRL's for ``loss.loss_type`` (dapo by default; grpo, bnpo, dr_grpo, cispo, sapo, luspo, vespo), per
  token or per sequence (``importance_sampling_level``, GSPO), clipped by ``epsilon``/``epsilon_high``; each sample
  batch serves ``num_iterations`` optimizer steps; ``beta`` > 0 adds the KL to the input model (for LoRA the base
  with the adapters switched off; for a full run a frozen copy of the input, the one case with two models in memory);
- it logs TRL's metric names (``reward``, ``reward_std``, ``rewards/<func>/mean``, ``completions/*``, ``kl``,
  ``clip_ratio/*``, ``entropy``, ``frac_reward_zero_std``) beside loss, lr, tokens/s, and ``val_reward`` on held-out
  prompts (``validation``); the console shows what moves (``waypoint.run.grpo_progress``: GRPO's loss stays near 0)
  and warns once when every group's rewards have been equal for several steps in a row (nothing learns);
- full runs write the policy in the input's format and files; LoRA runs the PEFT adapter and ``merged/``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed: its root holds `waypoint`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from waypoint.agents.tool_loop import ToolTurns
from waypoint.agents.toolbox import ToolSet, reward_of
from waypoint.checkpointers import CheckpointError, load_into
from waypoint.cli.entry import run_recipe
from waypoint.cli.grpo_option_checks import GRPO
from waypoint.cli.hub_source import base_model_name
from waypoint.cli.option_checks import COMMON, LORA, check_options
from waypoint.cli.run_config import config_as_given
from waypoint.data.data_order import iterate_batches, optimizer_steps_per_epoch
from waypoint.data.run_data import run_data
from waypoint.models.lora import adapters_disabled
from waypoint.rewards import resolve
from waypoint.run.grpo_progress import LOSS_NOTE, ZeroSpreadWatch, progress_values
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.preemption import PreemptionWatch
from waypoint.run.progress import TrainingProgress
from waypoint.run.recipe_state import capture_recipe_state
from waypoint.run.resume import RunStart, refusing
from waypoint.run.run_outputs import RunOutputs
from waypoint.run.step_content import adapter_step, model_step
from waypoint.sampling.grpo_engine import start_engine
from waypoint.text.stop_tokens import stop_token_ids
from waypoint.training.distributed import Distributed
from waypoint.training.fsdp import shard_model
from waypoint.training.grpo_loss import GRPOLossOptions
from waypoint.training.grpo_step import GRPOStep, Preempted, RolloutOptions, step_seed
from waypoint.training.nonfinite import check_weights_finite, clip_gradients, step_is_finite
from waypoint.training.recipe_model import load_adapters, load_model
from waypoint.training.seed import seed_everything

# the loss section's keys: GRPOLossOptions' but those set from elsewhere in the config
LOSS_OPTIONS = [k for k in GRPOLossOptions.__dataclass_fields__
                if k not in ("max_completion_length", "gradient_accumulation_steps", "steps_per_generation")]
# beside waypoint.run.resume.BREAKING_KEYS: another adapter or base, a LoRA run resumed as a full one, another group size
GRPO_BREAKING = ("lora", "quantize_base", "nf4", "generation.num_generations")
REWARD_TIMEOUT_S = 120  # reward_timeout's default: one reward call that takes longer stops the run in one line
TOOL_TIMEOUT_S = 30  # tool_timeout's default: a tool call that takes longer answers the model with an error


def train(cfg: DictConfig, dist: Distributed) -> int:
    """The run; ``run_recipe`` has checked the config, started the process group (under torchrun) and holds
    ``output_dir`` for it."""
    device, main = dist.device, dist.is_main
    say = print if main else (lambda *a, **k: None)  # noqa: E731
    lora = cfg.get("lora")
    if lora:
        check_options(cfg, LORA)
    elif cfg.get("quantize_base"):
        raise CheckpointError("quantize_base: a 4-bit base is frozen, so it needs a lora section (QLoRA); "
                              "set quantize_base=null for full fine-tuning")
    generation, loss = (OmegaConf.to_container(cfg[key], resolve=True) for key in ("generation", "loss"))
    generation.pop("engine", None)  # who samples: sampling.grpo_engine
    generation["stop_strings"] = tuple(generation.get("stop_strings") or ())
    for section, given, known in (("generation", generation, RolloutOptions.__dataclass_fields__),
                                  ("loss", loss, set(LOSS_OPTIONS))):
        for key in given:
            if key not in known:
                raise CheckpointError(f"{section}.{key}: no such option (options: {', '.join(sorted(known))})")
    try:
        rollout = RolloutOptions(**generation)
        options = GRPOLossOptions(**loss, max_completion_length=rollout.max_completion_length,
                                  gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    except ValueError as e:  # a value out of range the option checks let through
        raise CheckpointError(f"loss.{e}") from None
    reward_funcs = resolve(cfg.get("reward_funcs") or [])  # a bad name or import fails here, before the model loads
    reward_weights = cfg.get("reward_weights")
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise CheckpointError(f"reward_weights: {len(reward_weights)} weights for {len(reward_funcs)} reward_funcs; "
                              "give one per function (or null for all 1)")
    # Tools the model may call, each completion then a multi-turn rollout (TRL's tools and environment_factory);
    # an environment with get_reward() is one more reward function (weight 1), named after its class.
    toolset = ToolSet.load(cfg.get("tools"), cfg.get("environment_factory"), cfg.get("tool_timeout", TOOL_TIMEOUT_S))
    if toolset is not None and toolset.env_reward:
        reward_funcs.append(reward_of(toolset.factory.__name__))
        reward_weights = None if reward_weights is None else [*reward_weights, 1.0]
    if not reward_funcs:
        raise CheckpointError("reward_funcs: none given; name at least one reward function (or an environment_factory "
                              "whose environment has get_reward())")
    config = config_as_given(cfg)
    run_dir = RunDir(Path(cfg.output_dir), cfg.get("output_store"))

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    start = RunStart(run_dir, cfg.resume, cfg.overwrite, config, dist, check=refusing(GRPO_BREAKING))
    seed_everything(cfg.seed)

    # Model, on the meta device, sharded (FSDP2) under torchrun, then given its tensors (as the DPO recipe).
    loaded = load_model(cfg, dist, start, lora, say)
    model, checkpointer = loaded.model, loaded.checkpointer
    if lora:
        original, sources = loaded.original, loaded.report.sources  # the merge reads the input's full-precision base again
        converter = load_adapters(model, checkpointer, start)
        say(f"lora: {len(loaded.wrapped)} layers ({', '.join(lora.targets)}), rank {lora.rank}, alpha {lora.alpha}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # The reference of beta > 0: LoRA's base with the adapters off; a full run's frozen copy of the input model.
    reference = None
    if options.beta != 0.0:
        if lora:
            reference = lambda: _disabled(model)  # noqa: E731
        else:
            with torch.device("meta"):
                frozen = instantiate(cfg.model)
            if dist.enabled:
                shard_model(frozen, dist.mesh, cfg.get("mixed_precision"))
            load_into(frozen, checkpointer.load_checkpoint()["model"], dtype=cfg.dtype, device=device,
                      strict=cfg.strict, key_prefix_map=cfg.key_prefix_map)
            frozen.requires_grad_(False)
            frozen.eval()
            reference = lambda: contextlib.nullcontext(frozen)  # noqa: E731
            say("beta > 0: a frozen copy of the input model is the KL's reference (a second model in memory)")

    # Data: prompts (held-out ones for val_reward); a global batch of batch_size x gradient_accumulation_steps x
    # processes prompts per step, each num_generations completions.
    tokenizer = instantiate(cfg.tokenizer)
    def make_dataset(**source):
        return instantiate(cfg.dataset, tokenizer=tokenizer, **source, **({"tools": toolset.schemas} if toolset else {}))
    dataset, validation = run_data(make_dataset, tokenizer, checkpointer, cfg.get("validation"), cfg.seed,
                                   packed_to=None, vocab_size=model.args.vocab_size, say=say)
    longest = max(len(dataset[i]["prompt_ids"]) for i in range(len(dataset))) + rollout.max_completion_length
    if longest > model.args.max_seq_len:
        raise CheckpointError(f"the longest prompt and generation.max_completion_length={rollout.max_completion_length} "
                              f"make {longest} tokens, past the model's max_seq_len={model.args.max_seq_len}; set "
                              "dataset.max_prompt_length or lower generation.max_completion_length")
    template = getattr(_origin(dataset), "prompt_format", None)
    turns = toolset and ToolTurns(toolset, template, tokenizer, rollout.max_completion_length, model.args.max_seq_len,
                                  rollout.max_tool_calling_iterations)
    # vLLM in the policy's place where the config asks for it (refused in one line where it cannot serve this run)
    engine = start_engine(cfg, checkpointer, dataset, longest, lora, dist, say, options.loss_type, model,
                          converter if lora else None)
    stops = stop_token_ids(tokenizer, template) + (turns.stop_ids() if turns else [])
    step = GRPOStep(rollout, options, reward_funcs, reward_weights, tokenizer, stops,
                    conversational=bool(getattr(_origin(dataset), "conversational", False)), device=device, dist=dist,
                    loss_chunk=None if cfg.get("fused_loss", True) else 0,
                    reward_timeout=cfg.get("reward_timeout", REWARD_TIMEOUT_S),
                    engine=engine and engine.engine, correction=engine and engine.options.correction,
                    sample_batch=cfg.batch_size, turns=turns)
    accumulate = cfg.gradient_accumulation_steps
    steps_per_epoch = optimizer_steps_per_epoch(len(dataset), cfg.batch_size, accumulate, dist.world_size,
                                                cfg.max_steps_per_epoch)
    plan = RunPlan(steps_per_epoch, cfg.epochs, cfg.batch_size, accumulate, dist.world_size, cfg.seed,
                   save_every_n_steps=cfg.save_every_n_steps or 0, save_every_epoch=cfg.save_every_epoch)

    optimizer = instantiate(cfg.optimizer, params=trainable)
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer,
                            num_training_steps=plan.total_steps * options.num_iterations)
    position = start.restore(optimizer, scheduler, model, plan, say)
    if position is None:
        return 0
    global_step, start_epoch, start_step = position
    # the sampling generator: seeded by the run's seed, advanced one draw a step, carried in every recipe_state.pt
    sampling = torch.Generator().manual_seed(cfg.seed)
    if start.checkpoint:
        sampling.set_state(start.state["sampling_rng"])

    outputs = RunOutputs(cfg, config, run_dir, start, dist, global_step, sharded=dist.enabled and not lora, say=say)
    metrics = outputs.metrics
    save_merged = "never" if cfg.get("save_adapter_weights_only", False) else cfg.get("save_merged", "final")

    def save(epoch: int, step_in_epoch: int, final: bool, preempted: bool) -> Path:
        check_weights_finite(model, global_step, dist.any)
        recipe = capture_recipe_state(plan, global_step, epoch, step_in_epoch, scheduler, config, dist, outputs.trackers)
        recipe.sampling_rng = sampling.get_state()
        if lora:
            content = adapter_step(model, optimizer, recipe, checkpointer, converter=converter,
                                   base_name=base_model_name(checkpointer.checkpoint_dir),
                                   max_lora_rank=cfg.get("max_lora_rank", 16), layout=checkpointer.adapter_layout(),
                                   original=original, sources=sources, dist=dist, verify=outputs.verify, report=tqdm.write,
                                   merge=save_merged == "every" or (save_merged == "final" and final))
        else:
            content = model_step(model, optimizer, checkpointer, recipe, final, dist, outputs.verify, tqdm.write)
        return outputs.saver.save(global_step, content, final=final or preempted)

    preemption = PreemptionWatch(cfg.preemption_signals)
    progress = TrainingProgress(plan.total_steps, global_step, cfg.get("progress_every_n_steps", 10), shown=main,
                                note=LOSS_NOTE)
    zero_spread = ZeroSpreadWatch()  # every group's rewards equal, step after step: nothing learns (warned once)
    first_step, whole = global_step + 1, None  # whole: (epoch, step in it) of the newest step trained
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=list,
                                  start_batch=first * accumulate, rank=dist.rank, world_size=dist.world_size)
        for step_in_epoch in range(first, plan.steps_per_epoch):
            started = time.perf_counter()
            prompts = [next(batches)[1] for _ in range(accumulate)]
            # Sample and score (the policy as it is), then num_iterations optimizer steps on those samples.
            before = sampling.get_state()
            synced = engine.sync(model, global_step, f"before step {global_step + 1}") if engine else {}
            try:
                rollouts, record = step.rollouts(model, prompts, step_seed(sampling), stop=lambda: preemption.requested)
            except Preempted:  # a signal while it sampled or scored: nothing of it trained; save the last whole step
                sampling.set_state(before)  # so that the resumed run draws this step's seed again
                if global_step > outputs.saved_step:  # the newest step on disk
                    save(*whole, final=False, preempted=True)
                return outputs.stop(global_step, preemption, progress)
            step.fill_fixed_logps(model, rollouts, reference)
            record.update(synced, **step.sampling_metrics(rollouts))  # TRL's sampling/*: the engine against the policy
            global_step, whole = global_step + 1, (epoch, step_in_epoch)
            losses, loss_metrics = [], []
            for iteration in range(options.num_iterations):
                loss_value, logged = step.backward(model, rollouts)
                grad_norm = clip_gradients(trainable, cfg.clip_grad_norm)
                if step_is_finite(global_step, loss_value, grad_norm, model, cfg.get("on_nonfinite", "stop"),
                                  tqdm.write, updated=global_step > first_step or iteration > 0):
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss_value)
                loss_metrics.append(logged)
            tokens = dist.sum(sum(int((r.tokens != tokenizer.pad_id).sum()) for r in rollouts))
            record.update({k: sum(m[k] for m in loss_metrics) / len(loss_metrics) for k in loss_metrics[0]})
            record = dict(step=global_step, epoch=epoch, loss=sum(losses) / len(losses), lr=scheduler.get_last_lr()[0],
                          grad_norm=grad_norm, tokens_per_s=tokens / (time.perf_counter() - started), **record)
            if start.checkpoint and global_step == first_step:
                record["resumed"] = True
            if main:
                metrics.write(**record)
            if validation and validation.due(global_step, plan.total_steps):
                # the held-out prompts sampled by the policy as this step left it (an engine given it first)
                synced = engine.sync(model, global_step, f"after step {global_step}") if engine else {}
                try:
                    held_out = step.evaluate(model, validation.dataset, cfg.seed, stop=lambda: preemption.requested)
                except Preempted:  # the step is whole and saved below; its held-out reward goes unmeasured
                    held_out = {}
                held_out.update(synced)
                record.update(held_out)
                if main and held_out:
                    metrics.write(step=global_step, **held_out)
            # the figures that move (GRPO's loss stays near 0); a step that measured val_reward always gets its line
            progress.update(global_step, always="val_reward" in record, **progress_values(record))
            warning = zero_spread.update(global_step, record["frac_reward_zero_std"])
            if warning and main:
                tqdm.write(warning)

            # Checkpoints at step boundaries only (a step's samples never span a save); a signal on any rank stops
            # every rank here.
            if outputs.step_end(plan, global_step, epoch, step_in_epoch, preemption, save):
                return outputs.stop(global_step, preemption, progress)
    outputs.finish(progress)
    say(outputs.done_line(checkpointer, adapter=bool(lora)))
    return 0


@contextlib.contextmanager
def _disabled(model):
    with adapters_disabled(model):
        yield model


def _origin(dataset):
    """The dataset a validation split's ``Subset`` was cut from."""
    return getattr(dataset, "dataset", dataset)


CHECKS = COMMON | GRPO  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0], example="configs/tiny_grpo.yaml", checks=CHECKS)


if __name__ == "__main__":
    sys.exit(main())
