"""An EAGLE-3 drafter in vLLM's own checkpoint layout, with a pure-torch forward of what vLLM computes for it.

The folder :func:`save_eagle3` writes is what ``--speculative-config '{"method": "eagle3", "model": DIR, ...}'``
loads (``LlamaForCausalLMEagle3``, vLLM's ``llama_eagle3`` model; read for 0.32.0): ``config.json`` (a one-layer
Llama config with ``eagle_config.eagle_aux_hidden_state_layer_ids``, ``target_hidden_size`` and
``draft_vocab_size``) and ``model.safetensors`` with these weights (HF names; vLLM maps ``midlayer.`` to its
``layers.0.`` and stacks q/k/v and gate/up itself)::

    fc.weight                                 [C, A*Ct]   the verifier's A auxiliary planes fused
    midlayer.input_layernorm.weight           [C]         RMSNorm of the token embedding
    midlayer.hidden_norm.weight               [C]         RMSNorm of the fused hidden state
    midlayer.self_attn.{q,k,v}_proj.weight    [H*D, 2C]   attention over concat(embedding, hidden)
    midlayer.self_attn.o_proj.weight          [C, H*D]
    midlayer.post_attention_layernorm.weight  [C]
    midlayer.mlp.{gate,up}_proj.weight        [I, C];  midlayer.mlp.down_proj.weight [C, I]
    norm.weight                               [C]
    lm_head.weight                            [V, C]      a frozen copy of the verifier's LM head

No ``embed_tokens``: vLLM then shares the verifier's embedding with the drafter (and ours is the verifier's too);
no ``d2t``/``t2d``: the draft vocabulary is the verifier's.  The ``lm_head`` copy is identical to the verifier's,
which vLLM detects and shares as well.

The forward, one decoder layer (facts of vLLM's ``llama_eagle3.py``, written here from scratch):

* the verifier's planes at the auxiliary layer ids (layer id ``k``: the residual stream after ``k`` layers; vLLM
  concatenates them in ascending layer order whatever order the config lists) go through ``fc``;
* row ``t`` (position ``t``) takes the fused hidden state of ``x_t`` and the embedding of ``x_{t+1}``:
  ``e = input_layernorm(embed(x_{t+1}))``, ``h = hidden_norm(hidden)``, residual ``= hidden`` (before its norm);
  causal attention with rotary positions over ``concat(e, h)``; ``r = attn + residual``;
  ``m = mlp(post_attention_layernorm(r))``; ``out = m + r`` (pre-norm); logits ``= lm_head(norm(out))``;
* draft ``j + 1`` is read at the last row; its row's pre-norm ``out`` stands in for the fused hidden state of the
  row after it (position + 1, the drafted token's embedding), as vLLM feeds a draft's own output back.

Training (:func:`train_eagle3`): records of a capture tree in the ``eagle3`` layout, a soft next-token loss
against the verifier's own distribution (from the record's base plane through the verifier's final norm and LM
head) on the record's loss mask: :func:`vllm_hs_compat.drafter.head.make_item`'s items.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vllm_hs_compat.drafter.head import StepStats, train
from vllm_hs_compat.errors import DrafterError, HsCompatError

#: ``config.json``'s architecture: vLLM's registry maps it to its ``llama_eagle3`` model.
ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: Marks a folder this module wrote (vLLM ignores it): what it was trained on.
META_KEY = "vllm_hs_compat"


@dataclass(frozen=True)
class Eagle3Geometry:
    """The drafter's shape, as ``config.json`` states it to vLLM."""

    hidden: int
    target_hidden: int
    aux_layer_ids: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope_theta: float
    max_positions: int

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)


def _rope_theta(cfg: dict[str, Any], where: str) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind != "default":
        raise DrafterError(
            f"{where} uses rope type {kind!r}; this drafter implements the default rotary embedding only"
        )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else cfg.get("rope_theta", 10000.0))


