"""Stage 5, release: the whole pipeline in one command, and its artifacts.

`release()` runs checkout -> apply -> build -> smoke -> package and stops at the
first failing stage with that stage's own error. A rerun resumes: checkout keeps
the applied series, apply and ninja are no-ops, a smoke result is reused when
the shipped files (binaries *and* libraries: the fix lives in
libllama-common) and the fixtures are unchanged, and the artifacts are rewritten
only when what goes into them changed. What each stage recorded is kept in
WORK/release-<backend>.json, so an unchanged stage also keeps its manifest
section, and the archive (whose manifest.json holds those sections) stays
byte-identical.

Artifacts in OUT:
- llama-<tag>-dflash-bin-<os>-<backend>-<arch>.tar.gz (.zip on Windows), rooted
  at one directory named like the archive: bin/ (llama-server, other built
  tools, their shared libraries; $ORIGIN rpath), LICENSE and licenses/,
  patches/ (the applied patches and series.toml) and manifest.json.
  <tag> is `<base>-<series hash>`, e.g. b10359-3f9a0c1d: the llama.cpp base
  and the first 8 hex of a hash over the series as applied to it.
- llama_dflash-0.0.<build>+dflash.<series hash>.<backend>-py3-none-<platform>.whl,
  built through builder/ (scikit-build-core): `pip install` gives `llama-server`.
- SHA256SUMS (sha256sum -c format) over the archives and wheels in OUT.
- manifest.json: source, series, build, smoke, release (artifacts with sha256
  and size, per-stage wall times).

Archives are reproducible: sorted entries, one mtime (SOURCE_DATE_EPOCH, else
the patched commit's date), uid/gid 0 with no names, fixed modes, and a gzip
header with mtime 0 and no file name.

`verify()` checks an OUT directory: SHA256SUMS, each archive's members against
the file list in its manifest, OUT/manifest.json against the archives, the
wheel's binaries against the archive's, and that the unpacked llama-server's
`--version` names the patched commit.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import backends, build, fixtures, manifest, matrix, owned, paths, series, smoke, source, state, ui
from .errors import ArchiveError, ReleaseError, SmokeFailedError, VerifyError
from .paths import sha256_file

SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "manifest.json"
WHEEL_DIST = "llama_dflash"          # the wheel's distribution (normalised) and package name
ARCHIVE_SUFFIXES = (".tar.gz", ".zip")
STAGES = ("checkout", "apply", "build", "smoke", "package")
ZIP_EPOCH_MIN = 315532800            # 1980-01-01: the earliest date a zip entry can hold


# --- names and versions ------------------------------------------------------------


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


def release_tag(base: str, series_section: dict) -> str:
    """<base>-<series hash>; a full commit id as base is shortened, odd characters become '-'."""
    label = base[:12] if re.fullmatch(r"[0-9a-fA-F]{13,40}", base) else base
    label = re.sub(r"[^A-Za-z0-9._+]+", "-", label).strip("-") or "base"
    return f"{label}-{series_hash(series_section)}"


def wheel_version(build_number: int, series_digest: str, backend: str) -> str:
    """0.0.<build>+dflash.<series>.<backend> (PEP 440): the base, the series and the backend.

    The backend is part of the local label, as torch's +cu121, so wheels of
    several backends for one platform can sit in one release without clashing.
    """
    return f"0.0.{int(build_number)}+dflash.{series_digest}.{re.sub(r'[^a-z0-9]', '', backend.lower())}"


def archive_root(name: str) -> str:
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def source_date_epoch(tree: Path) -> int:
    """$SOURCE_DATE_EPOCH when set, else the commit date of the tree's HEAD (the patched commit)."""
    override = os.environ.get("SOURCE_DATE_EPOCH")
    if override:
        try:
            return int(override)
        except ValueError:
            raise ReleaseError(f"SOURCE_DATE_EPOCH={override!r} is not a number of seconds",
                               "unset it or give an integer") from None
    result = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%ct", "HEAD"],
                            capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        raise ReleaseError(f"cannot read the commit date of {tree}", "release a tree made by `dfbuild apply`")
    return int(result.stdout.strip())


# --- hashing -----------------------------------------------------------------------


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# --- the payload -------------------------------------------------------------------


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


def _sibling_link(path: Path) -> str:
    """The target of a library version link, which must stay in its own directory."""
    target = os.readlink(path)
    if "/" in target or "\\" in target or target in (".", ".."):
        raise ReleaseError(f"{path} links to {target}, outside its directory",
                           "the build dir looks tampered with; rebuild with --fresh")
    return target


