"""The transformers forward of the same weights: what every captured row must equal (to bf16 precision).

Layer id ``k < num_layers`` is HF ``hidden_states[k]`` (``k = 0``: the embeddings; ``k``: the input of decoder layer
``k``).  Layer id ``num_layers`` is the last decoder layer's output BEFORE the final norm -- HF's last
``hidden_states`` entry is after it, so that one is taken from the final norm's input.

The hybrid verifier is a Llama checkpoint with per-layer ``layer_types``; vLLM's Llama honours them, HF's Llama
does not.  Its reference therefore runs HF's ``MinistralForCausalLM`` -- the Llama architecture with per-layer
sliding-window masks -- over the very same state dict; :func:`check_hybrid_equivalence` proves the two HF classes
equal where the window cannot matter and different where it must.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch


@functools.cache
def load_hf(model_dir: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t == "sliding_attention" for t in layer_types):
        return _load_ministral(model_dir, dtype)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


def _load_ministral(model_dir: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, LlamaForCausalLM, MinistralConfig, MinistralForCausalLM

    src = AutoConfig.from_pretrained(model_dir)
    cfg = MinistralConfig(
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads,
        head_dim=src.head_dim,
        max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps,
        rope_parameters=src.rope_parameters,
        tie_word_embeddings=src.tie_word_embeddings,
        sliding_window=src.sliding_window,
        layer_types=list(src.layer_types),
        hidden_act=src.hidden_act,
    )
    llama = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    # Built in the target dtype (not cast afterwards): a cast would also round the rotary inv_freq buffer, which
    # from_pretrained keeps in float32.
    model = MinistralForCausalLM._from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    # Tied lm_head may be reported either way; nothing else may differ.
    bad = [k for k in list(missing) + list(unexpected) if k != "lm_head.weight"]
    if bad:
        raise RuntimeError(f"Llama -> Ministral state dict mismatch: {bad}")
    model.config._attn_implementation = "eager"
    return model.eval()


def reference(model_dir: str, token_ids: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """``[T, P, C]`` for these tokens, plane ``i`` = layer id ``layer_ids[i]``, in the model's dtype."""
    model = load_hf(model_dir)
    num_layers = model.config.num_hidden_layers
    pre_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0].detach()))
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)], dtype=torch.long), output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    hs = out.hidden_states
    assert len(hs) == num_layers + 1, f"expected {num_layers + 1} hidden states, got {len(hs)}"
    assert len(pre_norm) == 1
    planes = []
    for k in layer_ids:
        if not 0 <= k <= num_layers:
            raise ValueError(f"layer id {k} outside [0, {num_layers}]")
        planes.append(pre_norm[0][0] if k == num_layers else hs[k][0])
    return torch.stack(planes, dim=1)


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
