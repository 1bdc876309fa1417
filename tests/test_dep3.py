"""Every patch file carries true DEP-3 headers, and series.toml's copy agrees with them.

The headers live in the commit message of each format-patch file (Subject and
body are DEP-3's Description; Origin, Bug, Forwarded, Applied-Upstream and
Last-Update are trailers), so `git am`, Debian's tools and a reader see them.
"""

from __future__ import annotations

import email
import email.utils
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from dfbuild import series
from dfbuild.source import checkout as source

CURATED = series.load_series()
# Applied-Upstream is there only where upstream has the change (DEP-3: a field to omit otherwise)
FIELDS = ("Origin", "Bug", "Forwarded", "Last-Update")
OPTIONAL = ("Applied-Upstream",)
REPO = Path(__file__).resolve().parents[1]
PATCHES = [(c, v) for c in CURATED.concerns for v in c.variants.values() if v.file]


def _message(path) -> tuple[email.message.Message, str, dict]:
    text = path.read_text(encoding="utf-8")
    head, _, _ = text.partition("\n---\n")
    msg = email.message_from_string(head)
    body = msg.get_payload()
    trailers = dict(re.findall(r"^([A-Z][A-Za-z-]+): (.+)$", body, re.M))
    return msg, body, trailers


@pytest.mark.parametrize("concern,variant", PATCHES, ids=lambda x: getattr(x, "file", None) or getattr(x, "id", ""))
def test_patch_file_has_the_dep3_fields_series_toml_records(concern, variant):
    msg, body, trailers = _message(series.patch_path(CURATED, variant))
    for field in FIELDS:
        assert trailers.get(field), f"{variant.file}: no {field}"
        assert trailers[field] == str(concern.dep3[field]), f"{variant.file}: {field} differs from series.toml"
    for field in OPTIONAL:
        assert trailers.get(field) == concern.dep3.get(field), f"{variant.file}: {field} differs from series.toml"
    assert trailers["Dfbuild-Concern"] == concern.id
    assert trailers["Dfbuild-Variant"] == variant.base
    # Last-Update is a real date, the one git format-patch stamped as the patch's Date
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", trailers["Last-Update"])
    day = int(trailers["Last-Update"][-2:])
    assert msg["Date"] and f" {day} " in msg["Date"] and trailers["Last-Update"][:4] in msg["Date"], variant.file
    assert "2000" not in msg["Date"], f"{variant.file}: placeholder date"


@pytest.mark.parametrize("concern,variant", PATCHES, ids=lambda x: getattr(x, "file", None) or getattr(x, "id", ""))
def test_a_message_names_only_its_own_base_and_patches(concern, variant):
    _, body, trailers = _message(series.patch_path(CURATED, variant))
    description = body.split("\n\nOrigin:")[0]
    named = set(re.findall(r"\bb\d{4,5}\b", description)) | set(re.findall(r"\b5ecbe1a\b", description))
    allowed = {variant.base}
    assert named <= allowed, f"{variant.file} names {sorted(named - allowed)}, not this variant's base"
    files = [c.variants[variant.base] for c in CURATED.concerns
             if variant.base in c.variants and c.variants[variant.base].file]
    position = [v.file for v in files].index(variant.file)
    if "previous patch" in description:
        assert position > 0, f"{variant.file} speaks of a previous patch, but it is this variant's first"
    if "next patch" in description:
        assert position < len(files) - 1, f"{variant.file} speaks of a next patch, but it is this variant's last"


def project_author() -> tuple[str, str]:
    authors = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["authors"]
    return authors[0]["name"], authors[0]["email"]


def test_the_project_author_is_the_one_pyproject_names():
    assert project_author() == (source.PROJECT_NAME, source.PROJECT_EMAIL)
    assert not source.PROJECT_EMAIL.endswith("@localhost")


