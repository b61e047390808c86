"""Tokenizers trained with `tokenizers` (byte-level BPE, or character-level), saved and loaded as transformers
fast tokenizers."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lmpretrain.data.corpus import CORPUS_VERSION, build_once, cache_root, ensure_stdlib_corpus, python_tag
from lmpretrain.errors import TokenizerError
from lmpretrain.progress import announce, bars_enabled

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
BUILTIN_PREFIX = "builtin:"
# name: (vocabulary, trainer). The character-level one is a small-vocabulary shape for benchmarks, where
# the transformer blocks, not the output head, dominate a step.
BUILTIN_TOKENIZERS = {"python-stdlib": (8192, "bpe"), "python-stdlib-chars": (65, "chars")}
_BUILTIN_TRAIN_BYTES = 6_000_000  # enough for a good 8k vocabulary; keeps the first build ~10 s


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (special tokens bos/eos/pad = ids 0/1/2) and `save_pretrained` it to `out_dir`.
    `tokenizers` draws its own progress bars (main process, not under CI)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token
        show_progress=bars_enabled(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # No post-processor: encoding never adds BOS/EOS; the data packer appends EOS itself.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(str(out_dir))
    return fast


def train_char_level(
    texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, lowercase: bool = True
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: bos/eos/pad/unk = ids 0/1/2/3, then the `vocab_size - 4` most frequent
    characters of `texts` (lowercased first with `lowercase`); every other character encodes as unk.
    Saved with `save_pretrained` to `out_dir`. Decoding joins the characters back without spaces."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    if lowercase:  # Python source lowercased fits ~99.9% of its characters in 61 symbols, not ~98%
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each character a word
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD, UNK], show_progress=bars_enabled()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # spaces are characters like any other
    )
    fast.save_pretrained(str(out_dir))
    return fast


def _stdlib_texts(max_bytes: int) -> Iterator[str]:
    """Documents from every train shard in turn (a slice of each), up to `max_bytes` in total."""
    shards = sorted(ensure_stdlib_corpus().glob("train-*.jsonl"))
    per_shard = max_bytes // len(shards)
    for shard in shards:
        used = 0
        with open(shard, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                yield text
                used += len(text)
                if used >= per_shard:
                    break


def ensure_builtin_tokenizer(name: str = "python-stdlib") -> Path:
    """Folder of a builtin tokenizer, trained on the builtin corpus' train split on first use (cached)."""
    if name not in BUILTIN_TOKENIZERS:
        raise TokenizerError(
            f"unknown builtin tokenizer {name!r}; available: "
            + ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_TOKENIZERS)
        )
    vocab, kind = BUILTIN_TOKENIZERS[name]
    # Named after the corpus version too: a rebuilt corpus must not meet a tokenizer trained on the old one.
    final = cache_root() / f"tokenizer-{name}-{python_tag()}-c{CORPUS_VERSION}-v{vocab}"

    def build(tmp: Path) -> None:
        ensure_stdlib_corpus()
        announce(
            f"training the builtin tokenizer {name} ({vocab} tokens) on {_BUILTIN_TRAIN_BYTES / 1e6:.0f} MB of "
            f"its corpus (once, ~10 s; cached in {cache_root()})"
        )
        train = train_bpe if kind == "bpe" else train_char_level
        train(_stdlib_texts(_BUILTIN_TRAIN_BYTES), vocab, tmp)

    return build_once(final, build)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder, a Hub id, or `builtin:python-stdlib`; it must have an EOS token."""
    if spec.startswith(BUILTIN_PREFIX):
        path = str(ensure_builtin_tokenizer(spec[len(BUILTIN_PREFIX) :]))
    else:
        if spec.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(spec)):
            raise TokenizerError(
                f"data.tokenizer: folder {spec!r} does not exist; train one with scripts/train_tokenizer.py "
                "or use builtin:python-stdlib"
            )
        path = os.path.expanduser(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        reason = (
            f"{type(e).__name__}: {e}".strip().splitlines()[0].rstrip(".")
        )  # its first line says what failed
        if os.path.isdir(path):
            raise TokenizerError(
                f"data.tokenizer: folder {spec!r} holds no loadable tokenizer (tokenizer.json + "
                f"tokenizer_config.json, as save_pretrained writes them): {reason}"
            ) from e
        raise TokenizerError(
            f"data.tokenizer: {spec!r} is neither a local folder (there is no directory {os.path.abspath(path)}) "
            f"nor a Hub id that loads: {reason}. Point data.tokenizer at a tokenizer folder (train one with "
            "scripts/train_tokenizer.py) or use builtin:python-stdlib"
        ) from e
    if tokenizer.eos_token_id is None:
        raise TokenizerError(
            f"tokenizer {spec!r} has no EOS token; the data packer needs one to separate documents. "
            "Set `eos_token` in its tokenizer_config.json or train one with scripts/train_tokenizer.py"
        )
    return tokenizer


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short content hash of a tokenizer (vocabulary, merges, normalisation, special ids), for fingerprints."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    payload += json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
