"""What llama.cpp's own release workflow does for one release entry, read from the tree itself.

A llama.cpp tree (a git checkout or an sdist: both keep .github/) carries the
workflow that made that base's official archives, `.github/workflows/release.yml`.
For a (os, backend, arch, toolkit) entry this module finds the job that builds
it there (backends.toml [upstream_release.jobs]: ubuntu-cpu, windows-cuda, ...),
picks its matrix entry, and reads:

- the CMake options it configures with: the workflow's `CMAKE_ARGS` (GGML_RPC=ON,
  LLAMA_BUILD_TOOLS=ON, ...) and the job's own `-D` options, with the GitHub
  expressions it can evaluate (`env.X`, `matrix.X`, `matrix.a == 'x' && 'ON' || 'OFF'`)
  filled in; what it cannot evaluate is named, never guessed;
- how the job packs the archive: a tarball rooted at `llama-<tag>/` with the
  binaries at its top, or a flat zip;
- for a Linux CUDA job, the CUDA runtime libraries it packs beside the archive
  (`cudart-llama-<tag>-bin-ubuntu-cuda-...`).

The file is YAML in a tree dfbuild does not control, so it is read with PyYAML's
safe loader (booleans as YAML 1.2 and GitHub read them: only true/false; a
matrix value `OFF` stays the text OFF), within a size cap, and any shape it does
not expect (no file, a parse error, no such job, no configure step) gives a
Reading with `found` False and a note saying why: the caller then uses the
backend table (backends.toml) and records that note. Nothing here raises on the
tree's content.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dfbuild.host import backends

WORKFLOW = ".github/workflows/release.yml"
MAX_BYTES = 2 * 1024 * 1024          # release.yml is about 80 KB; anything far larger is not one
TAG = "<tag>"                        # how a tag expression is written in the layouts read here

_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_UNRESOLVED = "\x00"                 # marks text that came from an expression this module cannot evaluate
# -DNAME=VALUE or -D NAME=VALUE (a CMake type suffix allowed); VALUE quoted or up to the next blank
_OPTION = re.compile(r"(?:^|\s)-D\s*([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z]+)?=(\"[^\"]*\"|'[^']*'|[^\s\"']\S*|(?=\s|$))")
# matrix.a == 'x' && 'Y' || 'Z', the one conditional form the release workflow uses
_CONDITIONAL = re.compile(r"^([A-Za-z_][\w.-]*)\s*==\s*'([^']*)'\s*&&\s*'([^']*)'\s*\|\|\s*'([^']*)'$")
_REF = re.compile(r"^(env|matrix)\.([A-Za-z_][\w-]*)$")
_TAG_EXPR = re.compile(r"\b(tag_name|tag\.outputs\.name)\b")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only), as GitHub reads a workflow."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


@dataclass
class Reading:
    """What the workflow of one tree does for one release entry (found False: see note)."""

    found: bool
    note: str | None = None
    file: str = WORKFLOW
    job: str | None = None
    matrix: dict = field(default_factory=dict)        # the matrix entry picked (str values)
    options: dict = field(default_factory=dict)       # -D options with a value it could read
    unresolved: dict = field(default_factory=dict)    # option -> the expression it could not evaluate
    layout: str | None = None                         # "top" (llama-<tag>/ with the binaries) | "flat"
    root: str | None = None                           # the tarball's top folder, with <tag>
    cudart: list = field(default_factory=list)        # Linux CUDA: the runtime libraries packed beside it
    cudart_name: str | None = None                    # ... and their archive's name, with <tag>

    def summary(self) -> dict:
        """The record a manifest keeps (no path of this machine: the file is relative to the tree)."""
        if not self.found:
            return {"file": self.file, "found": False, "note": self.note}
        record = {"file": self.file, "found": True, "job": self.job, "matrix": self.matrix,
                  "layout": self.layout}
        if self.note:
            record["note"] = self.note
        if self.cudart:
            record["cudart"] = self.cudart
        return record


def _not_found(note: str) -> Reading:
    return Reading(found=False, note=note)


def load(tree: Path) -> tuple[dict | None, str | None]:
    """(the parsed workflow, None) or (None, why it cannot be read)."""
    path = Path(tree) / WORKFLOW
    try:
        if path.is_symlink() or not path.is_file():
            return None, f"the tree has no {WORKFLOW}"
        if path.stat().st_size > MAX_BYTES:
            return None, f"{WORKFLOW} is larger than {MAX_BYTES // 1024} KiB, not a release workflow"
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return None, f"{WORKFLOW} cannot be read ({exc.strerror or exc})"
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no Python objects
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        return None, f"{WORKFLOW} is not valid YAML" + (f" (line {where.line + 1})" if where else "")
    except RecursionError:
        return None, f"{WORKFLOW} nests too deeply to read"
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), dict):
        return None, f"{WORKFLOW} has no jobs"
    return data, None


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def matrix_entries(job: dict) -> list[dict]:
    """The job's matrix as GitHub expands it: the product of its list keys, then `include`
    (an include entry extends the combinations it matches on their keys, else is added)."""
    strategy = job.get("strategy")
    matrix = strategy.get("matrix") if isinstance(strategy, dict) else None
    if not isinstance(matrix, dict):
        matrix = {}
    axes = {k: v for k, v in matrix.items() if k not in ("include", "exclude") and isinstance(v, list)}
    # each value of the product has one item per axis: strict holds
    combos = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())] if axes else []
    added = []
    includes = matrix.get("include")
    if not isinstance(includes, list):
        includes = []
    for extra in includes:
        if not isinstance(extra, dict):
            continue
        matched = False
        for combo in combos:  # added where it overwrites none of the combination's original values
            if all(combo.get(k) == v for k, v in extra.items() if k in axes):
                combo.update(extra)
                matched = True
        if not matched:  # a combination of its own (never extended by a later include)
            added.append(dict(extra))
    return [{k: _text(v) for k, v in combo.items()} for combo in combos + added] or [{}]


def _jobs_for(data: dict, pattern: str) -> list[tuple[str, dict]]:
    return [(name, job) for name, job in data["jobs"].items()
            if isinstance(job, dict) and fnmatch.fnmatchcase(str(name), pattern)]


def _pick(entries: list[dict], wanted: dict[str, str], toolkit_key: str | None,
          toolkit: str | None) -> tuple[dict | None, str | None]:
    """The matrix entry whose values are WANTED; the toolkit matched on major.minor, else on its major."""
    # a key the entry does not have matches (older windows-cuda matrices name no arch: x64 only)
    plain = [e for e in entries if all(e.get(k, v) == v for k, v in wanted.items())]
    if not toolkit_key:
        return (plain[0], None) if plain else (None, None)
    if not toolkit:
        return None, "the toolkit version is not known"
    label = ".".join(str(n) for n in backends.version_tuple(toolkit)[:2])
    exact = [e for e in plain if _minor(e.get(toolkit_key, "")) == label]
    if exact:
        return exact[0], None
    major = label.split(".")[0]
    same = [e for e in plain if _minor(e.get(toolkit_key, "")).split(".")[0] == major]
    if same:
        return same[0], (f"no {toolkit_key} {label} entry; the CUDA {major} entry "
                         f"({same[0].get(toolkit_key)}) gives the options")
    return None, None


def _minor(version: str) -> str:
    numbers = backends.version_tuple(version or "")
    return ".".join(str(n) for n in numbers[:2])


def evaluate(expression: str, matrix: dict, env: dict) -> str | None:
    """A GitHub expression of the forms the release workflow uses; None when it is another kind."""
    expression = expression.strip()
    ref = _REF.match(expression)
    if ref:
        scope = env if ref.group(1) == "env" else matrix
        return scope.get(ref.group(2)) if ref.group(2) in scope else None
    conditional = _CONDITIONAL.match(expression)
    if conditional:
        value = evaluate(conditional.group(1), matrix, env)
        if value is None:
            return None
        return conditional.group(3) if value == conditional.group(2) else conditional.group(4)
    return None


def expand(text: str, matrix: dict, env: dict, unresolved: list[str], depth: int = 0) -> str:
    """TEXT with every expression it can evaluate filled in. One it cannot evaluate becomes a token
    without blanks (so a command line still splits into its words): <tag> for the release tag,
    else NUL, its index in UNRESOLVED, NUL (_restore puts the expression back)."""
    def one(match: re.Match) -> str:
        value = evaluate(match.group(1), matrix, env)
        if value is not None:  # env.CMAKE_ARGS may hold expressions of its own
            return expand(value, matrix, env, unresolved, depth + 1) if depth < 4 else value
        if _TAG_EXPR.search(match.group(1)):
            return TAG
        unresolved.append(match.group(0))
        return f"{_UNRESOLVED}{len(unresolved) - 1}{_UNRESOLVED}"

    return _EXPR.sub(one, text)


def _restore(text: str, unresolved: list[str]) -> str:
    """TEXT with expand's tokens turned back into the expressions the workflow wrote."""
    return re.sub(f"{_UNRESOLVED}(\\d+){_UNRESOLVED}", lambda m: unresolved[int(m.group(1))], text)


