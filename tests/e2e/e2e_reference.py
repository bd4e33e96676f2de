"""The transformers forward of the same weights: what every captured row must equal (to bf16 precision).  The
forward itself is the package's (:mod:`vllm_hs_compat.reference.forward`, shared with ``vllm-hs-compat demo`` and
``verify``); the soundness check of the hybrid reference stays here.

Layer id ``k < num_layers`` is HF ``hidden_states[k]`` (``k = 0``: the embeddings; ``k``: the input of decoder layer
``k``).  Layer id ``num_layers`` is the last decoder layer's output BEFORE the final norm -- HF's last
``hidden_states`` entry is after it, so that one is taken from the final norm's input.

The hybrid verifier is a Llama checkpoint with per-layer ``layer_types``; vLLM's Llama honours them, HF's Llama
does not.  Its reference therefore runs HF's ``MinistralForCausalLM`` -- the Llama architecture with per-layer
sliding-window masks -- over the very same state dict; :func:`check_hybrid_equivalence` proves the two HF classes
equal where the window cannot matter and different where it must.
"""

from __future__ import annotations

import torch

from vllm_hs_compat.reference import forward as _ref

load_hf = _ref.load_hf


def reference(model_dir: str, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """The package's reference, computed on the GPU where the engine ran on one (the same device as the records),
    returned on the CPU for the pairing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return _ref.reference(model_dir, token_ids, layer_ids, device=device).cpu()


def check_hybrid_equivalence(model_dir: str, window: int, seed: int = 0) -> dict[str, float]:
    """The hybrid reference is sound: HF Llama and HF Ministral over the same weights agree bit for bit on a prompt
    no longer than the sliding window, and disagree (in the layers after a sliding layer) on a longer one."""
    from transformers import LlamaForCausalLM

    ministral = load_hf(model_dir)
    llama = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(3, 400, (1, window), generator=g)
    long = torch.randint(3, 400, (1, 3 * window), generator=g)
    with torch.no_grad():
        a = ministral(short, output_hidden_states=True, use_cache=False).hidden_states
        b = llama(short, output_hidden_states=True, use_cache=False).hidden_states
        c = ministral(long, output_hidden_states=True, use_cache=False).hidden_states
        d = llama(long, output_hidden_states=True, use_cache=False).hidden_states
    short_equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    long_diff = float((c[-1][0, window:] - d[-1][0, window:]).abs().max())
    if not short_equal:
        raise AssertionError("HF Ministral and HF Llama disagree on a prompt inside the sliding window")
    if long_diff == 0.0:
        raise AssertionError("HF Ministral ignores the sliding window: the hybrid reference would be a dense one")
    return {"short_equal": 1.0, "long_max_abs_diff": long_diff}
