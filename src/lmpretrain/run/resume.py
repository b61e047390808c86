"""The resume's checks and notes around the checkpoint load: the fingerprint check before the model is
built (a refused resume costs seconds and writes nothing), and, once the checkpoint has loaded, what
changed since it was written."""

from __future__ import annotations

from pathlib import Path

from lmpretrain.data.mixture import mixture_change
from lmpretrain.run.fingerprint import check_fingerprint
from lmpretrain.update.schedule import hyperparameter_changes


def check_resume(saved: dict | None, fingerprint: dict, cfg) -> list[str]:
    """Check this run's fingerprint against the checkpoint's metadata `saved` (None: a fresh run, nothing
    to check); raises CheckpointMismatchError, else returns the lines to print (run/fingerprint.py)."""
    if not saved:
        return []
    return check_fingerprint(
        saved["fingerprint"],
        fingerprint,
        allow_mismatch=cfg.run.allow_mismatch,
        lr=cfg.optim.lr,
        allow_data_change=cfg.run.allow_data_change,
    )


def resumed(path: Path, saved: dict, cfg, fingerprint: dict, state, ramp, ema=None) -> list[str]:
    """After `path` has loaded into `state` (the TrainState): the lines that say what the run goes on
    from and what changed since (the EMA absent from the checkpoint, hyper-parameters and the lr, the data
    mixture). A resume into another output dir (e.g. an anneal) is a W&B run of its own: `state` forgets
    the original's run id."""
    lines = [f"resumed from {path} at step {state.step}"]
    if ema and "ema" not in saved.get("averages", []):
        lines.append(f"the checkpoint holds no EMA: it starts from the weights of step {state.step}")
    if path.parent.parent.resolve() != Path(cfg.run.output_dir).resolve():
        state.wandb_run_id = None
    for note in (
        hyperparameter_changes(saved["config"], cfg, state.step, state.step - state.skipped_steps, ramp),
        mixture_change(saved["fingerprint"], fingerprint, state.step),
    ):
        if note:
            lines.append(note)
    return lines
