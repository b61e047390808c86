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
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers import JsonlReader, ParquetReader
from datatrove.pipeline.readers.base import BaseReader

from lmpretrain.data.encoder import Encoder
from lmpretrain.data.readers import Bad, is_url
from lmpretrain.data.sources import OLD_TOKENS_META, SourceSpec, as_spec, is_old_token_cache, open_source
from lmpretrain.data.token_files import token_dtype
from lmpretrain.data.token_layouts import HEADER, VERSION
from lmpretrain.errors import DataError

PREPARE_PIECES = 64  # our reader cuts a source into (about) this many pieces, whatever the task count
EXECUTORS = ("local", "slurm", "ray")
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # documents tokenized per call


class SourceReader(BaseReader):
    """A datatrove reader over lmpretrain's own readers: the pieces rank, rank + world_size, ... of a source,
    each document (or part of one, for long text) a Document tagged with its piece number; `transforms`
    (data.transforms) applied as a training run applies them."""

    name = "lmpretrain source"

    def __init__(self, spec: SourceSpec, transforms=None):
        super().__init__()
        self.spec, self.transforms = spec, transforms

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        source = open_source(self.spec, self.transforms)
        for n, piece in enumerate(source.pieces(PREPARE_PIECES)):
            if n % world_size != rank:
                continue
            for k, item in enumerate(source.read(piece, None)):
                meta = {"shard": n}
                if isinstance(item, Bad):
                    self.stat_update("bad_records")
                    yield Document(text="", id=f"{n}/{k}", metadata={**meta, "bad": True})
                else:
                    yield Document(
                        text=item.value, id=f"{n}/{k}", metadata={**meta, "bos": item.bos, "eos": item.eos}
                    )


class _Shard:
    """One shard being written: shard-N.bin (framed ids), then at close shard-N.idx and shard-N.json."""

    def __init__(self, folder: str, name: str, encoder: Encoder, dtype: np.dtype):
        self.path = os.path.join(folder, name)
        self.name, self.encoder, self.dtype = name, encoder, dtype
        self.out = open(self.path + ".bin", "wb")
        self.starts: list[int] = []
        self.written = self.skipped = 0
        self.max_id = -1
        self.batch: list[tuple[str, bool, bool]] = []
        self.chars = 0

    def add(self, doc: Document) -> None:
        meta = doc.metadata
        if meta.get("bad") or not isinstance(doc.text, (str, list)):
            self.skipped += 1  # a bad record, or a field that is not text (datatrove's readers pass it on)
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
        counts.update(skipped=self.skipped, max_id=self.max_id)
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

    def __init__(self, folder: str, out: str, header: dict):
        super().__init__()
        self.folder, self.out, self.header = folder, out, header

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        folder, out = Path(self.folder), Path(self.out)
        shards = [json.loads(p.read_text()) for p in sorted(folder.glob("shard-*.json"))]
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
            "shards": [{k: s[k] for k in ("name", "tokens", "documents")} for s in shards],
        }
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
class Prepare:
    """A planned prepare: the two pipelines and where they write."""

    out: Path
    work: Path  # .NAME.prepare/ beside out: shards/, files.txt, logs/, job.json
    reader: PipelineStep
    writer: ShardWriter
    finish: FinishFolder
    summary: str


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
) -> Prepare:
    """Open the source and check everything a task needs, before any work; the work folder is kept when it
    belongs to the same command (a resume), else made afresh. `transforms` (data.transforms) are applied
    by our reader, the one that applies them in training too."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    spec = as_spec(spec)
    out = Path(os.path.expanduser(str(out))).absolute()
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; choose another --out or pass --overwrite")
    old = spec.files[0] if spec.files and len(spec.files) == 1 and is_old_token_cache(spec.files[0]) else None
    if old is None:
        source = open_source(spec)  # the one listing (and, for parquet, footer read) of the source
        if source.format == "tokens":
            raise DataError(f"source {spec.label} is token files already; train on it directly")
        files, label = source.files, source.label
    else:
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
    }
    job_file = work / "job.json"
    if not (job_file.is_file() and json.loads(job_file.read_text()) == job):
        shutil.rmtree(work, ignore_errors=True)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(job, indent=2))
    shards = str(work / "shards")
    json_lines = old is None and source.format == "json" and not any(source.json_arrays)
    if old is None and (transforms or source.is_hub or not (json_lines or source.format == "parquet")):
        reader, pieces, files = SourceReader(spec, transforms), len(source.pieces(PREPARE_PIECES)), None
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
    }
    digits = max(5, len(str(pieces - 1)))  # shard names sort in piece order
    writer = ShardWriter(shards, tokenizer, encoder.add_bos, files, digits)
    return Prepare(out, work, reader, writer, FinishFolder(shards, str(out), header), summary)


def build_executors(prep: Prepare, executor: str = "local", tasks: int = 1, workers: int = -1, **cluster):
    """(tokenize, finish): datatrove executors of `tasks` tokenizing tasks and the one final task, which
    depends on them. `cluster`: slurm's partition, time, cpus_per_task, mem_per_cpu_gb, sbatch_args (and
    venv_path), ray's cpus_per_task, mem_per_cpu_gb."""
    logs = prep.work / "logs"
    pipeline = [prep.reader, prep.writer]
    if executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        # fork: tasks start with the launcher's imports (datatrove's default, forkserver, re-imports per task)
        tokenize = LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logs / "tokenize"), start_method="fork"
        )
        finish = LocalPipelineExecutor([prep.finish], logging_dir=str(logs / "finish"), depends=tokenize)
    elif executor == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        common = dict(cluster, job_name=f"prepare-{prep.out.name}")
        tokenize = SlurmPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logs / "tokenize"), **common
        )
        common.update(job_name=f"prepare-{prep.out.name}-header", cpus_per_task=1)
        finish = SlurmPipelineExecutor(
            [prep.finish], tasks=1, logging_dir=str(logs / "finish"), depends=tokenize, **common
        )
    elif executor == "ray":
        from datatrove.executor import RayPipelineExecutor

        tokenize = RayPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=str(logs / "tokenize"), **cluster
        )
        finish = RayPipelineExecutor(
            [prep.finish], tasks=1, logging_dir=str(logs / "finish"), depends=tokenize
        )
    else:
        raise DataError(f"--executor {executor!r} is not one of {EXECUTORS}")
    return tokenize, finish


def run_prepare(
    prep: Prepare, executor: str = "local", tasks: int = 1, workers: int = -1, **cluster
) -> dict | None:
    """Run the prepare (local, ray) or submit it (slurm); returns the header once the folder is in place here."""
    build_executors(prep, executor, tasks, workers, **cluster)[1].run()
    if not (prep.out / HEADER).is_file():  # submitted: the final job writes it
        return None
    shutil.rmtree(prep.work)
    return json.loads((prep.out / HEADER).read_text())


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
) -> dict:
    """Tokenize a source into the token-file folder `out` on this machine (`tasks` tasks, `workers` at a
    time; -1: all); returns the header. The folder appears only when complete."""
    prep = plan_prepare(
        spec, tokenizer, out, add_bos=add_bos, overwrite=overwrite, tasks=tasks, transforms=transforms
    )
    return run_prepare(prep, "local", tasks, workers)
