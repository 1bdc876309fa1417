"""A stand-in for llama-server, for unit tests of the smoke stage (no llama.cpp needed).

It speaks the few endpoints smoke uses (/health, /props, /metrics, /completion,
streamed or not, /v1/embeddings) and logs like the real server: an image is IMAGE_ROWS
rows, decoded in -b sized batches as mtmd logs them. FAKE_SERVER_MODE picks a
behaviour:
  ok              every request answers 200; drafts all accepted
  bug             with a draft, image requests fail like unpatched b10359 (500 + log lines)
  exit-early      exit 3 before listening
  ignore-sigterm  like ok, but survives SIGTERM (the handle must kill it)
  reject-drafts   like ok, but no draft is accepted
  busy-port-once  the first start fails to bind, like a port taken after the probe
  never-healthy   /health answers 503 (loading) forever, like a cold shader cache on lavapipe
  near-tie        drafted output takes the runner-up at token 5, where the plain run's top two
                  are 0.01 nats apart: batch-shape noise on a device like lavapipe
  diverge         the same difference, but at a decisive token (5 nats apart): a real divergence
  zero-fill-images like ok, but with a draft each image's span (and a restored prefix) is logged as
                  zero-filled at -v, in the one debug wording the series had before issue 37
  restore-unused  like ok, but a restored slot's prompt is never reused (the hybrid target's
                  full re-processing): the completion after a restore logs "cached n_tokens = 0"
  begin-warning   like ok, but with a draft each completion logs begin()'s warning (a real miss)
  gated           like ok, as today's series logs: an image's span and a restored prefix zero-filled,
                  each with the warning (issue 44)
  debug-fill      like gated, as issue 37's series logged: an image's span zero-filled at debug level
                  ("... of the image left out"), without the warning
  other-drafts    like ok, but at -v the draft proposes other candidates (what a changed draft cache does)
With a draft and -v, every completion logs the draft's candidates as draft() does.
The slot actions (POST /slots/0?action=save|erase|restore, with --slot-save-path) answer as
llama-server's do; the first completion after a restore reuses the restored prompt ("cached
n_tokens = 709" at -v, and under "bug" the draft's hole fails it as unpatched b11434 does).
`--list-devices` prints FAKE_DEVICES (";"-separated device lines) as llama-server does.
With n_probs in a request, each generated token carries completion_probabilities.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_SERVER_MODE", "ok")
MARKER = "<__media_fake__>"
N_DRAFT = 12
IMAGE_ROWS = 9  # the grid projector's small image


def arg_value(argv: list[str], flag: str, default: str | None = None) -> str | None:
    # the last one wins, as in llama-server
    return argv[len(argv) - argv[::-1].index(flag)] if flag in argv else default


def log(line: str) -> None:
    print(line, flush=True)


DIFF_AT = 5  # near-tie / diverge: the token where drafted and plain runs differ


def top_logprobs(index: int) -> list[dict]:
    """The plain run's top candidates at token INDEX, in llama-server's form."""
    first, second = -0.01, -5.0
    if index == DIFF_AT and MODE == "near-tie":
        first, second = -0.69, -0.70
    return [{"id": 97, "token": "a", "bytes": [97], "logprob": first},
            {"id": 98, "token": "b", "bytes": [98], "logprob": second}]


def probabilities(content: str) -> list[dict]:
    return [{"id": ord(c), "token": c, "bytes": [ord(c)], "logprob": top_logprobs(k)[0]["logprob"],
             "top_logprobs": top_logprobs(k)} for k, c in enumerate(content)]


class State:
    speculative = False
    restored = False  # a slot restore happened and no completion has reused it yet
    draft_holds = False  # the draft cache holds a position (a completion since the last erase)
    health_polls = 0
    drafted = 0
    accepted = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):  # keep the log like llama-server's, not http.server's
        log("srv  log_server_r: " + (fmt % args))

    def reply(self, status: int, body: dict | str, content_type: str = "application/json") -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        raw = data.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path == "/health":
            State.health_polls += 1
            if State.health_polls < 3 or MODE == "never-healthy":  # loading, like the real server
                self.reply(503, {"error": {"code": 503, "message": "Loading model"}})
            else:
                self.reply(200, {"status": "ok"})
        elif self.path == "/props":
            self.reply(200, {"media_marker": MARKER})
        elif self.path == "/metrics":
            self.reply(200, "# HELP llamacpp:spec_decode_num_draft_tokens_total x\n"
                            f"llamacpp:spec_decode_num_draft_tokens_total {State.drafted}\n"
                            f"llamacpp:spec_decode_num_accepted_tokens_total {State.accepted}\n", "text/plain")
        else:
            self.reply(404, {"error": {"code": 404, "message": "not found"}})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.startswith("/slots/"):
            self.slot_action(self.path.partition("action=")[2], payload)
            return
        prompt = payload["prompt"] if self.path == "/completion" else payload["input"]
        has_image = isinstance(prompt, dict) and bool(prompt.get("multimodal_data"))
        if has_image:
            n_batch = int(arg_value(sys.argv, "-b", "2048"))
            pieces = [min(n_batch, IMAGE_ROWS - k) for k in range(0, IMAGE_ROWS, n_batch)]
            for k, n in enumerate(pieces, 1):
                log(f"decode_image_chunk: decoding image batch {k}/{len(pieces)}, n_tokens_batch = {n}")
        if MODE == "bug" and State.speculative and has_image:
            log("init: the tokens of sequence 0 in the input batch have inconsistent sequence positions:")
            log("process: llama_decode(ctx_dft) failed rc=-1 (n_tokens=12, offset=0)")
            error = {"code": 500, "message": "decode() failed: failed to process speculative batch", "type": "server_error"}
            if payload.get("stream"):  # a failed stream still arrives behind a 200
                self.reply(200, f"data: {json.dumps({'error': error})}\n\n", "text/event-stream")
            else:
                self.reply(500, {"error": error})
            return
        if self.path == "/v1/embeddings":
            self.reply(200, {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5] * 8}]})
            return
        restored, State.restored = State.restored, False
        draft_held, State.draft_holds = State.draft_holds, True
        if restored and "-v" in sys.argv:
            log(f"slot   operator(): id  0 | task 9 | cached n_tokens = {0 if MODE == 'restore-unused' else 709}, "
                "memory_seq_rm [709, end)")
        if restored and MODE == "bug" and State.speculative:
            log("init: the tokens of sequence 0 in the input batch have inconsistent sequence positions:")
            log("process: llama_process(ctx_dft) failed rc=-1 (n_tokens=27, offset=0)")
            self.reply(500, {"error": {"code": 500, "message": "decode() failed: failed to process speculative batch",
                                       "type": "server_error"}})
            return
        if MODE == "begin-warning" and State.speculative:
            log("0.00.135.687 W begin: ctx_dft pos_max=111 < N-1=114 - process() did not run on every prefill "
                "ubatch. Drafts may degrade.")
        if MODE == "zero-fill-images" and State.speculative and "-v" in sys.argv and (has_image or restored):
            # the series before issue 37: one debug wording for every fill, a restored prefix's too, and
            # from an empty draft cache as well
            hole = "[16, 32)" if has_image else "[33, 709)" if draft_held else "[0, 709)"
            log(f"process: seq_id=0: zero-filling draft positions {hole}")
        if MODE == "debug-fill" and State.speculative and has_image and "-v" in sys.argv:
            log("0.01 D spec      process: seq_id=0: zero-filling draft positions [16, 32) of the image left out")
        if MODE == "gated" and State.speculative and has_image:
            log("0.01 W spec      process: seq_id=0: zero-filling draft positions [16, 32), which the draft "
                "never processed; drafts may degrade")
        if MODE in ("gated", "debug-fill") and State.speculative and restored and draft_held:  # (an empty cache
            # takes any start)
            log("0.01 W spec      process: seq_id=0: zero-filling draft positions [33, 709), which the draft "
                "never processed; drafts may degrade")
        if State.speculative and "-v" in sys.argv:
            p = 0.5 if MODE == "other-drafts" else 0.912
            for k in range(3):
                log(f"0.02 D  - seq_id 0, draft candidate {k:3d}, pos {k:3d}: {97 + k:6d} ({p:8.3f}) 'a'")
        n_predict = payload.get("n_predict", 16)
        timings = {"predicted_n": n_predict}
        if State.speculative:
            accepted = 0 if MODE == "reject-drafts" else N_DRAFT
            timings |= {"draft_n": N_DRAFT, "draft_n_accepted": accepted}
            State.drafted += N_DRAFT
            State.accepted += accepted
        content = "a" * n_predict
        if MODE in ("near-tie", "diverge") and State.speculative:
            content = "a" * DIFF_AT + "b" + "c" * (n_predict - DIFF_AT - 1)  # what follows the difference differs too
        n_probs = int(payload.get("n_probs", 0))
        if payload.get("stream"):
            events = [{"content": c, "stop": False} for c in content]
            if n_probs:
                for k, event in enumerate(events):
                    event["completion_probabilities"] = probabilities(content)[k:k + 1]
            events.append({"content": "", "stop": True, "timings": timings})
            self.reply(200, "".join(f"data: {json.dumps(e)}\n\n" for e in events), "text/event-stream")
        else:
            body = {"content": content, "timings": timings}
            if n_probs:
                body["completion_probabilities"] = probabilities(content)
            self.reply(200, body)


    def slot_action(self, action: str, payload: dict) -> None:
        folder = arg_value(sys.argv, "--slot-save-path")
        if folder is None:
            self.reply(501, {"error": {"code": 501, "message": "This server does not support slots action.",
                                       "type": "not_supported_error"}})
        elif action == "erase":
            State.draft_holds = False
            self.reply(200, {"id_slot": 0, "n_erased": 724})
        elif action in ("save", "restore") and payload.get("filename"):
            path = os.path.join(folder, payload["filename"])
            if action == "save":
                with open(path, "wb") as handle:
                    handle.write(b"fake slot")
                self.reply(200, {"id_slot": 0, "filename": payload["filename"], "n_saved": 724})
            elif os.path.isfile(path):
                State.restored = True
                self.reply(200, {"id_slot": 0, "filename": payload["filename"], "n_restored": 724})
            else:
                self.reply(400, {"error": {"code": 400, "message": "Unable to restore slot", "type": "invalid_request_error"}})
        else:
            self.reply(400, {"error": {"code": 400, "message": "Invalid action", "type": "invalid_request_error"}})


def main(argv: list[str]) -> int:
    if "--list-devices" in argv:
        for line in filter(None, os.environ.get("FAKE_DEVICES_STDERR", "").split(";")):
            print(line, file=sys.stderr)   # what a GPU backend says at start when it finds no device
        print("Available devices:")
        for line in filter(None, os.environ.get("FAKE_DEVICES", "").split(";")):
            print(f"  {line}")
        return 0
    log("$ fake llama-server " + " ".join(argv))
    if MODE == "exit-early":
        log("error: failed to load model")
        return 3
    if MODE == "busy-port-once":
        flag = os.environ["FAKE_SERVER_FLAG"]
        if not os.path.exists(flag):
            open(flag, "w").close()
            log("srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 1")
            return 1
    if MODE == "ignore-sigterm":
        signal.signal(signal.SIGTERM, lambda *_: log("ignoring SIGTERM"))
    State.speculative = arg_value(argv, "--spec-type", "none") != "none"
    if State.speculative and arg_value(argv, "--spec-type") == "draft-dflash":
        log("common_speculative_init: adding speculative implementation 'draft-dflash'")
    server = ThreadingHTTPServer((arg_value(argv, "--host", "127.0.0.1"), int(arg_value(argv, "--port", "8080"))), Handler)
    log(f"srv  llama_server: listening on http://127.0.0.1:{server.server_address[1]}")
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
