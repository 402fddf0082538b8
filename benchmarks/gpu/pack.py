"""The wheels that the GPU run (benchmarks/gpu/run.sh) carries to a machine with no network.

That machine's Python has torch, transformers and much else (its image), but not Celery,
pydantic, FastAPI and the rest of what llmpipe runs on. The wheels it needs are the
closure of llmpipe's dependencies, read from the packages' METADATA, less what the image
has in a version known to satisfy the requirement. The list is kept in
benchmarks/gpu/wheels.txt (``--relock`` rewrites it from this venv's versions), so that a pack
downloads exactly it.

    python -m benchmarks.gpu.pack                 # .whl/ for Python 3.12, checks, carry list
    python -m benchmarks.gpu.pack --relock        # rewrite benchmarks/gpu/wheels.txt first
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = Path(__file__).resolve().parent / "wheels.txt"
LIMIT_BYTES = 64 * 2**20  # what travels with one device call, the working tree included
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]

# The H200 image's Python packages (the device tool's KINDS.md, read 2026-11-17) and the
# versions it gives for some (its pip list). A requirement on one of these is left to the
# image when it has no version bound, or when the known version satisfies it.
IMAGE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "tokenizers": "0.23.2", "numpy": "2.5.2",
                  "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "accelerate": "1.15.0"}
IMAGE_PACKAGES = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax opt-einsum orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest python-dateutil pytorch-lightning pyyaml
regex requests rich safetensors scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard threadpoolctl tiktoken timm
tokenizers toolz torch torchaudio torchvision tqdm transformers triton typer typing-extensions typing-inspect
urllib3 uvloop werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# llmpipe dependencies the GPU run does not use, or takes from the image as they are.
NOT_CARRIED = {
    "flower": "the GPU run starts no Flower",
    "gguf": "SmolLM2 preparation only",
    "accelerate": "SmolLM2 preparation only",
    "matplotlib": "the image's (plots are left out without it)",
}


def target_env(python_version: str) -> dict[str, str]:
    env = default_environment()
    full = python_version if python_version.count(".") == 2 else f"{python_version}.0"
    env.update(python_version=".".join(full.split(".")[:2]), python_full_version=full, sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}) | {""})


def image_satisfies(req: Requirement) -> bool:
    name = canonicalize_name(req.name)
    if name not in IMAGE_PACKAGES:
        return False
    known = IMAGE_VERSIONS.get(name)
    if known is not None:
        return req.specifier.contains(Version(known), prereleases=True)
    return not str(req.specifier)


def project_requirements() -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if canonicalize_name(r.name) not in NOT_CARRIED]


def resolve(python_version: str = "3.12") -> dict[str, str]:
    """name -> version to carry: the closure of the project's requirements over this
    venv's installed METADATA, evaluated for ``python_version`` on Linux x86_64."""
    env = target_env(python_version)
    todo = [(r, set(r.extras)) for r in project_requirements()]
    carry: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if image_satisfies(req):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{req} is needed on the GPU but not installed here: install it, then --relock") from None
        if not req.specifier.contains(Version(dist.version), prereleases=True):
            raise SystemExit(f"{req} is needed on the GPU, but this venv has {name} {dist.version}")
        carry[name] = dist.version
        if (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        for sub in map(Requirement, dist.requires or []):
            if _applies(sub, env, extras):
                todo.append((sub, set(sub.extras)))
    return dict(sorted(carry.items()))


def write_lock(carry: dict[str, str], path: Path = LOCK) -> None:
    head = ("# Wheels carried to the GPU machine (python -m benchmarks.gpu.pack --relock writes this file;\n"
            "# benchmarks/gpu/pack.py says how it is derived).\n")
    path.write_text(head + "".join(f"{n}=={v}\n" for n, v in carry.items()))


def read_lock(path: Path = LOCK) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def lock_key(python_version: str, path: Path = LOCK) -> str:
    return hashlib.sha256(("\n".join(read_lock(path)) + python_version).encode()).hexdigest()[:12]


def download(dest: Path, python_version: str = "3.12", pins: list[str] | None = None) -> list[Path]:
    """Exactly the locked wheels (no dependencies of their own) into ``dest``, which
    holds nothing else afterwards."""
    pins = pins or read_lock()
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *pins]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    noise = "it is neither a file nor a directory"  # a local index in this machine's pip config
    sys.stderr.write("".join(ln for ln in proc.stderr.splitlines(keepends=True) if noise not in ln))
    if proc.returncode:
        raise SystemExit(f"pip download failed (exit {proc.returncode})")
    wanted = {canonicalize_name(p.split("==")[0]) for p in pins}
    wheels = []
    for w in sorted(dest.glob("*.whl")):
        if canonicalize_name(w.name.split("-")[0]) in wanted and _wheel_version(w) in {p.split("==")[1] for p in pins}:
            wheels.append(w)
        else:
            w.unlink()  # a stale version from an earlier lock: two versions stop the install
    return wheels