@pytest.mark.parametrize("concern,variant", PATCHES, ids=lambda x: getattr(x, "file", None) or getattr(x, "id", ""))
def test_patch_file_is_authored_by_the_project_and_says_where_it_comes_from(concern, variant):
    """DEP-3 as Debian reads it: an author who is a person or a project at an address it owns (never
    a tool), an Origin with a URL, Applied-Upstream only as `bNNNN` (the first release with the
    change, then optionally a commit or a URL), and Forwarded that agrees with it."""
    path = series.patch_path(CURATED, variant)
    msg, _, trailers = _message(path)
    name, address = email.utils.parseaddr(msg["From"])
    assert (name, address) == project_author(), f"{variant.file}: From: {msg['From']}"
    assert (name, address) == series.patch_author(path)[0]
    assert "localhost" not in address and name.lower() != "dfbuild", f"{variant.file}: authored by a tool"
    assert re.fullmatch(r"(?:(?:upstream|backport|vendor|other), )?https://\S+", trailers["Origin"]), \
        f"{variant.file}: Origin {trailers['Origin']!r} has no URL"
    applied = trailers.get("Applied-Upstream")
    if applied is None:
        assert trailers["Forwarded"] == "no" or trailers["Forwarded"].startswith("https://"), variant.file
    else:
        assert re.fullmatch(r"b\d{4,5}(?:, (?:commit:[0-9a-f]{7,40}|https://\S+))?", applied), \
            f"{variant.file}: Applied-Upstream {applied!r} is not `bNNNN[, commit:SHA|, URL]`"
        assert trailers["Forwarded"] in ("not-needed", "yes") or trailers["Forwarded"].startswith("https://")


def test_applied_upstream_names_the_first_release_that_did_it():
    """bNNNN is the first release of the epoch from which series.toml records the concern as upstream."""
    for concern in CURATED.concerns:
        upstream = sorted(e.first for e in CURATED.epochs
                          if concern.variants.get(e.variant) and concern.variants[e.variant].status == "upstream"
                          and any(p.status == "patch" for b, p in concern.variants.items()
                                  if series.base_build(CURATED, b) and series.base_build(CURATED, b) < e.first))
        applied = concern.dep3.get("Applied-Upstream")
        if not upstream:
            assert applied is None, f"{concern.id}: Applied-Upstream {applied!r}, but no epoch has it upstream"
            continue
        assert applied and applied.split(",")[0] == f"b{upstream[0]}", (concern.id, applied)
        release_url = f"https://github.com/ggml-org/llama.cpp/releases/tag/b{upstream[0]}"
        assert applied in (f"b{upstream[0]}", f"b{upstream[0]}, {release_url}") or ", commit:" in applied


@pytest.mark.integration
def test_the_commits_apply_makes_carry_each_patch_author_and_date(tmp_path):
    """A real release: every commit `apply` makes is its patch's (author, Date), never 2000."""
    tree = tmp_path / "b11434"
    source.checkout("b11434", dest=tree)
    section = series.apply_series(CURATED, tree)
    made = [c for c in section["concerns"] if c["status"] == "applied"]
    assert made, section
    for entry in made:
        (name, address), date = series.patch_author(series.patch_path(CURATED, CURATED.concern(entry["id"]).variants[
            entry["variant"]]))
        log = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%an|%ae|%aD|%cn|%ce|%cD", entry["commit"]],
                             capture_output=True, text=True, check=True).stdout.strip().split("|")
        assert log[:2] == [name, address] == list(project_author()), entry["id"]
        assert log[3:5] == list(project_author()), entry["id"]
        assert email.utils.parsedate_to_datetime(log[2]) == email.utils.parsedate_to_datetime(date)
        assert email.utils.parsedate_to_datetime(log[5]) == email.utils.parsedate_to_datetime(date)
        assert not log[2].split()[3] == "2000" and not log[5].split()[3] == "2000", log


def test_no_embedding_skip_patch_skips_every_embedding_batch():
    """Upstream injects image rows from b10355 on; the patch leaves out only a position-pinned image."""
    for variant in CURATED.concern("embedding-skip").variants.values():
        if not variant.file:
            continue
        added = [line[1:] for line in series.patch_path(CURATED, variant).read_text().splitlines()
                 if line.startswith("+") and not line.startswith("+++")]
        code = "\n".join(added)
        assert "batch_in.embd != nullptr ||" not in code, variant.file
        assert "pos[" in code, f"{variant.file} does not look at the image rows' positions"
