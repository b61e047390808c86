"""Tokenize a source into token files (data/token_files.py) with a datatrove pipeline, on one machine or a cluster.

The launcher (`plan_prepare`) opens the source once — files expanded, a Hub dataset listed and its parquet
footers read, the tokenizer checked — and writes the file list to `files.txt`, so no task lists anything
again. Every task then runs

    reader  datatrove's JsonlReader / ParquetReader over its files (paths_file lines rank, rank + tasks, ...),
            or `SourceReader` (ours, over data/readers.py) for what datatrove has no reader for: text files
            (one document per file or separated), JSON arrays, Hub datasets without parquet files
    writer  `ShardWriter` (ours): tokenizes with the run's Encoder (special-token strings encoded as text,
            BOS/EOS framing) and writes one shard per input piece — a file, or a piece of our reader — named
            by the piece's number in the source, never by the task, so any task count writes the same bytes

and one final task (`FinishFolder`, a dependent job on a cluster) writes the header last and renames the
folder into place. All of it lives in a hidden `.NAME.prepare/` beside the output (shards, datatrove's logs
and completion markers); an interrupted prepare leaves no tokens.json, and running the same command again
resumes it (datatrove skips the tasks it marked complete).

`data.transforms` (`--transform`, pure functions only) run in our reader, which then reads documents whole;
their names and file hashes go into the header, where a training run finds them (data/transforms.py).
`--dedup exact` and `--dedup minhash` run datatrove's own deduplication before tokenizing: its signature
stage over the same reader, its finding stage(s), then its filter in front of the writer (stages, in order,
one executor each); the header records the documents it removed. Exact dedup keeps the first copy in source
order (datatrove's document priority: the earlier piece), so the bytes stay the same for any --tasks.

On this machine (the local executor) datatrove's log lines are silenced and a progress bar shows each
stage; its logs stay in the work folder while it exists. (The dedup stages that find duplicates still draw
datatrove's own short bars, "Initializing pq", "Reading dup files".)
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.readers.base import BaseReader
from datatrove.utils.word_tokenizers import WordTokenizer

from lmpretrain.data.encoder import Encoder
from lmpretrain.data.readers import Bad, is_url
from lmpretrain.data.sources import OLD_TOKENS_META, SourceSpec, as_spec, is_old_token_cache, open_source
from lmpretrain.data.token_files import token_dtype
from lmpretrain.data.token_layouts import HEADER, VERSION
from lmpretrain.errors import DataError

PREPARE_PIECES = 64  # our reader cuts a source into (about) this many pieces, whatever the task count
EXECUTORS = ("local", "slurm", "ray")
DEDUP_METHODS = ("exact", "minhash")
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # documents tokenized per call
MAX_PRIORITY = 65535  # datatrove's exact-dedup priorities are 1 .. 65535


def usable(doc: Document) -> bool:
    """A document to tokenize: not the stand-in of a bad record or of one a transform dropped."""
    meta = doc.metadata
    return not (meta.get("bad") or meta.get("dropped")) and isinstance(doc.text, (str, list))


class SourceReader(BaseReader):
    """A datatrove reader over lmpretrain's own readers: the pieces rank, rank + world_size, ... of a source,
    each document (or part of one, for long text; whole with transforms or dedup) a Document tagged with its
    piece number; `transforms` (data.transforms, pure functions) applied as a training run applies them. A bad
    record and a document a transform dropped come as empty stand-ins (`usable` is false), counted by the
    writer."""

    name = "lmpretrain source"

    def __init__(self, spec: SourceSpec, transforms=None, whole_documents: bool = False):
        super().__init__()
        self.spec, self.transforms, self.whole_documents = spec, transforms, whole_documents

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        source = open_source(self.spec, self.transforms)
        source.whole_documents = source.whole_documents or self.whole_documents
        chain = self.transforms.chain() if self.transforms else None
        for n, piece in enumerate(source.pieces(PREPARE_PIECES)):
            if n % world_size != rank:
                continue
            at = None
            for k, item in enumerate(source.read(piece, None)):
                meta, start = {"shard": n}, at
                at = item.after if item.after is not None else at
                if isinstance(item, Bad):
                    self.stat_update("bad_records")
                    yield Document(text="", id=f"{n}/{k}", metadata={**meta, "bad": True})
                    continue
                text = item.value
                if chain is not None:
                    text = chain(text, source.label, functools.partial(source.locate, piece, start))
                if text is None:
                    self.stat_update("dropped")
                    yield Document(text="", id=f"{n}/{k}", metadata={**meta, "dropped": True})
                else:
                    yield Document(
                        text=text, id=f"{n}/{k}", metadata={**meta, "bos": item.bos, "eos": item.eos}
                    )


class DocumentCount(PipelineStep):
    """Passes documents on and writes how many were usable to `folder/{name}-{rank}.json` (what the header's
    dedup record is computed from)."""

    name = "lmpretrain document count"
    type = "🔢 - TOKENIZER"

    def __init__(self, folder: str, name: str):
        super().__init__()
        self.folder, self.label = folder, name

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        count = 0
        for doc in data or ():
            count += usable(doc)
            yield doc
        os.makedirs(self.folder, exist_ok=True)
        Path(self.folder, f"{self.label}-{rank:05d}.json").write_text(json.dumps(count))


class PieceOrder:
    """Exact dedup's document priority: documents of earlier pieces first (datatrove keeps the copy of
    highest priority, and within one piece the earlier one), so the first copy in source order is kept."""

    def __init__(self, files: list[str] | None):
        self.shard_of = {f: n for n, f in enumerate(files or [])}

    def __call__(self, doc: Document) -> int:
        n = doc.metadata.get("shard")
        n = self.shard_of[doc.metadata["file_path"]] if n is None else n
        return max(1, MAX_PRIORITY - n)


def dedup_content(doc: Document) -> bytes:
    """What exact dedup hashes: the text (a stand-in's unique id: stand-ins are never duplicates)."""
    return (doc.text if usable(doc) else f"\0{doc.id}").encode()


class SplitWords(WordTokenizer):
    """Words at whitespace, for minhash's shingles (datatrove's language tokenizers need spaCy or NLTK)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans, at = [], 0
        for line in text.splitlines(keepends=True):
            if line.strip():
                spans.append((at, at + len(line)))
            at += len(line)
        return spans


class _Shard:
    """One shard being written: shard-N.bin (framed ids), then at close shard-N.idx and shard-N.json."""

    def __init__(self, folder: str, name: str, encoder: Encoder, dtype: np.dtype):
        self.path = os.path.join(folder, name)
        self.name, self.encoder, self.dtype = name, encoder, dtype
        self.out = open(self.path + ".bin", "wb")
        self.starts: list[int] = []
        self.written = self.skipped = self.filtered = 0
        self.max_id = -1
        self.batch: list[tuple[str, bool, bool]] = []
        self.chars = 0

    def add(self, doc: Document) -> None:
        meta = doc.metadata
        if not usable(
            doc
        ):  # a bad record, a field that is not text (datatrove's readers pass it on), dropped
            self.filtered += bool(meta.get("dropped"))
            self.skipped += not meta.get("dropped")
            return
        self.batch.append((doc.text, meta.get("bos", True), meta.get("eos", True)))
        self.chars += len(doc.text)
        if len(self.batch) >= _BATCH_DOCS or self.chars >= _BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        encoded = iter(self.encoder([t for t, _, _ in self.batch if isinstance(t, str)]))
        lists = [np.asarray(t, dtype=np.int64) for t, _, _ in self.batch if not isinstance(t, str)]
        self.encoder.check(lists, "the old token cache")  # ids of the retired parquet cache, converted
        lists = iter(lists)
        for text, bos, eos in self.batch:
            ids = next(encoded) if isinstance(text, str) else next(lists)
            if bos or not self.starts:
                self.starts.append(self.written)
            framed = self.encoder.frame(ids, bos, eos)
            if len(framed):
                self.max_id = max(self.max_id, int(framed.max()))
            self.out.write(framed.astype(self.dtype).tobytes())
            self.written += len(framed)
        self.batch, self.chars = [], 0

    def close(self) -> dict:
        self.flush()
        self.out.close()
        np.array([*self.starts, self.written], dtype="<u8").tofile(self.path + ".idx")
        counts = {"name": self.name, "tokens": self.written, "documents": len(self.starts)}
        counts.update(skipped=self.skipped, filtered=self.filtered, max_id=self.max_id)
        Path(self.path + ".json").write_text(json.dumps(counts))  # last: the shard is whole
        return counts


class ShardWriter(PipelineStep):
    """Tokenize documents into one token-file shard per input piece (`metadata["shard"]`, or the number of
    the document's file in the launcher's list)."""

    name = "lmpretrain token shards"
    type = "🔢 - TOKENIZER"

    def __init__(self, folder: str, tokenizer, add_bos: bool, files: list[str] | None, digits: int):
        super().__init__()
        self.folder, self.tokenizer, self.add_bos, self.digits = folder, tokenizer, add_bos, digits
        self.shard_of = {f: n for n, f in enumerate(files or [])}  # datatrove's metadata["file_path"] -> n

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread per task
        encoder = Encoder(self.tokenizer, self.add_bos)
        dtype = token_dtype(len(self.tokenizer))
        shard, done = None, set()
        for doc in data or ():
            n = doc.metadata.get("shard")
            n = self.shard_of[doc.metadata["file_path"]] if n is None else n
            if shard is None or n != shard[0]:
                if shard is not None:
                    self._close(*shard)
                if n in done:  # a piece is read in one go; if not, its shard would be overwritten
                    raise RuntimeError(f"piece {n} came back after another piece")
                done.add(n)
                shard = (n, _Shard(self.folder, f"shard-{n:0{self.digits}d}", encoder, dtype))
            with self.track_time():
                shard[1].add(doc)
        if shard is not None:
            self._close(*shard)
        return
        yield  # a generator step that ends the pipeline

    def _close(self, n: int, shard: _Shard) -> None:
        counts = shard.close()
        self.stat_update("shards")
        self.stat_update("documents", value=counts["documents"])
        self.stat_update("tokens", value=counts["tokens"])


class FinishFolder(PipelineStep):
    """The one final task: the header from every shard's counts, written last, then the folder renamed to `out`
    (an existing `out`, with --overwrite, goes only once the new folder is complete)."""

    name = "lmpretrain token-file header"
    type = "🔢 - TOKENIZER"

    def __init__(self, folder: str, out: str, header: dict, counts: str | None = None):
        super().__init__()
        self.folder, self.out, self.header, self.counts = folder, out, header, counts

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        folder, out = Path(self.folder), Path(self.out)
        shards = [json.loads(p.read_text()) for p in sorted(folder.glob("shard-*.json"))]
        documents = sum(s["documents"] for s in shards)
        for s in shards:
            (folder / f"{s['name']}.json").unlink()
            if not s["documents"]:  # nothing usable in that piece
                (folder / f"{s['name']}.bin").unlink()
                (folder / f"{s['name']}.idx").unlink()
        shards = [s for s in shards if s["documents"]]
        if not shards:
            raise DataError(f"source {self.header['source']}: no usable document to tokenize")
        header = {
            **self.header,
            "max_id": max(s["max_id"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "skipped": sum(s["skipped"] for s in shards),
            "filtered": sum(s["filtered"] for s in shards),
            "shards": [{k: s[k] for k in ("name", "tokens", "documents")} for s in shards],
        }
        if self.counts is not None:  # dedup: the usable documents before it, and how many it removed
            before = sum(json.loads(p.read_text()) for p in Path(self.counts).glob("before-*.json"))
            header["dedup"] = {**header["dedup"], "documents": before, "removed": before - documents}
        (folder / HEADER).write_text(json.dumps(header, indent=2))
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            folder.rename(out)
            shutil.rmtree(old)
        else:
            folder.rename(out)
        return
        yield


@dataclass
class Stage:
    """One executor's work: its pipeline and how many tasks run it (None: the prepare's --tasks)."""

    name: str  # its logs' folder, and what the progress bar says
    pipeline: list
    tasks: int | None = None


@dataclass
class Prepare:
    """A planned prepare: its stages, in order (the last writes the header), and where they write."""

    out: Path
    work: Path  # .NAME.prepare/ beside out: shards/, files.txt, logs/, job.json, dedup/
    stages: list[Stage]
    summary: str
    pieces: int  # shards the tokenize stage writes (at most): the progress bar's total
    dedup: str | None = None


def _root_and_relative(files: list[str]) -> tuple[str, list[str]]:
    """A folder (local, or an fsspec URL such as hf://datasets/org/name@commit) and the files relative to it."""
    if is_url(files[0]):
        root = os.path.dirname(files[0])
        while not all(f.startswith(root + "/") for f in files):
            root = os.path.dirname(root)
    else:
        files = [os.path.abspath(f) for f in files]
        root = os.path.commonpath([os.path.dirname(f) for f in files])
    return root, [f[len(root) :].lstrip("/") for f in files]


def _old_cache_files(folder: str, tokenizer) -> list[str]:
    """The shards of a retired parquet token cache, which must come from this tokenizer."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    meta = json.loads((Path(os.path.expanduser(folder)) / OLD_TOKENS_META).read_text())
    if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
        raise DataError(
            f"{folder} was tokenized with {meta.get('tokenizer')!r} (hash {meta.get('tokenizer_hash')}), not "
            "--tokenizer: give the tokenizer it was made with"
        )
    files = sorted(str(p) for p in Path(os.path.expanduser(folder)).glob("tokens-*.parquet"))
    if not files:
        raise DataError(f"{folder}: {OLD_TOKENS_META} but no tokens-*.parquet files; prepare from the text")
    return files


def _old_cache_row(self, data: dict, path: str, id_in_file: int) -> dict:
    """A row of the retired cache: ids without BOS/EOS, and whether they start / end their document."""
    meta = {"bos": bool(data["doc_start"]), "eos": bool(data["doc_end"])}
    return {"text": data[self.text_key], "id": f"{path}/{id_in_file}", "metadata": meta}


def plan_prepare(
    spec: SourceSpec | dict,
    tokenizer,
    out,
    *,
    add_bos: bool | None = None,
    overwrite: bool = False,
    tasks: int = 1,
    transforms=None,
    dedup: str | None = None,
) -> Prepare:
    """Open the source and check everything a task needs, before any work; the work folder is kept when it
    belongs to the same command (a resume), else made afresh. `transforms` (data.transforms, pure functions)
    are applied by our reader, the one that applies them in training too; `dedup` ("exact" or "minhash")
    runs datatrove's deduplication before tokenizing."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    spec = as_spec(spec)
    out = Path(os.path.expanduser(str(out))).absolute()
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; choose another --out or pass --overwrite")
    if dedup is not None and dedup not in DEDUP_METHODS:
        raise DataError(f"--dedup {dedup!r} is not one of {DEDUP_METHODS}")
    if transforms and transforms.stateful:
        raise DataError(
            f"--transform {', '.join(transforms.stateful)} keeps state (a class): what it drops would depend on "
            "how the tasks split the source. prepare_data applies pure functions; deduplicate with --dedup exact "
            "or --dedup minhash (datatrove's, over the whole source), or keep the class in data.transforms of a "
            "run on the text source"
        )
    old = spec.files[0] if spec.files and len(spec.files) == 1 and is_old_token_cache(spec.files[0]) else None
    if old is None:
        source = open_source(spec)  # the one listing (and, for parquet, footer read) of the source
        if source.format == "tokens":
            raise DataError(f"source {spec.label} is token files already; train on it directly")
        files, label = source.files, source.label
    else:
        if dedup:
            raise DataError(f"{old}: the retired token cache is converted as it is (no --dedup)")
        files, label = _old_cache_files(old, tokenizer), spec.label
    encoder = Encoder(tokenizer, add_bos)  # checks EOS/BOS before any work
    work = out.parent / f".{out.name}.prepare"
    job = {
        "source": asdict(spec),
        "listing": files,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "add_bos": encoder.add_bos,
        "tasks": tasks,
        "version": VERSION,
        "transforms": transforms.fingerprint() if transforms else [],
        "dedup": dedup,
    }
    job_file = work / "job.json"
    if not (job_file.is_file() and json.loads(job_file.read_text()) == job):
        shutil.rmtree(work, ignore_errors=True)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job, indent=2))
    shards = str(work / "shards")
    json_lines = old is None and source.format == "json" and not any(source.json_arrays)
    if old is None and (transforms or source.is_hub or not (json_lines or source.format == "parquet")):
        reader = SourceReader(spec, transforms, whole_documents=dedup is not None)
        pieces, files = len(source.pieces(PREPARE_PIECES)), None
        summary = f"{source.summary(PREPARE_PIECES)}, read by lmpretrain's readers"
    else:
        root, relative = _root_and_relative(files)
        (work / "files.txt").write_text("".join(f + "\n" for f in relative))
        paths, pieces = str(work / "files.txt"), len(files)
        if old is not None:
            reader = ParquetReader(root, paths_file=paths, text_key="input_ids", adapter=_old_cache_row)
            summary = f"{old}: the retired parquet token cache, {len(files)} files, converted"
        elif json_lines:
            reader = JsonlReader(root, paths_file=paths, text_key=source.field, compression="infer")
        else:
            reader = ParquetReader(root, paths_file=paths, text_key=source.field, read_metadata=False)
        files = [reader.data_folder.resolve_paths(f) for f in relative]
        if old is None:
            summary = f"{source.summary(1)}, read by datatrove's {type(reader).__name__} (one shard per file)"
    header = {
        "version": VERSION,
        "dtype": token_dtype(len(tokenizer)).str,
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": len(tokenizer),
        "add_bos": encoder.add_bos,
        "bos_id": encoder.bos_id,
        "eos_id": encoder.eos_id,
        "source": label,
        "transforms": transforms.fingerprint() if transforms else [],
        **({"dedup": {"method": dedup}} if dedup else {}),
    }
    digits = max(5, len(str(pieces - 1)))  # shard names sort in piece order
    writer = ShardWriter(shards, tokenizer, encoder.add_bos, files, digits)
    counts = str(work / "counts") if dedup else None
    finish = Stage("header", [FinishFolder(shards, str(out), header, counts)], tasks=1)
    if dedup is None:
        stages = [Stage("tokenize", [reader, writer])]
    else:
        stages = _dedup_stages(dedup, work / "dedup", reader, writer, counts, files)
        summary += f"; deduplicated ({dedup}) by datatrove"
    return Prepare(out, work, [*stages, finish], summary, pieces, dedup)