def geometry_for(verifier_config: dict[str, Any], aux_layer_ids: Sequence[int]) -> Eagle3Geometry:
    """A drafter's geometry for a verifier (its ``config.json`` as a dict): the verifier's width, heads, head size,
    MLP width, vocabulary, norm epsilon and rotary embedding (the same KV page size as the verifier's layers)."""
    ids = tuple(int(k) for k in aux_layer_ids)
    n = int(verifier_config["num_hidden_layers"])
    if list(ids) != sorted(set(ids)) or not ids or ids[0] < 0 or ids[-1] > n:
        raise DrafterError(
            f"auxiliary layer ids {list(ids)}: expected distinct ids in ascending order within [0, {n}] (vLLM "
            "concatenates the planes in ascending layer order whatever order a config lists)"
        )
    hidden = int(verifier_config["hidden_size"])
    heads = int(verifier_config["num_attention_heads"])
    return Eagle3Geometry(
        hidden=hidden,
        target_hidden=hidden,
        aux_layer_ids=ids,
        heads=heads,
        kv_heads=int(verifier_config.get("num_key_value_heads") or heads),
        head_dim=int(verifier_config.get("head_dim") or hidden // heads),
        intermediate=int(verifier_config["intermediate_size"]),
        vocab=int(verifier_config["vocab_size"]),
        rms_eps=float(verifier_config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(verifier_config, "the verifier's config"),
        max_positions=int(verifier_config.get("max_position_embeddings", 4096)),
    )


class _Attention(nn.Module):
    def __init__(self, g: Eagle3Geometry) -> None:
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(2 * g.hidden, g.heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * g.hidden, g.kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * g.hidden, g.kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.heads * g.head_dim, g.hidden, bias=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # NeoX-style rotary embedding over the whole head: halves rotated, as Llama's default
        d = self.g.head_dim
        inv = 1.0 / (self.g.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = positions.float()[..., None] * inv  # [B, T, d/2]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        g = self.g
        q = self.q_proj(x).view(b, t, g.heads, g.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, g.kv_heads, g.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, g.kv_heads, g.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        rep = g.heads // g.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
        if pad is not None:
            allowed = allowed & ~pad[:, None, None, :]
        # a padded query row sees no key: let it see itself (its output is masked out of the loss)
        allowed = allowed | torch.eye(t, dtype=torch.bool)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, g.heads * g.head_dim))  # type: ignore[no-any-return]


class _Mlp(nn.Module):
    def __init__(self, g: Eagle3Geometry) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden, g.intermediate, bias=False)
        self.up_proj = nn.Linear(g.hidden, g.intermediate, bias=False)
        self.down_proj = nn.Linear(g.intermediate, g.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class _MidLayer(nn.Module):
    def __init__(self, g: Eagle3Geometry) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(g.hidden, eps=g.rms_eps)
        self.hidden_norm = nn.RMSNorm(g.hidden, eps=g.rms_eps)
        self.self_attn = _Attention(g)
        self.post_attention_layernorm = nn.RMSNorm(g.hidden, eps=g.rms_eps)
        self.mlp = _Mlp(g)


class Eagle3Drafter(nn.Module):
    """The drafter (module docstring); ``state_dict()`` keys are the checkpoint's names.  ``embed``: the
    verifier's input embedding ``[V, C]`` (a buffer, not saved); ``lm_head``: the verifier's LM head ``[V, C]``
    (frozen)."""

    def __init__(self, g: Eagle3Geometry, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        for name, w in (("embedding", embed), ("LM head", lm_head)):
            if tuple(w.shape) != (g.vocab, g.hidden):
                raise DrafterError(f"the verifier's {name} is {tuple(w.shape)}, expected {(g.vocab, g.hidden)}")
        self.g = g
        self.fc = nn.Linear(g.num_aux * g.target_hidden, g.hidden, bias=False)
        self.midlayer = _MidLayer(g)
        self.norm = nn.RMSNorm(g.hidden, eps=g.rms_eps)
        self.lm_head = nn.Linear(g.hidden, g.vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.float())
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` of the verifier's auxiliary planes ``[..., A*Ct]`` (ascending layer order) -> ``[..., C]``."""
        return self.fc(aux.float())  # type: ignore[no-any-return]

    def layer(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decoder layer's pre-norm output ``[B, T, C]`` from hidden states ``[B, T, C]`` (fused planes, or a
        draft's own output), the next tokens ``[B, T]`` and their rows' positions ``[B, T]``."""
        m = self.midlayer
        e = m.input_layernorm(F.embedding(next_ids, self.get_buffer("embed")))
        residual = hidden
        x = torch.cat([e, m.hidden_norm(hidden)], dim=-1)
        r = m.self_attn(x, positions, pad) + residual
        out: torch.Tensor = m.mlp(m.post_attention_layernorm(r)) + r
        return out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Token logits of pre-norm outputs: ``lm_head(norm(out))``."""
        return self.lm_head(self.norm(out))  # type: ignore[no-any-return]

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward: ``aux`` ``[B, T, A*Ct]`` at positions ``0..T-1``, ``next_ids`` ``[B, T]`` -> logits
        ``[B, T, V]`` (row ``t`` predicts the token after ``next_ids[t]``)."""
        b, t = next_ids.shape
        positions = torch.arange(t)[None].expand(b, t)
        return self.logits(self.layer(self.fuse(aux), next_ids, positions, pad))

    def draft(self, aux: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[int]:
        """``k`` greedy drafts, as vLLM proposes them: ``aux`` ``[n+1, A*Ct]`` (the verifier's planes at positions
        ``0..n``), ``next_ids`` ``[n+1]`` (tokens ``1..n+1``; the last is the verifier's own next token)."""
        if aux.dim() != 2 or aux.shape[0] != next_ids.shape[0] or aux.shape[0] < 1:
            raise DrafterError(
                f"draft needs one plane row per next token: found planes {tuple(aux.shape)}, "
                f"tokens {tuple(next_ids.shape)}"
            )
        out: list[int] = []
        with torch.no_grad():
            hidden = self.fuse(aux)[None]
            ids = next_ids.long()[None]
            for _ in range(k):
                positions = torch.arange(ids.shape[1])[None]
                h = self.layer(hidden, ids, positions)
                tok = int(self.logits(h[0, -1]).argmax())
                out.append(tok)
                hidden = torch.cat([hidden, h[:, -1:]], dim=1)
                ids = torch.cat([ids, torch.tensor([[tok]], dtype=torch.long)], dim=1)
        return out


class Eagle3Proposer:
    """:class:`Eagle3Drafter`'s drafts for :func:`vllm_hs_compat.drafter.acceptance.measure`."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter

    def propose(self, ids: Sequence[int], aux: torch.Tensor, next_id: int, k: int) -> list[int]:
        return self.drafter.draft(aux, torch.tensor([*ids[1:], next_id], dtype=torch.long), k)


# --- the checkpoint -------------------------------------------------------------------------------------------


def config_json(g: Eagle3Geometry, **meta: Any) -> dict[str, Any]:
    """``config.json`` of the drafter: what vLLM's ``llama_eagle3`` reads, plus ``meta`` under
    :data:`META_KEY` (vLLM ignores it)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": g.hidden,
        "target_hidden_size": g.target_hidden,
        "intermediate_size": g.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": g.rms_eps,
        "rope_theta": g.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": g.rope_theta},
        "max_position_embeddings": g.max_positions,
        "vocab_size": g.vocab,
        "draft_vocab_size": g.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(g.aux_layer_ids), "use_aux_hidden_state": True},
        META_KEY: meta,
    }


def is_eagle3_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a ``config.json`` naming an EAGLE-3 architecture (ours or any in vLLM's format)."""
    cfg = Path(path) / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any("Eagle3" in str(a) for a in archs)


def read_eagle3_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of an EAGLE-3 drafter folder (refused by name when missing or not JSON)."""
    cfg_path = Path(path) / CONFIG_FILE
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise DrafterError(f"cannot read {cfg_path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(cfg, dict):
        raise DrafterError(f"{cfg_path} holds {type(cfg).__name__}, expected a JSON object")
    return cfg


def save_eagle3(drafter: Eagle3Drafter, path: str | os.PathLike[str], **meta: Any) -> Path:
    """Write ``drafter`` in vLLM's layout into the folder ``path`` (bf16 weights, as the engine serves them);
    returns the folder."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().clone() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config_json(drafter.g, **meta), indent=1))
    return out


def load_eagle3(path: str | os.PathLike[str], embed: torch.Tensor) -> tuple[Eagle3Drafter, dict[str, Any]]:
    """A drafter :func:`save_eagle3` wrote (weights as saved, computed in float32), with the verifier's input
    embedding ``embed``; returns it in eval mode and its ``config.json``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    cfg_path, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_path.is_file() or not weights.is_file():
        raise DrafterError(f"{folder} is not an EAGLE-3 drafter folder: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
        state = load_file(str(weights))
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        g = Eagle3Geometry(
            hidden=int(cfg["hidden_size"]),
            target_hidden=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
            aux_layer_ids=tuple(int(k) for k in ids),
            heads=int(cfg["num_attention_heads"]),
            kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg, str(cfg_path)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
        )
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise DrafterError(f"cannot read the EAGLE-3 drafter in {folder}: {type(exc).__name__}: {exc}") from None
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual") if cfg.get(k)] + [
        k for k in ("norm_before_fc",) if (cfg.get("eagle_config") or {}).get(k)
    ]
    if (
        int(cfg.get("num_hidden_layers", 1)) != 1
        or unsupported
        or int(cfg.get("draft_vocab_size") or g.vocab) != g.vocab
    ):
        raise DrafterError(
            f"{cfg_path}: this forward implements one layer, the full vocabulary and no extra norms; found "
            f"num_hidden_layers={cfg.get('num_hidden_layers')}, draft_vocab_size={cfg.get('draft_vocab_size')}, "
            f"options {unsupported}"
        )
    lm_head = state.get("lm_head.weight")
    if lm_head is None:
        raise DrafterError(f"{weights} has no lm_head.weight (found {sorted(state)[:6]}...)")
    drafter = Eagle3Drafter(g, embed, lm_head)
    try:
        drafter.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as exc:
        raise DrafterError(f"{weights} does not fit the geometry in {cfg_path}: {exc}") from None
    return drafter.eval(), cfg


# --- training -------------------------------------------------------------------------------------------------


def train_eagle3(
    items: Sequence[Any],
    drafter: Eagle3Drafter,
    steps: int,
    *,
    batch: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    on_step: Callable[[StepStats], None] | None = None,
) -> list[StepStats]:
    """``steps`` Adam steps over random batches of :class:`vllm_hs_compat.drafter.head.TrainItem` ``items``
    (the record's next token at each position, the verifier's distribution there, its loss mask): the head's own
    loop (:func:`vllm_hs_compat.drafter.head.train`, KL against the verifier's distribution), in train mode."""
    if not items:
        raise DrafterError("no training item: the tree gave no record of 2 tokens or more")
    drafter.train()
    try:
        return train(items, drafter, steps, batch=batch, lr=lr, seed=seed, on_step=on_step)
    finally:
        drafter.eval()


def items_from_tree(tree: str, model: Any) -> tuple[list[Any], list[int], int]:
    """Training items of every record of a capture tree (``eagle3`` layout) for the verifier ``model`` (HF);
    returns them, the auxiliary layer ids (every captured id but the last, the base plane) and the records that
    failed to read (counted)."""
    from vllm_hs_compat.drafter.head import make_item
    from vllm_hs_compat.reference.forward import final_norm
    from vllm_hs_compat.trainer import HiddenStatesDataset

    norm, lm_head = final_norm(model), model.get_output_embeddings()
    ds = HiddenStatesDataset.from_capture(tree, layout="eagle3", on_error="skip")
    items: list[Any] = []
    layer_ids: list[int] | None = None
    for rec in ds:
        ids = sorted(int(k) for k in rec["layer_ids"])
        if layer_ids is None:
            layer_ids = ids
        elif ids != layer_ids:
            raise DrafterError(f"{tree}: records captured different layer ids ({layer_ids} and {ids})")
        item = make_item(
            rec["input_ids"], rec["aux_hidden_states"], rec["hidden_states"], rec["loss_mask"], norm, lm_head
        )
        if item is not None:
            items.append(item)
    if layer_ids is None or len(layer_ids) < 2:
        raise DrafterError(f"{tree}: no readable record with an auxiliary plane and a base plane")
    return items, layer_ids[:-1], int(ds.stats.get("skipped", 0))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_hs_compat.drafter.eagle3 --model M --tree T --out D``: train an EAGLE-3 drafter in vLLM's
    layout on a capture tree (``vllm-hs-compat capture`` or the demo's ``<out>/tree``) and save it."""
    import json as _json
    import time

    from vllm_hs_compat.reference.forward import load_hf

    p = argparse.ArgumentParser(prog="python -m vllm_hs_compat.drafter.eagle3", description=main.__doc__)
    p.add_argument("--model", required=True, help="the verifier the tree was captured from (a local folder)")
    p.add_argument("--tree", required=True, help="a capture tree (eagle3 layout: auxiliary planes + base plane)")
    p.add_argument("--out", required=True, help="the drafter folder to write (config.json + model.safetensors)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    # 1e-3: on the demo's 12 records, 3e-3 overfits (simulated acceptance 1.40 after 100 steps against 1.70)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        model = load_hf(args.model, torch.float32)
        items, aux_ids, skipped = items_from_tree(args.tree, model)
        g = geometry_for(model.config.to_dict(), aux_ids)
        torch.manual_seed(args.seed)
        drafter = Eagle3Drafter(g, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        hist = train_eagle3(items, drafter, args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
        save_eagle3(drafter, args.out, verifier=str(args.model), tree=str(args.tree), steps=args.steps)
    except HsCompatError as exc:  # a drafter, tree or model that cannot be used: named, exit 2
        print(f"eagle3: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    summary = {
        "out": args.out,
        "records": len(items),
        "records_failed": skipped,
        "aux_layer_ids": aux_ids,
        "loss_first": hist[0].loss if hist else None,
        "loss_last": hist[-1].loss if hist else None,
        "accuracy_last": hist[-1].accuracy if hist else None,
        "seconds": round(time.monotonic() - t0, 2),
        "geometry": asdict(g),
    }
    print(_json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
