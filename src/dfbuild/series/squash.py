"""One diff from a chain of format-patch files, made without the tree they apply to.

A base like a PR head lives only on a git host; where that host cannot be
reached, the series' variant for it is all there is. Its patches still say what
they need: every context and removed line of a hunk is a line of the file before
that patch, at a stated position. From those lines the base file is rebuilt
sparsely: each line a hunk shows is known, each other line is a placeholder of
its own. git applies the patches to that sparse file at the same positions as to
the real one (no offset, no fuzz), and the diff of the two is the squashed diff:
its hunks hold known lines only (their context is context the patches showed).
Its index line is then the real one, from the patches' own full index lines:
the first patch's preimage blob and the last patch's postimage blob.

The sparse file is scratch: it is never written anywhere but a temp dir, and a
diff that would show a placeholder is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import pairwise

from dfbuild.core.errors import ExportError

# a line nobody writes in C++, Python or CMake: the sparse file's unknown lines
PLACEHOLDER = "@@ dfbuild: line {} of the base is not known here @@"
PLACEHOLDER_MARK = "@@ dfbuild: line "
# git's default funcname (the text after a hunk header's @@): a line starting with a letter, _ or $
_FUNCNAME = re.compile(r"^[A-Za-z_$]")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")
_INDEX = re.compile(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})(?: ([0-7]{6}))?$")

# a line of the sparse file as the patches move it: the base's line number N, or the text a patch added
Line = int | str


@dataclass
class Hunk:
    old_start: int
    old_len: int
    section: str
    lines: list[str] = field(default_factory=list)  # ' text', '-text', '+text'


@dataclass
class FileDiff:
    path: str
    old_blob: str
    new_blob: str
    mode: str
    hunks: list[Hunk] = field(default_factory=list)


def parse(text: str, name: str) -> list[FileDiff]:
    """The file diffs of one format-patch file (modified files with full index lines only)."""
    diffs: list[FileDiff] = []
    current: FileDiff | None = None
    hunk: Hunk | None = None
    left_old = left_new = 0  # lines the current hunk still holds, as its header counts them
    for line in text.split("\n"):
        if hunk is not None and (left_old or left_new):
            tag = line[:1]
            if tag not in (" ", "-", "+"):
                raise ExportError(f"{name}: a hunk of {current.path if current else 'a file'} is shorter than its "
                                  "header says", None)
            hunk.lines.append(line)
            left_old -= tag in (" ", "-")
            left_new -= tag in (" ", "+")
            continue
        if line.startswith("\\"):
            raise ExportError(f"{name}: {current.path if current else 'a file'} ends without a newline; it "
                              "cannot be squashed without the base's tree", "pass --repo with the base's tree")
        if line.startswith("diff --git "):
            current, hunk = FileDiff(line.split(" b/", 1)[-1], "", "", ""), None
            diffs.append(current)
        elif current is None:
            continue
        elif line.startswith("@@ "):
            match = _HUNK.match(line)
            if not match:
                raise ExportError(f"{name}: unreadable hunk header {line!r}", None)
            left_old, left_new = int(match.group(2) or 1), int(match.group(4) or 1)
            hunk = Hunk(int(match.group(1)), left_old, match.group(5))
            current.hunks.append(hunk)
        elif line.startswith("index ") and hunk is None:
            match = _INDEX.match(line)
            if not match:
                raise ExportError(f"{name}: {current.path} has no full index line (or changes its mode)",
                                  "regenerate the variant with `dfbuild series refresh` (full index lines)")
            current.old_blob, current.new_blob, current.mode = match.group(1), match.group(2), match.group(3) or ""
        elif line.startswith(("new file", "deleted file", "rename ", "copy ", "old mode", "Binary files")):
            raise ExportError(f"{name}: {current.path} is not a plain change of an existing file; it cannot "
                              "be squashed without the base's tree", "pass --repo with the base's tree")
    if hunk is not None and (left_old or left_new):
        raise ExportError(f"{name}: its last hunk is shorter than its header says", None)
    for diff in diffs:
        if not diff.old_blob or not diff.mode:
            raise ExportError(f"{name}: {diff.path} has no full index line",
                              "regenerate the variant with `dfbuild series refresh` (full index lines)")
    return diffs


def _apply(cur: list[Line], diff: FileDiff, name: str, known: dict[int, str]) -> list[Line]:
    """CUR after DIFF's hunks; learns the base lines they show (KNOWN: base line number -> text)."""
    out: list[Line] = []
    at = 0  # index into cur of the next preimage line not yet copied
    for h in diff.hunks:
        start = h.old_start if h.old_len == 0 else h.old_start - 1
        if start < at:
            raise ExportError(f"{name}: hunks of {diff.path} overlap or are out of order", None)
        out += cur[at:start]
        at = start
        for line in h.lines:
            tag, text = line[:1], line[1:]
            if tag == "+":
                out.append(text)
                continue
            if at >= len(cur):
                raise ExportError(f"{name}: a hunk of {diff.path} runs past the lines it can know", None)
            entry = cur[at]
            if isinstance(entry, int):  # a line of the base: the hunk shows it
                if known.setdefault(entry, text) != text:
                    raise ExportError(f"{name}: {diff.path} line {entry} reads differently in two patches; "
                                      "the variant's patches do not chain", "pass --repo with the base's tree")
            elif entry != text:
                raise ExportError(f"{name}: a hunk of {diff.path} does not match what the previous patch left",
                                  "the variant's patches do not chain; pass --repo with the base's tree")
            if tag == " ":
                out.append(entry)
            at += 1
    return out + cur[at:]