def _dedup_stages(method: str, folder: Path, reader, writer, counts: str, files) -> list[Stage]:
    """datatrove's deduplication: signatures over the reader's documents (counted), the stage(s) that find
    the duplicates, then the same reader through its filter into the writer."""
    from datatrove.pipeline import dedup

    count = DocumentCount(counts, "before")
    if method == "exact":
        config = dedup.ExactDedupConfig(content_getter=dedup_content, document_priority=PieceOrder(files))
        return [
            Stage(
                "dedup signatures", [reader, count, dedup.ExactDedupSignature(str(folder / "sigs"), config)]
            ),
            Stage(
                "dedup find", [dedup.ExactFindDedups(str(folder / "sigs"), str(folder / "dups"), config)], 1
            ),
            Stage("tokenize", [reader, dedup.ExactDedupFilter(str(folder / "dups"), config), writer]),
        ]
    from datatrove.utils.hashing import HashConfig

    # sha1: datatrove's minhash hashes its shingles as str, which xxhash 4 refuses ("must be encoded")
    config = dedup.MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))
    signature = dedup.MinhashDedupSignature(str(folder / "sigs"), config=config, language=SplitWords())
    buckets = dedup.MinhashDedupBuckets(str(folder / "sigs"), str(folder / "buckets"), config=config)
    cluster = dedup.MinhashDedupCluster(str(folder / "buckets"), str(folder / "remove"), config=config)
    return [
        Stage("dedup signatures", [reader, count, signature]),
        Stage("dedup buckets", [buckets], config.num_buckets),  # one task per bucket
        Stage("dedup clusters", [cluster], 1),
        Stage("tokenize", [reader, dedup.MinhashDedupFilter(str(folder / "remove")), writer]),
    ]


