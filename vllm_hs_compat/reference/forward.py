"""The transformers forward of the same weights: what every captured row must equal (to bf16 precision).

Capture convention (vLLM's ``extract_hidden_states``): layer id ``k < num_layers`` is HF ``hidden_states[k]``
(``k = 0``: the embeddings; ``k``: the input of decoder layer ``k``).  Layer id ``num_layers`` is the last decoder
layer's output BEFORE the final norm -- HF's last ``hidden_states`` entry is after it, so that one is taken from
the final norm's input (a forward pre-hook).

The tiny hybrid verifier is a Llama checkpoint with per-layer ``layer_types``; vLLM's Llama honours them, HF's
Llama does not.  Its reference therefore runs HF's ``MinistralForCausalLM`` -- the Llama architecture with
per-layer sliding-window masks -- over the very same state dict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hs_compat.errors import HfReferenceError

#: Per-row relative L2 tolerance of one plane.  bf16 has an 8-bit mantissa (relative step 2^-8); vLLM and
#: transformers round differently in every matmul and norm, and the error grows with depth.  Measured on the
#: tiny models: matching rows stay below ~0.036, rows of a different context are >= ~0.25 apart.
ROW_TOL = 0.08


@functools.cache
def load_hf(model_dir: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Any:
    """The HF causal LM of ``model_dir`` in eval mode (eager attention), cached per process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    layer_types = getattr(config, "layer_types", None)
    if (
        getattr(config, "model_type", None) == "llama"
        and layer_types
        and any(t == "sliding_attention" for t in layer_types)
    ):
        return _load_ministral(model_dir, dtype).to(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


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
        raise HfReferenceError(f"{model_dir}: the Llama -> Ministral state dicts differ in {bad}")
    model.config._attn_implementation = "eager"
    return model.eval()


def final_norm(model: Any) -> Any:
    """The decoder's final norm module (``model.model.norm`` on Llama-style models), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    return getattr(decoder, "norm", None)


@dataclass(frozen=True)
class HfPlanes:
    """One forward: HF's ``hidden_states`` (``num_layers + 1`` tensors ``[T, C]``; the last one after the final
    norm) and the final norm's input (``[T, C]``, None when the model has no ``norm`` to hook)."""

    hidden_states: tuple[torch.Tensor, ...]
    pre_norm: torch.Tensor | None

    @property
    def num_layers(self) -> int:
        return len(self.hidden_states) - 1


def hf_planes(model: Any, token_ids: Sequence[int]) -> HfPlanes:
    """Run ``model`` over ``token_ids`` (one sequence) and keep every hidden state."""
    pre: list[torch.Tensor] = []
    norm = final_norm(model)
    hook = norm.register_forward_pre_hook(lambda _m, args: pre.append(args[0].detach())) if norm else None
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            out = model(
                torch.tensor([list(token_ids)], dtype=torch.long, device=device),
                output_hidden_states=True,
                use_cache=False,
            )
    finally:
        if hook is not None:
            hook.remove()
    hs = tuple(h[0].detach() for h in out.hidden_states)
    num_layers = int(model.config.num_hidden_layers)
    if len(hs) != num_layers + 1:
        raise HfReferenceError(
            f"the model returned {len(hs)} hidden states, expected num_hidden_layers + 1 = {num_layers + 1}"
        )
    return HfPlanes(hidden_states=hs, pre_norm=pre[-1][0] if pre else None)


def convention_plane(planes: HfPlanes, layer_id: int) -> torch.Tensor:
    """The tensor layer id ``layer_id`` must equal under the capture convention (module docstring)."""
    n = planes.num_layers
    if not 0 <= layer_id <= n:
        raise HfReferenceError(f"layer id {layer_id} outside [0, {n}] (num_hidden_layers = {n})")
    if layer_id == n:
        if planes.pre_norm is None:
            raise HfReferenceError("the model has no final norm to hook: the last layer's pre-norm output is unknown")
        return planes.pre_norm
    return planes.hidden_states[layer_id]


def reference(model_dir: str, token_ids: Sequence[int], layer_ids: Sequence[int], device: str = "cpu") -> torch.Tensor:
    """``[T, P, C]`` for these tokens, plane ``i`` = layer id ``layer_ids[i]``, in the model's dtype, computed (and
    returned) on ``device``."""
    planes = hf_planes(load_hf(model_dir, device=device), token_ids)
    return torch.stack([convention_plane(planes, k) for k in layer_ids], dim=1)


@dataclass(frozen=True)
class PlaneError:
    """One plane of a record against its reference: the worst row's relative L2 error and the largest absolute
    difference of any element."""

    max_rel: float
    max_abs: float

    @property
    def ok(self) -> bool:
        return self.max_rel <= ROW_TOL


def plane_error(rec: torch.Tensor, ref: torch.Tensor) -> PlaneError:
    """``rec`` and ``ref`` are ``[T, C]`` of one plane (same T).  A ``rec`` holding NaN or Inf is infinitely far
    (``inf``, ``inf``): it never passes a tolerance."""
    if rec.shape != ref.shape:
        raise HfReferenceError(f"plane shapes differ: record {tuple(rec.shape)}, reference {tuple(ref.shape)}")
    if rec.numel() == 0:
        return PlaneError(0.0, 0.0)
    a, b = rec.float().cpu(), ref.float().cpu()
    if not bool(torch.isfinite(a).all()):  # NaN compares false with everything: never let it pass as a small error
        return PlaneError(math.inf, math.inf)
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return PlaneError(float(rel.max()), float((a - b).abs().max()))


def record_errors(rows: torch.Tensor, ref: torch.Tensor) -> list[PlaneError]:
    """Per plane errors of a record ``[T, P, C]`` against its reference ``[T, P, C]``."""
    if rows.shape != ref.shape:
        raise HfReferenceError(f"record is {tuple(rows.shape)}, its reference {tuple(ref.shape)}")
    return [plane_error(rows[:, p], ref[:, p]) for p in range(rows.shape[1])]
