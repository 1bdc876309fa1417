"""Passed smoke runs, remembered in dfbuild's cache by exactly what decides them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dfbuild.core import paths, state
from dfbuild.smoke.scenarios import DEFAULT_SCENARIOS, DEFAULT_SETS

# What a smoke section holds, in the key of a remembered pass: a release that reuses a pass recorded in an
# older layout would ship a manifest a fresh run does not write. 2: each scenario has begin_warnings.
RECORD_LAYOUT = 2


# --- passed runs, remembered by what decides them ---------------------------------------------
#
# A smoke run's outcome depends on the bytes of the binaries it ran, the bytes of
# the fixtures, the backend and the scenarios: nothing else. So a passed run is
# remembered in dfbuild's cache under a key made of exactly those, and any run on
# the same inputs (the release after a proof of the same binaries, a release of the
# same tree from another work folder) uses it instead of running again. Only
# passes are remembered: a failure is always run again.


def memo_key(payload_digest: str, fixtures_section: dict, backend: str, sets=None, scenarios=None,
             identity: dict | None = None, ran_on: str | None = None) -> str:
    """The key of a smoke run: binaries' and fixtures' content, backend, fixture sets, scenarios
    (and the identity rule where it is not exact: a looser rule's pass is not an exact one's), and
    for a GPU backend where it ran (RAN_ON: the device, or the CPU fallback): a pass on the CPU is
    no pass on the GPU, nor one on lavapipe a pass on an H200."""
    files = {name: f["sha256"] for name, f in fixtures_section.get("files", {}).items()}
    parts = [payload_digest, fixtures_section.get("seed"), files, backend,
             list(sets or DEFAULT_SETS), list(scenarios or DEFAULT_SCENARIOS), {"layout": RECORD_LAYOUT}]
    if identity and identity.get("rule", "exact") != "exact":
        parts.append(identity)
    if ran_on:
        parts.append({"ran_on": ran_on})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _memo_path(key: str) -> Path:
    return paths.cache_dir() / "smoke-passed" / f"{key}.json"


def recall(key: str) -> dict | None:
    """The smoke section of a passed run with this key, or None (never recorded, or unreadable)."""
    section = state.read_json(_memo_path(key), "remembered smoke result")
    return section if section.get("passed") is True else None


def remember(key: str, section: dict) -> None:
    """Record SECTION under KEY if it passed (written atomically: a reader sees all of it or nothing)."""
    if section.get("passed") is True and not section.get("skipped"):
        state.atomic_write_text(_memo_path(key), json.dumps(section, indent=2, sort_keys=True) + "\n")