def condition_holds(condition, matrix: dict, env: dict) -> bool:
    """A step's `if:`: false only when it is a conjunction of `X == 'v'` / `X != 'v'` terms that
    this matrix entry makes false; any other form counts as true (the step is read)."""
    if condition is None or isinstance(condition, bool):
        return condition is not False
    text = _EXPR.sub(lambda m: m.group(1), str(condition)).strip()
    for term in text.split("&&"):
        match = re.fullmatch(r"\s*([A-Za-z_][\w.-]*)\s*(==|!=)\s*'([^']*)'\s*", term)
        if not match:  # another form (||, a function call): read the step
            return True
        value = evaluate(match.group(1), matrix, env)
        if value is None:
            continue
        if (value == match.group(3)) != (match.group(2) == "=="):
            return False
    return True


def _joined(script: str) -> str:
    """A run script with its continuation lines joined (bash `\\`, cmd `^`, PowerShell backtick), each
    after a blank, as the workflow writes them: a Windows path's last backslash is no continuation."""
    return re.sub(r"[ \t]+(?:\\|\^|`)[ \t]*\r?\n[ \t]*", " ", script)


def _configure_line(script: str) -> str | None:
    """The `cmake ... -B <dir>` configure command of a build step (the first one)."""
    for line in _joined(script).splitlines():
        words = line.split()
        if words and words[0] == "cmake" and ("-B" in words or any(w.startswith("-B") for w in words)) \
                and "--build" not in words:
            return line
    return None


