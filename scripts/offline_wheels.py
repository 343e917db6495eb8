#!/usr/bin/env python3
"""Bring thunder_tk's Python dependencies to a GPU host that has no internet.

On a machine with internet, download the wheels the host lacks (the host's Python version and platform):

    python scripts/offline_wheels.py download --python 3.12 --dest .whl [--litgpt] [--have host-packages.txt]

`--have` names a file listing what the host already has (one name per line, or `pip list`/`pip freeze`
output); without it, the packages of a standard CUDA PyTorch image are assumed present. Dependencies
are followed through each wheel's metadata, so the set is complete. On the host:

    python3 scripts/offline_wheels.py install --from .whl --target /tmp/site
    export PYTHONPATH=/tmp/site

then build thunder_tk there with `pip install --no-build-isolation --no-index .`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# What thunder_tk needs at run time beyond PyTorch, by feature.
REQUIREMENTS = {
    "core": ["lightning-thunder==0.2.6", "pyyaml"],
    "litgpt": ["litgpt==0.5.13", "jsonargparse[signatures]>=4.30"],
}

# Present in a CUDA PyTorch image; never downloaded unless --have says otherwise.
ASSUMED_PRESENT = {
    "torch", "triton", "numpy", "networkx", "sympy", "mpmath", "filelock", "fsspec", "jinja2", "markupsafe",
    "typing-extensions", "setuptools", "packaging", "pyyaml", "opt-einsum", "lightning-utilities", "requests",
    "tqdm", "safetensors", "tokenizers", "huggingface-hub", "lightning", "pytorch-lightning", "torchmetrics",
    "psutil", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "rich", "pygments",
    "markdown-it-py", "mdurl", "aiohttp", "yarl", "multidict", "frozenlist", "aiosignal", "attrs", "idna",
    "propcache", "aiohappyeyeballs", "certifi", "charset-normalizer", "urllib3", "hf-xet", "httpx", "httpcore",
    "anyio", "h11", "click", "typer", "shellingham", "pybind11", "scikit-build-core", "cmake", "ninja",
}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: str | None) -> set[str]:
    if path is None:
        return set(ASSUMED_PRESENT)
    names = set()
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and not line.lstrip().startswith(("#", "Package", "---")):
            names.add(canonical(m.group(1)))
    return names


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0])


def wheel_requirements(wheel: Path, extras: set[str]) -> list[str]:
    """Requires-Dist lines of a wheel that apply on Linux without extras (or with the named extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        marker = req.split(";", 1)[1] if ";" in req else ""
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra and extra.group(1) not in extras:
            continue
        if re.search(r"sys_platform\s*==\s*['\"](win32|darwin)['\"]", marker):
            continue
        if re.search(r"python_version\s*<\s*['\"]3\.(\d+)['\"]", marker):
            continue  # backports for older Pythons
        reqs.append(req.split(";", 1)[0].strip())
    return reqs


def download(reqs: list[str], dest: Path, python: str, have: set[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    queue = list(reqs)
    while queue:
        req = queue.pop(0)
        name = requirement_name(req)
        if name in seen or name in have:
            continue
        seen.add(name)
        extras = set(re.findall(r"\[([^\]]+)\]", req)[0].split(",")) if "[" in req else set()
        spec = re.sub(r"\[[^\]]*\]", "", req)
        before = set(dest.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", "-d", str(dest), "-q"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        print(f"downloading {spec}", flush=True)
        subprocess.run(cmd + [spec], check=True)
        new = set(dest.glob("*.whl")) - before
        wheel = next(iter(new), None) or next(
            (w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) == name), None)
        if wheel is None:
            raise SystemExit(f"no wheel for {spec} was saved in {dest}")
        queue += wheel_requirements(wheel, {e.strip() for e in extras})
    print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}")


def install(src: Path, target: Path) -> None:
    wheels = sorted(str(w) for w in src.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {src}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)
    print(f"installed {len(wheels)} wheels into {target}; export PYTHONPATH={target}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("--python", default="3.12", help="the host's Python version (default 3.12)")
    d.add_argument("--dest", default=".whl")
    d.add_argument("--litgpt", action="store_true", help="also LitGPT, for the pretrain command")
    d.add_argument("--have", help="file listing packages the host already has")
    i = sub.add_parser("install")
    i.add_argument("--from", dest="src", default=".whl")
    i.add_argument("--target", default="/tmp/site")
    a = p.parse_args()
    if a.cmd == "download":
        reqs = REQUIREMENTS["core"] + (REQUIREMENTS["litgpt"] if a.litgpt else [])
        download(reqs, Path(a.dest), a.python, read_have(a.have))
    else:
        install(Path(a.src), Path(a.target))


if __name__ == "__main__":
    main()
