"""Pretrain a transformers causal LM.

    python -m lmpretrain.launch recipes/pretrain.py configs/smoke.yaml [--section.field=value ...]

This file is the training loop, top to bottom; fork it for a new model or objective. The parts it
calls live in src/lmpretrain/. Per optimizer step: load one global batch, then for each of the
grad_accum_steps micro-batches forward (autocast) and backward a loss normalised by the number of
target tokens in the whole global batch; gradients sync on the last micro-batch; unscale, clip,
step (skipped when the loss or gradient norm is not finite, fp16 overflows included, or the loss
spikes with train.skip_spikes; the schedule then does not advance); log; evaluate every eval.every
steps; checkpoint every checkpoint.every steps or when asked to stop. Under DeepSpeed the
engine does unscale, clip and step inside the last micro-batch's backward; the loop reads the same.
"""

import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from lmpretrain.checkpoint import Checkpointer, PerRank, check_output_dir_writable, export_pretrained
from lmpretrain.config import config_problems, load_config, model_problems, save_config
from lmpretrain.data import TrainStream, heldout_blocks, load_tokenizer, merge_data_states
from lmpretrain.errors import ConfigError, DataError, UserError
from lmpretrain.launch import report_user_error
from lmpretrain.model import (
    LMObjective,
    MixedPrecision,
    build_model,
    build_model_config,
    compile_seconds,
    count_targets,
    make_labels,
    parameter_counts,
    prepare_model,
)
from lmpretrain.observe import (
    ConsoleWarnings,
    Evaluator,
    MFUMeter,
    TaskSuite,
    Tracker,
    format_log_line,
    generate_sample,
    step_bar,
    wandb_log_with,
)
from lmpretrain.run import (
    LoopRNG,
    PreemptionHandler,
    TrainState,
    check_fingerprint,
    check_replicas_identical,
    run_fingerprint,
    run_lock,
    runtime,
)
from lmpretrain.update import (
    UpdateGuard,
    apply_hyperparameters,
    build_optimizer,
    describe_groups,
    describe_implementation,
    hyperparameter_changes,
    learning_rate,
    set_lr,
)


def main(argv: list[str]) -> None:
    with ExitStack() as cleanup:  # everything opened below is closed here, however the run ends
        train(load_config(argv), cleanup)


