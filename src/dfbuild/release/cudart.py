"""The CUDA runtime archives a CUDA release ships beside its archive, as llama.cpp's release workflow
packs them: cudart-llama-bin-win-cuda-<x.y>-<arch>.zip on Windows, cudart-llama-<tag>-bin-ubuntu-cuda-
<x.y>-<arch>.tar.gz on Linux (the libraries its base's release.yml names, and their licence terms).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dfbuild.build.directory import cuda_facts, read_cmake_cache
from dfbuild.core import owned
from dfbuild.core.archive import ZIP_EPOCH_MIN, Entry, archive_root, write_archive
from dfbuild.core.errors import ReleaseError
from dfbuild.host import backends, matrix
from dfbuild.release.record import payload_records, release_files


def cudart_bundle(out_dir: Path, toolkit: str, arch: str, cuda_path: Path | None = None) -> Path:
    """Windows CUDA: the runtime DLLs as llama.cpp ships them next to its archive (cudart-llama-bin-win-cuda-...zip).

    cudart64_*.dll, cublas64_*.dll and cublasLt64_*.dll from CUDA_PATH (bin/,
    bin/x64/ on CUDA 13), at the zip's top level like upstream's, so they unzip
    into the folder that holds llama-server.exe.
    """
    root = Path(cuda_path or os.environ.get("CUDA_PATH") or "")
    if not str(root) or not root.is_dir():
        raise ReleaseError("CUDA_PATH is not set, so the CUDA runtime DLLs cannot be bundled",
                           "run from a shell where the CUDA toolkit set CUDA_PATH")
    dlls: dict[str, Path] = {}
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
    """The CUDA toolkit a build used: the one its CMake cache names (build.tree.cuda_facts), else CUDA_PATH or
    CUDA_HOME, else the folder above the nvcc on PATH, else /usr/local/cuda."""
    recorded = build_section.get("cuda_toolkit_root")
    if recorded is None and build_section.get("build_dir"):  # a build recorded before the section kept it
        recorded = cuda_facts(read_cmake_cache(Path(build_section["build_dir"]))).get("cuda_toolkit_root")
    for candidate in (recorded, os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")):
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
        raise ReleaseError(f"{', '.join(missing)} not found under {root} "
                           f"({', '.join(d for d in spec.get('lib_dirs', []))})",
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


def cuda_runtime_libraries(tree: Path, os_name: str, arch: str, toolkit: str | None) -> list[str]:
    """The CUDA runtime libraries llama.cpp's release workflow of this base packs beside a Linux CUDA
    archive (libcudart, libcublas, libcublasLt), else backends.toml's list (a base before b11063
    has no ubuntu-cuda job)."""
    from dfbuild.build import upstream_release

    reading = upstream_release.read(Path(tree), os_name, "cuda", arch, toolkit) if os_name == "linux" else None
    if reading is not None and reading.found and reading.cudart:
        return list(reading.cudart)
    return list(backends.get("cuda").raw.get("runtime_archive", {}).get("libraries", []))
