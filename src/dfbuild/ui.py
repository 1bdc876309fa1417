"""Human output goes to stderr through rich; --json data goes to stdout, alone."""

from __future__ import annotations

import time
from contextlib import contextmanager

import click
from rich.console import Console

from .manifest import dumps

console = Console(stderr=True, highlight=False)


def info(message: str) -> None:
    console.print(message)


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {message}")


def emit_json(data: dict) -> None:
    click.echo(dumps(data))


@contextmanager
def step(title: str):
    """Print a step with its wall time, the way cibuildwheel's logger does."""
    console.print(f"[bold]==>[/bold] {title}")
    start = time.monotonic()
    yield
    console.print(f"    done in {time.monotonic() - start:.1f}s")
