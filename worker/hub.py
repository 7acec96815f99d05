"""Drafters by model-hub reference (``owner/name`` or ``owner/name@revision``): the revision
pinned to a commit, the files judged by name and size and the safetensors headers read
remotely before anything is downloaded, then only the accepted files downloaded at that
commit, checked against the listing, and handed to ``validate_checkpoint``. No Django here.

    repo_id, revision = parse_reference("RedHatAI/x-speculator.eagle3@main")
    ckpt = inspect(repo_id, revision, token=settings_token, max_total_bytes=cap)  # no download
    ...store ckpt.commit (the run measures exactly that commit), ckpt.as_dict()...
    uploads = download(ckpt, empty_dir)
    with validate_checkpoint(uploads, method, target, max_total_bytes=cap) as validated: ...

Every network call goes through ``huggingface_hub`` (its own HTTP code, retries and error
mapping) against ``endpoint``, else the ``HF_ENDPOINT`` environment variable, else the
public hub:

- ``HfApi.model_info(files_metadata=True)``: the commit sha the revision resolves to, and
  every file with its size and blob/LFS id;
- ``HfApi.parse_safetensors_file_metadata`` (what ``get_safetensors_metadata`` calls per
  file; called here for every ``.safetensors`` file to be fetched, whatever its name:
  ``get_safetensors_metadata`` itself only finds ``model.safetensors`` or a
  ``model.safetensors.index.json``, and downloads the index into the user's cache): two
  range reads per file at most, no tensor data;
- ``snapshot_download(revision=<commit>, allow_patterns=<exact names>, local_dir=dest)``.

Files are judged by the SAME name rules as an upload (worker/checkpoint/names.py): junk is
ignored, published extras (README.md, .gitattributes, training state...) dropped, ``.py``
held as code, all three never downloaded; ``.json``, ``.safetensors`` and the convertible
published weights (``pytorch_model.bin``, ``medusa_lm_head.pt``) are fetched; anything else
is refused with the upload's message. ``download`` returns the set-aside files as
name-only ``Upload``s (an empty stream that validation never reads, since it sets them
aside by name too), so that validation lists them exactly as for an upload: junk ignored,
extras in the notes, code dropped with a note in a ``speculators`` checkpoint and refused
as remote code in any other (``auto_map`` is checked by the content checks as usual).

Refusals the submitter can fix are ``Problem``s raised as ``CheckpointRejected``: unknown
repository or revision, gated or private without a token (the token is the setting
``SPECBOARD_HF_TOKEN``), a file or the total over the cap, a refused file type, an
unreadable safetensors header. Failures that are not the submitter's (the hub unreachable
or failing, a bad configured token, a download that does not match the listing) are
``HubError``: the caller retries later rather than counting a refusal.

Telemetry is off (``HF_HUB_DISABLE_TELEMETRY``; the user agent carries no torch version or
agent detection) and the calls draw no progress bars. Without a token, none is sent: the
library's implicit token (``HF_TOKEN``, ``~/.cache/huggingface/token``) is never used.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import httpx2  # noqa: E402  (huggingface_hub's HTTP client)
from huggingface_hub import HfApi, snapshot_download  # noqa: E402
from huggingface_hub import constants as hf_constants  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
)
from huggingface_hub.utils import tqdm as hf_tqdm  # noqa: E402

from worker.checkpoint.archives import DEFAULT_MAX_FILES, human_size  # noqa: E402
from worker.checkpoint.names import (extension_problem, is_extra, is_held_code,  # noqa: E402
                                     is_junk, normalise_name)
from worker.checkpoint.results import CheckpointRejected, Problem, Upload  # noqa: E402

# Read by huggingface_hub when it builds each request's user agent; it may have been
# imported (by transformers) before the environment default above was set.
hf_constants.HF_HUB_DISABLE_TELEMETRY = True

TOKEN_SETTING = "SPECBOARD_HF_TOKEN"
LIBRARY = "specboard"
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# The hub's repo id rules (huggingface_hub.utils.validate_repo_id, with the namespace
# required): each part 1-96 of letters, digits, "-", "_", "."; starting and ending with a
# letter, digit or "_"; no "--" or ".."; the name not ending in ".git".
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
REPO_ID_RE = re.compile(rf"^{_PART}/{_PART}$")
# A branch, a tag or a commit: git ref name characters, strictly.
REVISION_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,255}$")
# Where snapshot_download(local_dir=...) keeps its own bookkeeping: never a checkpoint file.
LOCAL_DIR_META = ".cache/"
WHERE = "(hub)"


class HubError(RuntimeError):
    """The hub could not answer as it should, through no fault of the submitter (not
    reachable, a server error, rate limiting, the configured token refused, a download
    that does not match the listing): retry later; not a refusal of the drafter."""


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    blob_id: str | None = None      # git blob sha1 (of the LFS pointer for an LFS file)
    lfs_sha256: str | None = None   # sha256 of the content, for an LFS file

    def as_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "blob_id": self.blob_id,
                "lfs_sha256": self.lfs_sha256}


@dataclass
class HubCheckpoint:
    """What ``inspect`` found, nothing downloaded yet. ``commit`` is what is measured."""
    repo_id: str
    revision: str                      # as submitted: a branch, a tag or the commit
    commit: str                        # the 40-hex commit sha it resolved to
    files: list[HubFile]               # to download: accepted by name, within the cap
    ignored: list[str] = field(default_factory=list)    # operating-system junk
    dropped: list[str] = field(default_factory=list)    # published extras (names.EXTRA_FILES)
    held_code: list[str] = field(default_factory=list)  # .py files: never downloaded or run
    # per .safetensors file, read remotely: {tensor name: (dtype, shape)}
    tensors: dict[str, dict[str, tuple[str, list[int]]]] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    notes: list[str] = field(default_factory=list)
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)  # never in as_dict

    @property
    def reference(self) -> str:
        return f"{self.repo_id}@{self.commit}"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensor_names(self) -> list[str]:
        return sorted(t for header in self.tensors.values() for t in header)

    def as_dict(self) -> dict:
        """JSON-ready, without the token (``from_dict`` takes it again)."""
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
                "files": [f.as_dict() for f in self.files], "ignored": list(self.ignored),
                "dropped": list(self.dropped), "held_code": list(self.held_code),
                "tensors": {f: {t: [d, list(s)] for t, (d, s) in h.items()}
                            for f, h in self.tensors.items()},
                "gated": self.gated, "private": self.private, "notes": list(self.notes),
                "endpoint": self.endpoint, "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, data: dict, *, token: str | None = None) -> "HubCheckpoint":
        return cls(repo_id=data["repo_id"], revision=data["revision"], commit=data["commit"],
                   files=[HubFile(**f) for f in data["files"]],
                   ignored=list(data.get("ignored", [])), dropped=list(data.get("dropped", [])),
                   held_code=list(data.get("held_code", [])),
                   tensors={f: {t: (d, list(s)) for t, (d, s) in h.items()}
                            for f, h in data.get("tensors", {}).items()},
                   gated=bool(data.get("gated")), private=bool(data.get("private")),
                   notes=list(data.get("notes", [])), endpoint=data.get("endpoint"),
                   token=token)


# ------------------------------------------------------------------------------------
# the reference


def check_repo_id(repo_id) -> str:
    if not isinstance(repo_id, str) or not REPO_ID_RE.match(repo_id) or "--" in repo_id \
            or ".." in repo_id or repo_id.endswith(".git"):
        raise ValueError(
            f"{repo_id!r} is not a model repository id: give owner/name (letters, digits, "
            "'-', '_' and '.', at most 96 characters each, starting and ending with a letter, "
            "a digit or '_', no '--' or '..'), e.g. RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3")
    return repo_id


def check_revision(revision) -> str:
    if (not isinstance(revision, str) or not REVISION_RE.match(revision) or ".." in revision
            or "//" in revision or revision.startswith(("/", ".", "-"))
            or revision.endswith(("/", ".", ".lock"))):
        raise ValueError(
            f"{revision!r} is not a revision: give a branch or tag name (letters, digits, "
            "'-', '_', '.', '/') or a full 40-character commit hash")
    return revision


def parse_reference(text) -> tuple[str, str]:
    """``owner/name`` or ``owner/name@revision`` -> (repo_id, revision); the revision
    defaults to ``main``. ValueError with a sentence for the submitter otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("give a model repository as owner/name, or owner/name@revision "
                         "(a branch, a tag or a commit hash)")
    repo_id, at, revision = text.strip().partition("@")
    if at and not revision:
        raise ValueError(f"{text.strip()!r} ends with '@': give the revision after it (a "
                         "branch, a tag or a commit hash), or leave '@' out for main")
    return check_repo_id(repo_id), check_revision(revision if at else "main")


