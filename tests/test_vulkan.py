"""The Vulkan backend, built here and smoke-tested on lavapipe (Mesa's Vulkan driver on the CPU).

b10359 is built unpatched and patched with `--backend vulkan` (realtrees layout:
NAME/src beside NAME/build-vulkan), then the qwen35 image scenario runs with
every layer of the target, the draft and the projector on the Vulkan device:
unpatched it must fail with the upstream symptom, patched it must pass.

Needs the toolchain that scripts/install-vulkan.sh installs (glslc, libvulkan-dev,
spirv-headers, Mesa >= 25's lavapipe; on Debian 12 also Debian 13's headers);
skipped only when doctor says that toolchain is absent.

Run settings, each for a measured reason (FIXTURES.md, "Vulkan on lavapipe"):
- GGML_VK_VISIBLE_DEVICES=0: ggml ignores CPU-type Vulkan devices otherwise, and
  everything would silently run on the CPU backend;
- MESA_SHADER_CACHE_DIR in the test cache: a cold cache costs minutes (llama-server
  took 446 s to become healthy here), a warm one about a second. A warm-up pass
  with long timeouts fills it before the timed-out smoke runs;
- --no-spec-draft-backend-sampling: the draft's top-k sampler on the device asserts
  in ggml-vulkan (GGML_ASSERT(allow_misalign || misalign_bytes == 0) in ggml_vk_topk)
  because the fixtures' 259-token vocabulary makes logit rows misaligned; real
  vocabularies are multiples of 64. The draft model itself still runs on Vulkan;
- -lv 4: llama-server logs the "using device" and "offloaded" lines from verbosity 4.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import realtrees

from dfbuild import smoke
from dfbuild.core.errors import DfbuildError
from dfbuild.host import backends, doctor

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.vulkan]

BASE = "pydist-0.94.0"
# Both projectors with the plain-rope draft: the M-RoPE image positions that break
# the unpatched draft. One scenario (an image, then the same streamed) shows it.
SETS = ["qwen35-mlp-plain-agree", "qwen35-grid-plain-agree"]
SCENARIOS = ["image"]
VULKAN_ARGS = backends.get("vulkan").smoke_server_args  # the backend table's, as release uses them
COLD_TIMEOUT_S = 1800  # start and first requests with a cold shader cache


def vulkan_env(test_cache: Path) -> dict[str, str]:
    return {**backends.get("vulkan").smoke_env, "MESA_SHADER_CACHE_DIR": str(test_cache / "mesa-shader-cache")}


def _absent(probes: list[dict]) -> list[str]:
    return [f"{p['what']}" + (f" ({p['problem']})" if p["problem"] else "") + f": {p['install']}" for p in probes]


@pytest.fixture(scope="module")
def vulkan_toolchain():
    """Skip unless doctor says the Vulkan backend can build and run here."""
    hint = "install it with: sudo bash scripts/install-vulkan.sh"
    entry = doctor.check_backend("vulkan")
    # Too-old system headers are not a reason yet: Debian 12 builds with Debian 13's.
    blocking = [p for p in entry["toolchain"] if not p["ok"] and not p["optional"] and p["name"] != "vulkan-headers"]
    blocking += [p for p in entry["runtime"] if not p["ok"]]
    if blocking:
        pytest.skip(f"Vulkan toolchain absent ({hint}): " + " | ".join(_absent(blocking)))
    try:
        include_dir = realtrees.vulkan_include_dir()
    except DfbuildError as exc:
        pytest.skip(f"Vulkan headers absent ({hint}): {exc}")
    entry = doctor.check_backend("vulkan", extra_include_dirs=[include_dir] if include_dir else [])
    if not entry["can_build"]:
        pytest.skip(f"Vulkan toolchain absent ({hint}): {entry['reason']}")
    return entry


@pytest.fixture(scope="module")
def vulkan_builds(vulkan_toolchain) -> dict[str, dict]:
    return {label: realtrees.built_tree(BASE, patched=label == "patched", backend="vulkan")
            for label in ("unpatched", "patched")}


@pytest.fixture(scope="module")
def fixture_section(tmp_path_factory) -> dict:
    from dfbuild.smoke import fixtures

    return fixtures.ensure_fixtures(tmp_path_factory.mktemp("vulkan-fixtures"))


class PatientServer(smoke.LlamaServer):
    """A llama-server whose requests wait as long as a cold shader cache needs."""

    def request(self, method, path, payload=None, timeout=COLD_TIMEOUT_S):
        return super().request(method, path, payload, timeout=max(timeout, COLD_TIMEOUT_S))


@pytest.fixture(scope="module")
def warm_shader_cache(vulkan_builds, fixture_section, test_cache, tmp_path_factory) -> dict[str, str]:
    """Run each scenario once on the patched build with long timeouts, so every
    pipeline the smoke runs need is in the Mesa shader cache (seconds when warm)."""
    env = vulkan_env(test_cache)
    binary = realtrees.server_binary(vulkan_builds["patched"])
    logs = tmp_path_factory.mktemp("vulkan-warmup")
    for scenario_name in SCENARIOS:
        scenario = smoke.SCENARIOS[scenario_name]
        for set_name in SETS:
            args = [*smoke.base_server_args(fixture_section["sets"][set_name], speculative=True),
                    *scenario.server_args, *VULKAN_ARGS]
            with PatientServer(binary, args, logs / f"{scenario_name}--{set_name}.log", env=env,
                               start_timeout=COLD_TIMEOUT_S) as server:
                smoke.run_steps(server, scenario.steps, fixture_section["images"])
    return env


def run_on_lavapipe(build_section: dict, fixture_section: dict, env: dict, log_dir: Path) -> dict:
    return smoke.run_smoke(Path(build_section["build_dir"]), Path(fixture_section["dir"]), sets=SETS,
                           scenarios=SCENARIOS, log_dir=log_dir, extra_server_args=VULKAN_ARGS, env=env)


def device_problems(result: dict) -> list[str]:
    """Why the speculative run's log does not show target, draft and projector on lavapipe."""
    log = Path(result["log"]).read_text(encoding="utf-8", errors="replace")
    where = f"{result['scenario']}/{result['set']} ({result['log']})"
    problems = []
    devices = re.findall(r"using device Vulkan0 \(llvmpipe", log)
    if len(devices) < 2:  # the target and the draft
        problems.append(f"{where}: 'using device Vulkan0 (llvmpipe' {len(devices)} times, expected 2")
    offloaded = re.findall(r"offloaded (\d+)/(\d+) layers to GPU", log)
    if len(offloaded) < 2 or any(done != total for done, total in offloaded):
        problems.append(f"{where}: expected every layer of target and draft offloaded, got {offloaded}")
    if "CLIP using Vulkan0 backend" not in log:
        problems.append(f"{where}: the projector did not run on Vulkan0")
    return problems