def build_executors(prep: Prepare, executor: str = "local", tasks: int = 1, workers: int = -1, **cluster):
    """One datatrove executor per stage, each depending on the one before (the last writes the header);
    `tasks` tasks for the stages that read the source, `workers` of them at a time. `cluster`: slurm's
    partition, time, cpus_per_task, mem_per_cpu_gb, sbatch_args (and venv_path), ray's cpus_per_task,
    mem_per_cpu_gb."""
    logs = prep.work / "logs"
    executors = []
    for stage in prep.stages:
        n = stage.tasks or tasks
        where = {"logging_dir": str(logs / stage.name.replace(" ", "-")), "tasks": n}
        depends = executors[-1] if executors else None
        if executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            # fork: tasks start with the launcher's imports (datatrove's default, forkserver, re-imports per task)
            run = LocalPipelineExecutor(
                stage.pipeline, workers=min(workers if workers > 0 else n, n), start_method="fork",
                depends=depends, **where,
            )  # fmt: skip
        elif executor == "slurm":
            from datatrove.executor import SlurmPipelineExecutor

            options = dict(cluster, job_name=f"prepare-{prep.out.name}-{stage.name.replace(' ', '-')}")
            if n == 1:
                options["cpus_per_task"] = 1
            run = SlurmPipelineExecutor(stage.pipeline, workers=workers, depends=depends, **where, **options)
        elif executor == "ray":
            from datatrove.executor import RayPipelineExecutor

            options = dict(cluster, **({"cpus_per_task": 1} if n == 1 else {}))
            run = RayPipelineExecutor(stage.pipeline, workers=workers, depends=depends, **where, **options)
        else:
            raise DataError(f"--executor {executor!r} is not one of {EXECUTORS}")
        executors.append(run)
    return executors


