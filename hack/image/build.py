"""`make image` / `make node-images`: build gpupool's OCI images and the dev node's pause and workload images.

    python hack/image/build.py [--node-images-only] [--no-ray] [--out out/image] [--no-import]

gpupool:<version> and gpupool-ray:<version> (root needed: mmdebstrap, chroot):
  1. base rootfs: hack/image/base.sh (mmdebstrap, Debian packages only), cached in
     $GPUPOOL_CACHE/image/base-<hash of base.sh + packages.txt>/ with its compressed layer; both images share it
  2. wheels: the lock's pinned wheels (hack/image/fetch-wheels.sh, cached by the lock's hash) + gpupool's wheel;
     gpupool: hack/image/requirements.lock (the `server` extra), gpupool-ray: hack/image/requirements-ray.lock
     (`server` + `ray` extras + ray[default]: what a KubeRay RayJob's head, workers and submitter run)
  3. a copy of the rootfs, hack/image/install.sh chrooted in it -> /opt/gpupool: the second layer. gpupool-ray:
     install.sh without gpupool's wheel -> its dependency layer, cached by the hash of the base recipe,
     install.sh and the lock; then hack/image/install-app.sh adds gpupool's wheel: a third layer of its files
  4. out/image/<name>-<version>.oci.tar, sbom.json and packages.txt (gpupool-ray: sbom-ray.json, packages-ray.txt)
pause:3.10 and gpupool-workload:<version>: static C programs (hack/image/*.c), one file each.
Each archive is imported into /run/containerd/containerd.sock when that socket exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

from gpupool_devcluster.errors import DevClusterError
from gpupool_devcluster.oci import DEFAULT_PATH, ImageConfig, Layer, import_image, make_layer, write_oci_archive

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "hack" / "image"
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
PAUSE_NAME = "registry.k8s.io/pause:3.10"


def log(msg: str) -> None:
    print(f"[image] {msg}", flush=True)


def version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def digest_of(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("GPUPOOL_CACHE") or Path.home() / ".cache" / "gpupool") / "image"


def cached_layer(meta: Path) -> Layer | None:
    if not meta.is_file():
        return None
    d = json.loads(meta.read_text())
    layer = Layer(Path(d["path"]), d["digest"], d["size"], d["diff_id"], d["tar_size"])
    return layer if layer.path.is_file() and layer.path.stat().st_size == layer.size else None


def save_layer(layer: Layer, meta: Path) -> Layer:
    meta.write_text(json.dumps({"path": str(layer.path), "digest": layer.digest, "size": layer.size,
                                "diff_id": layer.diff_id, "tar_size": layer.tar_size}))
    return layer


def base_rootfs() -> tuple[Path, Layer]:
    """The cached Debian rootfs and its compressed layer, built when the recipe changed."""
    key = digest_of(HERE / "base.sh", HERE / "packages.txt")
    d = cache_dir() / f"base-{key}"
    rootfs, meta = d / "rootfs", d / "layer.json"
    layer = cached_layer(meta)
    if layer is not None and rootfs.is_dir():
        log(f"base rootfs: cached ({d})")
        return rootfs, layer
    if shutil.which("mmdebstrap") is None:
        sys.exit("make image: mmdebstrap is not installed (apt-get install mmdebstrap)")
    for old in cache_dir().glob("base-*"):  # earlier recipes' rootfs: ~100 MiB each
        shutil.rmtree(old, ignore_errors=True)
    d.mkdir(parents=True)
    log(f"base rootfs: mmdebstrap bookworm -> {d} (recipe {key})")
    subprocess.run(["bash", str(HERE / "base.sh"), str(rootfs)], check=True)
    layer = make_layer(rootfs, d / "layer.tar.gz", skip_contents=("dev", "proc", "sys", "tmp"))
    return rootfs, save_layer(layer, meta)


def lock_wheels(lock: Path) -> Path:
    """The cached directory with the lock's wheels (by the lock's hash), downloaded when missing."""
    cached = cache_dir() / f"wheels-{digest_of(lock)}"
    if not (cached / "requirements.lock").is_file():
        log(f"wheels: downloading what {lock.relative_to(REPO)} pins -> {cached}")
        subprocess.run(["bash", str(HERE / "fetch-wheels.sh"), str(cached), str(lock)], check=True,
                       env={**os.environ, "PIP": f"{sys.executable} -m pip"})
    return cached


def gpupool_wheel(out: Path) -> None:
    log("wheels: building gpupool's wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(REPO)], check=True, cwd=out)


def wheels(work: Path, lock: Path) -> Path:
    """A directory with the lock's wheels (cached by the lock's hash) and gpupool's own wheel."""
    out = work / "wheels"
    shutil.copytree(lock_wheels(lock), out)
    gpupool_wheel(out)
    return out