def test_vulkan_build_links_ggml_vulkan(vulkan_builds):
    for label, section in vulkan_builds.items():
        assert section["backend"] == "vulkan"
        assert section["flags"]["GGML_VULKAN"] == "ON"
        assert Path(section["build_dir"]).name == "build-vulkan"
        assert any("ggml-vulkan" in lib for lib in section["libraries"]), f"{label}: {section['libraries']}"
        assert realtrees.server_binary(section).is_file()


def test_unpatched_vulkan_server_fails_image_scenario_with_the_upstream_symptom(
        vulkan_builds, fixture_section, warm_shader_cache, tmp_path):
    section = run_on_lavapipe(vulkan_builds["unpatched"], fixture_section, warm_shader_cache, tmp_path / "logs")
    problems = []
    for by_set in section["results"].values():
        for result in by_set.values():
            problems += device_problems(result)
            where = f"{result['scenario']}/{result['set']}"
            if result["passed"]:
                problems.append(f"{where}: passed on the unpatched tree, so it cannot prove the fix")
            elif not smoke.upstream_symptom(result):
                problems.append(f"{where}: failed, but not with the upstream symptom: {result['failures'][:3]}")
    assert not problems, "\n".join(problems)


def test_patched_vulkan_server_passes_image_scenario(vulkan_builds, fixture_section, warm_shader_cache, tmp_path):
    section = run_on_lavapipe(vulkan_builds["patched"], fixture_section, warm_shader_cache, tmp_path / "logs")
    problems = []
    for by_set in section["results"].values():
        for result in by_set.values():
            problems += device_problems(result)
            if not result["passed"]:
                problems.append(f"{result['scenario']}/{result['set']}: {result['failures'][:3]}\n"
                                f"{result['failure_excerpt']}")
    assert not problems, "\n".join(problems)
