"""The archive format: reproducible .tar.gz and .zip files, read back safely.

Archives are reproducible: sorted entries, one mtime, uid/gid 0 with no
names, fixed modes, and a gzip header with mtime 0 and no file name. Reading
gives every member with its contents (dfbuild's archives are small);
`unsafe_member` says why a member name must not be extracted.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import ArchiveError, ReleaseError, VerifyError

ARCHIVE_SUFFIXES = (".tar.gz", ".zip")
ZIP_EPOCH_MIN = 315532800            # 1980-01-01: the earliest date a zip entry can hold


def archive_root(name: str) -> str:
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name



@dataclass(frozen=True)
class Entry:
    """One file of the archive, relative to its root directory."""

    path: str                     # posix, e.g. "bin/llama-server"
    mode: int = 0o644
    source: Path | None = None    # a file on disk ...
    data: bytes | None = None     # ... or bytes
    link: str | None = None       # a symlink to a sibling (shared library version links)

    def read(self) -> bytes:
        return self.data if self.data is not None else Path(self.source).read_bytes()



def _resolve_link(entries_by_path: dict[str, Entry], entry: Entry) -> Entry:
    seen = set()
    while entry.link is not None:
        if entry.path in seen:
            raise ReleaseError(f"symlink loop at {entry.path}", "rebuild with --fresh")
        seen.add(entry.path)
        target = str(PurePosixPath(entry.path).parent / entry.link)
        if target not in entries_by_path:
            raise ReleaseError(f"{entry.path} links to {entry.link}, which is not shipped", "rebuild with --fresh")
        entry = entries_by_path[target]
    return entry



# --- archives ----------------------------------------------------------------------


def unsafe_member(name: str) -> str | None:
    """Why an archive member name is unsafe to extract, or None."""
    posix = name.replace("\\", "/")
    if not posix or posix.startswith("/") or re.match(r"^[A-Za-z]:", posix):
        return f"{name!r} is an absolute path"
    if ".." in PurePosixPath(posix).parts:
        return f"{name!r} climbs out with '..'"
    return None


def _member_name(root: str | None, path: str) -> str:
    return f"{root}/{path}" if root else path


def _directories(root: str | None, entries: list[Entry]) -> list[str]:
    if not root:  # a flat archive (the CUDA runtime bundle): files only
        return []
    dirs = {root}
    for entry in entries:
        parent = PurePosixPath(root, entry.path).parent
        while str(parent) != root and str(parent) != ".":
            dirs.add(str(parent))
            parent = parent.parent
    return sorted(dirs)


def _check_names(root: str | None, entries: list[Entry]) -> None:
    for entry in entries:
        problem = unsafe_member(entry.path) or unsafe_member(_member_name(root, entry.path))
        if problem:
            raise ReleaseError(f"refusing to archive {problem}", "this is a dfbuild bug; please report it")


def write_tar_gz(path: Path, root: str | None, entries: list[Entry], mtime: int) -> None:
    _check_names(root, entries)
    members = [(d, None) for d in _directories(root, entries)] + [(_member_name(root, e.path), e) for e in entries]
    members.sort(key=lambda member: member[0])
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        # filename="" keeps the name out of the gzip header; mtime=0 keeps the time out
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for name, entry in members:
                    info = tarfile.TarInfo(name)
                    info.mtime = mtime
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    if entry is None:
                        info.type, info.mode = tarfile.DIRTYPE, 0o755
                        tar.addfile(info)
                    elif entry.link is not None:
                        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.link
                        tar.addfile(info)
                    else:
                        data = entry.read()
                        info.mode, info.size = entry.mode, len(data)
                        tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def write_zip(path: Path, root: str | None, entries: list[Entry], mtime: int) -> None:
    """A zip for Windows: symlinks become copies of their target (Windows builds have none)."""
    _check_names(root, entries)
    by_path = {e.path: e for e in entries}
    date_time = time.gmtime(max(mtime, ZIP_EPOCH_MIN))[:6]
    members = [(d + "/", None) for d in _directories(root, entries)] + [(_member_name(root, e.path), e) for e in entries]
    members.sort(key=lambda member: member[0])
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for name, entry in members:
            info = zipfile.ZipInfo(name, date_time=date_time)
            info.create_system = 3  # unix, so the modes below are honoured by unzip
            if entry is None:
                info.external_attr = ((stat.S_IFDIR | 0o755) << 16) | 0x10
                zf.writestr(info, b"")
                continue
            real = _resolve_link(by_path, entry)
            info.external_attr = (stat.S_IFREG | real.mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, real.read(), compresslevel=9)
    os.replace(tmp, path)


def write_archive(path: Path, root: str | None, entries: list[Entry], mtime: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".zip"):
        write_zip(path, root, entries, mtime)
    elif path.name.endswith(".tar.gz"):
        write_tar_gz(path, root, entries, mtime)
    else:
        raise ReleaseError(f"{path.name}: unknown archive type", "name it .tar.gz or .zip")
    return path


@dataclass
class Member:
    name: str
    kind: str                     # file | dir | link | other
    mode: int
    data: bytes | None = None
    link: str | None = None


# what Python's zipfile (and so pip and verify) can read; deflate64 (9), PPMd, ... it cannot
ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
               zipfile.ZIP_LZMA: "lzma"}


def zip_member_problem(info: zipfile.ZipInfo) -> str | None:
    """Why a zip member cannot be read and vetted (encrypted, an unsupported method), or None."""
    if info.flag_bits & 0x1:
        return "is encrypted"
    if info.compress_type not in ZIP_METHODS:
        return f"uses compression method {info.compress_type} (not stored, deflate, bzip2 or lzma: e.g. deflate64)"
    return None


def read_members(path: Path, limits=None) -> list[Member]:
    """Every member of a .tar.gz or .zip, with file contents, once the sizes are within LIMITS."""
    from . import source  # the size caps are the ones `dfbuild import` applies

    members = []
    limits = limits or source.Limits()
    try:
        if path.name.endswith(".zip"):
            with zipfile.ZipFile(path) as zf:
                source.check_limits(path, [info.file_size for info in zf.infolist()], limits)
                for info in zf.infolist():
                    why = zip_member_problem(info)
                    if why:
                        raise VerifyError(f"{path.name}: member {info.filename} {why}; it cannot be vetted",
                                          "rebuild the archive with dfbuild release")
                    mode = (info.external_attr >> 16) & 0o7777
                    if info.is_dir():
                        members.append(Member(info.filename.rstrip("/"), "dir", mode))
                    else:
                        members.append(Member(info.filename, "file", mode, data=zf.read(info)))
        else:
            with tarfile.open(path, "r:*") as tar:
                source.check_limits(path, [info.size for info in tar.getmembers() if info.isfile()], limits)
                for info in tar.getmembers():
                    if info.isdir():
                        members.append(Member(info.name, "dir", info.mode))
                    elif info.issym():
                        members.append(Member(info.name, "link", info.mode, link=info.linkname))
                    elif info.isfile():
                        members.append(Member(info.name, "file", info.mode, data=tar.extractfile(info).read()))
                    else:
                        members.append(Member(info.name, "other", info.mode))
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error, RuntimeError,
            NotImplementedError, ValueError) as exc:  # zipfile: RuntimeError (encrypted), NotImplementedError
        raise VerifyError(f"{path.name} cannot be read: {exc}", "download it again") from None
    except ArchiveError as exc:
        raise VerifyError(exc.message, exc.hint) from None
    return members


def extract_members(members: list[Member], into: Path) -> None:
    """Write already-checked members under INTO, restoring modes and links."""
    into = Path(into)
    for member in sorted(members, key=lambda m: m.name):
        target = into / member.name
        if member.kind == "dir":
            target.mkdir(parents=True, exist_ok=True)
        elif member.kind == "file":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(member.data)
            if os.name != "nt":
                target.chmod(member.mode & 0o755)
        elif member.kind == "link":
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(member.link, target)
