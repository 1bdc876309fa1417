"""The build request: what a command was asked to build and smoke, typed and frozen.

The CLI makes one `BuildRequest` from its options (`BuildRequest.from_options`), prints it before any
work starts (`summary`, as cibuildwheel prints its options), and hands it to build, prove, smoke and
release, which read its fields instead of a dict of keywords. The manifest records it as plain data
(its `request` section: `to_dict`; `from_dict` reads it back).

A request says what was asked, not what a build made of it: `cpu_variants` None is "all", the build
section lists the variants built; `os` and `arch` None is "this machine's".
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dfbuild.host import backends
from dfbuild.host.backends import Host

DEFAULT_TARGETS = ("llama-server",)
ALL_TARGETS = "all"              # --target all: every tool the tree builds, all shipped
# the environment's defaults smoke.plan reads (smoke/plan.py, smoke/server.py), named in the summary
TABLE_ENV = "DFBUILD_SMOKE_TABLE"
START_TIMEOUT_ENV = "DFBUILD_START_TIMEOUT"


def parse_targets(values: str | Iterable[str]) -> list[str]:
    """--target values: repeatable, each a comma list; `all` ships every tool. Empty: llama-server."""
    items = [values] if isinstance(values, str) else list(values)
    targets: list[str] = []
    for item in items:
        for name in re.split(r"[,\s]+", item):
            if name and name not in targets:
                targets.append(name)
    return targets or list(DEFAULT_TARGETS)


def split_cpu_variants(value: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """--cpu-variants as the names given ("x64,haswell" -> ("x64", "haswell")); None or nothing: all.
    Whether this host has them is the build's to say (build.parse_cpu_variants), where it always was."""
    if value is None:
        return None
    items = re.split(r"[,;\s]+", value) if isinstance(value, str) else list(value)
    names = tuple(item.strip() for item in items if item and item.strip())
    return names or None


@dataclass(frozen=True)
class SmokeOptions:
    """How patient the smoke is and how much of the table it runs (smoke.plan reads these)."""

    table: str | None = None               # auto, full or software; None: $DFBUILD_SMOKE_TABLE, else auto
    start_timeout: float | None = None     # seconds; None: the backend table's (or $DFBUILD_START_TIMEOUT)
    allow_cpu_fallback: bool = False       # a GPU backend with no device smokes on the CPU, and says so


