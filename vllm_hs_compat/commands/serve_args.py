"""``vllm-hs-compat serve-args --model PATH_OR_ID --layers 2,16,29,32``: the ``vllm serve`` flags that capture
those layers on the INSTALLED vLLM release, what the hidden-state cache costs beside the KV cache, and what this
release cannot do with this model.

The flags are the same on every supported release; what differs (which layer ids are capturable, what happens to
the hybrid KV-cache manager with a connector, which model runner drives the capture) is asked of the release's
adapter, never decided here from the version number.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hs_compat import envs
from vllm_hs_compat.errors import HsCompatError, ModelConfigError, ToolError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "float8_e4m3fn": 1}
#: ``layer_types`` entries that hold a KV cache per token (others -- mamba, linear attention -- hold a state).
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def register(sub: Any) -> None:
    p = sub.add_parser("serve-args", help="the vllm serve flags for a capture on the installed vLLM, and its cost")
    p.add_argument("--model", required=True, help="model folder or hub id (its config.json is read)")
    add_capture_arguments(p)
    p.add_argument("--tokens", type=int, default=1 << 20, help="N for the 'N tokens' cost line (default 1Mi)")
    p.add_argument("--kv-budget-gib", type=float, default=None, help="KV-cache memory, to show tokens that fit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def add_capture_arguments(p: Any) -> None:
    """The capture's options, shared with ``vllm-hs-compat serve``."""
    p.add_argument("--layers", required=True, help="comma-separated layer ids, e.g. 2,16,29,32")
    p.add_argument("--sink", choices=("export", "file", "callback"), default="export")
    p.add_argument(
        "--backend",
        choices=("auto", "nixl", "shm"),
        default="auto",
        help="export sink: the transport (auto: NIXL if installed)",
    )
    p.add_argument(
        "--export-host", default=None, help="export sink: bind address (0.0.0.0 for trainers on other hosts)"
    )
    p.add_argument("--export-port", type=int, default=None, help="export sink: fixed port (offset by the DP rank)")
    p.add_argument(
        "--advertise-host", default=None, help="export sink: the address trainers dial (with a wildcard bind)"
    )
    p.add_argument(
        "--file-path",
        default="hidden-states",
        help="file sink: the records' folder (a relative one is taken from where this command runs)",
    )
    p.add_argument("--callback", default=None, help="callback sink: module:function")
    p.add_argument(
        "--format",
        default=None,
        choices=("native", "speculators", "specforge-eagle3", "specforge-dflash", "modelopt"),
        help="the drafter trainer's format: the file sink writes it; every sink prints the layer ids its drafter "
        "config needs (SpecForge/ModelOpt number layer outputs: vLLM id - 1)",
    )
    p.add_argument("--capture", choices=("prompt", "all", "output"), default="prompt")
    p.add_argument("--dtype", default=None, help="the serving dtype (default: the model config's)")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size in tokens, for the cost lines (default: the installed release's, 16; 64 from vLLM 0.34)",
    )
    p.add_argument(
        "--hybrid-kv-cache-manager",
        choices=("auto", "on", "off"),
        default="auto",
        help="on: you intend --no-disable-hybrid-kv-cache-manager; off: --disable-hybrid-kv-cache-manager",
    )
    p.add_argument(
        "--extra-config",
        default=None,
        metavar="JSON",
        help='more kv_connector_extra_config, merged over the flags (e.g. \'{"export": {"num_slots": 256}}\')',
    )


# --- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the cost and the checks need from a model's config."""

    num_layers: int
    hidden_size: int
    dtype: str
    kv_bytes_per_token: int  # every attention layer, K and V, at the serving dtype
    attention_layers: int
    sliding_layers: int
    state_layers: int  # mamba / linear-attention layers (a state, no per-token KV)
    mla: bool
    hybrid: bool
    model_type: str = ""


def load_config(model: str) -> dict[str, Any]:
    """The model's config as a dict: ``config.json`` of a folder, else transformers' ``AutoConfig`` (hub id in
    the local cache)."""
    path = Path(model) / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path} is not a JSON object")
        return data
    try:
        from transformers import AutoConfig

        return dict(AutoConfig.from_pretrained(model).to_dict())
    except Exception as exc:  # transformers raises OSError/ValueError for unknown ids; the hub may be unreachable
        raise ModelConfigError(
            f"{model!r} is not a folder with a config.json and transformers cannot load its config ({exc}); "
            "pass a local model folder"
        ) from exc


