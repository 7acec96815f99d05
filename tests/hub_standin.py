"""A local stand-in for the model hub, for tests: a stdlib HTTP server in a thread that
answers the few endpoints worker/hub.py reaches through ``huggingface_hub`` (2.4), so the
library's own code runs against it (``HF_ENDPOINT`` or ``endpoint=``). A test fixture, not
a product: no uploads, no pagination, no xet, no redirects to a CDN.

Repositories live in a folder, read on every request (the folder is the truth)::

    {root}/{owner}/{name}/repo.json       {"refs": {"main": sha, "v1": sha},
                                           "gated": false, "private": false, "tokens": [...]}
    {root}/{owner}/{name}/{commit}/...    the files of each commit (commit: 40 hex digits)

``publish`` writes a commit and moves a branch, ``tag`` adds a tag, ``set_access`` makes a
repository gated or private with the tokens that may read it.

Endpoints (and which ``huggingface_hub`` call uses each):

- ``GET /api/models/{owner}/{name}/revision/{rev}`` (``model_info``): ``id``, ``sha`` (the
  commit the revision resolves to), ``private``, ``gated`` and ``siblings`` (``rfilename``;
  with ``?blobs=true``, as ``files_metadata=True`` asks, also ``size``, ``blobId`` and
  ``lfs {sha256, size, pointerSize}``). A gated repository's info is public, as on the hub.
- ``GET /api/models/{owner}/{name}/tree/{rev}[/{path}]?recursive=..`` (``list_repo_tree``,
  which ``snapshot_download`` calls for a commit hash): files (``type, oid, size, path,
  lfs {oid, size, pointerSize}``) and, recursive, folders. One page, no ``Link`` header.
- ``HEAD`` and ``GET /{owner}/{name}/resolve/{rev}/{path}`` (``get_hf_file_metadata`` before
  each download, ``http_get``, and ``parse_safetensors_file_metadata``'s range reads):
  ``X-Repo-Commit``, ``ETag`` (git blob sha1, or the sha256 for LFS files, also as
  ``X-Linked-Etag`` with ``X-Linked-Size``), ``Content-Length``, ``Accept-Ranges: bytes``;
  a ``Range: bytes=a-b`` request gets ``206`` with ``Content-Range``.

Errors carry the hub's ``X-Error-Code`` (which ``hf_raise_for_status`` maps to exceptions)
and ``X-Error-Message``: an unknown or private repository (without a token that may read
it) is ``RepoNotFound`` (401 without ``Authorization``, 404 with one); an unknown revision
``RevisionNotFound`` (404); an unknown file ``EntryNotFound`` (404); a gated repository's
files without a granted ``Authorization: Bearer`` token ``GatedRepo`` (401 without a token,
403 with one that was not granted).

Every request is recorded in ``requests`` (method, kind, repo, revision, file, range,
authorization, user agent, path, status, body bytes sent) so that a test can say what was, and
was not, fetched.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# Stored with git LFS on the hub (its default .gitattributes), everything else in git.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                ".zip", ".tar.gz")
CHUNK = 1 << 16


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:"
            f"{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n").encode()


@dataclass
class Request:
    method: str
    kind: str             # "info", "tree", "resolve" or "other"
    repo: str | None
    revision: str | None
    file: str | None
    range: str | None
    authorization: str | None
    user_agent: str | None = None
    path: str = ""        # the request's path and query, as sent
    status: int = 0
    body_bytes: int = 0   # bytes of the response body sent


class StandinHub:
    """The server and its folder. ``with StandinHub(folder) as hub: ... hub.url ...``"""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # serving --------------------------------------------------------------------------
    def start(self) -> "StandinHub":
        hub = self

        class Handler(_Handler):
            standin = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True, name="hub-standin")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> "StandinHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # the folder -------------------------------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    def meta(self, repo_id: str) -> dict | None:
        path = self.repo_dir(repo_id) / "repo.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _write_meta(self, repo_id: str, meta: dict) -> None:
        folder = self.repo_dir(repo_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "repo.json").write_text(json.dumps(meta, indent=1, sort_keys=True))

    def publish(self, repo_id: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """A new commit holding exactly ``files`` ({path: bytes}) on ``branch``; its sha."""
        meta = self.meta(repo_id) or {"refs": {}, "gated": False, "private": False,
                                      "tokens": []}
        parent = meta["refs"].get(branch, "")
        h = hashlib.sha1(f"parent {parent}\n".encode())
        for name in sorted(files):
            h.update(f"{name} {hashlib.sha256(files[name]).hexdigest()}\n".encode())
        commit = h.hexdigest()
        folder = self.repo_dir(repo_id) / commit
        if folder.exists():
            shutil.rmtree(folder)
        for name, data in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        folder.mkdir(parents=True, exist_ok=True)
        meta["refs"][branch] = commit
        self._write_meta(repo_id, meta)
        return commit

    def tag(self, repo_id: str, tag: str, commit: str) -> None:
        meta = self.meta(repo_id)
        meta["refs"][tag] = commit
        self._write_meta(repo_id, meta)

    def set_access(self, repo_id: str, *, gated: bool = False, private: bool = False,
                   tokens: tuple[str, ...] = ()) -> None:
        meta = self.meta(repo_id)
        meta.update(gated=gated, private=private, tokens=list(tokens))
        self._write_meta(repo_id, meta)

    def file_path(self, repo_id: str, commit: str, name: str) -> Path:
        return self.repo_dir(repo_id) / commit / name

    # what was asked ---------------------------------------------------------------------
    def gets(self, repo_id: str, name: str) -> list[Request]:
        """The GET requests for one file's bytes (any revision)."""
        return [r for r in self.requests
                if r.kind == "resolve" and r.method == "GET" and r.repo == repo_id
                and r.file == name]


