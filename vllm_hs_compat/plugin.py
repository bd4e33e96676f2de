"""``vllm.general_plugins`` entry point, run by vLLM in every process it starts (the front end that parses the
command line or builds ``LLM(...)``, the engine core, the workers).  It

* registers ``HiddenStatesCaptureConnector`` with vLLM's connector factory, so ``--kv-transfer-config
  '{"kv_connector": "HiddenStatesCaptureConnector", ...}'`` works without ``kv_connector_module_path``;
* in the front end's process, installs a check of ``kv_connector_extra_config`` that runs when vLLM turns its
  arguments into a config (``EngineArgs.create_engine_config``), before any engine process starts or the model
  loads: a typo fails in about a second with the package's own message as the last line (otherwise it would be
  refused only when the scheduler builds the connector, after the model loaded, under vLLM's generic "Engine core
  initialization failed").

``register`` itself never raises (a failure is logged; the module path and the connector's own checks still
work); the check it installs raises :class:`~vllm_hs_compat.errors.CaptureConfigError` for a config that names
this connector and is wrong, and does nothing for any other connector.
"""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.vllm_hs_compat.plugin")


def register() -> None:
    """Register the connector name and the early config check (once per process)."""
    try:
        from vllm_hs_compat.adapters import register_connector
        from vllm_hs_compat.connector import CONNECTOR_NAME, MODULE_PATH

        register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except Exception as e:  # a plugin must not stop vLLM from starting
        log.warning("vllm-hs-compat: could not register %s with vLLM (%s: %s)", "connector", type(e).__name__, e)
    try:
        from vllm_hs_compat.adapters import check_config_before_engine
        from vllm_hs_compat.connector.config import check_kv_transfer_config

        check_config_before_engine(check_kv_transfer_config)
    except Exception as e:  # the connector still checks its config when the engine builds it
        log.warning("vllm-hs-compat: could not install the early config check (%s: %s)", type(e).__name__, e)