def model_facts(config: Mapping[str, Any], dtype: str | None = None) -> ModelFacts:
    """Layers, hidden size, dtype and KV bytes per token of a (text) model config."""
    cfg = dict(config.get("text_config") or config)

    def need(key: str) -> int:
        v = cfg.get(key)
        if not isinstance(v, int) or v <= 0:
            raise ModelConfigError(f"the model config has no positive integer {key!r} (found {v!r})")
        return v

    num_layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    dt = str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    dt = dt.removeprefix("torch.")
    if dt not in DTYPE_BYTES:
        raise ModelConfigError(f"unknown dtype {dt!r}; pass --dtype (one of {sorted(DTYPE_BYTES)})")
    nbytes = DTYPE_BYTES[dt]
    types = list(cfg.get("layer_types") or ["full_attention"] * num_layers)
    if len(types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    attention = [t for t in types if t in ATTENTION_TYPES]
    sliding = sum(1 for t in types if t == "sliding_attention")
    if cfg.get("kv_lora_rank"):  # MLA: one latent of kv_lora_rank + the rope part per token and layer
        per_layer = (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * nbytes
        mla = True
    else:
        heads = need("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        per_layer = 2 * kv_heads * head_dim * nbytes
        mla = False
    return ModelFacts(
        num_layers=num_layers,
        hidden_size=hidden,
        dtype=dt,
        kv_bytes_per_token=per_layer * len(attention),
        attention_layers=len(attention),
        sliding_layers=sliding,
        state_layers=num_layers - len(attention),
        mla=mla,
        hybrid=len(set(types)) > 1,
        model_type=str(cfg.get("model_type", "")),
    )


# --- the plan ------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    vllm: str
    adapter: str
    model: str
    layer_ids: list[int]
    speculative_config: dict[str, Any]
    kv_transfer_config: dict[str, Any]
    extra_flags: list[str]
    env: dict[str, str]  # suggested environment (shell text, not quoted)
    facts: ModelFacts
    cost: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    trainer: dict[str, Any] | None = None
    """With ``--format``: the layer ids the trainer's drafter config needs (its numbering) and where they go."""
    release_defaults: dict[str, Any] = field(default_factory=dict)
    """What the installed release does where the flags say nothing (:func:`release_defaults`)."""
    device_memory: dict[str, Any] = field(default_factory=dict)
    """The connector's own device memory (:func:`connector_device_memory`)."""

    @property
    def argv(self) -> list[str]:
        """``vllm serve`` argv (after ``vllm``)."""
        return [
            "serve",
            self.model,
            "--speculative-config",
            json.dumps(self.speculative_config, separators=(",", ":")),
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config, separators=(",", ":")),
            *self.extra_flags,
        ]

    def command(self) -> str:
        """The ``vllm serve`` command line, shell-quoted."""
        return "vllm " + " ".join(shlex.quote(a) for a in self.argv)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["argv"] = self.argv
        d["command"] = self.command()
        d["ok"] = not self.errors
        return d


def cost(facts: ModelFacts, num_planes: int, block_size: int, tokens: int, budget_gib: float | None) -> dict[str, Any]:
    """The hidden-state cache beside the KV cache: ``P x C x dtype bytes`` per token."""
    nbytes = DTYPE_BYTES[facts.dtype]
    hs = num_planes * facts.hidden_size * nbytes
    kv = facts.kv_bytes_per_token
    out: dict[str, Any] = {
        "hs_bytes_per_token": hs,
        "hs_bytes_per_block": hs * block_size,
        "block_size": block_size,
        "tokens": tokens,
        "hs_bytes_for_tokens": hs * tokens,
        "kv_bytes_per_token": kv,
        "kv_bytes_per_block": kv * block_size,
        "hs_over_kv": (hs / kv) if kv else None,
        # At a fixed KV-cache memory, every cached token now costs kv + hs: this share of the tokens is lost.
        "token_capacity_loss": (hs / (kv + hs)) if kv + hs else None,
    }
    if budget_gib is not None:
        budget = int(budget_gib * (1 << 30))
        out["budget_bytes"] = budget
        out["tokens_without_capture"] = budget // kv if kv else None
        out["tokens_with_capture"] = budget // (kv + hs)
    return out


# --- the release's serving defaults and the connector's own device memory --------------------------------------------
def release_defaults(adapter: Any) -> dict[str, Any]:
    """What the installed release does where the command line says nothing, asked of its adapter: the KV block size
    (16; 64 from 0.34), whether the extensible KV cache is on by default on CUDA/ROCm (0.34+: committed after
    warm-up, ``gpu_memory_utilization`` then defaults to 1.0) and the margin it keeps."""
    margin = adapter.kv_cache_margin
    return {
        "block_size": adapter.default_block_size,
        "extensible_kv_cache": adapter.extensible_kv_cache,
        "gpu_memory_utilization": 1.0 if adapter.extensible_kv_cache else None,  # None: vLLM's pre-warm-up sizing
        "kv_cache_margin": asdict(margin) if margin is not None else None,
        "model_runners": list(adapter.model_runners),
    }


def connector_device_memory(facts: ModelFacts, num_planes: int, tokens: int) -> dict[str, Any]:
    """The device memory the worker half allocates beside vLLM's, after vLLM sized the KV cache, when ``tokens``
    tokens of records are read in one step (``core/transfer.py``'s staged path): one staging buffer of at most
    ``STAGE_BYTES`` (a bigger step is gathered chunk by chunk into the same memory, in stream order), the step's
    slot index (8 B per token) and each chunk's row index (8 B per token and plane on per-plane layouts, with an
    intermediate of the same size).  The direct path (Triton into pinned host memory) has no staging buffer."""
    from vllm_hs_compat.core.transfer import STAGE_BYTES

    token_bytes = num_planes * facts.hidden_size * DTYPE_BYTES[facts.dtype]
    chunk_tokens = min(tokens, max(1, STAGE_BYTES // token_bytes))
    staging = min(STAGE_BYTES, tokens * token_bytes)
    index = 8 * tokens + 2 * 8 * num_planes * chunk_tokens
    return {
        "tokens_read_in_one_step": tokens,
        "stage_limit_bytes": STAGE_BYTES,
        "staging_bytes": staging,
        "index_bytes": index,
        "peak_bytes": staging + index,
    }


def memory_warning(vllm_version: str, defaults: Mapping[str, Any], memory: Mapping[str, Any]) -> str | None:
    """Where the release commits the KV cache after warm-up (the extensible KV cache), the connector's device
    memory is stated against the margin vLLM keeps, with the flag that reserves it; None elsewhere (the KV cache is
    sized from ``gpu_memory_utilization`` before warm-up, which leaves the rest of the GPU to everything else)."""
    margin = defaults.get("kv_cache_margin")
    if not defaults.get("extensible_kv_cache") or not margin:
        return None
    peak = int(memory["peak_bytes"])
    floor = int(margin["floor_bytes"])
    example = 80 << 30
    return (
        f"vLLM {vllm_version} commits the KV cache after warm-up from the memory it measured free (the extensible "
        f"KV cache, on by default on CUDA and ROCm) and keeps only a margin: {margin['fraction']:g} x the measured "
        f"transient peak, at least {_gib(floor)} on CUDA, of which {_gib(int(margin['non_torch_bytes']))} is held "
        "back from torch; --gpu-memory-utilization defaults to 1.0. The connector's device buffers, allocated "
        f"after that, come out of the margin: up to {_gib(peak)} ({_gib(int(memory['staging_bytes']))} staging + "
        f"{_gib(int(memory['index_bytes']))} index for {int(memory['tokens_read_in_one_step']):,} tokens read in "
        f"one step), {100 * peak / (floor - int(margin['non_torch_bytes'])):.0f}% of what the margin's floor leaves "
        f"torch. To reserve it, pass --gpu-memory-utilization 1 - {_gib(peak)} / GPU memory (e.g. "
        f"{int((1 - peak / example) * 1000) / 1000:g} on an 80 GiB GPU)."
    )


def extra_config(args: argparse.Namespace) -> dict[str, Any]:
    """``kv_connector_extra_config`` from the flags, with ``--extra-config`` merged over it (one level deep: its
    ``export`` map is merged into the flags' one)."""
    extra = _flags_extra_config(args)
    raw = getattr(args, "extra_config", None)
    if raw:
        try:
            more = json.loads(raw)
        except ValueError as exc:
            raise ToolError(f"--extra-config is not JSON ({exc}): {raw!r}") from None
        if not isinstance(more, dict):
            raise ToolError(f"--extra-config must be a JSON object, found {type(more).__name__}")
        for key, value in more.items():
            if isinstance(value, dict) and isinstance(extra.get(key), dict):
                extra[key] = {**extra[key], **value}
            else:
                extra[key] = value
    return extra


def _flags_extra_config(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"capture": args.capture, "sink": args.sink}
    if args.sink == "export":
        export: dict[str, Any] = {"backend": getattr(args, "backend", "auto")}
        for key, value in (
            ("host", getattr(args, "export_host", None)),
            ("port", getattr(args, "export_port", None)),
            ("advertise_host", getattr(args, "advertise_host", None)),
        ):
            if value is not None:
                export[key] = value
        extra["export"] = export
    elif args.sink == "file":
        extra["file"] = {"path": os.path.abspath(args.file_path)}
        fmt = getattr(args, "format", None)
        if fmt not in (None, "native"):
            extra["file"]["format"] = fmt
            model = getattr(args, "model", "")
            if model and os.path.isdir(model):
                extra["file"]["verifier"] = os.path.abspath(model)
    else:
        if not args.callback or ":" not in args.callback:
            raise ToolError("--sink callback needs --callback module:function")
        extra["callback"] = args.callback
    return extra


def plan(args: argparse.Namespace, adapter: Any, vllm_version: str, config: Mapping[str, Any]) -> Plan:
    """Everything the command prints, for the release ``adapter`` answers for."""
    from vllm_hs_compat.commands.verify import parse_layers
    from vllm_hs_compat.demo.engine import kv_transfer_config, speculative_config

    facts = model_facts(config, args.dtype)
    layers = parse_layers(args.layers)
    warnings: list[str] = []
    errors: list[str] = []
    lo, hi = adapter.layer_id_bounds(facts.num_layers)
    outside = [k for k in layers if not lo <= k <= hi]
    if outside:
        errors.append(
            f"layer ids {outside} are outside [{lo}, {hi}], what vLLM {vllm_version} captures for a "
            f"{facts.num_layers}-layer model (id {facts.num_layers}: the last layer's output before the final norm)"
        )
    if layers != sorted(layers):
        warnings.append(f"planes are stored in ascending layer-id order: {sorted(layers)}, not {layers}")
    if facts.num_layers not in layers:
        warnings.append(
            f"no base plane: EAGLE-3 trainers take the last layer's output (layer id {facts.num_layers}) as the "
            "base hidden state; add it to --layers"
        )
    extra_flags: list[str] = []
    if facts.hybrid:
        hma = adapter.hma_with_connector
        if hma == "forced-off":
            warnings.append(
                f"hybrid verifier ({facts.sliding_layers} sliding / {facts.state_layers} state layers): vLLM "
                f"{vllm_version} turns the hybrid KV-cache manager off whenever a KV connector is set, so every "
                "attention layer keeps full-length KV (no sliding-window savings); vLLM >= 0.22 keeps it on"
            )
            if args.hybrid_kv_cache_manager == "on" and adapter.proposer_uses_group0_slots:
                errors.append(
                    f"--no-disable-hybrid-kv-cache-manager is refused on vLLM {vllm_version}: the capture layer would "
                    "get a KV-cache group of its own, and this release writes hidden states with group 0's slots "
                    "(the rows would belong to other tokens); drop the flag or upgrade to vLLM >= 0.22"
                )
        else:
            warnings.append(
                f"hybrid verifier: the capture layer gets a KV-cache group of its own with the hybrid KV-cache "
                f"manager on ({hma}); its block size is derived from the page size, not --block-size, and its page "
                "is padded to the group's"
            )
        if args.hybrid_kv_cache_manager == "off":
            extra_flags.append("--disable-hybrid-kv-cache-manager")
        elif args.hybrid_kv_cache_manager == "on":
            extra_flags.append("--no-disable-hybrid-kv-cache-manager")
    if args.capture != "prompt" and adapter.generated_rows_need_sync_scheduling():
        extra_flags.append("--no-async-scheduling")
        warnings.append(
            f"--capture {args.capture}: async scheduling off (--no-async-scheduling). On vLLM {vllm_version} Model "
            "Runner V1 under async scheduling computes the positions after a step that emitted two tokens one "
            "place short (vllm-project/vllm#56417); the connector would fail those records (reason async_drafts)"
        )
    if facts.state_layers and not facts.hybrid:
        warnings.append(f"{facts.state_layers} layers hold no per-token KV (state layers)")
    trainer: dict[str, Any] | None = None
    fmt = getattr(args, "format", None)
    if fmt is not None:
        from vllm_hs_compat.trainer.specs import trainer_layer_ids

        try:
            lm = trainer_layer_ids(fmt, sorted(layers), facts.num_layers)
        except HsCompatError as exc:
            errors.append(str(exc))
        else:
            trainer = {"format": fmt, **lm.to_dict(), "line": lm.line()}
            if fmt == "specforge-eagle3" and args.sink == "file" and not os.path.isdir(args.model):
                errors.append(
                    "--format specforge-eagle3 writes the base plane after the verifier's final norm, read from the "
                    "model folder: pass --model as a local folder"
                )
    spec = speculative_config(layers)
    kv = kv_transfer_config(extra_config(args))
    try:  # what the plugin's check would refuse at start-up, said here first
        from vllm_hs_compat.connector.config import check_kv_transfer_config

        check_kv_transfer_config(kv)
    except HsCompatError as exc:
        errors.append(str(exc))
    env: dict[str, str] = {}
    if args.sink == "export":
        env[envs.EXPORT_TOKEN] = "$(openssl rand -hex 32)"
    defaults = release_defaults(adapter)
    memory = connector_device_memory(facts, len(layers), args.tokens)
    advice = memory_warning(vllm_version, defaults, memory)
    if advice is not None:
        warnings.append(advice)
    if adapter.untested:
        warnings.append(
            f"vLLM {vllm_version} is newer than every release this package was tested with: the connector runs "
            "only if every probe agrees at start-up (`vllm-hs-compat doctor` shows them now), and then checks the "
            "slots of every request"
        )
    block_size = args.block_size if args.block_size is not None else int(defaults["block_size"])
    return Plan(
        vllm=vllm_version,
        adapter=adapter.describe(),
        model=args.model,
        layer_ids=sorted(layers),
        speculative_config=spec,
        kv_transfer_config=kv,
        extra_flags=extra_flags,
        env=env,
        facts=facts,
        cost=cost(facts, len(layers), block_size, args.tokens, args.kv_budget_gib),
        warnings=warnings,
        errors=errors,
        trainer=trainer,
        release_defaults=defaults,
        device_memory=memory,
    )


def _gib(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def render(p: Plan) -> str:
    f, c = p.facts, p.cost
    lines = [f"vLLM {p.vllm}: adapter {p.adapter}", ""]
    for k, v in p.env.items():
        lines.append(f"  export {k}={v}   # the trainer token; trainers read the same variable")
    lines += ["  " + p.command().replace(" --", " \\\n      --"), ""]
    if p.env:
        lines.append("  (without the variable the server writes a token to ~/.cache/vllm-hs-compat/export.token)")
        lines.append("")
    kind = "MLA" if f.mla else "attention"
    lines.append(
        f"model: {f.model_type or '?'}, {f.num_layers} layers ({f.attention_layers} {kind}), hidden {f.hidden_size}, "
        f"{f.dtype}"
    )
    n = len(p.layer_ids)
    lines.append(
        f"hidden-state cache: {n} planes x {f.hidden_size} x {DTYPE_BYTES[f.dtype]} B = {c['hs_bytes_per_token']:,} B "
        f"per token, {_gib(c['hs_bytes_per_block'])} per {c['block_size']}-token block, "
        f"{_gib(c['hs_bytes_for_tokens'])} for {c['tokens']:,} tokens"
    )
    if c["kv_bytes_per_token"]:
        lines.append(
            f"KV cache: {c['kv_bytes_per_token']:,} B per token ({_gib(c['kv_bytes_per_block'])} per block): the "
            f"capture adds {100 * c['hs_over_kv']:.1f}% per token; at a fixed KV budget "
            f"{100 * c['token_capacity_loss']:.1f}% fewer tokens fit"
        )
    if p.device_memory:
        m = p.device_memory
        lines.append(
            f"connector device memory (worker, after vLLM sized the KV cache): up to {_gib(m['peak_bytes'])} for "
            f"{m['tokens_read_in_one_step']:,} tokens read in one step ({_gib(m['staging_bytes'])} staging, at most "
            f"{_gib(m['stage_limit_bytes'])}; {_gib(m['index_bytes'])} index)"
        )
    if "budget_bytes" in c:
        lines.append(
            f"KV budget {_gib(c['budget_bytes'])}: {c['tokens_without_capture'] or 0:,} tokens without capture, "
            f"{c['tokens_with_capture']:,} with"
        )
    if p.trainer is not None:
        lines.append(f"trainer layer ids: {p.trainer['line']}")
    for w in p.warnings:
        lines.append(f"warning: {w}")
    for e in p.errors:
        lines.append(f"ERROR: {e}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from vllm_hs_compat.adapters import OVERRIDE_ENV, choose_adapter, installed_vllm_version

    try:
        version = installed_vllm_version()
        adapter = choose_adapter(version, os.environ.get(OVERRIDE_ENV) or None)
        result = plan(args, adapter, version, load_config(args.model))
    except HsCompatError as exc:
        print(f"serve-args: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render(result))
    return 1 if result.errors else 0


def main(argv: Sequence[str]) -> int:
    """Entry for tests: ``main(["--model", ..., "--layers", ...])``."""
    parser = argparse.ArgumentParser(prog="vllm-hs-compat")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return run(parser.parse_args(["serve-args", *argv]))
