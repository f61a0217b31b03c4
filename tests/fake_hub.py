"""A stand-in for the Hugging Face hub's HTTP API on 127.0.0.1 (third-party HTTP, so a fake is allowed): it serves
one repo at one commit from a model dir (repo info, the tree listing, HEAD, GET and ranged GET of `resolve/`) and
records which files were downloaded whole."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from model_boxes import blob_name


@contextmanager
def fake_hub(model_dir: Path, repo_id: str, commit: str, *, exclude: tuple[str, ...] = ()
             ) -> Iterator[tuple[str, list[str]]]:
    """Serve `model_dir` (but `exclude`) as `repo_id` at `commit`; yields (endpoint, names of the files downloaded)."""
    downloaded: list[str] = []
    files = {p.name: p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")
             and p.name not in exclude}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?")[0]
            if path.startswith(f"/api/models/{repo_id}/tree/{commit}"):
                return self._json([_entry(name, file) for name, file in files.items()], body)
            if path.startswith(f"/api/models/{repo_id}/revision/"):  # model_info / repo_info
                return self._json({"id": repo_id, "sha": commit, "siblings": [_sibling(n, f) for n, f in files.items()]},
                                  body)
            name = path.split("/resolve/", 1)[-1].split("/", 1)[-1]
            if f"/{repo_id}/resolve/" not in path or name not in files:
                return self._send(b"{}", {"X-Error-Code": "EntryNotFound"}, body, status=404)
            data, status = files[name].read_bytes(), 200
            if ranged := self.headers.get("Range"):  # safetensors headers read by range
                first, _, last = ranged.removeprefix("bytes=").partition("-")
                data, status = data[int(first):int(last) + 1 if last else None], 206
            elif body:
                downloaded.append(name)
            return self._send(data, {"X-Repo-Commit": commit, "ETag": f'"{blob_name(files[name])}"'}, body, status)

        def _json(self, value: object, body: bool) -> None:
            self._send(json.dumps(value).encode(), {"Content-Type": "application/json"}, body)

        def _send(self, data: bytes, headers: dict[str, str], body: bool, status: int = 200) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", downloaded
    finally:
        server.shutdown()
        server.server_close()


def _sibling(name: str, path: Path) -> dict[str, object]:
    sibling: dict[str, object] = {"rfilename": name, "size": path.stat().st_size}
    if path.suffix == ".safetensors":
        sibling["lfs"] = {"sha256": blob_name(path), "size": path.stat().st_size, "pointerSize": 134}
    return sibling


def _entry(name: str, path: Path) -> dict[str, object]:
    size = path.stat().st_size
    entry: dict[str, object] = {"type": "file", "path": name, "size": size, "oid": blob_name(path)}
    if path.suffix == ".safetensors":
        entry["lfs"] = {"oid": blob_name(path), "size": size, "pointerSize": 134}
    return entry
