"""The loop's own counters, saved in every checkpoint."""

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed (skipped fp16 overflow steps included: they consumed data)."""
    tokens_seen: int = 0
    skipped_steps: int = 0
    eval_loss: float | None = None
    best_eval_loss: float | None = None
    wandb_run_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "TrainState":
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})
