"""Training mixtures that change at resume (annealing on a new mix): a train source's weight may change and
sources may be added or removed when a run resumes with `run.allow_data_change`.

A source is known by its key (its label: builtin name, Hub id or file patterns, never its weight) and keeps
an id for its lifetime in a run, which seeds its piece order, so adding or removing another source leaves
its order and position alone. At a change every stream restarts from its *frontier* — each unchanged
source's position after the last document window the stream read — so a source goes on with the documents
it would have read next; blocks already packed from the old mixture but not yet trained on (at most one
block window per stream) are dropped, never replayed. Added sources start at their beginning. Under the
global shuffle a source's id keys its permutations, and its (epoch, index) moves with its key.
"""

from __future__ import annotations

import copy
import re
from dataclasses import fields

from lmpretrain.data.cursor import SourceCursor
from lmpretrain.data.sources import SourceSpec

DATA_CHANGE_FLAG = "--run.allow_data_change=true"


def source_keys(specs: list[SourceSpec]) -> list[str]:
    """Each source's key: its label, numbered when two sources share one."""
    keys: list[str] = []
    for spec in specs:
        key, n = spec.label, 2
        while key in keys:
            key, n = f"{spec.label}#{n}", n + 1
        keys.append(key)
    return keys


def metric_names(specs: list[SourceSpec]) -> list[str]:
    """Names for `data/<name>/tokens`: the builtin name or Hub id with its split, or the file patterns,
    with every character W&B would read as structure replaced by `_`; unique within the run."""
    names: list[str] = []
    for spec in specs:
        if spec.name or spec.hub:
            raw = f"{spec.name or spec.hub}" + (f"_{spec.hub_config}" if spec.hub_config else "")
            raw += f"_{spec.split}"
        else:
            raw = "+".join(p.removeprefix("./") for p in spec.files or [])
        name = re.sub(r"[^A-Za-z0-9._+-]+", "_", raw).strip("_")[-80:] or "source"
        unique, n = name, 2
        while unique in names:
            unique, n = f"{name}_{n}", n + 1
        names.append(unique)
    return names


def mixture(specs: list[SourceSpec], ids: list[int]) -> list[dict]:
    """The data state's record of the mixture: each source's key, id and weight, in config order."""
    return [
        {"source": key, "id": i, "weight": spec.weight}
        for key, i, spec in zip(source_keys(specs), ids, specs, strict=True)
    ]


def follow(saved: list[dict], specs: list[SourceSpec]) -> tuple[list[int], bool]:
    """(ids of this run's sources, whether the mixture differs from the saved one): a source the
    checkpoint knows keeps its id, a new one takes the next unused id."""
    known = {m["source"]: int(m["id"]) for m in saved}
    ids, next_id = [], max(known.values(), default=-1) + 1
    for key in source_keys(specs):
        if key in known:
            ids.append(known[key])
        else:
            ids.append(next_id)
            next_id += 1
    return ids, mixture(specs, ids) != saved


def restart_global(state: dict, saved: list[dict], keys: list[str]) -> dict:
    """The global shuffle's state saved under the `saved` mixture, moved to this run's sources (`keys`):
    a kept source goes on with its (epoch, index) in its own permutations, an added one starts at (0, 0);
    the draw counter goes on (the global order packs nothing ahead, so nothing is dropped)."""
    old_keys = [m["source"] for m in saved]
    position = dict(zip(old_keys, state["sources"], strict=True))
    tokens = dict(zip(old_keys, state.get("tokens") or [0] * len(old_keys), strict=True))
    return {
        **state,
        "sources": [list(position.get(k, [0, 0])) for k in keys],
        "tokens": [tokens.get(k, 0) for k in keys],
    }


def restart_at_frontier(state: dict, saved: list[dict], keys: list[str]) -> dict:
    """A stream's state saved under the `saved` mixture, moved to this run's sources (`keys`): it starts
    a fresh block window at its frontier; unchanged sources keep their positions and token counts. A
    global-shuffle state (it has `draws`) goes to `restart_global`."""
    if "draws" in state:
        return restart_global(state, saved, keys)
    old_keys = [m["source"] for m in saved]
    frontier = state.get("frontier") or {"start": state["docs"]["start"], "window": state["docs"]["window"]}
    start = frontier["start"]
    position = dict(zip(old_keys, start["sources"], strict=True))
    tokens = dict(zip(old_keys, state.get("tokens", [0] * len(old_keys)), strict=True))
    open_key = old_keys[start["open"]] if start["open"] >= 0 else None  # a source in mid-document
    new_start = {
        "mix": start["mix"],
        "open": keys.index(open_key) if open_key in keys else -1,
        "sources": [copy.deepcopy(position.get(k, SourceCursor.initial_position())) for k in keys],
        **(
            {"transforms": copy.deepcopy(start["transforms"])} if "transforms" in start else {}
        ),  # their state
    }
    return {
        "window": int(state["window"]) + 1,
        "emitted": 0,
        "docs": {"start": new_start, "window": frontier["window"], "unit": 0, "offset": 0},
        "frontier": {"start": copy.deepcopy(new_start), "window": frontier["window"]},
        "tokens": [tokens.get(k, 0) for k in keys],
    }


def _spec(entry: dict) -> SourceSpec:
    names = {f.name for f in fields(SourceSpec)}
    return SourceSpec(**{k: v for k, v in entry.items() if k in names})


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def compare_sources(saved: list, current: list) -> tuple[str | None, list[str]]:
    """Compare the train sources of two data fingerprints: (the mixture change in words, or None; the
    differences that are not a mixture change: a source whose settings or files changed)."""
    if not all(isinstance(x, dict) for x in [*saved, *current]):  # not per-source fingerprints
        return None, [] if saved == current else [f"sources: {saved!r} -> {current!r}"]
    old = dict(zip(source_keys([_spec(x) for x in saved]), saved, strict=True))
    new = dict(zip(source_keys([_spec(x) for x in current]), current, strict=True))
    total_old = sum(x["weight"] for x in saved) or 1.0
    total_new = sum(x["weight"] for x in current) or 1.0
    changes, other = [], []
    for key, entry in new.items():
        share = f"{entry['weight'] / total_new:.0%}"
        if key not in old:
            changes.append(f"{key} added (weight {entry['weight']:g}, {share})")
            continue
        was, now = _flat({**old[key], "weight": None}), _flat({**entry, "weight": None})
        other += [
            f"sources[{key}].{f}: {was.get(f)!r} -> {now.get(f)!r}"
            for f in sorted(was.keys() | now.keys())
            if was.get(f) != now.get(f)
        ]
        if old[key]["weight"] != entry["weight"]:
            changes.append(
                f"{key} weight {old[key]['weight']:g} -> {entry['weight']:g} "
                f"({old[key]['weight'] / total_old:.0%} -> {share})"
            )
    changes += [f"{key} removed" for key in old if key not in new]
    if not changes and list(old) != list(new):
        changes.append(f"sources reordered {list(old)} -> {list(new)}")
    return "; ".join(changes) or None, other


def mixture_change(saved_fingerprint: dict, fingerprint: dict, step: int) -> str | None:
    """One line on how the training mixture changed since the checkpoint, to print at resume; None when not."""
    change, _ = compare_sources(saved_fingerprint.get("sources", []), fingerprint.get("sources", []))
    if change is None:
        return None
    return (
        f"resumed with a new data mixture from step {step}: {change} (shares of documents drawn); unchanged "
        "sources continue from their positions, blocks packed from the old mixture and not yet trained on "
        "are dropped"
    )
