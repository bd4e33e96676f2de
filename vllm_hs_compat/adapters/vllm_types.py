"""vLLM's types for annotations outside ``adapters/`` (type checking only: nothing here runs).

Faces (``connector/``, the CLI) name vLLM's objects in their signatures through this module, so the only place
that spells vLLM's module paths stays ``adapters/``.  mypy resolves them against the vLLM release the ``lint``
session installs; at run time the module defines nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVCacheConfig", "Request", "SchedulerOutput", "VllmConfig"]
