"""The patch series: apply, check, list and refresh on synthetic git repos.

A tiny fake llama.cpp tree (CMakeLists.txt and a ~50-line
common/speculative.cpp) stands in for the real thing, and four synthetic
concerns play the four DFlash fixes. Their patch files are real
`git format-patch` output from commits carrying `Dfbuild-Concern:` trailers,
in a patches dir of their own with its own series.toml, so every rule of the
series (sha256, reverse check, zero fuzz, fixed identity, atomic rollback) is
exercised without a llama.cpp checkout. Concerns 1 and 2 touch neighbouring
lines on purpose: real concerns in one function do that too.

The last tests check the shipped patches/series.toml itself (cheap: no tree).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import dfbuild, private_cache, run_git, said, write_fake_llama

from dfbuild import series
from dfbuild.core import gitrun, journal, paths, ui
from dfbuild.core.errors import (
    DirtyTreeError,
    NotApplicableError,
    NoVariantError,
    PatchConflictError,
    PatchIntegrityError,
    SeriesFileError,
)
from dfbuild.core.manifest import tree_manifest_path
from dfbuild.source import checkout as source

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC = "common/speculative.cpp"
FORMAT_PATCH = ["format-patch", "--zero-commit", "--no-signature", "--no-numbered", "--full-index", "--stdout"]

# --- the synthetic llama.cpp ---------------------------------------------------------

BASE_LINES = [
    "// synthetic common/speculative.cpp for dfbuild's unit tests",
    '#include "speculative.h"',
    "",
    "// process(): mirror a target batch into the draft cache",
    "int process(dflash & st, const batch & b) {",
    "    const int n = b.n_tokens;",
    "    // mirror the rows",
    "    mirror(st, b, n);",
    "    return 0;",
    "}",
    "",
    "// draft(): place the noise block and decode it",
    "int draft(dflash & st, const tokens & prompt) {",
    "    const int base = st.n_past;",
    *[f"    draft_step_{i:02d}();" for i in range(1, 13)],
    "    decode(st, base, noise);",
    "    return sample(st);",
    "}",
    "",
    "// begin(): remember the prompt",
    "void begin(dflash & st, const tokens & prompt) {",
    "    if (st.pos_max < (int) prompt.size() - 1) {",
    '        LOG_WRN("pos_max < N-1");',
    "    }",
    "    st.prompt = prompt;",
    "}",
]

# Each concern: its id, a subject, and its edits as (an existing line, the lines replacing it).
CONCERNS = [
    ("embedding-skip", "spec : skip embedding batches in process()", [
        ("    const int n = b.n_tokens;",
         ["    const int n = b.n_tokens;", "    if (b.embd) {", "        return 0; // image rows stay out", "    }"]),
    ]),
    ("zero-fill", "spec : zero-fill the draft cache's hole", [
        # inside the trailing context of embedding-skip's hunk
        ("    mirror(st, b, n);", ["    fill_hole(st, b); // [pos_max+1, first_pos)", "    mirror(st, b, n);"]),
    ]),
    ("noise-block-base", "spec : noise block at the draft cache's pos_max + 1", [
        ("    const int base = st.n_past;", ["    const int base = st.pos_max + 1;"]),
        ("    decode(st, base, noise);", ["    decode(st, base, noise); // at the cache's own position"]),
    ]),
    ("warning-downgrade", "spec : the pos_max < N-1 warning becomes a debug message", [
        ('        LOG_WRN("pos_max < N-1");', ['        LOG_DBG("pos_max < N-1: tokens and positions differ");']),
    ]),
]
IDS = [c[0] for c in CONCERNS]


def text_of(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def with_concerns(lines: list[str], ids: list[str]) -> list[str]:
    """BASE_LINES with the edits of the given concerns made."""
    lines = list(lines)
    for concern_id, _, edits in CONCERNS:
        if concern_id in ids:
            for old, new in edits:
                at = lines.index(old)
                lines[at:at + 1] = new
    return lines


def blob_id(text: str) -> str:
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- git and CLI helpers ---------------------------------------------------------------


def commit_all(tree: Path, message: str) -> str:
    run_git(tree, "add", "-A")
    run_git(tree, "commit", "-q", "-m", message)
    return run_git(tree, "rev-parse", "HEAD")


def new_repo(path: Path, speculative: str, message: str = "llama : base") -> str:
    path.mkdir(parents=True)
    run_git(path, "init", "-q", "-b", "master")
    write_fake_llama(path, speculative)
    return commit_all(path, message)


def commit_edit(tree: Path, lines: list[str], message: str) -> str:
    (tree / SPEC).write_text(text_of(lines))
    return commit_all(tree, message)


def head(tree: Path) -> str:
    return run_git(tree, "rev-parse", "HEAD")


def snapshot(tree: Path) -> dict:
    """Everything `apply` or `check` could change in a checkout."""
    files = {p.relative_to(tree).as_posix(): p.read_bytes()
             for p in sorted(tree.rglob("*")) if p.is_file() and ".git" not in p.relative_to(tree).parts}
    return {
        "head": head(tree),
        "branch": run_git(tree, "symbolic-ref", "-q", "HEAD"),
        "refs": run_git(tree, "for-each-ref"),
        "index": run_git(tree, "ls-files", "--stage"),
        "status": run_git(tree, "status", "--porcelain", "--untracked-files=all", "--ignored"),
        "files": files,
    }


# --- the synthetic series ----------------------------------------------------------------


@dataclass
class Synthetic:
    upstream: Path          # the base repo: one commit, tagged base1
    base_commit: str
    work: Path              # a maintainer's clone: one commit per concern on top of base1
    concern_commits: list[str]
    patches: Path           # patches dir: series.toml + base1/NNNN-<id>.patch
    blob: str               # blob id of the base's speculative.cpp

    def load(self) -> series.Series:
        return series.load_series(self.patches)

    def clone(self, dest: Path) -> Path:
        run_git(dest.parent, "clone", "-q", str(self.upstream), str(dest))
        return dest

    def patch(self, concern_id: str) -> Path:
        return self.patches / "base1" / f"{IDS.index(concern_id) + 1:04d}-{concern_id}.patch"


SERIES_HEADER = """\
# synthetic series for dfbuild's unit tests
# (comments like this one must survive `series refresh`)

