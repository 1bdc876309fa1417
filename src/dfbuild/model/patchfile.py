"""The series' patch files: where each lives, its sha256, its DEP-3 author and message, its hunks and paths,
and a failed `git apply` said in words (patch, file, hunk).
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dfbuild.core.errors import PatchIntegrityError, SeriesFileError
from dfbuild.core.paths import sha256_file
from dfbuild.model.series import Concern, Series, Variant

# --- patch files ------------------------------------------------------------------------


def patch_path(series: Series, variant: Variant) -> Path:
    return series.root / cast(str, variant.file)  # a variant with a patch file: the callers ask for no other


def verify_patch(series: Series, concern: Concern, variant: Variant) -> Path:
    path = patch_path(series, variant)
    if not path.is_file():
        raise PatchIntegrityError(f"patch {variant.file} for {concern.id} is missing",
                                  "restore patches/ from git")
    actual = sha256_file(path)
    if actual != variant.sha256:
        raise PatchIntegrityError(
            f"patch {variant.file} does not match its sha256 in series.toml (got {actual[:12]}, "
            f"want {cast(str, variant.sha256)[:12]}); refusing to apply anything",
            "restore the file from git, or run `dfbuild series refresh` if you changed it on purpose",
        )
    return path


def patch_author(patch: Path) -> tuple[tuple[str, str], str]:
    """A format-patch file's author (name, email) and Date, which the commit it becomes carries."""
    msg = email.message_from_bytes(patch.read_bytes(), policy=email.policy.compat32)
    name, address = email.utils.parseaddr(str(msg["From"] or ""))
    date = str(msg["Date"] or "").strip()
    if not address or "@" not in address or email.utils.parsedate_tz(date) is None:
        raise SeriesFileError(f"{patch.name} has no author or no Date: it is not git format-patch output",
                              "regenerate it with `dfbuild series refresh`")
    return (name or address, address), date


def commit_message(patch: Path) -> str:
    """Subject and body of a format-patch file, as `git am` would commit them."""
    msg = email.message_from_bytes(patch.read_bytes(), policy=email.policy.default)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(str(msg["Subject"] or "").split()))
    payload = msg.get_payload()
    body = payload.split("\n---\n", 1)[0].strip() if isinstance(payload, str) else ""
    if not subject:
        raise SeriesFileError(f"{patch.name} has no Subject: it is not git format-patch output",
                              "regenerate it with `dfbuild series refresh`")
    return f"{subject}\n\n{body}\n" if body else f"{subject}\n"


@dataclass
class Hunk:
    file: str
    number: int         # 1-based within its file
    header: str
    old_start: int


def hunks(patch: Path) -> list[Hunk]:
    found, current, number = [], None, 0
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("diff --git "):
            current, number = line.split(" b/", 1)[-1], 0
        elif line.startswith("@@ ") and current:
            number += 1
            old_start = int(cast(re.Match, re.match(r"@@ -(\d+)", line)).group(1))  # a hunk header
            found.append(Hunk(current, number, line.split(" @@")[0] + " @@", old_start))
    return found


def describe_failure(patch: Path, stderr: str) -> str:
    """Turn git apply's complaint into 'file, hunk #N (@@ ... @@)'."""
    corrupt = re.search(r"corrupt patch at line (\d+)", stderr)
    if corrupt:
        return f"corrupt patch at line {corrupt.group(1)}"
    failed = re.search(r"patch failed: (.+?):(\d+)", stderr)
    if failed:
        path, line = failed.group(1), int(failed.group(2))
        for h in hunks(patch):
            if h.file == path and h.old_start == line:
                return f"{path}, hunk #{h.number} ({h.header})"
        return f"{path}, hunk at line {line}"
    missing = re.search(r"error: (.+?): (No such file or directory|does not exist in index)", stderr)
    if missing:
        return f"{missing.group(1)} does not exist in the tree"
    return (stderr.strip().splitlines() or ["git apply failed"])[-1]


def patch_paths(patch: Path) -> list[str]:
    """Every path a patch file touches (both sides of each `diff --git a/X b/Y`)."""
    found: list[str] = []
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        match = re.match(r"^diff --git a/(.+) b/(.+)$", line)
        if match:
            found.extend(p for p in match.groups() if p not in found)
    return found


def patch_post_images(patch: Path) -> dict[str, list[str]]:
    """Per file, the (abbreviated) blob ids a patch leaves, from its `index OLD..NEW` lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in patch.read_text(encoding="utf-8", errors="replace").splitlines():
        match = re.match(r"^diff --git a/(.+) b/(.+)$", line)
        if match:
            current = match.group(2)
            continue
        match = re.match(r"^index [0-9a-f]+\.\.([0-9a-f]{7,})", line)
        if match and current and set(match.group(1)) != {"0"}:
            found.setdefault(current, []).append(match.group(1))
    return found
