"""The words of `dfbuild series export --upstream`: what it says to llama.cpp's maintainers.

The squashed fix's commit message (llama.cpp's `spec : ...` subject, when the bug happens, what
changes, the base it was written against), the test commit's message, the upstream server test
dfbuild ships (its own code, MIT) with the PyYAML its requirements lack, and PR.md: the tree's pull
request template with Overview and Additional information filled, the AI usage disclosure left to
the submitter. The patches' own descriptions are not copied: they describe one variant against its
epoch's code; upstream gets one commit. export.py makes the commits and writes the files.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from importlib import resources
from pathlib import Path

from dfbuild import series as series_mod
from dfbuild.source import gitfetch

FIX_SUBJECT = "spec : fix DFlash draft KV positions after multimodal chunks"
TEST_SUBJECT = "server : test DFlash with a plain-rope draft after an M-RoPE image"
TEST_NAME = "test_speculative_mtmd.py"
TEST_PATH = f"tools/server/tests/unit/{TEST_NAME}"
REQUIREMENTS = "tools/server/tests/requirements.txt"
# gguf-py imports yaml (gguf/metadata.py), which the server tests' requirements do not bring
YAML_REQUIREMENT = "PyYAML~=6.0"
# the DEP-3 fields and dfbuild's own trailers: a patch file's bookkeeping, not upstream's commit message
_BOOKKEEPING = re.compile(r"^(Origin|Bug(-[\w-]+)?|Forwarded|Applied-Upstream|Last-Update|Author|From|Description|"
                          r"Reviewed-by|Acked-by|Dfbuild-[\w-]+):", re.IGNORECASE)
# From b10662 llama.cpp loads a DFlash draft that has rope sections as M-RoPE (llama_model_rope_type) and
# DFlash's process() knows it (is_mrope); before, every DFlash draft runs plain rope whatever its GGUF says
# (docs/drafts.md; the smoke's mrope-draft scenario starts there too)
SECTIONS_KEY = "dflash.rope.dimension_sections"
DRAFT_SECTIONS_READ_FROM = 10662
# When the bug happens: the one statement the fix commit and PR.md both make (true at every base the series
# serves: before b10662 every DFlash draft runs plain rope; an image's rows sit on one position whether
# process() skips them or stacks them). No release is named: the commit message names only its base, and
# PR.md's converter note names the release for the base exported.
WHEN = ("DFlash speculative decoding fails when the draft has no rope sections (a plain-rope draft: a DFlash "
        f"GGUF without `{SECTIONS_KEY}`, or any DFlash draft in a llama.cpp that does not read that key yet), "
        "the target uses M-RoPE, and an image follows other text in the prompt. "
        "mtmd puts all rows of such an image on one position, so the draft KV cache ends "
        "behind the position where the text after the image starts. A plain-rope draft only takes a batch that "
        "continues its last position (Y = X + 1): the next draft batch fails with `inconsistent sequence "
        "positions`, `llama_decode(ctx_dft)` fails and llama-server answers HTTP 500.")


# --- messages --------------------------------------------------------------------------------


def upstream_message(patch: Path) -> tuple[str, str]:
    """(subject, body) of a patch's commit message without its DEP-3 fields and dfbuild trailers."""
    message = series_mod.commit_message(patch)
    subject, _, body = message.partition("\n")
    kept = [line for line in body.strip().splitlines() if not _BOOKKEEPING.match(line)]
    return subject.strip(), "\n".join(kept).strip()


def origin_urls(patch: Path) -> list[str]:
    """URLs in a patch's Origin field (where the approach comes from)."""
    found = []
    for line in series_mod.commit_message(patch).splitlines():
        if line.lower().startswith("origin:"):
            found += [u.rstrip(".,;)") for u in re.findall(r"https?://\S+", line)]
    return found


def _strip_area(subject: str) -> str:
    """'spec : DFlash mirrors ...' -> 'DFlash mirrors ...' (the area prefix of llama.cpp's subjects)."""
    return re.sub(r"^[\w/.-]+ : ", "", subject)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 72, break_long_words=False, break_on_hyphens=False)


