"""What makes a directory a llama.cpp tree (its markers, the blob of common/speculative.cpp), and the
commits dfbuild writes into one: a fixed identity and date for imports, the project's for patches,
so one input always gives one commit id.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import git

from dfbuild.core import gitrun

# Commits dfbuild writes itself when it imports a tree use one identity and one
# date, so the same input always gives the same commit id.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "dfbuild",
    "GIT_AUTHOR_EMAIL": "dfbuild@localhost",
    "GIT_COMMITTER_NAME": "dfbuild",
    "GIT_COMMITTER_EMAIL": "dfbuild@localhost",
}
FIXED_DATE = "2000-01-01T00:00:00+0000"

# The project, as the author of the patches it curates and the committer of the commits they
# become in a tree (pyproject.toml's `authors`; tests/test_dep3.py keeps the two equal). A patch
# commit carries its patch's own author and Date, so it is as reproducible as an import.
PROJECT_NAME = "dfbuild maintainers"
PROJECT_EMAIL = "maintainers@users.noreply.a-seed-1169d44c.example"

# Repos dfbuild creates keep files byte for byte on every OS (no CRLF conversion
# on Windows), so blob ids, patches and imported commit ids match everywhere.
KEEP_BYTES = ("core.autocrlf", "false")

# The files that make a directory a llama.cpp tree.
LLAMA_MARKERS = ("CMakeLists.txt", "common/speculative.cpp")


def commit_fixed(repo: git.Repo, message: str, date: str = FIXED_DATE) -> str:
    return _commit(repo, message, dict(FIXED_IDENTITY, GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date))


def commit_patch(repo: git.Repo, message: str, author: tuple[str, str], date: str) -> str:
    """Commit the index as a patch's own commit: its AUTHOR (name, email) and DATE, committed by the
    project at that same date (as `git am --committer-date-is-author-date` would), so one base and
    one series always give one commit id."""
    return _commit(repo, message, patch_identity(author, date))


def patch_identity(author: tuple[str, str], date: str) -> dict:
    """The git environment a patch's commit is made with: its author and date, committed by the project."""
    name, email = author
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date,
            "GIT_COMMITTER_NAME": PROJECT_NAME, "GIT_COMMITTER_EMAIL": PROJECT_EMAIL, "GIT_COMMITTER_DATE": date}


def _commit(repo: git.Repo, message: str, who: dict) -> str:
    # no hooks at all (--no-verify leaves prepare-commit-msg on): they could change the commit id
    env = dict(who, GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0="core.hooksPath", GIT_CONFIG_VALUE_0=os.devnull)
    repo.git.commit("--no-verify", "--no-gpg-sign", "-q", "-m", message, env=env)
    return repo.head.commit.hexsha


def is_llama_tree(path: Path) -> bool:
    return all((Path(path) / marker).is_file() for marker in LLAMA_MARKERS)


def committed_blob(tree: Path, commit: str) -> str | None:
    """The blob id of common/speculative.cpp at COMMIT (what the base was, whatever sits on top now)."""
    result = gitrun.run(tree, "rev-parse", "--verify", "--quiet", f"{commit}:{LLAMA_MARKERS[1]}", check=False)
    return result.stdout.strip() or None


def speculative_blob(tree: Path) -> str | None:
    """The git blob id of common/speculative.cpp: how a base is recognised by content."""
    path = Path(tree) / "common" / "speculative.cpp"
    if not path.is_file():
        return None
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