def options_of(line: str, expressions: Sequence[str] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """({name: value}, {name: expression}) of the -D options on a configure line (as expand left it,
    EXPRESSIONS its unresolved expressions)."""
    options: dict[str, str] = {}
    unresolved: dict[str, str] = {}
    for match in _OPTION.finditer(line):
        name, value = match.group(1), match.group(2)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        if _UNRESOLVED in value:
            unresolved[name] = _restore(value, list(expressions))
            options.pop(name, None)
        else:
            options[name] = value
            unresolved.pop(name, None)
    return options, unresolved


def _steps(job: dict, matrix: dict, env: dict) -> list[tuple[str | None, str]]:
    """(id, run script) of the job's steps that run for this matrix entry."""
    steps = job.get("steps")
    if not isinstance(steps, list):
        steps = []
    return [(s.get("id"), s["run"]) for s in steps
            if isinstance(s, dict) and isinstance(s.get("run"), str) and condition_holds(s.get("if"), matrix, env)]


def _configure(steps: list[tuple[str | None, str]]) -> str | None:
    """The configure line of the job's build step (id cmake_build, as every release job names it),
    else the first `cmake -B` of any step."""
    ordered = [run for id_, run in steps if id_ == "cmake_build"] + [run for _, run in steps]
    return next((line for line in map(_configure_line, ordered) if line), None)


def _layout(scripts: list[str]) -> tuple[str | None, str | None]:
    """How the job packs its archive: ("top", "llama-<tag>") for a tarball of build/bin under one
    folder, ("flat", None) for a zip of the binaries themselves. SCRIPTS as expand left them."""
    for script in scripts:
        for line in _joined(script).splitlines():
            words = line.split()
            if not words:
                continue
            if words[0] == "tar" and any(w.endswith(".tar.gz") and w.startswith("llama-") for w in words):
                transform = re.search(r"s?,\^\\\.,([^,]+),", line)  # GNU --transform s,^\.,X, or bsdtar -s ,^\.,X,
                return "top", (transform.group(1) if transform else None)
            if words[0] == "7z" and any(w.endswith(".zip") and w.startswith("llama-") for w in words):
                return "flat", None
    return None, None


def _cudart(scripts: list[str], expressions: list[str]) -> tuple[list[str], str | None]:
    """The CUDA runtime libraries a Linux CUDA job copies (cp -L .../libcudart.so.${major}), and the
    name of the tarball it packs them into."""
    libraries, name = [], None
    for script in scripts:
        for line in _joined(script).splitlines():
            copy = re.search(r"\bcp\s+-L\s+\S*/(lib[A-Za-z0-9_]+)\.so\.\S*", line)
            if copy and copy.group(1) not in libraries:
                libraries.append(copy.group(1))
            packed = re.search(r"\btar\s+-\w*c\w*f\s+(cudart-llama-\S+\.tar\.gz)", line)
            if packed:
                name = _restore(packed.group(1), expressions)
    return libraries, name


def read(tree: Path, os_name: str, backend: str, arch: str, toolkit: str | None = None) -> Reading:
    """What the tree's release workflow does for the entry (os_name, backend, arch, toolkit).
    Never raises on the file's content: a shape it does not read gives a Reading with a note."""
    try:
        return _read(tree, os_name, backend, arch, toolkit)
    except (TypeError, AttributeError, ValueError, KeyError, IndexError, RecursionError) as exc:
        return _not_found(f"{WORKFLOW} has a shape dfbuild does not read ({type(exc).__name__})")


def _read(tree: Path, os_name: str, backend: str, arch: str, toolkit: str | None) -> Reading:
    rule = backends.table().get("upstream_release", {}).get("jobs", {}).get(f"{os_name}-{backend}")
    if rule is None:
        return _not_found(f"llama.cpp's release workflow has no {os_name} {backend} job dfbuild knows of")
    data, why = load(tree)
    if data is None:
        return _not_found(why or f"{WORKFLOW} cannot be read")
    jobs = _jobs_for(data, rule["job"])
    if not jobs:
        return _not_found(f"{WORKFLOW} of this base has no {rule['job']} job: llama.cpp released no "
                          f"{os_name} {backend} archive at this base")
    name, job = jobs[0]
    wanted = {k: str(v).replace("{arch}", arch) for k, v in (rule.get("matrix") or {}).items()}
    entry, toolkit_note = _pick(matrix_entries(job), wanted, rule.get("toolkit"), toolkit)
    if entry is None:
        what = ", ".join(f"{k}={v}" for k, v in wanted.items())
        if rule.get("toolkit"):
            what = ", ".join(filter(None, [what, f"{rule['toolkit']}={toolkit}"]))
        return _not_found(toolkit_note or f"the {name} job of {WORKFLOW} has no matrix entry {what}")
    env = {k: _text(v) for k, v in (data.get("env") or {}).items()} if isinstance(data.get("env"), dict) else {}
    if isinstance(job.get("env"), dict):
        env.update({k: _text(v) for k, v in job["env"].items()})
    steps = _steps(job, entry, env)
    configure = _configure(steps)
    if configure is None:
        return _not_found(f"the {name} job of {WORKFLOW} has no `cmake -B` configure step")
    expressions: list[str] = []
    options, unresolved = options_of(expand(configure, entry, env, expressions), expressions)
    scripts = [expand(run, entry, env, expressions) for _, run in steps]
    layout, root = _layout(scripts)
    libraries, cudart_name = _cudart(scripts, expressions) if backend == "cuda" else ([], None)
    return Reading(found=True, note=toolkit_note, job=name, matrix=entry, options=options,
                   unresolved=unresolved, layout=layout, root=root, cudart=libraries, cudart_name=cudart_name)


def cmake_options(reading: Reading) -> tuple[dict[str, str], dict[str, str]]:
    """(the options dfbuild takes, {option: why not}) from a Reading, by backends.toml's
    [upstream_release.not_taken] (and every option whose expression could not be evaluated)."""
    refused = backends.table().get("upstream_release", {}).get("not_taken", {})
    taken, not_taken = {}, {}
    for name_, value in reading.options.items():
        if name_ in refused:
            not_taken[name_] = f"{value}: {refused[name_]}"
        else:
            taken[name_] = value
    for name_, expression in reading.unresolved.items():
        not_taken[name_] = (f"{expression}: {refused[name_]}" if name_ in refused
                            else f"{expression}: a GitHub expression dfbuild does not evaluate")
    return taken, not_taken