def collect_payload(build_section: dict, tree: Path, patches_root: Path, series_section: dict) -> list[Entry]:
    """What the archive ships besides manifest.json, sorted by path."""
    build_dir = Path(build_section["build_dir"])
    entries: dict[str, Entry] = {}

    for rel in [*build_section["binaries"], *build_section["libraries"]]:
        path = build_dir / rel
        arcname = f"bin/{Path(rel).name}"
        if path.is_symlink():
            entries[arcname] = Entry(arcname, 0o777, link=_sibling_link(path))
        elif path.is_file():
            entries[arcname] = Entry(arcname, 0o755, source=path)
        else:
            raise ReleaseError(f"{path} is missing from the build dir", "run the build again")

    license_path = Path(tree) / "LICENSE"
    if not license_path.is_file():
        raise ReleaseError(f"{tree} has no LICENSE", "release a llama.cpp tree; it ships its MIT LICENSE")
    entries["LICENSE"] = Entry("LICENSE", source=license_path)
    third_party = Path(tree) / "licenses"
    if third_party.is_dir():
        for path in sorted(third_party.iterdir()):
            if path.is_file():
                entries[f"licenses/{path.name}"] = Entry(f"licenses/{path.name}", source=path)

    for concern in series_section.get("concerns", []):
        if concern.get("status") in ("applied", "already-present") and concern.get("file"):
            patch = Path(patches_root) / concern["file"]
            entries[f"patches/{patch.name}"] = Entry(f"patches/{patch.name}", source=patch)
    series_file = Path(patches_root) / "series.toml"
    if series_file.is_file():
        entries["patches/series.toml"] = Entry("patches/series.toml", source=series_file)
    return [entries[key] for key in sorted(entries)]


def payload_records(entries: list[Entry]) -> list[dict]:
    """The file list recorded in manifest.json, against which `verify` checks the archive."""
    records = []
    for entry in entries:
        if entry.link is not None:
            records.append({"path": entry.path, "link": entry.link})
        else:
            data = entry.read()
            records.append({"path": entry.path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "mode": f"{entry.mode:04o}"})
    return records


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


def _directories(root: str, entries: list[Entry]) -> list[str]:
    dirs = {root}
    for entry in entries:
        parent = PurePosixPath(root, entry.path).parent
        while str(parent) != root and str(parent) != ".":
            dirs.add(str(parent))
            parent = parent.parent
    return sorted(dirs)


def _check_names(root: str, entries: list[Entry]) -> None:
    for entry in entries:
        problem = unsafe_member(entry.path) or unsafe_member(f"{root}/{entry.path}")
        if problem:
            raise ReleaseError(f"refusing to archive {problem}", "this is a dfbuild bug; please report it")


def write_tar_gz(path: Path, root: str, entries: list[Entry], mtime: int) -> None:
    _check_names(root, entries)
    members = [(d, None) for d in _directories(root, entries)] + [(f"{root}/{e.path}", e) for e in entries]
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


def write_zip(path: Path, root: str, entries: list[Entry], mtime: int) -> None:
    """A zip for Windows: symlinks become copies of their target (Windows builds have none)."""
    _check_names(root, entries)
    by_path = {e.path: e for e in entries}
    date_time = time.gmtime(max(mtime, ZIP_EPOCH_MIN))[:6]
    members = [(d + "/", None) for d in _directories(root, entries)] + [(f"{root}/{e.path}", e) for e in entries]
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


def write_archive(path: Path, root: str, entries: list[Entry], mtime: int) -> Path:
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


def read_members(path: Path, limits: source.Limits | None = None) -> list[Member]:
    """Every member of a .tar.gz or .zip, with file contents, once the sizes are within LIMITS."""
    members = []
    limits = limits or source.Limits()
    try:
        if path.name.endswith(".zip"):
            with zipfile.ZipFile(path) as zf:
                source.check_limits(path, [info.file_size for info in zf.infolist()], limits)
                for info in zf.infolist():
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
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
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


# --- the wheel ---------------------------------------------------------------------


