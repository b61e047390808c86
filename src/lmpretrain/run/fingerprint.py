"""What a run depends on (data, tokenizer, model, world size, batch) and the resume check against a
checkpoint's copy: differences are refused, naming each, unless explicitly allowed."""

from lmpretrain.errors import CheckpointMismatchError

OVERRIDE_FLAG = "--run.allow_mismatch=true"
# Resuming with a different number of dataloader workers is exact (streams, not workers, hold positions).
SILENT_FINGERPRINT_KEYS = {"num_workers", "data.num_workers"}


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def run_fingerprint(cfg, world_size: int, data: dict, model_config) -> dict:
    """This run's fingerprint: the data's (sources, tokenizer, layout), the model config, the batch."""
    return {
        **data,
        "world_size": world_size,
        "model": {k: v for k, v in model_config.to_diff_dict().items() if k != "transformers_version"},
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "global_batch": cfg.global_batch(world_size),
    }


def _batch_advice(saved: dict, current: dict, lr: float | None) -> str | None:
    old_w, new_w = saved.get("world_size"), current.get("world_size")
    old_b, new_b = saved.get("global_batch"), current.get("global_batch")
    if old_b is not None and new_b is not None and old_b != new_b:
        factor = new_b / old_b
        suggestion = f"optim.lr x {factor:g}" if lr is None else f"lr {lr:.4g} -> {lr * factor:.4g}"
        return (
            f"the global batch changes {old_b} -> {new_b} (world size {old_w} -> {new_w}): with linear "
            f"scaling the learning rate should change by x{factor:g} ({suggestion})"
        )
    if old_w != new_w:
        if old_b is not None and old_b == new_b:
            return (
                f"world size changes {old_w} -> {new_w} but the global batch stays {old_b}: "
                f"no learning-rate rescaling is needed"
            )
        return (
            f"world size changes {old_w} -> {new_w}: if the global batch changes, rescale the learning "
            f"rate linearly (lr x new_batch / old_batch)"
        )
    return None


def check_fingerprint(
    saved: dict,
    current: dict,
    *,
    allow_mismatch: bool,
    lr: float | None = None,
    allow_data_change: bool = False,
) -> list[str]:
    """Compare a checkpoint's fingerprint with this run's; raise naming every difference unless allowed.

    Nested dicts are compared key by key (``model.hidden_size``). ``num_workers`` may differ silently.
    When the world size or global batch differs, the message says how to rescale the learning rate
    (give ``lr`` for a number).
    Returns the warnings to print when ``allow_mismatch`` is set (empty when nothing differs).
    The train sources' mixture (weights, sources added or removed) may differ with ``allow_data_change``
    (data/mixture.py); a source whose files or settings changed is a difference like any other.
    """
    # Imported here: lmpretrain.data imports lmpretrain.run (through observe).
    from lmpretrain.data.mixture import DATA_CHANGE_FLAG, compare_sources

    mixture, diffs = compare_sources(saved.get("sources", []), current.get("sources", []))
    if mixture and not allow_data_change:
        diffs.append(f"data mixture: {mixture}")
    old = _flatten({k: v for k, v in saved.items() if k != "sources"})
    new = _flatten({k: v for k, v in current.items() if k != "sources"})
    missing = "<absent>"
    diffs += [
        f"{key}: {old.get(key, missing)!r} -> {new.get(key, missing)!r}"
        for key in sorted(old.keys() | new.keys())
        if key not in SILENT_FINGERPRINT_KEYS
        and key.rsplit(".", 1)[-1] not in SILENT_FINGERPRINT_KEYS
        and old.get(key, missing) != new.get(key, missing)
    ]
    if not diffs:
        return []
    advice = _batch_advice(saved, current, lr)
    if not allow_mismatch:
        lines = ["the checkpoint was written by a run that differs from this one:"]
        lines += [f"  {d}" for d in diffs]
        if advice:
            lines.append(f"note: {advice}")
        if mixture and not allow_data_change:
            others = "; the other differences need the flag below" if len(diffs) > 1 else ""
            lines.append(
                f"The training mixture may change at resume with {DATA_CHANGE_FLAG} (unchanged sources "
                f"continue from their positions){others}."
            )
        lines.append(
            f"Resume anyway with {OVERRIDE_FLAG}, or start fresh in another output_dir "
            f"(or with --run.resume=never --run.overwrite=true)."
        )
        raise CheckpointMismatchError("\n".join(lines))
    warnings = [f"resuming across a fingerprint difference ({OVERRIDE_FLAG}): {d}" for d in diffs]
    if advice:
        warnings.append(advice)
    return warnings
