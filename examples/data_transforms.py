"""A data fork as one new file (docs/forking.md): a filter, and an exact-dedup transform that keeps state.

    accelerate launch recipes/pretrain.py configs/smoke.yaml \
        "--data.transforms=[examples/data_transforms.py:keep_long_lowercased, examples/data_transforms.py:ExactDedup]"

`data.transforms` names them; the run applies them to every training and held-out document of its text
sources, counts the documents they drop (`train/filtered_docs`) and refuses a resume once they (or this
file) have changed. A function must be pure; a class keeps state, which the run saves per stream with the
data position, so a resume is exact.
"""

import hashlib

MIN_CHARS = 200


def keep_long_lowercased(text: str, source: str) -> str | None:
    """The document lower-cased, or None (dropped) when it is shorter than MIN_CHARS characters."""
    if len(text) < MIN_CHARS:
        return None
    return text.lower()


def keep_long(text: str, source: str) -> str | None:
    """The document as it is, or None when it is shorter than MIN_CHARS characters (the same filter, no case change)."""
    return text if len(text) >= MIN_CHARS else None


class ExactDedup:
    """Drops a document whose text this stream has already seen.

    One instance per stream, which sees only its stream's share of the documents: a copy that falls to
    another stream is kept there (deduplicate offline, `scripts/prepare_data.py --dedup exact`, to remove
    every copy). The state is 8 bytes of hash per kept document; a stream that reads its share a second time
    (a second epoch) finds every document seen and drops all of them, so use it for runs within one epoch.
    """

    def __init__(self):
        self.seen: set[str] = set()

    def __call__(self, text: str, source: str) -> str | None:
        key = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        if key in self.seen:
            return None
        self.seen.add(key)
        return text

    def state_dict(self) -> dict:
        return {"seen": sorted(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = set(state["seen"])
