"""Build the payload that carries vLLM 0.26.0 and this package to a GPU host that has none (docs/gpu.md).

The host (the ``device`` machines: Python 3.12, torch 2.11.0+cu130, no vLLM, no network, at most 64 MiB of files per
call) gets:

* vLLM 0.26.0's wheel (the newest release pinned to torch 2.11.0; a CUDA 13 build), slimmed with ``zip -d`` of what a
  dense or hybrid Llama on ``TRITON_ATTN`` never loads (:data:`SLIM`): 303.7 MB -> 109.3 MB;
* the wheels of every vLLM dependency the host lacks (``payload.txt``; the host's own set is ``device_packages.txt``);
* this package as a wheel (console script and vLLM plugin entry point included) and ``src.tar.gz``: the files the GPU
  cases and benchmarks run from (``tests/e2e``, ``benchmarks/gpu``, ``examples``, the package).

Everything goes into one tar stream split into ``--parts`` equal parts (``partN/payload.partN``), each under
``--limit-mib``; ``install.sh`` on the host joins them, checks every part's sha256 and installs with
``pip install --no-index --no-deps --target``.

Before writing the parts the set is checked (``--check``, on by default): every ``Requires-Dist`` of every carried
wheel (markers evaluated for CPython 3.12 on x86-64 Linux, requested extras followed) must be met by a carried wheel
or a host package, unless a ``# not carried:`` line of ``payload.txt`` names it; with ``--python`` the wheels are also
installed into a scratch target with that interpreter and the modules the GPU run needs are imported there (no CUDA:
those that need a GPU at import are reported, not failed).

    python benchmarks/gpu/build_payload.py --out /path/to/repo/.gpu            # .gpu/part0 .. part2, 48.7 MiB each
    python benchmarks/gpu/build_payload.py --out .gpu --python /usr/bin/python3.12 --torch-site SITE
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VLLM = "vllm==0.26.0"
#: What a dense or hybrid Llama on TRITON_ATTN never loads (zip -d patterns).  vLLM marks a backend whose import
#: fails as invalid and falls back; the cases pass ``attention_backend="TRITON_ATTN"`` explicitly anyway.  One
#: FlashAttention build must stay: on CUDA, ``llama.py`` imports ``layers.attention``, whose encoder attention
#: imports ``v1.attention.backends.fa_utils``, which imports ``vllm.vllm_flash_attn``, which raises ImportError
#: without ``_vllm_fa2_C`` or ``_vllm_fa3_C`` (seen on an H100, 2026-12-06).  FA3 (Hopper) is 38 MB compressed,
#: FA2 129 MB: FA3 stays.
SLIM = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    "vllm/third_party/fmha_sm100/*",
    "vllm/third_party/deep_gemm/_C.cpython-310-*",
    "vllm/third_party/deep_gemm/_C.cpython-311-*",
    "vllm/third_party/deep_gemm/_C.cpython-313-*",
    "vllm/third_party/deep_gemm/_C.cpython-314-*",
    "vllm/entrypoints/serve/instrumentator/static/*",
)
#: The .so that must load: ``vllm/platforms/cuda.py`` imports it unguarded.
MUST_KEEP = "vllm/_C_stable_libtorch.abi3.so"
#: glibc tags pip may take (pip matches each N exactly); the host's Python 3.12.3 image has a newer glibc than 2.35.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 24, 17)) + ("manylinux2014_x86_64",)
#: The files the GPU cases and benchmarks run from (src.tar.gz).
SRC_PATHS = (
    "vllm_hs_compat",
    "tests/e2e",
    "tests/gpu",
    "benchmarks/gpu",
    "benchmarks/bench_capture.py",
    "benchmarks/probe_write_path.py",
    "benchmarks/probe_step_read.py",
    "benchmarks/probe_pinned_reuse.py",
    "benchmarks/thread_clock.py",
    "examples",
    "pyproject.toml",
)
#: Modules the GPU run imports, checked in the scratch install (``--python``).
IMPORTS = (
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.spec_decode.extract_hidden_states",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "vllm.entrypoints.openai.api_server",
    "vllm_hs_compat.connector",
    "vllm_hs_compat.cli",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(line: str, prefix: str) -> set[str]:
    return {_norm(n) for n in re.split(r"[,\s]+", line.removeprefix(prefix).split("(")[0]) if n}


def read_pins(path: Path) -> tuple[list[str], set[str], set[str]]:
    """``payload.txt``: the pins, the names its ``# not carried:`` lines give, and those of its ``# host
    accepted:`` lines (the host's version is used although a carried wheel asks for another)."""
    pins: list[str] = []
    skipped: set[str] = set()
    accepted: set[str] = set()
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("# not carried:"):
            skipped |= _names(s, "# not carried:")
        elif s.startswith("# host accepted:"):
            accepted |= _names(s, "# host accepted:")
        elif s and not s.startswith("#"):
            pins.append(s)
    return pins, skipped, accepted


def read_host(path: Path) -> dict[str, str | None]:
    """``device_packages.txt``: name -> version (None where unknown)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            name, _, version = s.partition("==")
            out[_norm(name)] = version or None
    return out


def download(pins: Iterable[str], dest: Path) -> None:
    """``pip download --no-deps`` of each pin not already in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    have = {_wheel_key(p.name) for p in dest.glob("*.whl")}
    need = [p for p in pins if (_norm(p.split("==")[0]), p.split("==")[1]) not in have]
    if not need:
        return
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    print(f"downloading {len(need)} wheels", flush=True)
    subprocess.run([*cmd, *need], check=True)


def _wheel_key(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return _norm(name), version


def slim_vllm(src: Path, dest: Path) -> Path:
    """A copy of vLLM's wheel without :data:`SLIM` (``zip -d``: nothing recompressed)."""
    out = dest / src.name
    shutil.copyfile(src, out)
    names = set(zipfile.ZipFile(out).namelist())
    if MUST_KEEP not in names:
        raise SystemExit(f"{src.name} has no {MUST_KEEP}: not the build this payload was made for")
    subprocess.run(["zip", "-q", "-d", str(out), *SLIM], check=True)
    return out


def check_requirements(
    wheels: list[Path], host: dict[str, str | None], skipped: set[str], accepted: frozenset[str] = frozenset()
) -> list[str]:
    """Every carried wheel's requirements against the carried set and the host's packages; returns the unmet ones
    (each with the wheel that asked)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    carried: dict[str, Version] = {}
    metas: dict[str, list[str]] = {}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta_name).decode()
        name = _norm(re.search(r"^Name: (.+)$", text, re.M).group(1).strip())  # type: ignore[union-attr]
        carried[name] = Version(re.search(r"^Version: (.+)$", text, re.M).group(1).strip())  # type: ignore[union-attr]
        metas[name] = [m.strip() for m in re.findall(r"^Requires-Dist: (.+)$", text, re.M)]
    env = {
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    unmet: list[str] = []
    todo = [(name, "") for name in carried]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in metas:
            continue
        seen.add((name, extra))
        for raw in metas[name]:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
                continue
            if extra and (req.marker is None or "extra" not in str(req.marker)):
                continue  # base requirements were checked with extra ""
            dep = _norm(req.name)
            if dep in carried:
                if not req.specifier.contains(carried[dep], prereleases=True):
                    unmet.append(f"{name}{f'[{extra}]' if extra else ''} needs {req}, carried {carried[dep]}")
                todo.extend((dep, e) for e in req.extras)
            elif dep in host:
                version = host[dep]
                if (
                    version is not None
                    and dep not in accepted
                    and not req.specifier.contains(Version(version), prereleases=True)
                ):
                    unmet.append(f"{name} needs {req}, the host has {version}")
            elif dep not in skipped:
                unmet.append(f"{name}{f'[{extra}]' if extra else ''} needs {req}: neither carried nor on the host")
    return sorted(set(unmet))


def package_wheel(dest: Path) -> Path:
    """This package as a wheel (its console script and vLLM plugin entry point come with it)."""
    with tempfile.TemporaryDirectory() as tmp:
        # The project's venv is made by uv and has no pip: build with uv where it is on PATH.
        uv = shutil.which("uv")
        if uv is not None:
            cmd = [uv, "build", "-q", "--wheel", "--out-dir", tmp, str(ROOT)]
        else:
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp, str(ROOT)]
        subprocess.run(cmd, check=True, cwd=tmp)
        built = next(Path(tmp).glob("vllm_hs_compat-*.whl"))
        out = dest / built.name
        shutil.copyfile(built, out)
    return out


def src_tarball() -> bytes:
    """The tracked files of :data:`SRC_PATHS` as they are in the working tree, gzipped."""
    files = subprocess.run(
        ["git", "ls-files", "-z", *SRC_PATHS], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
        for f in sorted(x for x in files if x):
            tar.add(ROOT / f, arcname=f"src/{f}", recursive=False)
    return buf.getvalue()


_PROBE = """
import importlib, importlib.metadata as md, json, sys
importlib.import_module(sys.argv[1])
where = sys.argv[2]
dists = md.packages_distributions()
used = sorted({d for name, m in list(sys.modules.items()) if "." not in name
               and str(getattr(m, "__file__", "") or "").startswith(where) for d in dists.get(name, [name])})
print(json.dumps(used))
"""


def scratch_import(
    python: str, wheels: list[Path], torch_site: str | None, host: dict[str, str | None], skipped: set[str]
) -> dict[str, str]:
    """Install the wheels into a scratch target with ``python`` and import :data:`IMPORTS` there, ``torch_site``
    (torch and the host's other packages) after the target.  Every distribution a module was imported from out of
    ``torch_site`` must be one the host has: that site may hold more than the host."""
    result: dict[str, str] = {}
    borrowed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="hs-payload-") as tmp:
        site = Path(tmp) / "site"
        t0 = time.monotonic()
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                str(site),
                *map(str, wheels),
            ],
            check=True,
        )
        print(f"scratch install: {time.monotonic() - t0:.1f} s into {site}", flush=True)
        path = os.pathsep.join([str(site)] + ([torch_site] if torch_site else []))
        for mod in IMPORTS:
            proc = subprocess.run(
                [python, "-c", _PROBE, mod, torch_site or "/nonexistent"],
                env={**os.environ, "PYTHONPATH": path},
                capture_output=True,
                text=True,
                cwd=tmp,
                timeout=300,
            )
            if proc.returncode:
                result[mod] = (proc.stderr.strip().splitlines() or ["failed"])[-1]
            else:
                result[mod] = "ok"
                borrowed.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  import {mod}: {result[mod]}", flush=True)
    missing = sorted(d for d in borrowed if _norm(d) not in host and _norm(d) not in skipped)
    print(f"  imported from --torch-site: {sorted(borrowed)}")
    if missing:
        raise SystemExit(f"imported from --torch-site but not on the host: {missing} (carry them in payload.txt)")
    bad = {m: r for m, r in result.items() if r != "ok"}
    if bad:
        raise SystemExit(f"imports failed: {bad}")
    return result


def write_parts(wheels: list[Path], src: bytes, out: Path, parts: int, limit: int) -> list[Path]:
    """One uncompressed tar of the wheels and src.tar.gz, split into ``parts`` equal parts under ``limit`` bytes."""
    blob = io.BytesIO()
    with tarfile.open(fileobj=blob, mode="w") as tar:
        for w in wheels:
            tar.add(w, arcname=f"payload/{w.name}")
        info = tarfile.TarInfo("payload/src.tar.gz")
        info.size = len(src)
        tar.addfile(info, io.BytesIO(src))
    data = blob.getvalue()
    size = math.ceil(len(data) / parts)
    if size > limit:
        need = math.ceil(len(data) / limit)
        raise SystemExit(
            f"{len(data) / 2**20:.1f} MiB in {parts} parts is {size / 2**20:.1f} MiB a part, over "
            f"--limit-mib {limit / 2**20:.0f}: use --parts {need}"
        )
    sums = {}
    paths = []
    for i in range(parts):
        d = out / f"part{i}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        p = d / f"payload.part{i}"
        chunk = data[i * size : (i + 1) * size]
        p.write_bytes(chunk)
        sums[p.name] = hashlib.sha256(chunk).hexdigest()
        paths.append(p)
    manifest = {
        "parts": parts,
        "sha256": sums,
        "bytes": len(data),
        "wheels": [w.name for w in wheels],
        "src_bytes": len(src),
    }
    for i in range(parts):
        (out / f"part{i}" / "payload.json").write_text(json.dumps(manifest, indent=1))
        shutil.copyfile(HERE / "install.sh", out / f"part{i}" / "install.sh")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for part0 .. partN-1 (e.g. the repo's ignored .gpu)")
    ap.add_argument(
        "--cache",
        default=os.path.expanduser("~/.cache/vllm-hs-compat/gpu-payload"),
        help="downloaded wheels (kept between builds)",
    )
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--limit-mib", type=float, default=58.0, help="largest part (64 MiB a call, less the tree)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the requirements check")
    ap.add_argument("--python", default=None, help="a Python 3.12 to install the payload into and import from")
    ap.add_argument(
        "--torch-site",
        default=None,
        help="with --python: a site-packages holding torch (and the host's other packages) to import against",
    )
    args = ap.parse_args(argv)
    pins, skipped, accepted = read_pins(HERE / "payload.txt")
    host = read_host(HERE / "device_packages.txt")
    cache = Path(args.cache)
    download(pins, cache / "wheels")
    wanted = {(_norm(p.split("==")[0]), p.split("==")[1]) for p in pins}
    carried = sorted(w for w in (cache / "wheels").glob("*.whl") if _wheel_key(w.name) in wanted)
    if len(carried) != len(pins):
        got = {_wheel_key(w.name) for w in carried}
        raise SystemExit(f"missing wheels for {sorted(wanted - got)}")
    work = Path(tempfile.mkdtemp(prefix="hs-payload-"))
    try:
        vllm_whl = next(w for w in carried if _wheel_key(w.name)[0] == "vllm")
        slim = slim_vllm(vllm_whl, work)
        print(f"vLLM wheel {vllm_whl.stat().st_size / 1e6:.1f} MB -> slimmed {slim.stat().st_size / 1e6:.1f} MB")
        ours = package_wheel(work)
        wheels = [slim if w == vllm_whl else w for w in carried] + [ours]
        if args.check:
            unmet = check_requirements(wheels, host, skipped, frozenset(accepted))
            for u in unmet:
                print(f"UNMET: {u}")
            if unmet:
                raise SystemExit(
                    f"{len(unmet)} requirements unmet (add the wheel to payload.txt or a '# not carried:' "
                    "line saying why)"
                )
            print(
                f"requirements: every Requires-Dist of {len(wheels)} wheels met (carried, on the host, or named "
                f"not carried: {sorted(skipped)}; host version accepted: {sorted(accepted)})"
            )
        if args.python:
            scratch_import(args.python, wheels, args.torch_site, host, skipped)
        src = src_tarball()
        paths = write_parts(wheels, src, Path(args.out), args.parts, int(args.limit_mib * 2**20))
        total = sum(p.stat().st_size for p in paths)
        print(
            f"payload: {len(wheels)} wheels + src.tar.gz ({len(src) / 2**20:.2f} MiB) = {total / 2**20:.1f} MiB in "
            f"{len(paths)} parts: " + ", ".join(f"{p.parent.name} {p.stat().st_size / 2**20:.1f} MiB" for p in paths)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
