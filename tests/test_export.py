"""`dfbuild series export --upstream` on the synthetic llama.cpp of test_series.

The export checks the base out into a scratch tree, applies what the series applies
there, squashes it into one `spec : ...` commit, adds the upstream server test, and
writes format-patch files and PR.md into --out, whole or not at all. These tests run
it as a user would and read what it wrote; the real b11434 run is in
test_export_real.py (integration, slow).
"""

from __future__ import annotations

import email
import email.policy
import json
import py_compile
import re
import subprocess
from pathlib import Path

import pytest

from dfbuild import export

from helpers import dfbuild, private_cache, run_git, said
from test_series import (BASE_LINES, FORMAT_PATCH, IDS, SPEC, patch_variant, snapshot, syn, template,  # noqa: F401
                         text_of, with_concerns)

PROJECT = "maintainers@users.noreply.a-seed-1169d44c.example"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


def run_export(syn, out: Path, *extra):
    return dfbuild("series", "export", "--upstream", "--base", syn.base_commit, "--repo", syn.upstream,
                   "--patches", syn.patches, "--out", out, *extra)


def mails(out: Path) -> list[email.message.EmailMessage]:
    return [email.message_from_bytes(p.read_bytes(), policy=email.policy.default) for p in sorted(out.glob("*.patch"))]


def subject(mail) -> str:
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(str(mail["Subject"]).split()))


def am(syn, out: Path, dest: Path) -> Path:
    """A fresh clone of the base with the export applied by `git am`, as a reviewer would."""
    run_git(dest.parent, "clone", "-q", str(syn.upstream), str(dest))
    run_git(dest, "checkout", "-q", syn.base_commit)
    run_git(dest, "am", "-q", *[str(p) for p in sorted(out.glob("*.patch"))])
    return dest


def test_export_writes_two_patches_and_pr_md_that_git_am_applies(syn, tmp_path):
    out = tmp_path / "export"
    result = run_export(syn, out, "--json")
    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    names = sorted(p.name for p in out.iterdir())
    assert [Path(p).name for p in data["written"]] == [n for n in names if not n.startswith(".")]
    patches = sorted(out.glob("*.patch"))
    assert len(patches) == 2 and (out / "PR.md").is_file()

    # the fix first, in llama.cpp's style, then the test; the project is the author, never a tool
    found = mails(out)
    assert subject(found[0]) == export.FIX_SUBJECT
    assert subject(found[1]).startswith("server : ")
    for mail in found:
        assert PROJECT in str(mail["From"]) and "dfbuild@localhost" not in str(mail["From"])
        assert mail.get_payload().count("Dfbuild-Concern") == 0  # dfbuild's trailers stay home
        assert "Origin:" not in mail.get_payload().split("\n---\n")[0]
    assert patches[0].read_text().startswith("From 0000000000000000000000000000000000000000 ")

    tree = am(syn, out, tmp_path / "reviewer")
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))
    assert (tree / export.TEST_PATH).read_text() == export.test_source()
    log = run_git(tree, "log", "--format=%an <%ae>|%s", f"{syn.base_commit}..HEAD").splitlines()
    assert [line.split("|")[0] for line in log] == [f"dfbuild maintainers <{PROJECT}>"] * 2
    assert [(c["id"], c["file"]) for c in data["concerns"]] == [(i, f"base1/{n:04d}-{i}.patch")
                                                                for n, i in enumerate(IDS, 1)]


def test_the_stdout_lists_the_files_and_the_talk_goes_to_stderr(syn, tmp_path):
    out = tmp_path / "export"
    result = run_export(syn, out)
    assert result.exit_code == 0, said(result)
    assert result.stdout.split() == [str(out / n) for n in sorted(p.name for p in out.iterdir()
                                                                  if not p.name.startswith("."))]
    assert "git am" in said(result)