@dataclass(frozen=True)
class BuildRequest:
    """One build (and its smoke), as asked: the backend, the target, what to compile and how."""

    backend: str = "cpu"                              # a name of the backend table (data/backends.toml)
    os: str | None = None                             # the target OS; None: this machine's
    arch: str | None = None                           # the target arch; None: this machine's
    targets: tuple[str, ...] = DEFAULT_TARGETS        # CMake targets, or ("all",)
    cpu_variants: tuple[str, ...] | None = None       # ggml's runtime-dispatched CPU variants; None: all
    cuda_arch: str | None = None                      # cuda: CMAKE_CUDA_ARCHITECTURES; None: the table's
    gpu_targets: str | None = None                    # hip: GPU_TARGETS; None: the table's
    vulkan_include_dir: Path | None = None            # vulkan: headers instead of the system's
    extra_cmake_args: tuple[str, ...] = ()            # --cmake-arg, after every flag dfbuild sets
    jobs: int | None = None                           # ninja -j; None: ninja's own
    reconfigure: bool = False                         # reuse a build dir made for another backend or tree
    fresh: bool = False                               # delete the build dir (dfbuild's) and start over
    use_ccache: bool = True
    web_ui: bool = True                               # llama-server's web UI embedded; False: --no-ui
    smoke: SmokeOptions = field(default_factory=SmokeOptions)
    # what the names mean, resolved once when the request is made and carried by replace(): the backend's
    # table entry and the Host the binaries are for, so that no stage looks either up again by its name
    spec: backends.Backend = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    host: Host = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    # how a build runs, not what it makes: a change of these makes the same binaries
    RUN_ONLY = ("jobs", "reconfigure", "fresh", "use_ccache", "smoke")
    # resolved from the fields above, not asked for: left out of the manifest's request section
    RESOLVED = ("spec", "host")

    def __post_init__(self) -> None:
        # the typed forms, whatever a caller passed (a list of targets, a str path): frozen, so set once here
        set_ = object.__setattr__
        set_(self, "targets", tuple(parse_targets(self.targets)))
        set_(self, "cpu_variants", split_cpu_variants(self.cpu_variants))
        set_(self, "extra_cmake_args", tuple(self.extra_cmake_args))
        if self.vulkan_include_dir is not None:
            set_(self, "vulkan_include_dir", Path(self.vulkan_include_dir))
        if self.spec is None or self.spec.name != self.backend:
            set_(self, "spec", backends.get(self.backend))
        if not self._host_fits():
            from dfbuild.host import platforms  # the cross targets' table: read when a request is made

            set_(self, "host", platforms.target_host(self.os, arch=self.arch))

    def _host_fits(self) -> bool:
        """Whether the Host carried over (by replace()) is still the one os and arch ask for."""
        if self.host is None:
            return False
        if self.os is None and self.arch is None:  # this machine
            return not self.host.cross
        return self.os in (None, self.host.os) and self.arch in (None, self.host.arch)

    @classmethod
    def from_options(cls, *, backend: str = "cpu", target_os: str | None = None, target_arch: str | None = None,
                     targets: Iterable[str] = (), cpu_variants: str | None = None, cuda_arch: str | None = None,
                     gpu_targets: str | None = None, vulkan_include_dir: Path | None = None,
                     cmake_args: Iterable[str] = (), jobs: int | None = None, reconfigure: bool = False,
                     fresh: bool = False, no_ccache: bool = False, no_ui: bool = False,
                     start_timeout: float | None = None, smoke_table: str | None = None,
                     allow_cpu_fallback: bool = False) -> BuildRequest:
        """The request a command's options make (the names are the CLI's parameters): the backend
        checked against the table (exit 33 for an unknown one), --os/--arch resolved (exit 33 for a
        target this machine cannot build), this machine's own OS and arch recorded as None."""
        from dfbuild.host import platforms  # the cross targets' table: read when a command runs, not at import

        name = backends.get(backend.lower()).name
        host = platforms.target_host(target_os, arch=target_arch)
        return cls(backend=name, os=host.os if host.cross else None, arch=host.arch if host.cross else None,
                   targets=tuple(targets), cpu_variants=split_cpu_variants(cpu_variants), cuda_arch=cuda_arch or None,
                   gpu_targets=gpu_targets or None, vulkan_include_dir=vulkan_include_dir,
                   extra_cmake_args=tuple(cmake_args), jobs=jobs, reconfigure=reconfigure, fresh=fresh,
                   use_ccache=not no_ccache, web_ui=not no_ui,
                   smoke=SmokeOptions(table=smoke_table, start_timeout=start_timeout,
                                      allow_cpu_fallback=bool(allow_cpu_fallback)))

    # --- what the stages read ---------------------------------------------------------------
    # spec (the backend's record) and host (the Host the binaries are for: this machine, or the cross
    # target --os/--arch named) are fields, resolved in __post_init__.

    @property
    def cross_host(self) -> Host | None:
        """The cross target, or None for this machine (native work dirs and records stay as they were)."""
        return self.host if self.host.cross else None

    def with_targets(self, targets: Iterable[str]) -> BuildRequest:
        return replace(self, targets=tuple(targets))

    def identity(self) -> dict[str, Any]:
        """What the request makes, without how it runs: the fields that change the binaries and are set
        (the backend and targets left to the caller, which keys by them apart), the cross target's Host;
        web_ui always (binaries with and without the web UI differ)."""
        made = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self.RUN_ONLY + self.RESOLVED and f.name not in ("backend", "targets", "os", "arch")}
        if self.cross_host is not None:
            made["host"] = self.cross_host
        return {k: v for k, v in sorted(made.items()) if v is not None and v != ()}

    # --- plain data --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The manifest's `request` section: JSON-friendly values only."""
        # the asked fields only (asdict would deep-copy the resolved table entry and Host first)
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.RESOLVED}
        data["smoke"] = asdict(self.smoke)
        data.update(targets=list(self.targets), extra_cmake_args=list(self.extra_cmake_args),
                    cpu_variants=list(self.cpu_variants) if self.cpu_variants is not None else None,
                    vulkan_include_dir=str(self.vulkan_include_dir) if self.vulkan_include_dir else None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildRequest:
        """A request from its `request` section (keys it does not know are left out: a newer dfbuild's)."""
        known = {f.name for f in fields(cls)} - set(cls.RESOLVED)
        values = {k: v for k, v in data.items() if k in known}
        if isinstance(values.get("smoke"), dict):
            values["smoke"] = SmokeOptions(**{k: v for k, v in values["smoke"].items()
                                              if k in {f.name for f in fields(SmokeOptions)}})
        return cls(**values)

    # --- said before the work starts ---------------------------------------------------------

    def _ccache_words(self) -> str:
        """Whether the build uses ccache, as the build (build_config) and doctor find it: on PATH."""
        if not self.use_ccache:
            return "no (--no-ccache)"
        from dfbuild.host.probes import probe

        found = probe("ccache", self.host, optional=True)
        return "yes" if found.found else "no: not installed (`dfbuild doctor` says how)"

    def summary(self, *, smoke: bool = True) -> str:
        """The request in words, one option a line (stderr, before any work; plain text)."""
        here = backends.current_host()
        target = self.host
        where = (f"{target.os} {target.arch}" + (f" (cross-built on {here.os} {here.arch})" if target.cross
                                                  else " (this machine)"))
        lines = [("backend", self.backend), ("os, arch", where), ("targets", ", ".join(self.targets)),
                 ("cpu variants", ", ".join(self.cpu_variants) if self.cpu_variants else "all")]
        if self.backend == "cuda" or self.cuda_arch:
            lines.append(("cuda arch", self.cuda_arch or "the backend table's"))
        if self.backend == "hip" or self.gpu_targets:
            lines.append(("gpu targets", self.gpu_targets or "the backend table's"))
        if self.backend == "vulkan" or self.vulkan_include_dir:
            lines.append(("vulkan headers", str(self.vulkan_include_dir) if self.vulkan_include_dir
                          else "the system's"))
        lines += [("cmake args", " ".join(self.extra_cmake_args) or "none"),
                  ("jobs", str(self.jobs) if self.jobs else "ninja's default"),
                  ("ccache", self._ccache_words()),
                  ("web ui", "embedded" if self.web_ui else "left out (--no-ui)")]
        if self.reconfigure or self.fresh:
            lines.append(("build dir", "start over (--fresh)" if self.fresh else "reconfigure (--reconfigure)"))
        if smoke:
            table_env = os.environ.get(TABLE_ENV, "").strip()
            timeout_env = os.environ.get(START_TIMEOUT_ENV, "").strip()
            lines += [("smoke table", self.smoke.table or (f"{table_env} (${TABLE_ENV})" if table_env else "auto")),
                      ("start timeout", f"{self.smoke.start_timeout:g}s" if self.smoke.start_timeout
                       else f"{timeout_env}s (${START_TIMEOUT_ENV})" if timeout_env else "the backend table's"),
                      ("cpu fallback", "allowed" if self.smoke.allow_cpu_fallback else "no")]
        width = max(len(label) for label, _ in lines) + 1
        return "\n".join(["build request:", *(f"  {label + ':':<{width}} {value}" for label, value in lines)])
