"""Pretrain a transformers causal LM.

    accelerate launch recipes/pretrain.py configs/smoke.yaml [--section.field=value ...]

This file is the training loop, top to bottom; fork it for a new model or objective (docs/forking.md).
The parts it calls live in src/lmpretrain/, one wing per section below. Per optimizer step: load one
global batch; `train_step` runs forward (autocast) and backward of each of the grad_accum_steps
micro-batches on the objective's terms normalised by the number of target tokens in the whole global
batch (gradients sync on the last micro-batch), then unscales, clips and steps, unless the guard skips the
update (a loss or gradient norm that is not finite, fp16 overflows included, or a loss spike with
train.skip_spikes; the schedule then waits); with train.ema_decay the weights are folded into their moving
average; then log, evaluate every eval.every steps (the average too), checkpoint every
checkpoint.every steps or when asked to stop. Under DeepSpeed the engine unscales, clips and steps inside
the last micro-batch's backward; the loop reads the same.
"""

import math
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from lmpretrain.checkpoint import Checkpointer, PerRank, check_output_dir_writable, export_pretrained
from lmpretrain.config import load_config, save_config
from lmpretrain.data import (
    BatchRamp,
    TrainStream,
    heldout_blocks,
    load_tokenizer,
    merge_data_states,
    step_counters,
)
from lmpretrain.model import (
    ExpertLoad,
    LMObjective,
    MixedPrecision,
    ModelInit,
    build_model,
    count_targets,
    import_model_modules,
    make_labels,
    mup,
    parameter_counts,
    precompute_fp8_scales,
    prepare_model,
    refuse_unfound_embedding,
    weighted_sum,
)
from lmpretrain.observe import (
    ConsoleWarnings,
    Evaluator,
    MFUMeter,
    StepBytes,
    StepLog,
    StepMetrics,
    StepProfiler,
    TaskSuite,
    Tracker,
    evaluate_all,
    generate_sample,
    wandb_log_with,
)
from lmpretrain.plan.preflight import check_plan_fits
from lmpretrain.preflight import preflight
from lmpretrain.run import (
    LoopRNG,
    PreemptionHandler,
    StallWatch,
    StragglerWatch,
    TrainState,
    check_replicas_identical,
    check_resume,
    expert_parallel,
    halve_on_oom,
    local_main_first,
    on_rank_zero,
    provenance,
    read_step,
    resumed,
    run_fingerprint,
    run_lock,
    runtime,
)
from lmpretrain.update import (
    SpikeRollback,
    UpdateGuard,
    WeightAverage,
    apply_hyperparameters,
    build_optimizer,
    describe_groups,
    describe_implementation,
    learning_rate,
    set_lr,
)


def main(argv: list[str], sections: dict | None = None, objective=LMObjective, transforms=()) -> None:
    """A fork passes its own config sections ({"name": dataclass}), objective class and data transforms
    (functions, run before data.transforms) (docs/forking.md)."""
    cfg = load_config(argv, sections=sections, transforms=transforms)
    with ExitStack() as cleanup:  # everything opened below is closed here, however the run ends
        train(cfg, cleanup, objective, recipe=Path(sys.argv[0]))


