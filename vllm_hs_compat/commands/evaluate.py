"""``vllm-hs-compat evaluate``: a drafter's mean acceptance length against its verifier.

Greedy verification simulated over the verifier's transformers forward (the same weights vLLM serves): the drafter
proposes ``--k`` tokens from the verifier's planes at its auxiliary layer ids, the verifier's greedy tokens accept
a prefix, and each verification step yields ``accepted + 1`` tokens; the figure is the mean over every step
(:mod:`vllm_hs_compat.drafter.acceptance`; docs/cli.md says why a simulation and not vLLM's own EAGLE-3 path).  The
prompts are the rows of ``--data`` templated up to their last assistant turn (the generation prompt included),
through the same code as ``vllm-hs-compat capture --on-policy``.  Needs transformers; no vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_hs_compat.errors import DrafterError, HsCompatError, ToolError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "evaluate",
        help="a drafter's mean acceptance length against its verifier (greedy verification, transformers forward)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", required=True, help="the verifier: a local model folder")
    p.add_argument("--drafter", required=True, help="a saved drafter folder (the demo writes <out>/drafter)")
    p.add_argument(
        "--data", default=None, help="rows to take prompts from (as capture's --data; default: the shipped set)"
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file instead of the tokenizer's")
    p.add_argument("--k", type=int, default=3, help="tokens drafted per verification step (default 3)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--limit", type=int, default=8, help="prompts evaluated (default 8; 0: all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def prompts_of(
    data: str | None, tokenizer: Any, *, chat_template: str | None = None, limit: int | None = None
) -> tuple[list[list[int]], int]:
    """The prompts of ``data`` (default: the shipped conversation set): each row templated up to its last
    assistant turn with the generation prompt, as ``capture --on-policy`` does; returns them and the number of
    rows that gave none (counted, never silently dropped)."""
    from vllm_hs_compat.capture.data import CONVERSATIONS
    from vllm_hs_compat.capture.samples import RowError, read_samples

    prompts: list[list[int]] = []
    failed = 0
    for item in read_samples(
        str(data or CONVERSATIONS), tokenizer, chat_template=chat_template, loss_mask="none", on_policy=True
    ):
        if isinstance(item, RowError):
            failed += 1
            continue
        prompts.append(list(item.input_ids))
        if limit and len(prompts) >= limit:
            break
    return prompts, failed


def check_fit(cfg: dict[str, Any], hf_config: Any, where: str) -> list[int]:
    """The drafter's auxiliary layer ids, once its geometry fits the verifier's config."""
    hidden, vocab = int(hf_config.hidden_size), int(hf_config.vocab_size)
    if int(cfg.get("hidden", -1)) != hidden or int(cfg.get("vocab", -1)) != vocab:
        raise DrafterError(
            f"the drafter in {where} was made for hidden size {cfg.get('hidden')} and vocabulary {cfg.get('vocab')}; "
            f"the verifier has {hidden} and {vocab}: evaluate it against the model it was trained on"
        )
    aux = cfg.get("aux_layer_ids")
    if not isinstance(aux, list) or len(aux) != int(cfg["num_aux"]):
        raise DrafterError(
            f"the drafter in {where} names no auxiliary layer ids matching its {cfg.get('num_aux')} planes "
            f"(found {aux!r}); its drafter.json needs aux_layer_ids"
        )
    return [int(k) for k in aux]


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ToolError('evaluate needs transformers: pip install "vllm-hs-compat[capture]"') from None
    from vllm_hs_compat.drafter.acceptance import DrafterProposer, Verifier, measure
    from vllm_hs_compat.drafter.head import load_drafter
    from vllm_hs_compat.reference.forward import load_hf

    for flag in ("k", "new_tokens"):
        if getattr(args, flag) < 1:
            raise ToolError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if args.limit < 0:
        raise ToolError(f"--limit {args.limit}: expected 0 (all) or more")
    head, cfg = load_drafter(args.drafter)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot load the tokenizer of --model {args.model!r}: {exc}") from None
    # float32: the bf16 weights exactly, and a forward whose greedy tokens do not flip with the sequence length
    model = load_hf(args.model, torch.float32)
    aux_ids = check_fit(cfg, model.config, args.drafter)
    prompts, failed = prompts_of(args.data, tokenizer, chat_template=args.chat_template, limit=args.limit or None)
    max_len = int(getattr(model.config, "max_position_embeddings", 0)) or None
    result = measure(
        Verifier(model, aux_ids), DrafterProposer(head), prompts, k=args.k, new_tokens=args.new_tokens, max_len=max_len
    )
    return {**result.to_dict(), "rows_failed": failed, "aux_layer_ids": aux_ids, "drafter": str(args.drafter)}


def run(args: argparse.Namespace) -> int:
    try:
        out = evaluate(args)
    except HsCompatError as exc:
        print(f"vllm-hs-compat evaluate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    k = out["k"]
    print(
        f"mean acceptance length {out['mean_length']:.3f} (k={k}: 1.0 = no draft accepted, {k + 1}.0 = every "
        f"draft accepted) over {out['steps']} verification steps, {out['prompts']} prompts, {out['generated']} tokens"
    )
    print("draft accepted at position: " + ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(out["per_position"])))
    print(f"method: {out['method']}")
    if out["rows_failed"]:
        print(f"rows without a prompt (skipped, counted): {out['rows_failed']}")
    return 0
