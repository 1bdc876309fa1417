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
import os
import py_compile
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, run_git, said
from test_series import (  # noqa: F401
    BASE_LINES,
    FORMAT_PATCH,
    IDS,
    SPEC,
    patch_variant,
    snapshot,
    syn,
    template,
    text_of,
    with_concerns,
)

from dfbuild.export import text as export_text
from dfbuild.export import upstream as export

SUBMITTER = "Ada Submitter <ada@example.org>"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


def git_identity(monkeypatch, path: Path, name: str | None, address: str | None) -> None:
    """The user's git config is PATH (with NAME and ADDRESS, or no identity); no identity from the environment."""
    text = "" if name is None else f"[user]\n\tname = {name}\n\temail = {address}\n"
    path.write_text(text)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL",
                 "GIT_CONFIG_PARAMETERS", "SOURCE_DATE_EPOCH"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def a_submitter(tmp_path, monkeypatch) -> None:
    git_identity(monkeypatch, tmp_path / "user.gitconfig", "Ada Submitter", "ada@example.org")


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

    # the fix first, in llama.cpp's style, then the test; the submitter is the author, never a tool
    found = mails(out)
    assert subject(found[0]) == export.FIX_SUBJECT
    assert subject(found[1]).startswith("server : ")
    for mail in found:
        assert str(mail["From"]) == SUBMITTER
        assert mail.get_payload().count("Dfbuild-Concern") == 0  # dfbuild's trailers stay home
        assert "Origin:" not in mail.get_payload().split("\n---\n")[0]
    assert patches[0].read_text().startswith("From 0000000000000000000000000000000000000000 ")

    tree = am(syn, out, tmp_path / "reviewer")
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))
    assert (tree / export.TEST_PATH).read_text() == export.test_source()
    log = run_git(tree, "log", "--format=%an <%ae>|%s", f"{syn.base_commit}..HEAD").splitlines()
    assert [line.split("|")[0] for line in log] == [SUBMITTER] * 2
    assert [(c["id"], c["file"]) for c in data["concerns"]] == [(i, f"base1/{n:04d}-{i}.patch")
                                                                for n, i in enumerate(IDS, 1)]


def test_the_stdout_lists_the_files_and_the_talk_goes_to_stderr(syn, tmp_path):
    out = tmp_path / "export"
    result = run_export(syn, out)
    assert result.exit_code == 0, said(result)
    assert result.stdout.split() == [str(out / n) for n in sorted(p.name for p in out.iterdir()
                                                                  if not p.name.startswith("."))]
    assert "git am" in said(result)


