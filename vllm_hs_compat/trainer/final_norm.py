"""The verifier's final norm, read from its model folder: what turns the base plane (the last decoder layer's output
*before* the final norm, as vLLM captures it) into the hidden state the LM head reads (*after* it).

Only what the folder states is used: ``config.json`` (``model_type``, ``rms_norm_eps``; a ``text_config`` for
multimodal checkpoints) and the final norm's weight from the safetensors (``model.norm.weight`` or a known
multimodal prefix).  A norm type this module does not know (e.g. Gemma's ``1 + weight`` RMSNorm) is refused by
name, never guessed: :class:`FinalNormError` says what was found and how to proceed.

The arithmetic is transformers' ``LlamaRMSNorm``: ``x`` in float32, ``x * rsqrt(mean(x^2) + eps)``, cast back to
the input dtype, times the weight (in the input dtype).  On fp32 inputs it is the verifier's own fp32 post-norm
hidden state; on bf16 inputs the same rounding as the bf16 model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from vllm_hs_compat.errors import FinalNormError

#: ``model_type`` -> final-norm kind, for the architectures whose final norm is plain RMSNorm (``weight * x_hat``).
RMSNORM_MODEL_TYPES: Final = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "deepseek_v3",
        "kimi_k2",
        "glm4_moe",
    }
)
#: Keys of the final norm's weight, tried in order.
WEIGHT_KEYS: Final = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.text_model.norm.weight",
)
NORM_KINDS: Final = ("rmsnorm",)


@dataclass(frozen=True)
class FinalNorm:
    """The verifier's final norm: ``kind`` (``"rmsnorm"``), ``weight`` ``[C]``, ``eps``, and where it came from."""

    weight: torch.Tensor
    eps: float
    kind: str = "rmsnorm"
    source: str = ""
    model_type: str = ""

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise FinalNormError(f"final norm kind must be one of {NORM_KINDS}, found {self.kind!r}")
        if self.weight.dim() != 1:
            raise FinalNormError(f"the final norm weight must be [hidden], found shape {tuple(self.weight.shape)}")
        if not self.eps > 0:
            raise FinalNormError(f"the final norm eps must be > 0, found {self.eps!r}")

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[0])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The post-norm hidden state of ``x`` (``[..., C]``, any float dtype), in ``x``'s dtype."""
        if x.shape[-1] != self.hidden_size:
            raise FinalNormError(
                f"hidden size {x.shape[-1]} differs from the final norm's {self.hidden_size} ({self.source}): "
                "the records are of another verifier"
            )
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * normed.to(x.dtype)

    def post_norm_residual(self, y: torch.Tensor) -> float:
        """How far ``y`` (``[..., C]``) is from being an output of this norm: the largest ``|rms(y / weight) - 1|``
        over the rows (0 for a post-norm plane up to rounding; a pre-norm residual stream is far from 1).  Rows
        with a zero weight entry are compared on the non-zero entries."""
        w = self.weight.float()
        keep = w != 0
        if not bool(keep.any()):
            raise FinalNormError(f"the final norm weight is all zeros ({self.source})")
        z = y.float()[..., keep] / w[keep]
        rms = z.pow(2).mean(-1).sqrt()
        return float((rms - 1).abs().max()) if rms.numel() else 0.0

    def describe(self) -> dict[str, Any]:
        """JSON-safe provenance (no tensor)."""
        return {
            "kind": self.kind,
            "eps": self.eps,
            "hidden_size": self.hidden_size,
            "model_type": self.model_type,
            "source": self.source,
        }


#: ``post_norm_residual`` below this: the plane is post-norm (rounding of bf16 is ~4e-3).
POST_NORM_TOL: Final = 2e-2


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    for key in ("text_config", "llm_config", "language_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict) and "hidden_size" in sub:
            return sub
    return cfg


def read_model_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The (text) config of ``model_dir`` as a dict; :class:`FinalNormError` when it cannot be read."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FinalNormError(
            f"cannot read the verifier's config at {path} ({type(exc).__name__}: {exc}); pass the verifier's "
            "local model folder (the one vLLM served)"
        ) from None
    if not isinstance(cfg, dict):
        raise FinalNormError(f"{path} is not a JSON object")
    return _text_config(cfg)


def num_hidden_layers(model_dir: str | os.PathLike[str]) -> int:
    """``num_hidden_layers`` of the verifier in ``model_dir``."""
    cfg = read_model_config(model_dir)
    n = cfg.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise FinalNormError(f"{model_dir}/config.json has no usable num_hidden_layers (found {n!r})")
    return n


def _find_weight(model_dir: Path) -> tuple[torch.Tensor, str]:
    from safetensors import safe_open

    index = sorted(model_dir.glob("*.safetensors.index.json"))
    candidates: list[Path] = []
    if index:
        try:
            weight_map = json.loads(index[0].read_text()).get("weight_map", {})
        except (OSError, json.JSONDecodeError) as exc:
            raise FinalNormError(f"cannot read {index[0]} ({exc})") from None
        for key in WEIGHT_KEYS:
            if key in weight_map:
                candidates = [model_dir / str(weight_map[key])]
                break
    else:
        candidates = sorted(model_dir.glob("*.safetensors"))
    for path in candidates:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            for key in WEIGHT_KEYS:
                if key in names:
                    return f.get_tensor(key), f"{path.name}:{key}"
    raise FinalNormError(
        f"no final norm weight ({' / '.join(WEIGHT_KEYS)}) in the safetensors of {model_dir}; the base plane's "
        "post-norm value cannot be computed without it (a folder without weights, or an architecture whose final "
        "norm has another name)"
    )


def load_final_norm(model_dir: str | os.PathLike[str], *, kind: str | None = None) -> FinalNorm:
    """The final norm of the verifier saved in ``model_dir``.

    ``kind``: the norm's kind when ``model_type`` is not in :data:`RMSNORM_MODEL_TYPES` and you know it is a plain
    RMSNorm (``"rmsnorm"``); otherwise an unknown ``model_type`` raises :class:`FinalNormError`."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FinalNormError(
            f"no verifier model folder at {d}: the base plane's post-norm value needs the verifier's final norm "
            "weight and eps (pass the local folder vLLM served, e.g. a Hugging Face snapshot directory)"
        )
    cfg = read_model_config(d)
    model_type = str(cfg.get("model_type", ""))
    if kind is None:
        if cfg.get("use_gemma_norm") or model_type.startswith("gemma"):
            raise FinalNormError(
                f"the verifier's final norm (model_type {model_type!r}) is a Gemma-style RMSNorm (1 + weight), which "
                "this package does not compute; use a format that takes the pre-norm base plane "
                "(speculators, modelopt)"
            )
        if model_type not in RMSNORM_MODEL_TYPES:
            raise FinalNormError(
                f"the final norm type of model_type {model_type!r} is not known to vllm-hs-compat (known RMSNorm "
                f"models: {sorted(RMSNORM_MODEL_TYPES)}); if it is a plain RMSNorm (weight * x / rms(x)), pass "
                "final_norm_kind='rmsnorm' (--final-norm rmsnorm)"
            )
        kind = "rmsnorm"
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise FinalNormError(f"{d}/config.json has no usable rms_norm_eps (found {eps!r})")
    weight, where = _find_weight(d)
    return FinalNorm(
        weight=weight.detach().clone(), eps=float(eps), kind=kind, source=f"{d}/{where}", model_type=model_type
    )
