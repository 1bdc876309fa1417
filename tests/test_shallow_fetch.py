"""Fetch only what is needed: a GitHub base is one shallow ref in the cache, not a full clone.

A synthetic upstream stands in for GitHub: a bare repo with a main branch of
ten commits (release tags b100 and b105 on two of them, an annotated tag v1), a
side branch, and a PR reachable only through refs/pull/7/head. Every test
checks what the cache holds afterwards (shallow, and how many commits), which
is what tells the new cache from the old full clone.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import dfbuild, private_cache, run_git, said

from dfbuild import series
from dfbuild.build import tree as build
from dfbuild.source import checkout as source
from dfbuild.source import gitfetch

PR = 7
MAIN_COMMITS = 10


def fast_import(bare: Path, script: str) -> dict[str, str]:
    """Write commits into BARE with one `git fast-import` (a few git calls, not dozens); mark -> commit id."""
    marks = bare / "marks"
    run_git(bare, "fast-import", "--quiet", f"--export-marks={marks}", input=script)
    return dict(line.split() for line in marks.read_text().splitlines())


def commit_script(ref: str, mark: str, message: str, files: dict[str, str], parent: str | None = None) -> str:
    data = "".join(f"M 100644 inline {path}\ndata {len(text.encode())}\n{text}\n" for path, text in files.items())
    return (f"commit {ref}\nmark :{mark}\ncommitter Upstream Dev <dev@example.org> 1767225600 +0000\n"
            f"data {len(message)}\n{message}\n" + (f"from {parent}\n" if parent else "") + data + "\n")


LLAMA = "CMakeLists.txt"


def llama_files(speculative: str) -> dict[str, str]:
    return {LLAMA: "cmake_minimum_required(VERSION 3.14)\nproject(llama.cpp)\n",
            "common/speculative.cpp": speculative}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


@pytest.fixture
def upstream(tmp_path) -> SimpleNamespace:
    bare = tmp_path / "upstream.git"
    run_git(tmp_path, "init", "-q", "--bare", "-b", "main", str(bare))
    script = ""
    for n in range(MAIN_COMMITS):
        files = {**llama_files(f"// speculative decoding, revision {n}\n"), f"file{n}.txt": f"{n}\n"}
        script += commit_script("refs/heads/main", f"{n + 1}", f"main {n}", files)
    script += commit_script("refs/heads/side", "20", "side work", {"side.txt": "side\n"}, parent=":5")
    for n in range(3):
        script += commit_script(f"refs/pull/{PR}/head", f"{30 + n}", f"spec : DFlash ({n + 1}/3)",
                                llama_files(f"// speculative decoding, revision 7\n// DFlash part {n}\n"),
                                parent=":8" if n == 0 else None)
    script += "reset refs/tags/b100\nfrom :3\n\nreset refs/tags/b105\nfrom :6\n\n"
    script += ("tag v1\nfrom :7\ntagger Upstream Dev <dev@example.org> 1767225600 +0000\n"
               "data 10\nrelease v1\n")
    marks = fast_import(bare, script)
    return SimpleNamespace(path=bare, url=bare.as_uri(), main=[marks[f":{n + 1}"] for n in range(MAIN_COMMITS)],
                           side=marks[":20"], pr=[marks[f":{30 + n}"] for n in range(3)])


def cache_repo(own_cache: Path) -> Path:
    (repo,) = (own_cache / "repos").glob("*.git")
    return repo


def is_shallow(repo: Path) -> bool:
    return run_git(repo, "rev-parse", "--is-shallow-repository") == "true"


def commits_in(repo: Path) -> set[str]:
    return set(run_git(repo, "rev-list", "--all").split())


def checkout(upstream, base, dest, *extra):
    result = dfbuild("checkout", "--base", base, "--repo", upstream.url, "--dir", dest, "--json", *extra)
    assert result.exit_code == 0, said(result)
    return json.loads(result.stdout)


def speculative(dest: Path) -> str:
    return (dest / "common" / "speculative.cpp").read_text()


# --- one ref, one commit deep ------------------------------------------------------------


def test_tag_checkout_fetches_only_the_tagged_commit(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    data = checkout(upstream, "b105", dest)

    assert data["commit"] == upstream.main[5]
    assert run_git(dest, "rev-parse", "HEAD") == upstream.main[5]
    assert speculative(dest) == "// speculative decoding, revision 5\n"
    assert run_git(dest, "status", "--porcelain") == ""
    cache = cache_repo(own_cache)
    assert is_shallow(cache)
    assert commits_in(cache) == {upstream.main[5]}  # not main's ten, the side branch or the PR
    assert run_git(cache, "rev-parse", "refs/tags/b105") == upstream.main[5]
    assert is_shallow(dest)
    assert run_git(dest, "rev-list", "--count", "HEAD") == "1"


def test_annotated_tag_checkout_brings_its_release_tag_for_the_build_number(upstream, tmp_path, own_cache):
    """v1 is no bNNNN: the history below it is fetched just deep enough to reach b105 (what describe says)."""
    dest = tmp_path / "llama"
    data = checkout(upstream, "v1", dest)

    assert data["commit"] == upstream.main[6]
    assert run_git(dest, "describe", "--tags", "--abbrev=0", "--match", "b[0-9]*") == "b105"
    assert build.build_number(dest) == 105
    cache = cache_repo(own_cache)
    assert is_shallow(cache)
    assert upstream.main[5] in commits_in(cache)
    assert upstream.main[0] not in commits_in(cache)  # not the whole of main
    assert run_git(cache, "cat-file", "-t", "refs/tags/v1") == "tag"  # the annotated tag itself


def test_pr_checkout_fetches_only_the_pr_head(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    data = checkout(upstream, upstream.pr[-1][:8], dest, "--pr", PR)

    assert data["commit"] == upstream.pr[-1]
    assert data["pr"] == PR
    assert "DFlash part 2" in speculative(dest)
    cache = cache_repo(own_cache)
    assert is_shallow(cache)
    # the PR head, and the history below it only about as deep as the release tag b105 (the build number)
    held = commits_in(cache)
    assert upstream.pr[-1] in held and upstream.main[5] in held
    assert upstream.main[2] not in held and upstream.main[9] not in held
    assert run_git(cache, "rev-parse", f"refs/dfbuild/pull/{PR}") == upstream.pr[-1]


def test_earlier_pr_commit_deepens_the_pr_only(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    data = checkout(upstream, upstream.pr[0][:9], dest, "--pr", PR)

    assert data["commit"] == upstream.pr[0]
    assert "DFlash part 0" in speculative(dest)
    held = commits_in(cache_repo(own_cache))
    assert upstream.main[9] not in held and upstream.side not in held  # main's head and other branches: never


def test_full_sha_of_a_commit_no_ref_points_at(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    data = checkout(upstream, upstream.main[3], dest)

    assert data["commit"] == upstream.main[3]
    assert speculative(dest) == "// speculative decoding, revision 3\n"
    cache = cache_repo(own_cache)
    assert is_shallow(cache)
    # main[3] by its id, one commit deep, then down to b100 (main[2]) for the build number
    assert commits_in(cache) == {upstream.main[3], upstream.main[2]}
    assert run_git(cache, "rev-parse", f"refs/dfbuild/commits/{upstream.main[3]}") == upstream.main[3]
    assert build.build_number(dest) == 100


def test_short_sha_of_a_branch_tip_resolves_through_the_remote_refs(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    data = checkout(upstream, upstream.side[:7], dest)

    assert data["commit"] == upstream.side
    assert (dest / "side.txt").read_text() == "side\n"
    held = commits_in(cache_repo(own_cache))
    assert upstream.side in held and upstream.main[9] not in held


def test_short_sha_inside_history_deepens_the_default_branch_on_demand(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main[7][:8], "--repo", upstream.url, "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["commit"] == upstream.main[7]
    assert "looking for it in the history of the default branch" in said(result)
    cache = cache_repo(own_cache)
    assert is_shallow(cache)
    held = commits_in(cache)
    assert upstream.main[7] in held and upstream.main[0] not in held


def test_head_is_the_default_branch_tip(upstream, tmp_path, own_cache):
    data = checkout(upstream, "HEAD", tmp_path / "llama")
    assert data["commit"] == upstream.main[9]
    held = commits_in(cache_repo(own_cache))
    assert upstream.main[9] in held and upstream.main[0] not in held  # down to b105 only, for the build number


def test_sha_the_server_will_not_send_by_id_is_found_by_deepening(upstream, tmp_path, own_cache, monkeypatch):
    """Protocol v0 sends only advertised tips: the commit is then looked for in the default branch."""
    monkeypatch.setattr(gitfetch, "REMOTE_PROTOCOL", "protocol.version=0")
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.main[8], "--repo", upstream.url, "--dir", dest, "--json")

    assert result.exit_code == 0, said(result)
    assert json.loads(result.stdout)["commit"] == upstream.main[8]
    assert f"did not send {upstream.main[8][:12]} by its id" in said(result)
    assert is_shallow(cache_repo(own_cache))
    assert upstream.main[0] not in commits_in(cache_repo(own_cache))


def test_second_checkout_fetches_just_the_other_ref(upstream, tmp_path, own_cache, monkeypatch):
    checkout(upstream, "b100", tmp_path / "one")
    cache = cache_repo(own_cache)
    assert commits_in(cache) == {upstream.main[2]}

    fetched = []
    real = source._git_progress
    monkeypatch.setattr(gitfetch, "_git_progress",
                        lambda args, title, *a, **k: fetched.append(args) or real(args, title, *a, **k))
    data = checkout(upstream, "b105", tmp_path / "two")
    assert data["commit"] == upstream.main[5]
    assert commits_in(cache) == {upstream.main[2], upstream.main[5]}
    assert cache_repo(own_cache) == cache  # the same cache, fetched into
    assert all("clone" not in args for args in fetched)
    assert any("+refs/tags/b105:refs/tags/b105" in args for args in fetched)

    # and the same ref again needs no fetch at all, only the look at the remote's refs
    fetched.clear()
    checkout(upstream, "b105", tmp_path / "three")
    assert [args for args in fetched if "fetch" in args] == []


def test_refetching_a_ref_keeps_the_history_the_cache_already_has(upstream, tmp_path, own_cache):
    """`git fetch --depth 1` of a commit already here marks it as history's end; the cache undoes that.

    The release tag b105 is fetched --depth 1 after main was deepened past it:
    left so, main[5] would end main[7]'s history in the cache.
    """
    checkout(upstream, upstream.main[7][:8], tmp_path / "one")  # main fetched 8 deep: main[9] .. main[2]
    cache = cache_repo(own_cache)
    assert run_git(cache, "rev-list", "--count", upstream.main[7]) == "6"  # main[7] .. main[2]
    assert run_git(cache, "rev-parse", "refs/tags/b105") == upstream.main[5]
    checkout(upstream, "b105", tmp_path / "two")
    assert run_git(cache, "rev-list", "--count", upstream.main[7]) == "6"
    assert run_git(tmp_path / "one", "rev-list", "--count", "HEAD") == "6"  # DIR got what the cache had


def test_rev_not_in_the_prs_history_is_refused_after_deepening_the_pr(upstream, tmp_path, own_cache):
    dest = tmp_path / "llama"
    result = dfbuild("checkout", "--base", upstream.side[:7], "--pr", PR, "--repo", upstream.url, "--dir", dest)
    assert result.exit_code != 0
    assert f"is not in the history of PR #{PR}" in said(result)
    assert not dest.exists()
    # to tell, the PR's whole history was fetched, and the side branch's tip: nothing else
    held = commits_in(cache_repo(own_cache))
    assert held == {*upstream.pr, *upstream.main[:8], upstream.side}


def test_an_old_full_clone_cache_keeps_working(upstream, tmp_path, own_cache):
    """A cache an older dfbuild made (every branch and tag) is fetched into the old way and stays whole.

    (A guard for the old caches: the old code passes it too, but for the helper it uses to find the cache.)
    """
    old = source.cache_path(upstream.url)
    old.parent.mkdir(parents=True)
    run_git(tmp_path, "clone", "-q", "--bare", upstream.url, str(old))
    newer = fast_import(upstream.path, commit_script("refs/heads/main", "1", "news", {"NEWS": "news\n"},
                                                     parent=upstream.main[-1]))[":1"]

    data = checkout(upstream, newer[:7], tmp_path / "llama")
    assert data["commit"] == newer
    assert not is_shallow(old)
    assert len(commits_in(old)) == MAIN_COMMITS + 2  # main, side and the news
    assert not is_shallow(tmp_path / "llama")
    pr = checkout(upstream, upstream.pr[1][:8], tmp_path / "pr", "--pr", PR)
    assert pr["commit"] == upstream.pr[1]


# --- deepening on demand, later ----------------------------------------------------------------


def test_known_base_blob_fetches_the_one_missing_commit(upstream, tmp_path, own_cache, monkeypatch):
    """A carry needs a git base's pre-image the shallow cache lacks: just that commit is fetched."""
    checkout(upstream, "b105", tmp_path / "one")
    cache = cache_repo(own_cache)
    known = source.KNOWN_BASES["5ecbe1a"]
    monkeypatch.setitem(source.KNOWN_BASES, "5ecbe1a",
                        dataclasses.replace(known, repo=upstream.url, commit=upstream.main[8]))
    blob = run_git(upstream.path, "rev-parse", f"{upstream.main[8]}:common/speculative.cpp")

    assert source.known_base_blob("5ecbe1a", blob) == b"// speculative decoding, revision 8\n"
    assert commits_in(cache) == {upstream.main[5], upstream.main[8]}
    assert is_shallow(cache)