def train_step(
    model, optimizer, objective, input_ids, labels, *, accelerator, precision, guard, max_norm, host
):
    """One optimizer step over a global batch's rows on this rank; returns the step's numbers.

    Each term is normalised by the target count of the whole global batch (all micro-batches, all ranks),
    times W because gradients are averaged over ranks and times K because accelerator.backward divides by
    the accumulation steps. The count stays on the device: the step reads the device once, at the end,
    together with `host`: numbers of this rank (name -> (value, "sum" | "min" | "max")) to combine over ranks.
    """
    W, K = accelerator.num_processes, accelerator.gradient_accumulation_steps
    n_targets = accelerator.reduce(count_targets(labels), reduction="sum")
    loss_scale = W * K / n_targets.clamp_min(1)
    sums: dict[str, torch.Tensor] = {}  # name -> (sum, count) over this rank's micro-batches
    for x, y in zip(input_ids.chunk(K), labels.chunk(K), strict=True):
        # Gradients are all-reduced only in the K-th micro-batch's backward (accelerate counts them).
        with accelerator.accumulate(model):
            with precision.autocast():
                terms = objective(model, x, y)  # 2. forward + fp32 loss terms, summed over the targets
            accelerator.backward(precision.scale(weighted_sum(terms) * loss_scale))  # 3. backward, 4. sync
        for name, term in terms.items():
            sums[name] = sums.get(name, 0) + torch.stack([term.sum.detach(), term.count]).double()
    assert accelerator.sync_gradients, "the last micro-batch of a step must synchronise gradients"
    precision.unscale_(optimizer)  # real-size grads
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)  # 5. clip
    # The step's one device->host read: every rank's terms and host numbers, the target count, the norm.
    means, grad_norm, shared = read_step(accelerator, sums, host, n_targets, grad_norm)
    # A non-finite loss or gradient (or a loss spike) skips the update: no weight or moment changes and
    # the schedule waits. DeepSpeed's engine makes the same non-finite check inside backward.
    skipped = guard.check(means["loss"], grad_norm, precision.backs_off_overflows)
    # 6. update (DeepSpeed already stepped, or skipped, in backward: its step() is a no-op)
    stepped = precision.step(optimizer, skip=skipped is not None) and not optimizer.step_was_skipped
    optimizer.zero_grad(set_to_none=True)
    return {"terms": means, "grad_norm": grad_norm, "skipped": skipped, "stepped": stepped, "host": shared}


