"""What a release dir records and is named by: the tag, the wheel's name and version, the artifact
names dfbuild writes (SHA256SUMS, manifest.json), the portable form of the manifest's sections, the file
list an archive's manifest holds, SHA256SUMS read and written, and the work dir's record of each stage
(WORK/release-<backend>.json).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from dfbuild.core import manifest, owned, readers, state
from dfbuild.core.archive import Entry
from dfbuild.core.errors import ReleaseError, VerifyError
from dfbuild.core.paths import sha256_file

SUMS_NAME = "SHA256SUMS"


MANIFEST_NAME = "manifest.json"


REQUIRES_NAME = "REQUIRES.txt"       # in the archive: the system libraries it needs, and their packages


WHEEL_DIST = "llama_dflash"          # the builder's package; a release renames it per backend


def series_hash(series_section: dict) -> str:
    """8 hex naming the series as applied: each concern's id, patch sha256 or decision.

    'applied' and 'already-present' count the same (the patch is in the commit
    either way), so a rerun on an already patched tree names the same series.
    """
    lines = []
    for concern in series_section.get("concerns", []):
        status = concern.get("status")
        if status in ("applied", "already-present"):
            lines.append(f"{concern['id']} patch {concern.get('sha256')}")
        else:
            lines.append(f"{concern['id']} {status}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:8]


TAG_MARKER = "dflash"


def release_tag(base: str, series_section: dict) -> str:
    """<base>-dflash-<series hash> (b11434-dflash-e8448d4a): llama.cpp's tag first, so a parser of
    llama-<tag>-bin-<platform> reads the whole tag and one of llama-b<N>-... the build number; the
    marker says it is not llama.cpp's own build, the hash which series (docs/backends.md, "The tag").
    A full commit id as base is shortened, odd characters become '-'."""
    label = base[:12] if re.fullmatch(r"[0-9a-fA-F]{13,40}", base) else base
    label = re.sub(r"[^A-Za-z0-9._+]+", "-", label).strip("-") or "base"
    return f"{label}-{TAG_MARKER}-{series_hash(series_section)}"


def wheel_version(build_number: int, series_digest: str, backend: str) -> str:
    """0.0.<build>+dflash.<series>.<backend> (PEP 440): the base, the series and the backend.

    The backend is part of the local label, as torch's +cu121, so wheels of
    several backends for one platform can sit in one release without clashing.
    """
    return f"0.0.{int(build_number)}+dflash.{series_digest}.{re.sub(r'[^a-z0-9]', '', backend.lower())}"


def wheel_package(backend: str) -> str:
    """llama_dflash_<backend>: the wheel's import package and (normalised) distribution name.

    One distribution per backend (llama-dflash-cpu, llama-dflash-cuda, ...), so
    `pip install llama-dflash-cpu` can only ever pick the CPU build, whatever
    other backends' wheels sit in the same folder or index.
    """
    return f"{WHEEL_DIST}_{re.sub(r'[^a-z0-9]', '', backend.lower())}"


def toolkit_version(build_section: dict) -> str | None:
    """The GPU toolkit a build used (nvcc for cuda, HIP for hip): it is part of the artifact name."""
    probe = {"cuda": "nvcc", "hip": "hip-clang"}.get(build_section.get("backend") or "")
    return (build_section.get("toolchain") or {}).get(probe) if probe else None


# Keys of the stage sections that describe this machine or this run, not the
# release: paths, logs, timings. The archive's manifest.json (and OUT/manifest.json)
# leave them out, so two work folders give byte-identical archives.
_LOCAL_KEYS = {"dir", "build_dir", "source_dir", "log", "log_dir", "fixtures_dir", "server", "server_args",
               "configured", "up_to_date", "steps", "compiled_steps", "compiled_objects", "built_in", "log_findings",
               "failure_excerpt", "log_offset", "reused"}


_TIMING_KEY = re.compile(r"(^|_)(s|ms|sec|seconds|wall|time)$")


# an absolute path (POSIX or Windows), not part of a URL
_ABS_PATH = re.compile(r"(?<![\w:/.])(?:[A-Za-z]:[\\/]|/)(?:[^\s;,:\"'=/\\]+[\\/])*([^\s;,:\"'=/\\]+)")


def portable(section):
    """SECTION without what only holds on the build machine: local keys and timings dropped,
    absolute paths reduced to their last part (/usr/bin/ccache -> ccache)."""
    if isinstance(section, dict):
        return {k: portable(v) for k, v in section.items()
                if k not in _LOCAL_KEYS and not _TIMING_KEY.search(k)}
    if isinstance(section, list):
        return [portable(v) for v in section]
    if isinstance(section, str):
        return _ABS_PATH.sub(lambda m: m.group(1), section)
    return section


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# dfbuild's own files in an archive, beside the binaries (manifest.json and REQUIRES.txt too)
OWN_FILES = ("LICENSE", "licenses", "patches")


def payload_records(entries: list[Entry]) -> list[dict]:
    """The file list recorded in manifest.json, against which `verify` checks the archive."""
    records: list[dict] = []
    for entry in entries:
        if entry.link is not None:
            records.append({"path": entry.path, "link": entry.link})
        else:
            data = entry.read()
            records.append({"path": entry.path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "mode": f"{entry.mode:04o}"})
    return records


def parse_wheel_name(name: str) -> dict | None:
    """{dist, version, python, abi, platform} of a wheel file name (no build tag in ours)."""
    match = re.fullmatch(r"([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl", name)
    if not match:
        return None
    return dict(zip(("dist", "version", "python", "abi", "platform"), match.groups(), strict=True))


def read_sha256sums(path: Path) -> dict[str, str]:
    """{name: sha256} of a SHA256SUMS file, read strictly (readers.read_sha256sums); VerifyError (51) otherwise."""
    try:
        return readers.read_sha256sums(Path(path))
    except readers.FormatError as exc:
        raise VerifyError(exc.message, "regenerate it with dfbuild release") from None


def release_files(out_dir: Path) -> set[str]:
    """What an OUT dir written before the ownership marker holds of dfbuild's: its manifest's artifacts."""
    full = json.loads((out_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    return {SUMS_NAME, MANIFEST_NAME, *(a["name"] for a in full["release"]["artifacts"])}


def write_sha256sums(out_dir: Path, names: list[str]) -> Path:
    """Add NAMES to OUT/SHA256SUMS, keeping other entries whose files are still there (other backends).

    Written atomically, and only over a SHA256SUMS dfbuild wrote (owned.claim).
    """
    path = out_dir / SUMS_NAME
    owned.claim(out_dir, [SUMS_NAME], ReleaseError, legacy=release_files)
    sums = {}
    if path.is_file():
        try:
            sums = {n: d for n, d in read_sha256sums(path).items() if (out_dir / n).is_file()}
        except VerifyError:
            sums = {}
    for name in names:
        sums[name] = sha256_file(out_dir / name)
    state.atomic_write_text(path, "".join(f"{sums[n]}  {n}\n" for n in sorted(sums)))
    return path


class _State:
    """WORK/release-<backend>.json: each stage's key and section from the last successful run."""

    def __init__(self, path: Path):
        self.path = path
        self.data = manifest.load(path) if path.is_file() else {}

    def reuse(self, stage: str, key: str, section: dict) -> tuple[dict, bool]:
        """The stored section when KEY is unchanged (a no-op rerun keeps its record), else SECTION."""
        stored = self.data.get(stage)
        if stored and stored.get("key") == key:
            return stored["section"], True
        self.data[stage] = {"key": key, "section": section}
        return section, False

    def cached(self, stage: str, key: str) -> dict | None:
        stored = self.data.get(stage)
        return stored["section"] if stored and stored.get("key") == key else None

    def store(self, stage: str, key: str, section: dict) -> None:
        self.data[stage] = {"key": key, "section": section}

    def save(self) -> None:
        manifest.save(self.data, self.path)
