"""The HTTP side of a smoke run: one response of llama-server (a stream judged by its events), SSE and /metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


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