def builder_dir() -> Path:
    """The repo's builder/ when running from a checkout, else the copy shipped in the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "builder", here.parent / "data" / "builder"):
        if (candidate / "pyproject.toml").is_file():
            return candidate
    raise ReleaseError("the wheel builder project (builder/) is missing",
                       "reinstall dfbuild from a checkout or a complete sdist")


def check_wheel_tools() -> None:
    """Fail before the long stages when the wheel cannot be built at the end."""
    if importlib.util.find_spec("scikit_build_core") is None:
        raise ReleaseError("scikit-build-core is not installed, so the wheel cannot be built",
                           f"{sys.executable} -m pip install scikit-build-core")
    builder_dir()


def stage_wheel_bin(entries: list[Entry], dest: Path) -> Path:
    """bin/ for the wheel: regular files only, one per library under the name the loader asks for.

    A wheel cannot hold symlinks. CMake lays libraries out as libX.so ->
    libX.so.0 -> libX.so.0.21.0, and binaries ask for the middle name (the
    soname). So the content of the real file goes in under the name of the
    last link; the dev link and the fully versioned name are left out.
    """
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    in_bin = {e.path: e for e in entries if e.path.startswith("bin/")}
    link_targets = {str(PurePosixPath(e.path).parent / e.link) for e in in_bin.values() if e.link}
    for entry in in_bin.values():
        if entry.link is not None:
            target = in_bin.get(str(PurePosixPath(entry.path).parent / entry.link))
            if target is None or target.link is not None:
                continue  # a dev link to another link: nobody loads it by that name
            real = target
        elif entry.path in link_targets:
            continue  # shipped under its soname link's name
        else:
            real = entry
        out = dest / PurePosixPath(entry.path).name
        out.write_bytes(real.read())
        out.chmod(real.mode)
    return dest


def build_wheel(*, bin_dir: Path, version: str, manifest_bytes: bytes, license_path: Path | None,
                out_dir: Path, work_dir: Path, epoch: int) -> Path:
    """Build the wheel from a staged copy of builder/ (its version written in) with pip + scikit-build-core."""
    project = work_dir / "project"
    if project.exists():
        shutil.rmtree(project)
    shutil.copytree(builder_dir(), project, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    package = project / "src" / WHEEL_DIST
    (package / "_version.py").write_text(f'__version__ = "{version}"\n', encoding="utf-8")
    (package / MANIFEST_NAME).write_bytes(manifest_bytes)
    if license_path is not None:
        shutil.copyfile(license_path, project / "LICENSE")
    dist = work_dir / "dist"
    if dist.exists():
        shutil.rmtree(dist)
    dist.mkdir(parents=True)
    log_path = work_dir / "pip-wheel.log"
    args = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
            "--disable-pip-version-check", "--wheel-dir", str(dist),
            "--config-settings", f"cmake.define.DFBUILD_BIN_DIR={Path(bin_dir).resolve()}",
            "--config-settings", f"build-dir={work_dir / 'cmake-build'}", str(project)]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    log_path.write_text("$ " + " ".join(args) + "\n" + result.stdout + result.stderr, encoding="utf-8")
    wheels = sorted(dist.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        last = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise ReleaseError(f"building the wheel failed: {last[0].strip()}", f"full log: {log_path}")
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / wheels[0].name
    owned.claim(out_dir, [final.name], ReleaseError, legacy=release_files)
    os.replace(wheels[0], final)
    return final


def parse_wheel_name(name: str) -> dict | None:
    """{dist, version, python, abi, platform} of a wheel file name (no build tag in ours)."""
    match = re.fullmatch(r"([^-]+)-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl", name)
    if not match:
        return None
    return dict(zip(("dist", "version", "python", "abi", "platform"), match.groups()))


# --- SHA256SUMS ----------------------------------------------------------------------

_SUMS_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def read_sha256sums(path: Path) -> dict[str, str]:
    sums = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise VerifyError(f"{Path(path).name} is not UTF-8 text", "regenerate it with dfbuild release") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _SUMS_LINE.match(line)
        if not match:
            raise VerifyError(f"{path.name} line {number} is not '<sha256>  <name>'", "regenerate it with dfbuild release")
        sums[match.group(2)] = match.group(1).lower()
    return sums


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


# --- the pipeline ----------------------------------------------------------------------


def default_work_dir(base: str) -> Path:
    return Path.cwd() / f"dfbuild-{re.sub(r'[^A-Za-z0-9._-]+', '-', base)}"


def run_smoke_stage(build_dir: Path, fixtures_dir: Path, log_dir: Path, backend: str = "cpu") -> dict:
    """The smoke stage as release runs it (one place, so tests can stand in for it)."""
    how = backends.get(backend)

    def progress(result: dict) -> None:
        verdict = "[green]pass[/green]" if result.get("passed") else "[red]FAIL[/red]"
        ui.info(f"    {result.get('scenario')} / {result.get('set')}: {verdict}")

    return smoke.run_smoke(build_dir, fixtures_dir, log_dir=log_dir, on_result=progress,
                           extra_server_args=how.smoke_server_args, env=how.smoke_env)


def fixtures_digest(fixtures_section: dict) -> str:
    return _digest({"seed": fixtures_section.get("seed"),
                    "files": {name: f["sha256"] for name, f in fixtures_section.get("files", {}).items()}})


def payload_digest(build_section: dict) -> str:
    """A hash of everything the build ships: binaries and libraries, by content."""
    build_dir = Path(build_section["build_dir"])
    parts = {}
    for rel in [*build_section["binaries"], *build_section["libraries"]]:
        path = build_dir / rel
        parts[rel] = "link:" + os.readlink(path) if path.is_symlink() else sha256_file(path)
    return _digest(parts)


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


@contextmanager
def _timed(stages: dict, name: str, title: str):
    record = {"wall_s": None, "reused": False}
    stages[name] = record
    start = time.monotonic()
    with ui.step(title):
        yield record
    record["wall_s"] = round(time.monotonic() - start, 2)


def release(base: str, *, backend: str, pr: int | None = None, repo: str | None = None,
            out: Path | None = None, work: Path | None = None, skip_smoke: bool = False,
            targets=build.DEFAULT_TARGETS, patches_dir: Path | None = None, build_options: dict | None = None) -> dict:
    """checkout -> apply -> build -> smoke -> package; returns the full manifest (also OUT/manifest.json)."""
    backends.get(backend)
    check_wheel_tools()
    work = Path(work or default_work_dir(base)).resolve()
    out = Path(out or Path.cwd() / "dist").resolve()
    owned.check(out, [SUMS_NAME, MANIFEST_NAME], ReleaseError, legacy=release_files)  # fail before building
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "src"
    build_dir = work / f"build-{backend}"
    stages: dict[str, dict] = {}

    with paths.locked(work / f"release-{backend}"):
        state = _State(work / f"release-{backend}.json")

        with _timed(stages, "checkout", f"checkout {base}"):
            src = source.checkout(base, pr=pr, repo=repo, dest=tree, keep_descendants=True)
            tree = Path(src["dir"])
            manifest.update_tree_manifest(tree, "source", src)

        with _timed(stages, "apply", "apply the patch series") as record:
            curated = series.load_series(patches_dir)
            applied = series.apply_series(curated, tree)
            record["reused"] = not applied.get("changed", True)
            ser, _ = state.reuse("series", applied["head"], applied)
            manifest.update_tree_manifest(tree, "series", ser)

        with _timed(stages, "build", f"build {backend}") as record:
            built = build.build_tree(tree, backend, build_dir, targets=targets, **(build_options or {}))
            record["reused"] = bool(built.get("up_to_date"))
            shipped = payload_digest(built)
            bld, _ = state.reuse("build", _digest([shipped, built.get("flags"), built.get("source_commit")]), built)
            manifest.update_tree_manifest(tree, "build", bld)
        state.save()

        with _timed(stages, "smoke", "smoke tests" + (" (skipped: --skip-smoke)" if skip_smoke else "")) as record:
            if skip_smoke:
                ui.warn("--skip-smoke: this release is NOT smoke-tested; the manifest says so")
                smk = {"skipped": True}
            else:
                fixtures_dir = work / "fixtures"
                fx = fixtures.ensure_fixtures(fixtures_dir)
                key = _digest([shipped, fixtures_digest(fx), backend])
                smk = state.cached("smoke", key)
                record["reused"] = smk is not None
                if smk is None:
                    smk = run_smoke_stage(build_dir, fixtures_dir, work / f"smoke-{backend}", backend)
                    if not smk.get("passed"):
                        failed = smk.get("failed") or ["?"]
                        raise SmokeFailedError(
                            f"smoke failed on {len(failed)} scenario(s): {', '.join(failed[:5])}",
                            f"logs in {smk.get('log_dir')}; rerun after fixing, or --skip-smoke (recorded) to package anyway")
                    state.store("smoke", key, smk)
                else:
                    ui.info("    binaries and fixtures unchanged: reusing the passed smoke result")
            manifest.update_tree_manifest(tree, "smoke", smk)
        state.save()

        with _timed(stages, "package", f"package into {out}") as record:
            rel = package({"source": src, "series": ser, "build": bld, "smoke": smk}, tree=tree,
                          patches_root=curated.root, out_dir=out, work_dir=work / f"package-{backend}", state=state)
            record["reused"] = rel.pop("reused")
        state.save()

    rel["stages"] = stages
    full = {"source": src, "series": ser, "build": bld, "smoke": smk, "release": rel}
    owned.claim(out, [MANIFEST_NAME], ReleaseError, legacy=release_files)
    manifest.save(full, out / MANIFEST_NAME)
    manifest.update_tree_manifest(tree, "release", rel)
    return full


def package(sections: dict, *, tree: Path, patches_root: Path, out_dir: Path, work_dir: Path,
            state: _State | None = None) -> dict:
    """Write the archive, the wheel and SHA256SUMS into OUT_DIR; return the release section.

    SECTIONS holds source, series, build and smoke. When STATE says the same
    inputs made the artifacts already in OUT_DIR, they are left as they are.
    """
    build_section = sections["build"]
    host = build_section.get("host") or {}
    os_name = host.get("os") or backends.current_host().os
    arch = host.get("arch") or backends.current_host().arch
    backend = build_section["backend"]
    base = sections["source"].get("base") or sections["series"].get("base")
    tag = release_tag(base, sections["series"])
    name = matrix.artifact_name(tag, os_name, backend, arch)
    root = archive_root(name)
    epoch = source_date_epoch(tree)
    version = wheel_version(build_section.get("build_number", 0), series_hash(sections["series"]), backend)

    entries = collect_payload(build_section, tree, patches_root, sections["series"])
    packed = {
        "tag": tag,
        "os": os_name,
        "arch": arch,
        "backend": backend,
        "archive": name,
        "root": root,
        "source_date_epoch": epoch,
        "wheel_version": version,
        "files": payload_records(entries),
    }
    embedded = {**{k: sections[k] for k in ("source", "series", "build", "smoke")}, "release": packed}
    manifest_bytes = (manifest.dumps(embedded) + "\n").encode()
    all_entries = sorted([*entries, Entry(MANIFEST_NAME, data=manifest_bytes)], key=lambda e: e.path)
    builder_files = {str(p.relative_to(builder_dir())): sha256_file(p)
                     for p in sorted(builder_dir().rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    key = _digest([hashlib.sha256(manifest_bytes).hexdigest(), builder_files, sys.version_info[:2]])

    previous = state.cached("package", key) if state else None
    if previous and all((out_dir / a["name"]).is_file() and sha256_file(out_dir / a["name"]) == a["sha256"]
                        for a in previous["artifacts"]):
        ui.info("    inputs unchanged: keeping the artifacts already in place")
        artifacts, reused = previous["artifacts"], True
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        owned.claim(out_dir, [name], ReleaseError, legacy=release_files)
        archive = write_archive(out_dir / name, root, all_entries, epoch)
        owned.record_produced(archive)  # verify runs binaries by default only from archives made here
        wheel = build_wheel(bin_dir=stage_wheel_bin(entries, work_dir / "bin"), version=version,
                            manifest_bytes=manifest_bytes, license_path=Path(tree) / "LICENSE",
                            out_dir=out_dir, work_dir=work_dir, epoch=epoch)
        artifacts = [{"name": path.name, "kind": kind, "sha256": sha256_file(path), "size": path.stat().st_size}
                     for path, kind in ((archive, "archive"), (wheel, "wheel"))]
        reused = False
        if state:
            state.store("package", key, {"artifacts": artifacts})
    write_sha256sums(out_dir, [a["name"] for a in artifacts])
    wheel_name = next(a["name"] for a in artifacts if a["kind"] == "wheel")
    return {**packed, "artifacts": artifacts, "wheel": parse_wheel_name(wheel_name), "sha256sums": SUMS_NAME,
            "reused": reused}


# --- verify ------------------------------------------------------------------------------

_COMMIT_IN_VERSION = re.compile(r"commit ([0-9A-Za-z]+(?:-dirty)?)")


def _commit_matches(found: str, expected: str) -> bool:
    return found == expected or (len(found) >= 7 and not found.endswith("-dirty") and expected.startswith(found))


RUN_OPT_IN = "--run"


def _check_archive(path: Path, problems: list[str], notes: list[str], run_binaries: bool,
                   host: backends.Host, *, not_run_why: str = "not run (--no-run)",
                   limits: source.Limits | None = None) -> dict | None:
    """Check one archive; return its embedded manifest (None when it cannot be read).

    Its llama-server runs only when RUN_BINARIES and the archive passed every check before that.
    """
    problems_before = len(problems)
    members = read_members(path, limits)
    root = archive_root(path.name)
    bad = False
    for member in members:
        why = unsafe_member(member.name)
        if why:
            problems.append(f"{path.name}: unsafe member {why}")
            bad = True
        elif member.name != root and not member.name.startswith(root + "/"):
            problems.append(f"{path.name}: member {member.name!r} is outside the root directory {root}/")
            bad = True
        if member.kind == "link" and (unsafe_member(member.link) or "/" in member.link):
            problems.append(f"{path.name}: {member.name} links outside its directory ({member.link})")
            bad = True
        if member.kind == "other":
            problems.append(f"{path.name}: {member.name} is neither a file, a directory nor a symlink")
            bad = True
    if bad:
        return None
    by_name = {m.name[len(root) + 1:]: m for m in members if m.name != root}
    embedded_member = by_name.get(MANIFEST_NAME)
    if embedded_member is None or embedded_member.kind != "file":
        problems.append(f"{path.name}: no {root}/{MANIFEST_NAME}")
        return None
    try:
        embedded = json.loads(embedded_member.data)
    except ValueError:
        problems.append(f"{path.name}: {MANIFEST_NAME} is not JSON")
        return None
    packed = embedded.get("release") if isinstance(embedded, dict) else None
    files = packed.get("files") if isinstance(packed, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        problems.append(f"{path.name}: {MANIFEST_NAME} does not have the shape of a dfbuild manifest")
        return None
    expected = {f["path"]: f for f in packed.get("files", [])}
    actual = {n: m for n, m in by_name.items() if m.kind != "dir" and n != MANIFEST_NAME}
    for name_ in sorted(set(expected) - set(actual)):
        problems.append(f"{path.name}: {name_} is in the manifest but not in the archive")
    for name_ in sorted(set(actual) - set(expected)):
        problems.append(f"{path.name}: {name_} is in the archive but not in the manifest")
    zipped = path.name.endswith(".zip")
    for name_ in sorted(set(expected) & set(actual)):
        record, member = expected[name_], actual[name_]
        if "link" in record:
            if zipped:  # zips carry the link's target as a copy
                continue
            if member.kind != "link" or member.link != record["link"]:
                problems.append(f"{path.name}: {name_} should link to {record['link']}")
            continue
        if member.kind != "file" or hashlib.sha256(member.data).hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: {name_} does not match its sha256 in the manifest")
        elif os.name != "nt" and f"{member.mode & 0o777:04o}" != record.get("mode"):
            problems.append(f"{path.name}: {name_} has mode {member.mode & 0o777:04o}, not {record.get('mode')}")
    notes.append(f"{path.name}: {len(actual)} files match its manifest")

    series_, build_ = (embedded.get(k) if isinstance(embedded.get(k), dict) else {} for k in ("series", "build"))
    patched = series_.get("head") or build_.get("source_commit")
    if patched is not None and not isinstance(patched, str):
        patched = None
    if not patched:
        problems.append(f"{path.name}: the manifest names no patched commit")
        return embedded
    exe = "bin/llama-server" + (".exe" if packed.get("os") == "windows" else "")
    if len(problems) > problems_before:
        why = "not run: the archive failed the checks above"
    elif not run_binaries:
        why = not_run_why
    elif (packed.get("os"), packed.get("arch")) != (host.os, host.arch):
        why = f"built for {packed.get('os')}/{packed.get('arch')}, not run on {host.os}/{host.arch}"
    else:
        why = _run_version(path, members, root, exe, patched, problems, notes)
    if why:
        # Cannot run it here: the version stamp must at least be compiled into the shipped files.
        holders = sorted(n for n, m in actual.items() if m.kind == "file" and patched.encode() in m.data)
        if holders:
            notes.append(f"{path.name}: {exe} {why}; the patched commit {patched[:12]} is stamped into "
                         f"{', '.join(holders)}")
        else:
            problems.append(f"{path.name}: {exe} {why}, and no shipped file holds the patched commit {patched[:12]}")
    return embedded


_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: ([^:\s]+)")


def _run_version(path: Path, members: list[Member], root: str, exe: str, patched: str,
                 problems: list[str], notes: list[str]) -> str | None:
    """Unpack and run `llama-server --version`. Returns why it could not run here, else None."""
    with tempfile.TemporaryDirectory(prefix="dfbuild-verify-") as tmp:
        extract_members(members, Path(tmp))
        binary = Path(tmp) / root / exe
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")}
        try:
            result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120,
                                    cwd=tmp, env=env, errors="replace")
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"{path.name}: the unpacked {exe} does not run: {exc}")
            return None
    output = result.stdout + result.stderr
    missing = _MISSING_LIBRARY.search(output)
    shipped = {PurePosixPath(m.name).name for m in members}
    if result.returncode != 0 and missing and missing.group(1) not in shipped:
        # e.g. libcuda.so.1 comes with the GPU driver, which this machine lacks
        return f"needs {missing.group(1)} from the system, which is missing here"
    found = _COMMIT_IN_VERSION.search(output)
    if result.returncode != 0:
        problems.append(f"{path.name}: the unpacked {exe} --version exited {result.returncode}: {output.strip()[-300:]}")
    elif not found or not _commit_matches(found.group(1), patched):
        problems.append(f"{path.name}: {exe} --version says {found.group(1) if found else 'no commit'}, "
                        f"not the patched commit {patched[:12]}")
    else:
        notes.append(f"{path.name}: unpacked {exe} --version names the patched commit {found.group(1)[:12]}")
    return None


def wheel_platform(platform_tag: str) -> tuple[str | None, str | None]:
    """(os, arch) in dfbuild's names for a wheel platform tag: linux_x86_64 -> (linux, x64)."""
    os_name = ("linux" if "linux" in platform_tag else "macos" if platform_tag.startswith("macosx")
               else "windows" if platform_tag.startswith("win") else None)
    arch = ("x64" if platform_tag.endswith(("x86_64", "amd64")) else
            "arm64" if platform_tag.endswith(("aarch64", "arm64")) else None)
    return os_name, arch