bug = "https://example.org/issues/1"

[bases.base1]
blob = "{blob}"
note = "the synthetic base"
"""

CONCERN_TABLE = """
[[concern]]
id = "{id}"
title = "{title}"
rationale = \"\"\"
Why {id} is needed, in a few words.
\"\"\"
[concern.dep3]
Origin = "vendor, dfbuild"
Forwarded = "no"

[concern.variants]
{variants}
"""


def write_series(patches: Path, blob: str, variants: dict[str, list[str]], extra_bases: str = "") -> Path:
    """series.toml with one variants block per concern (lines of `base = {...}`)."""
    text = SERIES_HEADER.format(blob=blob) + extra_bases
    for concern_id, title, _ in CONCERNS:
        text += CONCERN_TABLE.format(id=concern_id, title=title, variants="\n".join(variants[concern_id]))
    patches.mkdir(parents=True, exist_ok=True)
    (patches / "series.toml").write_text(text)
    return patches / "series.toml"


def patch_variant(base: str, path: Path, patches: Path) -> str:
    return f'{base} = {{file = "{path.relative_to(patches).as_posix()}", sha256 = "{sha256(path)}"}}'


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Synthetic:
    root = tmp_path_factory.mktemp("series-template")
    base_text = text_of(BASE_LINES)
    upstream = root / "upstream"
    base_commit = new_repo(upstream, base_text)
    run_git(upstream, "tag", "base1")

    work = root / "work"
    run_git(root, "clone", "-q", str(upstream), str(work))
    patches = root / "patches"
    (patches / "base1").mkdir(parents=True)
    commits, variants = [], {}
    for number, (concern_id, subject, _) in enumerate(CONCERNS, 1):
        lines = with_concerns(BASE_LINES, IDS[:number])
        message = f"{subject}\n\nWhat {concern_id} changes and why.\n\nDfbuild-Concern: {concern_id}\n"
        commits.append(commit_edit(work, lines, message))
        patch = patches / "base1" / f"{number:04d}-{concern_id}.patch"
        patch.write_bytes(subprocess.run(["git", *FORMAT_PATCH, "-1", commits[-1]], cwd=work,
                                         capture_output=True, check=True).stdout)
        variants[concern_id] = [patch_variant("base1", patch, patches)]
    write_series(patches, blob_id(base_text), variants)
    return Synthetic(upstream, base_commit, work, commits, patches, blob_id(base_text))


@pytest.fixture
def syn(template, tmp_path) -> Synthetic:
    """A private copy of the template, so a test may change anything in it."""
    copy = {}
    for name in ("upstream", "work", "patches"):
        copy[name] = tmp_path / name
        shutil.copytree(getattr(template, name), copy[name])
    return Synthetic(copy["upstream"], template.base_commit, copy["work"], template.concern_commits,
                     copy["patches"], template.blob)


@pytest.fixture
def tree(syn, tmp_path) -> Path:
    """A user's checkout of the synthetic base."""
    return syn.clone(tmp_path / "llama")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    return private_cache(tmp_path, monkeypatch)


# --- clean apply -------------------------------------------------------------------------------


