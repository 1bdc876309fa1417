"""Smoke scenarios: start the built llama-server on the fixtures and prove DFlash survives images.

Each scenario runs twice on a freshly started server (127.0.0.1, free port, its
own log file): once with the DFlash draft and once with `--spec-type none`. The
speculative run must answer HTTP 200 everywhere, stay alive, keep the known
failure lines out of its log, draft *and accept* on image requests when the
fixture set agrees, and produce greedy output byte-identical to the plain run.

The server handle follows llama.cpp's tools/server/tests/utils.py: an argument
list, /health polled while the process is watched, and an unconditional stop
(terminate, then kill) that keeps the log for the failure message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import errors, fixtures, paths, proc, state

# --- the server handle ----------------------------------------------------------

# The backend table sets each backend's start timeout (smoke.runtime.start_timeout_s);
# a user raises it with --start-timeout or this variable.
DEFAULT_START_TIMEOUT = 180.0
DEFAULT_REQUEST_TIMEOUT = 300.0
START_TIMEOUT_ENV = "DFBUILD_START_TIMEOUT"
# What a smoke section holds, in the key of a remembered pass: a release that reuses a pass recorded in an
# older layout would ship a manifest a fresh run does not write. 2: each scenario has begin_warnings.
RECORD_LAYOUT = 2


def server_binary(build_dir: Path) -> Path:
    """`B/bin/llama-server` (`.exe` on Windows), as CMake lays it out; a Windows build made here
    (`--os windows` on Linux) has only the `.exe`, which runs through Wine (launcher_for)."""
    native, other = ("llama-server.exe", "llama-server") if sys.platform == "win32" else ("llama-server",
                                                                                           "llama-server.exe")
    path = Path(build_dir) / "bin" / native
    if not path.is_file() and (Path(build_dir) / "bin" / other).is_file():
        return Path(build_dir) / "bin" / other
    return path


def launcher_for(binary: Path) -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) that runs BINARY here: nothing for a native program; for a
    Windows .exe on Linux, Wine in a prefix of dfbuild's cache (platforms.windows); for a hip build
    made in the Debian forky root, that root (platforms.rocm_root); for an ELF program of another
    machine (arm64 on x64), qemu-user (platforms.linux_arm64)."""
    from .platforms import rocm_root

    in_root = rocm_root.launcher(Path(binary).parent.parent)
    if in_root:
        return in_root, {}
    module, host = _cross_runner(binary)
    if module is None:
        return [], {}
    env = module.run_env(host)
    if hasattr(module, "display_env"):  # a Windows Vulkan build: Wine with a display (platforms.windows)
        env.update(module.display_env(host, binary))
    return module.launcher(host), env


