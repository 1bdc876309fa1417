"""What a llama-server log says: the failure lines, zero-filled draft spans (and which warned), the draft's
candidates, begin()'s warnings, its tail."""

from __future__ import annotations

import hashlib
import re

# Lines that mean the speculative path broke, whatever the HTTP status said.
FAILURE_PATTERNS = {
    # llama_decode(ctx_dft) in DFlash v1 trees; llama_process(ctx_dft) from about b11400 on
    "draft decode failed": re.compile(r"llama_(decode|process)\(ctx_dft\) failed"),
    "inconsistent positions": re.compile(r"inconsistent sequence positions"),
    "mtmd chunk failed": re.compile(r"failed to (process|decode) mtmd chunk"),
    "speculative batch failed": re.compile(r"failed to process speculative batch"),
    "assertion": re.compile(r"GGML_ASSERT|GGML_ABORT"),
}


# zero-fill's log line, "zero-filling draft positions [a, b)" in every variant (after the SPC_* prefix,
# or a function name). Since issue 44 every fill is a warning ("..., which the draft never processed"):
# the series keeps no state to tell a left-out image from a restored prefix. (Issue 37's series logged a
# left-out image's span at debug level, "... of the image left out", and warned for any other hole.)
ZERO_FILL = re.compile(r"zero-filling draft positions \[(\d+), (\d+)\)")
ZERO_FILL_WARNED = re.compile(r"zero-filling draft positions \[(\d+), (\d+)\), which the draft never processed")


def zero_filled_spans(text: str) -> list[tuple[int, int]]:
    """Every draft-position span a server log says was mirrored as zero rows."""
    return [(int(a), int(b)) for a, b in ZERO_FILL.findall(text)]


def warned_fill_spans(text: str) -> list[tuple[int, int]]:
    """The spans a server log says were zero-filled with a warning (every fill of today's series)."""
    return [(int(a), int(b)) for a, b in ZERO_FILL_WARNED.findall(text)]


# the draft's candidates at -v, one line per candidate ("- seq_id 0, draft candidate   0, pos   1:     97
# ( 0.912) 'a'"), from draft() in every DFlash release: what a patched build drafts must be what the
# unpatched one drafted wherever that works (issue 37)
DRAFT_CANDIDATE = re.compile(r"draft candidate\s+\d+, pos\s+\d+:\s+-?\d+ \(\s*[-0-9.naif]+\)")


def draft_trace(text: str) -> dict:
    """The draft candidates a log shows (-v), as a count and a digest (the lines themselves stay in the log)."""
    lines = [m.group(0) for m in DRAFT_CANDIDATE.finditer(text)]
    return {"lines": len(lines), "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}


# begin()'s warning in DFlash's draft implementation, upstream's one wording from b9837 to b11434
# (LOG_WRN; no patch of the series touches it): the draft cache ends before the prompt does. Only
# at warning level, not the same words demoted to debug (a "D" line at -v): an optional timestamp,
# then "W " where the log shows levels.
BEGIN_WARNING = re.compile(r"^(?:[0-9.]+ )?(?:W )?begin: ctx_dft pos_max=(-?\d+) < N-1=(\d+) - "
                           r"process\(\) did not run on every prefill ubatch", re.MULTILINE)


def begin_warnings(text: str) -> list[tuple[int, int]]:
    """(draft pos_max, N-1) of every begin() warning a log prints at warning level."""
    return [(int(a), int(b)) for a, b in BEGIN_WARNING.findall(text)]


def scan_log(text: str) -> list[dict]:
    """Every failure line in a server log, with the pattern that caught it."""
    findings = []
    for number, line in enumerate(text.splitlines(), 1):
        for label, pattern in FAILURE_PATTERNS.items():
            if pattern.search(line):
                findings.append({"pattern": label, "line": number, "text": line.strip()[:400]})
                break
    return findings


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
