"""dfbuild's cache: what is in it, how big each kind is, and cleaning it without harming a run.

The cache dir is platformdirs' user cache dir for "dfbuild" (~/.cache/dfbuild on
Linux), or $DFBUILD_CACHE_DIR, or the global --cache-dir. Only the entries dfbuild
itself makes there are its kinds (KINDS); anything else found in the dir is
reported as not dfbuild's and never removed, so a --cache-dir pointed at the
wrong folder loses nothing.

Cleaning is safe beside a running dfbuild:
- an entry guarded by a cache lock (a git cache repo, an imported tree, the
  Windows OpenSSL build, a built web UI, the Vulkan headers) is removed only while its lock is
  held, taken without waiting: an entry in use is skipped and named;
- a scratch dir under tmp/ is removed only when the process that made it is gone
  (the rule every run's own sweep uses);
- lock files (*.lock, their .owner notes, locks/) are never removed: another
  process may be waiting on that very file.
Links are removed, never followed; nothing outside the cache dir is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from dfbuild.core import locks, paths, state
from dfbuild.core.errors import LockedError, UsageError

# name in the cache dir -> what it holds (the order `dfbuild cache` lists them in)
KINDS: dict[str, str] = {
    "sdists": "PyPI sdists of llama.cpp releases (the offline sources, with their .sha256 records)",
    "imports": "one-commit git repos imported from those sdists (what a checkout is made from)",
    "repos": "shallow git cache repos of --repo URLs (GitHub: 5ecbe1a, --pr)",
    "pypi": "PyPI release listings (track, offline hints)",
    "tls": "OpenSSL built for the Windows cross build",
    "webui": "llama-server's web UI built from a tree's tools/ui, one entry per set of UI sources (what builds embed)",
    "npm": "npm's package cache for the web UI builds (another base with the same lockfile then builds offline)",
    "node": "Node.js from PyPI, where the machine's is missing or too old for the web UI",
    "wine-prefix": "the Wine prefix Windows binaries run in",
    "mesa-shader-cache": "Mesa's shader cache for Vulkan smoke runs on lavapipe",
    "vulkan-headers": "Debian 13's Vulkan headers (doctor --fetch-vulkan-headers)",
    "fixtures": "the tiny GGUF models smoke writes by default",
    "image-base": "the Debian root layers container images stand on (mmdebstrap), one per set of packages",
    "image-logs": "the smoke logs of an image that failed its run before publishing",
    "smoke-passed": "smoke results remembered by the bytes they judged",
    "track": "track's records of proven outcomes",
    "produced.json": "sha256 of every archive released here (verify runs only these by default)",
    "tmp": "scratch dirs of running (or killed) commands",
    "locks": "lock files (never removed)",
}
# kinds whose entries a run holds a cache lock on (paths.locked: ENTRY.lock, or SLUG.lock for repos/SLUG.git)
LOCKED_KINDS = ("imports", "repos", "tls", "webui", "vulkan-headers", "node", "image-base")
NEVER_REMOVED = ("locks",)


@dataclass
class Kind:
    name: str
    what: str
    path: Path
    bytes: int
    entries: int

    def to_dict(self) -> dict:
        return {"kind": self.name, "what": self.what, "path": str(self.path), "bytes": self.bytes,
                "entries": self.entries}


def _lstat(path: Path):
    try:
        return os.lstat(path)
    except OSError:
        return None


def size_of(path: Path) -> int:
    """Bytes on disk under PATH (apparent sizes), links counted as links, never followed."""
    info = _lstat(path)
    if info is None:
        return 0
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    total = 0
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            sub = _lstat(Path(root) / name)
            if sub is not None and not stat.S_ISDIR(sub.st_mode):
                total += sub.st_size
    return total


def newest_mtime(path: Path) -> float:
    """When anything under PATH last changed (the newest mtime, links not followed)."""
    info = _lstat(path)
    if info is None:
        return 0.0
    newest = info.st_mtime
    if stat.S_ISDIR(info.st_mode):
        for root, dirs, files in os.walk(path, followlinks=False):
            for name in dirs + files:
                sub = _lstat(Path(root) / name)
                if sub is not None:
                    newest = max(newest, sub.st_mtime)
    return newest


def _is_lock_file(name: str) -> bool:
    return name.endswith((".lock", ".lock.owner")) or (name.startswith(".") and ".lock.owner." in name)


def _kind_lock(name: str) -> bool:
    """NAME is the lock file (or its owner note) of a kind kept at the cache's top, e.g. produced.json.lock."""
    return _is_lock_file(name) and name.lstrip(".").split(".lock")[0] in KINDS


def show(root: Path | None = None) -> dict:
    """Where the cache is and its size by kind: {dir, bytes, kinds: [...], other: [names not dfbuild's]}."""
    root = Path(root or paths.cache_dir())
    kinds = []
    for name, what in KINDS.items():
        path = root / name
        if not os.path.lexists(path):
            continue
        info = _lstat(path)
        entries = len(os.listdir(path)) if info and stat.S_ISDIR(info.st_mode) else 1
        kinds.append(Kind(name, what, path, size_of(path), entries))
    other = sorted(n for n in os.listdir(root) if n not in KINDS and not _kind_lock(n))
    return {"dir": str(root), "bytes": sum(k.bytes for k in kinds), "kinds": [k.to_dict() for k in kinds],
            "other": other}