def test_the_export_is_reproducible_with_source_date_epoch(syn, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796300000")
    assert run_export(syn, tmp_path / "one").exit_code == 0
    assert run_export(syn, tmp_path / "two").exit_code == 0
    for path in (tmp_path / "one").iterdir():
        assert path.read_bytes() == (tmp_path / "two" / path.name).read_bytes(), path.name
    for mail in mails(tmp_path / "one"):
        assert email.utils.parsedate_to_datetime(str(mail["Date"])).timestamp() == 1796300000


def test_the_commits_are_dated_now_without_source_date_epoch(syn, tmp_path):
    before = time.time()
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    for mail in mails(out):
        when = email.utils.parsedate_to_datetime(str(mail["Date"])).timestamp()
        assert before - 1 <= when <= time.time() + 1, mail["Date"]


def test_a_source_date_epoch_that_is_not_a_number_is_a_usage_error(syn, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    result = run_export(syn, tmp_path / "export")
    assert result.exit_code == 2, said(result)
    assert "SOURCE_DATE_EPOCH" in said(result) and not (tmp_path / "export").exists()


# --- who the patches are by ------------------------------------------------------------------


def test_git_dash_c_around_the_export_makes_the_author(syn, tmp_path):
    # as `git -c user.name=A -c user.email=a@example.org <command>` runs a command: through a git alias
    out = tmp_path / "export"
    command = " ".join([sys.executable, "-m", "dfbuild", "series", "export", "--upstream", "--base", syn.base_commit,
                        "--repo", str(syn.upstream), "--patches", str(syn.patches), "--out", str(out)])
    result = subprocess.run(["git", "-c", "user.name=A", "-c", "user.email=a@example.org", "-c",
                             f"alias.export-upstream=!{command}", "export-upstream"],
                            cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull})
    assert result.returncode == 0, result.stderr
    for mail in mails(out):
        assert str(mail["From"]) == "A <a@example.org>"
    written = [p.read_text() for p in out.iterdir() if p.is_file()]
    assert not any(".example" in text for text in written)


def test_author_wins_over_git_and_the_tree_config_over_the_user_config(syn, tmp_path, monkeypatch):
    out = tmp_path / "export"
    result = run_export(syn, out, "--author", "Bo Builder <bo@example.net>")
    assert result.exit_code == 0, said(result)
    assert {str(m["From"]) for m in mails(out)} == {"Bo Builder <bo@example.net>"}

    mine = tmp_path / "my-llama.cpp"
    run_git(tmp_path, "init", "-q", str(mine))
    run_git(mine, "config", "user.name", "Cy Local")
    run_git(mine, "config", "user.email", "cy@example.com")
    monkeypatch.chdir(mine)
    assert export.submitter() == ("Cy Local", "cy@example.com")
    monkeypatch.chdir(tmp_path)
    assert export.submitter() == ("Ada Submitter", "ada@example.org")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Di Env")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "di@example.com")
    assert export.submitter() == ("Di Env", "di@example.com")


def test_no_identity_is_exit_27_with_a_hint_and_nothing_written(syn, tmp_path, monkeypatch):
    git_identity(monkeypatch, tmp_path / "empty.gitconfig", None, None)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "export"
    result = run_export(syn, out, "--json")
    assert result.exit_code == 27, said(result)
    error = json.loads(result.stdout)
    assert "--author" in error["hint"] and "user.email" in error["hint"]
    assert not out.exists() and list(tmp_path.glob(".export.export-*")) == []


@pytest.mark.parametrize("author", ["Bo Builder", "bo@example.net", "<bo@example.net>"])
def test_an_author_that_is_not_name_and_email_is_a_usage_error(syn, tmp_path, author):
    result = run_export(syn, tmp_path / "export", "--author", author)
    assert result.exit_code == 2, said(result)
    assert "Name <email>" in said(result) and not (tmp_path / "export").exists()


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


def test_an_empty_dir_is_used_and_an_earlier_export_replaced_whole(syn, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796300000")
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


TEMPLATE = ("## Overview\n\n<!-- Describe -->\n\n## Additional information\n\n<!-- more -->\n\n"
            "## Requirements\n\n<!-- IMPORTANT: keep -->\n\n- I have read\n"
            "- AI usage disclosure: <!-- mention: YES / NO -->\n\n"
            "<!-- If you are an AI agent: remind the user that they are responsible -->\n")
APPLIED = [{"id": "zero-fill", "subject": "spec : fill the hole", "body": "Why.", "origin_urls": []}]


def measured_record(**change) -> dict:
    record = {"base": "b1", "test_sha256": export.digest(export.test_source()), "fix_sha256": "f" * 64,
              "unpatched": {"summary": "1 failed: HTTP 500"}, "patched": {"summary": "1 passed"},
              "how": "Run with upstream's pytest."}
    return {**record, **change}


def pr(measured=None) -> str:
    return export.pr_text(TEMPLATE, base="b1", base_commit="c" * 40, applied=APPLIED, bug="https://bug",
                          measured=measured)


def test_pr_md_follows_the_template_and_leaves_the_disclosure_to_the_submitter():
    text = pr()
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## Overview", "## Additional information", "## Requirements"]
    assert "<!-- Describe -->" not in text and "<!-- more -->" not in text
    assert "<!-- IMPORTANT: keep -->" in text
    # the disclosure is the submitter's: left as the template has it, with a note saying so
    lines = text.splitlines()
    at = lines.index("- AI usage disclosure: <!-- mention: YES / NO -->")
    assert lines[at + 1].startswith("<!-- dfbuild: left for you.") and "AI usage disclosure yourself" in lines[at + 1]
    # the template's comment to AI agents is handled: its reminder is the note (and stderr), the comment goes
    assert "If you are an AI agent" not in text
    assert "- fill the hole" in text and "Fixes https://bug" in text


def test_pr_md_says_once_when_the_bug_happens_and_no_dfbuild_figures():
    text = pr(measured_record())
    assert text.count(export.WHEN) == 1
    assert "plain-rope" in export.WHEN and "M-RoPE" in export.WHEN
    for internal in ("smoke", " of 41", "fixture set", "dfbuild prove", "scenario"):
        assert internal not in text, internal
    assert "<!-- dfbuild: slot for the converter figures" in text


CONVERTED = json.loads((Path(__file__).resolve().parent.parent / "bench" / "convert_drafts.json").read_text())


def test_pr_md_says_which_drafts_hit_the_bug_from_the_bases_own_converter():
    """Issue 37: bench/convert_drafts.json's rows for the exported base, a table a reviewer can redo with the
    base's converter and gguf-dump, and when reconverting is the way out; the slot where nothing was measured."""
    text = export.pr_text(TEMPLATE, base="b11434", base_commit="c" * 40, applied=APPLIED, bug="", measured=None,
                          converter=CONVERTED)
    assert export_text.CONVERTER_SLOT not in text
    assert "b11434's own `convert_hf_to_gguf.py`" in text
    assert "| `rope_parameters.mrope_section` | `dflash.rope.dimension_sections = [8, 0, 0, 0]` |" in text
    assert "| `rope_scaling.mrope_section` | `dflash.rope.dimension_sections = [8, 0, 0, 0]` |" in text
    assert "| no `mrope_section` | no rope sections (plain rope) |" in text
    assert "| `rope_parameters` without it, `rope_scaling.mrope_section` | no rope sections (plain rope) |" in text
    assert "by b10644's converter or an older one" in text  # the newest measured one that writes no sections
    assert "reconverting it with b11434's converter" in text and "is the alternative to this PR" in text
    # before the loader reads the sections, reconverting cannot help, whatever the converter wrote
    old = export.pr_text(TEMPLATE, base="b10644", base_commit="c" * 40, applied=APPLIED, bug="", measured=None,
                         converter=CONVERTED)
    assert "At b10644 llama.cpp does not read `dflash.rope.dimension_sections`" in old
    assert "reconverting the draft does not avoid it" in old and "alternative to this PR" not in old
    assert old.count("no rope sections (plain rope) |") == 4
    # the one statement of when it happens names the drafts a loader that ignores the key treats as plain rope
    assert "any DFlash draft in a llama.cpp that does not read that key yet" in export.WHEN
    # a base whose own converter was not measured (another may read a config otherwise), a PR head, no record
    for base, record in (("b11378", CONVERTED), ("5ecbe1a", CONVERTED), ("b11434", None),
                         ("b11434", {"rows": CONVERTED["rows"]})):
        assert export_text.converter_note(base, record) is None, base
        assert export_text.CONVERTER_SLOT in export.pr_text(TEMPLATE, base=base, base_commit="c" * 40, applied=APPLIED,
                                                       bug="", measured=None, converter=record)


def test_the_export_reads_the_converter_record_beside_the_patches(syn, tmp_path, monkeypatch):
    seen = []

    def note(base, record):
        seen.append((base, record))
        return ["CONVERTER FIGURES"]

    monkeypatch.setattr(export_text, "converter_note", note)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "convert_drafts.json").write_text(json.dumps({"rows": [], "targets": {}}))
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    assert seen == [(syn.base_commit, {"rows": [], "targets": {}})]
    text = (out / "PR.md").read_text()
    assert "CONVERTER FIGURES" in text and "slot for the converter" not in text


def test_pr_md_shows_the_new_tests_results_only_when_made_with_this_test_and_fix():
    record = measured_record()
    assert export.measured_for(record, base="b1", fix_sha256="f" * 64) == record
    text = pr(record)
    assert "| `pytest -v unit/test_speculative_mtmd.py` | 1 failed: HTTP 500 | 1 passed |" in text
    assert "Run with upstream's pytest." in text
    stale = [measured_record(test_sha256="0" * 64), measured_record(base="b2"), measured_record(patched={})]
    for old in stale:
        assert export.measured_for(old, base="b1", fix_sha256="f" * 64) is None
    assert export.measured_for(record, base="b1", fix_sha256="e" * 64) is None  # another fix
    assert export.measured_for(record, base="b1", fix_sha256=None) is None
    text = pr(None)
    assert "| `pytest" not in text and "not recorded for this text" in text


def test_a_record_of_another_fix_is_left_out_with_a_warning(syn, tmp_path):
    record = tmp_path / "measured.json"
    record.write_text(json.dumps(measured_record(base=syn.base_commit)))
    out = tmp_path / "export"
    result = run_export(syn, out, "--measured", record, "--json")
    assert result.exit_code == 0, said(result)
    assert "not measured with this export's test and fix" in result.stderr
    assert "| `pytest" not in (out / "PR.md").read_text()
    # the same figures under the digests the export reports are shown
    data = json.loads(result.stdout)
    record.write_text(json.dumps(measured_record(base=syn.base_commit, fix_sha256=data["fix_sha256"])))
    result = run_export(syn, out, "--measured", record)
    assert result.exit_code == 0, said(result)
    assert "| 1 failed: HTTP 500 | 1 passed |" in (out / "PR.md").read_text()


def test_the_commit_messages_read_as_a_maintainers(syn, tmp_path):
    out = tmp_path / "export"
    assert run_export(syn, out).exit_code == 0
    fix, test = [m.get_payload().split("\n---\n")[0] for m in mails(out)]
    assert export.WHEN.split(". ")[0].split()[:4] == fix.split()[:4]
    assert f"Written against llama.cpp {syn.base_commit}." in " ".join(fix.split())
    assert "Fixes: " in fix
    for body in (fix, test):
        assert all(len(line) <= 80 for line in body.splitlines()), body
        # no heading made of a subject ("DFlash mirrors ...:"), no bookkeeping, no dfbuild words
        assert [line for line in body.splitlines() if line.endswith(":")] in ([], ["Changes:"]), body
        for internal in ("dfbuild", "series", "epoch", "variant", "Dfbuild-", "Origin:", "base1"):
            assert internal not in body, internal


def test_no_shipped_patch_subject_names_an_epoch():
    # the fix commit lists the applied patches' subjects: they must not name dfbuild's bases
    from dfbuild import series

    curated = series.load_series()
    files = sorted({v.file for c in curated.concerns for v in c.variants.values() if v.file})
    for name in files:
        subject, _ = export.upstream_message(curated.root / name)
        message = export.fix_message([{"subject": subject, "origin_urls": []}], "https://bug", "b99999")
        named = set(re.findall(r"\b(b\d{4,6}|5ecbe1a|pydist[\w.-]*)\b", message))
        assert named == {"b99999"}, (name, named)


def test_requirements_gain_pyyaml_once():
    text = "aiohttp~=3.9.3\nnumpy~=2.2.6\nopenai~=2.14.0\n"
    assert export.requirements_with_yaml(text) == "aiohttp~=3.9.3\nnumpy~=2.2.6\nPyYAML~=6.0\nopenai~=2.14.0\n"
    assert export.requirements_with_yaml("pyyaml>=5\n") is None


def test_the_upstream_test_is_small_ascii_python_in_upstreams_pattern(tmp_path):
    source = export.test_source()
    path = tmp_path / export.TEST_NAME
    path.write_text(source)
    py_compile.compile(str(path), doraise=True)
    assert source.isascii()
    assert len(source.splitlines()) < 150
    # upstream's harness: utils.ServerProcess, the tree's gguf-py as the converters import it
    assert "from utils import *" in source and "ServerProcess()" in source
    assert 'sys.path.insert(1, str(Path(__file__).resolve().parents[4] / "gguf-py"))' in source
    assert "gguf.GGUFWriter" in source and '"draft-dflash"' in source
    # no download, no override of conftest's fixtures, no tautology
    assert "download_file" not in source and "hf_repo = None" in source.replace("model_", "")
    assert "load_server_presets" not in source and "content_of" not in source
    # the case that fails: a plain-rope draft (no rope sections), M-RoPE target, text before the image
    draft = source[source.index('"draft.gguf"'):source.index("# a qwen2vl_merger")]
    assert "rope.dimension_sections" not in draft
    assert '"rope.dimension_sections": [3, 3, 2, 0]' in source
    assert re.search(r'"prompt_string": f"\w[^"]*<__media__>\{question\}"', source)
    # the prefix reuse it claims is asserted
    assert 'res.body["timings"]["cache_n"] > 0' in source
    assert source.count("assert res.status_code == 200") == 3


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


# --- a base whose tree only a git host has: the export from its variants alone ---------------


def a_pr_head(syn, tmp_path, monkeypatch) -> None:
    """base1 as a PR head is to dfbuild: a known base whose tree only a git host has (here: one that is gone)."""
    from dfbuild.source import checkout as source

    monkeypatch.setitem(source.KNOWN_BASES, "base1", source.KnownBase(
        name="base1", commit=syn.base_commit, repo=str(tmp_path / "gone"), note="a PR head"))


def test_a_base_only_a_git_host_has_is_exported_from_its_variants_without_a_tree(syn, tmp_path, monkeypatch):
    a_pr_head(syn, tmp_path, monkeypatch)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1796300000")
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
    result = dfbuild("series", "export", "--upstream", "--base", "base1", "--repo", syn.upstream, "--patches",
                     syn.patches, "--out", made_in_a_tree)
    assert result.exit_code == 0, said(result)
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
    assert all(str(m["From"]) == SUBMITTER for m in found)
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


# --- dfbuild.series.squash: the sparse base a variant's chained patches show -----------------------


def _patch(old_blob: str, new_blob: str, hunk: str) -> str:
    return (f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] x\n\n---\ndiff --git a/f.cpp b/f.cpp\n"
            f"index {old_blob}..{new_blob} 100644\n--- a/f.cpp\n+++ b/f.cpp\n{hunk}\n-- \n2.0\n")


