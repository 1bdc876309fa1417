"""Smoke scenarios: start the built llama-server on the fixtures and prove DFlash survives images.

Each scenario runs twice on a freshly started server (127.0.0.1, free port, its
own log file): once with the DFlash draft and once with `--spec-type none`. The
speculative run must answer HTTP 200 everywhere, stay alive, keep the known
failure lines out of its log, draft *and accept* on image requests when the
fixture set agrees, and produce greedy output byte-identical to the plain run.

One module per job:
- fixtures/: the tiny seeded GGUF targets, mmprojs, drafts and the test image (`dfbuild fixtures`)
- server: the llama-server process handle (binary, launcher, free port, start, /health, stop)
- client: one HTTP response (a stream judged by its events), SSE and /metrics parsing
- logscan: what a server log says (failure lines, zero-fill spans and which warned, the draft's candidates,
  begin() warnings)
- scenarios: the scenario table (steps, which fixture sets, server arguments)
- judge: the verdict on what one scenario observed, and the identity rule with the plain run
- run: the driver (run_smoke, run_scenario, the fixture load check)
- plan: how a backend runs its smoke (table, timeout, identity, environment, device)
- devices: `--list-devices`, a GPU backend's device, exit 45 without one
- memo: passed runs remembered by what decides them

The names below are the package's public face (`smoke.run_smoke`, `smoke.plan`...); a test
that patches a name patches it where it is used: `smoke.devices.list_devices`, `smoke.memo.RECORD_LAYOUT`.
Takes a build dir (its llama-server) and the request's smoke options; hands on the manifest's `smoke`
section.
"""

from __future__ import annotations

from dfbuild.smoke.client import Response, parse_sse, prometheus_counters
from dfbuild.smoke.devices import DeviceLines, backend_devices, backend_said, device_name, list_devices, no_device_error
from dfbuild.smoke.judge import (
    EXACT,
    IDENTITY_RULES,
    MAX_DISAGREE_ACCEPTANCE,
    MIN_ACCEPTANCE,
    N_PROBS,
    UPSTREAM_PATTERNS,
    identity_verdict,
    judge,
    upstream_symptom,
)
from dfbuild.smoke.logscan import (
    BEGIN_WARNING,
    DRAFT_CANDIDATE,
    FAILURE_PATTERNS,
    ZERO_FILL,
    ZERO_FILL_WARNED,
    begin_warnings,
    draft_trace,
    scan_log,
    tail,
    warned_fill_spans,
    zero_filled_spans,
)
from dfbuild.smoke.memo import RECORD_LAYOUT, memo_key, recall, remember
from dfbuild.smoke.plan import (
    SHADER_CACHE_DIR_ENV,
    TABLE_ENV,
    TABLES,
    Plan,
    identity_for,
    plan,
    smoke_env_for,
    start_timeout_for,
)
from dfbuild.smoke.run import fixtures_that_do_not_load, run_scenario, run_smoke, run_steps
from dfbuild.smoke.scenarios import (
    DEFAULT_SCENARIOS,
    DEFAULT_SETS,
    EDGE_SCENARIOS,
    N_PREDICT,
    SCENARIOS,
    SEED,
    SLOT_FILE,
    UNPATCHED_EXPECTATIONS,
    Scenario,
    Step,
    base_server_args,
)
from dfbuild.smoke.server import (
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_START_TIMEOUT,
    START_TIMEOUT_ENV,
    LlamaServer,
    exe_start_timeout,
    free_port,
    launcher_for,
    server_binary,
)

__all__ = [
    "BEGIN_WARNING", "DEFAULT_REQUEST_TIMEOUT", "DEFAULT_SCENARIOS", "DEFAULT_SETS", "DEFAULT_START_TIMEOUT",
    "DRAFT_CANDIDATE", "EDGE_SCENARIOS", "EXACT", "FAILURE_PATTERNS", "IDENTITY_RULES", "MAX_DISAGREE_ACCEPTANCE",
    "MIN_ACCEPTANCE", "N_PREDICT", "N_PROBS", "RECORD_LAYOUT", "SCENARIOS", "SEED", "SHADER_CACHE_DIR_ENV", "SLOT_FILE",
    "START_TIMEOUT_ENV", "TABLES", "TABLE_ENV", "UNPATCHED_EXPECTATIONS", "UPSTREAM_PATTERNS", "ZERO_FILL",
    "ZERO_FILL_WARNED", "DeviceLines", "LlamaServer", "Plan", "Response", "Scenario", "Step", "backend_devices",
    "backend_said", "base_server_args", "begin_warnings", "device_name", "draft_trace", "exe_start_timeout",
    "fixtures_that_do_not_load", "free_port", "identity_for", "identity_verdict", "judge", "launcher_for",
    "list_devices", "memo_key", "no_device_error", "parse_sse", "plan", "prometheus_counters", "recall", "remember",
    "run_scenario", "run_smoke", "run_steps", "scan_log", "server_binary", "smoke_env_for", "start_timeout_for", "tail",
    "upstream_symptom", "warned_fill_spans", "zero_filled_spans",
]
