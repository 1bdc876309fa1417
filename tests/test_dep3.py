"""Every patch file carries true DEP-3 headers, and series.toml's copy agrees with them.

The headers live in the commit message of each format-patch file (Subject and
body are DEP-3's Description; Origin, Bug, Forwarded, Applied-Upstream and
Last-Update are trailers), so `git am`, Debian's tools and a reader see them.
"""

from __future__ import annotations

import email
import re

import pytest

from dfbuild import series

CURATED = series.load_series()
FIELDS = ("Origin", "Bug", "Forwarded", "Applied-Upstream", "Last-Update")
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


def test_applied_upstream_names_the_first_release_that_did_it():
    dep3 = {c.id: c.dep3 for c in CURATED.concerns}
    assert dep3["embedding-skip"]["Applied-Upstream"].startswith("b10901")
    assert dep3["noise-block-base"]["Applied-Upstream"].startswith("b10909")
    for concern in ("zero-fill", "warning-downgrade"):
        assert dep3[concern]["Applied-Upstream"] == "no"


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