def test_clean_apply_makes_one_commit_per_concern_with_the_patch_author_and_date(syn, tree):
    section = series.apply_series(syn.load(), tree)

    assert section["base"] == "base1"
    assert section["changed"] is True
    assert [c["id"] for c in section["concerns"]] == IDS
    assert [c["status"] for c in section["concerns"]] == ["applied"] * 4
    # one commit per concern, in order, on top of the base, and nothing else
    commits = run_git(tree, "rev-list", "--reverse", f"{syn.base_commit}..HEAD").split()
    assert [c["commit"] for c in section["concerns"]] == commits
    assert section["head"] == commits[-1] == head(tree)
    for entry, commit in zip(section["concerns"], commits):
        who = run_git(tree, "log", "-1", "--format=%an <%ae>|%ad|%cn <%ce>|%cd", "--date=iso-strict", commit)
        # the patch's own author and Date (the synthetic patches are the maintainer's commits), committed
        # by the project at that date: reproducible, and never the import's placeholder identity or 2000
        author, date = series.patch_author(syn.patch(entry["id"]))
        assert (author, date) == (("Upstream Dev", "dev@example.org"), "Thu, 1 Jan 2026 00:00:00 +0000")
        project = f"{source.PROJECT_NAME} <{source.PROJECT_EMAIL}>"
        assert who == f"Upstream Dev <dev@example.org>|2026-01-01T00:00:00+00:00|{project}|2026-01-01T00:00:00+00:00"
        assert entry["file"] == f"base1/{syn.patch(entry['id']).name}"
        assert entry["sha256"] == sha256(syn.patch(entry["id"]))
        # the commit message is the patch's, trailer included, as `git am` would make it
        message = run_git(tree, "log", "-1", "--format=%B", commit)
        subject = dict((c[0], c[1]) for c in CONCERNS)[entry["id"]]
        assert message.splitlines()[0] == subject
        assert f"Dfbuild-Concern: {entry['id']}" in message
    # the result is exactly the maintainer's tree, and the checkout is clean
    assert run_git(tree, "rev-parse", "HEAD^{tree}") == run_git(syn.work, "rev-parse", "HEAD^{tree}")
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))
    assert run_git(tree, "status", "--porcelain", "--untracked-files=all") == ""


def test_apply_accepts_a_relative_patches_dir(syn, tree, monkeypatch):
    monkeypatch.chdir(syn.patches.parent)
    section = series.apply_series(series.load_series(Path(syn.patches.name)), tree)
    assert [c["status"] for c in section["concerns"]] == ["applied"] * 4


def test_reapply_is_a_noop_that_says_so(syn, tree):
    series.apply_series(syn.load(), tree)
    before = snapshot(tree)

    again = series.apply_series(syn.load(), tree)

    assert again["changed"] is False
    assert [c["status"] for c in again["concerns"]] == ["already-present"] * 4
    assert all("commit" not in c for c in again["concerns"])
    assert again["head"] == before["head"]
    assert snapshot(tree) == before


def test_reproducible_commit_ids_across_clones(syn, tmp_path):
    first = syn.clone(tmp_path / "one")
    second = syn.clone(tmp_path / "two")
    a = series.apply_series(syn.load(), first)
    b = series.apply_series(syn.load(), second)
    assert a["head"] == b["head"] == head(first) == head(second)
    assert [c["commit"] for c in a["concerns"]] == [c["commit"] for c in b["concerns"]]
    # and not by accident: the patched commits are new ones, not the maintainer's
    assert a["head"] != syn.concern_commits[-1]


def test_reapply_after_the_patch_files_were_reworded_gives_the_fresh_trees_commits(syn, tree, tmp_path):
    """A tree patched from older patch files (a renamed variant, a new header: the same change in other
    words) gets the commits today's series makes, as a fresh tree does: the patched commit is stamped
    into every binary, so it may depend on the series alone. Before, the old commits stayed."""
    series.apply_series(syn.load(), tree)
    old_head = head(tree)
    patch = syn.patch("zero-fill")
    patch.write_text(patch.read_text().replace("Dfbuild-Concern: zero-fill",
                                               "Reworded, not changed.\n\nDfbuild-Concern: zero-fill", 1))
    write_series(syn.patches, syn.blob, {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS})

    again = series.apply_series(syn.load(), tree)
    fresh = series.apply_series(syn.load(), syn.clone(tmp_path / "fresh"))

    assert again["head"] == fresh["head"] == head(tree) != old_head
    assert "Reworded, not changed." in run_git(tree, "log", "--format=%B", "HEAD")
    assert run_git(tree, "status", "--porcelain", "--untracked-files=all") == ""
    assert journal.pending(tree) is None


# --- upstream and already-present ------------------------------------------------------------


def test_concern_recorded_upstream_is_reported_not_applied(syn, tmp_path):
    """A base that already carries warning-downgrade; series.toml says so."""
    upstream_text = text_of(with_concerns(BASE_LINES, ["warning-downgrade"]))
    other = tmp_path / "other"
    new_repo(other, upstream_text, "llama : upstream took warning-downgrade")
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches),
                      patch_variant("other", syn.patch(cid), syn.patches)] for cid in IDS[:3]}
    variants["warning-downgrade"] = [
        patch_variant("base1", syn.patch("warning-downgrade"), syn.patches),
        'other = {status = "upstream", note = "merged upstream as abc1234"}',
    ]
    write_series(syn.patches, syn.blob, variants,
                 extra_bases=f'\n[bases.other]\nblob = "{blob_id(upstream_text)}"\n')

    base, steps = series.plan(syn.load(), other)
    assert base == "other"
    assert [s.status for s in steps] == ["clean", "clean", "clean", "upstream"]
    assert steps[3].detail == "merged upstream as abc1234"

    section = series.apply_series(syn.load(), other)
    assert [c["status"] for c in section["concerns"]] == ["applied"] * 3 + ["upstream"]
    assert "commit" not in section["concerns"][3]
    assert len(run_git(other, "rev-list", "HEAD").split()) == 1 + 3
    assert (other / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))