def _cross_runner(binary: Path):
    """(platform module, cross Host) whose runner starts BINARY here, or (None, None) for a native program."""
    from . import elf, platforms

    if Path(binary).suffix.lower() == ".exe":
        if sys.platform == "win32":
            return None, None
        from .platforms import windows

        return windows, platforms.target_host("windows")  # refused (exit 33) where no cross entry says how
    try:
        with open(binary, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return None, None
    machine = elf.machine(head)
    if machine is None or machine == elf.host_machine() or not sys.platform.startswith("linux"):
        return None, None
    host = platforms.by_elf_machine(machine)
    if host is None:
        raise errors.UnsupportedBackendError(f"{binary} is an ELF program for {machine}, which this "
                                             f"{elf.host_machine()} machine has no way to run",
                                             "run it on a machine of its kind")
    return platforms.cross(host), host


def exe_start_timeout(binary: Path) -> float | None:
    """The target's start timeout for a program that runs through a launcher (Wine's first start
    makes its prefix; qemu emulates every instruction), or None for a native one."""
    module, host = _cross_runner(binary)
    return module.start_timeout(host) if module is not None else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Response:
    status: int
    body: dict | None
    text: str
    events: list[dict] = field(default_factory=list)  # parsed `data:` lines of a stream

    @property
    def error(self) -> str | None:
        """Why this response failed, judged by its events for a stream (a failed
        stream still arrives behind a 200 status line)."""
        if self.status != 200:
            return f"HTTP {self.status}: {self.text[:300]}"
        for event in self.events:
            if "error" in event:
                return f"stream error event: {json.dumps(event['error'])[:300]}"
        if self.body is None and not self.events:
            return f"unreadable body: {self.text[:300]}"
        return None

    @property
    def content(self) -> str:
        if self.events:
            return "".join(e.get("content", "") for e in self.events)
        return (self.body or {}).get("content", "")

    @property
    def probabilities(self) -> list[dict]:
        """`completion_probabilities` of the generated tokens (asked for with n_probs)."""
        if self.events:
            return [p for e in self.events for p in e.get("completion_probabilities") or []]
        return list((self.body or {}).get("completion_probabilities") or [])

    @property
    def timings(self) -> dict:
        if self.events:
            for event in reversed(self.events):
                if "timings" in event:
                    return event["timings"]
            return {}
        return (self.body or {}).get("timings", {})


class LlamaServer:
    """A llama-server process on 127.0.0.1, used as a context manager.

    `args` are the model/feature arguments; host, port and nothing else are added
    here. Inherited LLAMA_ARG_* variables are dropped so the user's shell cannot
    change what a smoke test runs.
    """

    def __init__(self, binary: Path, args: list[str], log_path: Path, *, env: dict | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT, stop_timeout: float = 10.0, host: str = "127.0.0.1",
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.binary = Path(binary)
        # a Windows .exe on Linux runs through Wine: that prefix, and Wine's environment
        self.launcher, launch_env = launcher_for(self.binary) if self.binary.is_file() else ([], {})
        self.args = [str(a) for a in args]
        self.log_path = Path(log_path)
        self.host = host
        self.port: int | None = None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.request_timeout = request_timeout
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.env = base_env | launch_env | (env or {})
        self.process: proc.Popen | None = None
        self._log_file = None

    @property
    def command(self) -> list[str]:
        return [*self.launcher, str(self.binary), *self.args, "--host", self.host, "--port", str(self.port)]

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    BIND_ATTEMPTS = 3

    def start(self) -> LlamaServer:
        """Start and wait for /health; a port taken between probe and bind gets a new port."""
        for attempt in range(1, self.BIND_ATTEMPTS + 1):
            try:
                return self._start_once()
            except errors.ServerStartError:
                if attempt == self.BIND_ATTEMPTS or "couldn't bind" not in self.log_text():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> LlamaServer:
        if not self.binary.is_file():
            raise errors.ServerStartError(f"no llama-server at {self.binary}",
                                          hint="build it first (`dfbuild build`) or pass the right --build-dir")
        self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self._log_file.write(("$ " + " ".join(self.command) + "\n").encode())
        self._log_file.flush()
        self.process = proc.start(self.command, stdout=self._log_file, stderr=proc.STDOUT, stdin=proc.DEVNULL,
                                  env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.alive():
                code = self.process.returncode
                self.stop()
                raise errors.ServerStartError(
                    f"llama-server exited with code {code} before it was healthy; log {self.log_path}:\n"
                    + tail(self.log_text(), 15),
                    hint="read the log above: a model that does not load, or a flag this build does not know")
            try:
                if self.request("GET", "/health", timeout=5).status == 200:
                    return self
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                self.stop()
                raise errors.ServerStartError(
                    f"llama-server was not healthy after {self.start_timeout:.0f}s; log {self.log_path}:\n"
                    + tail(self.log_text(), 15),
                    hint=f"a slow device (a cold shader cache) or a hung load: read the log, or give it longer "
                         f"with --start-timeout SECONDS (or ${START_TIMEOUT_ENV}) on smoke, prove or release")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """Terminate, then kill; always safe to call. Returns the exit code."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=self.stop_timeout)
                except proc.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_text(self, offset: int = 0) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")

    def request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None) -> Response:
        timeout = self.request_timeout if timeout is None else timeout
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url(path), data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        text = raw.decode("utf-8", errors="replace")
        body, events = None, []
        if payload is not None and payload.get("stream"):
            events = parse_sse(text)
        else:
            try:
                body = json.loads(text)
            except ValueError:
                body = None
        return Response(status, body if isinstance(body, dict) else None, text, events)


def parse_sse(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            event = {"error": {"message": f"unparseable event: {data[:200]}"}}
        events.append(event if isinstance(event, dict) else {"error": {"message": data[:200]}})
    return events


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def prometheus_counters(text: str) -> dict[str, float]:
    """`llamacpp:name value` lines of /metrics, without the prefix."""
    counters = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            counters[name.split(":", 1)[-1]] = float(value)
        except ValueError:
            continue
    return counters


# --- log scanning -------------------------------------------------------------------

# Lines that mean the speculative path broke, whatever the HTTP status said.
FAILURE_PATTERNS = {
    # llama_decode(ctx_dft) in DFlash v1 trees; llama_process(ctx_dft) from about b11400 on
    "draft decode failed": re.compile(r"llama_(decode|process)\(ctx_dft\) failed"),
    "inconsistent positions": re.compile(r"inconsistent sequence positions"),
    "mtmd chunk failed": re.compile(r"failed to (process|decode) mtmd chunk"),
    "speculative batch failed": re.compile(r"failed to process speculative batch"),
    "assertion": re.compile(r"GGML_ASSERT|GGML_ABORT"),
}


# the draft's zero-fill debug line, one wording in every variant ("zero-filling draft positions [a, b)",
# after the SPC_DBG prefix where the base has the macro, or after the function name)
ZERO_FILL = re.compile(r"zero-filling draft positions \[(\d+), (\d+)\)")


def zero_filled_spans(text: str) -> list[tuple[int, int]]:
    """Every draft-position span a server log says was mirrored as zero rows."""
    return [(int(a), int(b)) for a, b in ZERO_FILL.findall(text)]


# begin()'s warning in DFlash's draft implementation, upstream's one wording from b9837 to b11434
# (LOG_WRN; no patch of the series touches it): the draft cache ends before the prompt does. Only
# at warning level, not the same words demoted to debug (a "D" line at -v): an optional timestamp,
# then "W " where the log shows levels.
BEGIN_WARNING = re.compile(r"^(?:[0-9.]+ )?(?:W )?begin: ctx_dft pos_max=(-?\d+) < N-1=(\d+) - "
                           r"process\(\) did not run on every prefill ubatch", re.MULTILINE)


def begin_warnings(text: str) -> list[tuple[int, int]]:
    """(draft pos_max, N-1) of every begin() warning a log prints at warning level."""
    return [(int(a), int(b)) for a, b in BEGIN_WARNING.findall(text)]


def scan_log(text: str) -> list[dict]:
    """Every failure line in a server log, with the pattern that caught it."""
    findings = []
    for number, line in enumerate(text.splitlines(), 1):
        for label, pattern in FAILURE_PATTERNS.items():
            if pattern.search(line):
                findings.append({"pattern": label, "line": number, "text": line.strip()[:400]})
                break
    return findings


# --- scenarios ------------------------------------------------------------------------

TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Once more: the quick brown fox"
N_PREDICT = 16
SEED = 42


@dataclass(frozen=True)
class Step:
    """One /completion request. `text` holds {media} markers, `images` names fixture images."""

    label: str
    text: str
    images: tuple[str, ...] = ()
    stream: bool = False
    parallel_group: int | None = None  # steps with the same group are sent concurrently
    endpoint: str = "/completion"  # or "/v1/embeddings" (the prompt as its input; nothing is generated)

    @property
    def has_image(self) -> bool:
        return bool(self.images)


def _image_prompt(tag: str) -> str:
    # text after the image: a prompt that *ends* with an image aborts upstream
    # servers with GGML_ASSERT(batch.size() > 0), a separate known bug.
    return f"USER: look {tag} {{media}}\nwhat is in the picture? ASSISTANT: it shows"


TEXT = Step("text", TEXT_PROMPT)
TEXT_STREAM = Step("text-stream", TEXT_PROMPT, stream=True)
IMAGE = Step("image", _image_prompt("here"), ("small",))
IMAGE_STREAM = Step("image-stream", _image_prompt("again"), ("small",), stream=True)
TEXT_AFTER = Step("text-after-image", "And now some plain text after that picture, then")
TWO_IMAGES = Step("two-images", "USER: first {media} and second {media}\ncompare them. ASSISTANT: the first", ("small", "large"))
LARGE_IMAGE = Step("large-image", _image_prompt("big"), ("large",))
PREFIX_TEXT_A = Step("prefix-text-a", TEXT_PROMPT)
PREFIX_TEXT_B = Step("prefix-text-b", TEXT_PROMPT + " jumps over the lazy dog again and")
PREFIX_IMAGE_A = Step("prefix-image-a", _image_prompt("cached"), ("small",))
PREFIX_IMAGE_B = Step("prefix-image-b", _image_prompt("cached") + " a small picture of", ("small",))
EMBED_IMAGE = Step("embeddings-image", _image_prompt("embedded"), ("small",), endpoint="/v1/embeddings")

# slot-restore: a prompt the target restores from a file and the draft never processed
SLOT_FILE = "dfbuild-smoke-slot.bin"
RESTORE_PROMPT = " ".join(f"item {i} is a word" for i in range(40))  # about 700 tokens: many ubatches
RESTORE_STEPS = (
    Step("restore-long", RESTORE_PROMPT),
    Step("slot-save", "", endpoint="/slots/0?action=save"),
    Step("slot-erase", "", endpoint="/slots/0?action=erase"),
    Step("restore-other", "short other prompt"),  # the draft cache now holds another prompt's start
    Step("slot-restore", "", endpoint="/slots/0?action=restore"),
    Step("restored-prefix", RESTORE_PROMPT + " and then more words follow"),
)


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    server_args: tuple[str, ...] = ()
    description: str = ""
    # only on fixture sets whose image rows take one position each (a llama target), where
    # upstream injects them from b10355 on: there no image's span may reach the draft as zero-fill
    linear_images_only: bool = False
    since_build: int | None = None  # the first llama.cpp release it applies to (None: every one)
    projectors: tuple[str, ...] = ()  # only on fixture sets with one of these projectors (empty: every set)
    # a line the speculative server's log must show, or the scenario never reached its case
    expect_log: str | None = None
    archs: tuple[str, ...] = ()  # only on fixture sets whose target has one of these architectures
    slot_save: bool = False  # the server gets a --slot-save-path of its own (the slot actions' folder)

    def applies_to(self, release: int | None) -> bool:
        """Unknown releases (a PR head, an imported tree) run it: better a check too many."""
        return self.since_build is None or release is None or release >= self.since_build

    def runs_on(self, fixture_set: dict) -> bool:
        if self.projectors and fixture_set.get("projector") not in self.projectors:
            return False
        if self.archs and fixture_set.get("arch") not in self.archs:
            return False
        return not (self.linear_images_only and fixture_set.get("reproduces_bug", True))


_SEQUENCE = (TEXT, IMAGE, TEXT_AFTER, TWO_IMAGES, PREFIX_IMAGE_A, PREFIX_IMAGE_B)

SCENARIOS = {s.name: s for s in (
    Scenario("text", (TEXT, TEXT_STREAM), description="plain text, plain and streamed"),
    Scenario("image", (IMAGE, IMAGE_STREAM), description="one image, text after it; plain and streamed"),
    Scenario("text-after-image", (IMAGE, TEXT_AFTER), description="a text request after an image request"),
    Scenario("two-images", (TWO_IMAGES,), description="two images in one request"),
    Scenario("large-image", (LARGE_IMAGE, TEXT_AFTER), server_args=("-b", "8", "-ub", "8"),
             description="an image larger than one ubatch (-b 8 -ub 8)"),
    Scenario("prefix-reuse", (PREFIX_TEXT_A, PREFIX_TEXT_B, PREFIX_IMAGE_A, PREFIX_IMAGE_B),
             description="cache_prompt reuses a text prefix, then a prefix that holds an image"),
    Scenario("parallel", (
        Step("parallel-image", _image_prompt("slot"), ("small",), parallel_group=1),
        Step("parallel-text", TEXT_PROMPT, parallel_group=1),
        Step("parallel-image-2", _image_prompt("other"), ("large",), parallel_group=2),
        Step("parallel-image-3", _image_prompt("both"), ("small",), parallel_group=2),
    ), server_args=("-np", "2"), description="-np 2: concurrent image and text requests"),
    Scenario("repeat", _SEQUENCE * 3, description="the whole sequence three times on one server"),
    # -v prints the draft's debug log, where a zero-filled span names its positions. On a
    # target whose image rows take one position each (linear rope) nothing leaves a hole on a
    # fresh server, so any zero-fill there means an image's rows reached the draft as zeros
    # instead of the target's features. Before b10355 upstream's process() leaves every image
    # out of the draft by itself, so the scenario starts there.
    Scenario("linear-image", (IMAGE, TEXT_AFTER, TWO_IMAGES), server_args=("-v",),
             description="images with linear positions reach the draft with the target's features (no zero-fill)",
             linear_images_only=True, since_build=10355),
    # The two edge cases of embedding-skip's test (issue 29). It compares the first and last row
    # of each batch process() sees, and mtmd hands it the image in n_batch pieces: the grid
    # projector's small image is 9 rows on one temporal position, so -b 8 gives a last piece of
    # ONE row, which no first/last test can tell from a text token: it is injected at the pinned
    # position after its 8 siblings were skipped. -v: mtmd logs its pieces only at -v.
    Scenario("single-row-chunk", (IMAGE, TEXT_AFTER), server_args=("-b", "8", "-ub", "8", "-v"),
             description="an M-RoPE image whose last -b 8 piece holds one row (injected; its siblings skipped)",
             projectors=("qwen2vl_merger",), expect_log=r"n_tokens_batch = 1\b"),
    # process() reads a batch's kind from its first entry (common_batch::has_token/has_embd). The
    # server builds one batch of text tokens and image rows only for an embeddings task on a
    # target without causal attention (server_context::use_mixed_batch, add_prompt_mixed), and
    # hands it to process() when a draft is loaded. llama-server has no --attention flag: the
    # target's own GGUF key says non-causal.
    Scenario("mixed-batch", (EMBED_IMAGE,),
             server_args=("--embeddings", "--pooling", "mean", "--override-kv", "qwen35.attention.causal=bool:false"),
             description="one batch of text tokens and image rows (embeddings, non-causal target) reaches the draft",
             projectors=("qwen2vl_merger",)),
    # A prompt prefix the draft never processed (issue 29's "real miss"). llama-server's slot
    # restore (POST /slots/0?action=restore) loads the target's cache from a file and leaves the
    # draft's as it was: here holding the start of another prompt, so the next request reuses a
    # restored prefix of ~700 tokens the draft never saw and its first batch starts past the
    # draft's last position. A text-only case: it needs a target that reuses a partial prefix
    # (a llama target; the hybrid qwen35 re-processes the whole prompt after a restore, so no
    # hole opens there). -v: the server's "cached n_tokens" line shows the restored prefix was
    # reused (the case), and the draft's zero-fill line what the series did about it.
    Scenario("slot-restore", RESTORE_STEPS, server_args=("-v",),
             description="a slot restored from a file: the target reuses a prefix the draft never processed",
             archs=("llama",), slot_save=True, expect_log=r"cached n_tokens = [1-9]\d*, memory_seq_rm"),
)}

# the edge cases run when asked for (--scenario), not in every proof and release
EDGE_SCENARIOS = ("single-row-chunk", "mixed-batch", "slot-restore")
DEFAULT_SCENARIOS = tuple(name for name in SCENARIOS if name not in EDGE_SCENARIOS)
# The control, then the shapes of the bug: both projectors with the plain-rope draft
# (fails on b10359 and b11312), and the rope-sections draft that b11312 honours.
# The random set checks greedy equality where the output is not one repeated letter.
DEFAULT_SETS = ("llama-mlp-agree", "qwen35-mlp-plain-agree", "qwen35-grid-plain-agree", "qwen35-grid-sections-agree",
                "qwen35-grid-plain-random")

MIN_ACCEPTANCE = 0.9
MAX_DISAGREE_ACCEPTANCE = 0.1


def base_server_args(fixture_set: dict, *, speculative: bool) -> list[str]:
    """One thread: the models are tiny, and ggml's spinning workers on a busy machine
    (2 cores, a build next door) turned 15 s runs into 5 minutes with -t 2."""
    args = ["-m", fixture_set["target"], "--mmproj", fixture_set["mmproj"],
            "-c", "2048", "-np", "1", "-t", "1", "--metrics", "--no-webui"]
    if speculative:
        args += ["-md", fixture_set["draft"], "--spec-type", "draft-dflash"]
    else:
        args += ["--spec-type", "none"]
    return args


def _merge_args(base: list[str], extra: tuple[str, ...] | list[str]) -> list[str]:
    """Later flags win: drop a base flag (and its value) that `extra` sets again."""
    extra = list(extra)
    overridden = {a for a in extra if a.startswith("-")}
    merged, skip = [], False
    for i, arg in enumerate(base):
        if skip:
            skip = False
            continue
        if arg in overridden:
            skip = i + 1 < len(base) and not base[i + 1].startswith("-")
            continue
        merged.append(arg)
    return merged + extra


def _payload(step: Step, marker: str, images: dict[str, str], n_probs: int = 0) -> dict:
    prompt_text = step.text.replace("{media}", marker)
    prompt: object = prompt_text
    if step.images:
        prompt = {"prompt_string": prompt_text,
                  "multimodal_data": [base64.b64encode(Path(images[i]).read_bytes()).decode() for i in step.images]}
    if step.endpoint.startswith("/slots/"):
        return {"filename": SLOT_FILE}  # save and restore name the file; erase ignores it
    if step.endpoint != "/completion":
        return {"input": prompt}
    payload = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1, "seed": SEED,
               "cache_prompt": True, "ignore_eos": True, "stream": step.stream}
    if n_probs:
        # the pre-sampling top candidates of each generated token (the plain run's,
        # for the near-tie identity rule); it does not change what is generated
        payload["n_probs"] = n_probs
    return payload


def _metrics(server: LlamaServer) -> dict[str, float]:
    try:
        resp = server.request("GET", "/metrics", timeout=10)
    except OSError:
        return {}
    return prometheus_counters(resp.text) if resp.status == 200 else {}


DRAFTED = "spec_decode_num_draft_tokens_total"
ACCEPTED = "spec_decode_num_accepted_tokens_total"


def _compact_probs(entries: list[dict]) -> list[dict]:
    """Each generated token's bytes and its top candidates' (bytes, logprob), nothing else."""
    def piece(entry: dict) -> list[int]:
        raw = entry.get("bytes")
        return list(raw) if isinstance(raw, list) else list(str(entry.get("token", "")).encode())

    def logprob(entry: dict) -> float:
        if "logprob" in entry:
            return float(entry["logprob"])
        prob = float(entry.get("prob", 0.0))  # post-sampling form
        return math.log(prob) if prob > 0 else -math.inf

    return [{"bytes": piece(e),
             "top": [[piece(c), logprob(c)] for c in (e.get("top_logprobs") or e.get("top_probs") or [])]}
            for e in entries]


def _run_step(server: LlamaServer, step: Step, marker: str, images: dict[str, str], n_probs: int = 0) -> dict:
    log_offset = server.log_size()
    started = time.monotonic()
    try:
        resp = server.request("POST", step.endpoint, _payload(step, marker, images, n_probs))
        error = resp.error
    except OSError as exc:  # connection reset: the server died under the request
        resp, error = None, f"no response: {exc}"
    timings = resp.timings if resp else {}
    extra = {"probs": _compact_probs(resp.probabilities) if resp else []} if n_probs else {}
    return {
        **extra,
        "label": step.label,
        "image": step.has_image,
        "generates": step.endpoint == "/completion",
        "stream": step.stream,
        "status": resp.status if resp else None,
        "error": error,
        "content": resp.content if resp else None,
        "draft_n": int(timings.get("draft_n", 0)),
        "draft_n_accepted": int(timings.get("draft_n_accepted", 0)),
        "wall_s": round(time.monotonic() - started, 3),
        "log_offset": log_offset,
    }


def run_steps(server: LlamaServer, steps: tuple[Step, ...], images: dict[str, str], n_probs: int = 0) -> list[dict]:
    """Send the steps in order (a parallel group at once), reading the draft counters around each."""
    props = server.request("GET", "/props", timeout=30)
    marker = (props.body or {}).get("media_marker", "<__media__>")
    results: list[dict] = []
    i = 0
    while i < len(steps):
        group = [steps[i]]
        while (steps[i].parallel_group is not None and i + len(group) < len(steps)
               and steps[i + len(group)].parallel_group == steps[i].parallel_group):
            group.append(steps[i + len(group)])
        before = _metrics(server)
        if len(group) == 1:
            outcomes = [_run_step(server, group[0], marker, images, n_probs)]
        else:
            outcomes = [None] * len(group)

            def worker(k: int) -> None:
                outcomes[k] = _run_step(server, group[k], marker, images, n_probs)

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(group))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        after = _metrics(server)
        for outcome in outcomes:
            outcome["metrics_drafted_before"] = before.get(DRAFTED)
            outcome["metrics_accepted_before"] = before.get(ACCEPTED)
            outcome["metrics_drafted_after"] = after.get(DRAFTED)
            outcome["metrics_accepted_after"] = after.get(ACCEPTED)
        results.extend(outcomes)
        i += len(group)
    return results


# --- identity with the plain run ---------------------------------------------------------
#
# On CPU (and CUDA) drafted and plain greedy decoding give byte-identical output:
# "exact". On a device whose arithmetic depends on the batch shape (Vulkan, and
# lavapipe above all) the drafted run verifies tokens in batches while the plain
# run decodes one by one, so where the target's top two candidates are nearly tied
# the two runs may pick different tokens without any bug. "near-tie" tells that
# noise from a real divergence at the *first* differing token (everything after it
# follows from different text, so it says nothing):
# - the plain run's top candidates there are within `near_tie_logprob` nats, and
# - the drafted run picked one of those near-tied candidates.
# Anything else (a decisive position, a token the plain run did not rank near the
# top, a shorter output) fails as on CPU. The plain run is asked for its top
# candidates (n_probs), which changes nothing about what it generates.

IDENTITY_RULES = ("exact", "near-tie")
N_PROBS = 4  # candidates the plain run reports per token under "near-tie"
EXACT = {"rule": "exact"}


def identity_verdict(drafted: str, plain: str, plain_probs: list[dict], near_tie_logprob: float) -> dict:
    """Is DRAFTED's difference from PLAIN device noise? `plain_probs` is `_compact_probs` of the plain run.

    Returns {"noise": bool, "why": words, ...where it differs and by what margin}.
    """
    d_bytes, p_bytes = drafted.encode(), plain.encode()
    first = next((i for i, (x, y) in enumerate(zip(d_bytes, p_bytes)) if x != y), min(len(d_bytes), len(p_bytes)))
    offset = 0
    for index, entry in enumerate(plain_probs):
        piece = bytes(entry["bytes"])
        if offset + len(piece) > first:
            break
        offset += len(piece)
    else:
        return {"noise": False, "why": f"the outputs differ at byte {first}, past the plain run's reported tokens"}
    candidates = sorted(entry["top"], key=lambda c: -c[1])
    where = {"token_index": index, "plain_token": piece.decode("utf-8", "replace"),
             "drafted_text": d_bytes[offset:offset + 8].decode("utf-8", "replace")}
    if len(candidates) < 2:
        return {"noise": False, **where, "why": f"token {index}: the plain run reported no runner-up to compare with"}
    best = candidates[0][1]
    margin = best - candidates[1][1]
    where["margin"] = round(margin, 6)
    tied = [bytes(c[0]) for c in candidates[1:] if best - c[1] <= near_tie_logprob]
    picked = next((c for c in tied if c and d_bytes[offset:].startswith(c)), None)
    if picked is not None:
        return {"noise": True, **where, "drafted_token": picked.decode("utf-8", "replace"),
                "why": f"token {index}: a near-tie ({margin:.4g} nats between the top two), and the drafted run "
                       f"picked a near-tied candidate"}
    if not tied:
        why = (f"token {index}: the plain run's top two are {margin:.4g} nats apart, more than the "
               f"{near_tie_logprob:g} a near-tie may differ by: a real divergence")
    else:
        why = (f"token {index}: a near-tie ({margin:.4g} nats), but the drafted run picked "
               f"{where['drafted_text']!r}, not one of the near-tied candidates: a real divergence")
    return {"noise": False, **where, "why": why}


# --- judging ---------------------------------------------------------------------------


def judge(fixture_set: dict, spec_steps: list[dict], base_steps: list[dict] | None, *,
          alive: bool, log_findings: list[dict], identity: dict | None = None) -> dict:
    """Pure verdict over what one scenario observed; every reason it failed, in words.

    IDENTITY is the rule for comparing with the plain run ({"rule": "exact"} by
    default; "near-tie" with its near_tie_logprob, see identity_verdict).
    """
    identity = identity or EXACT
    failures = []
    for step in spec_steps:
        if step["error"]:
            failures.append(f"{step['label']}: {step['error']}")
    if not alive:
        failures.append("llama-server died during the scenario")
    for finding in log_findings:
        failures.append(f"log: {finding['pattern']}: {finding['text']}")

    image_steps = [s for s in spec_steps if s["image"] and not s["error"] and s.get("generates", True)]
    drafted = sum(s["draft_n"] for s in spec_steps)
    accepted = sum(s["draft_n_accepted"] for s in spec_steps)
    image_drafted = sum(s["draft_n"] for s in image_steps)
    image_accepted = sum(s["draft_n_accepted"] for s in image_steps)
    acceptance = accepted / drafted if drafted else None
    image_acceptance = image_accepted / image_drafted if image_drafted else None

    agree = fixture_set.get("agree")
    if agree is True:
        for s in image_steps:
            if s["draft_n"] == 0:
                failures.append(f"{s['label']}: no drafts on an image request")
            elif s["draft_n_accepted"] == 0:
                failures.append(f"{s['label']}: drafts on an image request, none accepted")
        if drafted == 0:
            if any(s.get("generates", True) for s in spec_steps):
                failures.append("no drafts at all")
        elif acceptance < MIN_ACCEPTANCE:
            failures.append(f"acceptance {acceptance:.2f} < {MIN_ACCEPTANCE} with an agreeing draft")
    elif agree is False and drafted and acceptance > MAX_DISAGREE_ACCEPTANCE:
        failures.append(f"acceptance {acceptance:.2f} > {MAX_DISAGREE_ACCEPTANCE} with a disagreeing draft: counters are wrong")

    identical = None
    near_ties = []
    if base_steps is not None:
        mismatched = [(s, b) for s, b in zip(spec_steps, base_steps)
                      if not s["error"] and not b["error"] and s["content"] != b["content"]]
        base_errors = [f"{b['label']}: {b['error']}" for b in base_steps if b["error"]]
        identical = not mismatched and not base_errors and len(spec_steps) == len(base_steps)
        for s, b in mismatched:
            if identity["rule"] == "near-tie":
                found = identity_verdict(s["content"] or "", b["content"] or "", b.get("probs") or [],
                                         float(identity["near_tie_logprob"]))
                if found["noise"]:
                    near_ties.append({"label": s["label"], **found})  # recorded, never silent
                else:
                    failures.append(f"{s['label']}: output differs from --spec-type none; {found['why']}")
            else:
                failures.append(f"{s['label']}: output differs from --spec-type none")
        for err in base_errors:
            failures.append(f"baseline (--spec-type none) {err}")

    image_idx = [k for k, s in enumerate(spec_steps) if s["image"]]
    first, last = (spec_steps[image_idx[0]], spec_steps[image_idx[-1]]) if image_idx else (None, None)
    return {
        "passed": not failures,
        "failures": failures,
        "statuses": [s["status"] for s in spec_steps],
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(acceptance, 4) if acceptance is not None else None,
        "image_drafted": image_drafted,
        "image_accepted": image_accepted,
        "image_acceptance": round(image_acceptance, 4) if image_acceptance is not None else None,
        # the server's own /metrics totals around the image requests
        "drafted_before": first["metrics_drafted_before"] if first else None,
        "accepted_before": first["metrics_accepted_before"] if first else None,
        "drafted_after": last["metrics_drafted_after"] if last else None,
        "accepted_after": last["metrics_accepted_after"] if last else None,
        "identical_to_no_spec": identical,
        "identity_rule": identity["rule"],
        "near_ties": near_ties,  # differences accepted as device noise, each with its margin
        "alive": alive,
    }


UPSTREAM_PATTERNS = ("draft decode failed", "inconsistent positions", "mtmd chunk failed", "speculative batch failed")


def upstream_symptom(result: dict) -> bool:
    """Did this scenario fail the way the upstream bug fails (a 5xx, or a draft-side
    decode failure in the log), rather than some other way?"""
    server_error = any(
        (r["status"] or 0) >= 500 or (r["error"] or "").startswith("stream error event")
        for r in result["requests"]
    )
    decode_failure = any(f["pattern"] in UPSTREAM_PATTERNS for f in result["log_findings"])
    return server_error or decode_failure


def _excerpt(log_text: str, findings: list[dict], steps: list[dict], context: int = 3) -> str:
    """The log lines around the first failure line, or the tail after the first failed request."""
    lines = log_text.splitlines()
    if findings:
        n = findings[0]["line"] - 1
        return "\n".join(lines[max(0, n - context):n + context + 1])
    failed = next((s for s in steps if s["error"]), None)
    if failed:
        return failed["error"] + "\n" + tail(log_text, 8)
    return ""


# --- driver -----------------------------------------------------------------------------


def _run_server_scenario(binary: Path, args: list[str], log_path: Path, scenario: Scenario,
                         images: dict[str, str], env: dict | None, *, start_timeout: float = DEFAULT_START_TIMEOUT,
                         n_probs: int = 0) -> tuple[list[dict], bool, str]:
    # a device slow to start is slow to answer too (its first request compiles shaders)
    request_timeout = max(DEFAULT_REQUEST_TIMEOUT, start_timeout)
    with LlamaServer(binary, args, log_path, env=env, start_timeout=start_timeout,
                     request_timeout=request_timeout) as server:
        steps = run_steps(server, scenario.steps, images, n_probs)
        alive = server.alive()
        if alive:
            try:  # a server that still answers is alive, not merely not yet reaped
                alive = server.request("GET", "/health", timeout=10).status == 200
            except OSError:
                alive = False
    return steps, alive, log_path.read_text(encoding="utf-8", errors="replace")


def _slot_args(scenario: Scenario, folder: Path) -> list[str]:
    """--slot-save-path FOLDER (made here: llama-server takes only a folder that exists) for a
    scenario with slot actions; nothing for the others."""
    if not scenario.slot_save:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    return ["--slot-save-path", str(folder)]


def run_scenario(binary: Path, fixture_set_name: str, fixture_set: dict, scenario: Scenario, images: dict[str, str],
                 log_dir: Path, *, extra_server_args=(), env=None, compare_no_spec: bool = True,
                 baseline_cache: dict | None = None, start_timeout: float = DEFAULT_START_TIMEOUT,
                 identity: dict | None = None) -> dict:
    """One scenario on one fixture set: the speculative run, then (unless cached) the plain one.

    The plain run does not involve the draft, so sets that share a target and an
    mmproj share it: `baseline_cache` keeps it per (target, mmproj, scenario, args).
    """
    started = time.monotonic()
    spec_args = _merge_args(base_server_args(fixture_set, speculative=True),
                            [*scenario.server_args, *extra_server_args,
                             *_slot_args(scenario, log_dir / f"{scenario.name}--{fixture_set_name}--spec-slots")])
    spec_log = log_dir / f"{scenario.name}--{fixture_set_name}--spec.log"
    identity = identity or EXACT
    spec_steps, alive, log_text = _run_server_scenario(binary, spec_args, spec_log, scenario, images, env,
                                                       start_timeout=start_timeout)
    findings = scan_log(log_text)

    base_steps = None
    if compare_no_spec:
        # one slot folder for every set's plain run: sets that share a target share that run
        base_args = _merge_args(base_server_args(fixture_set, speculative=False),
                                [*scenario.server_args, *extra_server_args,
                                 *_slot_args(scenario, log_dir / f"{scenario.name}--nospec-slots")])
        key = (scenario.name, *base_args)
        cache = baseline_cache if baseline_cache is not None else {}
        if key not in cache:
            base_log = log_dir / f"{scenario.name}--{fixture_set_name}--nospec.log"
            n_probs = N_PROBS if identity["rule"] == "near-tie" else 0
            cache[key] = _run_server_scenario(binary, base_args, base_log, scenario, images, env,
                                              start_timeout=start_timeout, n_probs=n_probs)[0]
        base_steps = cache[key]

    result = judge(fixture_set, spec_steps, base_steps, alive=alive, log_findings=findings, identity=identity)
    spans = zero_filled_spans(log_text) if scenario.linear_images_only else []
    if scenario.expect_log and not re.search(scenario.expect_log, log_text):
        result["passed"] = False
        result["failures"].append(f"the scenario did not reach its case: no log line matches {scenario.expect_log!r}")
    if spans:
        result["passed"] = False
        result["failures"].append("image rows with linear positions reached the draft as zero-fill, not the "
                                  "target's features: draft positions " + ", ".join(f"[{a}, {b})" for a, b in spans))
    result.update({
        "zero_filled": [list(span) for span in spans],
        # begin()'s warning, recorded and never judged: (draft pos_max, N-1) of each (issue 29)
        "begin_warnings": [list(w) for w in begin_warnings(log_text)],
        "set": fixture_set_name,
        "scenario": scenario.name,
        "failure_excerpt": _excerpt(log_text, findings, spec_steps) if not result["passed"] else "",
        "upstream_symptom": None,
        "log_findings": findings[:20],
        "requests": [{k: v for k, v in s.items() if k != "log_offset"} for s in spec_steps],
        "log": str(spec_log),
        "server_args": spec_args,
        "wall_s": round(time.monotonic() - started, 2),
    })
    result["upstream_symptom"] = upstream_symptom(result)
    return result


def run_smoke(build_dir: Path, fixtures_dir: Path, *, sets=None, scenarios=None, log_dir=None,
              extra_server_args=(), env=None, compare_no_spec: bool = True, on_result=None,
              start_timeout: float | None = None, identity: dict | None = None, table: str | None = None,
              device: str | None = None, ran_on: str | None = None, cpu_fallback: bool = False) -> dict:
    """Run every scenario on every fixture set; return the smoke section.

    Fixtures are written into `fixtures_dir` when it has none. `on_result` is
    called with each scenario result as it lands (progress for the CLI).
    `plan(...).run_kwargs()` gives the backend's settings (server arguments,
    environment, start timeout, identity rule, table and the device it chose by).
    """
    start_timeout = float(start_timeout or DEFAULT_START_TIMEOUT)
    identity = identity or EXACT
    started = time.monotonic()
    binary = server_binary(build_dir)
    if not binary.is_file():
        raise errors.ServerStartError(f"no llama-server at {binary}",
                                      hint="build it first (`dfbuild build`) or pass the right --build-dir")
    section_fixtures = fixtures.ensure_fixtures(Path(fixtures_dir))
    set_names = list(sets or DEFAULT_SETS)
    scenario_names = list(scenarios or DEFAULT_SCENARIOS)
    for name in set_names:
        if name not in section_fixtures["sets"]:
            raise errors.FixtureError(f"unknown fixture set {name!r}",
                                      hint="choose from: " + ", ".join(section_fixtures["sets"]))
    for name in scenario_names:
        if name not in SCENARIOS:
            raise errors.SmokeFailedError(f"unknown scenario {name!r}", hint="choose from: " + ", ".join(SCENARIOS))
    log_dir = Path(log_dir) if log_dir else Path(fixtures_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, dict]] = {}
    baseline_cache: dict = {}
    for scenario_name in scenario_names:
        for set_name in set_names:
            if not SCENARIOS[scenario_name].runs_on(section_fixtures["sets"][set_name]):
                continue  # e.g. linear-image on an M-RoPE set, whose pinned images are zero-filled by design
            result = run_scenario(binary, set_name, section_fixtures["sets"][set_name], SCENARIOS[scenario_name],
                                  section_fixtures["images"], log_dir, extra_server_args=extra_server_args, env=env,
                                  compare_no_spec=compare_no_spec, baseline_cache=baseline_cache,
                                  start_timeout=start_timeout, identity=identity)
            results.setdefault(scenario_name, {})[set_name] = result
            if on_result:
                on_result(result)

    failed = [f"{sc}/{st}" for sc, by_set in results.items() for st, r in by_set.items() if not r["passed"]]
    return {
        "build_dir": str(build_dir),
        "server": str(binary),
        "fixtures_dir": str(fixtures_dir),
        "log_dir": str(log_dir),
        "sets": set_names,
        "scenarios": scenario_names,
        "table": table or ("full" if sets is None and scenarios is None else "custom"),
        "device": device,
        "ran_on": ran_on or device or "the CPU backend",   # in words: what verify and the release notes show
        "cpu_fallback": bool(cpu_fallback),                # a GPU backend run on the CPU, because the user asked
        "identity": identity,
        "start_timeout_s": start_timeout,
        "results": results,
        "failed": failed,
        "passed": not failed,
        "wall_s": round(time.monotonic() - started, 1),
    }


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
LIST_DEVICES_TIMEOUT = 120.0


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
        return memo_key(payload_digest, fixtures_section, self.backend, self.sets, self.scenarios, self.identity,
                        ran_on=self.ran_on if (self.device or self.cpu_fallback) else None)


def start_timeout_for(how, override: float | None = None) -> float:
    """--start-timeout, else $DFBUILD_START_TIMEOUT, else the backend table's, else 180 s."""
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


class DeviceLines(list):
    """list_devices' answer: the device lines, and (said) the server's own stderr lines about its backends."""

    said: tuple[str, ...] = ()


# e.g. "ggml_cuda_init: failed to initialize ROCm: no ROCm-capable device is detected",
# "ggml_vulkan: No devices found.": a line that names a backend and says what failed
_SAID = re.compile(r"\b(?:fail\w*|no\b|not found|cannot|unable)", re.IGNORECASE)


def backend_said(how, said) -> list[str]:
    """The lines of SAID (list_devices' stderr lines) in which HOW's backend says why it found no device."""
    names = [n.lower() for n in (*how.smoke_device.get("names", ()), how.name)]
    return [line for line in said if any(n in line.lower() for n in names) and _SAID.search(line)][:3]


def list_devices(binary: Path, env: dict | None = None, timeout: float = LIST_DEVICES_TIMEOUT) -> list[str]:
    """The device lines of `llama-server --list-devices` (e.g. "Vulkan0: llvmpipe (LLVM 19.1.7, 256 bits) ..."),
    as a DeviceLines whose `said` holds the server's stderr lines (a backend says there why it has no device).

    Raises OSError or a proc.SubprocessError when the binary cannot say.
    """
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    prefix, launch_env = launcher_for(binary)
    command = [*prefix, str(binary), "--list-devices"]
    done = proc.run(command, env=base_env | launch_env | (env or {}), stdin=proc.DEVNULL, errors="replace",
                    timeout=timeout)
    if done.returncode != 0:  # subprocess's own error: its message is what the smoke record says
        raise proc.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Available devices:"), None)
    if start is None:
        raise OSError("no 'Available devices:' in its output")
    # "(none)" is how llama-server says the list is empty
    found = DeviceLines(line.strip() for line in lines[start + 1:]
                        if line.startswith(" ") and line.strip() and line.strip() != "(none)")
    found.said = tuple(line.strip() for line in (done.stderr or "").splitlines() if line.strip())
    return found


_MEMORY = re.compile(r"\s*\(\d+ MiB, \d+ MiB free\)\s*$")


def device_name(line: str) -> str:
    """A device line without its memory figures (free memory changes from run to run):
    "Vulkan0: NVIDIA H200 (NVIDIA) (143771 MiB, 142000 MiB free)" -> "Vulkan0: NVIDIA H200 (NVIDIA)"."""
    return _MEMORY.sub("", line).strip()


def backend_devices(how, lines: list[str]) -> list[str]:
    """The device lines that are HOW's own devices (CUDA0, Vulkan1, ROCm0: a name of its table, then a number)."""
    names = how.smoke_device.get("names", ())
    pattern = re.compile(r"^(?:" + "|".join(re.escape(n) for n in names) + r")\d*:", re.IGNORECASE)
    return [line for line in lines if names and pattern.match(line)]


def _vk_driver_files_missing(env: dict) -> list[str]:
    """ICD files that VK_DRIVER_FILES / VK_ICD_FILENAMES name and that do not exist (the loader then finds none)."""
    missing = []
    for var in ("VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        value = env.get(var, os.environ.get(var, ""))
        for item in filter(None, value.split(os.pathsep)):
            if not Path(item).exists():
                missing.append(f"{var} names {item}, which does not exist")
    return missing


def no_device_error(how, why: str, env: dict, binary: Path | None = None) -> errors.NoDeviceError:
    """Exit 45: HOW's smoke found no device of its kind; the hint names what is missing."""
    hint = how.smoke_device.get("missing", f"install the {how.name} driver")
    module, host = _cross_runner(binary) if binary is not None else (None, None)
    under = module.device_hint(host, how.name) if module is not None and hasattr(module, "device_hint") else None
    if under:  # a Windows .exe under Wine reaches this machine's driver through Wine's own path
        hint = under + "; " + hint
    if how.name == "vulkan":
        named = _vk_driver_files_missing(env)
        if named:
            hint = "; ".join(named) + "; " + hint
    return errors.NoDeviceError(
        f"no {how.name} device: {why}, so the smoke would run on the CPU and prove nothing about the "
        f"{how.name} build", hint + "; or pass --allow-cpu-fallback to run it on the CPU backend, "
                                    "which the manifest then records")


def _check_table(table: str) -> str:
    if table not in TABLES:
        raise errors.UsageError(f"unknown smoke table {table!r}", f"use one of: {', '.join(TABLES)}")
    return table


def plan(how, build_dir: Path, *, table: str | None = None, start_timeout: float | None = None,
         sets=None, scenarios=None, release: int | None = None, allow_cpu_fallback: bool = False) -> Plan:
    """The smoke run of backend HOW (a backends.Backend) on BUILD_DIR's llama-server.

    A GPU backend (one with a smoke.device table: cuda, vulkan, hip) lists
    `llama-server --list-devices` first and runs on the first device of its kind.
    With none, NoDeviceError (exit 45) names what is missing, unless
    ALLOW_CPU_FALLBACK: then the smoke runs on the CPU backend and says so
    (ran_on, cpu_fallback), in the manifest and in the key of a remembered pass.

    TABLE: "full" (every default set and scenario), "software" (the backend's
    smaller table for software devices), or "auto" (the default; also from
    $DFBUILD_SMOKE_TABLE): software when the device is a software device the
    table lists, full otherwise. SETS / SCENARIOS, when given, replace that
    dimension of the table.
    """
    table = _check_table(table or os.environ.get(TABLE_ENV, "").strip() or "auto")
    software = how.smoke_software
    if table == "software" and not software:
        raise errors.UsageError(f"the {how.name} backend has no software-device smoke table",
                                "use --smoke-table full (or auto)")
    env = smoke_env_for(how)
    device, note, ran_on, fallback = None, "", "the CPU backend", False
    if how.smoke_device or (table == "auto" and software):
        try:
            lines = list_devices(server_binary(build_dir), env)
            why = "`llama-server --list-devices` lists none"
        except (OSError, proc.SubprocessError) as exc:
            note = f"could not list devices ({exc})"
            lines, why = [], f"`llama-server --list-devices` could not say ({exc})"
        mine = backend_devices(how, lines) if how.smoke_device else lines
        if how.smoke_device and not mine and backend_said(how, getattr(lines, "said", ())):
            why += "; it said: " + " / ".join(backend_said(how, lines.said))  # e.g. no ROCm-capable device
        if mine:
            names = [n.lower() for n in software.get("devices", ())]
            device = next((line for line in mine if any(n in line.lower() for n in names)), None)
            if table == "auto" and device is not None:
                table = "software"
            device = device_name(device or mine[0])
            ran_on = device
        elif how.smoke_device:
            if not allow_cpu_fallback:
                raise no_device_error(how, why, env, server_binary(build_dir))
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


def fixtures_that_do_not_load(binary: Path, fixtures_section: dict, log_dir: Path, *, sets=None,
                              env: dict | None = None, extra_server_args: tuple[str, ...] = (),
                              start_timeout: float | None = None) -> dict[str, str]:
    """Every fixture set, started in BINARY's llama-server with its draft: {set: why} for those that fail.

    A set loads when the server becomes healthy with the mmproj (a media marker)
    and the DFlash draft set up, and answers a plain text completion. A proof
    that some set cannot load in is no proof (a loader that refuses a fixture
    fails every scenario of it, patched or not), so `prove` runs this first.
    """
    problems: dict[str, str] = {}
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    for name in sorted(sets or fixtures_section["sets"]):
        entry = fixtures_section["sets"][name]
        args = _merge_args(base_server_args(entry, speculative=True), extra_server_args)
        timeout = {"start_timeout": start_timeout} if start_timeout else {}
        try:
            with LlamaServer(binary, args, Path(log_dir) / f"load-{name}.log", env=env, **timeout) as server:
                props = server.request("GET", "/props").body or {}
                text = server.request("POST", "/completion", {"prompt": "hello there", "n_predict": 4,
                                                              "temperature": 0})
                log = server.log_text()
        except errors.DfbuildError as exc:  # did not start, or died: the log says why
            problems[name] = exc.message
            continue
        if not props.get("media_marker"):
            problems[name] = "no media marker (the mmproj did not load)"
        elif "adding speculative implementation 'draft-dflash'" not in log:
            problems[name] = "the DFlash draft was not set up"
        elif text.error:
            problems[name] = f"a text completion failed: {text.error}"
    return problems