def chroot_install(root: Path, script: str, wheel_dir: Path) -> None:
    """hack/image/SCRIPT WHEELS_DIR run as root inside the root file system `root`."""
    shutil.copytree(wheel_dir, root / "tmp/wheels")
    shutil.copy(HERE / script, root / f"tmp/{script}")
    subprocess.run(["chroot", str(root), "/bin/sh", f"/tmp/{script}", "/tmp/wheels"], check=True,
                   env={"PATH": DEFAULT_PATH, "HOME": "/root", "LC_ALL": "C.UTF-8"})
    shutil.rmtree(root / "tmp/wheels")
    (root / f"tmp/{script}").unlink()


def deps_venv(name: str, lock: Path, rootfs: Path) -> tuple[Path, Layer]:
    """/opt/gpupool with the lock's dependencies alone (install.sh without gpupool's wheel) and its layer,
    cached in $GPUPOOL_CACHE/image/<name>-deps-<hash of the base recipe, install.sh and the lock>/: the part
    of an image that changes with the lock only, built once instead of at every `make image`."""
    key = digest_of(HERE / "base.sh", HERE / "packages.txt", HERE / "install.sh", lock)
    d = cache_dir() / f"{name}-deps-{key}"
    venv, meta = d / "opt-gpupool", d / "layer.json"
    layer = cached_layer(meta)
    if layer is not None and venv.is_dir():
        log(f"{name}: dependency layer cached ({d})")
        return venv, layer
    for old in cache_dir().glob(f"{name}-deps-*"):  # earlier locks' venvs: ~500 MiB each
        shutil.rmtree(old, ignore_errors=True)
    d.mkdir(parents=True)
    log(f"{name}: install.sh (dependencies only) in a copy of the rootfs -> {d}")
    with tempfile.TemporaryDirectory(prefix="gpupool-image-") as tmp:
        root = Path(tmp, "root")
        subprocess.run(["cp", "-a", str(rootfs), str(root)], check=True)
        chroot_install(root, "install.sh", lock_wheels(lock))
        subprocess.run(["mv", str(root / "opt/gpupool"), str(venv)], check=True)
    return venv, save_layer(make_layer(venv, d / "layer.tar.gz", prefix="opt/gpupool"), meta)


def snapshot(tree: Path) -> dict[str, tuple[int, int, int]]:
    """(mtime, size, mode) of every file and link under tree, by relative path."""
    found = {}
    for p in tree.rglob("*"):
        st = p.lstat()
        if not stat.S_ISDIR(st.st_mode):
            found[str(p.relative_to(tree))] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return found


def dpkg_packages(rootfs: Path) -> list[tuple[str, str, str]]:
    """(name, version, architecture) of every installed package in the rootfs's dpkg status."""
    found = []
    for block in (rootfs / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line[0].isspace())
        if fields.get("Status", "").endswith(" installed"):
            found.append((fields["Package"], fields["Version"], fields.get("Architecture", "")))
    return sorted(found)


