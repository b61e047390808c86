"""A data fork as one new file (docs/forking.md): keep documents of at least 200 characters, lower-cased.

    accelerate launch recipes/pretrain.py configs/smoke.yaml \
        "--data.transforms=[examples/data_transforms.py:keep_long_lowercased]"

`data.transforms` names it; the run applies it to every training and held-out document, counts the
documents it drops (`train/filtered_docs`) and refuses a resume once it (or this file) has changed.
"""

MIN_CHARS = 200


def keep_long_lowercased(text: str, source: str) -> str | None:
    """The document lower-cased, or None (dropped) when it is shorter than MIN_CHARS characters."""
    if len(text) < MIN_CHARS:
        return None
    return text.lower()


def keep_long(text: str, source: str) -> str | None:
    """The document as it is, or None when it is shorter than MIN_CHARS characters (the same filter, no case change)."""
    return text if len(text) >= MIN_CHARS else None
