"""Stage 1, source: a llama.cpp working tree at a known commit.

Two ways in, one way out. A git repository (GitHub, a mirror, a local path) is
fetched into a bare cache repo, only the ref asked for and one commit deep
(deeper only when something needs the history; gitfetch.py); an archive or a PyPI
sdist (sdist.py) that vendors llama.cpp is unpacked safely (unpack.py) and imported
into a one-commit repo, cached the same way. Either way the user's DIR is then
materialised from that cache repo, on a branch named after the base, so later
stages never care where the code came from.

One module per job, and this one is the facade: the names callers use (fetching and
unpacking ones included) are importable from here.
- known_bases: the bases dfbuild knows by name, and the checks a name or URL passes
- tree_commits: what makes a llama.cpp tree, and the commits dfbuild writes into one
- staging: a DIR made beside its place and renamed into it
- tree_import: archives and sdists imported into one-commit cache repos
- gitfetch: the bare cache repos of git bases, filled shallowly
- source (here): checkout, materialising the user's DIR from a cache repo
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import git

from dfbuild.core import gitrun, journal, paths, state, ui
from dfbuild.core.errors import (
    DirtyTreeError,
    NotLlamaTreeError,
    SourceError,
)
from dfbuild.core.paths import cache_dir, locked
from dfbuild.core.staging import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source.checkout
    clear_debris,
    move_into_place,
    staged,
    staging_dir,
)
from dfbuild.core.unpack import (  # noqa: F401 - re-exported
    LIMIT_FLAG,
    Limits,
    check_limits,
    check_links_stay_in,
    extract,
    parse_size,
)
from dfbuild.source.gitfetch import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source.checkout
    MAX_TAG_DEPTH,
    NETWORK_HINT,
    NO_PROMPT,
    RELEASE_NAME,
    REMOTE_PROTOCOL,
    SHALLOW_KEY,
    _fetch_base,
    _git_error,
    _git_progress,
    _has_blob,
    cache_path,
    ensure_commit,
    fetch_base_into,
    git_in,
    is_shallow_cache,
    release_build,
    resolve_commit,
    slug,
    valid_ref_name,
)
from dfbuild.source.known_bases import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source.checkout
    _RELEASE_SPELLING,
    BASE_ALIASES,
    GITHUB_LLAMA,
    KNOWN_BASES,
    MAX_NAME_BYTES,
    KnownBase,
    _unknown_base,
    absolute_if_local,
    branch_for,
    canonical_base,
    check_base_name,
    check_known,
    check_repo_url,
    known_base,
    named_bases,
    normal_name,
    offline_bases,
    offline_hint,
    unknown_base,
)
from dfbuild.source.sdist import cached as cached_sdist  # noqa: F401 - re-exported
from dfbuild.source.sdist import fetch_sdist  # noqa: F401 - re-exported
from dfbuild.source.tree_commits import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source.checkout
    FIXED_DATE,
    FIXED_IDENTITY,
    KEEP_BYTES,
    LLAMA_MARKERS,
    PROJECT_EMAIL,
    PROJECT_NAME,
    _commit,
    commit_fixed,
    commit_patch,
    committed_blob,
    is_llama_tree,
    patch_identity,
    speculative_blob,
)
from dfbuild.source.tree_import import (  # noqa: F401 - re-exported: callers and tests use them through dfbuild.source.checkout
    _offline_cache_repo,
    check_tag_name,
    find_llama_root,
    import_archive,
    known_base_blob,
)


def _check_dir(dest: Path, force: bool) -> git.Repo | None:
    """Refuse a DIR dfbuild must not touch. Returns its repo when it is a checkout.

    Only dfbuild's own debris is cleared first (see clear_debris); nothing of the user's is touched.
    """
    clear_debris(dest)
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
        with staged(dest) as partial:
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
            move_into_place(partial, dest)
        return
    if repo is None:
        # built beside DIR and renamed into place: an interrupt never leaves a half-made DIR
        # a local clone hardlinks the cache's objects: seconds, where a fetch would repack them
        with staged(dest) as partial:
            made = git.Repo.clone_from(str(Path(cache.git_dir)), partial, no_checkout=True, local=True,
                                       multi_options=["--quiet"])
            made.git.config(*KEEP_BYTES)  # before the first checkout writes any file
            made.remote("origin").set_url(origin)
            state.fault_point("checkout: cloned")
            made.git.checkout("--quiet", "-B", branch, commit)
            state.fault_point("checkout: checked out beside DIR")
            move_into_place(partial, dest)
        return
    repo.git.execute(["git", *fetch_args, *wanted])
    head = repo.head.commit.hexsha if repo.head.is_valid() else None
    on_branch = not repo.head.is_detached and repo.active_branch.name == branch
    if keep_descendants and on_branch and head and repo.is_ancestor(commit, head):  # type: ignore[arg-type]  # GitPython takes any rev
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
    if head and head != commit and not repo.is_ancestor(head, commit):  # type: ignore[arg-type]  # GitPython takes any rev
        backup = _backup_ref(repo, branch)
        repo.git.update_ref(backup, head)
        ui.warn(f"{dest} was at {head[:12]}; that commit is kept as {backup}")
    journal.begin(dest, "checkout", commit=commit, branch=branch, previous=head)
    state.fault_point("checkout: journal written")
    repo.git.checkout("--quiet", "-B", branch, commit)
    journal.end(dest)


def default_dir(name: str) -> Path:
    """./llama.cpp-NAME, the default DIR of checkout (NAME = base) and import (NAME = tag)."""
    return Path.cwd() / f"llama.cpp-{name}"


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

    if repo is None and known is not None and known.sdist:  # (known: never None without --repo, above)
        if pr is not None:
            raise SourceError(f"{base} is an offline base imported from PyPI ({known.sdist}); it has no PR refs",
                              "drop --pr, or pass --repo URL_OR_PATH to fetch the PR from a repository")
        cache = _offline_cache_repo(known)
        commit = resolve_commit(cache, known.name)
        tags: list[str] = []
        origin, kind = f"pypi:{known.sdist}", "sdist"
    else:
        url = repo or (known.repo if known is not None else None)
        if not url:  # a known base with no repository and no sdist: nowhere to fetch it from
            raise _unknown_base(base)
        if pr is None and known is not None and url == known.repo:
            pr = known.pr
        url = absolute_if_local(url)
        with locked(cache_dir() / "repos" / slug(url)):
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