def fix_message(applied: list[dict], bug: str, base: str) -> str:
    """The squashed commit: llama.cpp's subject, when it fails, what changes, the base it was written against.

    The patches' own descriptions are not copied: they describe one variant against its epoch's code and
    refer to each other ("the previous patch"); upstream gets one commit."""
    parts = [FIX_SUBJECT, "", *_wrap(WHEN), "", "Changes:", ""]
    for entry in applied:
        parts += _wrap("- " + _strip_area(entry["subject"]).rstrip(".") + ".")
    urls = [u for entry in applied for u in entry["origin_urls"]]
    parts += ["", *_wrap(f"Written against llama.cpp {base}.")]
    if urls:
        parts += ["", *_wrap("The approach follows " + ", ".join(dict.fromkeys(urls)) + ".")]
    if bug:
        parts += ["", f"Fixes: {bug}"]
    return "\n".join(parts).strip() + "\n"


def test_message(requirements: bool = True) -> str:
    """The test commit's message; REQUIREMENTS: whether it adds PyYAML to the test requirements."""
    parts = [TEST_SUBJECT, "",
             *_wrap("The test writes a tiny M-RoPE target, a qwen2vl_merger projector and a DFlash draft "
                    "without rope sections with gguf-py, so it downloads nothing. A /completion request with "
                    "text before and after an image must answer 200, draft tokens and give the tokens of the "
                    "same request without the draft; a second question about the same image must reuse the "
                    "cached prompt and draft again."),
             "",
             *_wrap("It is a file of its own beside test_speculative.py, whose module fixture starts every "
                    "test with a stories15M server and a downloaded draft-simple model.")]
    if requirements:
        parts += ["", *_wrap("gguf-py imports yaml, so the test requirements gain PyYAML.")]
    return "\n".join(parts) + "\n"


# --- the test file ---------------------------------------------------------------------------


def test_source() -> str:
    """The upstream server test dfbuild ships (its own code, MIT), byte for byte."""
    return resources.files("dfbuild.data").joinpath("upstream").joinpath(TEST_NAME).read_text(encoding="utf-8")


def requirements_with_yaml(text: str) -> str | None:
    """REQUIREMENTS' text with PyYAML added (after numpy, else at the end), or None when it has it already."""
    if re.search(r"^\s*pyyaml\b", text, re.IGNORECASE | re.MULTILINE):
        return None
    lines = text.splitlines()
    at = next((i + 1 for i, line in enumerate(lines) if re.match(r"\s*numpy\b", line, re.IGNORECASE)), len(lines))
    lines.insert(at, YAML_REQUIREMENT)
    return "\n".join(lines) + "\n"


# --- PR.md -----------------------------------------------------------------------------------

# The template asks an AI agent to remind the user of this; dfbuild says it on stderr and in PR.md
SUBMITTER_NOTE = ("dfbuild wrote this text from its records. llama.cpp's CONTRIBUTING.md and AGENTS.md ask "
                  "that you understand every line you submit, write the PR description in your own words, "
                  "and fill in the AI usage disclosure yourself; you are responsible for the change.")
# Where the measurement of which drafts the converter writes as plain-rope goes (issue 37) when the base's
# own converter is not in bench/convert_drafts.json: PR.md says nothing about it and marks the place
CONVERTER_SLOT = ("<!-- dfbuild: slot for the converter figures (issue 37): which DFlash drafts this base's "
                  "convert_hf_to_gguf.py writes without rope sections, and whether reconverting avoids the bug. "
                  "Not measured yet: fill it in or delete this comment. -->")


def _where_sections(config: dict) -> str:
    """Where a target's config.json names its M-RoPE sections, in the text_config the converter reads."""
    text = config.get("text_config", config)
    params, scaling = text.get("rope_parameters"), text.get("rope_scaling")
    if isinstance(params, dict) and "mrope_section" in params:
        return "`rope_parameters.mrope_section`"
    if isinstance(scaling, dict) and "mrope_section" in scaling:
        return ("`rope_parameters` without it, `rope_scaling.mrope_section`" if params
                else "`rope_scaling.mrope_section`")
    return "no `mrope_section`"


