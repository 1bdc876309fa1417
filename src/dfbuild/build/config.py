"""What a build is configured with: the CMake flags (the backend table's, llama.cpp's own release
options for the tree, the per-build ones), the extra CMake arguments, the environment, and the CPU
variants this compiler can build.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
from collections.abc import Iterable
from pathlib import Path

from dfbuild.build import upstream_release
from dfbuild.build.request import ALL_TARGETS
from dfbuild.core import proc, ui
from dfbuild.core.errors import BuildError, ToolchainMissingError
from dfbuild.host import backends, platforms, probes
from dfbuild.host.backends import Host

VARIANTS_INCLUDE = "dfbuild-cpu-variants.cmake"


# Injected with CMAKE_PROJECT_INCLUDE when only some CPU variants are wanted
# (--cpu-variants). ggml makes its `ggml` target depend on every variant module
# (add_dependencies(ggml ggml-cpu-<name>)), so building llama-server would
# compile all of them; this drops the unwanted ones from that dependency and
# from `all`. The wanted ones are then built as explicit ninja targets.
_VARIANTS_CMAKE = """\
# written by dfbuild: build only the CPU variants in DFBUILD_CPU_VARIANTS
if(NOT COMMAND _dfbuild_variants_guard AND NOT DFBUILD_CPU_VARIANTS STREQUAL "all")
  function(_dfbuild_variants_guard)
  endfunction()
  function(add_dependencies target)
    set(kept)
    foreach(dep ${ARGN})
      set(wanted TRUE)
      if(target STREQUAL "ggml" AND dep MATCHES "^ggml-cpu-(.+)$")
        list(FIND DFBUILD_CPU_VARIANTS "${CMAKE_MATCH_1}" index)
        if(index EQUAL -1)
          set(wanted FALSE)
          set_target_properties(${dep} PROPERTIES EXCLUDE_FROM_ALL ON)
          message(STATUS "dfbuild: CPU variant ${CMAKE_MATCH_1} is not built (--cpu-variants)")
        endif()
      endif()
      if(wanted)
        list(APPEND kept ${dep})
      endif()
    endforeach()
    if(kept)
      _add_dependencies(${target} ${kept})
    endif()
  endfunction()
