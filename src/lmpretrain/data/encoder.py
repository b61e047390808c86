"""Text -> token ids for packing, with the document-boundary contract: each document is [BOS] ids EOS.

Text is encoded with the tokenizer's special tokens treated as ordinary text (a document containing the
string "<|eos|>" never yields the EOS id), and every batch is checked, so anything that derives document
boundaries from input_ids (document masking, mask_cross_doc_targets) sees exactly the real ones.
"""

from __future__ import annotations

import numpy as np

from lmpretrain.errors import DataError


def resolve_add_bos(tokenizer, add_bos: bool | None) -> bool:
    """data.add_bos: null means on when the tokenizer has a BOS token distinct from EOS."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    distinct = bos is not None and bos != eos
    if add_bos is None:
        return distinct
    if add_bos and not distinct:
        raise DataError(
            f"data.add_bos=true but tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has "
            + ("no BOS token" if bos is None else f"BOS = EOS (id {eos})")
            + "; set data.add_bos=false (or null) or use a tokenizer with a distinct BOS"
        )
    return add_bos


class Encoder:
    """Batched tokenization of document text (never producing BOS/EOS ids) and framing with BOS/EOS."""

    def __init__(self, tokenizer, add_bos: bool | None = None):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise DataError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no EOS token; the packer "
                "needs one between documents. Set eos_token or train one with scripts/train_tokenizer.py"
            )
        self.bos_id = tokenizer.bos_token_id if resolve_add_bos(tokenizer, add_bos) else None
        self.boundary_ids = np.array(
            sorted({i for i in (self.eos_id, tokenizer.bos_token_id) if i is not None}), dtype=np.int64
        )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            # A private copy: the run's tokenizer (prompts, samples) keeps its usual behaviour.
            self.backend = Tokenizer.from_str(backend.to_str())
            self.backend.encode_special_tokens = True
        else:
            self.backend = None

    @property
    def add_bos(self) -> bool:
        return self.bos_id is not None

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens."""
        if not texts:
            return []
        if self.backend is not None:
            ids = [
                np.asarray(e.ids, dtype=np.int64)
                for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)
            ]
        else:
            out = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ids = [np.asarray(x, dtype=np.int64) for x in out]
        self.check(ids, "text")
        return ids

    def check(self, ids: list[np.ndarray], what: str) -> None:
        """Refuse document tokens that equal a boundary id (BOS/EOS): boundaries must be exact."""
        if ids and np.isin(np.concatenate(ids), self.boundary_ids).any():
            raise DataError(
                f"{what} encodes to the tokenizer's BOS/EOS ids {self.boundary_ids.tolist()}, so document "
                "boundaries in input_ids would be wrong; "
                + (
                    "re-run scripts/prepare_data.py with this version (it encodes special-token strings as text)"
                    if what != "text"
                    else "this tokenizer maps ordinary text to a special id: use another tokenizer"
                )
            )

    def frame(self, ids: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
        """[BOS if bos and add_bos] + ids + [EOS if eos], as int32."""
        head = int(bos and self.bos_id is not None)
        out = np.empty(len(ids) + head + int(eos), dtype=np.int32)
        if head:
            out[0] = self.bos_id
        out[head : head + len(ids)] = ids
        if eos:
            out[-1] = self.eos_id
        return out

    def describe(self) -> str:
        bos = f"BOS (id {self.bos_id}) before and " if self.add_bos else "no BOS; "
        return f"{bos}EOS (id {self.eos_id}) after each document"