def converter_note(base: str, record: dict | None) -> list[str] | None:
    """PR.md's lines on which drafts hit the bug at BASE (issue 37): what BASE's own convert_hf_to_gguf.py
    wrote for a tiny DFlash draft against each target config of RECORD (bench/convert_drafts.py, the GGUFs
    read back), and whether reconverting avoids the bug there. None where BASE's converter is not in RECORD:
    another release's converter may read a target's config otherwise, so nothing is carried over."""
    release = gitfetch.release_build(base)
    everything = [r for r in (record or {}).get("rows") or [] if isinstance(r, dict)]
    found = (record or {}).get("targets")
    targets: dict = found if isinstance(found, dict) else {}
    rows = [r for r in everything if r.get("base") == base]
    if release is None or not rows or not all(r.get("converted") and r.get("target") in targets for r in rows):
        return None
    lines = [f"Which DFlash drafts hit this at {base}: a tiny DFlash checkpoint converted by {base}'s own "
             "`convert_hf_to_gguf.py` with `--target-model-dir` a tiny Qwen3.5 or Qwen3-VL target whose "
             "`config.json` names its M-RoPE sections as each row says, the GGUF read back with `gguf-py`:", "",
             "| the target's `text_config` | the draft converted |", "| --- | --- |"]
    for row in rows:
        written = f"`{SECTIONS_KEY} = {row['sections']}`" if row.get("sections") else "no rope sections (plain rope)"
        lines.append(f"| {_where_sections(targets[row['target']])} | {written} |")
    lines.append("")
    if release < DRAFT_SECTIONS_READ_FROM:
        lines.append(f"At {base} llama.cpp does not read `{SECTIONS_KEY}` (it does from "
                     f"b{DRAFT_SECTIONS_READ_FROM}): every DFlash draft runs plain rope and hits this with an "
                     "M-RoPE target, and reconverting the draft does not avoid it.")
    elif not any(r.get("sections") for r in rows):
        lines.append(f"{base}'s converter wrote no rope sections for any of these targets: every draft it "
                     "converts is plain-rope and hits this, and reconverting with it does not avoid it.")
    else:
        # the newest converter measured before the first one that writes sections: drafts it made are plain
        made = [(gitfetch.release_build(r.get("base")), bool(r.get("sections"))) for r in everything]
        first_writer = min(b for b, sections in made if sections and b is not None)
        plain_up_to = max((b for b, _ in made if b is not None and b < first_writer), default=None)
        lines.append(f"A draft with `{SECTIONS_KEY}` runs M-RoPE at {base}: it may start a batch past its last "
                     "position and does not hit this. A plain-rope draft does: one converted against a target "
                     f"config without `mrope_section` where {base}'s converter reads it (rows above)"
                     + (f", or by b{plain_up_to}'s converter or an older one, which write no rope sections"
                        if plain_up_to else "") + ". "
                     f"For such a draft, reconverting it with {base}'s converter against a target config that names "
                     "`mrope_section` where the converter reads it (the rows with rope sections) is the alternative "
                     "to this PR; "
                     f"`gguf-dump DRAFT.gguf` (gguf-py) shows whether a draft has `{SECTIONS_KEY}`.")
    return lines


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def measured_for(measured: dict | None, *, base: str, fix_sha256: str | None) -> dict | None:
    """MEASURED when it was made with this export's test and fix at BASE, else None (its figures would be
    another change's). The record names the test's and the fix diff's sha256 (tests/test_export_real.py)."""
    if not measured:
        return None
    wanted = {"base": base, "test_sha256": digest(test_source()), "fix_sha256": fix_sha256}
    if any(measured.get(key) != value for key, value in wanted.items()) or fix_sha256 is None:
        return None
    if not all(isinstance(measured.get(name), dict) and measured[name].get("summary")
               for name in ("unpatched", "patched")):
        return None
    return measured