# ------------------------------------------------------------------------------------
# inspect


def inspect(repo_id: str, revision: str = "main", *, token: str | None = None,
            max_total_bytes: int, endpoint: str | None = None,
            max_files: int = DEFAULT_MAX_FILES) -> HubCheckpoint:
    """Resolve ``revision`` to its commit, judge every file of that commit by name and
    size, and read the headers of the ``.safetensors`` files to be fetched, without
    downloading any file. Raises ``CheckpointRejected`` (the submitter's to fix),
    ``HubError`` (retry later) or ValueError (a malformed id or revision)."""
    check_repo_id(repo_id)
    check_revision(revision)
    token = token or None
    endpoint = _endpoint(endpoint)
    api = _api(endpoint, token)
    ctx = _Context(repo_id, revision, token, endpoint)

    with ctx.mapped():
        info = api.model_info(repo_id, revision=revision, files_metadata=True,
                              token=_auth(token))
    commit = info.sha
    if not isinstance(commit, str) or not COMMIT_RE.match(commit):
        raise HubError(f"the hub answered for {repo_id}@{revision} without a commit hash "
                       f"({commit!r})")
    if COMMIT_RE.match(revision) and commit != revision:
        raise HubError(f"the hub resolved commit {revision} of {repo_id} to another commit "
                       f"({commit})")
    ckpt = HubCheckpoint(repo_id, revision, commit, [], gated=bool(info.gated),
                         private=bool(info.private), endpoint=endpoint, token=token)
    if ckpt.gated and token is None:
        raise CheckpointRejected([ctx.gated_problem()])

    problems: list[Problem] = []
    fetch: list[HubFile] = []
    for sib in sorted(info.siblings or [], key=lambda s: s.rfilename):
        name, why = normalise_name(sib.rfilename)
        if why:
            problems.append(Problem(str(sib.rfilename), "path", why))
            continue
        if name.startswith(LOCAL_DIR_META):
            ckpt.notes.append(f"not downloaded: {name} (a cache folder, not part of a "
                              "checkpoint)")
            continue
        if is_junk(name):
            ckpt.ignored.append(name)
            continue
        if is_extra(name):
            ckpt.dropped.append(name)
            continue
        if is_held_code(name):
            ckpt.held_code.append(name)
            continue
        why = extension_problem(name)
        if why:
            problems.append(Problem(name, "extension", why))
            continue
        if not isinstance(sib.size, int) or sib.size < 0:
            raise HubError(f"the hub listed {name} of {repo_id}@{commit} without a size")
        fetch.append(HubFile(name, sib.size, sib.blob_id,
                             sib.lfs.sha256 if sib.lfs is not None else None))
    if len(fetch) > max_files:
        problems.append(Problem(WHERE, "files", f"{len(fetch)} files to download: at most "
                                f"{max_files} are accepted (a config.json and a few "
                                ".safetensors shards)"))
    limit = int(max_total_bytes)
    for f in fetch:
        if f.size > limit:
            problems.append(Problem(f.name, "size", f"{f.size} bytes ({human_size(f.size)}) "
                                    f"exceeds the upload limit of {limit} bytes "
                                    f"({human_size(limit)}); nothing was downloaded: publish a "
                                    "smaller checkpoint (bf16 weights, only the drafter's own "
                                    "tensors)"))
    total = sum(f.size for f in fetch)
    if total > limit and not any(p.field == "size" for p in problems):
        problems.append(Problem(WHERE, "size", f"the files to download total {total} bytes "
                                f"({human_size(total)}), over the upload limit of {limit} "
                                f"bytes ({human_size(limit)}); nothing was downloaded: publish "
                                "a smaller checkpoint"))
    if not fetch and not problems:
        problems.append(Problem(WHERE, "files", f"{repo_id}@{commit} has no checkpoint files "
                                "(config.json and .safetensors weights)"))
    if problems:
        raise CheckpointRejected(problems)
    ckpt.files = fetch

    for f in fetch:
        if not f.name.endswith(".safetensors"):
            continue
        try:
            with ctx.mapped():
                meta = api.parse_safetensors_file_metadata(repo_id, f.name, revision=commit,
                                                           token=_auth(token))
        except SafetensorsParsingError as e:
            problems.append(Problem(f.name, "header", f"the safetensors header could not be "
                                    f"read: {e}"))
            continue
        if not meta.tensors:
            problems.append(Problem(f.name, "header", "the safetensors file holds no tensor"))
        ckpt.tensors[f.name] = {t: (i.dtype, list(i.shape)) for t, i in meta.tensors.items()}
    if problems:
        raise CheckpointRejected(problems)
    if ckpt.dropped:
        ckpt.notes.append("not downloaded (vLLM does not use them): " + ", ".join(ckpt.dropped))
    if ckpt.held_code:
        ckpt.notes.append("code files, not downloaded and never run: "
                          + ", ".join(ckpt.held_code))
    return ckpt


