"""Extraction of an upload into a temporary directory: loose files, or one .zip / .tar.gz /
.tgz archive, with every member checked before a byte of it is written (names, extensions,
regular files only, no encryption, duplicates, the number of files) and sizes capped both
as declared and as actually read. Problems are collected, at most a few per file."""
from __future__ import annotations

import gzip
import hashlib
import os
import stat
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from worker.checkpoint.names import (archive_kind, extension_problem, is_extra, is_held_code,
                                     is_junk, normalise_name)
from worker.checkpoint.results import Problem, Upload

DEFAULT_MAX_FILES = 256
MAX_PROBLEMS_PER_FILE = 50
CHUNK = 1 << 20


class _TooBig(Exception):
    pass


class _CappedReader:
    """A read-only stream that raises _TooBig once more than ``cap`` bytes were read."""

    def __init__(self, raw, cap: int):
        self.raw = raw
        self.cap = cap
        self.count = 0

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.cap - self.count + 1
        data = self.raw.read(min(n, self.cap - self.count + 1))
        self.count += len(data)
        if self.count > self.cap:
            raise _TooBig()
        return data

    def readable(self):
        return True


def _chunks(stream):
    while chunk := stream.read(CHUNK):
        yield chunk


def _read_source(source):
    """An open binary stream for a path or a file object, and whether we opened it."""
    if isinstance(source, (str, os.PathLike)):
        return open(source, "rb"), True
    if hasattr(source, "seek"):
        try:
            source.seek(0)
        except (OSError, ValueError):
            pass
    return source, False


@dataclass
class _Entry:
    raw_name: str          # normalised name before stripping a common top folder
    path: Path
    size: int
    sha256: str
    source: str
    member: str | None
    name: str = ""