def run_prepare(
    prep: Prepare, executor: str = "local", tasks: int = 1, workers: int = -1, **cluster
) -> dict | None:
    """Run the prepare (local, ray) or submit it (slurm); returns the header once the folder is in place here.
    Locally the stages run one after the other under a progress bar, datatrove's own log lines silenced."""
    executors = build_executors(prep, executor, tasks, workers, **cluster)
    if executor == "local":
        with _quiet_datatrove():
            for stage, run in zip(prep.stages, executors, strict=True):
                if stage is prep.stages[-1]:  # the header: a moment, no bar
                    run.run()
                    continue
                with _stage_bar(prep, stage, run):
                    run.run()
    else:
        executors[-1].run()  # launches the ones it depends on
    if not (prep.out / HEADER).is_file():  # submitted: the final job writes it
        return None
    shutil.rmtree(prep.work)
    return json.loads((prep.out / HEADER).read_text())


# datatrove's dedup steps that draw tqdm bars of their own inside a task ("Initializing pq...", "Reading dup
# files", and unnamed ones), nested under ours with cursor-up codes
_DATATROVE_BARS = ("datatrove.pipeline.dedup.exact_dedup", "datatrove.pipeline.dedup.minhash")


@contextmanager
def _quiet_datatrove():
    """datatrove logs each task's start, pipeline and stats at INFO to the terminal (~40 lines for the
    quickstart's corpus): off while the stages run here (its task logs in the work folder stay). Its dedup
    steps' own short bars are off too (tqdm reads TQDM_DISABLE only at import, so their module's `tqdm` is
    one with disable=True for the while; the local executor forks its tasks from here)."""
    import sys

    from loguru import logger
    from tqdm import tqdm

    logger.disable("datatrove")
    patched = [m for name in _DATATROVE_BARS if getattr(m := sys.modules.get(name), "tqdm", None) is tqdm]
    for module in patched:
        module.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        logger.enable("datatrove")
        for module in patched:
            module.tqdm = tqdm


