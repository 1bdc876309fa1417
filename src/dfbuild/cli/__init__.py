"""The thin Click layer: parse options, call one stage, render its section.

One module per command group, each command a thin skin over its stage:
- checkout_cmds: checkout, import, apply
- series_cmds: series list/check/refresh/adopt/start/continue/record/record-proof/epochs
- release_cmds: build, webui, release, verify
- proof_cmds: fixtures, smoke, prove, track
- host_cmds: doctor, matrix
- cache_cmds: bases, cache (show, dir, clean)
- draft_cmds: draft check, draft fix
- image_cmds: image
app holds the `dfbuild` group, options the shared options, common the locks, dirs and
tables the commands share; exits maps every error
to its documented exit code (see errors.py and docs/exit-codes.md), in one place:
everything below this layer raises, never exits.
"""

from __future__ import annotations

from dfbuild.cli import (  # noqa: F401  (registers the commands)
    cache_cmds,
    checkout_cmds,
    draft_cmds,
    host_cmds,
    image_cmds,
    proof_cmds,
    release_cmds,
    series_cmds,
)
from dfbuild.cli.app import main
from dfbuild.cli.checkout_cmds import apply, checkout, import_
from dfbuild.cli.common import STATUS_STYLE, _default_dir_here, _locks, _render_concerns, _work_locks
from dfbuild.cli.exits import PROVE_EXIT, _fail, handle_errors
from dfbuild.cli.host_cmds import doctor, matrix
from dfbuild.cli.options import (
    BASE_HELP,
    SeriesHelpOption,
    _utf8_path,
    base_option,
    json_option,
    known_bases_text,
    no_wait_option,
    patches_option,
    proof_options,
    smoke_run_options,
    source_options,
    toolchain_options,
)
from dfbuild.cli.proof_cmds import OUTCOME_STYLE, fixtures, prove, smoke, track
from dfbuild.cli.release_cmds import build, release_cmd, verify
from dfbuild.cli.series_cmds import (
    dir_option,
    series_adopt,
    series_check,
    series_continue,
    series_epochs,
    series_group,
    series_list,
    series_record,
    series_record_proof,
    series_refresh,
    series_start,
)

__all__ = [
    "BASE_HELP", "OUTCOME_STYLE", "PROVE_EXIT", "STATUS_STYLE", "SeriesHelpOption", "_default_dir_here", "_fail",
    "_locks", "_render_concerns", "_utf8_path", "_work_locks", "apply", "base_option", "build",
    "checkout", "dir_option", "doctor", "fixtures", "handle_errors", "import_", "json_option", "known_bases_text",
    "main", "matrix", "no_wait_option", "patches_option", "proof_options", "prove", "release_cmd", "series_adopt",
    "series_check", "series_continue", "series_epochs", "series_group", "series_list", "series_record",
    "series_record_proof", "series_refresh", "series_start", "smoke", "smoke_run_options", "source_options",
    "toolchain_options", "track", "verify",
]