def test_concern_recorded_not_needed_is_a_decision_with_its_reason(syn, tree, capsys):
    """warning-downgrade at a base where no scenario needs it: nothing is applied, and apply says why."""
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches)] for cid in IDS[:3]}
    variants["warning-downgrade"] = ['base1 = {status = "not-needed", note = "measured: the warning never fired"}']
    write_series(syn.patches, syn.blob, variants)

    base, steps = series.plan(syn.load(), tree)
    assert [s.status for s in steps] == ["clean", "clean", "clean", "not-needed"]
    section = series.apply_series(syn.load(), tree)
    decision = section["concerns"][3]
    assert decision["status"] == "not-needed" and decision["detail"] == "measured: the warning never fired"
    assert "commit" not in decision
    assert len(run_git(tree, "rev-list", f"{syn.base_commit}..HEAD").split()) == 3
    from dfbuild.release import pipeline as release

    assert release.series_hash(section) != release.series_hash(
        {"concerns": section["concerns"][:3] + [{**decision, "status": "upstream"}]})
    # a decision without its reason is refused
    write_series(syn.patches, syn.blob, {**variants, "warning-downgrade": ['base1 = {status = "not-needed"}']})
    with pytest.raises(SeriesFileError, match="not-needed: its note must say why"):
        syn.load()


def test_partial_upstream_variant_applies_what_is_missing(syn, tmp_path):
    """noise-block-base is half upstream on this base: its variant adds the other half."""
    half = with_concerns(BASE_LINES, ["noise-block-base"])
    half[half.index("    decode(st, base, noise); // at the cache's own position")] = "    decode(st, base, noise);"
    other = tmp_path / "other"
    new_repo(other, text_of(half))
    rest = syn.patches / "other" / "0003-noise-block-base.patch"
    rest.parent.mkdir()
    work = syn.clone(tmp_path / "maintainer")
    commit_edit(work, half, "upstream : half of it")
    commit_edit(work, with_concerns(BASE_LINES, ["noise-block-base"]), "spec : the rest\n\nDfbuild-Concern: noise-block-base\n")
    rest.write_bytes(subprocess.run(["git", *FORMAT_PATCH, "-1", "HEAD"], cwd=work, capture_output=True, check=True).stdout)
    variants = {cid: [patch_variant("other", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["noise-block-base"] = [patch_variant("other", rest, syn.patches)[:-1]
                                    + ', status = "partial-upstream", note = "base placement is upstream"}']
    write_series(syn.patches, syn.blob, variants, extra_bases=f'\n[bases.other]\nblob = "{blob_id(text_of(half))}"\n')

    section = series.apply_series(syn.load(), other)

    assert [c["status"] for c in section["concerns"]] == ["applied"] * 4
    assert section["concerns"][2]["file"] == "other/0003-noise-block-base.patch"
    assert (other / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))


def test_change_already_in_the_tree_is_skipped_as_already_present(syn, tree):
    """Upstream made warning-downgrade's change after the base: the reverse check finds it."""
    commit_edit(tree, with_concerns(BASE_LINES, ["warning-downgrade"]), "upstream : quieter begin()")
    upstream_head = head(tree)

    section = series.apply_series(syn.load(), tree)

    # a tree that moved on from base1 is a base of its own: the series is carried to it
    assert section["derived"] is True and section["proven"] is False
    assert section["base"] == upstream_head[:12]
    assert [c["status"] for c in section["concerns"]] == ["applied"] * 3 + ["already-present"]
    assert [(c["variant"], c["how"]) for c in section["concerns"]] == [("base1", "exact")] * 3 + [("base1", "upstream")]
    assert run_git(tree, "rev-list", "--reverse", f"{upstream_head}..HEAD").split() == \
        [c["commit"] for c in section["concerns"][:3]]
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))


def test_partly_applied_series_applies_the_rest(syn, tree):
    """Concerns 1 and 2 (neighbours) are already committed; 3 and 4 still apply."""
    run_git(tree, "fetch", "-q", str(syn.work), syn.concern_commits[1])
    run_git(tree, "merge", "-q", "--ff-only", "FETCH_HEAD")

    section = series.apply_series(syn.load(), tree)

    assert [c["status"] for c in section["concerns"]] == ["already-present"] * 2 + ["applied"] * 2
    assert (tree / SPEC).read_text() == text_of(with_concerns(BASE_LINES, IDS))


# --- failures leave the tree exactly as it was ----------------------------------------------------


def break_hunk_2_of_noise_block_base(tree: Path) -> None:
    lines = list(BASE_LINES)
    lines[lines.index("    draft_step_12();")] = "    draft_step_12(); // changed upstream"
    commit_edit(tree, lines, "upstream : touch draft()")


def test_conflict_rolls_back_and_names_patch_file_and_hunk(syn, tree):
    break_hunk_2_of_noise_block_base(tree)
    before = snapshot(tree)

    with pytest.raises(PatchConflictError) as caught:
        series.apply_series(syn.load(), tree)

    message = caught.value.message
    assert "base1/0003-noise-block-base.patch" in message
    assert SPEC in message
    assert "hunk #2" in message
    assert "nothing was applied" in message
    assert "refresh" in caught.value.hint
    assert snapshot(tree) == before