def train(cfg, cleanup: ExitStack) -> None:
    # ---- Config and processes: every problem is reported before any work starts ---------------
    accelerator, info = runtime.setup(
        cfg.train, cfg.run.threads, cfg.run.seed, wandb_log_with(cfg.logging.wandb_mode)
    )
    cleanup.callback(accelerator.end_training)
    say = accelerator.print
    say(f"[lmpretrain] {info.describe()}")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model_config = build_model_config(cfg.model, tokenizer)
    problems = config_problems(cfg, info.world_size) + model_problems(cfg, model_config, tokenizer)
    if problems:
        raise ConfigError(problems, source=cfg.config_path)
    deepspeed = info.sharding.startswith("deepspeed")
    guard = UpdateGuard(cfg.train, engine_steps=deepspeed)  # skips non-finite (and spiking) updates
    out = Path(cfg.run.output_dir)
    check_output_dir_writable(out)
    cleanup.enter_context(run_lock(out, accelerator))  # a second live run in this output dir is refused
    checkpointer = Checkpointer.from_config(out, accelerator, cfg.checkpoint, announce=say)
    cleanup.callback(checkpointer.close)
    resume_from = checkpointer.resolve_resume(cfg.run.resume, cfg.run.overwrite)

    # ---- Build: model, optimizer, schedule, precision, data -------------------------------------
    B, K, W = cfg.train.micro_batch_size, cfg.train.grad_accum_steps, info.world_size
    global_batch = cfg.global_batch(W)
    model = build_model(model_config, cfg.model.pretrained, cfg.train.param_dtype)
    counts = parameter_counts(model)
    # One forward + loss for training and evaluation (document masking, loss kernel, z-loss); then
    # activation checkpointing and compile, before accelerate wraps the model.
    objective = LMObjective.from_config(cfg, tokenizer.eos_token_id)
    for line in prepare_model(model, objective, cfg.train, accelerator):
        say(f"[lmpretrain] {line}")
    optimizer = build_optimizer(model, cfg.optim, accelerator.device)
    say(f"[lmpretrain] {counts['params_total']:,} parameters; optimizer groups: {describe_groups(optimizer)}")
    say(f"[lmpretrain] {describe_implementation(optimizer, cfg.optim, accelerator.device)}")
    precision = MixedPrecision(
        cfg.train.precision, accelerator.device, cfg.train.loss_scale_init, engine=deepspeed
    )
    # DDP / FSDP / DeepSpeed wrapping. The schedule stays ours (schedule.py sets the param groups' lr
    # before each step from the updates really applied), under every backend.
    model, optimizer = accelerator.prepare(model, optimizer)
    say(f"[lmpretrain] {runtime.describe_wrapping(model, accelerator)}")
    say(f"[lmpretrain] {checkpointer.describe()}")
    if deepspeed:
        say(f"[lmpretrain] {precision.check_engine_weights(model)}")
    train_data = TrainStream(
        cfg.data, tokenizer, blocks_per_step=global_batch, rank=info.rank, world_size=W, seed=cfg.run.seed
    )
    cleanup.callback(train_data.close)
    say(f"[lmpretrain] {train_data.describe()}")
    eval_size = cfg.eval.batches * cfg.eval.batch_size  # blocks
    held_out = heldout_blocks(cfg.data, tokenizer, num_blocks=eval_size, progress=accelerator.is_main_process)
    evaluator = Evaluator(held_out, objective, precision, cfg.eval.batch_size, accelerator, tokenizer)
    # eval.tasks: resolved and loaded now, so a bad task stops the run before its first step
    tasks = TaskSuite.from_config(cfg, tokenizer, accelerator, precision)
    say(f"[lmpretrain] {tasks.describe()}")
    fingerprint = run_fingerprint(cfg, W, train_data.fingerprint(), model_config)  # checked at resume
    meter = MFUMeter.for_run(
        model_config, cfg.data.seq_len, accelerator.device, precision.dtype or torch.float32
    )
    say(f"[lmpretrain] {meter.describe()}")

    # ---- Resume: weights, moments, and every state below (per rank: RNG, data position) ----------
    state, loop_rng = TrainState(), LoopRNG(cfg.run.seed + info.rank)  # replicas drop different units
    states = {
        "train": state,
        "guard": guard,
        "scaler": precision,
        "data": PerRank(train_data, merge=merge_data_states),  # any process count resumes
        "rng": PerRank(loop_rng),
    }
    if resume_from:
        saved = checkpointer.metadata(resume_from)
        for warning in check_fingerprint(
            saved["fingerprint"], fingerprint, allow_mismatch=cfg.run.allow_mismatch, lr=cfg.optim.lr
        ):
            say(f"[lmpretrain] WARNING: {warning}")
        checkpointer.load(resume_from, model=model, optimizer=optimizer, states=states)
        say(f"[lmpretrain] resumed from {resume_from} at step {state.step}")
        if resume_from.parent.parent.resolve() != out.resolve():  # a branch into another output dir
            state.wandb_run_id = None  # (e.g. an anneal) is a W&B run of its own, not the original's
        apply_hyperparameters(optimizer, cfg.optim)  # the current config's, not the checkpoint's
        changes = hyperparameter_changes(saved["config"], cfg, state.step, state.step - state.skipped_steps)
        if changes:
            say(f"[lmpretrain] {changes}")
    if accelerator.is_main_process:  # only now: a refused resume writes nothing
        save_config(cfg, out / "config.yaml")

    tracker = Tracker.for_run(
        accelerator,
        cfg,
        facts={**counts, "runtime": vars(info), **meter.facts()},
        run_id=state.wandb_run_id,
        resume_step=state.step if resume_from else None,
    )
    cleanup.push(lambda exc_type, *_: tracker.finish(exit_code=1 if exc_type else 0))
    state.wandb_run_id = tracker.run_id
    warnings = ConsoleWarnings(say, max_skipped=cfg.train.max_skipped_steps)

    def save_checkpoint():
        meta = {"config": cfg.to_dict(), "fingerprint": fingerprint, "eval_loss": state.eval_loss_now}
        checkpointer.save(state.step, model=model, optimizer=optimizer, states=states, meta=meta)

    def run_eval():
        metrics = evaluator(model)
        state.record_eval(metrics["eval/loss"])
        # eval.tasks when due (eval.tasks_every): lm-evaluation-harness on the live model, every rank
        metrics.update(tasks.run_if_due(model, state.step))
        if cfg.eval.sample_tokens:  # every rank: a sharded model generates on all of them
            text = generate_sample(model, tokenizer, cfg.eval.prompt, cfg.eval.sample_tokens, accelerator)
            tracker.log_samples(state.step, [(cfg.eval.prompt, text)])
        return metrics

    # ---- The loop ---------------------------------------------------------------------------------
    model.train()
    batches = iter(train_data)
    # The loop's random numbers (dropout) start from a known state whatever ran before it: a fresh
    # run seeds it, a resumed run continues the saved one.
    loop_rng.start()
    preemption = cleanup.enter_context(PreemptionHandler())
    progress = step_bar(total=cfg.train.max_steps, initial=state.step, enabled=accelerator.is_main_process)
    cleanup.callback(progress.close)
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    first_step = state.step + 1
    if state.step == 0 and cfg.eval.every:  # the baseline every curve starts from
        tracker.log({**run_eval(), "train/tokens_seen": 0}, step=0)
    while state.step < cfg.train.max_steps:
        t_start = time.perf_counter()
        batch = next(batches)  # 1. load
        t_data = time.perf_counter() - t_start
        # The lr of this update: a function of the updates applied so far and the current config.
        lr = set_lr(optimizer, learning_rate(cfg, state.step - state.skipped_steps))
        input_ids = batch.input_ids.to(accelerator.device, non_blocking=True)
        labels = make_labels(input_ids, tokenizer.eos_token_id if cfg.train.mask_cross_doc_targets else None)
        # Normalise by the target count of the whole global batch (all micro-batches, all ranks);
        # times W because gradients are averaged over ranks, times K because accelerator.backward
        # divides by the accumulation steps.
        n_targets = accelerator.reduce(count_targets(labels), reduction="sum").item()
        if n_targets == 0:
            raise DataError(
                f"step {state.step + 1}: every target of the global batch is ignored (-100), so there is no "
                f"loss to train on; every token starts a document, too short for train.mask_cross_doc_targets=true"
            )
        loss_scale = W * K / n_targets
        loss_sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # cross-entropy, z
        for x, y in zip(input_ids.split(B), labels.split(B), strict=True):
            # Gradients are all-reduced only in the K-th micro-batch's backward (accelerate counts them).
            with accelerator.accumulate(model):
                with precision.autocast():
                    sums = objective(model, x, y)  # 2. forward + fp32 loss, summed over the targets
                accelerator.backward(precision.scale(sums.objective * loss_scale))  # 3. backward, 4. sync
            loss_sums += torch.stack([sums.ce, sums.z]).double()
        assert accelerator.sync_gradients, "the last micro-batch of a step must synchronise gradients"
        train_loss, z_loss = (accelerator.reduce(loss_sums, reduction="sum") / n_targets).tolist()
        precision.unscale_(optimizer)  # real-size grads
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))  # 5. clip
        # A non-finite loss or gradient (or a loss spike) skips the update: no weight or moment changes
        # and the schedule waits. DeepSpeed's engine makes the same non-finite check inside backward.
        skipped = guard.check(train_loss, grad_norm, precision.backs_off_overflows)
        # 6. update (DeepSpeed already stepped, or skipped, in backward: its step() is a no-op)
        stepped = precision.step(optimizer, skip=skipped is not None) and not optimizer.step_was_skipped
        optimizer.zero_grad(set_to_none=True)
        if not stepped:
            state.skipped_steps += 1
        state.step += 1
        guard.record(state.step, train_loss, grad_norm, skipped)  # too many skips in a row: TrainingDiverged
        state.tokens_seen += global_batch * cfg.data.seq_len
        step_time = time.perf_counter() - t_start

        tokens_per_s = global_batch * cfg.data.seq_len / step_time
        metrics = {
            "train/loss": train_loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/clipped": grad_norm > max_norm,
            "train/tokens_seen": state.tokens_seen,
            "train/epoch": batch.epoch,
            "train/skipped_docs": batch.skipped_docs,
            "perf/tokens_per_s": tokens_per_s,
            "perf/step_time_s": step_time,
            "perf/data_wait_frac": t_data / step_time,
            "perf/peak_mem_bytes": runtime.peak_memory_bytes(accelerator.device),
            "train/skipped_steps": state.skipped_steps,
        }
        metrics.update(meter.metrics(tokens_per_s / W))  # perf/mfu
        if cfg.train.z_loss:
            metrics["train/z_loss"] = cfg.train.z_loss * z_loss  # the term added to the loss
        if cfg.train.compile and state.step == first_step:  # compiling happens in the first steps
            metrics["perf/compile_s"] = compile_seconds()
        if precision.scaler:
            metrics["train/loss_scale"] = precision.loss_scale
        warnings.observe(state.step, train_loss, metrics["train/clipped"], skipped)
        final_step = state.step == cfg.train.max_steps
        if final_step or (cfg.eval.every and state.step % cfg.eval.every == 0):  # 7. evaluate
            metrics.update(run_eval())
        tracker.log(metrics, step=state.step)
        progress.update(1)
        progress.set_postfix(
            loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False
        )
        if state.step % cfg.logging.every == 0 and accelerator.is_main_process:
            progress.write(format_log_line(state.step, metrics, cfg.train.max_steps))

        stop = preemption.should_stop(accelerator)
        checkpointer.poll()  # commits a background save once every rank has written it
        # 8. checkpoint. Not periodically while updates are being skipped: a diverging run must not
        # rotate its last good checkpoints out (keep_last) for copies of the weights it stalled on.
        periodic = cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0 and not guard.consecutive
        if stop or final_step or periodic:
            save_checkpoint()
        if stop:
            checkpointer.wait()
            say(f"[lmpretrain] stopped by signal after step {state.step}; resume with the same command")
            return
    progress.close()
    checkpointer.wait()

    # ---- Finish: export model + tokenizer for from_pretrained / pipeline() -------------------------
    train_data.close()
    if info.sharding.startswith(("ddp", "deepspeed")):  # replicas must hold identical parameters
        say(f"[lmpretrain] {check_replicas_identical(model, accelerator)}")
    final = export_pretrained(model, tokenizer, out / "final", accelerator)  # every rank: gathers shards
    sample = generate_sample(model, tokenizer, cfg.eval.prompt, 48, accelerator)
    say(f"[lmpretrain] done: step {state.step}, eval loss {state.eval_loss:.4f}, model saved to {final}")
    say(f"[lmpretrain] sample: {sample!r}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as err:  # a problem to fix, not a bug: one message, no traceback
        runtime.exit_process(report_user_error(err))
    runtime.exit_process(0)  # see exit_process: a clean exit that gloo's threads cannot abort
