"""`data.transforms`: a fork's functions (or stateful classes) over each document's text.

Each entry is `module:name` (a module on the Python path) or `path/to/file.py:name`, naming either

- a **function** `f(text, source)` (or `f(text)`) that returns the text to tokenize, or None to drop the
  document. It must be pure: the same output for the same input, whenever it is called (a resume re-reads
  documents, and each stream calls it in its own process); or
- a **class** with `__call__(text, source)`, `state_dict()` and `load_state_dict(state)`, built with no
  arguments once per stream (a hash-set dedup, a running count): its state is kept per stream in the data
  position, in the checkpoints with it, so a resume is exact. `state_dict()` returns plain data (dicts,
  lists, strings, numbers) that later calls do not change; it is taken at every document window (64
  documents by default) and every step, so keep it small.

Several run in order; a drop ends the chain. They run on each stream's own share of a source, after the
streams have taken their shares (data/cursor.py: a stream never sees, so never counts or dedups, another
stream's documents), on whole documents (a reader's units joined: `join_segments`), for every text source of
a run, training and held-out alike; token files are transformed when they are prepared (`scripts/
prepare_data.py --transform`, recorded in their header), and a run given data.transforms for token files
prepared otherwise is refused (`check_token_sources`). A transform that raises stops the run with one
message naming it, the source and the document. Names and the sha256 of the files that define them are in
the resume fingerprint (`fingerprint()`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmpretrain.data.corpus import BUILTIN_DATASETS
from lmpretrain.data.readers import Bad, Unit
from lmpretrain.errors import ConfigError, DataError

PREPARE_COMMAND = "python scripts/prepare_data.py"


class TransformError(DataError):
    """A data transform raised on a document: the message names the transform, the source and the document."""


@dataclass(frozen=True)
class Transform:
    name: str  # as configured: module:name or path.py:name
    function: Callable  # a function, or a class (one instance per stream)
    takes_source: bool  # f(text, source) rather than f(text)
    sha256: str | None  # of the file defining it (None: no file, e.g. a builtin)
    stateful: bool = False  # a class with state_dict / load_state_dict


def _module(where: str):
    """The module `where` names: a dotted module name, or the path of a .py file (imported under its stem,
    or the running script itself when it is that file)."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).expanduser().resolve()
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and Path(main.__file__).resolve() == path:
        return main  # a forked recipe naming its own functions
    if not path.is_file():
        raise ImportError(f"no such file: {path}")
    known = sys.modules.get(path.stem)
    if known is not None and getattr(known, "__file__", None) and Path(known.__file__).resolve() == path:
        return known
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # as an import would: pickles (dataloader workers) find it
    spec.loader.exec_module(module)
    return module


def _file_sha256(function: Callable) -> str | None:
    try:
        path = inspect.getsourcefile(function) or inspect.getfile(function)
    except TypeError:  # a builtin: no file
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and Path(path).is_file() else None


def _takes_source(function: Callable) -> bool:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


def transform_name(function: Callable) -> str:
    """The `data.transforms` entry naming a function (a forked recipe's own: its file's path)."""
    module = function.__module__
    if module == "__main__":
        module = str(Path(inspect.getsourcefile(function)).resolve())
        try:
            module = str(Path(module).relative_to(Path.cwd()))
        except ValueError:
            pass
    return f"{module}:{function.__qualname__}"


class Transforms:
    """The loaded `data.transforms` of a run: what the fingerprint and the start-up log name; `chain()` gives
    the callable one stream applies (with its own instances of the stateful ones)."""

    def __init__(self, transforms: Sequence[Transform]):
        self.transforms = tuple(transforms)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    @property
    def stateful(self) -> list[str]:
        """The names of the transforms that keep state."""
        return [t.name for t in self.transforms if t.stateful]

    def chain(self) -> TransformChain:
        return TransformChain(self.transforms)

    def fingerprint(self) -> list[dict]:
        """What the resume check compares: each transform's name and the sha256 of its file."""
        return [{"name": t.name, "sha256": t.sha256} for t in self.transforms]

    def describe(self) -> str:
        kept = f" (state kept per stream: {', '.join(self.stateful)})" if self.stateful else ""
        return "transforms: " + " -> ".join(t.name for t in self.transforms) + kept