# ------------------------------------------------------------------------------------
# download


def download(checkpoint: HubCheckpoint, dest_dir) -> list[Upload]:
    """Download ``checkpoint.files`` at ``checkpoint.commit`` into ``dest_dir`` (created, or
    empty) and check each against the listing (size, then sha256 or git blob id). Returns
    ``Upload``s for ``validate_checkpoint``: each downloaded file, then the files set aside
    by name (junk, extras, code) as name-only uploads with an empty stream, which
    validation sets aside unread (see the module's docstring). On any failure ``dest_dir``
    is emptied again and the error raised (``CheckpointRejected`` or ``HubError``)."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty: download into a folder of its own")
    ctx = _Context(checkpoint.repo_id, checkpoint.revision, checkpoint.token,
                   _endpoint(checkpoint.endpoint))
    try:
        if checkpoint.files:
            with tempfile.TemporaryDirectory(prefix="specboard-hub-cache-") as cache, \
                    ctx.mapped():
                snapshot_download(
                    checkpoint.repo_id, revision=checkpoint.commit,
                    allow_patterns=[_exact_pattern(f.name) for f in checkpoint.files],
                    local_dir=dest, cache_dir=cache, token=_auth(checkpoint.token),
                    endpoint=ctx.endpoint, library_name=LIBRARY, tqdm_class=_Quiet,
                    max_workers=4)
        shutil.rmtree(dest / LOCAL_DIR_META, ignore_errors=True)
        _verify(checkpoint, dest)
    except BaseException:
        _empty(dest)
        raise
    uploads = [Upload(f.name, dest / f.name, f.size) for f in checkpoint.files]
    uploads += [Upload(name, io.BytesIO(b""), 0)
                for name in (*checkpoint.ignored, *checkpoint.dropped, *checkpoint.held_code)]
    return uploads


def _verify(checkpoint: HubCheckpoint, dest: Path) -> None:
    expected = {f.name: f for f in checkpoint.files}
    found = {p.relative_to(dest).as_posix() for p in dest.rglob("*")
             if p.is_file() or p.is_symlink()}
    where = f"{checkpoint.repo_id}@{checkpoint.commit}"
    if found != set(expected):
        missing, extra = sorted(set(expected) - found), sorted(found - set(expected))
        raise HubError(f"the download of {where} does not match its listing: "
                       + "; ".join(x for x in (missing and f"missing {', '.join(missing)}",
                                               extra and f"unexpected {', '.join(extra)}") if x))
    for name, f in expected.items():
        path = dest / name
        if path.is_symlink() or not path.is_file():
            raise HubError(f"{name} of {where} was not downloaded as a regular file")
        size = path.stat().st_size
        if size != f.size:
            raise HubError(f"{name} of {where}: {size} bytes downloaded, the listing says "
                           f"{f.size}")
        if f.lfs_sha256:
            got, want = _digest(path, hashlib.sha256()), f.lfs_sha256
        elif f.blob_id:
            got, want = _digest(path, hashlib.sha1(b"blob %d\0" % size)), f.blob_id
        else:
            continue
        if got != want.lower():
            raise HubError(f"{name} of {where}: the downloaded bytes do not match the "
                           "listing's hash")


def _digest(path: Path, h) -> str:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _empty(dest: Path) -> None:
    for p in dest.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------
# plumbing


class _Quiet(hf_tqdm):
    """No progress bars, whatever the environment says (TQDM_POSITION=-1 included)."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _endpoint(endpoint: str | None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")


