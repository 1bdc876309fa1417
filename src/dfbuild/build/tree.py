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

The stage's jobs have their modules: build_version (the commit and its stamp),
build_dir (the stamp file and the claim), build_config (flags, arguments,
environment, CPU variants), build_run (a step, its log and first error). This
one runs them for a BuildRequest (build_tree), says what a build ships and its
digests, and is where callers import the stage's names from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from dfbuild.build.config import (
    _VARIANTS_CMAKE,
    VARIANTS_INCLUDE,
    _variant_compiler,
    build_env,
    build_flags,
    env_cmake_args,
    parse_cpu_variants,
    relative_file_args,
    unbuildable_variants,
    upstream_options,
)
from dfbuild.build.directory import (
    STAMP_NAME,
    build_dir_owner,
    claim_build_dir,
    cuda_facts,
    default_build_dir,
    dir_label,
    read_cmake_cache,
    read_stamp,
    write_stamp,
)
from dfbuild.build.request import ALL_TARGETS, DEFAULT_TARGETS, BuildRequest, parse_targets
from dfbuild.build.run import LOG_NAME, _fail, _run_logged, first_error
from dfbuild.build.version import (
    BUILD_INFO_TEMPLATE,
    _stamps_build_info,
    build_number,
    check_llama_tree,
    source_commit,
    stamp_base,
    stamp_build_info,
)
from dfbuild.core import ui
from dfbuild.core.errors import BuildError, ToolchainMissingError
from dfbuild.core.paths import cache_dir, sha256_file
from dfbuild.host import backends, doctor, platforms, probes, webui
from dfbuild.host.backends import Host
from dfbuild.host.platforms import rocm_root


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
    return match is not None and match.group(1) not in variants


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
        entry = doctor.require(spec, host,
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
    flags = build_flags(spec, host, commit=configured_commit, number=number, entry=entry,
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
        found_cmake, found_ninja = probes.find_pypi_program("cmake"), probes.find_pypi_program("ninja")
        if found_cmake is None or found_ninja is None:  # dfbuild's own dependencies: doctor.require saw them
            raise ToolchainMissingError("cmake or ninja is not installed beside dfbuild",
                                        "reinstall dfbuild (both are its dependencies on PyPI)")
        cmake, ninja = found_cmake, found_ninja

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
        binds: list[Path | str] = [source_dir, build_dir, env["CCACHE_DIR"]]
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
                if setup.get("tls") else probes.probe("openssl-headers", host).install or "install libssl-dev")
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
    if backend == "cuda":
        section.update(cuda_facts(cache))
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


# the stage's public names, those of the modules above included
__all__ = ["ALL_TARGETS", "BUILD_INFO_TEMPLATE", "DEFAULT_TARGETS", "LOG_NAME", "SMOKE_PROGRAMS", "STAMP_NAME",
    "VARIANTS_INCLUDE", "build_dir_owner", "build_env", "build_flags", "build_number", "build_tree", "check_llama_tree",
    "claim_build_dir", "cuda_facts", "default_build_dir", "dir_label", "env_cmake_args", "first_error",
    "parse_cpu_variants", "parse_targets", "payload_digest", "read_cmake_cache", "read_stamp", "relative_file_args",
    "smoke_digest", "source_commit", "stamp_base", "stamp_build_info", "unbuildable_variants", "upstream_options",
    "write_stamp"]
