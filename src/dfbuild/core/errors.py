"""Every fatal error dfbuild can raise, with a stable exit code and a hint.

The exit codes are part of the CLI contract and are documented in docs/exit-codes.md;
never renumber one, only add new ones.
"""

from __future__ import annotations

import errno


class DfbuildError(Exception):
    """A failure the user can act on: one-line reason plus what to do."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(DfbuildError):
    """A name or option value dfbuild refuses before touching anything (as click's usage errors)."""

    exit_code = 2


class UnknownBaseError(DfbuildError):
    exit_code = 10


class SourceError(DfbuildError):
    """The repository, PR ref or revision cannot be reached or resolved."""

    exit_code = 11


class DirtyTreeError(DfbuildError):
    exit_code = 12


class NotLlamaTreeError(DfbuildError):
    exit_code = 13


class ArchiveError(DfbuildError):
    exit_code = 14


class LockedError(DfbuildError):
    """The work tree, build dir or output dir is in use by another dfbuild (--no-wait, or a timeout)."""

    exit_code = 15


class StateFileError(LockedError):
    """Where dfbuild keeps a lock, a journal or a record sits a symlink, FIFO, device or socket: refused (15).

    dfbuild never follows, truncates or blocks on such a thing; the user removes it.
    """

    def __init__(self, path, kind: str, what: str):
        super().__init__(f"{path} is {kind}, not dfbuild's {what}; nothing was done",
                         f"dfbuild keeps its own regular file there: remove it (rm '{path}') if nothing of "
                         "yours uses it, then run again")
        self.path = path


class ForeignStateError(LockedError):
    """A state file of dfbuild's reads, but holds what dfbuild never writes there (a journal whose branch
    climbs out of refs/heads, a key no journal has): refused (15), never acted on and never removed unseen."""

    def __init__(self, path, why: str, what: str):
        super().__init__(f"{path} is not a {what} dfbuild wrote ({why}); nothing was done",
                         f"look at it and check the tree with `git status`; then remove it (rm '{path}') "
                         "and run again")
        self.path = path


class CannotWriteError(DfbuildError):
    """A directory dfbuild must write is read-only, not ours to write, or on a full disk."""

    exit_code = 16


# errno -> (what it means, what to do); an OSError with one of these is the user's to fix, not a bug
_WRITE_ERRNOS: dict[int | None, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free some space there, or put it on another disk (--out for a release, "
                   "--dir or --work for the tree, --cache-dir or DFBUILD_CACHE_DIR for the cache), then run "
                   "again; what was half done is finished or undone by the next run"),
    errno.EDQUOT: ("the disk quota is exceeded", "free some space there, then run again"),
    errno.EROFS: ("the file system is read-only", "pass a --dir (or --out) on a writable file system"),
    errno.EACCES: ("permission denied", "pass a --dir (or --out) you can write, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "pass a --dir (or --out) you can write, or fix its permissions"),
}


def from_os_error(exc: OSError) -> DfbuildError | None:
    """The documented error for an OSError about writing (full disk, read-only, no permission), else None."""
    known = _WRITE_ERRNOS.get(exc.errno)
    if known is None:
        return None
    where = exc.filename if exc.filename is not None else "a file"
    return CannotWriteError(f"cannot write {where}: {known[0]}", known[1])


class RepositoryError(DfbuildError):
    """git cannot read a repository dfbuild uses: a corrupt index or object, a damaged cache repo (its config,
    HEAD or objects). git's own words are quoted; the hint says how to repair the tree or clear the cache entry."""

    exit_code = 17


class PatchIntegrityError(DfbuildError):
    """A patch file does not match the sha256 recorded in series.toml."""

    exit_code = 20


class PatchConflictError(DfbuildError):
    exit_code = 21


class NoVariantError(DfbuildError):
    exit_code = 22


class SeriesFileError(DfbuildError):
    exit_code = 23


class NotApplicableError(DfbuildError):
    """The tree has no DFlash, so the series has nothing to fix."""

    exit_code = 24


class NoProofError(DfbuildError):
    """No `dfbuild prove` result where one is needed (series adopt, series record-proof)."""

    exit_code = 25


class ExportError(DfbuildError):
    """`series export --upstream` cannot be made or written: an --out dir that is not an earlier export,
    nothing to send."""

    exit_code = 26


class ExportIdentityError(DfbuildError):
    """`series export --upstream` has no author: no --author, and git has no identity (user.name, user.email)."""

    exit_code = 27


class ExportProofError(DfbuildError):
    """`series export --upstream` ran its test at the base under upstream's pytest, and the test did not fail
    unpatched (with the bug's symptom) and pass patched: the export proves nothing there and is not written."""

    exit_code = 28


class ToolchainMissingError(DfbuildError):
    exit_code = 30


class BuildError(DfbuildError):
    exit_code = 31


class BuildDirMismatchError(DfbuildError):
    exit_code = 32


class UnsupportedBackendError(DfbuildError):
    exit_code = 33


class WebUIError(DfbuildError):
    """The web UI could not be built from the tree's sources (npm failed; offline with nothing cached), or its
    tools/ui/dist holds a UI dfbuild did not put there. Nothing half-built is kept; --no-ui builds without it."""

    exit_code = 34


class FixtureError(DfbuildError):
    exit_code = 40


class SmokeFailedError(DfbuildError):
    exit_code = 41


class ServerStartError(DfbuildError):
    exit_code = 42


class StillBrokenError(DfbuildError):
    """The proof: the patched tree still fails smoke, so nothing is released."""

    exit_code = 43


# `dfbuild prove` exits with this when the unpatched tree already passes every
# scenario ("fixed upstream"): a result, not an error, that a script must notice.
FIXED_UPSTREAM_EXIT = 44


class NoDeviceError(DfbuildError):
    """A GPU backend's llama-server lists no device of its kind (cuda, vulkan, hip), so its smoke would
    run on the CPU; refused unless the user asks for a CPU run (--allow-cpu-fallback), which is recorded."""

    exit_code = 45


class ReleaseError(DfbuildError):
    exit_code = 50


class VerifyError(DfbuildError):
    exit_code = 51


class ImageToolError(DfbuildError):
    """A tool the image stage needs (mmdebstrap, umoci, skopeo, GNU tar) is missing, or failed."""

    exit_code = 52


class ImageInputError(DfbuildError):
    """The release dir holds nothing an image can be made of: no manifest, no archive of a backend
    llama.cpp has an image for, an archive that does not read, an image file dfbuild did not write."""

    exit_code = 53


class ImageRunError(DfbuildError):
    """An image's entrypoint, started in its unpacked root filesystem, failed its smoke request
    (run before it is published): nothing was added to the release dir."""

    exit_code = 54


class ImageCheckError(DfbuildError):
    """The image archive written is not what was asked for: skopeo does not read it, or its config,
    layers or digest are not those recorded (a dfbuild bug or a changed tool)."""

    exit_code = 55


class NotGgufError(DfbuildError):
    """`dfbuild draft`: a file that is not a GGUF model (no GGUF magic, a version llama.cpp does not read,
    not a regular file, missing or unreadable)."""

    exit_code = 60


class DraftDamagedError(DfbuildError):
    """`dfbuild draft`: a GGUF file that is truncated or damaged (a length past its end, an unknown type)."""

    exit_code = 61


class NotDraftError(DfbuildError):
    """`dfbuild draft`: the DRAFT is not a DFlash draft, or the TARGET is not a text model (a projector, a draft)."""

    exit_code = 62


class DraftFixRefusedError(DfbuildError):
    """`dfbuild draft fix` writes nothing: the target is not M-RoPE (nothing to fix), `--out` exists (without
    `--force`) or is one of the inputs, or the copy did not read back equal (it is removed)."""

    exit_code = 63


# Ctrl-C (SIGINT), as shells report it: 128 + 2. Not an exception class: cli.handle_errors
# maps KeyboardInterrupt to it.
INTERRUPTED_EXIT_CODE = 130
# SIGTERM (what `timeout`, systemd and a supervisor send): 128 + 15
TERMINATED_EXIT_CODE = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised by the handler cli.handle_errors sets: a KeyboardInterrupt, so everything that
    rolls back on Ctrl-C rolls back on it too, and it exits 143 where Ctrl-C exits 130."""

    signal_name = "SIGTERM"
