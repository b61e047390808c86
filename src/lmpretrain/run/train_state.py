"""The loop's own counters, saved in every checkpoint."""

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed (skipped steps included: they consumed data)."""
    tokens_seen: int = 0
    skipped_steps: int = 0
    eval_loss: float | None = None
    eval_step: int | None = None
    """The step `eval_loss` was measured at."""
    best_eval_loss: float | None = None
    wandb_run_id: str | None = None
    rollbacks: int = 0
    """Spike rollbacks so far (train.on_spike=rollback); they outlast the checkpoints they reload."""
    rolled_back_steps: int = 0
    """Steps whose data a rollback skipped (counted in skipped_steps too)."""
    rolled_back_tokens: int = 0
    """The tokens of those steps (a train.batch_ramp gives steps of different sizes)."""

    def count_step(self, stepped: bool, tokens: int) -> None:
        """One optimizer step done: its global batch's `tokens` read, its update applied or skipped."""
        self.skipped_steps += not stepped
        self.step += 1
        self.tokens_seen += tokens

    def record_eval(self, loss: float) -> None:
        """Note an eval run at the current step (and the best loss so far)."""
        self.eval_loss, self.eval_step = loss, self.step
        if self.best_eval_loss is None or loss < self.best_eval_loss:
            self.best_eval_loss = loss

    @property
    def eval_loss_now(self) -> float | None:
        """The eval loss if an eval ran at this very step, else None (a stale loss must not pick "best")."""
        return self.eval_loss if self.eval_step == self.step else None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Set the counters in place (the checkpointer restores the object the loop holds)."""
        for f in fields(self):
            if f.name in saved:
                setattr(self, f.name, saved[f.name])
