"""A build dir: its name, whose it is (dfbuild's stamp file, else CMake's cache) and claiming it for
one (backend, source) pair; any other use is refused unless the caller asks to reconfigure or start fresh.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from dfbuild.core import state, ui
from dfbuild.core.errors import BuildDirMismatchError
from dfbuild.host.backends import Host

STAMP_NAME = "dfbuild-stamp.json"


def dir_label(backend: str, host: Host | None = None) -> str:
    """What a work dir's build folders are named by: the backend, plus the target OS (or arch) of a cross
    build (build-cpu, build-cpu-windows, build-cpu-arm64), so one tree keeps its native and cross builds apart."""
    if host is None or not host.cross:
        return backend
    # another OS: build-cpu-windows; another arch of this OS: build-cpu-arm64
    return f"{backend}-{host.os}" if host.build_os != host.os else f"{backend}-{host.arch}"


def default_build_dir(source_dir: Path, backend: str, host: Host | None = None) -> Path:
    """X/src -> X/build-<backend> (build-<backend>-<os> for a cross build): the same layout everywhere,
    so ccache hits across copies."""
    return Path(source_dir).resolve().parent / f"build-{dir_label(backend, host)}"


def read_stamp(build_dir: Path) -> dict | None:
    path = build_dir / STAMP_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_stamp(build_dir: Path, stamp: dict) -> None:
    """Atomic write, so a Ctrl-C never leaves half a stamp behind."""
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = build_dir / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    state.move(tmp, build_dir / STAMP_NAME)


def read_cmake_cache(build_dir: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    try:
        lines = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return values
    for line in lines:
        match = re.match(r"^([A-Za-z0-9_.+-]+):[A-Z]+=(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


def cuda_facts(cache: dict[str, str]) -> dict[str, str]:
    """What a CUDA build's CMake cache says of it: the architectures, and the toolkit it compiled and linked
    with (the folder above CUDAToolkit_BIN_DIR), which the cudart archive must pack. The nvcc on PATH can
    be a wrapper script outside its toolkit (/usr/local/bin/nvcc); FindCUDAToolkit asks nvcc itself."""
    facts: dict[str, str] = {}
    if cache.get("CMAKE_CUDA_ARCHITECTURES"):
        facts["cuda_architectures"] = cache["CMAKE_CUDA_ARCHITECTURES"]
    if cache.get("CUDAToolkit_BIN_DIR"):
        facts["cuda_toolkit_root"] = str(Path(cache["CUDAToolkit_BIN_DIR"]).parent)
    return facts


def _backend_from_cache(cache: dict[str, str]) -> str:
    for backend, flag in (("cuda", "GGML_CUDA"), ("vulkan", "GGML_VULKAN"), ("hip", "GGML_HIP"),
                          ("metal", "GGML_METAL")):
        if cache.get(flag, "").upper() in ("ON", "1", "TRUE", "YES"):
            return backend
    return "cpu"


def build_dir_owner(build_dir: Path) -> dict | None:
    """Which (backend, source) a build dir was made for: from our stamp, else CMake's cache."""
    stamp = read_stamp(build_dir)
    if stamp:
        return {"backend": stamp.get("backend"), "source_dir": stamp.get("source_dir")}
    cache = read_cmake_cache(build_dir)
    if cache.get("CMAKE_HOME_DIRECTORY"):
        return {"backend": _backend_from_cache(cache), "source_dir": cache["CMAKE_HOME_DIRECTORY"]}
    return None


def _same_path(a: str | None, b: Path) -> bool:
    if not a:
        return False
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def claim_build_dir(build_dir: Path, backend: str, source_dir: Path, *, reconfigure: bool, fresh: bool) -> bool:
    """Make BUILD_DIR ours for (backend, source). Returns True when CMake must start from scratch."""
    if build_dir.resolve() == source_dir.resolve():
        raise BuildDirMismatchError(f"the build dir {build_dir} is the source tree itself",
                                    "use a separate --build-dir (the default is ../build-<backend>)")
    populated = build_dir.is_dir() and any(build_dir.iterdir())
    owner = build_dir_owner(build_dir) if populated else None
    if populated and owner is None:
        raise BuildDirMismatchError(
            f"{build_dir} is not empty and is not a dfbuild/CMake build dir; nothing was touched",
            "choose a new or empty --build-dir",
        )
    if fresh and populated and read_stamp(build_dir) is None:
        # a CMake cache alone may be another project's build dir: --fresh deletes only what dfbuild made
        raise BuildDirMismatchError(
            f"{build_dir} has no dfbuild stamp ({STAMP_NAME}), so --fresh will not delete it; nothing was touched",
            "delete it yourself if it is yours to lose, or choose another --build-dir",
        )
    if fresh and populated:
        ui.info(f"removing the old build dir {build_dir} (--fresh)")
        shutil.rmtree(build_dir)
        populated, owner = False, None

    mismatch = owner is not None and (owner["backend"] != backend or not _same_path(owner["source_dir"], source_dir))
    if owner is not None and mismatch and not reconfigure:
        raise BuildDirMismatchError(
            f"{build_dir} was made for the {owner['backend']} backend of {owner['source_dir']}, "
            f"not for {backend} of {source_dir}",
            "pass --reconfigure to reuse it, --fresh to start it over, or another --build-dir",
        )
    stamp = read_stamp(build_dir) or {}
    stamp.update({"backend": backend, "source_dir": str(source_dir.resolve())})
    if mismatch or reconfigure:
        stamp.pop("configured_args", None)
    write_stamp(build_dir, stamp)
    return reconfigure and populated
