"""Human output goes to stderr through rich; --json data goes to stdout, alone."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import click
from rich.console import Console

# the lowest floor: ui imports nothing of dfbuild's, so every module may report through it

console = Console(stderr=True, highlight=False)


def info(message: str) -> None:
    console.print(message)


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {message}")


def dumps(data: dict) -> str:
    """The one JSON form of dfbuild's data (stdout, manifests, records)."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def emit_json(data: dict) -> None:
    click.echo(dumps(data))


@contextmanager
def step(title: str):
    """Print a step with its wall time, the way cibuildwheel's logger does."""
    console.print(f"[bold]==>[/bold] {title}")
    start = time.monotonic()
    yield
    console.print(f"    done in {time.monotonic() - start:.1f}s")


class Progress:
    """Progress of a long step (a clone, a download): a rich bar on a terminal, a line per 10% in CI logs."""

    def __init__(self, title: str, *, interval_s: float = 15.0):
        self.title = title
        self.interval_s = interval_s
        self.interactive = console.is_terminal
        self._bar = None
        self._task = None
        self._reported: dict[str, int] = {}
        self._last_line = time.monotonic()

    def __enter__(self):
        if self.interactive:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

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
            console.print(f"    {self.title}: {phase} {percent:.0f}%" + (f" {detail}" if detail else ""))

    def tick(self, detail: str) -> None:
        """No percentage known: a line every interval_s in CI logs (the bar shows it on a terminal)."""
        if self._bar is not None:
            self.update("", 0, detail)
        elif time.monotonic() - self._last_line >= self.interval_s:
            self._last_line = time.monotonic()
            console.print(f"    {self.title}: {detail}")

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False