def _sdist_base(name: str) -> str | None:
    """The base whose sdist (or its .sha256 record) NAME is: a run imports it under that base's lock."""
    from dfbuild.source import checkout as source
    from dfbuild.source import pypi, sdist

    name = name[:-len(sdist.RECORD_SUFFIX)] if name.endswith(sdist.RECORD_SUFFIX) else name
    match = re.fullmatch(re.escape(pypi.normalise(pypi.RELEASES_PROJECT)) + r"-(\d+)\.0\.0\.tar\.gz", name)
    if match:
        return f"b{int(match.group(1))}"
    return next((k.name for k in source.KNOWN_BASES.values()
                 if k.sdist and sdist.sdist_path(k.sdist).name == name), None)


def _lock_for(kind: str, entry: Path) -> Path | None:
    """The cache lock a run holds while it uses ENTRY (paths.locked puts it beside the entry); an sdist is
    read while its base's import is made, under the import's lock."""
    if kind == "sdists":
        base = _sdist_base(entry.name)
        return None if base is None else entry.parent.parent / "imports" / f"{base}.git.lock"
    if kind not in LOCKED_KINDS:
        return None
    for suffix in (".tmp", ".partial"):  # what a run makes beside ENTRY under ENTRY's lock, then renames
        if entry.name.endswith(suffix):
            entry = entry.with_name(entry.name[:-len(suffix)])
    if entry.name.endswith(".git") and kind == "repos":  # gitfetch locks repos/SLUG (SLUG.lock), the repo is SLUG.git
        return entry.with_name(entry.name[:-len(".git")] + ".lock")
    return entry.with_name(entry.name + ".lock")


def _remove(path: Path) -> None:
    """Remove PATH: a link or a file is unlinked (never followed), a directory removed with what it holds."""
    info = _lstat(path)
    if info is None:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)  # rmtree never follows a link inside the tree
    else:
        path.unlink()


def base_entries(base: str, root: Path) -> list[tuple[str, Path]]:
    """What the cache holds for BASE: its imported tree, its sdist with the sdist's record, or (a git base)
    the cache repo of its URL."""
    from dfbuild.source import checkout as source
    from dfbuild.source import sdist

    name = source.canonical_base(base, quiet=True)
    known = source.known_base(name)
    if known is None:
        raise UsageError(f"'{base}' is not a base dfbuild can name",
                         "name a base `dfbuild bases` lists, or any release bNNNNN")
    found = [("imports", root / "imports" / f"{known.name}.git")]
    if known.repo and not known.sdist:  # a git base: the cache repo of its URL (shared by every rev fetched from it)
        found.append(("repos", root / "repos" / source.cache_path(known.repo).name))
    if known.sdist:
        cached = root / "sdists" / sdist.sdist_path(known.sdist).name
        found += [("sdists", cached), ("sdists", sdist.record_path(cached))]
    return [(kind, path) for kind, path in found if os.path.lexists(path)]


def clean(*, older_than_days: float | None = None, base: str | None = None, root: Path | None = None,
          dry_run: bool = False) -> dict:
    """Remove cache entries: everything dfbuild made, or those not changed for OLDER_THAN_DAYS, or BASE's.

    Returns {dir, removed: [{kind, path, bytes}], skipped: [{path, why}], freed}. An entry a run holds
    the lock of is skipped (named, with its holder); so is a live process's scratch dir.
    """
    root = Path(root or paths.cache_dir())
    removed: list[dict] = []
    skipped: list[dict] = []
    if base is not None:
        candidates = base_entries(base, root)
    else:
        candidates = []
        for kind in KINDS:
            folder = root / kind
            info = _lstat(folder)
            if info is None or kind in NEVER_REMOVED:
                continue
            if not stat.S_ISDIR(info.st_mode):  # produced.json, or a link where a kind's dir belongs
                candidates.append((kind, folder))
                continue
            for entry in sorted(folder.iterdir()):
                if not _is_lock_file(entry.name):
                    candidates.append((kind, entry))
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    for kind, entry in candidates:
        if cutoff is not None and newest_mtime(entry) > cutoff:
            continue
        if kind == "tmp":
            match = state.TEMP_NAME.match(entry.name)
            if match and state.pid_alive(int(match.group(1))):
                skipped.append({"path": str(entry), "why": f"in use by the running process {match.group(1)}"})
                continue
        size = size_of(entry)
        lock_file = _lock_for(kind, entry)
        try:
            if dry_run:
                pass
            elif lock_file is None:
                _remove(entry)
            else:
                with locks.hold(lock_file, f"the cache entry {entry}", wait=False):
                    _remove(entry)
        except LockedError as exc:
            skipped.append({"path": str(entry), "why": exc.message.split(";")[0]})
            continue
        except OSError as exc:
            skipped.append({"path": str(entry), "why": f"cannot remove it: {exc.strerror or exc}"})
            continue
        removed.append({"kind": kind, "path": str(entry), "bytes": size})
    return {"dir": str(root), "removed": removed, "skipped": skipped, "freed": sum(r["bytes"] for r in removed),
            "dry_run": dry_run}


def human(size: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as du -h --si)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