def test_the_export_is_reproducible(syn, tmp_path):
    assert run_export(syn, tmp_path / "one").exit_code == 0
    assert run_export(syn, tmp_path / "two").exit_code == 0
    for path in (tmp_path / "one").iterdir():
        assert path.read_bytes() == (tmp_path / "two" / path.name).read_bytes(), path.name


def test_commits_carry_the_patches_own_date(syn, tmp_path):
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    want = email.utils.parsedate_to_datetime(export.export_date(sorted((syn.patches / "base1").glob("*.patch"))))
    for mail in mails(out):
        assert email.utils.parsedate_to_datetime(str(mail["Date"])) == want
        assert want.year != 2000


def test_a_concern_the_series_does_not_patch_at_the_base_is_left_out(syn, tmp_path):
    toml = syn.patches / "series.toml"
    text = toml.read_text()
    line = next(x for x in text.splitlines() if x.startswith("base1 = ") and "warning-downgrade" in x)
    toml.write_text(text.replace(line, 'base1 = {status = "upstream", note = "not needed here: measured"}'))
    out = tmp_path / "export"
    result = run_export(syn, out, "--json")
    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert [c["id"] for c in data["concerns"]] == IDS[:3]
    assert [c["id"] for c in data["decided"]] == ["warning-downgrade"]
    tree = am(syn, out, tmp_path / "reviewer")
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS[:3]))
    assert "LOG_WRN" in (tree / SPEC).read_text()


def test_nothing_to_export_when_the_series_patches_nothing_there(syn, tmp_path):
    toml = syn.patches / "series.toml"
    toml.write_text("\n".join('base1 = {status = "upstream", note = "upstream"}' if x.startswith("base1 = ") else x
                              for x in toml.read_text().splitlines()) + "\n")
    out = tmp_path / "export"
    result = run_export(syn, out)
    assert result.exit_code == 26, said(result)
    assert "nothing to send" in said(result)
    assert not out.exists()


