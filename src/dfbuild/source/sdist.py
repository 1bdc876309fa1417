"""PyPI sdists in dfbuild's cache (sdists/): what an offline base is imported from.

Each sdist is kept with a record of its sha256 beside it, NAME.tar.gz.sha256 in
`sha256sum` format, written when it is downloaded (the digest PyPI lists, which
the download was checked against). A cached sdist whose bytes match its record
is used without asking the network at all: an air-gapped build box, or a cache
whose imports were pruned, checks out from it offline. The network is needed
only for what is not cached, or for a cached file that fails its record.

Copying sdists in for an air-gapped box: copy each NAME.tar.gz.sha256 along. An
sdist found without a record is checked against the index's listing when that
can be read (and then recorded), else used as it is, with a warning.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable
from pathlib import Path

from dfbuild.core import state, ui
from dfbuild.core.errors import SourceError
from dfbuild.core.paths import cache_dir, sha256_file
from dfbuild.source import pypi

RECORD_SUFFIX = ".sha256"


def sdist_path(requirement: str) -> Path:
    """Where the sdist of REQUIREMENT (name==version) is cached."""
    name, _, version = requirement.partition("==")
    return cache_dir() / "sdists" / f"{pypi.normalise(name)}-{version}.tar.gz"


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def read_record(path: Path) -> str | None:
    """The sha256 recorded for PATH, or None when there is no readable record."""
    try:
        first = record_path(path).read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError):
        return None
    return first[0].lower() if first and re.fullmatch(r"[0-9a-fA-F]{64}", first[0]) else None


def write_record(path: Path, digest: str) -> None:
    # atomic: a crash leaves the old record or the new one, never half a digest
    state.atomic_write_text(record_path(path), f"{digest}  {path.name}\n")


def cached(requirement: str) -> Path | None:
    """The cached sdist of REQUIREMENT when there is one on disk (fetch_sdist checks it against its record)."""
    path = sdist_path(requirement)
    return path if path.is_file() else None


def _listed(name: str, version: str) -> pypi.Sdist | None:
    """What the index lists for NAME VERSION; None when it cannot be asked or lists no sdist."""
    try:
        return pypi.sdists(name).get(version)
    except SourceError:
        return None


def fetch_sdist(requirement: str) -> Path:
    """The sdist for REQUIREMENT (name==version): the cached one when it matches its record, else downloaded."""
    name, _, version = requirement.partition("==")
    dest = sdist_path(requirement)
    bad_copy = None  # why the cached file is not used, when there is one
    if dest.is_file():
        recorded = read_record(dest)
        actual = sha256_file(dest)
        if recorded == actual:
            return dest  # no network: the bytes are the ones that were downloaded and checked
        if recorded is not None:
            bad_copy = f"the cached {dest.name} does not match its recorded sha256 (corrupt or changed)"
        else:
            listed = _listed(name, version)
            if listed is None:
                ui.warn(f"{dest} has no record of its sha256 and the index cannot be asked: using it "
                        f"unchecked (copy {record_path(dest).name} along with a copied sdist)")
                return dest
            if listed.sha256 == actual:
                write_record(dest, actual)
                return dest
            bad_copy = f"the cached {dest.name} does not match the sha256 the index lists for it"
        ui.warn(f"{bad_copy}: downloading it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        digest = pypi.download_sdist(requirement, dest)
    except SourceError as exc:
        if bad_copy is None:
            raise
        raise SourceError(f"{bad_copy}, and a fresh copy cannot be downloaded: {exc.message}",
                          f"check the network (or ${pypi.INDEX_ENV}), or copy a good {dest.name} and its "
                          f"{record_path(dest).name} into {dest.parent}") from None
    write_record(dest, digest)
    return dest


# --- a few files straight from the stream ---------------------------------------------


class _Hashing:
    """A file-like reader that hashes every byte read through it (what tarfile's stream mode reads)."""

    def __init__(self, raw):
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def read_members(sdist: pypi.Sdist | str, wanted: Iterable[str], *, sha256: str | None = None) -> dict[str, bytes]:
    """The files WANTED of the .tar.gz at SDIST (a listed sdist or a URL), read straight from the
    download stream, by path; a wanted path the archive lacks is absent. Paths are relative to the
    archive's top directory (an sdist's NAME-VERSION/), e.g. "llama.cpp/common/speculative.cpp".

    Reading stops, and the connection is closed, as soon as every wanted file has
    been read: for a llama.cpp sdist that is often a fraction of the download.
    The sdist's sha256 (a listed sdist's, or SHA256) can then not be checked,
    since the bytes after that point are never read; callers that need the files
    to be what they claim record what they read instead (the sweep records
    speculative.cpp's git blob per release). When the whole archive is read
    (a wanted file is missing, or the last one is the archive's last member)
    the sha256 is checked, and a mismatch is a SourceError.
    """
    url = sdist.url if isinstance(sdist, pypi.Sdist) else sdist
    expected = sdist.sha256 if isinstance(sdist, pypi.Sdist) else sha256
    name = url.rsplit("/", 1)[-1]
    wanted, found = set(wanted), {}
    try:
        with urllib.request.urlopen(url, timeout=pypi.TIMEOUT_S) as response:
            reader = _Hashing(response)
            # a stream: no seeking, nothing on disk (_Hashing reads like a file; typeshed wants a real one)
            with tarfile.open(fileobj=reader, mode="r|gz") as tar:  # type: ignore[call-overload]
                for member in tar:
                    path = member.name.split("/", 1)[1] if "/" in member.name else ""
                    if path in wanted and member.isfile():
                        found[path] = tar.extractfile(member).read()
                        if len(found) == len(wanted):
                            return found  # stop here: the rest of the download is never read
            reader.drain()  # the archive's end: read what trails it, so the digest covers the whole file
            if expected and reader.digest.hexdigest() != expected.lower():
                raise SourceError(f"{name} does not match its sha256 (read {reader.size} bytes)",
                                  "read it again; if this persists, the index is serving a different file")
    except (urllib.error.URLError, OSError, EOFError, tarfile.TarError, zlib.error) as exc:
        raise SourceError(f"cannot read {name} as a .tar.gz stream: {exc}",
                          "check that the index is reachable and serves a gzip'd tar") from None
    return found
