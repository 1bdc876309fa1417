"""The manifest: plain data that grows as it flows through the stages.

Sections: source, series, build, smoke, proof (both trees smoked), release. Each stage returns its own
section as a dict of JSON-friendly values; the manifest is just a dict of them. Beside them, `request`:
what the command that built was asked (request.BuildRequest.to_dict).
A checkout keeps its manifest inside its git dir so the tree never looks dirty.
"""

from __future__ import annotations

from pathlib import Path

from dfbuild.core import paths, state
from dfbuild.core.ui import dumps

SECTIONS = ("source", "series", "build", "smoke", "proof", "release", "request")


def tree_manifest_path(tree: Path) -> Path:
    return paths.git_dir(tree) / "dfbuild" / "manifest.json"


def load(path: Path) -> dict:
    """The manifest at PATH; a missing or unreadable one is {} (with a warning), never a crash."""
    return state.read_json(path, "manifest")


def save(manifest: dict, path: Path) -> Path:
    """Atomic (temp file, fsync, rename): an interrupt leaves the old manifest or the new one."""
    return state.atomic_write_text(Path(path), dumps(manifest) + "\n")


def update_tree_manifest(tree: Path, section: str, data: dict) -> dict:
    """Record one stage's section in the checkout's manifest and return the whole manifest."""
    assert section in SECTIONS, section
    path = tree_manifest_path(tree)
    state.clear_non_file(path, "tree record")
    manifest = load(path)
    manifest[section] = data
    save(manifest, path)
    return manifest