def train(cfg, cleanup: ExitStack, objective_class=LMObjective, recipe: Path = Path(__file__)) -> None:
    # ---- Pre-flight: processes, config, model config, data; every problem before any work ----------
    accelerator, info = runtime.setup_from_config(cfg, log_with=wandb_log_with(cfg.logging.wandb_mode))
    cleanup.callback(accelerator.end_training)
    say = runtime.announcer(accelerator)  # say(*lines): `[lmpretrain] line` on the main process
    say(*info.startup_lines())  # the processes; which restart this is (launch --max_restarts)
    # what comes from the Hub is fetched once per machine (then read from its cache), or once per job
    tokenizer = local_main_first(lambda: load_tokenizer(cfg.data.tokenizer), accelerator)
    import_model_modules(cfg.model)  # a fork's own model classes register with the Auto classes
    model_config = preflight(cfg, info.layout, tokenizer)  # one error lists every problem
    check_plan_fits(cfg, info, accelerator, say)  # CUDA: a run whose planned peak cannot fit stops here
    W = info.world_size
    ramp = BatchRamp.from_config(cfg.train, cfg.global_batch(W), cfg.data.seq_len)  # blocks of each step
    # Data is opened before the model: a missing file fails in seconds, not after a model load.
    train_data = cleanup.enter_context(TrainStream.from_config(cfg, tokenizer, ramp, info.rank, W))
    say(train_data.describe())
    eval_size = cfg.eval.batches * cfg.eval.batch_size  # blocks, framed (BOS or not) as the training stream
    held_out = on_rank_zero(  # rank 0 reads the held-out rows, every rank gets the blocks
        lambda: heldout_blocks(
            cfg.data, tokenizer, eval_size, train_data.add_bos, accelerator.is_main_process
        )
    )
    deepspeed, fsdp2 = info.layout.kind == "deepspeed", info.layout.kind == "fsdp2"
    precision = MixedPrecision.from_config(cfg.train, accelerator.device, engine=deepspeed)
    # eval.tasks: resolved and loaded now, so a bad task stops the run before the model is built
    tasks = TaskSuite.from_config(cfg, tokenizer, accelerator, precision)
    say(tasks.describe())
    guard = UpdateGuard(cfg.train, engine_steps=deepspeed)  # skips non-finite (and spiking) updates
    out = Path(cfg.run.output_dir)
    check_output_dir_writable(out)
    cleanup.enter_context(run_lock(out, accelerator))  # a second live run in this output dir is refused
    checkpointer = cleanup.enter_context(Checkpointer.from_config(out, accelerator, cfg.checkpoint))
    resume_from = checkpointer.resolve_resume(cfg.run.resume, cfg.run.overwrite)
    fingerprint = run_fingerprint(cfg, W, train_data.fingerprint(), model_config)  # checked at resume
    saved = checkpointer.metadata(resume_from) if resume_from else None
    say(*check_resume(saved, fingerprint, cfg))  # before the model is built: a refused resume writes nothing

    # ---- Build: model and its objective, speed switches, optimizer, precision, wrapping ------------
    objective = objective_class.from_config(cfg, tokenizer.eos_token_id)

    def make_model():  # the model, μP and the objective's modules: what the initial weights come from
        model = build_model(
            model_config, cfg.model.pretrained, cfg.train.param_dtype, cfg.model.trust_remote_code
        )
        refuse_unfound_embedding(model, cfg, info.layout)  # FSDP2 and μP find it by get_input_embeddings()
        lines = []
        if cfg.model.mup:  # μP by width (and depth): init, logits, attention, residual branches, lr per group
            m = cfg.model.mup
            fixed = "head_dim" in cfg.model.overrides
            lines.append(mup.apply(model, m.base_width, fixed, m.depth, m.base_depth).describe())
        lines += objective.install(model)  # the loss runs inside the model's forward (FSDP2 needs it)
        return model, lines

    # FSDP2: built on meta, each rank fills its own shards; DDP/DeepSpeed: rank 0 alone builds it on the host
    init = ModelInit.for_run(cfg, info.layout, accelerator.process_index)
    model, lines = init.build(make_model)
    say(*lines)
    counts = parameter_counts(model)  # after install: a fork's auxiliary modules train too
    say(*prepare_model(model, cfg.train, accelerator))  # attention, experts, checkpointing, compile
    say(*expert_parallel.apply(model, info.layout, accelerator))  # model.ep_size
    optimizer = build_optimizer(model, cfg.optim, accelerator.device, info.layout)
    say(f"{counts['params_total']:,} parameters; optimizer groups: {describe_groups(optimizer)}")
    say(describe_implementation(optimizer, cfg.optim, accelerator.device, W, fsdp2, info.layout.replicas))
    # DDP / FSDP / DeepSpeed wrapping. The schedule stays ours (set_lr before each step from the
    # updates really applied), under every backend.
    say(
        *init.materialise(model, optimizer, accelerator)
    )  # FSDP2: sharded here, this rank's shards filled; DDP/DeepSpeed: rank 0's buffers taken
    say(*runtime.keep_buffers_loadable(model, accelerator))  # e.g. a DeepSeek-V3 router's bias under FSDP2
    model, optimizer = accelerator.prepare(model, optimizer)
    say(runtime.describe_wrapping(model, accelerator))
    say(*precompute_fp8_scales(model, optimizer, cfg.train.fp8))  # FSDP2's float8 all-gather: after each step
    # a mixture of experts: tokens per expert (moe/load_*); with train.moe_balance=bias, the routers' biases
    expert_load = ExpertLoad.for_run(accelerator.unwrap_model(model), cfg, accelerator)
    if expert_load:
        say(expert_load.describe())
    ema = WeightAverage.from_config(cfg.train, accelerator.unwrap_model(model))  # sharded like the weights
    averages = {"ema": ema} if ema else {}
    if ema:
        say(ema.describe())
    say(*precision.check_prepared(model, optimizer, cfg.train, info.layout))  # FSDP2's, DeepSpeed's
    say(checkpointer.describe())
    evaluator = Evaluator(held_out, objective, precision, cfg.eval.batch_size, accelerator, tokenizer, out)
    made_by = provenance(recipe, cfg)  # which recipe and fork files, commit and packages trained this run
    meter = MFUMeter.for_run(  # a fork's auxiliary modules count in the FLOPs too
        model_config, cfg, accelerator.device, precision.compute_dtype,
        objective.extra_matmul_params(accelerator.unwrap_model(model)),
    )  # fmt: skip
    say(meter.describe())

    # ---- Resume: weights, moments, and every state below (per rank: RNG, data position) ----------
    state, loop_rng = TrainState(), LoopRNG(cfg.run.seed + info.rank)  # replicas drop different units
    # a rank that stops is named after run.stall_report_s, and when a collective times out (ending the run)
    cleanup.enter_context(StallWatch.from_config(cfg.run, info.rank, W, lambda: state.step))
    states = {
        "train": state,
        "guard": guard,
        "scaler": precision,
        "data": PerRank(train_data, merge=merge_data_states, reads=train_data.saved_ranks),  # any world size
        "rng": PerRank(loop_rng),
        **({"expert_load": expert_load} if expert_load else {}),  # the loads' logging window
    }
    rollback = SpikeRollback(  # train.on_spike=rollback: a spike reloads the last checkpoint
        cfg.train, checkpointer, model=model, optimizer=optimizer, states=states, ramp=ramp, averages=averages
    )
    if resume_from:
        checkpointer.load(resume_from, model=model, optimizer=optimizer, states=states, averages=averages)
        apply_hyperparameters(optimizer, cfg.optim)  # the current config's, not the checkpoint's
        # what changed since the checkpoint; a branch into another output dir is a W&B run of its own
        say(*resumed(resume_from, saved, cfg, fingerprint, state, ramp, ema))
    batches = train_data.start()  # reads the first step now: a saved position that no longer fits fails here
    if accelerator.is_main_process:  # only now: a refused resume writes nothing
        save_config(cfg, out / "config.yaml", provenance=made_by)

    tracker = Tracker.for_run(
        accelerator, cfg, facts={**counts, "runtime": info.facts(), **meter.facts(), "provenance": made_by},
        run_id=state.wandb_run_id, resume_step=state.step if resume_from else None,
    )  # fmt: skip
    cleanup.enter_context(tracker)  # finishes the W&B run, as failed when the run ends on an exception
    state.wandb_run_id = tracker.run_id
    warnings = ConsoleWarnings(say, max_skipped=cfg.train.max_skipped_steps)
    straggler = StragglerWatch(cfg.run.straggler_factor, W, say)  # names a rank the others wait for

    def run_eval():  # the held-out set, eval.tasks when due, the same of the EMA
        metrics = evaluate_all(model, state.step, evaluator, tasks, ema)
        state.record_eval(metrics["eval/loss"])
        if cfg.eval.sample_tokens:  # every rank: a sharded model generates on all of them
            text = generate_sample(model, tokenizer, cfg.eval.prompt, cfg.eval.sample_tokens, accelerator)
            tracker.log_samples(state.step, [(cfg.eval.prompt, text)])
        return metrics

    # ---- The loop ---------------------------------------------------------------------------------
    model.train()
    loop_rng.start()  # dropout's random numbers: seeded for a fresh run, the saved state for a resumed one
    preemption = cleanup.enter_context(PreemptionHandler())
    profiler = cleanup.enter_context(  # train.profile_steps; on CUDA an out-of-memory snapshot
        StepProfiler(cfg.train.profile_steps, out / "profile", accelerator.device, info.rank, say)
    )
    log_step = cleanup.enter_context(StepLog.for_run(tracker, cfg, state.step, accelerator.is_main_process))
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    step_metrics = StepMetrics(
        accelerator, meter, precision, max_norm, restarts=info.restarts, compiled=cfg.train.compile
    )
    step_bytes = StepBytes(  # comm/*, memory/* of one step
        cfg.logging.bytes_at_step, model, optimizer, say, held=ema.average if ema else ()
    )
    if state.step == 0 and cfg.eval.every:  # the baseline every curve starts from
        tracker.log({**run_eval(), "train/tokens_seen": 0}, step=0)
    while state.step < cfg.train.max_steps:
        profiler.step(state.step + 1)
        t_start = time.perf_counter()
        batch = next(batches)  # 1. load
        t_data = time.perf_counter() - t_start
        # The lr of this update: a function of the updates applied so far and the current config.
        lr = set_lr(optimizer, learning_rate(cfg, state.step - state.skipped_steps, ramp))
        if ramp.stages:  # this step's micro-batches
            runtime.set_grad_accum(accelerator, len(batch.input_ids) // cfg.train.micro_batch_size)
        input_ids = batch.input_ids.to(accelerator.device, non_blocking=True)
        labels = make_labels(input_ids, tokenizer.eos_token_id if cfg.train.mask_cross_doc_targets else None)
        host = {"stop": (preemption.received, "max"), **step_counters(batch), **straggler.host(t_data)}
        with step_bytes.at(state.step + 1):  # 2.-6. forward, backward, sync, clip, update (OOM: halved)
            step = halve_on_oom(
                train_step, model, optimizer, objective, input_ids, labels, train=cfg.train, say=say,
                accelerator=accelerator, precision=precision, guard=guard, max_norm=max_norm, host=host,
            )  # fmt: skip
        state.count_step(step["stepped"], tokens=batch.input_ids.numel() * W)
        straggler.observe(state.step, step["host"])  # takes its times out of the step's host numbers
        if ema and step["stepped"]:
            ema.update(state.step)
        if expert_load:  # this step's tokens per expert (over the ranks: they move the biases)
            expert_load.step_done(step["stepped"])
        # Too many skipped updates in a row raise TrainingDiverged.
        guard.record(state.step, step["terms"]["loss"], step["grad_norm"], step["skipped"])
        if rollback.wanted(step["skipped"]):  # back to the last checkpoint, the data since it skipped
            say(rollback(state))
            batches = iter(train_data)
        metrics = step_metrics(step, batch, state, lr, t_start, t_data) | step_bytes.metrics()
        warnings.observe(state.step, metrics["train/loss"], metrics["train/clipped"], step["skipped"])
        final_step = state.step == cfg.train.max_steps
        if expert_load:
            metrics.update(expert_load.metrics(state.step, final_step))  # every logging.every steps
        if final_step or (cfg.eval.every and state.step % cfg.eval.every == 0):  # 7. evaluate
            metrics.update(run_eval())
        log_step(state.step, metrics, terms=step["terms"])  # W&B + metrics.jsonl, the step bar, the console
        stop = bool(step["host"]["stop"])  # any rank signalled: every rank saves and stops here
        checkpointer.poll()  # commits a background save once every rank has written it
        # 8. checkpoint every checkpoint.every steps and at the end, unless a diverging run's guard says not
        if stop or guard.checkpoint_due(state.step, cfg.checkpoint.every, final_step):
            meta = {"config": cfg.to_dict(), "fingerprint": fingerprint, "eval_loss": state.eval_loss_now}
            meta["provenance"] = made_by
            checkpointer.save(
                state.step, model=model, optimizer=optimizer, states=states, meta=meta, averages=averages
            )
        if stop:
            checkpointer.wait()
            say(f"stopped by signal after step {state.step}; resume with the same command")
            return
    log_step.close()
    checkpointer.wait()
    guard.check_finished(state.step, state.eval_loss)  # skipping at the end or a non-finite eval: exit 2

    # ---- Finish: export model + tokenizer for from_pretrained / pipeline() -------------------------
    train_data.close()
    if info.layout.replicated:  # replicas must hold identical parameters
        say(check_replicas_identical(model, accelerator))
    final = export_pretrained(model, tokenizer, out / "final", accelerator)  # every rank: gathers shards
    sample = generate_sample(model, tokenizer, cfg.eval.prompt, 48, accelerator)
    if ema:
        with ema.swapped(model):
            say(f"EMA saved to {export_pretrained(model, tokenizer, out / 'final-ema', accelerator)}")
    say(f"done: step {state.step}, eval loss {state.eval_loss:.4f}, model saved to {final}")
    say(f"sample: {sample!r}")


def cli(sections: dict | None = None, objective=LMObjective, transforms=()) -> None:
    """The command line: main(sys.argv[1:]), then exit the process: 0, or a user error's one message and
    exit code 2 (a fork's entry point calls this too)."""
    runtime.exit_after(lambda: main(sys.argv[1:], sections, objective, transforms))


if __name__ == "__main__":
    cli()
