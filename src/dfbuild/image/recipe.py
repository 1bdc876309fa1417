"""What llama.cpp's own container image of a backend holds, read from the tree's `.devops/<name>.Dockerfile`.

Every llama.cpp tree carries the Dockerfiles its images are built from
(`ghcr.io/ggml-org/llama.cpp:server`, `:server-cuda`, ...). As upstream_release
reads the release options from release.yml, this module reads from the
Dockerfile what dfbuild's image of the same archive must hold:

- the runtime packages: the `apt-get install` of the stage the `server` stage
  stands on (`FROM ... AS base`: libgomp1 curl ffmpeg on the CPU image);
- the `server` stage's ENV (`LLAMA_ARG_HOST=0.0.0.0`), WORKDIR, HEALTHCHECK and
  ENTRYPOINT, in their JSON (exec) form;
- the programs it copies into /app (`COPY --from=build /app/full/llama
  /app/full/llama-server /app`) and whether the libraries go there too
  (`COPY --from=build /app/lib/ /app` in the base stage);
- the OCI labels it sets, by name (their values are the build's ARGs; dfbuild
  sets its own).

The Dockerfile is text in a tree dfbuild does not control: it is read within a
size cap, and any shape this reader does not expect (no file, no server stage,
a shell-form ENTRYPOINT) gives a Recipe with `found` False and a note, and the
table's fallback (data/images.toml) is used and recorded. Nothing here raises
on the tree's content and nothing here runs it.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dfbuild.host import backends

DEVOPS = ".devops"
MAX_BYTES = 256 * 1024                 # a Dockerfile is a few KB
SERVER_STAGE = "server"
_INSTRUCTION = re.compile(r"^([A-Za-z]+)\s+(.*)$", re.S)


@functools.cache
def table() -> dict:
    """data/images.toml, parsed (read-only)."""
    return backends.data_table("images.toml")


def image_for(backend: str) -> dict | None:
    """The images.toml entry of an archive backend (cpu, cuda, vulkan, hip), or None: no upstream image."""
    return table()["images"].get(backend)


@dataclass
class Recipe:
    """The server image of one Dockerfile (found False: the fallback's values, and why in note)."""

    found: bool
    file: str
    note: str | None = None
    packages: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    programs: list[str] = field(default_factory=list)
    libraries: bool = True             # the build's shared libraries go to /app too
    workdir: str = "/app"
    labels: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"file": self.file, "found": self.found, "note": self.note, "packages": self.packages,
                "env": self.env, "entrypoint": self.entrypoint, "healthcheck": self.healthcheck,
                "programs": self.programs, "libraries": self.libraries, "workdir": self.workdir,
                "upstream_labels": self.labels}


def fallback(file: str, note: str) -> Recipe:
    fb = table()["fallback"]
    return Recipe(found=False, file=file, note=note, packages=list(fb["packages"]), env=list(fb["env"]),
                  entrypoint=list(fb["entrypoint"]), healthcheck=list(fb["healthcheck"]),
                  programs=list(fb["programs"]), workdir=fb["workdir"])


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments and blanks dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continued instruction is dropped
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        match = _INSTRUCTION.match(line)
        if match:
            out.append((match.group(1).upper(), match.group(2).strip()))
    if pending:
        match = _INSTRUCTION.match(pending.strip())
        if match:
            out.append((match.group(1).upper(), match.group(2).strip()))
    return out


def stages(steps: list[tuple[str, str]]) -> dict[str, dict]:
    """{stage name: {"from": the image or stage it starts from, "steps": [(INSTRUCTION, args)]}}."""
    found: dict[str, dict] = {}
    current: dict | None = None
    for index, (name, args) in enumerate(steps):
        if name == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]  # --platform=...
            label = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"#{index}"
            current = {"from": words[0] if words else "", "steps": []}
            found[label] = current
        elif current is not None:
            current["steps"].append((name, args))
    return found


