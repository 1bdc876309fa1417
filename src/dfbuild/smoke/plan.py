"""How a backend runs its smoke (its table, start timeout, identity rule, environment and device): a Plan."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from dfbuild.build.request import SmokeOptions
from dfbuild.core import errors, paths, proc
from dfbuild.smoke import devices, memo
from dfbuild.smoke.judge import EXACT, IDENTITY_RULES
from dfbuild.smoke.scenarios import DEFAULT_SCENARIOS, DEFAULT_SETS, SCENARIOS
from dfbuild.smoke.server import DEFAULT_START_TIMEOUT, START_TIMEOUT_ENV, exe_start_timeout, server_binary

# --- how a backend runs the smoke: its table, timeout, identity rule and shader cache ----------
#
# Everything here comes from the backend table (backends.toml, smoke.*), and the
# user can override the start timeout and the table. A software Vulkan device
# (lavapipe) runs the whole table in hours on 2 cores, so there the backend's
# `software` table (fewer sets and scenarios, still failing unpatched) is the
# default; --smoke-table full asks for everything anyway.

TABLE_ENV = "DFBUILD_SMOKE_TABLE"
TABLES = ("auto", "full", "software")
SHADER_CACHE_DIR_ENV = "MESA_SHADER_CACHE_DIR"


@dataclass(frozen=True)
class Plan:
    """What one smoke run of a backend will be: run_smoke(**plan.run_kwargs())."""

    backend: str
    sets: tuple[str, ...]
    scenarios: tuple[str, ...]
    table: str                  # full | software | custom (sets or scenarios given)
    device: str | None          # the listed device the smoke runs on (memory figures left out), if any
    start_timeout: float
    server_args: tuple[str, ...]
    env: dict
    identity: dict
    note: str = ""              # why auto-detection could not decide, if it could not
    ran_on: str = "the CPU backend"   # in words, for the manifest: the device, or why the CPU
    cpu_fallback: bool = False  # a GPU backend with no device, run on the CPU backend because the user asked

    def run_kwargs(self) -> dict:
        return {"sets": list(self.sets), "scenarios": list(self.scenarios), "extra_server_args": self.server_args,
                "env": dict(self.env), "start_timeout": self.start_timeout, "identity": dict(self.identity),
                "table": self.table, "device": self.device, "ran_on": self.ran_on, "cpu_fallback": self.cpu_fallback}

    def memo_key(self, payload_digest: str, fixtures_section: dict) -> str:
        return memo.memo_key(payload_digest, fixtures_section, self.backend, self.sets, self.scenarios, self.identity,
                        ran_on=self.ran_on if (self.device or self.cpu_fallback) else None)


def start_timeout_for(how, override: float | None = None) -> float:
    """--start-timeout, else $DFBUILD_START_TIMEOUT, else the backend table's, else 180 s."""
    value: float | str
    if override is not None:
        value, source = override, "--start-timeout"
    elif os.environ.get(START_TIMEOUT_ENV, "").strip():
        value, source = os.environ[START_TIMEOUT_ENV].strip(), f"${START_TIMEOUT_ENV}"
    else:
        value, source = how.smoke_runtime.get("start_timeout_s", DEFAULT_START_TIMEOUT), "the backend table"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or math.isinf(seconds):
        raise errors.UsageError(f"{source}: {value!r} is not a number of seconds",
                                "give a positive number, e.g. --start-timeout 1800")
    return seconds


def identity_for(how) -> dict:
    rule = how.smoke_runtime.get("identity", "exact")
    if rule not in IDENTITY_RULES:
        raise errors.UsageError(f"backend {how.name}: unknown identity rule {rule!r}",
                                f"use one of: {', '.join(IDENTITY_RULES)}")
    if rule == "near-tie":
        return {"rule": rule, "near_tie_logprob": float(how.smoke_runtime.get("near_tie_logprob", 0.02))}
    return dict(EXACT)


def smoke_env_for(how) -> dict:
    """The backend's smoke environment, plus a persistent Mesa shader cache where the table asks
    for one: a cold cache costs minutes per run on lavapipe, a warm one seconds. A user's own
    MESA_SHADER_CACHE_DIR (CI points it at its cached folder) wins."""
    env = dict(how.smoke_env)
    if how.smoke_runtime.get("shader_cache") == "mesa" and not os.environ.get(SHADER_CACHE_DIR_ENV):
        env.setdefault(SHADER_CACHE_DIR_ENV, str(paths.cache_dir() / "mesa-shader-cache"))
    return env