endif()
"""


def _nvcc_version(entry: dict) -> tuple[int, ...] | None:
    for probe in entry["toolchain"]:
        if probe["name"] == "nvcc" and probe["version"]:
            return probes.version_tuple(probe["version"])
    return None


def _probe_path(entry: dict, name: str) -> str | None:
    for probe in entry["toolchain"]:
        if probe["name"] == name and probe["found"]:
            return probe["path"]
    return None


def upstream_options(source_dir: Path, backend: backends.Backend | str, host: Host,
                     entry: dict) -> tuple[dict[str, str], dict]:
    """The CMake options llama.cpp's own release workflow of this tree configures this entry with
    (its .github/workflows/release.yml), as dfbuild takes them, and the record of where they came
    from (the manifest's build.upstream_release): the job and matrix entry, what was not taken and
    why, or why the tree's file gave nothing (then the backend table's flags stand alone)."""
    backend = backends.resolve(backend).name  # the name, where a caller passed the table entry
    nvcc = _nvcc_version(entry)
    toolkit = ".".join(map(str, nvcc[:2])) if backend == "cuda" and nvcc else None
    reading = upstream_release.read(source_dir, host.os, backend, host.arch, toolkit)
    taken, not_taken = upstream_release.cmake_options(reading)
    record = reading.summary()
    if reading.found:
        record.update({"taken": taken, "not_taken": not_taken})
    else:
        record["note"] = f"{reading.note}; the flags are backends.toml's"
    return taken, record


def build_flags(backend: backends.Backend | str, host: Host, *, commit: str, number: int, entry: dict,
                cuda_arch=None, gpu_targets=None, vulkan_include_dir=None, use_ccache: bool = True,
                upstream: dict[str, str] | None = None) -> dict[str, str]:
    """The table's flags for (backend, host), then UPSTREAM (the options the tree's own release
    workflow takes: upstream_options), then a cross target's own flags and the per-build ones:
    version stamp, launchers, compilers. --cuda-arch / --gpu-targets stay the user's."""
    flags = backends.cmake_flags(backend, host.os, cuda_arch=cuda_arch, gpu_targets=gpu_targets,
                                 vulkan_include_dir=vulkan_include_dir, nvcc_version=_nvcc_version(entry),
                                 arch=host.arch)
    for name, value in (upstream or {}).items():
        if name not in ("CMAKE_CUDA_ARCHITECTURES", "GPU_TARGETS") or name not in flags:
            flags[name] = value
    if host.cross:  # the cross target's own flags (targets.toml): shared libraries, its TLS choice
        flags.update(platforms.cross_entry(host).get("flags", {}))
    flags["LLAMA_BUILD_NUMBER"] = str(number)
    flags["LLAMA_BUILD_COMMIT"] = commit
    ccache = _probe_path(entry, "ccache") if use_ccache else None
    backend = backends.resolve(backend).name
    if ccache:
        languages = ["C", "CXX"] + {"cuda": ["CUDA"], "hip": ["HIP"]}.get(backend, [])
        for language in languages:
            flags[f"CMAKE_{language}_COMPILER_LAUNCHER"] = ccache
    if backend == "hip":
        hipconfig = _probe_path(entry, "hip-clang")
        llvm_bin = probes.run_version(hipconfig, ["-l"]) if hipconfig else ""
        if llvm_bin:
            flags["CMAKE_HIP_COMPILER"] = str(Path(llvm_bin.splitlines()[-1].strip()) / "clang")
    if backend == "cuda":
        nvcc = _probe_path(entry, "nvcc")
        if nvcc and not shutil.which("nvcc"):  # found through CUDA_PATH or a default dir only
            flags["CMAKE_CUDA_COMPILER"] = nvcc
    return flags


def env_cmake_args() -> list[str]:
    """Extra CMake arguments from DFBUILD_CMAKE_ARGS (shell-quoted), as llama-cpp-python takes CMAKE_ARGS.

    They change what every build compiles, so they are part of the configure
    arguments (a change reconfigures) and of the build section (`cmake_args_env`).
    The tests use it to compile at -O1: about half the compile time of -O3 on 2 cores.
    """
    return shlex.split(os.environ.get("DFBUILD_CMAKE_ARGS", ""))


def relative_file_args(host: Host, source_dir: Path, build_dir: Path, extra_c: Iterable[str] = ()) -> list[str]:
    """CMake arguments that make __FILE__ relative to the tree (gcc and clang: not on Windows).

    ggml's asserts and aborts print __FILE__, and CMake hands the compiler absolute
    paths, so without a prefix map every binary would carry the build folder.
    ccache's base_dir rewrites the mapped paths too, so trees in different folders
    still share its entries (and an entry compiled elsewhere brings no foreign path).
    The user's CFLAGS/CXXFLAGS are kept: CMake ignores them once CMAKE_<LANG>_FLAGS is given.
    A cross build for Windows compiles with GCC (mingw-w64), so it gets the maps too; EXTRA_C
    (its compat header's forced include) goes to C files only.
    """
    if host.os == "windows" and not host.cross:
        return []
    maps = " ".join(f"-fmacro-prefix-map={Path(d).resolve()}/={label}"
                    for d, label in ((source_dir, ""), (build_dir, "build/")))  # the last match wins
    extra = {"C": " ".join(extra_c), "CXX": ""}
    return [f"-DCMAKE_{lang}_FLAGS={' '.join(filter(None, [os.environ.get(env, '').strip(), maps, extra[lang]]))}"
            for lang, env in (("C", "CFLAGS"), ("CXX", "CXXFLAGS"))]


