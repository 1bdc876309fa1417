"""Results on stdout, talk on stderr, as git and pip do.

`out` prints what a command produces (tables, lists, summaries, the paths a script needs, --json);
`console` prints the talk around it (progress, warnings, errors, hints). Neither wraps, colours or
animates when it is not a terminal (a pipe, a file, a CI log), and NO_COLOR is honoured (rich reads it).
-q/--quiet and -v/--verbose (on the `dfbuild` group) set how much talk there is: results are never hidden.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import click
from rich.console import Console, ConsoleDimensions
from rich.table import Table

# the lowest floor: ui imports nothing of dfbuild's, so every module may report through it

# a pipe or a file has no width: lines are never cut (rich would fold them at 80 columns)
PIPE_WIDTH = 100_000


class _Console(Console):
    """A rich Console that does not wrap when it is not a terminal."""

    def _size(self) -> ConsoleDimensions:
        if not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, 25)
        return Console.size.fget(self)  # type: ignore[attr-defined]  # rich types size as overloaded

    size = property(_size, Console.size.fset)  # type: ignore[attr-defined]


console = _Console(stderr=True, highlight=False)  # talk
out = _Console(highlight=False)  # results

# how much talk: -1 quiet (warnings and errors only), -2 very quiet (errors only), 0 normal, 1 verbose
verbosity = 0


def set_verbosity(level: int) -> None:
    global verbosity
    verbosity = level


def quiet() -> bool:
    return verbosity < 0


def result(message="", **kwargs) -> None:
    """A line (or rich renderable, e.g. a table) of a command's result: stdout, whatever -q says.

    A table drawn for a pipe or a file loses its box: aligned columns under a header line, as
    `pip list` and `git branch -v` print them, which grep, cut and awk read (box-drawing
    characters would stand in every line and field)."""
    if isinstance(message, Table) and not out.is_terminal:
        message.box, message.show_edge, message.pad_edge = None, False, False
    out.print(message, **kwargs)


def _talk(line: str) -> None:
    if verbosity >= 0:
        console.print(line)


def info(message: str) -> None:
    """Talk; inside a step that is itself inside a step, shifted under that inner step's header."""
    _talk("    " * max(_open_steps - 1, 0) + message)


def plain(text: str) -> None:
    """Talk printed as it is (no markup, no wrapping): a block such as the build request's summary."""
    if verbosity >= 0:
        console.print(text, markup=False, soft_wrap=True)


def next_step(command: str) -> None:
    """The command to run next (stderr, as pip and cibuildwheel say it), whole, to copy as is."""
    if verbosity >= 0:
        console.print(f"next: {command}", markup=False, soft_wrap=True)


def debug(message: str) -> None:
    """Talk only -v asks for (the commands dfbuild runs, where it looks)."""
    if verbosity > 0:
        console.print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    if verbosity >= -1:
        console.print(f"[yellow]warning:[/yellow] {message}")


def dumps(data: dict) -> str:
    """The one JSON form of dfbuild's data (stdout, manifests, records)."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


# whether this command printed its JSON already (a failing smoke or verify prints its report, then fails):
# then that report is the one JSON object on stdout, and the error adds none
json_emitted = False


def emit_json(data: dict) -> None:
    global json_emitted
    json_emitted = True
    click.echo(dumps(data))


# how many steps are open: a step inside another (release -> prove -> build) is indented under it, so
# each "done in" line stands under its own header, not under the last one printed
_open_steps = 0


@contextmanager
def step(title: str):
    """Print a step with its wall time, the way cibuildwheel's logger does."""
    global _open_steps
    indent = "    " * _open_steps
    _talk(f"{indent}[bold]==>[/bold] {title}")
    start = time.monotonic()
    _open_steps += 1
    try:
        yield
    finally:
        _open_steps -= 1
    _talk(f"{indent}    done in {time.monotonic() - start:.1f}s")


class Progress:
    """Progress of a long step (a clone, a download): a rich bar on a terminal, a line per 10% in CI logs."""

    def __init__(self, title: str, *, interval_s: float = 15.0):
        self.title = title
        self.interval_s = interval_s
        self.interactive = console.is_terminal and not quiet()
        self._bar = None
        self._task = None
        self._reported: dict[str, int] = {}
        self._last_line = time.monotonic()

    def __enter__(self):
        if self.interactive:
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("    {task.description}"), BarColumn(),
                                     TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                     console=console, transient=True)
            self._bar.__enter__()
        return self

    def update(self, phase: str, percent: float, detail: str = "") -> None:
        if self._bar is not None:
            description = f"{self.title}: {phase}" + (f" {detail}" if detail else "")
            if self._task is None:
                self._task = self._bar.add_task(description, total=100)
            self._bar.update(self._task, completed=percent, description=description)
            return
        decile = int(percent // 10)
        if self._reported.get(phase, -1) < decile:
            self._reported[phase] = decile
            self._last_line = time.monotonic()
            info(f"    {self.title}: {phase} {percent:.0f}%" + (f" {detail}" if detail else ""))

    def tick(self, detail: str) -> None:
        """No percentage known: a line every interval_s in CI logs (the bar shows it on a terminal)."""
        if self._bar is not None:
            self.update("", 0, detail)
        elif time.monotonic() - self._last_line >= self.interval_s:
            self._last_line = time.monotonic()
            info(f"    {self.title}: {detail}")

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
