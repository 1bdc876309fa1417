"""Errors to exit codes, in one place: every command runs inside handle_errors.

Each DfbuildError carries its documented exit code (see errors.py and docs/exit-codes.md);
everything below the CLI raises, never exits. A full disk or a read-only dir, a
name that is not UTF-8 and Ctrl-C get their codes here too.
"""

from __future__ import annotations

import functools
import signal
import sys

from .. import errors, ui
from .app import show_error


def _fail(exc: errors.DfbuildError, as_json: bool = False):
    # one JSON object on stdout: the command's own report when it printed one before failing, else the error
    show_error(exc.message, exc.hint, exc.exit_code, as_json=as_json and not ui.json_emitted)
    sys.exit(exc.exit_code)


def handle_errors(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        # from here on Ctrl-C is a KeyboardInterrupt that rolls back (before it, _entry exits 130 at once)
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread (a test's runner): nothing to replace there
            pass
        as_json = bool(kwargs.get("as_json"))  # a failure with --json is a JSON object on stdout too
        ui.json_emitted = False
        try:
            return func(*args, **kwargs)
        except errors.DfbuildError as exc:
            _fail(exc, as_json)
        except OSError as exc:
            # a full disk or a read-only dir is the user's to fix: its own code, never a traceback
            known = errors.from_os_error(exc)
            if known is None:
                raise
            _fail(known, as_json)
        except UnicodeError as exc:
            _fail(errors.UsageError(f"a path or name is not valid UTF-8 ({exc.reason})",
                                    "use names that are valid UTF-8"), as_json)
        except KeyboardInterrupt:
            # what was half done has been rolled back (or is recovered by the next run)
            ui.console.print("[red]interrupted[/red]: stopped (Ctrl-C); run the command again to finish",
                             soft_wrap=True)
            if as_json and not ui.json_emitted:
                ui.emit_json({"error": "interrupted", "code": errors.INTERRUPTED_EXIT_CODE,
                              "hint": "run the command again to finish"})
            sys.exit(errors.INTERRUPTED_EXIT_CODE)

    return wrapper


PROVE_EXIT = {"fixed": 0, "fixed-upstream": errors.FIXED_UPSTREAM_EXIT,
              "still-broken": errors.StillBrokenError.exit_code,
              "not-applicable": errors.NotApplicableError.exit_code,
              "conflict": errors.PatchConflictError.exit_code}