class TransformChain:
    """The transforms as one stream applies them: call it on (text, source label, where), where `where()`
    says which document this is (for the message when a transform raises)."""

    def __init__(self, transforms: Sequence[Transform]):
        self.steps = [(t, t.function() if t.stateful else t.function) for t in transforms]

    @property
    def stateful(self) -> bool:
        return any(t.stateful for t, _ in self.steps)

    def __call__(self, text: str, source: str, where: Callable[[], str]) -> str | None:
        for t, fn in self.steps:
            try:
                text = fn(text, source) if t.takes_source else fn(text)
            except Exception as err:  # noqa: BLE001 - the user's code: named with the document, no traceback
                raise TransformError(
                    f"data.transforms: {t.name} raised {type(err).__name__}: {err} on the document at {where()} "
                    f"(source {source}); fix the transform, or have it return None to drop such a document"
                ) from err
            if text is None:
                return None
            if not isinstance(text, str):
                raise TransformError(
                    f"data.transforms: {t.name} returned {type(text).__name__} for the document at {where()} "
                    f"(source {source}); a transform returns the text to tokenize (a str) or None to drop it"
                )
        return text

    def state_dict(self) -> dict:
        """Each stateful transform's state, by name."""
        return {t.name: fn.state_dict() for t, fn in self.steps if t.stateful}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` gave; a transform missing from it starts afresh (it was added at a resume
        that run.allow_data_change accepted)."""
        for i, (t, fn) in enumerate(self.steps):
            if t.stateful:
                if t.name in state:
                    fn.load_state_dict(state[t.name])
                else:
                    self.steps[i] = (t, t.function())


def join_segments(items: Iterator[Unit | Bad]) -> Iterator[Unit | Bad]:
    """A reader's items with each segment's units joined into one unit (a whole document, whatever the
    readers cut it into), so a transform sees documents whole. Bad lines inside a segment pass as they come."""
    parts: list[Unit] = []
    for item in items:
        if isinstance(item, Bad):
            yield item
            continue
        parts.append(item)
        if item.last:
            yield _joined(parts)
            parts = []
    if parts:  # readers end every piece on a segment end; kept whole should one not
        yield _joined(parts)


def _joined(parts: list[Unit]) -> Unit:
    if len(parts) == 1:
        return parts[0]
    first, end = parts[0], parts[-1]
    text = "".join(p.value for p in parts)
    return Unit(text, first.bos, end.eos, True, end.after, sum(p.records for p in parts))


def _stateful_problem(name: str, cls: type) -> str | None:
    """Why the class `cls` cannot be a transform, or None."""
    missing = [
        m for m in ("__call__", "state_dict", "load_state_dict") if not callable(getattr(cls, m, None))
    ]
    if missing:
        return (
            f"data.transforms: {name} is a class without {', '.join(missing)}: a transform class needs "
            "__call__(text, source), state_dict() and load_state_dict(state) (its state goes into checkpoints); "
            "name a function for a transform without state"
        )
    try:
        cls()
    except Exception as err:  # noqa: BLE001 - the user's constructor, named with its cause
        return f"data.transforms: {name} is a class that cannot be built with no arguments ({type(err).__name__}: {err})"
    return None


def load_transforms(names: Sequence[str]) -> Transforms:
    """The functions and classes `names` (module:name or file.py:name) name; one ConfigError lists every one
    that cannot be loaded."""
    loaded, problems = [], []
    for name in names:
        where, _, attr = str(name).rpartition(":")
        if not where or not attr:
            problems.append(
                f"data.transforms: {name!r} is not module:function (e.g. my_filters:keep_long, or "
                "examples/data_transforms.py:keep_long_lowercased)"
            )
            continue
        try:
            module = _module(where)
        except Exception as err:  # noqa: BLE001 - an import error of the user's module, named with its cause
            problems.append(
                f"data.transforms: cannot import {where!r} ({type(err).__name__}: {err}); give a module on "
                "PYTHONPATH or the path of a .py file"
            )
            continue
        function = module
        for part in attr.split("."):
            function = getattr(function, part, None)
        if not callable(function):
            problems.append(f"data.transforms: {where!r} has no function {attr!r}")
            continue
        stateful = isinstance(function, type)
        if stateful and (problem := _stateful_problem(str(name), function)):
            problems.append(problem)
            continue
        takes = _takes_source(function() if stateful else function)
        loaded.append(Transform(str(name), function, takes, _file_sha256(function), stateful))
    if problems:
        raise ConfigError(problems)
    return Transforms(loaded)


def check_token_sources(sources, transforms: Transforms, tokenizer: str) -> None:
    """data.transforms cannot change token files (they hold tokens): a token source must have been prepared
    with exactly these transforms (its header records their names and file hashes), which then are not
    applied again; any other is refused, before the model is built, with the prepare command that applies
    them (`tokenizer`: the run's data.tokenizer, for the command)."""
    if not transforms:
        return
    problems = []
    for source in sources:
        if source.token_files is None:
            continue
        recorded = [layout.header.get("transforms") for layout in source.token_files.layouts]
        if all(r == transforms.fingerprint() for r in recorded):
            continue
        names = [t["name"] for t in transforms.fingerprint()]
        if any(r and [t["name"] for t in r] == names for r in recorded):
            why = "the files defining them changed since the token files were prepared (sha256 differs)"
        elif any(r for r in recorded):
            why = f"they were prepared with {[t['name'] for r in recorded if r for t in r]}"
        else:
            why = "they were prepared without them"
        problems.append(
            f"source {source.label} is token files, which data.transforms ({', '.join(names)}) cannot change "
            f"(they hold tokens, not text), and {why}. Prepare them with the transforms, then train on that "
            f"folder with the same data.transforms (or none): {_prepare_command(source, transforms, tokenizer)}; "
            "or train on the text source (without `format: tokens`)"
        )
    if problems:
        raise DataError("; ".join(problems))


def _prepare_command(source, transforms: Transforms, tokenizer: str) -> str:
    """scripts/prepare_data.py's command line that writes `source`'s tokens through `transforms`."""
    spec = source.spec
    header = source.token_files.layouts[0].header
    label = spec.label if spec.name else header.get("source", "")
    kind, _, rest = label.partition(":")
    if spec.name or kind in BUILTIN_DATASETS:  # a builtin, or token files a prepare made of one
        name, split = (spec.name, spec.split) if spec.name else (kind, rest)
        text = f"--builtin {name} --split {split}"
        out = f"data/{name}-{split}-transformed"
    elif kind == "files":
        text = " ".join(f"--files {f}" for f in rest.split(","))
        out = str(Path(spec.files[0])).rstrip("/") + "-transformed"
    elif kind == "hub":
        where, _, split = rest.rpartition(":")
        parts = where.split("/")
        config = f" --hub-config {'/'.join(parts[2:])}" if len(parts) > 2 else ""
        text = f"--hub {'/'.join(parts[:2])}{config} --split {split}"
        out = f"data/{parts[-1]}-transformed"
    else:  # token files from elsewhere (datatrove, Megatron): their text is not recorded
        text, out = "--files <the text they were made from>", "data/transformed"
    pure = [t.name for t in transforms.transforms if not t.stateful]
    command = f"{PREPARE_COMMAND} {text} --tokenizer {tokenizer}"
    command += "".join(f" --transform {name}" for name in pure)
    if dedup := (header.get("dedup") or {}).get("method"):  # these token files were deduplicated: so again
        command += f" --dedup {dedup}"
    command += f" --out {out}"
    if transforms.stateful:  # prepare_data applies pure functions only
        command += (
            f" (the stateful {', '.join(transforms.stateful)} cannot run there: deduplicate with --dedup exact or "
            "--dedup minhash)"
        )
    return command
