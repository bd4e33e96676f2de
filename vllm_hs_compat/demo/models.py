"""Moved to :mod:`vllm_hs_compat.reference.models` (this name works for one release)."""

import sys

from vllm_hs_compat.demo._moved import moved

sys.modules[__name__] = moved(__name__, "vllm_hs_compat.reference.models")