def _check_table(table: str) -> str:
    if table not in TABLES:
        raise errors.UsageError(f"unknown smoke table {table!r}", f"use one of: {', '.join(TABLES)}")
    return table


def plan(how, build_dir: Path, options: SmokeOptions | None = None, *, sets=None, scenarios=None,
         release: int | None = None) -> Plan:
    """The smoke run of backend HOW (a backends.Backend) on BUILD_DIR's llama-server.

    A GPU backend (one with a smoke.device table: cuda, vulkan, hip) lists
    `llama-server --list-devices` first and runs on the first device of its kind.
    With none, NoDeviceError (exit 45) names what is missing, unless
    OPTIONS.allow_cpu_fallback: then the smoke runs on the CPU backend and says so
    (ran_on, cpu_fallback), in the manifest and in the key of a remembered pass.

    OPTIONS (a request's smoke options; the defaults without it) also say the start timeout and
    the table: "full" (every default set and scenario), "software" (the backend's
    smaller table for software devices), or "auto" (the default; also from
    $DFBUILD_SMOKE_TABLE): software when the device is a software device the
    table lists, full otherwise. SETS / SCENARIOS, when given, replace that
    dimension of the table.
    """
    options = options or SmokeOptions()
    start_timeout, allow_cpu_fallback = options.start_timeout, options.allow_cpu_fallback
    table = _check_table(options.table or os.environ.get(TABLE_ENV, "").strip() or "auto")
    software = how.smoke_software
    if table == "software" and not software:
        raise errors.UsageError(f"the {how.name} backend has no software-device smoke table",
                                "use --smoke-table full (or auto)")
    env = smoke_env_for(how)
    device, note, ran_on, fallback = None, "", "the CPU backend", False
    if how.smoke_device or (table == "auto" and software):
        lines: list[str]
        try:
            lines = devices.list_devices(server_binary(build_dir), env)
            why = "`llama-server --list-devices` lists none"
        except (OSError, proc.SubprocessError) as exc:
            note = f"could not list devices ({exc})"
            lines, why = [], f"`llama-server --list-devices` could not say ({exc})"
        mine = devices.backend_devices(how, lines) if how.smoke_device else lines
        if how.smoke_device and not mine and devices.backend_said(how, getattr(lines, "said", ())):
            # e.g. no ROCm-capable device
            why += "; it said: " + " / ".join(devices.backend_said(how, getattr(lines, "said", ())))
        if mine:
            names = [n.lower() for n in software.get("devices", ())]
            device = next((line for line in mine if any(n in line.lower() for n in names)), None)
            if table == "auto" and device is not None:
                table = "software"
            device = devices.device_name(device or mine[0])
            ran_on = device
        elif how.smoke_device:
            if not allow_cpu_fallback:
                raise devices.no_device_error(how, why, env, server_binary(build_dir))
            fallback = True
            ran_on = how.smoke_device.get("fallback", f"no {how.name} device here, ran on the CPU backend")
            note = f"{why}: --allow-cpu-fallback, so the smoke runs on the CPU backend ({ran_on})"
        elif note:
            note += "; running the full table"
    if table == "auto":
        table = "full"
    chosen_sets = tuple(software["sets"]) if table == "software" else DEFAULT_SETS
    chosen_scenarios = tuple(software["scenarios"]) if table == "software" else DEFAULT_SCENARIOS
    # RELEASE (the tree's llama.cpp build, when known): scenarios that do not apply to it are left out
    chosen_scenarios = tuple(name for name in chosen_scenarios if SCENARIOS[name].applies_to(release))
    if sets or scenarios:
        table = "custom"
    timeout = start_timeout_for(how, start_timeout)
    if start_timeout is None and not os.environ.get(START_TIMEOUT_ENV, "").strip():
        # a Windows build run here through Wine: its first start makes the Wine prefix
        timeout = max(timeout, exe_start_timeout(server_binary(build_dir)) or 0)
    return Plan(backend=how.name, sets=tuple(sets or chosen_sets), scenarios=tuple(scenarios or chosen_scenarios),
                table=table, device=device, start_timeout=timeout,
                server_args=tuple(how.smoke_server_args), env=env, identity=identity_for(how), note=note,
                ran_on=ran_on, cpu_fallback=fallback)