def test_the_sparse_base_holds_the_lines_the_chain_shows_and_the_hunk_headers_function_above_them():
    """Two chained patches of one file: the lines their hunks show, at their places; a placeholder for every
    other line, except the one nearest above a hunk, which gets the function its header names."""
    from dfbuild.series import squash

    a, b, c = "a" * 40, "b" * 40, "c" * 40
    hunk = "@@ -11,3 +11,4 @@ int main() {\n   b11\n   b12\n+  y = 3;\n   b13"
    first = _patch(a, b, "@@ -8,5 +8,5 @@ int main() {\n   a8\n   a9\n-  x = 1;\n+  x = 2;\n   b11\n   b12")
    second = _patch(b, c, hunk)
    chain = [(name, diff) for name, text in (("0001.patch", first), ("0002.patch", second))
             for diff in squash.parse(text, name)]
    text, old, new, mode = squash.sparse_base(chain)
    lines = text.splitlines()
    assert (old, new, mode) == (a, c, "100644")
    assert lines[:6] == [squash.PLACEHOLDER.format(n) for n in range(1, 7)]
    assert lines[6] == "int main() {"  # line 7: the function the hunk headers name, where git looks for it
    assert lines[7:13] == ["  a8", "  a9", "  x = 1;", "  b11", "  b12", "  b13"]
    assert lines[13:] == [squash.PLACEHOLDER.format(14)]

    unchained = squash.parse(_patch(a, c, hunk), "0002.patch")
    with pytest.raises(export.ExportError, match="starts from blob aaaaaaaaaaaa, but the patch before leaves bbbb"):
        squash.sparse_base([chain[0], ("0002.patch", unchained[0])])


