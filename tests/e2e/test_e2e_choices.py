"""A real engine (issue 16): ``n=2`` reaches both choices' records from the one merged ``kv_transfer_params`` vLLM
keeps, capture ``"prompt"`` stores the shared prompt once, and SIGKILL of every process of the engine (the gate
included) leaves nothing in ``/dev/shm``.  One engine start (``e2e_choices_engine.py``); the client here holds no
trainer token, only the response's params."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import e2e_cases
import e2e_models
import pytest

from vllm_hs_compat.export import ExportConsumer

HERE = Path(__file__).resolve().parent
SHM = "/dev/shm"


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _unnamed_pools(pids: list[int]) -> list[str]:
    """The pool descriptors these processes hold: files in /dev/shm without a name (``/dev/shm/#<ino> (deleted)``)."""
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(f"{SHM}/#") and target.endswith("(deleted)"):
                found.append(target)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.e2e
def test_n2_choices_reach_every_record_and_sigkill_leaves_shm_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = e2e_models.make_model(str(tmp_path / "model"), "dense", seed=7).path
    out = tmp_path / "run"
    out.mkdir()
    before = set(os.listdir(SHM))
    env = {**e2e_cases.base_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # engine core (and worker) processes
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "e2e_choices_engine.py"), model, str(out)],
        env=env,
        stdout=open(out / "engine.log", "wb"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (out / "result.json").exists():
            assert proc.poll() is None, (out / "engine.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no result in 600 s"
            time.sleep(0.5)
        results = json.loads((out / "result.json").read_text())
        # the client: only the response's params (no trainer token on this "host")
        monkeypatch.setenv("VLLM_HS_COMPAT_EXPORT_TOKEN_FILE", str(tmp_path / "no-token-here"))
        monkeypatch.delenv("VLLM_HS_COMPAT_EXPORT_TOKEN", raising=False)

        everything, prompt_only = results
        choices = everything["kv_transfer_params"]["hs_choices"]
        assert [e["index"] for e in choices] == [0, 1]
        assert [e["hs_record"]["status"] for e in choices] == ["queued", "queued"]
        ids = [e["hs_export"]["record_id"] for e in choices]
        assert len(set(ids)) == 2
        for e, generated in zip(choices, everything["outputs"], strict=True):
            with ExportConsumer.from_params(e) as c:
                assert c.principal == "record"
                rec = c.fetch(e["hs_export"]["record_id"], wait_s=60)
            # capture "all": the prompt and this choice's generated tokens whose hidden states were computed: all
            # but the last, or all of them when the engine ran one more step for this choice before it learned the
            # choice had finished (seen on 0.32.0 with both choices in one batch)
            full, toks = everything["prompt"] + generated, list(rec.meta.token_ids)
            assert toks == full[: len(toks)] and len(full) - 1 <= len(toks) <= len(full), (len(toks), len(full))

        shared = prompt_only["kv_transfer_params"]["hs_choices"]
        statuses = sorted(e["hs_record"]["status"] for e in shared)
        assert statuses == ["queued", "shared"]
        (holder,) = {e["hs_export"]["record_id"] for e in shared}  # both choices lead to one record
        assert {e["hs_record"].get("same_as") for e in shared} == {None, holder}
        with ExportConsumer.from_params(shared[0]) as c:
            rec = c.fetch(holder, wait_s=60)
        assert list(rec.meta.token_ids) == prompt_only["prompt"]

        # the pool exists, in /dev/shm, without a name
        procs = _descendants(proc.pid)
        assert _unnamed_pools(procs), f"no unnamed /dev/shm pool held by {procs}"
        assert not [n for n in set(os.listdir(SHM)) - before if n.startswith(("hsx2-", ".hsx2-"))]
    finally:
        procs = _descendants(proc.pid)
        for pid in procs:  # every process of the engine, the gate included, at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
    t0 = time.monotonic()
    while any(_alive(p) for p in procs) and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert not any(_alive(p) for p in procs)
    left = [n for n in set(os.listdir(SHM)) - before if n.startswith(("hsx2-", ".hsx2-"))]
    assert left == [], f"left in {SHM}: {left}"
