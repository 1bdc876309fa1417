"""Which files in an output dir are dfbuild's, and which archives dfbuild itself produced.

An output dir (`release --out`, `fixtures --out`) gets a marker, OUT/.dfbuild-owned.json,
listing the files dfbuild wrote there. dfbuild overwrites only those; any other
file in its way is refused with a clear error, so a user's file of the same
name is never replaced.

Separately, the cache keeps the sha256 of every archive this dfbuild packaged
(CACHE/produced.json). `verify` runs a binary from an archive by default only
when the archive is one of those: a marker inside a downloaded directory could
be forged, the user's own cache cannot.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from dfbuild.core import state
from dfbuild.core.errors import DfbuildError
from dfbuild.core.paths import cache_dir, sha256_file

MARKER_NAME = ".dfbuild-owned.json"


def owned_names(out: Path, legacy: Callable[[Path], Iterable[str]] | None = None) -> set[str]:
    """Names dfbuild wrote in OUT: from the marker, else (a dir from before the marker) from LEGACY."""
    marker = Path(out) / MARKER_NAME
    if marker.is_file():
        data = state.read_json(marker, "ownership marker")
        if data.get("written_by") != "dfbuild":
            return set()  # not dfbuild's marker: it owns nothing here (and check() refuses to replace it)
        files = data.get("files")
        return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()
    if legacy is not None:
        try:
            return set(legacy(Path(out)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return set()
    return set()


def check(out: Path, names: Iterable[str], error: type[DfbuildError], *,
          legacy: Callable[[Path], Iterable[str]] | None = None) -> set[str]:
    """Refuse (ERROR) any of NAMES that exists in OUT and is not dfbuild's; writes nothing. Returns dfbuild's names."""
    out = Path(out)
    marker = out / MARKER_NAME
    if (marker.exists() or marker.is_symlink()) and (
            not marker.is_file() or marker.is_symlink()
            or state.read_json(marker, "ownership marker").get("written_by") != "dfbuild"):
        # a file of the user's that happens to have the marker's name: never overwritten
        raise error(f"{marker} exists and is not dfbuild's ownership marker; refusing to overwrite it",
                    "move it away, or choose another output directory")
    mine = owned_names(out, legacy)
    foreign = [n for n in names if n not in mine and ((out / n).exists() or (out / n).is_symlink())]
    if foreign:
        raise error(
            f"{out / foreign[0]} exists and was not written by dfbuild; refusing to overwrite it"
            + (f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""),
            "move it away, or choose another output directory",
        )
    return mine


def claim(out: Path, names: Iterable[str], error: type[DfbuildError], *,
          legacy: Callable[[Path], Iterable[str]] | None = None) -> None:
    """Make NAMES dfbuild's in OUT, refusing (ERROR) any that exists there and is not already dfbuild's.

    The marker is updated before the files are written, so an interrupted write
    leaves a file dfbuild knows it may overwrite.
    """
    out = Path(out)
    names = list(names)
    mine = check(out, names, error, legacy=legacy)
    if set(names) <= mine and (out / MARKER_NAME).is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    state.atomic_write_text(out / MARKER_NAME, json.dumps(
        {"written_by": "dfbuild", "files": sorted(mine | set(names))}, indent=2) + "\n")


# --- archives this dfbuild produced -------------------------------------------------------


def _produced_path() -> Path:
    return cache_dir() / "produced.json"


def record_produced(path: Path) -> None:
    """Remember PATH's sha256 as an archive this dfbuild packaged."""
    digest = sha256_file(path)
    record = _produced_path()
    with state.hold(Path(str(record) + ".lock"), f"the record {record}", timeout=60):
        data = state.read_json(record, "record of produced archives")
        kept = data.get("sha256")
        produced = kept if isinstance(kept, dict) else {}
        produced[digest] = Path(path).name
        state.atomic_write_text(record, json.dumps({"sha256": produced}, indent=2, sort_keys=True) + "\n")


def was_produced(path: Path) -> bool:
    data = state.read_json(_produced_path(), "record of produced archives")
    produced = data.get("sha256")
    return isinstance(produced, dict) and sha256_file(path) in produced