def test_conflict_found_only_while_applying_rolls_back_everything(syn, tree, monkeypatch):
    """The trial passed, then the real `git apply` of patch 3 fails (after two commits were made)."""
    before = snapshot(tree)
    real_git = gitrun.run

    def git_with_a_surprise(where, *args, **kwargs):
        if "apply" in args and "--index" in args and args[-1].endswith("0003-noise-block-base.patch"):
            # something edits the tree between the check and the apply
            (Path(where) / SPEC).write_text("// not what the patch expects\n")
            (Path(where) / "stray.o").write_text("left behind\n")
        return real_git(where, *args, **kwargs)

    monkeypatch.setattr(gitrun, "run", git_with_a_surprise)
    with pytest.raises(PatchConflictError) as caught:
        series.apply_series(syn.load(), tree)

    assert "0003-noise-block-base.patch" in caught.value.message
    assert SPEC in caught.value.message
    # everything dfbuild changed is back; a file someone else made meanwhile is not dfbuild's to delete
    assert (tree / "stray.o").read_text() == "left behind\n"
    (tree / "stray.o").unlink()
    assert snapshot(tree) == before


def test_tampered_patch_is_refused_and_nothing_applied(syn, tree):
    patch = syn.patch("noise-block-base")
    data = bytearray(patch.read_bytes())
    at = data.index(b"pos_max + 1")
    data[at] ^= 0x01  # one byte
    patch.write_bytes(bytes(data))
    before = snapshot(tree)

    with pytest.raises(PatchIntegrityError) as caught:
        series.apply_series(syn.load(), tree)

    assert "0003-noise-block-base.patch" in caught.value.message
    assert "sha256" in caught.value.message
    assert snapshot(tree) == before


def test_corrupt_patch_with_matching_sha256_is_a_clear_error(syn, tree):
    """The sha256 was updated too, so only git can tell: a hunk lost a line."""
    patch = syn.patch("zero-fill")
    lines = patch.read_text().splitlines(keepends=True)
    lines.remove(" " + "    mirror(st, b, n);\n")  # a context line: the hunk's counts no longer add up
    patch.write_text("".join(lines))
    toml = syn.patches / "series.toml"
    old = re.search(r'zero-fill.patch", sha256 = "([0-9a-f]{64})"', toml.read_text()).group(1)
    toml.write_text(toml.read_text().replace(old, sha256(patch)))
    before = snapshot(tree)

    with pytest.raises(PatchConflictError) as caught:
        series.apply_series(syn.load(), tree)

    assert "base1/0002-zero-fill.patch" in caught.value.message
    assert "corrupt patch" in caught.value.message
    assert snapshot(tree) == before


def test_tree_without_dflash_is_not_applicable_and_untouched(syn, tmp_path):
    other = tmp_path / "other"
    new_repo(other, "// some other llama.cpp, from before speculative drafting\n")
    before = snapshot(other)
    assert series.identify_base(syn.load(), other) is None

    with pytest.raises(NotApplicableError) as caught:
        series.apply_series(syn.load(), other)

    assert "no DFlash" in caught.value.message
    assert snapshot(other) == before


def test_known_base_without_a_variant_for_one_concern(syn, tmp_path):
    """A base listed in series.toml, but one concern has nothing for it."""
    other_text = text_of(BASE_LINES[:-1] + ["}  // other"])
    other = tmp_path / "other"
    new_repo(other, other_text)
    variants = {cid: [patch_variant("base1", syn.patch(cid), syn.patches),
                      patch_variant("other", syn.patch(cid), syn.patches)] for cid in IDS}
    variants["noise-block-base"] = variants["noise-block-base"][:1]
    write_series(syn.patches, syn.blob, variants, extra_bases=f'\n[bases.other]\nblob = "{blob_id(other_text)}"\n')
    before = snapshot(other)

    with pytest.raises(NoVariantError) as caught:
        series.apply_series(syn.load(), other)

    assert "noise-block-base" in caught.value.message
    assert snapshot(other) == before


@pytest.mark.parametrize("mess", ["modified", "staged", "untracked"])
def test_dirty_tree_is_refused_untouched(syn, tree, mess):
    if mess == "untracked":
        (tree / "notes.txt").write_text("mine\n")
    else:
        (tree / SPEC).write_text((tree / SPEC).read_text() + "// my local edit\n")
        if mess == "staged":
            run_git(tree, "add", SPEC)
    before = snapshot(tree)

    with pytest.raises(DirtyTreeError):
        series.apply_series(syn.load(), tree)

    assert snapshot(tree) == before


# --- recognising the base --------------------------------------------------------------------------


def test_identify_base_by_content_and_through_history(syn, tree, tmp_path):
    curated = syn.load()
    assert series.identify_base(curated, tree) == "base1"

    # the same content in an unrelated repo is the same base: recognised by content
    imported = tmp_path / "imported"
    new_repo(imported, text_of(BASE_LINES), "Import llama.cpp from a tarball")
    assert series.identify_base(curated, imported) == "base1"

    series.apply_series(curated, tree)
    assert source.speculative_blob(tree) != syn.blob
    assert series.identify_base(curated, tree) == "base1"


# --- series check ----------------------------------------------------------------------------------


def check(tree: Path, patches: Path) -> dict:
    """`series check --json`; its exit code says whether apply would succeed."""
    result = dfbuild("series", "check", "--dir", tree, "--patches", patches, "--json")
    report = json.loads(result.stdout)
    found = set(statuses(report))
    expected = (21 if "conflict" in found else 22 if "no-variant" in found
                else 24 if found == {"not-applicable"} else 0)
    assert result.exit_code == expected, said(result)
    return report