def _auth(token: str | None):
    # False, not None: None would make huggingface_hub send the machine's implicit token.
    return token if token else False


def _api(endpoint: str, token: str | None) -> HfApi:
    return HfApi(endpoint=endpoint, token=_auth(token), library_name=LIBRARY)


def _exact_pattern(name: str) -> str:
    """An fnmatch pattern (snapshot_download's allow_patterns) matching ``name`` only."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


class _Context:
    """Turns huggingface_hub's exceptions into the submitter's Problems or a HubError."""

    def __init__(self, repo_id: str, revision: str, token: str | None, endpoint: str):
        self.repo_id, self.revision, self.token, self.endpoint = repo_id, revision, token, endpoint
        self.host = urlsplit(endpoint).netloc or endpoint

    def gated_problem(self) -> Problem:
        if self.token is None:
            msg = (f"{self.repo_id} is gated on {self.host}: its files can be downloaded only "
                   "with an access token of an account that has been granted access, and "
                   f"this site has none configured (the setting {TOKEN_SETTING})")
        else:
            msg = (f"{self.repo_id} is gated on {self.host} and the account of the token "
                   f"configured in {TOKEN_SETTING} has not been granted access: request "
                   "access on the repository's page with that account")
        return Problem(WHERE, "access", msg)

    def not_found_problem(self) -> Problem:
        if self.token is None:
            msg = (f"repository {self.repo_id} was not found on {self.host}: check the owner "
                   "and the name; a private repository can be read only with an access "
                   f"token, and this site has none configured (the setting {TOKEN_SETTING})")
        else:
            msg = (f"repository {self.repo_id} was not found on {self.host}, or it is "
                   f"private and the token configured in {TOKEN_SETTING} cannot read it: "
                   "check the owner and the name")
        return Problem(WHERE, "repository", msg)

    def mapped(self):
        return _Mapped(self)


class _Mapped:
    def __init__(self, ctx: _Context):
        self.ctx = ctx

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            return False
        ctx = self.ctx
        if isinstance(exc, (CheckpointRejected, HubError, SafetensorsParsingError, ValueError)) \
                and not isinstance(exc, HfHubHTTPError):
            return False
        if isinstance(exc, RevisionNotFoundError):
            raise CheckpointRejected([Problem(WHERE, "revision", (
                f"revision {ctx.revision!r} does not exist in {ctx.repo_id}: give a branch, a "
                "tag or a full commit hash of the repository"))]) from None
        if isinstance(exc, GatedRepoError):
            raise CheckpointRejected([ctx.gated_problem()]) from None
        if isinstance(exc, DisabledRepoError):
            raise CheckpointRejected([Problem(WHERE, "repository", (
                f"repository {ctx.repo_id} is disabled on {ctx.host}: it cannot be "
                "downloaded"))]) from None
        if isinstance(exc, RepositoryNotFoundError):
            raise CheckpointRejected([ctx.not_found_problem()]) from None
        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else None
            if status in (401, 403):
                raise HubError(f"{ctx.host} refused the request for {ctx.repo_id} ({status}): "
                               f"check the token configured in {TOKEN_SETTING}") from exc
            raise HubError(f"{ctx.host} failed for {ctx.repo_id} ({status}): try again "
                           "later") from exc
        if isinstance(exc, (httpx2.HTTPError, OfflineModeIsEnabled, OSError)):
            raise HubError(f"a request to {ctx.host} for {ctx.repo_id} failed "
                           f"({type(exc).__name__}: {exc}): try again later") from exc
        return False
