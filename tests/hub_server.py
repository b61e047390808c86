"""A Hugging Face Hub on loopback for tests: serves model and dataset repositories from a folder
(``<root>/<repo id>/<files>`` and ``<root>/datasets/<repo id>/<files>``) through the parts of the Hub's HTTP
API that huggingface_hub, transformers and datasets call (repo info, tree listings, paths-info, resolve
with byte ranges), and counts every request. It answers as the Hub does where the clients depend on it: a
missing file is a 404 with ``X-Error-Code: EntryNotFound`` and the commit (so clients cache its absence),
a missing repository a 404 ``RepoNotFound``. Run as ``python tests/hub_server.py ROOT PORT_FILE``: it
writes its port to PORT_FILE and, at each request, appends ``METHOD path`` to ``ROOT/requests.log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub(BaseHTTPRequestHandler):
    root: Path
    lock = threading.Lock()

    def log_message(self, *args):  # the request log below is the record
        pass

    def _record(self) -> None:
        with self.lock, open(self.root / "requests.log", "a") as f:
            f.write(f"{self.command} {unquote(urlparse(self.path).path)}\n")

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, code: int = 200, error: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if error:
            headers["X-Error-Code"] = error
            if error == "EntryNotFound":
                headers["X-Repo-Commit"] = COMMIT
        self._reply(code, json.dumps(obj).encode(), headers)

    def _repo(self, parts: list[str]) -> tuple[Path | None, list[str], str]:
        kind = "dataset" if parts and parts[0] in ("datasets", "dataset") else "model"
        parts = parts[1:] if kind == "dataset" else parts
        repo = self.root / ("datasets" if kind == "dataset" else "") / "/".join(parts[:2])
        return (repo if repo.is_dir() else None), parts[2:], kind

    def _entries(self, repo: Path, sub: str = "", recursive: bool = True) -> list[dict]:
        base = repo / sub
        found = sorted(base.rglob("*") if recursive else base.iterdir()) if base.is_dir() else []
        out = []
        for p in found:
            rel = p.relative_to(repo).as_posix()
            if p.is_dir():
                out.append({"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()})
            else:
                data = p.read_bytes()
                out.append(
                    {"type": "file", "path": rel, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                )
        return out

    def _api(self, parts: list[str]) -> None:
        repo, rest, kind = self._repo(parts)
        if repo is None:
            return self._json({"error": "Repository not found"}, 404, "RepoNotFound")
        if rest and rest[0] == "tree":  # tree/<rev>[/<path>]
            sub = "/".join(rest[2:])
            recursive = "recursive=true" in (urlparse(self.path).query or "").lower()
            if sub and not (repo / sub).exists():
                return self._json({"error": "Entry not found"}, 404, "EntryNotFound")
            return self._json(self._entries(repo, sub, recursive))
        if rest and rest[0] == "paths-info":
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            try:
                paths = json.loads(raw).get("paths", [])
            except ValueError:  # a form body: paths=a&paths=b
                paths = [unquote(kv.split("=", 1)[1]) for kv in raw.split("&") if kv.startswith("paths=")]
            entries = {e["path"]: e for e in self._entries(repo)}
            return self._json([entries[p] for p in paths if p in entries])
        files = [e for e in self._entries(repo) if e["type"] == "file"]
        name = repo.relative_to(self.root / ("datasets" if kind == "dataset" else "")).as_posix()
        return self._json(
            {
                "id": name,
                "sha": COMMIT,
                "private": False,
                "disabled": False,
                "gated": False,
                "siblings": [{"rfilename": e["path"], "size": e["size"]} for e in files],
                "cardData": {},
                "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z",
            }
        )

    def _file(self, parts: list[str]) -> None:
        repo, rest, _ = self._repo(parts)
        if repo is None:
            return self._json({"error": "Repository not found"}, 404, "RepoNotFound")
        if len(rest) < 3 or rest[0] != "resolve":
            return self._json({"error": "not found"}, 404, "EntryNotFound")
        path = repo / "/".join(rest[2:])
        if not path.is_file():
            return self._json({"error": "Entry not found"}, 404, "EntryNotFound")
        data = path.read_bytes()
        headers = {
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "X-Repo-Commit": COMMIT,
            "Accept-Ranges": "bytes",
        }
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            first, _, last = ranged[len("bytes=") :].partition("-")
            if first:  # bytes=a-b or bytes=a-
                start, stop = int(first), min(len(data) - 1, int(last)) if last else len(data) - 1
            else:  # bytes=-n: the last n
                start, stop = max(0, len(data) - int(last)), len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{stop}/{len(data)}"
            return self._reply(206, data[start : stop + 1], headers)
        self._reply(200, data, headers)

    def _route(self) -> None:
        self._record()
        parts = [p for p in unquote(urlparse(self.path).path).split("/") if p]
        if parts[:1] == ["api"]:
            parts = parts[1:]
            if parts[:1] in (["models"], ["datasets"]):
                return self._api(["datasets", *parts[1:]] if parts[0] == "datasets" else parts[1:])
            return self._json({"error": "not found"}, 404, "EntryNotFound")
        return self._file(parts)

    do_GET = do_HEAD = do_POST = _route


def main(root: str, port_file: str) -> None:
    Hub.root = Path(root)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    os.replace(tmp, port_file)  # whole or absent
    server.serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:3])
