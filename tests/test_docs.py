"""The README's and docs/' commands cannot rot: every documented `dfbuild` command and option must exist, and
the cheap ones run.

The convention (docs/commands.md follows it too):
- every `dfbuild ...` line in a fenced `sh` or `console` block, and every inline `` `dfbuild ...` `` span, is
  checked against the CLI: its command path and each `--option` must exist (click's own command tree);
- a block fenced as ```` ```sh run ```` is also run, line by line, with bash, in an empty directory, against
  a cache of its own (DFBUILD_CACHE_DIR), and each line must exit 0. Only cheap commands go there: help,
  bases, cache, series, doctor, matrix. Commands that build, smoke, prove, release or fetch (minutes, or the
  network) are never in a run block (RUN_NEVER); the static check still covers their options.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dfbuild.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(?<!`)`(dfbuild [^`]+)`(?!`)")
SHELL_LANGS = ("sh", "console", "bash", "shell")
# slow (a build, a smoke run, minutes) or the network: checked, never run here
RUN_NEVER = ("apply", "checkout", "import", "build", "webui", "smoke", "release", "prove", "track", "fixtures",
             "verify")
STOPS = {"&&", "||", "|", ";", ">", ">>", "<", "2>", "&", "(", ")"}


def _present(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path):
    """(lang, run, body, first line number) of each fenced block of PATH."""
    text = path.read_text(encoding="utf-8")
    for match in FENCE.finditer(text):
        info = match.group(1).split()
        yield (info[0] if info else ""), "run" in info[1:], match.group(2), text.count("\n", 0, match.start(2)) + 1


def shell_lines(body: str):
    """(offset, line) of each command line of a shell block: `$ ` prompts stripped, `\\` continuations joined,
    comments and blank lines left out."""
    pending, start = "", 0
    for number, raw in enumerate(body.splitlines()):
        line = raw[2:] if raw.startswith("$ ") else raw
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            yield start, line.strip()


def dfbuild_argvs(line: str) -> list[list[str]]:
    """The argument lists of every `dfbuild` a shell line runs (after `VAR=value` prefixes; up to a pipe,
    `&&`, `;` or a redirection)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a line this check can read
        return []
    found, segment = [], []
    for token in tokens + [";"]:
        if token in STOPS or set(token) <= set("&|;<>()"):
            while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
                segment.pop(0)
            if segment and segment[0] == "dfbuild":
                found.append(segment[1:])
            segment = []
        else:
            segment.append(token)
    return found


def inline_argvs(text: str) -> list[list[str]]:
    """`dfbuild ...` spans in prose and tables: the synopsis brackets and alternatives dropped."""
    found = []
    for match in INLINE.finditer(text):
        words = match.group(1).replace("\\|", " ").replace("[", " ").replace("]", " ").split()
        found.append([w for w in words[1:] if w not in ("|", "...") and not w.endswith("...")])
    return found


def _options(command: click.Command) -> dict[str, click.Parameter]:
    names = {"-h": None, "--help": None}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in param.opts + param.secondary_opts:
                names[name] = param
    return names


def check_argv(argv: list[str]) -> str:
    """Raise AssertionError naming the first command or option ARGV uses that the CLI does not have;
    return the command path."""
    command, path, position = main, ["dfbuild"], 0
    while position < len(argv):
        token = argv[position]
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            options = _options(command)
            assert name in options, f"`{' '.join(path)}` has no option {name}"
            param = options[name]
            takes_value = param is not None and not param.is_flag and not param.count and "=" not in token
            position += 2 if takes_value else 1
            continue
        if isinstance(command, click.Group):
            assert token in command.commands, f"`{' '.join(path)}` has no command {token!r}"
            command = command.commands[token]
            path.append(token)
        position += 1
    return " ".join(path)


def documented() -> list[tuple[str, list[str]]]:
    """(where, argv) of every dfbuild command line the README and docs/ show."""
    found = []
    for doc in DOCS:
        for lang, _, body, first in blocks(doc):
            if lang in SHELL_LANGS:
                for offset, line in shell_lines(body):
                    found += [(f"{_present(doc)}:{first + offset}", argv) for argv in dfbuild_argvs(line)]
        text = FENCE.sub("", doc.read_text(encoding="utf-8"))
        found += [(_present(doc), argv) for argv in inline_argvs(text)]
    return found


def runnable() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for lang, run, body, first in blocks(doc):
            if run:
                found += [(f"{_present(doc)}:{first + offset}", line) for offset, line in shell_lines(body)]
    return found


# --- the checker can fail -----------------------------------------------------------------------


def test_the_check_fails_on_a_command_or_option_that_does_not_exist():
    assert check_argv(["series", "list", "--json"]) == "dfbuild series list"
    assert check_argv(["--cache-dir", "X", "cache", "clean", "--older-than", "3"]) == "dfbuild cache clean"
    for argv, said in ((["aply", "--base", "b1"], "no command 'aply'"), (["bases", "--nope"], "no option --nope"),
                       (["cache", "purge"], "no command 'purge'"), (["--cache-dir", "X", "doctor", "--backnd", "cpu"],
                                                                    "no option --backnd")):
        with pytest.raises(AssertionError, match=re.escape(said)):
            check_argv(argv)
    assert dfbuild_argvs('eval "$(X=1 dfbuild)" && A=b dfbuild bases --json | head -3') == [["bases", "--json"]]
    assert inline_argvs("run `dfbuild verify DIR [--run \\| --no-run]` now") == [["verify", "DIR", "--run", "--no-run"]]


# --- every documented command and option exists --------------------------------------------------


def test_the_readme_is_short_and_starts_with_apply():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "dfbuild apply" in text and text.index("dfbuild apply") < text.index("dfbuild release")
    for doc in ("commands", "bases-and-epochs", "curating", "backends", "windows", "ci", "exit-codes"):
        assert f"(docs/{doc}.md)" in text, doc
        assert (ROOT / "docs" / f"{doc}.md").is_file(), doc


def test_every_documented_command_and_option_exists():
    lines = documented()
    assert len(lines) > 50, len(lines)  # the README and docs/ really were read
    problems = []
    for where, argv in lines:
        try:
            check_argv(argv)
        except AssertionError as exc:
            problems.append(f"{where}: dfbuild {' '.join(argv)}: {exc}")
    assert not problems, "\n".join(problems)


def test_slow_commands_are_never_in_a_run_block():
    for where, line in runnable():
        for argv in dfbuild_argvs(line):
            words = [w for w in argv if not w.startswith("-")]
            assert not words or words[0] not in RUN_NEVER, f"{where}: `{line}` builds or fetches; not a run block"


# --- the cheap ones run ----------------------------------------------------------------------------


@pytest.mark.parametrize("where, line", runnable(), ids=[w for w, _ in runnable()])
def test_documented_command_runs(where, line, tmp_path):
    env = {**os.environ, "DFBUILD_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "120",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env.pop("DFBUILD_PATCHES_DIR", None)
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{where}: `{line}` exited {done.returncode}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr


def test_every_relative_link_points_at_a_file_of_the_repo():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text(encoding="utf-8"))):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                broken.append(f"{_present(doc)}: {target}")
    assert not broken, broken
