"""Importing an archive or a PyPI sdist that vendors llama.cpp: unpacked safely, committed once with a
fixed identity, and kept as a bare cache repo per offline base (whose blobs carry reads too).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import cast

import git

from dfbuild.core import gitrun, manifest, state
from dfbuild.core.errors import (
    ArchiveError,
    DfbuildError,
    NotLlamaTreeError,
)
from dfbuild.core.paths import cache_dir, locked
from dfbuild.core.staging import clear_debris, move_into_place, staged
from dfbuild.core.unpack import (
    Limits,
    check_links_stay_in,
    extract,
)
from dfbuild.source import pypi
from dfbuild.source.gitfetch import (
    _has_blob,
    cache_path,
    ensure_commit,
    release_build,
    valid_ref_name,
)
from dfbuild.source.known_bases import (
    KNOWN_BASES,
    MAX_NAME_BYTES,
    KnownBase,
    absolute_if_local,
    branch_for,
    known_base,
)
from dfbuild.source.sdist import cached as cached_sdist
from dfbuild.source.sdist import fetch_sdist
from dfbuild.source.tree_commits import FIXED_DATE, KEEP_BYTES, commit_fixed, is_llama_tree, speculative_blob


def _offline_cache_repo(base: KnownBase) -> git.Repo:
    """The bare cache repo holding the one-commit import of an offline base."""
    path = cache_dir() / "imports" / f"{base.name}.git"
    with locked(path):
        if path.exists():
            return git.Repo(path)
        build = release_build(base.name)
        requirement = cast(str, base.sdist)  # an offline base: its sdist is what is imported
        # a clear "no such release" before any download; a cached sdist needs no index at all
        if base.name not in KNOWN_BASES and build is not None and cached_sdist(requirement) is None:
            pypi.require_release(build)
        archive = fetch_sdist(requirement)
        with state.temp_dir("import") as tmp:
            work = Path(tmp) / "tree"
            import_archive(archive, base.name, work, date=base.date,
                           message=f"Import llama.cpp {base.name} from {base.sdist}")
            tmp_bare = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp_bare, ignore_errors=True)
            git.Repo.clone_from(str(work), tmp_bare, bare=True, multi_options=["--quiet"])
            tmp_bare.rename(path)
    return git.Repo(path)


def known_base_blob(name: str, blob: str) -> bytes | None:
    """BLOB's content from the cached tree of known base NAME, or None when that tree is out of reach.

    An offline base (an sdist) is fetched and imported once for this; a git
    base is read from its cache repo only if one exists, and when that cache
    (shallow: it holds what checkouts asked for) lacks the base's commit, that
    one commit is fetched into it (see ensure_commit).
    """
    known = known_base(name)
    if known is None:
        return None
    if known.sdist:
        try:
            git_dir = _offline_cache_repo(known).git_dir
        except DfbuildError:
            return None
    elif known.repo:
        url = absolute_if_local(known.repo)
        git_dir = cache_path(url)
        if not _has_blob(git_dir, blob) and known.commit:
            ensure_commit(url, known.commit)
    else:
        return None
    result = gitrun.run(None, "cat-file", "blob", blob, git_dir=git_dir, text=False, check=False)
    return result.stdout if result.returncode == 0 else None


# --- importing archives ---------------------------------------------------------------


def find_llama_root(top: Path) -> Path:
    """The shallowest directory holding the llama.cpp markers."""
    candidates = sorted(
        (p.parent.parent for p in top.rglob("common/speculative.cpp") if is_llama_tree(p.parent.parent)),
        key=lambda p: len(p.parts),
    )
    if not candidates:
        raise ArchiveError(
            "no llama.cpp tree in the archive (no directory with CMakeLists.txt and common/speculative.cpp)",
            "pass an archive or sdist that contains llama.cpp sources",
        )
    return candidates[0]


def check_tag_name(tag: str) -> None:
    """A tag git accepts and that stays one plain name (it also names the default DIR)."""
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", tag or "")
    if not plain or ".." in tag.split("/") or len(tag) > MAX_NAME_BYTES or not valid_ref_name(f"refs/tags/{tag}") \
            or not valid_ref_name(f"refs/heads/{branch_for(tag)}"):
        raise ArchiveError(f"'{tag}' is not a valid tag name; nothing was touched",
                           "use letters, digits, '.', '_', '-' or '/' as git allows them (no '..', no '.lock' ending)")


def import_archive(archive: Path, tag: str, dest: Path, *, date: str = FIXED_DATE, message: str | None = None,
                   limits: Limits | None = None) -> dict:
    """Make DEST a one-commit git repo tagged TAG from a .tar.gz/.zip/sdist holding llama.cpp.

    The repo is made in a staging dir beside DEST and renamed into place when
    complete, so an interrupt never leaves a half-made DEST; the next run removes
    the staging dir.
    """
    check_tag_name(tag)
    archive = Path(archive)
    dest = Path(dest).resolve()
    if not archive.is_file():
        raise ArchiveError(f"archive {archive} does not exist", "check the path")
    clear_debris(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise NotLlamaTreeError(f"{dest} already exists and is not empty; nothing was touched",
                                "import into a new or empty directory")

    with staged(dest) as partial:
        work = partial / "tree"
        extract(archive, partial / "unpacked", limits)
        root = find_llama_root(partial / "unpacked")
        # vendored trees carry a .git *file* pointing at a submodule dir that is not there
        stale_git = root / ".git"
        if stale_git.is_file() or stale_git.is_symlink():
            stale_git.unlink()
        elif stale_git.is_dir():
            shutil.rmtree(stale_git)
        check_links_stay_in(root)
        os.replace(root, work)

        repo = git.Repo.init(work)
        repo.git.config(*KEEP_BYTES)
        repo.git.add("-A", "-f")  # the tree's own .gitignore hides a few real files
        commit = commit_fixed(repo, message or f"Import llama.cpp from {archive.name}", date)
        repo.git.tag(tag, commit)
        repo.git.checkout("--quiet", "-B", branch_for(tag))
        section = {
            "kind": "archive",
            "repo": str(archive),
            "pr": None,
            "base": tag,
            "commit": commit,
            "upstream_commit": None,
            "branch": branch_for(tag),
            "dir": str(dest),
            "speculative_blob": speculative_blob(work),
            "state": "clean",
        }
        # the record goes in before the rename: DEST is complete, with its record, or absent
        manifest.update_tree_manifest(work, "source", section)
        move_into_place(work, dest)
    return section
