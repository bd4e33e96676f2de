"""vllm-hs-compat: capture per-layer hidden states from vLLM 0.17-0.34 and stream them to trainers."""

from vllm_hs_compat.errors import HsCompatError

__version__ = "0.1.0"
__all__ = ["HsCompatError", "__version__"]
