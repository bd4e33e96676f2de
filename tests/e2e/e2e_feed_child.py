"""Child process of ``test_capture.py``'s feed test: ``capture``'s :class:`EngineFeed` on a real in-process engine.

    python e2e_feed_child.py MODEL OUT_DIR LAYERS

Three batches of three prompts, each queued with ``submit`` and run with ``finish``: the first as the capture command
runs one; in the second, one request is aborted through vLLM's own ``LLMEngine.abort_request`` after it was
queued (someone else dropped it: it never finishes); the third runs after that on the same engine.  Prints one JSON
line: per batch, either the records the connector reported and how many of them are still unread, or the error.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm_hs_compat.demo.engine import build_llm, prepare_env, shutdown


def main() -> int:
    model, out, layers = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    prepare_env()
    from vllm_hs_compat.adapters.engine_api import sampling_params
    from vllm_hs_compat.capture.feed import EngineFeed
    from vllm_hs_compat.connector import unread
    from vllm_hs_compat.core.vocabulary import REQUEST_KEY, RESULT_KEY
    from vllm_hs_compat.errors import CaptureFeedError

    llm = build_llm(model, layers, {"capture": "prompt", "sink": "file", "file": {"path": out}}, max_model_len=200)
    feed = EngineFeed(llm, read_wait_s=20.0)
    kv = {"kv_transfer_params": {REQUEST_KEY: {"capture": "prompt"}}}
    got: dict[str, Any] = {}
    for batch in ("first", "aborted", "after"):
        prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(20 + 5 * i)]} for i in range(3)]
        sub = feed.submit(prompts, [sampling_params(max_tokens=1, temperature=0.0, extra_args=kv) for _ in prompts])
        if batch == "aborted":
            llm.llm_engine.abort_request([sub.request_ids[1]])
        try:
            outs = feed.finish(sub)
        except CaptureFeedError as exc:
            got[batch] = {"error": str(exc), "dropped": sub.request_ids[1]}
            continue
        records = [str((o.kv_transfer_params or {}).get(RESULT_KEY, {}).get("record_id")) for o in outs]
        got[batch] = {"records": records, "unread": unread(records), "steps": feed.steps}
    shutdown(llm)
    print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