def _check_wheel(path: Path, embedded_by_version: dict[tuple, dict], problems: list[str], notes: list[str]) -> None:
    fields = parse_wheel_name(path.name)
    if not fields:
        problems.append(f"{path.name}: not a wheel file name")
        return
    if fields["platform"] == "any" or fields["abi"] != "none" or fields["python"] != "py3":
        problems.append(f"{path.name}: tags {fields['python']}-{fields['abi']}-{fields['platform']} "
                        "are not py3-none-<platform>")
    os_name, arch = wheel_platform(fields["platform"])
    embedded = embedded_by_version.get((fields["version"], os_name, arch))
    if embedded is None:
        problems.append(f"{path.name}: no archive here has wheel version {fields['version']} for {os_name}/{arch}")
        return
    files = {f["path"]: f for f in embedded["release"]["files"]}
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            shipped = {n[len(f"{WHEEL_DIST}/bin/"):]: zf.read(n) for n in names if n.startswith(f"{WHEEL_DIST}/bin/")}
            wheel_manifest = json.loads(zf.read(f"{WHEEL_DIST}/{MANIFEST_NAME}"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        problems.append(f"{path.name}: cannot be read as a dfbuild wheel: {exc}")
        return
    if wheel_manifest != embedded:
        problems.append(f"{path.name}: its manifest differs from the archive's")
    for name_, data in sorted(shipped.items()):
        record = files.get(f"bin/{name_}")
        while record and "link" in record:
            record = files.get(f"bin/{record['link']}")
        if record is None or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: bin/{name_} differs from the archive's")
    binaries = [f"bin/{Path(b).name}" for b in embedded.get("build", {}).get("binaries", [])]
    for binary in binaries:
        if binary[len("bin/"):] not in shipped:
            problems.append(f"{path.name}: {binary} is missing")
    notes.append(f"{path.name}: {len(shipped)} files match the archive")


def verify(directory: Path, *, run_binaries: bool | None = None, host: backends.Host | None = None,
           limits: source.Limits | None = None) -> dict:
    """Check a release directory; returns {dir, ok, problems, checked}. Never raises on a mismatch.

    RUN_BINARIES: None (the default) runs an archive's llama-server --version only
    when the archive is one this dfbuild packaged (owned.was_produced); True also
    runs it from other archives (--run); False never runs anything (--no-run). No
    binary runs from an archive once any checksum in the directory is wrong.
    """
    directory = Path(directory)
    host = host or backends.current_host()
    problems: list[str] = []
    notes: list[str] = []
    report = {"dir": str(directory), "problems": problems, "checked": notes}
    sums_path = directory / SUMS_NAME
    if not sums_path.is_file():
        problems.append(f"no {SUMS_NAME} in {directory}")
        report["ok"] = False
        return report
    try:
        sums = read_sha256sums(sums_path)
    except VerifyError as exc:
        problems.append(exc.message)
        sums = {}
    for name, digest in sorted(sums.items()):
        if unsafe_member(name) or "/" in name:
            problems.append(f"{SUMS_NAME} names {name!r}, which is not a file of this directory")
        elif not (directory / name).is_file():
            problems.append(f"{name} is in {SUMS_NAME} but missing")
        elif sha256_file(directory / name) != digest:
            problems.append(f"{name}: sha256 does not match {SUMS_NAME}")
    present = sorted(p.name for p in directory.iterdir()
                     if p.is_file() and (p.name.endswith(ARCHIVE_SUFFIXES) or p.name.endswith(".whl")))
    for name in present:
        if name not in sums:
            problems.append(f"{name} is not listed in {SUMS_NAME}")
    if sums and not problems:
        notes.append(f"{SUMS_NAME}: {len(sums)} artifacts match")
    checksums_ok = bool(sums) and not problems

    embedded_by_archive: dict[str, dict] = {}
    for name in present:
        if name.endswith(ARCHIVE_SUFFIXES):
            if not checksums_ok:
                allowed, why = False, f"not run: {SUMS_NAME} does not vouch for this directory"
            elif run_binaries is None:
                allowed = owned.was_produced(directory / name)
                why = f"not run: dfbuild did not package this archive here (pass {RUN_OPT_IN} to run it anyway)"
            else:
                allowed, why = run_binaries, "not run (--no-run)"
            try:
                embedded = _check_archive(directory / name, problems, notes, allowed, host, not_run_why=why,
                                          limits=limits)
            except VerifyError as exc:
                problems.append(exc.message)
                embedded = None
            if embedded:
                embedded_by_archive[name] = embedded
    # a wheel belongs to the archive of its version (base, series, backend) and platform
    by_version = {(e["release"].get("wheel_version"), e["release"].get("os"), e["release"].get("arch")): e
                  for e in embedded_by_archive.values() if isinstance(e.get("release"), dict)}
    for name in present:
        if name.endswith(".whl"):
            _check_wheel(directory / name, by_version, problems, notes)

    top = directory / MANIFEST_NAME
    if top.is_file():
        try:
            full = json.loads(top.read_text(encoding="utf-8"))
        except ValueError:
            problems.append(f"{MANIFEST_NAME} is not JSON")
            full = {}
        rel = full.get("release") if isinstance(full, dict) else None
        artifacts = rel.get("artifacts", []) if isinstance(rel, dict) else None
        if not isinstance(artifacts, list) or not all(
                isinstance(a, dict) and isinstance(a.get("name"), str) and "sha256" in a and "size" in a
                for a in artifacts) or not isinstance(rel.get("archive", ""), str):
            problems.append(f"{MANIFEST_NAME} does not have the shape of a dfbuild manifest")
            full, rel, artifacts = {}, {}, []
        for artifact in artifacts:
            if unsafe_member(artifact["name"]) or "/" in artifact["name"]:
                problems.append(f"{MANIFEST_NAME} names {artifact['name']!r}, which is not a file of this directory")
                continue
            path = directory / artifact["name"]
            if not path.is_file():
                problems.append(f"{MANIFEST_NAME} names {artifact['name']}, which is missing")
            elif sha256_file(path) != artifact["sha256"] or path.stat().st_size != artifact["size"]:
                problems.append(f"{artifact['name']}: sha256 or size does not match {MANIFEST_NAME}")
            elif sums.get(artifact["name"]) != artifact["sha256"]:
                problems.append(f"{artifact['name']}: {MANIFEST_NAME} and {SUMS_NAME} disagree")
        embedded = embedded_by_archive.get(rel.get("archive"))
        if rel.get("archive") and embedded is not None:
            for section in ("source", "series", "build", "smoke"):
                if full.get(section) != embedded.get(section):
                    problems.append(f"{MANIFEST_NAME}: the {section} section differs from the one in {rel['archive']}")
            for key, value in embedded.get("release", {}).items():
                if rel.get(key) != value:
                    problems.append(f"{MANIFEST_NAME}: release.{key} differs from the one in {rel['archive']}")
        elif rel.get("archive"):
            problems.append(f"{MANIFEST_NAME} describes {rel['archive']}, which could not be checked")
        else:
            problems.append(f"{MANIFEST_NAME} has no release section")
        if not any(p.startswith(MANIFEST_NAME) for p in problems):
            notes.append(f"{MANIFEST_NAME}: matches {rel.get('archive')}")
    report["ok"] = not problems
    return report


def check(directory: Path, *, run_binaries: bool | None = None) -> dict:
    """verify(), raising VerifyError (exit 51) on the first problem."""
    report = verify(directory, run_binaries=run_binaries)
    if not report["ok"]:
        count = len(report["problems"])
        raise VerifyError(report["problems"][0] + (f" (and {count - 1} more)" if count > 1 else ""),
                          "do not publish these files; rebuild them with `dfbuild release`")
    return report
