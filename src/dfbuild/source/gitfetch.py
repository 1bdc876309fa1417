"""Fetching llama.cpp from git: the bare cache repos under the cache's repos/, filled shallowly.

A repository is cached once per URL and fetched into only as deep as a checkout
needs (see SHALLOW_KEY). source.py turns what is fetched here into the user's DIR.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import git

from dfbuild.core import gitrun, proc, ui
from dfbuild.core.errors import SourceError
from dfbuild.core.paths import cache_dir, locked
from dfbuild.model.series import RELEASE_NAME, release_build  # noqa: F401 - the names a tag is read with

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


def slug(text: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[-40:]
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def valid_ref_name(ref: str) -> bool:
    """Whether git accepts REF (a full name like refs/tags/X) as a ref name."""
    if ref.startswith("-") or "\0" in ref:
        return False
    return gitrun.ok(None, "check-ref-format", ref)


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
    tail: list[str] = []
    with ui.Progress(title) as progress:
        def show(line: str) -> None:
            nonlocal tail
            match = _GIT_PROGRESS.match(line.strip())
            if match:
                progress.update(match.group(1).lower(), float(match.group(2)), match.group(5).strip(" ,"))
            elif line.strip():
                tail = (tail + [line.strip()])[-20:]

        returncode, rest = proc.stream(command, show, cwd=cwd, extra_env=NO_PROMPT, stdout=stdout)
    if returncode != 0:
        raise gitrun.GitError(command, returncode, "\n".join(tail + [rest.strip()]).strip())


# A repository is cached as a bare repo under repos/. Caches made the current way are
# `git init --bare` repos marked dfbuild.core.fetch=shallow: they fetch only the ref asked for
# (a tag, a branch, refs/pull/N/head, a commit), one commit deep, and fetch deeper only
# when something needs the history (a short sha that is no ref's tip, whether the base is
# in the PR, the nearest bNNNN tag). Caches made before that are full bare clones (every
# branch and tag: about 1.4 GB for llama.cpp); they keep working the way they always did.
SHALLOW_KEY = "dfbuild.core.fetch"


# Protocol v2 lets a client ask for any commit a ref reaches by its id (GitHub and git's
# own upload-pack allow it); under v0 a server sends only advertised tips.
REMOTE_PROTOCOL = "protocol.version=2"


NETWORK_HINT = "check the URL and your network, or use an offline base (b10359, b11312) or `dfbuild import`"


# How deep the search for the nearest release tag (bNNNN, the build number) may fetch.
MAX_TAG_DEPTH = 4096


def cache_path(url: str) -> Path:
    return cache_dir() / "repos" / f"{slug(url)}.git"


def git_in(git_dir, *args: str, input: str | None = None) -> proc.CompletedProcess:
    return gitrun.run(None, *args, git_dir=git_dir, input=input, check=False)


def is_shallow_cache(cache: git.Repo) -> bool:
    """Whether CACHE fetches only what is asked (not a full clone of an older dfbuild)."""
    return git_in(cache.git_dir, "config", "--get", SHALLOW_KEY).stdout.strip() == "shallow"


def _has_commit(git_dir, rev: str) -> bool:
    return git_in(git_dir, "cat-file", "-e", f"{rev}^{{commit}}").returncode == 0


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
        raw = git_in(git_dir, "cat-file", "commit", sha)
        parents = re.findall(r"^parent ([0-9a-f]{40})$", raw.stdout.split("\n\n", 1)[0], re.MULTILINE)
        if raw.returncode != 0 or not all(git_in(git_dir, "cat-file", "-e", p).returncode == 0 for p in parents):
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
    listed = git_in(git_dir, "rev-list", ref)
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
    gitrun.run(None, "init", "--quiet", "--bare", str(tmp))
    git_in(tmp, "config", SHALLOW_KEY, "shallow")
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
        depth = max(2, 2 * int(git_in(cache.git_dir, "rev-list", "--count", dst).stdout.strip() or 1))
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
    listed = git_in(cache.git_dir, "rev-parse", f"--disambiguate={prefix}")
    return any(git_in(cache.git_dir, "cat-file", "-t", sha).stdout.strip() == "commit"
               for sha in listed.stdout.split())


def _fetch_tip(cache: git.Repo, url: str, ref: str, obj: str) -> None:
    """Fetch the branch or tag REF (which names OBJ upstream), one commit deep, unless the cache has it."""
    here = git_in(cache.git_dir, "rev-parse", "--verify", "--quiet", ref).stdout.strip()
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
        listed = git_in(cache.git_dir, "rev-list", commit).stdout.split()
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
    path = cache_path(url)
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
    if pr_line is not None and not _deepen(cache, url, pr_line, lambda: cache.is_ancestor(commit, pr_line[1]),  # type: ignore[arg-type]  # GitPython takes any rev
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
    if pr_ref and not cache.is_ancestor(commit, pr_ref):  # type: ignore[arg-type]  # GitPython takes any rev
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
    path = cache_path(url)
    if not path.exists() or not re.fullmatch(r"[0-9a-f]{40}", sha):
        return False
    with locked(cache_dir() / "repos" / slug(url)):
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
    url = gitrun.out(tree, "remote", "get-url", "origin", check=False)
    path = cache_path(url) if url else None
    if path is None or not path.exists():
        return False
    if commit and re.fullmatch(r"[0-9a-f]{40}", commit):
        if not ensure_commit(url, commit):
            return False
        wanted = commit
    elif valid_ref_name(f"refs/tags/{name}"):
        wanted = f"refs/tags/{name}"
        with locked(cache_dir() / "repos" / slug(url)):
            cache = git.Repo(path)
            try:
                _fetch(cache, url, [f"+{wanted}:{wanted}"], f"fetch tag {name}",
                       depth=1 if is_shallow_cache(cache) else None)
            except git.GitCommandError:
                return False
    else:
        return False
    return gitrun.ok(tree, "-c", "protocol.version=2", "fetch", "--quiet", "--no-tags", "--update-shallow",
                     str(path), wanted)


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


def _has_blob(git_dir: Path, blob: str) -> bool:
    return Path(git_dir).exists() and git_in(git_dir, "cat-file", "-e", f"{blob}^{{blob}}").returncode == 0