def build_env(backend: str, host: Host, source_dir: Path, build_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # ccache: hash paths relative to the common parent, so X/src + X/build-cpu hits the
    # cache that Y/src + Y/build-cpu filled.
    env.setdefault("CCACHE_BASEDIR", os.path.commonpath([str(source_dir.resolve()), str(build_dir.resolve())]))
    env.setdefault("CCACHE_NOHASHDIR", "true")
    env["NINJA_STATUS"] = "[%f/%t] "
    # llama.cpp gzips its web UI assets with `gzip -c`, which stores each file's mtime (the
    # checkout's time) in the header, and embeds them with an ETag hashed from those bytes: -n
    # leaves the time out, so two checkouts give the same binary (gzip warns that GZIP is deprecated)
    env.setdefault("GZIP", "-n")
    # ggml turns its instruction-set defaults (AVX2, FMA, ...) off whenever
    # SOURCE_DATE_EPOCH is set; the flags here are explicit, so keep the
    # reproducible-archive setting away from CMake.
    env.pop("SOURCE_DATE_EPOCH", None)
    if host.os == "windows" and not host.cross:
        msvc = probes.find_msvc(host.arch)
        if msvc is None:
            raise ToolchainMissingError("MSVC (cl.exe) was not found", probes.MSVC_HINT)
        if msvc["cl"] is None:
            ui.info(f"using the MSVC environment from {msvc['vcvars']}")
            env.update(probes.msvc_environment(msvc["vcvars"]))
    return env


def parse_cpu_variants(value: str | Iterable[str] | None, host: Host) -> list[str]:
    """--cpu-variants: `all` (the default) or a list of ggml's variant names (x64, haswell, ...)."""
    known = backends.host_cpu_variants(host)
    items = [] if value is None else (re.split(r"[,;\s]+", value) if isinstance(value, str) else list(value))
    items = [i.strip() for i in items if i and i.strip()]
    if not items or items == [ALL_TARGETS]:
        return known
    if not known:
        raise BuildError(f"--cpu-variants: {host.os}/{host.arch} builds have no runtime-dispatched CPU variants",
                         "drop --cpu-variants")
    unknown = [i for i in items if i not in known]
    if unknown:
        raise BuildError(f"--cpu-variants: unknown variant(s) {', '.join(unknown)}",
                         f"choose from: all, {', '.join(known)}")
    return [v for v in known if v in items]  # ggml's order: baseline first


def _variant_compiler(entry: dict, host: Host) -> str | None:
    """The C compiler the CPU variants are compiled with: the cross compiler of a cross build, else the probe's."""
    if host.cross:
        return shutil.which(platforms.cross_entry(host).get("c_compiler", "")) or None
    return _probe_path(entry, "c-compiler")


def unbuildable_variants(compiler: str | None, variants: Iterable[str]) -> dict[str, str]:
    """{variant: why} for the VARIANTS whose -march (backends.toml cpu_variant_march) COMPILER rejects:
    a test compile each (cached per compiler and -march). Variants without an -march there (x64's) pass."""
    marches = backends.table()["common"].get("cpu_variant_march", {})
    if not compiler:
        return {}
    found = {}
    for variant in variants:
        if variant in marches:
            why = _march_problem(compiler, marches[variant])
            if why:
                found[variant] = why
    return found


@functools.cache
def _march_problem(compiler: str, march: str) -> str | None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dfbuild-march-") as tmp:
        source = Path(tmp) / "march.c"
        source.write_text("int dfbuild_march_check(void) { return 0; }\n", encoding="utf-8")
        try:
            result = proc.run([compiler, f"-march={march}", "-c", str(source), "-o", str(Path(tmp) / "m.o")],
                              errors="replace")
        except OSError as exc:
            return f"{Path(compiler).name} cannot run: {exc}"
    if result.returncode == 0:
        return None
    first = next((line.strip() for line in result.stderr.splitlines() if "error" in line), result.stderr.strip())
    return f"{Path(compiler).name} rejects -march={march}: {first[:160]}"
