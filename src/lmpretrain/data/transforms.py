"""`data.transforms`: a fork's functions over each document's text, applied wherever a text source is read.

Each entry is `module:function` (a module on the Python path) or `path/to/file.py:function`. The function
takes a document's text and its source's label (`def f(text, source)`, or `def f(text)`) and returns the
text to tokenize, or None to drop the document. Several run in order; a drop ends the chain.

They apply to every text source of a run, training and held-out alike, and in `scripts/prepare_data.py
--transform`, because they sit in `Source.read` (data/sources.py), below everything that reads a source:
a reader's units are joined into their whole segment (a document; readers cut long text documents into
64 KiB units), the segment is transformed and comes out as one unit, or as a `Dropped` record that streams
skip and count (`train/filtered_docs`). Token sources are read as prepared. Their names and the sha256 of
the files that define them are part of the resume fingerprint (`fingerprint()`).
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

from lmpretrain.data.readers import Bad, Unit
from lmpretrain.errors import ConfigError, DataError


class Dropped(Bad):
    """A document a transform dropped (returned None): skipped like a bad record by readers of a source
    that do not tell them apart, counted as filtered, not as bad, by the streams."""

    __slots__ = ()


@dataclass(frozen=True)
class Transform:
    name: str  # as configured: module:function or path.py:function
    function: Callable
    takes_source: bool  # f(text, source) rather than f(text)
    sha256: str | None  # of the file defining the function (None: no file, e.g. a builtin)


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
    """The loaded `data.transforms` of a run; call it on (text, source label)."""

    def __init__(self, transforms: Sequence[Transform]):
        self.transforms = tuple(transforms)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, text: str, source: str) -> str | None:
        for t in self.transforms:
            text = t.function(text, source) if t.takes_source else t.function(text)
            if text is None:
                return None
            if not isinstance(text, str):
                raise DataError(
                    f"data.transforms: {t.name} returned {type(text).__name__} for a document of {source}; "
                    "a transform returns the text to tokenize (a str) or None to drop the document"
                )
        return text

    def fingerprint(self) -> list[dict]:
        """What the resume check compares: each transform's name and the sha256 of its file."""
        return [{"name": t.name, "sha256": t.sha256} for t in self.transforms]

    def describe(self) -> str:
        return "transforms: " + " -> ".join(t.name for t in self.transforms)

    def apply(self, items: Iterator[Unit | Bad], source: str) -> Iterator[Unit | Bad]:
        """A reader's items with each segment's units joined, transformed and yielded as one unit, or as
        `Dropped` at the segment's end position. Bad lines inside a segment pass through as they come."""
        parts: list[Unit] = []
        for item in items:
            if isinstance(item, Bad):
                yield item
                continue
            parts.append(item)
            if item.last:
                yield self._segment(parts, source)
                parts = []
        if parts:  # readers end every piece on a segment end; kept whole should one not
            yield self._segment(parts, source)

    def _segment(self, parts: list[Unit], source: str) -> Unit | Bad:
        first, end = parts[0], parts[-1]
        text = parts[0].value if len(parts) == 1 else "".join(p.value for p in parts)
        records = sum(p.records for p in parts)
        out = self(text, source)
        if out is None:
            return Dropped(source, None, None, "dropped by data.transforms", end.after)
        return Unit(out, first.bos, end.eos, True, end.after, records)


def load_transforms(names: Sequence[str]) -> Transforms:
    """The functions `names` (module:function or file.py:function) name; one ConfigError lists every one
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
        loaded.append(Transform(str(name), function, _takes_source(function), _file_sha256(function)))
    if problems:
        raise ConfigError(problems)
    return Transforms(loaded)