def _wheel_version(w: Path) -> str:
    return w.name.split("-")[1]


def _wheel_metadata(w: Path):
    with zipfile.ZipFile(w) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return Parser().parsestr(z.read(name).decode())


def check_closure(wheels: list[Path], python_version: str = "3.12") -> list[str]:
    """Each requirement of each wheel (markers for ``python_version``), met by another
    wheel or by the image; returns what is not."""
    env = target_env(python_version)
    have = {canonicalize_name(w.name.split("-")[0]): Version(_wheel_version(w)) for w in wheels}
    missing = []
    for req in project_requirements():
        if canonicalize_name(req.name) not in have and not image_satisfies(req):
            missing.append(f"llmpipe needs {req}")
    for w in wheels:
        meta = _wheel_metadata(w)
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if not _applies(req, env, set()):
                continue
            name = canonicalize_name(req.name)
            if name in have:
                if not req.specifier.contains(have[name], prereleases=True):
                    missing.append(f"{w.name} needs {req}, the pack has {have[name]}")
            elif not image_satisfies(req):
                missing.append(f"{w.name} needs {req}")
    return missing


def travel_bytes(carry: list[Path]) -> int:
    """What one device call sends: tracked and untracked-not-ignored files, plus ``carry``."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode()
    total = sum((ROOT / f).stat().st_size for f in out.split("\0") if f and (ROOT / f).is_file())
    for c in carry:
        total += sum(p.stat().st_size for p in Path(c).rglob("*") if p.is_file())
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--relock", action="store_true", help="rewrite benchmarks/gpu/wheels.txt from this venv first")
    a = ap.parse_args(argv)
    if a.relock:
        write_lock(resolve(a.python_version))
        print(f"wrote {LOCK.relative_to(ROOT)}")
    wheels = download(a.dest, a.python_version)
    missing = check_closure(wheels, a.python_version)
    for m in missing:
        print(f"missing: {m}", file=sys.stderr)
    size = sum(w.stat().st_size for w in wheels)
    total = travel_bytes([a.dest]) if a.dest.resolve().is_relative_to(ROOT) else size
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB; everything that travels: {total / 2**20:.1f} MiB "
          f"of {LIMIT_BYTES / 2**20:.0f} MiB")
    if missing or total > LIMIT_BYTES:
        print("gpu-pack: FAILED" + (" (over the limit)" if total > LIMIT_BYTES else ""), file=sys.stderr)
        return 1
    rel = a.dest.resolve().relative_to(ROOT) if a.dest.resolve().is_relative_to(ROOT) else a.dest
    print(f'carry: ["{rel}"]')
    return 0


if __name__ == "__main__":
    sys.exit(main())


def image_venv(dest: Path, site_packages: Path | None = None) -> Path:
    """A stand-in for the GPU machine's Python, for the CPU rehearsal: a fresh venv that
    sees, of this venv's packages, only those the image has (by name; their versions are
    this venv's) with what those versions need themselves (the image is consistent in
    the same way), and none that the pack carries. Returns its python."""
    import shutil
    import sysconfig

    carried = {canonicalize_name(p.split("==")[0]) for p in read_lock()}
    src = Path(site_packages or sysconfig.get_paths()["purelib"])
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(dest)],
                   check=True)
    py = dest / "bin" / "python"
    target = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(src)])}
    env = target_env(".".join(map(str, sys.version_info[:3])))
    keep, todo = set(), [n for n in dists if n in IMAGE_PACKAGES]
    while todo:
        name = todo.pop()
        if name in keep or name in carried or name not in dists:
            continue
        keep.add(name)
        todo += [canonicalize_name(r.name) for r in map(Requirement, dists[name].requires or [])
                 if r.marker is None or r.marker.evaluate({**env, "extra": ""})]
    for name in sorted(keep):
        dist = dists[name]
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if top.endswith(".pth") or top == "__pycache__" or (target / top).exists():
                continue
            if (src / top).exists():
                (target / top).symlink_to(src / top)
    return py
