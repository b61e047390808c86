"""What a run depends on (data, tokenizer, model, world size, batch) and the resume check against a
checkpoint's copy: differences are refused, naming each, unless `run.allow_mismatch` names them.

The data a step sees and the trajectory depend on the global batch, not on how it is split: the blocks
of a step are a function of (data, seed, global batch, streams), and the loss is normalised by the
global batch's target count. So a resume that changes world_size / micro_batch_size /
grad_accum_steps but keeps the global batch needs no flag.
"""

import dataclasses

from lmpretrain.config import fork_sections
from lmpretrain.data.mixture import DATA_CHANGE_FLAG, compare_sources
from lmpretrain.errors import CheckpointMismatchError

# Resuming with a different number of dataloader workers is exact (streams, not workers, hold positions).
SILENT_FINGERPRINT_KEYS = {"num_workers", "data.num_workers"}
# How the global batch is split over processes, micro-batches and accumulation: free while it is unchanged.
LAYOUT_KEYS = ("world_size", "micro_batch_size", "grad_accum_steps")
# The names run.allow_mismatch accepts: the fingerprint's entries (the data's from TrainStream.fingerprint,
# then run_fingerprint's). `model` accepts every model difference; `model.<field>` one of them.
FINGERPRINT_NAMES = (
    "sources",
    "tokenizer",
    "add_bos",
    "epoch_offset",
    "seq_len",
    "num_streams",
    "seed",
    "shuffle",
    "shuffle_window",
    "doc_shuffle_window",
    "data_version",
    "model",
    "global_batch",
    "batch_ramp",
    *LAYOUT_KEYS,
)


def accepted_names(sections=()) -> str:
    """The names run.allow_mismatch accepts, in words (a fork's sections included)."""
    forks = "".join(f", {s}, {s}.<field>" for s in sections)
    return f"{', '.join(FINGERPRINT_NAMES)}, model.<field>{forks}"


def allow_mismatch_problems(names: list[str], sections=()) -> list[str]:
    """Config problems of run.allow_mismatch: every name must be a fingerprint entry (or a fork section's)."""
    prefixes = ("model.", *(f"{s}." for s in sections))
    unknown = [
        n for n in names if n not in FINGERPRINT_NAMES and n not in sections and not n.startswith(prefixes)
    ]
    if not unknown:
        return []
    return [
        f"run.allow_mismatch: unknown name(s) {', '.join(map(repr, unknown))}; it takes the names of the "
        f"resume differences to accept, from: {accepted_names(sections)}"
    ]


