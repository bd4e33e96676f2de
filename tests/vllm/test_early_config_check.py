"""The general plugin's early check on this release's own ``EngineArgs``: a bad ``kv_connector_extra_config``
is refused by ``create_engine_config`` -- where ``vllm serve``, the OpenAI api_server module and ``LLM(...)`` turn
their arguments into a config, before any engine process or model load -- with the package's message; a good
one goes on to vLLM's own config (the negative control)."""

from __future__ import annotations

import time
import traceback

import harness
import pytest

from vllm_hs_compat.errors import CaptureConfigError

pytestmark = pytest.mark.vllm


def _args(model: str, extra: dict[str, object]) -> object:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv = KVTransferConfig(
        kv_connector="HiddenStatesCaptureConnector", kv_role="kv_producer", kv_connector_extra_config=extra
    )
    return EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=harness.MAX_MODEL_LEN, kv_transfer_config=kv)


def test_create_engine_config_refuses_a_typo_first() -> None:
    model = harness.model_config().model
    bad = _args(model, {"capture": "prompt", "export": {"num_slot": 4}})
    t0 = time.monotonic()
    with pytest.raises(CaptureConfigError, match=r"unknown keys \['num_slot'\] \(did you mean 'num_slots'"):
        bad.create_engine_config()  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 5.0
    good = _args(model, {"capture": "prompt", "export": {"num_slots": 4}})
    try:
        config = good.create_engine_config()  # type: ignore[attr-defined]
    except CaptureConfigError:
        raise
    except Exception as exc:  # a release may refuse this CPU-only setup for its own reasons: past our check still
        frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
        assert sum(f.endswith("arg_utils.py") for f in frames) >= 1, frames
    else:
        assert config.kv_transfer_config.kv_connector_extra_config["export"] == {"num_slots": 4}
