"""draft check and draft fix: a DFlash draft and its target, read (metadata only) and, where that is the way
out of llama.cpp #27408, the draft copied with the rope sections an M-RoPE target's draft carries."""

from __future__ import annotations

from pathlib import Path

import click

from dfbuild.cli.app import main
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import json_option_for
from dfbuild.core import ui

_draft_argument = click.argument("draft", type=click.Path(path_type=Path, dir_okay=True))
_target_option = click.option("--target", "target", type=click.Path(path_type=Path), required=True,
                              help="The target model llama-server's -m loads beside the draft (-md).")


@main.group("draft")
def draft_group():
    """A DFlash draft and its target: does the pair hit llama.cpp #27408, and a fixed copy of the draft."""


@draft_group.command("check")
@_draft_argument
@_target_option
@json_option_for("the verdict: draft_rope, target_mrope, affected, affected_releases, way_out, ...")
@handle_errors
def draft_check(draft, target, as_json):
    """Say whether DRAFT with --target TARGET fails image requests (llama.cpp #27408), on which llama.cpp
    releases, and the way out. Reads only the two files' metadata."""
    from dfbuild.draft import check as check_stage

    check = check_stage.check_pair(draft, target)
    if as_json:
        ui.emit_json(check.to_dict())
        return
    for line in check_stage.describe(check):
        ui.result(line, soft_wrap=True, markup=False)
    if check.fixable:
        ui.next_step(f"dfbuild draft fix {draft} --target {target} --out FIXED.gguf")


@draft_group.command("fix")
@_draft_argument
@_target_option
@click.option("--out", "out", type=click.Path(path_type=Path), required=True,
              help="Where to write the fixed copy (DRAFT itself is never changed).")
@click.option("--force", is_flag=True, help="Replace --out when it exists.")
@json_option_for("what was written: out, changed, sections, bytes, tensors, verified, before, after")
@handle_errors
def draft_fix(draft, target, out, force, as_json):
    """Write a copy of DRAFT with dflash.rope.dimension_sections = [head_dim/2, 0, 0, 0], as llama.cpp's
    converter writes it for an M-RoPE target: llama-server b10662 and later then load it as an M-RoPE draft,
    which answers image requests unpatched. Every tensor and every other key is kept byte for byte; the copy
    is streamed, read back and hash-checked before it is renamed into place."""
    from dfbuild.draft import fix as fix_stage

    result = fix_stage.fix_draft(draft, target, out, force=force)
    if as_json:
        ui.emit_json(result)
        return
    if not result["changed"]:
        ui.result(f"{draft} already carries rope sections {result['sections']}: nothing to fix, nothing written",
                  soft_wrap=True, markup=False)
        return
    ui.info(f"read back {result['out']}: {result['tensors']} tensors hash equal to the draft's, every other key kept")
    after = result["after"]
    ui.result(f"wrote {result['out']}: {draft} with dflash.rope.dimension_sections = {result['sections']}, "
              f"{result['tensors']} tensors byte-identical", soft_wrap=True, markup=False)
    ui.result(f"now: {'affected' if after['affected'] else 'not affected'} on llama-server b10662 and later; "
              f"{after['affected_releases']} still fail (their loader ignores the sections)",
              soft_wrap=True, markup=False)
