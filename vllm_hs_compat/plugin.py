"""``vllm.general_plugins`` entry point: registers ``HiddenStatesCaptureConnector`` with vLLM's connector
factory, so ``--kv-transfer-config '{"kv_connector": "HiddenStatesCaptureConnector", ...}'`` works without
``kv_connector_module_path``.  vLLM runs general plugins in every process it starts; this one never raises
(a failure is logged and the module path still works)."""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.vllm_hs_compat.plugin")


def register() -> None:
    """Register the connector name (once per process)."""
    try:
        from vllm_hs_compat.adapters import register_connector
        from vllm_hs_compat.connector import CONNECTOR_NAME, MODULE_PATH

        register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except Exception as e:  # a plugin must not stop vLLM from starting
        log.warning("vllm-hs-compat: could not register %s with vLLM (%s: %s)", "connector", type(e).__name__, e)
