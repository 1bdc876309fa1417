"""Smoke on slow and software devices (issue 20, item 4), against the fake llama-server.

- the start timeout comes from the backend table, $DFBUILD_START_TIMEOUT or
  --start-timeout, and the error names the option that raises it;
- a software Vulkan device (lavapipe: "llvmpipe" in `llama-server --list-devices`)
  gets the backend's smaller table, which still fails where the bug is;
- Vulkan runs keep Mesa's shader cache in dfbuild's cache dir;
- identity with the plain run: exact on CPU; on Vulkan a difference is accepted
  only at a near-tie of the plain run, taking a near-tied candidate.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dfbuild import smoke
from dfbuild.build.request import SmokeOptions
from dfbuild.cli import main
from dfbuild.core import errors, paths
from dfbuild.host import backends
from dfbuild.smoke import fixtures

FAKE = Path(__file__).with_name("fake_llama_server.py")
LAVAPIPE = "Vulkan0: llvmpipe (LLVM 19.1.7, 256 bits) (32768 MiB, 32768 MiB free)"
GPU = "Vulkan0: NVIDIA H200 (NVIDIA) (143771 MiB, 142000 MiB free)"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the fake server is a script with a shebang")


@pytest.fixture
def build_dir(tmp_path) -> Path:
    """A build dir whose bin/llama-server is the fake server script."""
    binary = smoke.server_binary(tmp_path / "build")
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(FAKE)!r}\n"
                      f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return tmp_path / "build"


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fixtures")
    fixtures.write_fixtures(out)
    return out


@pytest.fixture(autouse=True)
def private_env(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    for name in ("DFBUILD_START_TIMEOUT", "DFBUILD_SMOKE_TABLE", "MESA_SHADER_CACHE_DIR", "FAKE_DEVICES",
                 "FAKE_DEVICES_STDERR"):
        monkeypatch.delenv(name, raising=False)


# --- the start timeout -------------------------------------------------------------------------


def test_start_timeout_comes_from_the_table_then_the_variable_then_the_option(monkeypatch):
    cpu, vulkan = backends.get("cpu"), backends.get("vulkan")
    assert smoke.start_timeout_for(cpu) == 180
    assert smoke.start_timeout_for(vulkan) > 446  # the slowest cold lavapipe start measured
    monkeypatch.setenv(smoke.START_TIMEOUT_ENV, "2400")
    assert smoke.start_timeout_for(vulkan) == 2400
    assert smoke.start_timeout_for(vulkan, 3600) == 3600
    monkeypatch.setenv(smoke.START_TIMEOUT_ENV, "soon")
    with pytest.raises(errors.UsageError, match=smoke.START_TIMEOUT_ENV):
        smoke.start_timeout_for(vulkan)


def test_a_server_not_healthy_in_time_names_the_option_that_gives_it_longer(build_dir, fixtures_dir, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("FAKE_SERVER_MODE", "never-healthy")
    result = CliRunner().invoke(main, ["smoke", "--build-dir", str(build_dir), "--fixtures", str(fixtures_dir),
                                       "--set", "llama-mlp-agree", "--scenario", "text", "--start-timeout", "0.5",
                                       "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == errors.ServerStartError.exit_code, result.output
    assert "not healthy after 0s" in result.output or "not healthy after 1s" in result.output
    assert "--start-timeout" in result.output and smoke.START_TIMEOUT_ENV in result.output


# --- the Mesa shader cache ----------------------------------------------------------------------


def test_vulkan_runs_keep_mesas_shader_cache_in_dfbuilds_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    env = smoke.smoke_env_for(backends.get("vulkan"))
    assert env[smoke.SHADER_CACHE_DIR_ENV] == str(tmp_path / "cache" / "mesa-shader-cache")
    assert env["GGML_VK_VISIBLE_DEVICES"] == "0"
    assert smoke.SHADER_CACHE_DIR_ENV not in smoke.smoke_env_for(backends.get("cpu"))
    monkeypatch.setenv(smoke.SHADER_CACHE_DIR_ENV, str(tmp_path / "ci-cache"))  # CI's cached folder wins
    assert smoke.SHADER_CACHE_DIR_ENV not in smoke.smoke_env_for(backends.get("vulkan"))


# --- the software-device table ---------------------------------------------------------------------


def test_the_software_table_keeps_fixtures_and_scenarios_that_show_the_bug():
    software = backends.get("vulkan").smoke_software
    assert 0 < len(software["sets"]) * len(software["scenarios"]) <= 6
    for name in software["sets"]:  # the qwen35 M-RoPE target with the plain-rope draft: fails on every known base
        assert fixtures.FIXTURE_SETS[name].reproduces_bug and fixtures.FIXTURE_SETS[name].draft_rope == "plain"
    assert any(fixtures.FIXTURE_SETS[name].projector == "qwen2vl_merger" for name in software["sets"])
    for name in software["scenarios"]:
        assert any(step.has_image for step in smoke.SCENARIOS[name].steps), name


def test_the_device_list_picks_the_table(build_dir, monkeypatch):
    vulkan = backends.get("vulkan")
    monkeypatch.setenv("FAKE_DEVICES", LAVAPIPE)
    software = smoke.plan(vulkan, build_dir)
    assert (software.table, software.device) == ("software", smoke.device_name(LAVAPIPE))
    assert list(software.sets) == vulkan.smoke_software["sets"]
    assert smoke.plan(vulkan, build_dir, SmokeOptions(table="full")).table == "full"
    monkeypatch.setenv(smoke.TABLE_ENV, "full")
    assert smoke.plan(vulkan, build_dir).table == "full"
    monkeypatch.delenv(smoke.TABLE_ENV)
    monkeypatch.setenv("FAKE_DEVICES", GPU)  # a real GPU runs everything
    gpu = smoke.plan(vulkan, build_dir)
    assert (gpu.table, gpu.sets, gpu.scenarios) == ("full", smoke.DEFAULT_SETS, smoke.DEFAULT_SCENARIOS)
    # the key of a remembered pass tells the tables apart
    assert software.memo_key("p", {"files": {}}) != gpu.memo_key("p", {"files": {}})
    with pytest.raises(errors.UsageError):
        smoke.plan(backends.get("cpu"), build_dir, SmokeOptions(table="software"))


@pytest.mark.parametrize("mode, passes", [("bug", False), ("ok", True)])
def test_on_lavapipe_the_software_table_fails_unpatched_and_passes_patched(build_dir, fixtures_dir, tmp_path,
                                                                           monkeypatch, mode, passes):
    monkeypatch.setenv("FAKE_DEVICES", LAVAPIPE)
    monkeypatch.setenv("FAKE_SERVER_MODE", mode)
    result = CliRunner().invoke(main, ["smoke", "--build-dir", str(build_dir), "--fixtures", str(fixtures_dir),
                                       "--backend", "vulkan", "--log-dir", str(tmp_path / "logs"), "--json"])
    assert result.exit_code == (0 if passes else errors.SmokeFailedError.exit_code), result.output
    section = json.loads(result.stdout)
    assert (section["table"], section["device"]) == ("software", smoke.device_name(LAVAPIPE))
    assert section["start_timeout_s"] == backends.get("vulkan").smoke_runtime["start_timeout_s"]
    runs = [r for by_set in section["results"].values() for r in by_set.values()]
    assert len(runs) == len(section["sets"]) * len(section["scenarios"]) < 8
    if passes:
        assert all(r["passed"] for r in runs)
    else:  # every run of the smaller table still shows the upstream symptom
        assert all(not r["passed"] and smoke.upstream_symptom(r) for r in runs)


# --- identity with the plain run ---------------------------------------------------------------


def tok(text: str, top: list[tuple[str, float]]) -> dict:
    return {"bytes": list(text.encode()), "top": [[list(t.encode()), lp] for t, lp in top]}


DECISIVE = [("a", -0.01), ("b", -5.0), ("c", -6.0)]
TIED = [("a", -0.69), ("b", -0.70), ("c", -6.0)]
PLAIN = "aaaa"


def plain_probs(at_2: list[tuple[str, float]]) -> list[dict]:
    return [tok("a", DECISIVE), tok("a", DECISIVE), tok("a", at_2), tok("a", DECISIVE)]


def step(content: str, probs=None) -> dict:
    s = {"label": "image", "image": True, "error": None, "content": content, "status": 200, "draft_n": 6,
         "draft_n_accepted": 6, "metrics_drafted_before": 0.0, "metrics_accepted_before": 0.0,
         "metrics_drafted_after": 6.0, "metrics_accepted_after": 6.0}
    return s | ({"probs": probs} if probs is not None else {})


NEAR_TIE = {"rule": "near-tie", "near_tie_logprob": 0.02}


def judge(drafted: str, at_2, identity) -> dict:
    return smoke.judge({"agree": None}, [step(drafted)], [step(PLAIN, plain_probs(at_2))], alive=True,
                       log_findings=[], identity=identity)


def test_near_tie_rule_accepts_the_runner_up_at_a_near_tie_and_records_it():
    result = judge("aabx", TIED, NEAR_TIE)  # differs at token 2 (a near-tie), and whatever follows
    assert result["passed"], result["failures"]
    assert result["identical_to_no_spec"] is False
    [noise] = result["near_ties"]
    assert (noise["token_index"], noise["plain_token"], noise["drafted_token"]) == (2, "a", "b")
    assert noise["margin"] == pytest.approx(0.01)


def test_near_tie_rule_fails_a_real_divergence_at_a_decisive_token():
    result = judge("aabx", DECISIVE, NEAR_TIE)
    assert not result["passed"]
    assert any("output differs from --spec-type none" in f and "real divergence" in f for f in result["failures"])
    assert result["near_ties"] == []


def test_near_tie_rule_fails_a_token_the_plain_run_did_not_rank_near_the_top():
    assert not judge("aacx", TIED, NEAR_TIE)["passed"]  # "c" is 5.3 nats behind: not noise
    assert not judge("aa", TIED, NEAR_TIE)["passed"]  # a shorter output is not noise either


def test_exact_rule_fails_any_difference():
    for identity in (None, {"rule": "exact"}):
        result = judge("aabx", TIED, identity)
        assert not result["passed"] and result["identity_rule"] == "exact"


@pytest.mark.parametrize("backend, mode, passes", [
    ("vulkan", "near-tie", True),   # batch-shape noise on a device that has it
    ("vulkan", "diverge", False),   # a decisive token differs: a real divergence fails on Vulkan too
    ("cpu", "near-tie", False),     # CPU keeps exact identity
])
def test_identity_rule_on_the_fake_server(build_dir, fixtures_dir, tmp_path, monkeypatch, backend, mode, passes):
    monkeypatch.setenv("FAKE_DEVICES", GPU)
    plan = smoke.plan(backends.get(backend), build_dir, sets=["qwen35-grid-plain-random"], scenarios=["image"])
    kwargs = plan.run_kwargs() | {"env": {**plan.env, "FAKE_SERVER_MODE": mode}}
    section = smoke.run_smoke(build_dir, fixtures_dir, log_dir=tmp_path / "logs", **kwargs)
    result = section["results"]["image"]["qwen35-grid-plain-random"]
    assert result["passed"] is passes, result["failures"]
    assert section["identity"]["rule"] == ("near-tie" if backend == "vulkan" else "exact")
    if passes:  # both requests (plain and streamed) differ at token 5, a near-tie
        assert [(n["label"], n["token_index"]) for n in result["near_ties"]] == [("image", 5), ("image-stream", 5)]


# --- a GPU backend's smoke runs on its GPU or says it did not (issue 31) -----------------------------------

CUDA = "CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)"
ROCM = "ROCm0: AMD Radeon RX 9070 XT (16304 MiB, 16000 MiB free)"
DEVICE_OF = {"cuda": CUDA, "vulkan": GPU, "hip": ROCM}
# what the hint must name when the backend finds no device: the loader / ICD, the driver, the runtime
MISSING_NAMES = {"cuda": ("libcuda.so.1", "NVIDIA driver"), "vulkan": ("ICD", "mesa-vulkan-drivers", "libglvnd"),
                 "hip": ("ROCm runtime", "AMD GPU")}


def smoke_cli(build_dir, fixtures_dir, tmp_path, backend, *extra):
    return CliRunner().invoke(main, ["smoke", "--build-dir", str(build_dir), "--fixtures", str(fixtures_dir),
                                     "--backend", backend, "--set", "llama-mlp-agree", "--scenario", "text",
                                     "--log-dir", str(tmp_path / "logs"), *extra])


@pytest.mark.parametrize("listed", ["", "(none)"])  # an empty list, and llama-server's own "(none)" line
@pytest.mark.parametrize("backend", ["cuda", "vulkan", "hip"])
def test_a_gpu_backend_with_no_device_stops_with_45_and_names_what_is_missing(build_dir, fixtures_dir, tmp_path,
                                                                             monkeypatch, backend, listed):
    monkeypatch.setenv("FAKE_DEVICES", listed)
    result = smoke_cli(build_dir, fixtures_dir, tmp_path, backend)
    assert result.exit_code == errors.NoDeviceError.exit_code == 45, result.output
    assert f"no {backend} device" in result.stderr and "--list-devices" in result.stderr
    for name in MISSING_NAMES[backend]:
        assert name in result.stderr, name
    assert "--allow-cpu-fallback" in result.stderr
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())  # no scenario ran
    as_json = smoke_cli(build_dir, fixtures_dir, tmp_path, backend, "--json")
    assert as_json.exit_code == 45, as_json.output


@pytest.mark.parametrize("backend, said", [
    ("hip", "ggml_cuda_init: failed to initialize ROCm: no ROCm-capable device is detected"),
    ("cuda", "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected"),
    ("vulkan", "ggml_vulkan: No devices found.")])
def test_with_no_device_the_servers_own_words_are_quoted(build_dir, fixtures_dir, tmp_path, monkeypatch, backend,
                                                         said):
    """The HIP build with no AMD GPU says plainly why it has no device: the error and the fallback quote it."""
    monkeypatch.setenv("FAKE_DEVICES", "(none)")
    monkeypatch.setenv("FAKE_DEVICES_STDERR", f"load_backend: loaded CPU backend;{said};main: unrelated line")
    result = smoke_cli(build_dir, fixtures_dir, tmp_path, backend)
    assert result.exit_code == 45, result.output
    assert f"it said: {said}" in " ".join(result.stderr.split()), result.stderr
    assert "unrelated line" not in result.stderr and "loaded CPU backend" not in result.stderr
    fallback = smoke.plan(backends.get(backend), build_dir, SmokeOptions(allow_cpu_fallback=True))
    assert f"it said: {said}" in fallback.note and fallback.cpu_fallback


def test_a_vulkan_driver_file_that_is_missing_is_named(build_dir, fixtures_dir, tmp_path, monkeypatch):
    """The H200 case: the loader was told of an ICD it could not use, listed (none), and the smoke passed on the CPU."""
    icd = tmp_path / "nvidia_icd.json"
    monkeypatch.setenv("VK_DRIVER_FILES", str(icd))
    monkeypatch.setenv("FAKE_DEVICES", "(none)")
    result = smoke_cli(build_dir, fixtures_dir, tmp_path, "vulkan")
    assert result.exit_code == 45, result.output
    assert f"VK_DRIVER_FILES names {icd}, which does not exist" in result.stderr


@pytest.mark.parametrize("backend", ["cuda", "vulkan", "hip"])
def test_a_gpu_backend_runs_on_its_device_and_records_it(build_dir, fixtures_dir, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("FAKE_DEVICES", f"BLAS: OpenBLAS (0 MiB, 0 MiB free);{DEVICE_OF[backend]}")  # not its own
    result = smoke_cli(build_dir, fixtures_dir, tmp_path, backend, "--json")
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)
    device = smoke.device_name(DEVICE_OF[backend])
    assert section["device"] == section["ran_on"] == device and "MiB" not in device
    assert section["cpu_fallback"] is False and section["passed"]
    said = smoke_cli(build_dir, fixtures_dir, tmp_path, backend)
    assert f"smoke runs on: {device}" in said.stderr


@pytest.mark.parametrize("backend, words", [("hip", "no AMD device here, ran on the CPU backend"),
                                            ("cuda", "no NVIDIA device here, ran on the CPU backend"),
                                            ("vulkan", "no Vulkan device here, ran on the CPU backend")])
def test_allow_cpu_fallback_runs_on_the_cpu_and_records_it(build_dir, fixtures_dir, tmp_path, monkeypatch, backend,
                                                          words):
    monkeypatch.setenv("FAKE_DEVICES", "(none)")
    result = smoke_cli(build_dir, fixtures_dir, tmp_path, backend, "--allow-cpu-fallback", "--json")
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)
    assert (section["ran_on"], section["cpu_fallback"], section["device"]) == (words, True, None)
    # a device present: the flag changes nothing, it runs there
    monkeypatch.setenv("FAKE_DEVICES", DEVICE_OF[backend])
    on_gpu = json.loads(smoke_cli(build_dir, fixtures_dir, tmp_path, backend, "--allow-cpu-fallback",
                                  "--json").stdout)
    assert (on_gpu["cpu_fallback"], on_gpu["ran_on"]) == (False, smoke.device_name(DEVICE_OF[backend]))


def test_the_cpu_backend_lists_nothing_and_runs_on_the_cpu(build_dir, fixtures_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DEVICES", "")
    section = json.loads(smoke_cli(build_dir, fixtures_dir, tmp_path, "cpu", "--json").stdout)
    assert (section["ran_on"], section["cpu_fallback"], section["device"]) == ("the CPU backend", False, None)


def test_the_key_of_a_remembered_pass_holds_the_device(build_dir, monkeypatch):
    """The H200 rerun reused the CPU run's pass: the key held binaries and fixtures, not the device."""
    vulkan = backends.get("vulkan")
    fx = {"seed": 0, "files": {"t.gguf": {"sha256": "0" * 64}}}
    monkeypatch.setenv("FAKE_DEVICES", "(none)")
    on_cpu = smoke.plan(vulkan, build_dir, SmokeOptions(table="full", allow_cpu_fallback=True))
    monkeypatch.setenv("FAKE_DEVICES", GPU)
    on_gpu = smoke.plan(vulkan, build_dir, SmokeOptions(table="full"))
    monkeypatch.setenv("FAKE_DEVICES", GPU.replace("142000 MiB free", "99 MiB free"))
    same_gpu_busier = smoke.plan(vulkan, build_dir, SmokeOptions(table="full"))
    monkeypatch.setenv("FAKE_DEVICES", "Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)")
    other_gpu = smoke.plan(vulkan, build_dir, SmokeOptions(table="full"))
    keys = [p.memo_key("payload", fx) for p in (on_cpu, on_gpu, same_gpu_busier, other_gpu)]
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[3] not in keys[:3]
    # the CPU backend's key is what it always was
    cpu = smoke.plan(backends.get("cpu"), build_dir)
    assert cpu.memo_key("payload", fx) == smoke.memo_key("payload", fx, "cpu", cpu.sets, cpu.scenarios)