def statuses(report: dict) -> list[str]:
    return [c["status"] for c in report["concerns"]]


def test_check_clean_and_changes_nothing(syn, tree):
    before = snapshot(tree)
    report = check(tree, syn.patches)
    assert report["base"] == "base1"
    assert [c["id"] for c in report["concerns"]] == IDS
    assert statuses(report) == ["clean"] * 4
    assert report["concerns"][0]["file"] == "base1/0001-embedding-skip.patch"
    assert snapshot(tree) == before


def test_check_offset(syn, tree):
    commit_edit(tree, BASE_LINES[:1] + [f"// moved down {i}" for i in range(5)] + BASE_LINES[1:], "upstream : header")
    before = snapshot(tree)
    report = check(tree, syn.patches)
    assert report["base"] is None  # moved on from base1: carried from its variants
    assert statuses(report) == ["offset"] * 4
    assert [(c["variant"], c["how"]) for c in report["concerns"]] == [("base1", "offset +5")] * 4
    assert "offset +5" in report["concerns"][0]["detail"]
    assert snapshot(tree) == before


def test_check_applied_after_apply(syn, tree):
    series.apply_series(syn.load(), tree)
    before = snapshot(tree)
    report = check(tree, syn.patches)
    assert report["base"] == "base1"
    assert statuses(report) == ["applied"] * 4
    assert snapshot(tree) == before


def test_check_conflict_names_patch_and_hunk_and_changes_nothing(syn, tree):
    break_hunk_2_of_noise_block_base(tree)
    before = snapshot(tree)
    report = check(tree, syn.patches)
    assert statuses(report) == ["clean", "clean", "conflict", "clean"]
    detail = report["concerns"][2]["detail"]
    assert "base1/0003-noise-block-base.patch" in detail and SPEC in detail and "hunk #2" in detail
    assert snapshot(tree) == before


def test_check_upstream(syn, tmp_path):
    upstream_text = text_of(with_concerns(BASE_LINES, ["warning-downgrade"]))
    other = tmp_path / "other"
    new_repo(other, upstream_text)
    variants = {cid: [patch_variant("other", syn.patch(cid), syn.patches)] for cid in IDS[:3]}
    variants["warning-downgrade"] = ['other = {status = "upstream", note = "upstream since b2"}']
    write_series(syn.patches, "0" * 40, variants, extra_bases=f'\n[bases.other]\nblob = "{blob_id(upstream_text)}"\n')
    report = check(other, syn.patches)
    assert report["base"] == "other"
    assert statuses(report) == ["clean"] * 3 + ["upstream"]
    assert report["concerns"][3]["detail"] == "upstream since b2"


def test_check_tree_without_dflash_is_not_applicable(syn, tmp_path):
    other = tmp_path / "other"
    new_repo(other, "// unknown\n")
    before = snapshot(other)
    report = check(other, syn.patches)
    assert report["base"] is None
    assert statuses(report) == ["not-applicable"] * 4
    assert snapshot(other) == before


def test_check_human_output(syn, tree):
    result = dfbuild("series", "check", "--dir", tree, "--patches", syn.patches)
    assert result.exit_code == 0, said(result)
    assert result.stderr == ""  # the report is the result: all of it on stdout
    assert "base base1" in result.stdout
    assert all(cid in result.stdout for cid in IDS)


# --- the CLI: apply, list, series.toml errors ------------------------------------------------------


def bare_upstream(syn, tmp_path) -> Path:
    bare = tmp_path / "upstream.git"
    run_git(tmp_path, "clone", "-q", "--bare", str(syn.upstream), str(bare))
    return bare


def test_cli_apply_json_then_nothing_to_do(syn, tmp_path):
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "checkout"
    args = ("apply", "--base", syn.base_commit, "--repo", bare, "--dir", dest, "--patches", syn.patches)

    first = dfbuild(*args, "--json")
    assert first.exit_code == 0, said(first)
    data = json.loads(first.stdout)
    assert data["source"]["commit"] == syn.base_commit
    assert data["series"]["base"] == "base1"
    assert [c["status"] for c in data["series"]["concerns"]] == ["applied"] * 4
    assert data["series"]["head"] == head(dest)
    assert json.loads(tree_manifest_path(dest).read_text())["series"] == data["series"]

    second = dfbuild(*args)
    assert second.exit_code == 0, said(second)
    assert "nothing to do" in said(second)
    assert head(dest) == data["series"]["head"]
    assert json.loads(tree_manifest_path(dest).read_text())["series"]["changed"] is False


def test_cli_apply_conflict_exit_code(syn, tmp_path):
    break_hunk_2_of_noise_block_base(syn.upstream)
    bare = bare_upstream(syn, tmp_path)
    dest = tmp_path / "checkout"
    result = dfbuild("apply", "--base", head(syn.upstream), "--repo", bare, "--dir", dest, "--patches", syn.patches)
    assert result.exit_code == PatchConflictError.exit_code
    assert "0003-noise-block-base.patch" in said(result) and "hunk #2" in said(result)
    assert head(dest) == head(syn.upstream)


