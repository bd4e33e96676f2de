"""The CLI suite: ``inspect`` against file-sink records and real export producers, ``doctor`` without vLLM
(the release-specific doctor cases live in tests/vllm)."""

from __future__ import annotations

import os
import sys

# UCX reads its environment once, when NIXL is first imported: set it before anything imports nixl.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "export"))