class _Handler(BaseHTTPRequestHandler):
    standin: StandinHub
    server_version = "hub-standin/1"

    def log_message(self, *args) -> None:   # quiet
        pass

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    # plumbing ---------------------------------------------------------------------------
    def _send(self, status: int, headers: dict, body: bytes = b"", head: bool = False) -> None:
        # Recorded before anything is sent: the client may look at the log as soon as it
        # has the response.
        self.req.status = status
        if not head:
            self.req.body_bytes += len(body)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, str(value))
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, obj, head: bool = False) -> None:
        self._send(200, {"Content-Type": "application/json"}, json.dumps(obj).encode(), head)

    def _error(self, status: int, code: str | None, message: str, head: bool = False,
               extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        headers.update(extra or {})
        self._send(status, headers, json.dumps({"error": message}).encode(), head)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    # routing ----------------------------------------------------------------------------
    def _dispatch(self, head: bool) -> None:
        split = urlsplit(self.path)
        raw = split.path.split("/")[1:]
        parts = [unquote(p) for p in raw]
        query = parse_qs(split.query)
        kind, repo, rev, file = "other", None, None, None
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("revision", "tree"):
            kind = "info" if parts[4] == "revision" else "tree"
            repo, rev = f"{parts[2]}/{parts[3]}", parts[5]
            file = "/".join(parts[6:]) or None
        elif len(parts) >= 5 and parts[2] == "resolve":
            kind, repo, rev = "resolve", f"{parts[0]}/{parts[1]}", parts[3]
            file = "/".join(parts[4:])
        self.req = Request(self.command, kind, repo, rev, file, self.headers.get("Range"),
                           self.headers.get("Authorization"), self.headers.get("User-Agent"),
                           self.path)
        self.standin.requests.append(self.req)
        if kind == "other" or (kind != "resolve" and head):
            return self._error(404, None, "Not Found (not served by the stand-in)", head)

        meta = self.standin.meta(repo)
        token = self._token()
        readable = meta is not None and (not meta["private"] or token in meta["tokens"])
        if not readable:
            return self._error(401 if token is None else 404, "RepoNotFound",
                               "Repository not found", head)
        if kind == "resolve" and meta["gated"] and token not in meta["tokens"]:
            return self._error(401 if token is None else 403, "GatedRepo",
                               f"Access to model {repo} is restricted: you must have access "
                               "to it and be authenticated to access it", head)
        commit = meta["refs"].get(rev)
        if commit is None and SHA_RE.match(rev) and (self.standin.repo_dir(repo) / rev).is_dir():
            commit = rev
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        folder = self.standin.repo_dir(repo) / commit
        if kind == "info":
            return self._info(repo, meta, commit, folder, "blobs" in query
                              and query["blobs"][0].lower() == "true")
        if kind == "tree":
            return self._tree(folder, file, query.get("recursive", ["false"])[0].lower() == "true")
        return self._resolve(folder, commit, file, head)

    # endpoints --------------------------------------------------------------------------
    @staticmethod
    def _files(folder: Path) -> list[tuple[str, Path]]:
        return sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*")
                      if p.is_file())

    def _info(self, repo, meta, commit, folder, blobs: bool) -> None:
        siblings = []
        for name, path in self._files(folder):
            entry = {"rfilename": name}
            if blobs:
                data = path.read_bytes()
                if is_lfs(name):
                    pointer = lfs_pointer(data)
                    entry.update(size=len(data), blobId=git_blob_sha1(pointer),
                                 lfs={"sha256": hashlib.sha256(data).hexdigest(),
                                      "size": len(data), "pointerSize": len(pointer)})
                else:
                    entry.update(size=len(data), blobId=git_blob_sha1(data))
            siblings.append(entry)
        self._json({"_id": hashlib.sha1(repo.encode()).hexdigest()[:24], "id": repo,
                    "modelId": repo, "author": repo.split("/")[0], "sha": commit,
                    "private": meta["private"], "gated": "manual" if meta["gated"] else False,
                    "disabled": False, "tags": [], "siblings": siblings})

    def _tree(self, folder: Path, sub: str | None, recursive: bool) -> None:
        base = folder / sub if sub else folder
        if not base.is_dir():
            return self._error(404, "EntryNotFound", f"{sub} does not exist")
        out = []
        for path in sorted(base.rglob("*") if recursive else base.iterdir()):
            name = path.relative_to(folder).as_posix()
            if path.is_dir():
                out.append({"type": "directory", "oid": hashlib.sha1(name.encode()).hexdigest(),
                            "size": 0, "path": name})
                continue
            data = path.read_bytes()
            if is_lfs(name):
                pointer = lfs_pointer(data)
                out.append({"type": "file", "oid": git_blob_sha1(pointer), "size": len(data),
                            "path": name, "lfs": {"oid": hashlib.sha256(data).hexdigest(),
                                                  "size": len(data),
                                                  "pointerSize": len(pointer)}})
            else:
                out.append({"type": "file", "oid": git_blob_sha1(data), "size": len(data),
                            "path": name})
        self._json(out)

    def _resolve(self, folder: Path, commit: str, name: str, head: bool) -> None:
        path = folder / name
        if not name or not path.is_file() or folder.resolve() not in path.resolve().parents:
            return self._error(404, "EntryNotFound", f"{name} does not exist at {commit}", head,
                               {"X-Repo-Commit": commit})
        data = path.read_bytes()
        size = len(data)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if is_lfs(name):
            digest = hashlib.sha256(data).hexdigest()
            headers.update({"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"',
                            "X-Linked-Size": size})
        else:
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
        wanted = self.headers.get("Range")
        status, body = 200, data
        if wanted:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
            start = end = None
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:
                    start, end = max(size - int(m.group(2)), 0), size - 1
            if start is None or start >= size or end < start:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, headers, b"", head)
            status, body = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = len(body)
        self._send(status, headers, body, head)