def pr_text(template: str | None, *, base: str, base_commit: str, applied: list[dict], bug: str,
            measured: dict | None, requirements: bool = True, made_on: dict | None = None,
            converter: dict | None = None) -> str:
    """PR.md: the tree's template with Overview and Additional information filled, Requirements left to the submitter.

    MEASURED: the new test's results with this export's test and fix (measured_for), or None: then PR.md
    reports no result. REQUIREMENTS: whether the test commit adds PyYAML to the test requirements.
    MADE_ON: for an export made without BASE's tree, what its variant was made on; PR.md then says first
    that nothing was applied to a BASE tree where it was prepared. CONVERTER: bench/convert_drafts.json's
    record, for which drafts BASE's own converter writes plain-rope (converter_note), or a marked slot."""
    overview = [WHEN, "", "This PR:", ""]
    overview += ["- " + _strip_area(e["subject"]) for e in applied]
    overview += [
        f"- adds `tools/server/tests/unit/{TEST_NAME}`: a tiny M-RoPE target, a qwen2vl_merger projector and a "
        "plain-rope DFlash draft, written with the tree's `gguf-py` at test time (no download). A request with "
        "text before and after an image must answer 200, draft tokens and give the tokens of the request "
        "without the draft; a second question about the same image must reuse the cached prompt "
        "(`timings.cache_n`) and draft again. It is a file beside `test_speculative.py`, whose module fixture "
        "starts each test with a stories15M server and a downloaded draft-simple model."
        + (" `PyYAML` joins the test requirements, because `gguf-py` imports it." if requirements else ""),
    ]
    if bug:
        overview += ["", f"Fixes {bug}"]
    info = [] if made_on is None else _without_tree_note(base, base_commit, made_on) + [""]
    run_it = ["```sh", "cmake -B build && cmake --build build --target llama-server",
              "cd tools/server/tests && pip install -r requirements.txt",
              f"LLAMA_SERVER_BIN_PATH=../../../build/bin/llama-server pytest -v unit/{TEST_NAME}", "```"]
    if measured:
        info += [f"The new test on {base}, without and with this PR:", "",
                 "| | without this PR | with this PR |", "| --- | --- | --- |",
                 f"| `pytest -v unit/{TEST_NAME}` | {measured['unpatched']['summary']} | "
                 f"{measured['patched']['summary']} |", ""]
        if measured.get("how"):
            info += [measured["how"], ""]
        info += ["To run it:", "", *run_it]
    else:
        info += [f"The new test's results on {base} are not recorded for this text: run it without and with "
                 "this PR and put them here.", "", *run_it]
    info += ["", *(converter_note(base, converter) or [CONVERTER_SLOT])]
    sections = {"Overview": "\n".join(overview), "Additional information": "\n".join(info)}
    if template is None:
        template = ("## Overview\n\n## Additional information\n\n## Requirements\n\n"
                    "- I have read and agree with the [contributing guidelines]"
                    "(https://github.com/ggml-org/llama.cpp/blob/master/CONTRIBUTING.md)\n"
                    "- AI usage disclosure: <!-- mention: YES / NO - if yes, describe how AI was used -->\n")
    return _leave_disclosure(_fill_template(template, sections))


def _leave_disclosure(text: str) -> str:
    """The disclosure line stays for the submitter, with a note saying so; the template's comment to AI
    agents goes (its reminder is SUBMITTER_NOTE, which the export also says on stderr)."""
    lines = []
    for line in text.splitlines():
        if re.match(r"^\s*<!--.*\bAI agent\b.*-->\s*$", line):
            continue
        lines.append(line)
        if re.match(r"^\s*- AI usage disclosure:", line):
            lines.append(f"<!-- dfbuild: left for you. {SUBMITTER_NOTE} -->")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def _without_tree_note(base: str, base_commit: str, made_on: dict) -> list[str]:
    """What a reader must know first about an export made without BASE's tree."""
    lines = [
        f"**Not applied to a {base} tree where this was prepared.** {base}'s tree"
        + (f" ({base_commit[:12]})" if base_commit else "") + " could not be fetched there (no network). "
        f"The fix commit is dfbuild's {base} variant squashed without the tree: the lines it changes and "
        "their context come from the variant's own patches",
    ]
    if made_on.get("blob"):
        lines[0] += (f", which were made on `common/speculative.cpp` blob {made_on['blob'][:12]} "
                     "(the index line names that blob)")
    lines[0] += (f". Nothing was built or run at {base} for this PR: `git am` on a clean {base} checkout "
                 "is expected to apply it, and the new test to fail before the fix commit and pass after "
                 f"it; neither was tried at {base}.")
    if made_on.get("note"):
        lines += ["", f"How the variant was made (dfbuild's series.toml): {made_on['note']}."]
    lines += ["", f"`{REQUIREMENTS}` is not changed: its text at {base} could not be read. `gguf-py` imports "
              f"`yaml`; if the file lacks it, add `{YAML_REQUIREMENT}` before running the new test."]
    return lines


def _fill_template(template: str, sections: dict[str, str]) -> str:
    """Each `## NAME` section of SECTIONS gets its text in place of the template's guidance comment."""
    out, current = [], None
    for line in template.splitlines():
        heading = re.match(r"^##\s+(.+?)\s*$", line)
        if heading:
            current = heading.group(1)
            out.append(line)
            if current in sections:
                out += ["", sections[current], ""]
            continue
        if current in sections and (not line.strip() or re.match(r"^\s*<!--.*-->\s*$", line)):
            continue  # the guidance comment and blank lines: replaced by the text above
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"