def python_dists(venv_lib: Path) -> list[tuple[str, str]]:
    found = []
    for meta in venv_lib.glob("python3*/site-packages/*.dist-info/METADATA"):
        fields = dict(line.split(": ", 1) for line in meta.read_text(errors="replace").split("\n\n")[0].splitlines()
                      if ": " in line)
        found.append((fields["Name"], fields["Version"]))
    return sorted(found, key=lambda nv: nv[0].lower())


def write_sbom(out: Path, name: str, ver: str, debs: list[tuple[str, str, str]], dists: list[tuple[str, str]],
               suffix: str = "") -> None:
    components = [{"type": "library", "name": n, "version": v, "bom-ref": f"deb:{n}",
                   "purl": f"pkg:deb/debian/{n}@{v}?arch={a}&distro=debian-12"} for n, v, a in debs]
    components += [{"type": "library", "name": n, "version": v, "purl": f"pkg:pypi/{n.lower()}@{v}",
                    "bom-ref": f"pypi:{n.lower()}"} for n, v in dists]
    sbom = {"bomFormat": "CycloneDX", "specVersion": "1.5", "serialNumber": f"urn:uuid:{uuid.uuid4()}", "version": 1,
            "metadata": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "component": {"type": "container", "name": name, "version": ver,
                                       "bom-ref": f"{name}:{ver}"}},
            "components": components}
    (out / f"sbom{suffix}.json").write_text(json.dumps(sbom, indent=1) + "\n")
    rows = [("debian", n, v) for n, v, _ in debs] + [("python", n, v) for n, v in dists]
    width = max(len(n) for _, n, _ in rows)
    (out / f"packages{suffix}.txt").write_text("".join(f"{k:<7} {n:<{width}} {v}\n" for k, n, v in rows))


# (lock file, sbom/packages suffix, cached dependency layer?, description) of the images built on the Debian
# base. gpupool-ray's dependencies (450 MiB, most of it Ray) are a layer of their own, cached by the lock's hash, and
# gpupool's wheel a small layer on it: a `make image` with a changed gpupool (CI) rebuilds only that.
IMAGES = {
    "gpupool": ("requirements.lock", "", False, "gpupool scheduler, extender and device plugin"),
    "gpupool-ray": ("requirements-ray.lock", "-ray", True,
                    "gpupool with Ray and its dashboard: the head, workers and submitter of a sweep's KubeRay RayJob"),
}
# what only gpupool-ray sets: no usage-stats report (the cluster has no business reaching ray.io)
RAY_ENV = ["RAY_USAGE_STATS_ENABLED=0"]