def test_a_non_empty_dir_that_is_not_an_export_is_refused_untouched(syn, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    result = run_export(syn, out, "--json")
    assert result.exit_code == 26, said(result)
    assert "not an earlier dfbuild export" in said(result)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert list(tmp_path.glob(".mine.export-*")) == []


def test_an_empty_dir_is_used_and_an_earlier_export_replaced_whole(syn, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    assert run_export(syn, out).exit_code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_export(syn, out)
    assert result.exit_code == 0, said(result)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")] == []


def test_an_earlier_export_someone_edited_or_added_to_is_refused(syn, tmp_path):
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    (out / "PR.md").write_text((out / "PR.md").read_text() + "\nmy words\n")
    result = run_export(syn, out)
    assert result.exit_code == 26, said(result)
    assert "PR.md changed since dfbuild wrote it" in said(result)
    assert (out / "PR.md").read_text().endswith("my words\n")

    (out / "PR.md").unlink()  # a missing file is a change too
    (out / "extra.txt").write_text("mine\n")
    result = run_export(syn, out)
    assert result.exit_code == 26
    assert (out / "extra.txt").read_text() == "mine\n"


def test_a_failure_leaves_no_dir_and_no_staging(syn, tmp_path):
    patch = syn.patch("zero-fill")
    patch.write_text(patch.read_text() + "\n")  # its sha256 no longer matches series.toml
    out = tmp_path / "export"
    result = run_export(syn, out)
    assert result.exit_code == 20, said(result)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".export-" in p.name] == []


def test_a_failure_keeps_an_earlier_export_as_it_was(syn, tmp_path):
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    patch = syn.patch("zero-fill")
    patch.write_text(patch.read_text() + "\n")
    assert run_export(syn, out).exit_code == 20
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_repository_it_reads_from_is_left_alone(syn, tmp_path):
    before = snapshot(syn.upstream)
    assert run_export(syn, tmp_path / "export").exit_code == 0
    assert snapshot(syn.upstream) == before


def test_a_file_in_the_way_is_refused(syn, tmp_path):
    out = tmp_path / "export"
    out.write_text("a file\n")
    result = run_export(syn, out)
    assert result.exit_code == 26, said(result)
    assert out.read_text() == "a file\n"


def test_pr_md_follows_the_template_and_leaves_the_disclosure_to_the_submitter():
    template = ("## Overview\n\n<!-- Describe -->\n\n## Additional information\n\n<!-- more -->\n\n"
                "## Requirements\n\n<!-- IMPORTANT: keep -->\n\n- I have read\n"
                "- AI usage disclosure: <!-- mention: YES / NO -->\n")
    applied = [{"id": "zero-fill", "subject": "spec : fill the hole", "body": "Why.", "origin_urls": []}]
    proof = {"base": "b1", "unpatched": {"runs": 4, "failed": ["a", "b"], "upstream_symptom": True,
                                         "first_failure": {"log_line": "0.00.1 E init: inconsistent"}},
             "patched": {"runs": 4, "passed": True, "failed": []},
             "concerns": [{"id": "zero-fill", "status": "applied"}]}
    text = export.pr_text(template, base="b1", base_commit="f" * 40, applied=applied, bug="https://bug",
                          proof=proof, recorded=None, measured=None, proof_note="CPU")
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## Overview", "## Additional information", "## Requirements"]
    assert "<!-- Describe -->" not in text and "<!-- more -->" not in text
    assert "- AI usage disclosure: <!-- mention: YES / NO -->" in text
    assert "<!-- IMPORTANT: keep -->" in text
    assert "| dfbuild smoke runs | 2 of 4 failed | all 4 passed |" in text
    assert "download" in text and "were not run" in text
    assert "- fill the hole" in text


def test_the_project_author_comes_from_pyproject_with_a_fallback(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\nauthors = [{name = "The Team", email = "team@example.org"}]\n')
    assert export.project_author(tmp_path) == ("The Team", "team@example.org")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "metadata", lambda name: {})
    assert export.project_author(tmp_path) == export.DEFAULT_AUTHOR
    assert export.DEFAULT_AUTHOR[1] == PROJECT


def test_requirements_gain_pyyaml_once():
    text = "aiohttp~=3.9.3\nnumpy~=2.2.6\nopenai~=2.14.0\n"
    assert export.requirements_with_yaml(text) == "aiohttp~=3.9.3\nnumpy~=2.2.6\nPyYAML~=6.0\nopenai~=2.14.0\n"
    assert export.requirements_with_yaml("pyyaml>=5\n") is None


def test_the_upstream_test_is_python_that_downloads_nothing(tmp_path):
    source = export.test_source()
    path = tmp_path / export.TEST_NAME
    path.write_text(source)
    py_compile.compile(str(path), doraise=True)
    assert "from utils import *" in source
    assert "download_file" not in source and "hf_repo = None" in source.replace("model_", "")
    assert '"draft-dflash"' in source
    assert "gguf.GGUFWriter" in source


def test_every_shipped_patch_reads_as_an_upstream_message():
    from dfbuild import series

    curated = series.load_series()
    files = sorted({v.file for c in curated.concerns for v in c.variants.values() if v.file})
    assert files
    for name in files:
        subject, body = export.upstream_message(curated.root / name)
        assert subject and body, name
        assert not re.search(r"^(Origin|Bug|Forwarded|Applied-Upstream|Last-Update|Dfbuild-[\w-]+):", body,
                             re.MULTILINE), name
        assert export._patch_date(curated.root / name) is not None, name


# --- a base whose tree only a git host has: the export from its variants alone ---------------


def a_pr_head(syn, tmp_path, monkeypatch) -> None:
    """base1 as a PR head is to dfbuild: a known base whose tree only a git host has (here: one that is gone)."""
    from dfbuild import source

    monkeypatch.setitem(source.KNOWN_BASES, "base1", source.KnownBase(
        name="base1", commit=syn.base_commit, repo=str(tmp_path / "gone"), note="a PR head"))


def test_a_base_only_a_git_host_has_is_exported_from_its_variants_without_a_tree(syn, tmp_path, monkeypatch):
    a_pr_head(syn, tmp_path, monkeypatch)
    out = tmp_path / "export"
    result = dfbuild("series", "export", "--upstream", "--base", "base1", "--patches", syn.patches, "--out", out,
                     "--json")
    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["applied_to_tree"] is False and data["commits"] is None
    assert data["base_commit"] == syn.base_commit
    assert "NOT applied to a base1 tree" in result.stderr
    assert (out / "PR.md").read_text().split("## Additional information\n\n", 1)[1].startswith(
        "**Not applied to a base1 tree where this was prepared.**")

    # a reviewer's git am on the real base gives exactly the series' result
    tree = am(syn, out, tmp_path / "reviewer")
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))
    assert (tree / export.TEST_PATH).read_text() == export.test_source()
    # and the patches are the bytes the export made in a tree of that base
    made_in_a_tree = tmp_path / "tree-export"
    assert run_export(syn, made_in_a_tree).exit_code == 0
    for patch in sorted(made_in_a_tree.glob("*.patch")):
        assert (out / patch.name).read_bytes() == patch.read_bytes(), patch.name


