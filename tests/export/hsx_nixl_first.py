"""A trainer process that imported NIXL before vllm-hs-compat (another library's NIXL agent came first).

Run as ``python hsx_nixl_first.py ENDPOINT TOKEN RECORD_ID [TX RX]``: it imports NIXL and starts an agent of "the
other library" (which, given ``TX RX``, first sets UCX's TCP segment sizes to its own choice, as a library that
tunes UCX for itself would), then imports vllm-hs-compat, opens a trainer's consumer of ENDPOINT and fetches
RECORD_ID.  One JSON line on stdout says what happened; a process that UCX aborts prints none (its exit status
says it).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("UCX_NET_DEVICES", "lo")
# The JSON line goes to the original stdout; NIXL's log lines go to stderr.
CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

endpoint, token, record_id, *sizes = sys.argv[1:]
if sizes:  # the other library's choice, made before it set up NIXL
    os.environ["UCX_TCP_TX_SEG_SIZE"], os.environ["UCX_TCP_RX_SEG_SIZE"] = sizes

import importlib  # noqa: E402

for name in ("nixl", "nixl_cu13", "nixl_cu12"):  # NIXL before vllm-hs-compat
    try:
        nixl = importlib.import_module(f"{name}._api")
        break
    except ImportError:
        continue
other = nixl.nixl_agent("other-library", nixl.nixl_agent_config(backends=["UCX"], enable_prog_thread=False))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hsx_testdata import digest  # noqa: E402

from vllm_hs_compat.errors import HsCompatError  # noqa: E402
from vllm_hs_compat.export import ExportConsumer  # noqa: E402

out: dict[str, object] = {"env": {k: v for k, v in os.environ.items() if k.startswith("UCX_TCP")}}
try:
    with ExportConsumer(endpoint, token, backend="nixl", timeout_s=20.0) as c:
        out["stage"] = "connected"
        rec = c.fetch(record_id)
        out["sha256"] = digest(rec.hidden_states)
except HsCompatError as e:
    out["error"] = type(e).__name__
    out["message"] = str(e)
print(json.dumps(out), file=CHANNEL, flush=True)