# --- git in the scratch checkout: its failures are the export's (exit 26), its commits the submitter's ------


def test_a_git_failure_in_the_scratch_checkout_is_exit_26_with_gits_last_line(tmp_path):
    with pytest.raises(export.ExportError) as caught:
        export.build_commits(None, tmp_path, base="base1", author=("Ada", "ada@example.org"), date="now")
    assert caught.value.exit_code == 26 and caught.value.hint is None
    assert caught.value.message == ("git rev-parse failed in the scratch checkout: fatal: not a git repository "
                                    "(or any of the parent directories): .git")


def test_a_commit_is_the_submitters_at_the_date_given_and_runs_no_hook(tmp_path):
    run_git(tmp_path, "init", "-q")
    hook = tmp_path / ".git" / "hooks" / "post-commit"
    hook.write_text("#!/bin/sh\ntouch hook-ran\n")  # a hook runs at the top of the work tree
    hook.chmod(0o755)
    (tmp_path / "f.txt").write_text("x\n")
    run_git(tmp_path, "add", "f.txt")
    date = "Fri, 1 Jan 2027 00:00:00 +0000"

    commit = export._commit(tmp_path, "subject\n\nbody\n", ("Ada Submitter", "ada@example.org"), date)

    shown = run_git(tmp_path, "log", "-1", "--format=%H|%an <%ae>|%cn <%ce>|%aD|%cD|%B")
    assert shown.strip() == (f"{commit}|{SUBMITTER}|{SUBMITTER}|{date}|{date}|subject\n\nbody")
    assert not (tmp_path / "hook-ran").exists()
    with pytest.raises(export.ExportError, match=r"^git commit failed in the scratch checkout: \(no message\)$"):
        export._commit(tmp_path, "nothing staged\n", ("Ada Submitter", "ada@example.org"), date)