def sparse_base(chain: list[tuple[str, FileDiff]]) -> tuple[str, str, str, str]:
    """(text, first preimage blob, last postimage blob, mode) of the sparse base file CHAIN's diffs apply to.

    CHAIN: (patch name, its diff of one path), in the order the patches apply."""
    for (_, before), (name, diff) in pairwise(chain):
        if diff.old_blob != before.new_blob:
            raise ExportError(f"{name}: {diff.path} starts from blob {diff.old_blob[:12]}, but the patch before "
                              f"leaves {before.new_blob[:12]}; the variant's patches do not chain", None)
    size = 1 + sum(max((h.old_start + h.old_len for h in d.hunks), default=0)
                   + sum(line.startswith("+") for h in d.hunks for line in h.lines) for _, d in chain)
    known: dict[int, str] = {}
    cur: list[Line] = list(range(1, size + 1))
    snapshots = []
    for name, diff in chain:
        snapshots.append(cur)
        cur = _apply(cur, diff, name, known)
    # a hunk header's function context comes from the nearest line above it that starts a function;
    # where that line is not known, the hunk's own header names it: it goes into the gap above
    hints: dict[int, str] = {}
    for preimage, (_, diff) in zip(snapshots, chain, strict=True):
        for h in diff.hunks:
            if not h.section:
                continue
            at = (h.old_start if h.old_len == 0 else h.old_start - 1) - 1
            while at >= 0:
                entry = preimage[at]
                if isinstance(entry, int) and entry not in known:
                    hints.setdefault(entry, h.section)
                    break
                if _FUNCNAME.match(entry if isinstance(entry, str) else known[entry]):
                    break
                at -= 1
    last = max(known, default=0)
    lines = [known.get(n, hints.get(n, PLACEHOLDER.format(n))) for n in range(1, last + 2)]
    first, final = chain[0][1], chain[-1][1]
    return "\n".join(lines) + "\n", first.old_blob, final.new_blob, first.mode


def real_index_lines(patch_text: str, blobs: dict[str, tuple[str, str]]) -> str:
    """PATCH_TEXT (format-patch of the sparse files) with each path's index line naming the real blobs."""
    out, path = [], None
    for line in patch_text.split("\n"):
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1]
        elif path in blobs and (index := _INDEX.match(line)):
            mode = index.group(3)
            old, new = blobs[path]
            line = f"index {old}..{new}" + (f" {mode}" if mode else "")
            path = None
        out.append(line)
    text = "\n".join(out)
    if PLACEHOLDER_MARK in text:
        raise ExportError("the squashed fix would show a line of the base that no patch of the variant shows; "
                          "it cannot be made without the base's tree", "pass --repo with the base's tree")
    return text