def build_gpupool(out: Path, ver: str, name: str = "gpupool") -> Path:
    lock_name, suffix, split, description = IMAGES[name]
    lock = HERE / lock_name
    rootfs, base = base_rootfs()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpupool-image-") as tmp:
        work = Path(tmp)
        root = work / "root"
        if split:
            venv, deps = deps_venv(name, lock, rootfs)
            log(f"{name}: install-app.sh (gpupool's wheel) on the dependency layer")
            subprocess.run(["cp", "-a", str(rootfs), str(root)], check=True)
            subprocess.run(["cp", "-a", str(venv), str(root / "opt/gpupool")], check=True)
            before = snapshot(root / "opt/gpupool")
            wheel_dir = work / "wheels"
            wheel_dir.mkdir()
            for pip_wheel in lock_wheels(lock).glob("pip-*.whl"):
                shutil.copy(pip_wheel, wheel_dir)
            gpupool_wheel(wheel_dir)
            chroot_install(root, "install-app.sh", wheel_dir)
            added = sorted(rel for rel, st in snapshot(root / "opt/gpupool").items() if before.get(rel) != st)
            staging = work / "app"
            staging.mkdir()
            subprocess.run(["cp", "-a", "--parents", "-t", str(staging), *added], check=True,
                           cwd=root / "opt/gpupool")
            app = make_layer(staging, work / "app.tar.gz", prefix="opt/gpupool")
            layers = [base, deps, app]
            log(f"{name}: {len(added)} files added by gpupool's wheel")
        else:
            subprocess.run(["cp", "-a", str(rootfs), str(root)], check=True)
            log(f"{name}: install.sh in a copy of the rootfs")
            chroot_install(root, "install.sh", wheels(work, lock))
            app = make_layer(root / "opt/gpupool", work / "app.tar.gz", prefix="opt/gpupool")
            layers = [base, app]
        write_sbom(out, name, ver, dpkg_packages(root), python_dists(root / "opt/gpupool/lib"), suffix)
        archive = out / f"{name}-{ver}.oci.tar"
        config = ImageConfig(
            cmd=["gpupool", "--help"], user="65532:65532", working_dir="/",
            env=[f"PATH=/opt/gpupool/bin:{DEFAULT_PATH}", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"]
            + (RAY_ENV if name == "gpupool-ray" else []),
            labels={"org.opencontainers.image.title": name, "org.opencontainers.image.version": ver,
                    "org.opencontainers.image.licenses": "Apache-2.0",
                    "org.opencontainers.image.description": description})
        write_oci_archive(archive, f"{name}:{ver}", layers, config)
    sizes = " + ".join(f"{layer.tar_size / 2**20:.1f}" for layer in layers)
    log(f"{name}:{ver}: {sum(layer.tar_size for layer in layers) / 2**20:.1f} MiB uncompressed (layers: {sizes}; "
        f"Debian base first), {archive.stat().st_size / 2**20:.1f} MiB as the archive; {time.monotonic() - start:.1f}s")
    return archive


def build_static(out: Path, source: str, binary: str, name: str, archive_name: str, user: str) -> Path:
    """An image of one static C program (gcc -static -Os, stripped) at /<binary>."""
    if shutil.which("gcc") is None:
        sys.exit("make image: gcc is needed for the pause and workload images (apt-get install gcc libc6-dev)")
    with tempfile.TemporaryDirectory(prefix="gpupool-image-") as tmp:
        root = Path(tmp, "root")
        root.mkdir()
        subprocess.run(["gcc", "-static", "-Os", "-s", "-Wall", "-Werror", "-o", str(root / binary),
                        str(HERE / source)], check=True)
        layer = make_layer(root, Path(tmp, "layer.tar.gz"))
        archive = out / archive_name
        write_oci_archive(archive, name, [layer], ImageConfig(entrypoint=[f"/{binary}"], user=user, env=[]))
    return archive


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "out" / "image")
    p.add_argument("--node-images-only", action="store_true", help="only the pause and workload images")
    p.add_argument("--no-ray", action="store_true", help="not gpupool-ray:<version> (the sweep's RayJob image)")
    p.add_argument("--no-import", action="store_true", help="write the archives only")
    args = p.parse_args()
    ver = version()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    archives = []
    if not args.node_images_only:
        if os.geteuid() != 0:
            sys.exit("make image: needs root (mmdebstrap and chroot build the root file system): sudo make image")
        archives.append(build_gpupool(args.out, ver))
        if not args.no_ray:
            archives.append(build_gpupool(args.out, ver, "gpupool-ray"))
    archives.append(build_static(args.out, "pause.c", "pause", PAUSE_NAME, "pause-3.10.oci.tar", "65535:65535"))
    archives.append(build_static(args.out, "workload.c", "workload", f"gpupool-workload:{ver}",
                                 f"gpupool-workload-{ver}.oci.tar", ""))
    for a in archives:
        log(f"wrote {a.relative_to(REPO) if a.is_relative_to(REPO) else a} ({a.stat().st_size / 2**20:.1f} MiB)")
    if args.no_import:
        pass
    elif CONTAINERD_SOCKET.is_socket():
        for a in archives:
            try:
                import_image(a, str(CONTAINERD_SOCKET))
            except DevClusterError as exc:
                sys.exit(f"make image: {exc}")
        log(f"imported into {CONTAINERD_SOCKET} (namespace k8s.io)")
    else:
        log(f"no containerd at {CONTAINERD_SOCKET}: wrote the archives only (import: ctr -n k8s.io images import FILE)")
    log(f"done in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