def test_history_between_commits_of_a_shallow_tree_is_unknown_not_near(upstream, tmp_path):
    """Two commits of a shallow tree, their history not fetched: no distance, rather than a false small one."""
    tree = tmp_path / "tree"
    run_git(tmp_path, "clone", "-q", "--depth", "1", upstream.url, str(tree))
    run_git(tree, "fetch", "-q", "--depth", "1", "origin", f"{upstream.main[2]}:refs/base")
    assert series.history_distance(tree, upstream.main[2], upstream.main[9]) is None
    run_git(tree, "fetch", "-q", "--unshallow", "origin")
    assert series.history_distance(tree, upstream.main[2], upstream.main[9]) == 7


def test_build_number_of_a_shallow_tree_without_a_release_tag_is_unknown(upstream, tmp_path):
    tree = tmp_path / "tree"
    run_git(tmp_path, "clone", "-q", "--depth", "1", "--no-tags", upstream.url, str(tree))
    assert build.build_number(tree) == 0  # not 1, the length of what was fetched


def test_a_carry_fetches_a_known_base_into_a_shallow_tree(upstream, tmp_path, own_cache):
    """A 3-way carry needs a known base's pre-image, which a full clone had in its history: by tag or commit."""
    tree = tmp_path / "llama"
    checkout(upstream, "b105", tree)
    blob = f"{upstream.main[2]}:common/speculative.cpp"
    assert subprocess.run(["git", "-C", str(tree), "cat-file", "-e", blob]).returncode != 0

    assert source.fetch_base_into(tree, "b100", None)  # by its tag
    assert run_git(tree, "cat-file", "-p", blob) == "// speculative decoding, revision 2"
    assert source.fetch_base_into(tree, "elsewhere", upstream.main[8])  # by its full commit id
    assert commits_in(cache_repo(own_cache)) == {upstream.main[5], upstream.main[2], upstream.main[8]}
    assert not source.fetch_base_into(tree, "no-such-tag", None)
