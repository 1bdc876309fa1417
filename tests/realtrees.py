"""Real llama.cpp trees for integration tests, made through dfbuild's own stages.

Every tree lives under the test cache as NAME/src with its CPU build in
NAME/build-cpu, so a fresh build dir of the same layout hits the shared ccache.
Reruns are cheap: checkout keeps an applied series, apply is then a no-op, and
ninja finds nothing to do.
"""

from __future__ import annotations

import os
from pathlib import Path

from dfbuild import build, series, source

CACHE = Path(os.environ.get("DFBUILD_TEST_CACHE", Path.home() / ".cache" / "dfbuild-tests"))


def tree_name(base: str, patched: bool, skip: tuple[str, ...] = ()) -> str:
    name = f"{base}-{'patched' if patched else 'unpatched'}"
    return name + "".join(f"-no-{concern}" for concern in skip)


def checkout_tree(base: str, *, patched: bool, skip: tuple[str, ...] = ()) -> Path:
    src = CACHE / "trees" / tree_name(base, patched, skip) / "src"
    source.checkout(base, dest=src, force=True, keep_descendants=patched)
    if patched:
        series.apply_series(series.load_series(), src, skip=skip)
    return src


def built_tree(base: str, *, patched: bool, skip: tuple[str, ...] = (), backend: str = "cpu") -> dict:
    """Check out, patch and build; returns the build section (build_dir, binaries, ...)."""
    src = checkout_tree(base, patched=patched, skip=skip)
    return build.build_tree(src, backend, src.parent / f"build-{backend}")


def server_binary(build_section: dict) -> Path:
    return Path(build_section["build_dir"]) / "bin" / ("llama-server.exe" if os.name == "nt" else "llama-server")