def test_the_pr_head_exports_offline_as_users_type_it(tmp_path):
    out = tmp_path / "export"
    result = dfbuild("series", "export", "--upstream", "--base", "5ecbe1a", "--out", out, "--json")
    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["applied_to_tree"] is False
    assert [c["id"] for c in data["concerns"]] == ["embedding-skip", "zero-fill", "noise-block-base"]
    assert [c["id"] for c in data["decided"]] == ["warning-downgrade"]
    assert data["base_commit"].startswith("5ecbe1a")
    found = mails(out)
    assert [subject(m).split(" : ")[0] for m in found] == ["spec", "server"]
    assert all(PROJECT in str(m["From"]) for m in found)
    # the index line names the blob the variant was made on and the blob its last patch leaves
    from dfbuild import series

    curated = series.load_series()
    last = (curated.root / curated.concern("noise-block-base").variants["5ecbe1a"].file).read_text()
    want = f"index {curated.bases['5ecbe1a']['made_on']}..{re.search(r'index [0-9a-f]+[.][.]([0-9a-f]{40})', last)[1]}"
    fix = sorted(out.glob("*.patch"))[0].read_text()
    assert want in fix and "dfbuild: line" not in fix
    assert "requirements.txt" not in sorted(out.glob("*.patch"))[1].read_text()
    assert "could not be read" in (out / "PR.md").read_text()


def test_a_variant_that_shows_too_little_of_the_base_is_refused_without_a_tree(syn, tmp_path, monkeypatch):
    # patches with one line of context say too little of the base to show the squashed diff's context
    a_pr_head(syn, tmp_path, monkeypatch)
    toml = syn.patches / "series.toml"
    text = toml.read_text()
    for number, (concern_id, commit) in enumerate(zip(IDS, syn.concern_commits), 1):
        patch = syn.patch(concern_id)
        old_line = patch_variant("base1", patch, syn.patches)
        patch.write_bytes(subprocess.run(["git", *FORMAT_PATCH, "-U1", "-1", commit], cwd=syn.work,
                                         capture_output=True, check=True).stdout)
        text = text.replace(old_line, patch_variant("base1", patch, syn.patches))
    toml.write_text(text)
    out = tmp_path / "export"
    result = dfbuild("series", "export", "--upstream", "--base", "base1", "--patches", syn.patches, "--out", out)
    assert result.exit_code == 26, said(result)
    assert "cannot be made without the base's tree" in said(result)
    assert not out.exists() and list(tmp_path.glob(".export.export-*")) == []
