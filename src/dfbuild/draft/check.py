"""`dfbuild draft check`: does a DFlash draft and its target hit llama.cpp #27408, on which releases, and
what is the way out. Metadata only (draft.header reads the two headers; no tensor byte is read).

What decides it, read from llama.cpp's code (docs/drafts.md has the tables):
- the target: image rows of an M-RoPE target (`llama_model_rope_type` answers MROPE or IMROPE) share a
  position, so the text after an image resumes further on and leaves a hole in the draft's cache;
- the draft: a plain-rope (NeoX) draft cache takes a batch only where it continues its last position, so
  it fails on that hole (HTTP 500); a draft with `dflash.rope.dimension_sections` is an M-RoPE draft, which
  may jump (X < Y), but only on a llama-server whose loader reads the key: b10662 and later
  (`case LLM_ARCH_DFLASH` in `src/llama-model.cpp`); b9837 to b10644 give every DFlash draft plain rope.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from dfbuild.core import errors
from dfbuild.draft.header import Header, read_header

DRAFT_ARCH = "dflash"
SECTIONS_KEY = "dflash.rope.dimension_sections"
FIRST_DFLASH_RELEASE = 9837  # the first llama.cpp release with DFlash (PR #27342)
LAST_LOADER_WITHOUT_SECTIONS = 10644  # its loader ignores dflash.rope.dimension_sections
FIRST_LOADER_WITH_SECTIONS = 10662  # the first release whose loader makes such a draft M-RoPE

# b11434's llama_model_rope_type: these architectures are always M-RoPE (MROPE or IMROPE)...
ALWAYS_MROPE = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "clef",
                          "qwen4exp", "qwen3tts"})
# ...these only when their rope sections say so (hparams.use_mrope(): sections[0] > 0 and sections[1] > 0)
MROPE_BY_SECTIONS = frozenset({"glm4", "glm4moe", "hunyuan_vl", "bailingmoe3"})
# what a target must not be: a projector, or a draft
NOT_TARGETS = {"clip": "a multimodal projector (mmproj)", DRAFT_ARCH: "a DFlash draft"}


@dataclass(frozen=True)
class Check:
    draft: str
    target: str
    draft_arch: str
    draft_rope: str  # "plain" | "sections"
    draft_sections: list[int] | None
    draft_head_dim: int
    target_arch: str
    target_mrope: bool
    affected: bool  # an unpatched llama-server of b10662 or later fails this pair's image requests
    affected_releases: str  # the unpatched releases that fail it, in words ("b9837 to b10644", "none")
    affected_from: int | None
    affected_to: int | None  # None with affected_from set: every release from affected_from on
    fixable: bool  # `dfbuild draft fix` gives a draft that works unpatched from b10662 on
    way_out: str

    def to_dict(self) -> dict:
        return asdict(self)


def _sections(header: Header, key: str) -> list[int] | None:
    value = header.get(key)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


def draft_head_dim(header: Header) -> int:
    """The draft's head width, as the converter reckons it (`head_dim`, else hidden_size / heads)."""
    key_length = header.get(f"{DRAFT_ARCH}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0:
        return key_length
    embd, heads = header.get(f"{DRAFT_ARCH}.embedding_length"), header.get(f"{DRAFT_ARCH}.attention.head_count")
    if isinstance(embd, int) and isinstance(heads, int) and heads > 0:
        return embd // heads
    raise errors.DraftDamagedError(
        f"{header.path} names no head width ({DRAFT_ARCH}.attention.key_length, or embedding_length and "
        "attention.head_count)", "llama.cpp would refuse it too: convert the draft again")


def target_is_mrope(header: Header) -> bool:
    arch = header.arch or ""
    if arch in ALWAYS_MROPE:
        return True
    if arch in MROPE_BY_SECTIONS:
        sections = _sections(header, f"{arch}.rope.dimension_sections") or []
        return len(sections) >= 2 and sections[0] > 0 and sections[1] > 0
    return False


def read_draft(path: Path) -> Header:
    header = read_header(path)
    if header.arch != DRAFT_ARCH:
        hint = "name the DFlash draft (the file llama-server's -md loads) first, then --target"
        if header.arch in ALWAYS_MROPE | MROPE_BY_SECTIONS:
            hint = "this looks like a target model: pass the DFlash draft as DRAFT and this file as --target"
        raise errors.NotDraftError(f"{path} is not a DFlash draft: its architecture is {header.arch or 'not named'!r}, "
                                   f"not {DRAFT_ARCH!r}", hint)
    return header


def read_target(path: Path) -> Header:
    header = read_header(path)
    what = NOT_TARGETS.get(header.arch or "")
    if what is not None:
        raise errors.NotDraftError(f"--target {path} is {what}, not the target model",
                                   "pass the model llama-server's -m loads as --target")
    if header.arch is None:
        raise errors.NotDraftError(f"--target {path} names no general.architecture", "pass the model -m loads")
    return header


def draft_rope(header: Header) -> tuple[str, list[int] | None]:
    """("sections", them) when the draft carries rope sections llama.cpp reads as M-RoPE, else ("plain", ...)."""
    sections = _sections(header, SECTIONS_KEY)
    # the loader's own test: any non-zero section makes the draft M-RoPE (all zeros is plain rope)
    return ("sections" if sections and any(sections[:4]) else "plain"), sections


def check_pair(draft_path: Path, target_path: Path) -> Check:
    draft, target = read_draft(draft_path), read_target(target_path)
    return judge(draft, target)


def judge(draft: Header, target: Header) -> Check:
    rope, sections = draft_rope(draft)
    mrope = target_is_mrope(target)
    first, last = f"b{FIRST_DFLASH_RELEASE}", f"b{LAST_LOADER_WITHOUT_SECTIONS}"
    fixed_from = f"b{FIRST_LOADER_WITH_SECTIONS}"
    span: tuple[int | None, int | None]
    if not mrope:
        affected, span = False, (None, None)
        way_out = ("nothing to do for images: a target without M-RoPE gives image rows one position each, so no "
                   "hole opens (a slot restored from a file still leaves one in a plain-rope draft's cache: only "
                   "dfbuild's patched build fills it)")
    elif rope == "plain":
        affected, span = True, (FIRST_DFLASH_RELEASE, None)
        way_out = (f"`dfbuild draft fix` adds the rope sections, and the fixed draft works on an unpatched "
                   f"llama-server from {fixed_from} on; for {first} to {last} (whose loader ignores them) use "
                   "dfbuild's patched build")
    else:
        affected, span = False, (FIRST_DFLASH_RELEASE, LAST_LOADER_WITHOUT_SECTIONS)
        way_out = (f"none needed on llama-server {fixed_from} or later (it reads the draft's rope sections); "
                   f"{first} to {last} ignore them: upgrade llama-server, or use dfbuild's patched build")
    if span[0] is None:
        releases = "none"
    elif span[1] is None:
        releases = f"b{span[0]} and later"
    else:
        releases = f"b{span[0]} to b{span[1]}"
    return Check(draft=str(draft.path), target=str(target.path), draft_arch=DRAFT_ARCH, draft_rope=rope,
                 draft_sections=sections, draft_head_dim=draft_head_dim(draft), target_arch=target.arch or "",
                 target_mrope=mrope, affected=affected, affected_releases=releases, affected_from=span[0],
                 affected_to=span[1], fixable=mrope and rope == "plain", way_out=way_out)


def describe(check: Check) -> list[str]:
    """The check in plain words, a line each (what `draft check` prints)."""
    rope = ("plain rope (no dflash.rope.dimension_sections)" if check.draft_rope == "plain"
            else f"M-RoPE sections {check.draft_sections}")
    target = "M-RoPE" if check.target_mrope else "linear rope (not M-RoPE)"
    if check.affected:
        verdict = (f"affected: image requests fail on unpatched llama-server {check.affected_releases} "
                   "(HTTP 500, llama.cpp #27408)")
    elif check.affected_from is not None:
        verdict = (f"not affected on llama-server b{FIRST_LOADER_WITH_SECTIONS} and later; affected on "
                   f"{check.affected_releases} (their loader ignores the sections)")
    else:
        verdict = "not affected: image requests do not hit llama.cpp #27408"
    return [f"draft:  {check.draft}: {rope}, head_dim {check.draft_head_dim}",
            f"target: {check.target}: {check.target_arch}, {target}",
            verdict, f"way out: {check.way_out}"]