def exec_form(args: str) -> list[str] | None:
    """A JSON exec form (["a", "b"]) as a list of strings, else None (the shell form is not read)."""
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def apt_packages(run: str) -> list[str]:
    """The packages every `apt-get install` of a RUN line names (options dropped)."""
    try:
        words = shlex.split(run, posix=True)
    except ValueError:
        return []
    packages: list[str] = []
    i = 0
    while i < len(words):
        if words[i] in ("apt-get", "apt") and i + 1 < len(words) and words[i + 1] == "install":
            i += 2
            while i < len(words) and words[i] not in ("&&", "||", ";", "|"):
                if not words[i].startswith("-") and re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", words[i]):
                    packages.append(words[i])
                i += 1
        i += 1
    return packages


def _env_pairs(args: str) -> list[str]:
    """ENV a=b c=d (or the old `ENV a b` form) as ["a=b", "c=d"]."""
    try:
        words = shlex.split(args, posix=True)
    except ValueError:
        return []
    if words and "=" not in words[0]:
        return [f"{words[0]}={' '.join(words[1:])}"]
    return [w for w in words if "=" in w]


def _labels(args: str) -> list[str]:
    try:
        return [w.split("=", 1)[0] for w in shlex.split(args, posix=True) if "=" in w]
    except ValueError:
        return []


def read_text(text: str, file: str) -> Recipe:
    """The server image that the Dockerfile TEXT describes (FILE names it in the record)."""
    found = stages(instructions(text))
    server = found.get(SERVER_STAGE)
    if server is None:
        return fallback(file, f"{file} has no `{SERVER_STAGE}` stage")
    # the chain of stages the server stage stands on, nearest first (server <- base)
    chain = [server]
    seen = {SERVER_STAGE}
    while chain[-1]["from"] in found and chain[-1]["from"] not in seen:
        seen.add(chain[-1]["from"])
        chain.append(found[chain[-1]["from"]])
    recipe = Recipe(found=True, file=file, programs=[], libraries=False)
    for stage in reversed(chain):  # the base first: a later stage's ENV or WORKDIR wins
        for name, args in stage["steps"]:
            if name == "RUN":
                recipe.packages += [p for p in apt_packages(args) if p not in recipe.packages]
            elif name == "ENV":
                for pair in _env_pairs(args):
                    key = pair.split("=", 1)[0]
                    recipe.env = [e for e in recipe.env if e.split("=", 1)[0] != key] + [pair]
            elif name == "WORKDIR":
                recipe.workdir = args.strip()
            elif name == "LABEL":
                recipe.labels += _labels(args)
            elif name == "ENTRYPOINT":
                recipe.entrypoint = exec_form(args) or []
                if not recipe.entrypoint:
                    return fallback(file, f"{file}: the server stage's ENTRYPOINT is not in exec form")
            elif name == "HEALTHCHECK":
                words = args.split(None, 1)
                if words and words[0].upper() == "CMD" and len(words) == 2:
                    command = exec_form(words[1])
                    recipe.healthcheck = ["CMD", *command] if command else ["CMD-SHELL", words[1]]
                elif words and words[0].upper() == "NONE":
                    recipe.healthcheck = []
            elif name == "COPY" and "--from=" in args:
                words = [w for w in args.split() if not w.startswith("--")]
                if len(words) >= 2 and words[-1].rstrip("/") == "/app":
                    for source in words[:-1]:
                        if source.rstrip("/").endswith("/lib"):
                            recipe.libraries = True
                        else:
                            recipe.programs.append(source.rstrip("/").rsplit("/", 1)[-1])
    if not recipe.entrypoint:
        return fallback(file, f"{file}: the server stage has no ENTRYPOINT")
    if not recipe.programs:
        return fallback(file, f"{file}: the server stage copies no program to /app")
    return recipe


def read(tree: Path | None, backend: str) -> Recipe:
    """The server image recipe of BACKEND's Dockerfile in TREE (None: no tree, the fallback)."""
    entry = image_for(backend)
    if entry is None:
        raise KeyError(backend)
    file = f"{DEVOPS}/{entry['dockerfile']}"
    if tree is None:
        return fallback(file, "no llama.cpp tree was given to read it from")
    path = Path(tree) / file
    try:
        if path.is_symlink() or not path.is_file():
            return fallback(file, f"the tree has no {file}")
        if path.stat().st_size > MAX_BYTES:
            return fallback(file, f"{file} is larger than {MAX_BYTES // 1024} KiB, not a Dockerfile")
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return fallback(file, f"{file} cannot be read ({exc.strerror or exc})")
    return read_text(text, file)
