"""The `dfbuild` group itself: --version, --cache-dir, -q/-v, and every usage error shown in dfbuild's style
(text or, with --json, a JSON object), with its exit code.
"""

from __future__ import annotations

import os

import click

from dfbuild.core import ui


def _show_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from dfbuild.cli import about

    click.echo(about.version_text())
    ctx.exit()


def _use_cache_dir(ctx, param, value):
    """--cache-dir: the same as $DFBUILD_CACHE_DIR for this command (and what it runs), which it overrides."""
    if value is not None:
        from dfbuild.core import paths

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
