"""Errors to exit codes, in one place: every command runs inside handle_errors.

Each DfbuildError carries its documented exit code (see errors.py and docs/exit-codes.md);
everything below the CLI raises, never exits. A full disk or a read-only dir, a
name that is not UTF-8 and Ctrl-C get their codes here too.
"""

from __future__ import annotations

import functools
import re
import signal
import sys

from dfbuild.cli.app import show_error
from dfbuild.core import errors, ui


def _fail(exc: errors.DfbuildError, as_json: bool = False):
    # one JSON object on stdout: the command's own report when it printed one before failing, else the error
    show_error(exc.message, exc.hint, exc.exit_code, as_json=as_json and not ui.json_emitted)
    sys.exit(exc.exit_code)


def _terminated(signum, frame):
    raise errors.Terminated()


def handle_errors(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))  # a failure with --json is a JSON object on stdout too
        ui.json_emitted = False
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        try:
            # A Ctrl-C anywhere from here on, the failure reports below included, ends in the except clause
            # (exit 130), never in click's "Aborted!" with exit 1: _take_signals is itself inside this try.
            _take_signals()
            return _mapped(func, as_json, args, kwargs)
        except KeyboardInterrupt as exc:
            # what was half done has been rolled back (or is recovered by the next run)
            term = isinstance(exc, errors.Terminated)
            code = errors.TERMINATED_EXIT_CODE if term else errors.INTERRUPTED_EXIT_CODE
            ui.console.print(f"[red]interrupted[/red]: stopped ({'SIGTERM' if term else 'Ctrl-C'}); "
                             "run the command again to finish", soft_wrap=True)
            if as_json and not ui.json_emitted:
                ui.emit_json({"error": "terminated" if term else "interrupted", "code": code,
                              "hint": "run the command again to finish"})
            sys.exit(code)
        finally:
            _give_back_signals(before)

    return wrapper


def _take_signals() -> None:
    """From here on Ctrl-C is a KeyboardInterrupt that rolls back (before it, _entry exits 130 at once), and
    SIGTERM (`timeout`, systemd, a supervisor) the same, as errors.Terminated: exit 143."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread (a test's runner): nothing to replace there
        pass


def _give_back_signals(before) -> None:
    """The command's outcome is decided: the handlers it replaced again (_entry's, which exit at once; a
    KeyboardInterrupt in click's teardown would be its "Aborted!")."""
    try:
        signal.signal(signal.SIGINT, before[0] if before[0] is not None else signal.SIG_DFL)
        signal.signal(signal.SIGTERM, before[1] if before[1] is not None else signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass


def _mapped(func, as_json, args, kwargs):
    """Run the command; each failure dfbuild knows becomes its documented exit code."""
    try:
        return func(*args, **kwargs)
    except errors.DfbuildError as exc:
        _fail(exc, as_json)
    except OSError as exc:
        # a full disk or a read-only dir is the user's to fix: its own code, never a traceback
        known = errors.from_os_error(exc) or git_failure(exc)  # GitPython's NoSuchPathError is an OSError
        if known is None:
            raise
        _fail(known, as_json)
    except UnicodeError as exc:
        _fail(errors.UsageError(f"a path or name is not valid UTF-8 ({exc.reason})",
                                "use names that are valid UTF-8"), as_json)
    except Exception as exc:  # only git's own failures are mapped; anything else re-raises
        known = git_failure(exc)
        if known is None:
            raise
        _fail(known, as_json)


def git_failure(exc: BaseException) -> errors.RepositoryError | None:
    """The documented error (17) for git failing on a repository it cannot read (a corrupt index, a damaged
    cache repo), raised by git, GitPython or its config reader from anywhere below the CLI; None for the rest.

    Failures dfbuild expects (a patch that does not apply, a missing revision) are mapped where they happen;
    what reaches here is damage, whichever repository it is in: quote git, say how to repair or clear it."""
    import configparser

    from git import exc as git_exc  # GitPython's errors, gitdb's (ODBError) re-exported among them

    if isinstance(exc, git_exc.GitCommandError):  # gitrun's GitError is one
        # GitPython keeps git's stderr as "\n  stderr: '...'" (gitrun's GitError too): quote git, not the wrapper
        said = re.sub(r"^stderr: '(.*)'$", r"\1", (exc.stderr or "").strip(), flags=re.DOTALL).strip() or str(exc)
        words = [line.strip() for line in said.splitlines() if line.strip()]
        what = f"git {exc.command[1] if len(exc.command) > 1 else ''} failed: {words[-1] if words else said}"
    elif isinstance(exc, (git_exc.InvalidGitRepositoryError, git_exc.NoSuchPathError)):
        what = f"{exc} is not a git repository git can read (its HEAD, config or objects are damaged)"
    elif isinstance(exc, configparser.Error):
        what = f"a git config does not parse: {str(exc).splitlines()[0]}"
    elif isinstance(exc, (git_exc.ODBError, ValueError)) and type(exc).__module__.startswith(("git", "gitdb")):
        what = f"git cannot read an object: {exc}"
    else:
        return None
    from dfbuild.core import paths

    cache = str(paths.cache_dir())
    if cache in str(exc) or cache in what:
        hint = (f"the damaged repository is dfbuild's cache ({cache}): remove it with `dfbuild cache clean` "
                "(or `--base B`) and run again; dfbuild fetches it again")
    else:
        hint = ("check the tree with `git status` and `git fsck`; a corrupt index is rebuilt by "
                "`rm .git/index && git reset`; if the repository is dfbuild's cache, `dfbuild cache clean` "
                "removes it")
    return errors.RepositoryError(what, hint)


PROVE_EXIT = {"fixed": 0, "fixed-upstream": errors.FIXED_UPSTREAM_EXIT,
              "still-broken": errors.StillBrokenError.exit_code,
              "not-applicable": errors.NotApplicableError.exit_code,
              "conflict": errors.PatchConflictError.exit_code}