@contextmanager
def _stage_bar(prep: Prepare, stage: Stage, run):
    """A bar over the stage's work while it runs: shards written for the tokenize stage, else tasks done
    (datatrove's completion markers), polled from the work folder."""
    from lmpretrain.progress import bar

    tokenize = stage.name == "tokenize"
    total = prep.pieces if tokenize else run.world_size
    unit = "shard" if tokenize else "task"
    shown = bar(desc=f"{prep.out.name}: {stage.name}", unit=unit, total=total, scale=False)
    done = threading.Event()

    def count() -> int:
        if tokenize:
            return len(list((prep.work / "shards").glob("shard-*.json")))
        return sum(run.is_rank_completed(rank) for rank in range(run.world_size))

    def poll():
        while not done.wait(0.5):
            shown.update(min(total, count()) - shown.n)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield
        shown.update(total - shown.n)
    finally:
        done.set()
        watcher.join()
        shown.close()


def write_token_files(
    spec,
    tokenizer,
    out,
    *,
    add_bos: bool | None = None,
    tasks: int = 1,
    workers: int = -1,
    overwrite: bool = False,
    transforms=None,
    dedup: str | None = None,
) -> dict:
    """Tokenize a source into the token-file folder `out` on this machine (`tasks` tasks, `workers` at a
    time; -1: all); returns the header. The folder appears only when complete."""
    prep = plan_prepare(
        spec,
        tokenizer,
        out,
        add_bos=add_bos,
        overwrite=overwrite,
        tasks=tasks,
        transforms=transforms,
        dedup=dedup,
    )
    return run_prepare(prep, "local", tasks, workers)
