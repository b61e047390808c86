"""Spike rollback (train.on_spike=rollback): on a loss spike the guard flags, reload the last checkpoint
and go on from the data position the spike left, so the batches read since that checkpoint (the spike's
included) are never trained on; PaLM's remedy (Chowdhery et al. 2022, section 5.1), where skipping
the update of the spike's step alone lets the following steps spike again.

The step counter keeps counting (the data was read; W&B and metrics.jsonl stay monotonic): the steps
rolled back count as skipped, so the schedule is that of the updates really applied, as after any skip.
Everything else (weights, optimizer moments, the guard's loss window, the loss scale, the RNGs) is the
checkpoint's, so a rerun that meets the same spike takes the same path, bit for bit.
"""

from __future__ import annotations

from lmpretrain.errors import TrainingDiverged
from lmpretrain.update.guard import SPIKE


class SpikeRollback:
    """``wanted(skipped)`` says whether a step's skip reason asks for a rollback; ``__call__`` makes it.

    ``states`` are the checkpointer's states (the recipe's dict): ``states["data"]`` wraps the training
    stream (its position is this run's, not the checkpoint's), ``states["rng"]`` the loop's LoopRNG;
    ``averages`` the weight averages (an EMA), ``ramp`` the BatchRamp that says each step's blocks
    (data/batch_ramp.py) of ``ramp.seq_len`` tokens."""

    def __init__(self, train_cfg, checkpointer, *, model, optimizer, states, ramp, averages=None):
        self.enabled = train_cfg.on_spike == "rollback"
        self.max_rollbacks = train_cfg.max_rollbacks
        self.checkpointer, self.model, self.optimizer = checkpointer, model, optimizer
        self.states = {name: obj for name, obj in states.items() if name != "data"}
        self.data, self.rng = states["data"].obj, states["rng"].obj
        self.ramp, self.seq_len = ramp, ramp.seq_len
        self.averages = averages or {}  # the EMA rolls back with the weights

    def wanted(self, skipped: str | None) -> bool:
        return self.enabled and skipped == SPIKE

    def __call__(self, state) -> str:
        """Roll back after the spike of step ``state.step`` (completed); returns the log line.
        Every rank calls it (it loads a checkpoint). Raises TrainingDiverged past train.max_rollbacks."""
        spike = state.step
        if state.rollbacks >= self.max_rollbacks:
            raise TrainingDiverged(
                f"training diverged: the loss spiked at step {spike} after {state.rollbacks} rollbacks "
                f"(train.max_rollbacks={self.max_rollbacks}). Lower optim.lr (or raise optim.warmup_steps), "
                "or look at the data of the spiking steps; then resume from a checkpoint before the first "
                "spike with --run.resume=<output_dir>/checkpoints/step-... and the new values"
            )
        self.checkpointer.wait()  # a background save still being written is of a step before the spike
        path = self.checkpointer.resolve_resume("auto", overwrite=False)  # rank 0's answer on every rank
        if path is None:
            return f"the loss spiked at step {spike} and there is no checkpoint to roll back to: its update is skipped"
        position = self.data.state_dict()
        keep = {k: getattr(state, k) for k in ("step", "tokens_seen", "wandb_run_id", "rollbacks")}
        keep["rolled_back_steps"], keep["rolled_back_tokens"] = (
            state.rolled_back_steps,
            state.rolled_back_tokens,
        )
        self.checkpointer.load(
            path, model=self.model, optimizer=self.optimizer, states=self.states, averages=self.averages
        )
        self.data.load_state_dict(position)  # past the spike: nothing since the checkpoint is read again
        self.rng.start()  # the checkpoint's random numbers from here on
        back_to = state.step
        applied = state.step - state.skipped_steps
        state.step, state.tokens_seen, state.wandb_run_id = (
            keep["step"],
            keep["tokens_seen"],
            keep["wandb_run_id"],
        )
        state.skipped_steps = state.step - applied
        state.rollbacks = keep["rollbacks"] + 1
        n = spike - back_to
        tokens = (self.ramp.blocks_before(spike) - self.ramp.blocks_before(back_to)) * self.seq_len
        state.rolled_back_steps = keep["rolled_back_steps"] + n
        state.rolled_back_tokens = keep["rolled_back_tokens"] + tokens
        return (
            f"the loss spiked at step {spike}: rolled back to {path.name} (step {back_to}); the data of steps "
            f"{back_to + 1}-{spike} ({n} steps, {tokens:,} tokens) is skipped, never trained on "
            f"(rollback {state.rollbacks} of at most {self.max_rollbacks})"
        )