def test_series_list_in_order(syn):
    result = dfbuild("series", "list", "--patches", syn.patches)
    assert result.exit_code == 0, said(result)
    text = said(result)
    positions = [text.index(f"{n}. {cid}") for n, cid in enumerate(IDS, 1)]
    assert positions == sorted(positions)
    assert "base1/0001-embedding-skip.patch" in text

    data = json.loads(dfbuild("series", "list", "--patches", syn.patches, "--json").stdout)
    assert [c["id"] for c in data["concerns"]] == IDS
    assert data["bases"]["base1"]["blob"] == syn.blob


def test_patches_dir_from_environment(syn, monkeypatch):
    monkeypatch.setenv(series.SERIES_ENV, str(syn.patches))
    data = json.loads(dfbuild("series", "list", "--json").stdout)
    assert data["bug"] == "https://example.org/issues/1"


BROKEN_SERIES = {
    "missing": None,
    "invalid-toml": 'bug = "unterminated\n',
    "missing-title": 'bug = "x"\n[bases.b]\nblob = "1"\n[[concern]]\nid = "a"\nrationale = "r"\n',
    "no-concerns": 'bug = "x"\n[bases.b]\nblob = "1"\n',
    "patch-without-sha": ('bug = "x"\n[bases.b]\nblob = "1"\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n'
                          '[concern.variants]\nb = {file = "b/0001-a.patch"}\n'),
    "variant-not-a-table": ('bug = "x"\n[bases.b]\nblob = "1"\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n'
                            '[concern.variants]\nb = "b/0001-a.patch"\n'),
    "unknown-status": ('bug = "x"\n[bases.b]\nblob = "1"\n[[concern]]\nid = "a"\ntitle = "t"\nrationale = "r"\n'
                       '[concern.variants]\nb = {status = "upstrem"}\n'),
}


@pytest.mark.parametrize("case", sorted(BROKEN_SERIES))
def test_broken_series_file(case, tmp_path):
    patches = tmp_path / "patches"
    patches.mkdir()
    if BROKEN_SERIES[case] is not None:
        (patches / "series.toml").write_text(BROKEN_SERIES[case])

    with pytest.raises(SeriesFileError) as caught:
        series.load_series(patches)
    assert str(patches / "series.toml") in caught.value.message
    assert caught.value.hint

    result = dfbuild("series", "list", "--patches", patches)
    assert result.exit_code == SeriesFileError.exit_code == 23
    assert "series.toml" in said(result)


# --- refresh -------------------------------------------------------------------------------------


def stale_series(syn) -> Path:
    """series.toml that knows base1 but whose variants predate the patches: refresh fills them in."""
    shutil.rmtree(syn.patches)
    return write_series(syn.patches, syn.blob,
                        {cid: [f'base1 = {{file = "base1/old-{cid}.patch", sha256 = "{"0" * 64}"}}'] for cid in IDS})


def test_refresh_writes_format_patch_files_and_sha256s(syn, template):
    toml = stale_series(syn)
    before = toml.read_text()

    result = series.refresh(syn.load(), syn.work, "base1")

    assert result["base"] == "base1"
    assert result["blob"] == syn.blob
    assert result["onto"] == syn.base_commit
    names = sorted(p.name for p in (syn.patches / "base1").iterdir())
    assert names == [f"{n:04d}-{cid}.patch" for n, cid in enumerate(IDS, 1)]
    for cid in IDS:
        # byte for byte what `git format-patch --zero-commit ...` gives
        assert syn.patch(cid).read_bytes() == template.patch(cid).read_bytes()
        assert syn.patch(cid).read_text().startswith("From " + "0" * 40)
        assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40}", syn.patch(cid).read_text(), re.M)
    after = toml.read_text()
    # only the variant lines changed: comments, rationale and layout are kept
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert len(changed) == 4 and all(a.startswith("base1 = ") for a, _ in changed)
    assert "# (comments like this one must survive `series refresh`)" in after
    curated = syn.load()
    for concern in curated.concerns:
        variant = concern.variants["base1"]
        assert variant.file == f"base1/{syn.patch(concern.id).name}"
        assert variant.sha256 == sha256(syn.patch(concern.id))
    # and what it wrote applies
    assert series.apply_series(curated, syn.clone(syn.patches.parent / "fresh"))["changed"]


def test_refresh_through_the_cli_for_a_new_base(syn, tmp_path):
    """A base series.toml does not know yet: refresh records its blob and its variants."""
    run_git(syn.work, "tag", "newbase", syn.base_commit)
    toml = syn.patches / "series.toml"
    toml.write_text(toml.read_text().replace("[bases.base1]", "[bases.old]").replace(syn.blob, "1" * 40)
                    .replace("base1 = {", "old = {"))

    result = dfbuild("series", "refresh", "--dir", syn.work, "--onto", "newbase", "--patches", syn.patches, "--json")

    assert result.exit_code == 0, said(result)
    data = json.loads(result.stdout)
    assert data["base"] == "newbase"
    assert [v["file"] for v in data["variants"]] == [f"newbase/{n:04d}-{cid}.patch" for n, cid in enumerate(IDS, 1)]
    curated = syn.load()
    assert curated.bases["newbase"]["blob"] == syn.blob
    assert curated.bases["old"]["blob"] == "1" * 40
    assert all(set(c.variants) == {"old", "newbase"} for c in curated.concerns)
    assert series.identify_base(curated, syn.clone(tmp_path / "fresh")) == "newbase"


