"""OpenSSL for a cross build: TLS for `llama-server -hf` where the target has no system OpenSSL.

llama.cpp's Windows release links BoringSSL, which its CMake fetches from
boringssl.googlesource.com at configure time. A cross build here reaches only
the package indexes, and mingw-w64 has no OpenSSL package in Debian, so dfbuild
builds one: OpenSSL's own release tarball as Debian's source archive keeps it
(`openssl_<version>.orig.tar.gz`, pinned by sha256 in targets.toml), configured
for the target, compiled into static libssl.a/libcrypto.a, and linked into the
binaries through llama.cpp's own `LLAMA_OPENSSL=ON` path (FindOpenSSL, the
OpenSSL 3 version check). Like BoringSSL in llama.cpp's zip, nothing is loaded
at run time and no OpenSSL DLL is shipped.

The result is kept in dfbuild's cache, keyed by everything that changes its
bytes (version, sha256, options, compiler): it is built once per toolchain
(about 10 minutes on 2 cores) and then reused by every build. A build happens
in a `.partial` folder that is renamed into place only when complete, under a
lock, so Ctrl-C, `kill -9` or two builds at once never leave a half-built copy
that a later build would link.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from dfbuild.core import fetch, paths, proc, ui, unpack
from dfbuild.core.errors import BuildError, SourceError, ToolchainMissingError

BUILT_NAME = "dfbuild-openssl.json"  # written last: a folder without it is not a usable build


def tarball_path(spec: dict) -> Path:
    return paths.cache_dir() / "tls" / f"openssl-{spec['version']}.tar.gz"


def build_key(spec: dict, compiler_version: str) -> str:
    """What decides the built libraries' bytes: a new value is a new folder (the old one is never reused)."""
    fields = [spec["version"], spec["sha256"], spec["configure_target"], *spec.get("configure_options", ()),
              compiler_version]
    return hashlib.sha256("\0".join(fields).encode()).hexdigest()[:12]


def prefix_path(spec: dict, compiler_version: str) -> Path:
    return paths.cache_dir() / "tls" / f"openssl-{spec['version']}-{spec['configure_target']}-" \
                                       f"{build_key(spec, compiler_version)}"


def is_built(prefix: Path) -> bool:
    return ((prefix / BUILT_NAME).is_file() and (prefix / "include" / "openssl" / "ssl.h").is_file()
            and all((prefix / "lib" / name).is_file() for name in ("libssl.a", "libcrypto.a")))


def configure_command(spec: dict, tools: dict[str, str]) -> list[str]:
    """Configure's argument list: the target, the options of targets.toml, the cross tools by name."""
    return ["perl", "Configure", spec["configure_target"], *spec.get("configure_options", ()),
            *(f"{var}={tool}" for var, tool in tools.items())]


def tarball(spec: dict) -> Path:
    """The pinned source tarball, downloaded once into the cache (checked against its sha256 every time)."""
    path = tarball_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        if paths.sha256_file(path) == spec["sha256"]:
            return path
        ui.warn(f"{path} does not match the pinned sha256 of OpenSSL {spec['version']}: downloading it again")
        path.unlink()
    failures = []
    for url in spec["urls"]:
        try:
            ui.info(f"downloading OpenSSL {spec['version']} (TLS for the Windows build) from {url}")
            fetch.download(url, path, sha256=spec["sha256"], name=path.name,
                           reach="check that Debian's archive (deb.debian.org) is reachable")
            return path
        except SourceError as exc:
            failures.append(exc.message)
    raise SourceError(f"cannot get OpenSSL {spec['version']}'s source: " + "; ".join(failures),
                      f"download openssl-{spec['version']}.tar.gz (sha256 {spec['sha256']}) from openssl.org or "
                      f"Debian's archive and put it at {path}")


def ensure(spec: dict, tools: dict[str, str], compiler_version: str, *, jobs: int | None = None) -> Path:
    """The folder holding include/ and lib/libssl.a, lib/libcrypto.a for SPEC, built with TOOLS when absent."""
    prefix = prefix_path(spec, compiler_version)
    if is_built(prefix):
        return prefix
    for program in ("perl", "make"):
        if shutil.which(program) is None:
            raise ToolchainMissingError(f"{program} is not installed: it builds OpenSSL (TLS for the Windows build)",
                                        f"install {program} (Debian, Ubuntu: apt-get install {program})")
    with paths.locked(prefix):
        if is_built(prefix):  # another dfbuild built it while this one waited
            return prefix
        source = tarball(spec)
        _build(spec, tools, source, prefix, jobs or os.cpu_count() or 2)
    return prefix


def _build(spec: dict, tools: dict[str, str], source: Path, prefix: Path, jobs: int) -> None:
    partial = prefix.with_name(prefix.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed build left (we hold the lock)
    shutil.rmtree(prefix, ignore_errors=True)   # a folder without its record is not a build
    partial.mkdir(parents=True)
    try:
        _build_in(spec, tools, source, prefix, partial, jobs)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # renamed into place when it worked


def _build_in(spec: dict, tools: dict[str, str], source: Path, prefix: Path, partial: Path, jobs: int) -> None:
    log_path = prefix.with_name(prefix.name + ".log")
    ui.info(f"building OpenSSL {spec['version']} for {spec['configure_target']} once ({jobs} jobs; "
            f"log: {log_path}); every later build reuses it")
    unpack.extract(source, partial / "src")
    tops = [p for p in (partial / "src").iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise BuildError(f"{source} does not hold one source folder", f"delete {source} and run again")
    tree = tops[0]
    # OpenSSL stamps "built on <date>" into the library: the tarball's own date, so a rebuild gives the same bytes
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(int((tree / "VERSION.dat").stat().st_mtime))}
    with open(log_path, "w", encoding="utf-8") as log:
        for command in (configure_command(spec, tools), ["make", f"-j{jobs}", "build_libs"]):
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            done = proc.run(command, cwd=tree, stdout=log, stderr=proc.STDOUT, env=env)
            if done.returncode != 0:
                raise BuildError(f"building OpenSSL {spec['version']} failed ({command[0]} {command[1]}: "
                                 f"exit {done.returncode})", f"full log: {log_path}")
    (partial / "lib").mkdir()
    for name in ("libssl.a", "libcrypto.a"):
        shutil.copy2(tree / name, partial / "lib" / name)
    shutil.copytree(tree / "include" / "openssl", partial / "include" / "openssl")
    shutil.copy2(tree / spec.get("license", "LICENSE.txt"), partial / "LICENSE.txt")
    shutil.rmtree(tree)
    shutil.rmtree(partial / "src")
    (partial / BUILT_NAME).write_text(json.dumps({
        "library": "OpenSSL", "version": spec["version"], "sha256": spec["sha256"],
        "configure": configure_command(spec, tools)}, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, prefix)


def describe(spec: dict) -> str:
    """The manifest's `tls` line for a build linked with it."""
    return f"OpenSSL {spec['version']} (static, built by dfbuild from Debian's source archive)"
