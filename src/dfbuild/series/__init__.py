"""The series stage: the curated DFlash fixes, applied safely; the stage's public names, in one place.

patches/series.toml is the single source of truth: the concerns in order, each
with its rationale, DEP-3 fields and one patch file per base. A base is
recognised by content (the git blob id of common/speculative.cpp), so a clone,
an sdist import and a tarball of the same code all pick the same variant.

The series is data first, and every job is a function of it, one module each:
- dfbuild.model (below source): series.toml read, validated and typed, and the patch files
- check: which base a tree is, and a known base's trial of each concern (Step)
- carry: the series carried to a base no variant was made for
- apply: plan (known or carried) and apply, all or nothing, one commit per concern
- adopt: commits and proofs back into series.toml (refresh, adopt); curate: the curator's loop
- proof_record, epochs, bases, squash: proofs in series.toml, the epochs, `dfbuild bases`, a variant squashed
Takes a checked-out tree; hands on the patched tree and the manifest's `series` section.

Callers and tests use these names through `dfbuild.series`. Its modules `carry` and `adopt` keep their
names: call `carry.carry()` and `adopt.adopt()` through them (a function of the same name here would hide
the module).
"""

from __future__ import annotations

from dfbuild.model.patchfile import (
    Hunk,
    commit_message,
    describe_failure,
    hunks,
    patch_author,
    patch_path,
    patch_paths,
    patch_post_images,
    verify_patch,
)
from dfbuild.model.series import (
    CONCERN_TRAILER,
    DECISIONS,
    SERIES_ENV,
    SPECULATIVE,
    VARIANT_STATUSES,
    Concern,
    Epoch,
    Series,
    Variant,
    base_build,
    carried_from,
    default_patches_dir,
    describe_proof,
    digest_without_proofs,
    load_series,
)
from dfbuild.series.adopt import refresh
from dfbuild.series.apply import apply_series, plan, released_form
from dfbuild.series.carry import has_dflash, history_distance, nearest_bases, tree_build
from dfbuild.series.check import CARRIED, CONCERN_COMMITTERS, MAX_HISTORY, Step, check_skip, identify_base, series_start

__all__ = [
    "CARRIED", "CONCERN_COMMITTERS", "CONCERN_TRAILER", "DECISIONS", "MAX_HISTORY", "SERIES_ENV", "SPECULATIVE",
    "VARIANT_STATUSES", "Concern", "Epoch", "Hunk", "Series", "Step", "Variant", "apply_series",
    "base_build", "carried_from", "check_skip", "commit_message", "default_patches_dir", "describe_failure",
    "describe_proof", "digest_without_proofs", "has_dflash", "history_distance", "hunks", "identify_base",
    "load_series", "nearest_bases", "patch_author", "patch_path", "patch_paths", "patch_post_images", "plan",
    "refresh", "released_form", "series_start", "tree_build", "verify_patch",
]