class Extraction:
    """The files of one upload, written under ``tmp`` (a new temporary directory under
    ``tmp_root``) as ``entries``, and the problems found; ``aborted`` when a problem ends
    the extraction (a size or count limit, or a mix of archives and files)."""

    def __init__(self, max_total_bytes: int, max_files: int, tmp_root):
        self.limit = int(max_total_bytes)
        self.max_files = max_files
        self.problems: list[Problem] = []
        self._per_file: dict[tuple, int] = {}
        self.entries: list[_Entry] = []
        self.names: set[str] = set()
        self.ignored: list[str] = []
        self.dropped: list[str] = []   # published extras (names.EXTRA_FILES), never opened
        self.held_code: list[tuple[str, str | None, str]] = []  # (file, member, name) of .py
        self.total = 0
        self.aborted = False
        self.tmp = Path(tempfile.mkdtemp(prefix="specboard-validate-", dir=tmp_root))
        self.files_dir = self.tmp / "files"
        self.files_dir.mkdir()

    # problems ---------------------------------------------------------------------------
    def add(self, file: str, fld: str, message: str, member: str | None = None):
        key = (file, member)
        n = self._per_file.get(key, 0) + 1
        self._per_file[key] = n
        if n <= MAX_PROBLEMS_PER_FILE:
            self.problems.append(Problem(file, fld, message, member))
        elif n == MAX_PROBLEMS_PER_FILE + 1:
            self.problems.append(Problem(file, "problems", "more problems in this file were "
                                         "not listed: fix the ones above and upload again", member))

    def too_big(self, file: str, member: str | None, what: str):
        self.add(file, "size", f"{what} exceeds the upload limit of {self.limit} bytes "
                 f"({human_size(self.limit)}): upload a smaller checkpoint (bf16 weights, only "
                 "the drafter's own tensors)", member)
        self.aborted = True

    def set_aside(self, file: str, member: str | None, name: str) -> bool:
        """Whether the file is left out unread: operating-system junk (ignored), a published
        checkpoint's extra (dropped with a note), or Python code (held: the checkpoint's
        format decides between a note and a refusal, worker/checkpoint/formats.py)."""
        if is_junk(name):
            self.ignored.append(name)
        elif is_extra(name):
            self.dropped.append(name)
        elif is_held_code(name):
            self.held_code.append((file, member, name))
        else:
            return False
        return True

    # writing ----------------------------------------------------------------------------
    def accept_name(self, file: str, member: str | None, name: str) -> bool:
        """Name/extension/duplicate/count checks before any byte of the file is read."""
        problem = extension_problem(name)
        if problem:
            self.add(file, "extension", problem, member)
            return False
        if name in self.names:
            self.add(file, "path", f"'{name}' appears twice: keep one copy", member)
            return False
        if len(self.names) >= self.max_files:
            self.add(file, "files", f"more than {self.max_files} files: a checkpoint needs a "
                     "config.json and a few .safetensors shards", member)
            self.aborted = True
            return False
        self.names.add(name)
        return True

    def write(self, stream, name: str, file: str, member: str | None,
              declared: int | None = None) -> None:
        dest = self.files_dir / name
        if self.files_dir.resolve() not in dest.resolve().parents:  # belt and braces
            self.add(file, "path", "the path leaves the checkpoint folder", member)
            return
        h = hashlib.sha256()
        n = 0
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "xb") as out:
                for chunk in _chunks(stream):
                    n += len(chunk)
                    if self.total + n > self.limit:
                        break
                    if declared is not None and n > declared:
                        break
                    h.update(chunk)
                    out.write(chunk)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            self.add(file, "path", f"'{name}' clashes with another file or folder of the "
                     "same name: rename one of them", member)
            return
        if self.total + n > self.limit:
            dest.unlink(missing_ok=True)
            self.too_big(file, member, "the data actually read")
            return
        if declared is not None and n != declared:
            dest.unlink(missing_ok=True)
            self.add(file, "size", f"declared size {declared} bytes but {n} bytes were read: "
                     "the upload is truncated or its header lies; upload it again", member)
            if n > declared:
                self.aborted = True
            return
        self.total += n
        self.entries.append(_Entry(name, dest, n, h.hexdigest(), file, member))

    # inputs -----------------------------------------------------------------------------
    def collect(self, uploads: list[Upload]) -> None:
        """Extract one archive, or each loose file; then strip a folder that holds everything."""
        archives = [u for u in uploads if archive_kind(u.name)]
        if archives and len(uploads) > 1:
            for u in uploads:
                self.add(u.name, "files", "upload either one archive (.zip, .tar.gz, .tgz) or "
                         "loose files, not several archives or an archive with other files")
            self.aborted = True
            return
        if archives:
            up = archives[0]
            if archive_kind(up.name) == "zip":
                self.take_zip(up)
            else:
                self.take_tar(up)
        else:
            for up in uploads:
                self.take_loose(up)
                if self.aborted:
                    return
        self.strip_common_folder()

    def take_loose(self, up: Upload):
        name, problem = normalise_name(up.name)
        if problem:
            self.add(str(up.name), "path", problem)
            return
        if self.set_aside(up.name, None, name):
            return
        if not self.accept_name(up.name, None, name):
            return
        if up.size is not None and self.total + up.size > self.limit:
            self.too_big(up.name, None, f"the uploads' total size ({human_size(self.total + up.size)}+)")
            return
        try:
            stream, opened = _read_source(up.source)
        except OSError as e:
            self.add(up.name, "file", f"cannot be read ({e.strerror or e}): upload it again")
            return
        try:
            self.write(stream, name, up.name, None, declared=up.size)
        finally:
            if opened:
                stream.close()

    def spool_archive(self, up: Upload) -> Path | None:
        """A path for the archive: the given path, or a copy of the file object in tmp."""
        if up.size is not None and up.size > self.limit:
            self.too_big(up.name, None, f"the archive ({human_size(up.size)})")
            return None
        if isinstance(up.source, (str, os.PathLike)):
            path = Path(up.source)
            try:
                size = path.stat().st_size
            except OSError as e:
                self.add(up.name, "file", f"cannot be read ({e.strerror or e}): upload it again")
                return None
            if size > self.limit:
                self.too_big(up.name, None, f"the archive ({human_size(size)})")
                return None
            return path
        dest = self.tmp / "archive"
        stream, _ = _read_source(up.source)
        n = 0
        with open(dest, "wb") as out:
            for chunk in _chunks(stream):
                n += len(chunk)
                if n > self.limit:
                    self.too_big(up.name, None, "the archive")
                    return None
                out.write(chunk)
        return dest

    def member_name(self, file: str, raw: str, kind: str, link: str = "") -> str | None:
        """The name to extract an archive member of this ``kind`` (``_zip_member_kind``,
        ``_tar_member_kind``) under; None for a folder, ignored junk, or a refused member
        (the problems recorded: its name, and any kind but a regular file or a folder)."""
        name = None
        if not (kind == "dir" and raw.strip("/") in ("", ".")):  # not the root folder "./"
            name, problem = normalise_name(raw)
            if problem:
                self.add(file, "path", problem, raw)
        if kind not in ("file", "dir"):
            self.add(file, "type", f"the member is a {kind}{link}: only regular files are "
                     "accepted; put the file itself in the archive", raw)
            return None
        if name is None or kind == "dir":
            return None
        if self.set_aside(file, raw, name):
            return None
        return name

    def take_zip(self, up: Upload):
        path = self.spool_archive(up)
        if path is None:
            return
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as e:
            self.add(up.name, "archive", f"not a readable zip file ({e}): re-create the archive")
            return
        with zf:
            infos = zf.infolist()
            if len(infos) > 4 * self.max_files:
                self.add(up.name, "files", f"{len(infos)} archive members: at most "
                         f"{self.max_files} files are accepted")
                self.aborted = True
                return
            todo = []
            for info in infos:
                kind = _zip_member_kind(info, info.external_attr >> 16)
                name = self.member_name(up.name, info.filename, kind)
                if name is None:
                    continue
                if info.flag_bits & 0x1:
                    self.add(up.name, "encryption", "the member is encrypted: upload an "
                             "archive without a password", info.filename)
                    continue
                if self.accept_name(up.name, info.filename, name):
                    todo.append((info, name))
            if self.aborted:
                return
            declared = sum(info.file_size for info, _ in todo)
            if declared > self.limit:
                self.too_big(up.name, None, f"the archive's declared content ({human_size(declared)})")
                return
            for info, name in todo:
                try:
                    with zf.open(info) as stream:
                        self.write(stream, name, up.name, info.filename, declared=info.file_size)
                except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError,
                        RuntimeError) as e:
                    (self.files_dir / name).unlink(missing_ok=True)
                    self.entries = [x for x in self.entries if x.raw_name != name]
                    self.add(up.name, "archive", f"the member is corrupt ({e}); its data do not "
                             "match its header: re-create the archive", info.filename)
                if self.aborted:
                    return

    def take_tar(self, up: Upload):
        path = self.spool_archive(up)
        if path is None:
            return
        # the decompressed stream as a whole (headers, long names, padding) is capped too
        cap = self.limit + 2048 * 4 * self.max_files + (1 << 20)
        declared = 0
        members = 0
        try:
            with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                capped = _CappedReader(gz, cap)
                with tarfile.open(fileobj=capped, mode="r|") as tf:
                    for m in tf:
                        members += 1
                        if members > 4 * self.max_files:
                            self.add(up.name, "files", f"more than {4 * self.max_files} archive "
                                     f"members: at most {self.max_files} files are accepted")
                            self.aborted = True
                            return
                        link = f" to '{m.linkname}'" if m.issym() or m.islnk() else ""
                        name = self.member_name(up.name, m.name, _tar_member_kind(m), link)
                        if name is None:
                            continue
                        if not self.accept_name(up.name, m.name, name):
                            if self.aborted:
                                return
                            continue
                        declared += m.size
                        if declared > self.limit:
                            self.too_big(up.name, m.name, "the archive's declared content "
                                         f"({human_size(declared)} so far)")
                            return
                        stream = tf.extractfile(m)
                        self.write(stream, name, up.name, m.name, declared=m.size)
                        if self.aborted:
                            return
        except _TooBig:
            self.too_big(up.name, None, "the decompressed archive stream")
        except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, OSError, ValueError) as e:
            self.add(up.name, "archive", f"not a readable .tar.gz ({type(e).__name__}: {e}): "
                     "re-create it with `tar czf drafter.tar.gz -C checkpoint_dir .`")

    # after extraction ---------------------------------------------------------------
    def strip_common_folder(self):
        if not self.entries:
            return
        firsts = {e.raw_name.split("/", 1)[0] for e in self.entries}
        strip = len(firsts) == 1 and all("/" in e.raw_name for e in self.entries)
        prefix = next(iter(firsts)) + "/" if strip else ""
        for e in self.entries:
            e.name = e.raw_name[len(prefix):]
        if prefix:
            cut = (lambda n: n[len(prefix):] if n.startswith(prefix) else n)
            self.dropped = [cut(n) for n in self.dropped]
            self.held_code = [(f, m, cut(n)) for f, m, n in self.held_code]


def _zip_member_kind(info: zipfile.ZipInfo, mode: int) -> str:
    if info.is_dir():
        return "dir"
    if info.create_system == 3 and mode:   # unix attributes
        fmt = stat.S_IFMT(mode)
        if fmt == 0 or stat.S_ISREG(mode):
            return "file"
        if stat.S_ISDIR(mode):
            return "dir"
        if stat.S_ISLNK(mode):
            return "symbolic link"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            return "device"
        if stat.S_ISFIFO(mode):
            return "FIFO"
        if stat.S_ISSOCK(mode):
            return "socket"
        return "special file"
    return "file"


def _tar_member_kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "symbolic link"
    if m.islnk():
        return "hard link"
    if m.ischr() or m.isblk():
        return "device"
    if m.isfifo():
        return "FIFO"
    if m.issparse():
        return "sparse file"
    if m.isdir():
        return "dir"
    if m.isreg():
        return "file"
    return "special file"


def human_size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


