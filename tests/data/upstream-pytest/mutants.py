"""Show that every assertion of the exported server test can fail: write one mutant of the test per assertion.

    python mutants.py TREE/tools/server/tests/unit/test_speculative_mtmd.py

writes test_speculative_mtmd_mutant_<name>.py beside it. Each mutant changes one request so that exactly one
assertion meets what it guards against; run them with upstream's pytest against the patched build: every mutant
must fail at the assertion its name says, and the unchanged test must pass. (The first drafted request's
`status_code == 200` fails on the unpatched build with the unchanged test: that is the bug.) Delete the mutants
afterwards; they are never part of an export.
"""

from __future__ import annotations

import sys
from pathlib import Path

# a second 2x2 PNG (other colours) and a payload that is no image; n_predict 1 leaves no room for a draft
OTHER_IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAD0lEQVR42mNgAIH/IAQkAA/+Av5EmZv7AAAAAElFTkSuQmCC"
NOT_AN_IMAGE = "bm90IGFuIGltYWdl"

# name: (occurrence of the request line it changes (0: no draft, 1: drafted, 2: the second question),
#        what runs before that request, the assertion that must fail)
MUTANTS = {
    "baseline_status": (0, f'globals()["IMAGE"] = "{NOT_AN_IMAGE}"', "assert res.status_code == 200"),
    "draft_n": (1, 'MUTANT_EXTRA["n_predict"] = 1', 'get("draft_n", 0) > 0'),
    "same_tokens": (1, f'globals()["IMAGE"] = "{OTHER_IMAGE}"', "== tokens_no_draft"),
    "second_status": (2, f'globals()["IMAGE"] = "{NOT_AN_IMAGE}"', "assert res.status_code == 200"),
    "prompt_cached": (2, 'MUTANT_EXTRA["cache_prompt"] = False', '["prompt_n"] <= n_question'),
    # the text before the image is reused, the image is not (b11434: cache_n 22 of 50, above the 6 tokens of
    # the text before it, so cache_n alone could not tell): the new tokens processed can
    "image_reused": (2, f'globals()["IMAGE"] = "{OTHER_IMAGE}"', '["prompt_n"] <= n_question'),
    "second_draft_n": (2, 'MUTANT_EXTRA["n_predict"] = 1', 'get("draft_n", 0) > 0'),
}
REQUESTS = ['    res = ask(" What is it?")\n', '    res = ask(" What is it?")\n', '    res = ask(" Why?")\n']


def mutant(source: str, occurrence: int, before: str) -> str:
    source = source.replace('"return_tokens": True,', '"return_tokens": True, **MUTANT_EXTRA,', 1)
    source = source.replace('"multimodal_data": [IMAGE]', '"multimodal_data": [globals()["IMAGE"]]', 1)
    source = source.replace("\nserver: ServerProcess\n", "\nserver: ServerProcess\nMUTANT_EXTRA: dict = {}\n", 1)
    at = -1
    for _ in range(occurrence + 1 if occurrence < 2 else 1):
        at = source.index(REQUESTS[occurrence], at + 1)
    return source[:at] + f"    {before}\n" + source[at:]


def main(test: Path) -> None:
    source = test.read_text(encoding="utf-8")
    for name, (occurrence, before, _) in MUTANTS.items():
        path = test.with_name(f"{test.stem}_mutant_{name}.py")
        path.write_text(mutant(source, occurrence, before), encoding="utf-8")
        print(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
