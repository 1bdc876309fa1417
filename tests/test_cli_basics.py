"""The CLI's front door: --help, --version, and the installed console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from click.testing import CliRunner

from dfbuild import __version__, cli


def invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), prog_name="dfbuild")


def test_help_names_the_pipeline_and_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    assert result.output.startswith("Usage: dfbuild [OPTIONS] COMMAND [ARGS]...")
    assert "DFlash" in result.output
    for command in ("checkout", "import"):
        assert f"  {command} " in result.output
    assert invoke("-h").output == result.output


def test_version_is_the_installed_distribution():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.startswith(f"dfbuild, version {version('dfbuild')}, series ")
    assert __version__ == version("dfbuild")


def test_checkout_help_lists_its_options():
    result = invoke("checkout", "--help")
    assert result.exit_code == 0
    for option in ("--base", "--pr", "--repo", "--dir", "--force", "--json"):
        assert option in result.output
    assert "5ecbe1a" in result.output  # the known bases are named


def test_import_help_lists_its_options():
    result = invoke("import", "--help")
    assert result.exit_code == 0
    for option in ("ARCHIVE", "--tag", "--dir", "--json"):
        assert option in result.output


def test_missing_base_is_a_usage_error():
    result = invoke("checkout")
    assert result.exit_code == 2
    assert "Missing option '--base'" in result.output


def test_unknown_command_is_a_usage_error():
    result = invoke("chekout")
    assert result.exit_code == 2
    assert "No such command 'chekout'" in result.output


def test_installed_console_script():
    """What a user types after `pip install .`: the entry point, in a real process."""
    # the script sits next to the interpreter that has dfbuild installed
    script = shutil.which("dfbuild", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert script, "the dfbuild console script is not installed (pip install -e '.[test]')"
    env = {**os.environ, "COLUMNS": "200"}
    help_run = subprocess.run([script, "--help"], capture_output=True, text=True, env=env)
    assert help_run.returncode == 0, help_run.stderr
    assert "Usage: dfbuild" in help_run.stdout
    assert "checkout" in help_run.stdout and "import" in help_run.stdout

    version_run = subprocess.run([script, "--version"], capture_output=True, text=True, env=env)
    assert version_run.returncode == 0
    assert version_run.stdout.startswith(f"dfbuild, version {version('dfbuild')}, series ")


def test_base_help_lists_the_series_bases_and_any_release():
    """--help names the bases series.toml knows (not a list frozen in the code) and says any bNNNNN works."""
    from dfbuild import series

    bases = list(series.load_series().bases)
    assert bases
    for command in ("checkout", "apply", "prove", "release"):
        result = invoke(command, "--help")
        assert result.exit_code == 0
        text = " ".join(result.output.split())
        listed = text[text.index("--base TEXT"):text.index("[required]")]
        assert all(base in listed for base in bases), (command, listed)
        assert "any llama.cpp release bNNNNN" in listed, (command, listed)


def test_the_cli_starts_without_the_model_writers():
    # numpy and gguf load only where fixtures are written: an import at the CLI's top made every command
    # start slower, and the copy of dfbuild that test_bad_luck_round3 runs as nobody failed without numpy.libs
    loaded = subprocess.run([sys.executable, "-c", "import sys, dfbuild.cli; print(sorted(sys.modules))"],
                            capture_output=True, text=True, check=True).stdout
    assert "'numpy'" not in loaded and "'gguf'" not in loaded