def _accepted(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _transforms_change(saved: list, current: list) -> str | None:
    """data.transforms' change in words (names, or the file of one that was edited), or None."""
    if saved == current:
        return None
    names = lambda entries: [t["name"] for t in entries]  # noqa: E731
    if names(saved) != names(current):
        return f"{names(saved) or 'none'} -> {names(current) or 'none'}"
    edited = [t["name"] for t, u in zip(saved, current, strict=True) if t != u]
    return f"the file defining {', '.join(edited)} changed (sha256 differs)"


def section_fingerprint(cfg) -> dict:
    """A fork's own config sections (config.fork_sections) and their fields, each checked at resume like
    ours, except a field declared with `metadata={"resume": "free"}` (a setting that may change)."""
    out = {}
    for name in fork_sections(cfg):
        section = getattr(cfg, name)
        values = dataclasses.asdict(section)
        out[name] = {
            f.name: values[f.name]
            for f in dataclasses.fields(section)
            if f.metadata.get("resume") != "free" and f.name in values
        }
    return out


def run_fingerprint(cfg, world_size: int, data: dict, model_config) -> dict:
    """This run's fingerprint: the data's (sources, tokenizer, layout), the model config, the batch (and its
    ramp, when there is one: the blocks of every step depend on it), a fork's config sections. Taken before
    the model is built, with the dtype the build gives the config."""
    ramp = {"batch_ramp": [[s.until_tokens, s.global_batch] for s in cfg.train.batch_ramp]}
    model = {k: v for k, v in model_config.to_diff_dict().items() if k != "transformers_version"}
    model.setdefault("dtype", cfg.train.param_dtype)
    return {
        **data,
        "world_size": world_size,
        "model": model,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "global_batch": cfg.global_batch(world_size),
        **(ramp if cfg.train.batch_ramp else {}),
        **section_fingerprint(cfg),
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
    saved: dict, current: dict, *, allow_mismatch=(), lr: float | None = None, allow_data_change: bool = False
) -> list[str]:
    """Compare a checkpoint's fingerprint with this run's; raise naming every difference that
    ``allow_mismatch`` (names from FINGERPRINT_NAMES) does not accept, and the exact flag that would.

    Nested dicts are compared key by key (``model.hidden_size``). ``num_workers`` may differ silently;
    so may the layout keys while the global batch is unchanged. When the world size or global batch
    differs, the message says how to rescale the learning rate (give ``lr`` for a number). The train
    sources' mixture (weights, sources added or removed) may change with ``allow_data_change``
    (data/mixture.py); a source whose files or settings changed is a `sources` difference.
    Returns the lines to print (a note on a changed layout, a warning per accepted difference).
    """
    mixture, source_diffs = compare_sources(saved.get("sources", []), current.get("sources", []))
    transforms = _transforms_change(saved.get("transforms", []), current.get("transforms", []))
    old = _flatten({k: v for k, v in saved.items() if k not in ("sources", "transforms")})
    new = _flatten({k: v for k, v in current.items() if k not in ("sources", "transforms")})
    missing = "<absent>"
    changed = [
        key
        for key in sorted(old.keys() | new.keys())
        if key not in SILENT_FINGERPRINT_KEYS
        and key.rsplit(".", 1)[-1] not in SILENT_FINGERPRINT_KEYS
        and old.get(key, missing) != new.get(key, missing)
    ]
    lines = []
    same_batch = saved.get("global_batch") is not None and saved.get("global_batch") == current.get(
        "global_batch"
    )
    if same_batch and any(key in LAYOUT_KEYS for key in changed):
        layout = ", ".join(
            f"{k} {old.get(k, missing)} -> {new.get(k, missing)}" for k in LAYOUT_KEYS if k in changed
        )
        lines.append(
            f"resuming with another layout ({layout}): the global batch stays {current['global_batch']}, "
            f"so the data and the trajectory are unchanged"
        )
        changed = [key for key in changed if key not in LAYOUT_KEYS]
    diffs = {key: f"{key}: {old.get(key, missing)!r} -> {new.get(key, missing)!r}" for key in changed}
    if source_diffs:
        diffs["sources"] = "; ".join(source_diffs)
    refused = [key for key in diffs if not _accepted(key, allow_mismatch)]
    mixture_refused = bool(mixture) and not allow_data_change
    transforms_refused = bool(transforms) and not allow_data_change
    advice = _batch_advice(saved, current, lr)
    if refused or mixture_refused or transforms_refused:
        message = ["the checkpoint was written by a run that differs from this one:"]
        message += [f"  {diffs[key]}" for key in refused]
        if mixture_refused:
            message.append(f"  data mixture: {mixture}")
        if transforms_refused:
            message.append(f"  data.transforms: {transforms}")
        if advice:
            message.append(f"note: {advice}")
        if mixture_refused:
            message.append(
                f"The training mixture may change at resume with {DATA_CHANGE_FLAG} (unchanged sources "
                f"continue from their positions)."
            )
        if transforms_refused:
            message.append(
                f"data.transforms may change at resume with {DATA_CHANGE_FLAG} (each stream goes on from the "
                "documents it would have read next)."
            )
        if refused:
            message.append(
                f"Resume anyway with '--run.allow_mismatch=[{','.join(refused)}]' (accepts these differences "
                f"only), or start fresh in another output_dir (or with --run.resume=never --run.overwrite=true)."
            )
        raise CheckpointMismatchError("\n".join(message))
    lines += [
        f"WARNING: resuming across a fingerprint difference (run.allow_mismatch): {diff}"
        for diff in diffs.values()
    ]
    if transforms:
        lines.append(f"WARNING: resuming with other data.transforms (run.allow_data_change): {transforms}")
    if advice and diffs:
        lines.append(f"WARNING: {advice}")
    return lines