def patches_state(patches: Path) -> dict:
    return {p.relative_to(patches).as_posix(): p.read_bytes() for p in sorted(patches.rglob("*")) if p.is_file()}


def test_refresh_refuses_a_commit_without_trailer(syn):
    stale_series(syn)
    commit_edit(syn.work, with_concerns(BASE_LINES, IDS) + ["// one more thing"], "spec : an unlabelled change")
    before = patches_state(syn.patches)

    with pytest.raises(SeriesFileError) as caught:
        series.refresh(syn.load(), syn.work, "base1")

    assert "Dfbuild-Concern" in caught.value.message
    assert head(syn.work)[:12] in caught.value.message
    assert patches_state(syn.patches) == before


def test_refresh_refuses_a_patch_that_does_not_apply_cleanly_on_the_base(syn):
    """--onto names a base the concern commits were not made on: writes nothing."""
    run_git(syn.work, "checkout", "-q", "-b", "elsewhere", syn.base_commit)
    lines = list(BASE_LINES)
    lines[lines.index("    return 0;")] = "    return 1; // upstream changed process()"
    elsewhere = commit_edit(syn.work, lines, "upstream : process() returns 1")
    run_git(syn.work, "checkout", "-q", "master")
    before = patches_state(syn.patches)

    with pytest.raises(PatchConflictError) as caught:
        series.refresh(syn.load(), syn.work, elsewhere)

    assert "0001-embedding-skip.patch" in caught.value.message
    assert "nothing was written" in caught.value.message
    assert patches_state(syn.patches) == before


def test_refresh_checks_the_variant_in_series_order(syn, tmp_path):
    """Commits made in another order than series.toml: `apply` would not get what was checked."""
    work = syn.clone(tmp_path / "reordered")
    commit_edit(work, with_concerns(BASE_LINES, ["zero-fill"]),
                "spec : zero-fill first\n\nDfbuild-Concern: zero-fill\n")
    commit_edit(work, with_concerns(BASE_LINES, ["zero-fill", "embedding-skip"]),
                "spec : then embedding-skip\n\nDfbuild-Concern: embedding-skip\n")
    before = patches_state(syn.patches)

    with pytest.raises(PatchConflictError):
        series.refresh(syn.load(), work, "base1")
    assert patches_state(syn.patches) == before


def test_refresh_refuses_two_commits_for_one_concern(syn):
    commit_edit(syn.work, with_concerns(BASE_LINES, IDS) + ["// more zero-fill"],
                "spec : zero-fill, part 2\n\nDfbuild-Concern: zero-fill\n")
    before = patches_state(syn.patches)

    with pytest.raises(SeriesFileError) as caught:
        series.refresh(syn.load(), syn.work, "base1")

    assert "zero-fill" in caught.value.message
    assert patches_state(syn.patches) == before


# --- helpers of the module ------------------------------------------------------------------------


def test_commit_message_and_hunks_read_format_patch_output(syn):
    patch = syn.patch("noise-block-base")
    assert series.commit_message(patch) == (
        "spec : noise block at the draft cache's pos_max + 1\n\n"
        "What noise-block-base changes and why.\n\nDfbuild-Concern: noise-block-base\n")
    found = series.hunks(patch)
    assert [(h.file, h.number) for h in found] == [(SPEC, 1), (SPEC, 2)]
    assert found[0].old_start < found[1].old_start
    assert series.describe_failure(patch, f"error: patch failed: {SPEC}:{found[1].old_start}\n") == \
        f"{SPEC}, hunk #2 ({found[1].header})"


# --- the shipped series -----------------------------------------------------------------------------


def test_shipped_series_loads_and_every_patch_matches_its_sha256():
    curated = series.load_series(REPO_ROOT / "patches")
    assert [c.id for c in curated.concerns] == ["embedding-skip", "zero-fill", "noise-block-base", "warning-downgrade"]
    assert curated.bases, "series.toml lists no bases"
    for name, info in curated.bases.items():
        assert re.fullmatch(r"[0-9a-f]{40}", info["blob"]), name
    patch_count = 0
    for number, concern in enumerate(curated.concerns, 1):
        assert concern.title and concern.rationale
        assert {"Origin", "Bug", "Forwarded"} <= set(concern.dep3), concern.id  # Applied-Upstream: where upstream has it
        for base, variant in concern.variants.items():
            assert base in curated.bases, f"{concern.id}: variant for undeclared base {base}"
            if variant.file is None:
                assert variant.status != "patch" and variant.note, f"{concern.id}/{base}: say why it needs no patch"
                continue
            path = series.verify_patch(curated, concern, variant)  # raises on a sha256 mismatch
            assert Path(variant.file).name == f"{number:04d}-{concern.id}.patch"
            text = path.read_text(encoding="utf-8")
            assert text.startswith("From " + "0" * 40), f"{variant.file}: not --zero-commit output"
            assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40}", text, re.M), f"{variant.file}: no full index"
            assert series.hunks(path), f"{variant.file}: no hunks"
            assert series.commit_message(path)
            patch_count += 1
    assert patch_count >= 4
