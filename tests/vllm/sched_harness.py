"""Drive vLLM's OWN ``Scheduler`` for the installed release, with only the model step replaced.

What is vLLM's code here (the release's, found by feature detection, never by version comparison):

* configs: ``VllmConfig`` with ``SpeculativeConfig(method="extract_hidden_states")``, chunked prefill and prefix
  caching on, ``KVTransferConfig`` naming the capture connector; the KV-cache config from the release's own grouping
  (``harness.build_kv_cache_configs``, sized by ``num_gpu_blocks_override`` as the engine sizes it);
* the scheduler: ``Scheduler`` with its real ``KVCacheManager``; the scheduler-role connector is created BY it; the
  requests are ``Request.from_engine_core_request(EngineCoreRequest(...), block_hasher)`` with the engine core's
  block hasher; aborts go through ``Scheduler.finish_requests``; drafts through ``update_draft_token_ids``;
* the worker-role connector: ``ensure_kv_transfer_initialized`` (the worker's call), then the runner's registration:
  V1 ``register_kv_caches`` + ``set_host_xfer_buffer_ops``, V2 ``ActiveKVConnector`` (0.29+);
* the hook sequence: V1 ``KVConnectorModelRunnerMixin`` (``maybe_get_kv_connector_output`` around the target forward,
  the drafter's own ``_get_kv_connector_output`` where the proposer runs a connector cycle of its own (0.17),
  ``finalize_kv_connector`` after the drafter (0.18+), ``kv_connector_no_forward``); V2 the runner's
  ``vllm/v1/worker/gpu/kv_connector.py`` (``pre_forward``/``finish_forward``/``post_forward``/``finalize_step``/
  ``no_forward``);
* batch order: V1 the runner's persistent ``InputBatch`` (``remove_request``/``add_request``/``condense``/
  ``refresh_metadata``; optionally ``reorder_batch_to_split_decodes_and_prefills`` as decode-first backends do);
  V2 ``sort_batch_req_ids``;
* slots: ``harness.compute_slot_mapping`` (the release's ``BlockTable`` and slot kernel; Model Runner V2's
  ``BlockTables.compute_slot_mappings`` where V1 is gone, 0.34+);
* the runners: each model runner the release has (:func:`runner_modes`, found by feature): V1 on 0.17-0.33, V2 on
  0.29+, V2 alone (the default engine, ``VLLM_USE_V2_MODEL_RUNNER`` left unset) from 0.34, which deleted V1;
* the write: the real ``CacheOnlyAttentionLayer.forward`` inside ``set_forward_context`` -- vLLM's
  ``unified_kv_cache_update`` writes with the layer's ``do_kv_cache_update`` and ``maybe_transfer_kv_layer`` calls
  the connector's ``wait_for_layer_load``/``save_kv_layer`` -- placed where the release's runner places the drafter
  relative to the connector hooks.

What is the test's: the model.  Hidden states and sampled tokens are deterministic functions of the request's token
prefix (like a causal model), so prefix-cache hits legitimately share rows and anything else is detectable.  The
worker-side request bookkeeping mirrors the runner's (block ids appended, replaced on resume; V2 rebuilds resumed
requests from ``prefill_token_ids``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import harness as h
import torch

VOCAB = 512  # the tiny model config's vocab_size
NUM_SPEC_TOKENS = 1  # extract_hidden_states requires exactly one
# P = 3 planes (harness.NUM_PLANES); valid on every release (0.17 captures 1 .. N-1); deliberately unsorted
AUX_LAYER_IDS = [3, 1, 2]
CONNECTOR = "HiddenStatesCaptureConnector"
CONNECTOR_MODULE = "vllm_hs_compat.connector"
CALLBACK = "sched_harness:receive_record"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# --------------------------------------------------------------------------------------------------
# the model: values are a function of the token prefix
# --------------------------------------------------------------------------------------------------
_M64 = (1 << 64) - 1
_SEED = 0x243F6A8885A308D3


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def extend_hashes(hashes: list[int], tokens: list[int]) -> list[int]:
    """Prefix hashes: ``hashes[p]`` identifies ``tokens[: p + 1]``; extends ``hashes`` in place to ``len(tokens)``."""
    prev = hashes[-1] if hashes else _SEED
    for t in tokens[len(hashes) :]:
        prev = _mix64(prev ^ (((t + 1) * 0x9E3779B97F4A7C15) & _M64))
        hashes.append(prev)
    return hashes


def prefix_hashes(tokens: list[int]) -> list[int]:
    return extend_hashes([], tokens)


def hash_after(prev: int | None, token: int) -> int:
    prev = _SEED if prev is None else prev
    return _mix64(prev ^ (((token + 1) * 0x9E3779B97F4A7C15) & _M64))


_gen = torch.Generator().manual_seed(20260601)
_K1 = torch.randint(1, 1 << 15, (1, h.NUM_PLANES * h.HIDDEN), generator=_gen, dtype=torch.int32)
_K2 = torch.randint(1, 1 << 15, (1, h.NUM_PLANES * h.HIDDEN), generator=_gen, dtype=torch.int32)
_K3 = torch.randint(0, 1 << 16, (1, h.NUM_PLANES * h.HIDDEN), generator=_gen, dtype=torch.int32)


def rows_for(hashes: list[int]) -> torch.Tensor:
    """The hidden states ``[T, P, C]`` (bf16) of the positions whose prefix hashes are given: finite bf16 values
    (exponent kept in 2^-15 .. 2^16, any sign and mantissa) drawn from the hash, element by element."""
    if not hashes:
        return torch.empty(0, h.NUM_PLANES, h.HIDDEN, dtype=h.DTYPE)
    hv = torch.tensor([[x & 0x7FFF, (x >> 15) & 0x7FFF, (x >> 30) & 0xFFFF] for x in hashes], dtype=torch.int32)
    v = ((hv[:, :1] * _K1) ^ (hv[:, 1:2] * _K2) ^ (hv[:, 2:] + _K3)) & 0xFFFF
    bits = (v & 0x807F) | ((((v >> 7) & 0x1F) + 112) << 7)
    return bits.to(torch.int16).view(h.DTYPE).view(-1, h.NUM_PLANES, h.HIDDEN)


def next_token(prefix_hash: int, last_token: int) -> int:
    """The verifier's greedy token after a prefix.  Half the time it repeats the last token: the extract_hidden_states
    proposer drafts the last sampled token, so about half the drafts are accepted and half rejected."""
    if (prefix_hash >> 60) & 1:
        return last_token
    return (prefix_hash >> 8) % VOCAB


# --------------------------------------------------------------------------------------------------
# the callback sink (``"sink": "callback"``; called in the worker, maybe from a thread)
# --------------------------------------------------------------------------------------------------
#: One line per schedule test that ran (printed in the pytest terminal summary by conftest).
SUMMARY: list[str] = []

_RECEIVED: list[Any] = []
_RECEIVED_LOCK = threading.Lock()


def receive_record(record: Any) -> None:
    with _RECEIVED_LOCK:
        _RECEIVED.append(record)


def take_records() -> list[Any]:
    with _RECEIVED_LOCK:
        out = list(_RECEIVED)
        _RECEIVED.clear()
    return out


# --------------------------------------------------------------------------------------------------
# feature detection
# --------------------------------------------------------------------------------------------------
def _kw(fn: Callable[..., Any], candidates: dict[str, Any]) -> dict[str, Any]:
    params = _params(fn)
    return {k: v for k, v in candidates.items() if k in params}


@functools.cache
def _params(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _fields(cls: type, candidates: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in candidates.items() if k in names}


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@functools.cache
def has_v1_runner() -> bool:
    """Whether the release has Model Runner V1 (``vllm.v1.worker.gpu_model_runner``, with its persistent
    ``InputBatch`` and connector mixin): 0.17-0.33; 0.34 deleted it (``VLLM_USE_V2_MODEL_RUNNER=0`` then raises)."""
    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


@functools.cache
def has_v2_runner() -> bool:
    """Whether the release runs extract_hidden_states on Model Runner V2: it has the V2 runner's connector helper,
    and either V2 is its only runner (0.34+) or its V2 feature check does not list our config (0.22-0.28 list
    "speculative method 'extract_hidden_states'")."""
    if not has_v2_module():
        return False
    if not has_v1_runner():
        return True
    cfg = make_vllm_config(EngineSpec(num_blocks=32, v2=False), connector=False)
    check = getattr(cfg, "_get_v2_model_runner_unsupported_features", None)
    return check is not None and not check()


def runner_modes() -> list[str]:
    """The model runners this release drives extract_hidden_states with, as scheduler modes: ``v1`` where Model
    Runner V1 exists, ``v2`` where V2 runs it (both on 0.29-0.33, ``v2`` alone from 0.34)."""
    return [m for m, present in (("v1", has_v1_runner()), ("v2", has_v2_runner())) if present]


def _runner_env(v2: bool) -> str | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` for an engine of this mode: the switch matters only where both runners exist
    (0.29-0.33 read it); where V1 is gone (0.34+) it is left unset -- ``=0`` raises and ``=1`` only warns."""
    if not (has_v1_runner() and has_v2_module()):
        return None
    return "1" if v2 else "0"


# --------------------------------------------------------------------------------------------------
# engine
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    num_blocks: int
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 4
    # Model Runner V2's bookkeeping and hook order; the default where V1 is gone (0.34+)
    v2: bool = field(default_factory=lambda: not has_v1_runner())
    extra_config: dict[str, Any] | None = None  # None: no connector
    pad_tokens: int = 0  # CUDA-graph style padding rows written to PAD_SLOT_ID (only where pads hit the null block)
    reorder: bool = False  # V1: a decode-first attention backend reorders the persistent batch
    verifier: str = "dense"  # harness.verifier_specs kind: dense, or hybrid (full + sliding-window layers)

    def connector_config(self) -> dict[str, Any]:
        cfg = dict(self.extra_config or {})
        cfg.setdefault("sink", "callback")
        cfg.setdefault("callback", CALLBACK)
        return cfg


def make_vllm_config(spec: EngineSpec, *, connector: bool) -> Any:
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    mc = h.model_config()
    pc = ParallelConfig()
    spec_cfg = SpeculativeConfig(
        method="extract_hidden_states",
        num_speculative_tokens=NUM_SPEC_TOKENS,
        draft_model_config={"hf_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS)}},
        target_model_config=mc,
        target_parallel_config=pc,
    )
    cache = CacheConfig(
        **_kw(
            CacheConfig,
            {
                "block_size": h.BLOCK_SIZE,
                "cache_dtype": "bfloat16",
                "enable_prefix_caching": True,
                "num_gpu_blocks_override": spec.num_blocks,
            },
        )
    )
    sched = SchedulerConfig(
        **_kw(
            SchedulerConfig,
            {
                "max_model_len": mc.max_model_len,
                "is_encoder_decoder": False,
                "max_num_batched_tokens": spec.max_num_batched_tokens,
                "max_num_seqs": spec.max_num_seqs,
                "enable_chunked_prefill": True,
                "async_scheduling": False,
            },
        )
    )
    kv_transfer = None
    if connector:
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer",
            kv_connector_extra_config=spec.connector_config(),
        )
    # The config is validated for the V1 runner where the release has both: on this machine (no Triton) a V2 config
    # does not validate.  V2 runs (0.29-0.33) then select the V2 paths through the env var the release reads, as a
    # Triton host would.  Where V1 is gone (0.34+) the variable stays unset.
    with _env(V2_ENV, _runner_env(False)):
        return VllmConfig(
            model_config=mc,
            cache_config=cache,
            parallel_config=pc,
            scheduler_config=sched,
            speculative_config=spec_cfg,
            kv_transfer_config=kv_transfer,
        )


@functools.cache
def min_num_blocks(
    verifier: str = "dense",
    connector: bool = True,
    v2: bool = False,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 4,
) -> int:
    """The smallest KV budget vLLM accepts for this engine: the blocks vLLM itself sizes from the least memory its
    start-up check accepts (one request of ``max_model_len`` tokens must fit; with sliding-window layers the need
    depends on the token budget).  Found by bisecting the memory handed to ``get_kv_cache_configs``."""

    def blocks(mem: int) -> int | None:
        spec = EngineSpec(
            num_blocks=0,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            verifier=verifier,
            extra_config={} if connector else None,
        )
        cfg = make_vllm_config(spec, connector=connector)
        cfg.cache_config.num_gpu_blocks_override = None
        layer = h.make_capture_layer(cfg)
        try:
            with _env(V2_ENV, _runner_env(v2)):
                return int(h.build_kv_cache_configs(cfg, layer, verifier, available_memory=mem).scheduler.num_blocks)
        except ValueError:
            return None

    lo, hi = 1, 1 << 16
    while blocks(hi) is None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if blocks(mid) is not None else (mid, hi)
    least = blocks(hi)
    assert least is not None
    # Up to 0.2x the start-up check does not count the null block: at its minimum a max-length request can never
    # be scheduled (vLLM waits forever).  One more block is the smallest cache in which every request can run.
    return least + 1


def has_v2_module() -> bool:
    return importlib.util.find_spec("vllm.v1.worker.gpu.kv_connector") is not None


def _block_hasher(cfg: Any, hash_block_size: int) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


@dataclass
class Engine:
    spec: EngineSpec
    cfg: Any
    layer: Any
    kv: h.KvConfigs
    gid: int  # the capture group
    block_size: int  # the capture group's block size
    kernel_block_size: int
    views: dict[str, torch.Tensor]
    scheduler: Any
    block_hasher: Any
    runner: Runner
    initial_free_blocks: int
    pads_to_null_block: bool = False
    worker_connector: Any = None  # the worker-role connector (ensure_kv_transfer_initialized made it)
    finished_params: dict[str, Any] = field(default_factory=dict)  # req_id -> what request_finished returned
    expected: dict[str, tuple[list[int], list[int], torch.Tensor]] = field(default_factory=dict)
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def view(self) -> torch.Tensor:
        return self.views[h.CAPTURE_LAYER]

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def connector_counters(self) -> dict[str, int]:
        """The capture connector's own counters (scheduler and worker half), e.g. ``slot_checks_failed``: what its
        self-checks against vLLM's slot mapping and block lists found."""
        out: dict[str, int] = {}
        halves = [getattr(self.scheduler.connector, "_hs_scheduler", None)]
        halves.append(getattr(self.worker_connector, "_hs_worker", None))
        for half in halves:
            out.update(getattr(half, "counters", None) or {})
        return out

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        try:
            # EngineCore.shutdown: the scheduler (its connector) and the workers (ensure_kv_transfer_shutdown:
            # the worker-role connector's shutdown publishes what it has read and stops its publisher).
            if hasattr(self.scheduler, "shutdown"):
                self.scheduler.shutdown()
            if kv_transfer_state.has_kv_transfer_group():
                kv_transfer_state.ensure_kv_transfer_shutdown()
        finally:
            self._exit.close()


def build_engine(spec: EngineSpec) -> Engine:
    """The engine core's start-up, in its order: KV-cache configs -> worker (connector, views, registration) ->
    scheduler (whose constructor creates the scheduler-role connector) -> block hasher."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import bind_kv_cache

    connector = spec.extra_config is not None
    cfg = make_vllm_config(spec, connector=connector)
    exit_stack = contextlib.ExitStack()
    # V2 runs (0.29-0.33): the scheduler and both connectors read ``vllm_config.use_v2_model_runner`` (the env var
    # wins).  0.34+ has no V1 and no switch: V2 always.
    exit_stack.enter_context(_env(V2_ENV, _runner_env(spec.v2)))
    if not spec.v2 and not has_v1_runner():
        raise ValueError("a Model Runner V1 engine was asked for, but this release has no V1 (deleted in 0.34)")
    try:
        layer = h.make_capture_layer(cfg)
        kv = h.build_kv_cache_configs(cfg, layer, spec.verifier)
        assert kv.scheduler.num_blocks == spec.num_blocks, (kv.scheduler.num_blocks, spec.num_blocks)
        # EngineCore._initialize_kv_caches: the cache config learns the block count (and, 0.18+, the block size).
        cfg.cache_config.num_gpu_blocks = kv.scheduler.num_blocks
        gid = h.group_index_of(kv.worker, h.CAPTURE_LAYER)
        bs = h.group_block_size(kv.worker, gid)
        kbs = [h.group_block_size(kv.worker, i) for i in range(len(kv.worker.kv_cache_groups))]

        # ---- worker: Worker.initialize_from_config -> ensure_kv_transfer_initialized, then the runner
        if kv_transfer_state.has_kv_transfer_group():
            kv_transfer_state.ensure_kv_transfer_shutdown()
        with set_current_vllm_config(cfg):
            _init_worker_distributed()
            if connector:
                kv_transfer_state.ensure_kv_transfer_initialized(
                    cfg, **_kw(kv_transfer_state.ensure_kv_transfer_initialized, {"kv_cache_config": kv.worker})
                )
            views = h.allocate_views(cfg, kv.worker, layer, kbs)
            bind_kv_cache({h.CAPTURE_LAYER: views[h.CAPTURE_LAYER]}, cfg.compilation_config.static_forward_context, [])
            group_bs = [h.group_block_size(kv.worker, i) for i in range(len(kv.worker.kv_cache_groups))]
            runner: Runner = RunnerV2(cfg, views) if spec.v2 else RunnerV1(cfg, views, group_bs, kbs)

        # ---- scheduler (EngineCore.__init__)
        resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
        if resolve is not None:
            sched_bs, hash_bs = resolve(kv.scheduler, cfg)
        else:
            pcfg = cfg.parallel_config
            sched_bs = (
                cfg.cache_config.block_size
                * pcfg.decode_context_parallel_size
                * getattr(pcfg, "prefill_context_parallel_size", 1)
            )
            hash_bs = sched_bs
        scheduler = Scheduler(
            **_kw(
                Scheduler.__init__,
                {
                    "vllm_config": cfg,
                    "kv_cache_config": kv.scheduler,
                    "structured_output_manager": StructuredOutputManager(cfg),
                    "block_size": sched_bs,
                    "hash_block_size": hash_bs,
                    "include_finished_set": False,
                    "log_stats": False,
                },
            )
        )
        if has_v1_runner():  # the scheduler's switch exists only where there is a choice (0.29-0.33)
            assert getattr(scheduler, "use_v2_model_runner", False) is spec.v2
        engine = Engine(
            spec=spec,
            cfg=cfg,
            layer=layer,
            kv=kv,
            gid=gid,
            block_size=bs,
            kernel_block_size=kbs[gid],
            views=views,
            scheduler=scheduler,
            block_hasher=_block_hasher(cfg, hash_bs),
            runner=runner,
            initial_free_blocks=0,
            _exit=exit_stack,
        )
        runner.engine = engine
        if kv_transfer_state.has_kv_transfer_group():
            engine.worker_connector = kv_transfer_state.get_kv_transfer_group()
        engine.pads_to_null_block = _pads_land_in_null_block(engine)
        engine.initial_free_blocks = engine.free_blocks()
        if scheduler.connector is not None:
            _handshake(scheduler.connector)
            _spy_request_finished(engine)
        return engine
    except BaseException:
        exit_stack.close()
        raise


def _pads_land_in_null_block(engine: Engine) -> bool:
    """Where vLLM's writer puts a padding token (``PAD_SLOT_ID``): the null block 0, which the block pool never
    hands out (0.25+), or the last slot of the last block (before), which it does.  Padding rows are written only in
    the first case: in the second they would corrupt a live request's rows in a real CUDA-graph run too."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    view = engine.view
    assert not view.any()
    junk = torch.ones(1, h.NUM_PLANES, h.HIDDEN, dtype=h.DTYPE)
    h.write_hidden_states(engine.layer, view, junk, torch.tensor([PAD_SLOT_ID], dtype=torch.int64))
    blocks = view.flatten(1).any(-1).nonzero().flatten().tolist()
    view.zero_()
    kernel_per_block = engine.block_size // engine.kernel_block_size
    return blocks == [0] or (kernel_per_block > 1 and blocks and blocks[0] < kernel_per_block)


def _init_worker_distributed() -> None:
    """A one-process world (TP = PP = 1, gloo), as the CPU worker's ``init_worker_distributed_environment``
    builds it; once per process (the connector's engine-id sync broadcasts over the TP group)."""
    import tempfile

    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    init_file = os.path.join(tempfile.mkdtemp(prefix="hs-compat-dist-"), "init")
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"file://{init_file}", local_rank=0, backend="gloo"
    )
    ps.ensure_model_parallel_initialized(1, 1)


def _handshake(scheduler_connector: Any) -> None:
    """EngineCore.__init__: the workers' ``get_handshake_metadata`` (keyed by ``(pp_rank, tp_rank)`` where the
    connector API is PP-aware, 0.23+, else by ``tp_rank``) handed to the scheduler-role connector.  One worker,
    rank 0."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    metadata = get_kv_transfer_group().get_handshake_metadata()
    if metadata is None:
        return
    if hasattr(scheduler_connector, "set_xfer_handshake_metadata_pp_aware"):
        scheduler_connector.set_xfer_handshake_metadata_pp_aware({(0, 0): metadata})
    else:
        scheduler_connector.set_xfer_handshake_metadata({0: metadata})


def _spy_request_finished(engine: Engine) -> None:
    """Record what the scheduler connector's ``request_finished[_all_groups]`` returns (vLLM drops it for aborted
    requests; the test wants to see why a record will not exist).  The call itself goes to the connector."""
    conn = engine.scheduler.connector
    for name in ("request_finished", "request_finished_all_groups"):
        original = getattr(conn, name, None)
        if original is None:
            continue

        def spy(request: Any, block_ids: Any, _original: Callable[..., Any] = original) -> Any:
            result = _original(request, block_ids)
            engine.finished_params.setdefault(request.request_id, result)
            return result

        setattr(conn, name, spy)


# --------------------------------------------------------------------------------------------------
# the model step
# --------------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    forward_steps: int = 0
    no_forward_steps: int = 0
    tokens_written: int = 0
    pad_rows: int = 0
    spec_accepted: int = 0
    spec_rejected: int = 0
    reordered_steps: int = 0
    block_copies: int = 0


class Runner:
    """The parts of a model runner a connector can observe: per-request state from the scheduler output, the batch
    order, the capture write (placed among the connector hooks as the release's runner places the drafter), the
    sampled tokens and drafts."""

    engine: Engine

    def __init__(self, cfg: Any, views: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.views = views
        self.requests: dict[str, Any] = {}  # req_id -> CachedRequestState (the runner's own dataclass)
        self.hashes: dict[str, list[int]] = {}
        self.drafts: tuple[list[str], list[list[int]]] | None = None
        self.stats = StepStats()
        self.order_log: list[list[str]] = []
        self.block_table: Any = None  # the release's BlockTable for the capture group, persistent like the runner's

    # ---- helpers shared by both runners ------------------------------------------------------------
    def _new_state(self, nr: Any, tokens: list[int]) -> Any:
        """The runner's state of a new request: what both runners read from it (V1 overrides this with vLLM's own
        ``CachedRequestState``, which its ``InputBatch`` takes)."""
        return _RequestState(
            req_id=nr.req_id,
            prompt_token_ids=tokens,
            block_ids=tuple(list(b) for b in nr.block_ids),
            num_computed_tokens=nr.num_computed_tokens,
        )

    def _tokens(self, rid: str) -> list[int]:
        st = self.requests[rid]
        return list(st.prompt_token_ids) + list(st.output_token_ids)

    def _apply_block_ops(self, so: Any) -> None:
        """Runner-side block operations the scheduler may ask for (0.17.1+ zeroing, 0.26+ copy-on-write copies).
        Neither happens for an attention-only verifier; if a release starts sending them the test must learn it."""
        zero = getattr(so, "new_block_ids_to_zero", None)
        assert not zero, f"the scheduler asked to zero blocks {zero}: not modelled"
        copies = getattr(so, "kv_cache_block_copies", None)
        if copies:
            from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

            copy_kv_cache_blocks_inplace(list(self.views.values()), self.engine.kv.worker.num_blocks, copies)
            self.stats.block_copies += len(copies)

    def _prepare(self, order: list[str], so: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Slot mapping (the release's BlockTable) and the hidden states of every scheduled token, in batch order;
        ``pad_tokens`` padding rows go to ``PAD_SLOT_ID`` where vLLM's writer sends them to the null block."""
        e = self.engine
        batch: list[h.ScheduledRequest] = []
        step_hashes: list[int] = []
        for rid in order:
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            spec = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            tokens = self._tokens(rid)
            start = st.num_computed_tokens
            assert start + n - len(spec) <= len(tokens), (rid, start, n, spec, len(tokens))
            assert not spec or start + n - len(spec) == len(tokens), (rid, start, n, spec, len(tokens))
            hs = extend_hashes(self.hashes.setdefault(rid, []), tokens)
            pos_hashes = hs[start : min(start + n, len(tokens))]
            prev = hs[len(tokens) - 1] if spec else None
            for d in spec:
                prev = hash_after(prev, d)
                pos_hashes.append(prev)
            assert len(pos_hashes) == n
            step_hashes.extend(pos_hashes)
            batch.append(h.ScheduledRequest(rid, list(st.block_ids[e.gid]), start, n))
        if self.block_table is None:
            sc = self.cfg.scheduler_config
            self.block_table = h.make_block_table(
                block_size=e.block_size,
                kernel_block_size=e.kernel_block_size,
                max_num_reqs=sc.max_num_seqs,
                max_num_blocks_per_req=-(-self.cfg.model_config.max_model_len // e.block_size) + 2,
                max_num_batched_tokens=sc.max_num_batched_tokens + (1 + NUM_SPEC_TOKENS) * sc.max_num_seqs + 8,
            )
        slots = h.compute_slot_mapping(
            batch,
            block_size=e.block_size,
            kernel_block_size=e.kernel_block_size,
            path=h.slot_mapping_path(),
            block_table=self.block_table,
        )
        to_cache = rows_for(step_hashes)
        pads = e.spec.pad_tokens if e.pads_to_null_block else 0
        if pads:
            from vllm.v1.attention.backends.utils import PAD_SLOT_ID

            junk = torch.full((pads, h.NUM_PLANES, h.HIDDEN), 7.0, dtype=h.DTYPE)
            to_cache = torch.cat([to_cache, junk])
            slots = torch.cat([slots, torch.full((pads,), PAD_SLOT_ID, dtype=slots.dtype)])
            self.stats.pad_rows += pads
        self.stats.tokens_written += sum(r.num_tokens for r in batch)
        self.order_log.append(list(order))
        return slots, to_cache, int(to_cache.shape[0])

    def _write(self, slots: torch.Tensor, to_cache: torch.Tensor, cycle: Any = None) -> Any:
        """The drafter's forward: the real capture layer inside a forward context carrying its metadata and slot
        mapping.  ``cycle``: a connector context the proposer itself opens (0.17)."""
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata

        md = {h.CAPTURE_LAYER: CacheOnlyAttentionMetadata(slot_mapping=slots)}
        kwargs = _kw(set_forward_context, {"num_tokens": int(slots.shape[0]), "slot_mapping": {h.CAPTURE_LAYER: slots}})
        with set_forward_context(md, self.cfg, **kwargs), cycle or contextlib.nullcontext() as out:
            self.engine.layer(to_cache)
        return out

    def _target_context(self, slots: torch.Tensor) -> Any:
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata

        md = {h.CAPTURE_LAYER: CacheOnlyAttentionMetadata(slot_mapping=slots)}
        kwargs = _kw(set_forward_context, {"num_tokens": int(slots.shape[0]), "slot_mapping": {h.CAPTURE_LAYER: slots}})
        return set_forward_context(md, self.cfg, **kwargs)

    def _sample(self, order: list[str], so: Any) -> list[list[int]]:
        """Greedy tokens of the deterministic verifier, with rejection of drafts; partial prefills sample nothing.
        The runner keeps the valid sampled tokens (``output_token_ids``) and drafts the last one."""
        sampled: list[list[int]] = []
        draft_ids: list[str] = []
        drafts: list[list[int]] = []
        for rid in order:
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            spec = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            tokens = self._tokens(rid)
            end = st.num_computed_tokens + n - len(spec)
            if end < len(tokens):
                sampled.append([])
                draft_ids.append(rid)
                drafts.append(
                    [tokens[end]]
                )  # V1 drafts a "backup" token for partial prefills; ignored by the scheduler
                continue
            hs = self.hashes[rid]
            prev, last = hs[end - 1], tokens[end - 1]
            out = [next_token(prev, last)]
            for d in spec:
                if d != out[-1]:
                    self.stats.spec_rejected += 1
                    break
                self.stats.spec_accepted += 1
                prev = hash_after(prev, d)
                out.append(next_token(prev, d))
            sampled.append(out)
            st.output_token_ids.extend(out)
            draft_ids.append(rid)
            drafts.append([out[-1]])
        self.drafts = (draft_ids, drafts)
        return sampled

    def _output(self, order: list[str], sampled: list[list[int]], kv_out: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        out = ModelRunnerOutput(
            **_fields(
                ModelRunnerOutput,
                {
                    "req_ids": list(order),
                    "req_id_to_index": {rid: i for i, rid in enumerate(order)},
                    "sampled_token_ids": sampled,
                    "logprobs": None,
                    "prompt_logprobs_dict": {},
                },
            )
        )
        out.kv_connector_output = kv_out
        return out

    def take_draft_token_ids(self) -> Any:
        from vllm.v1.outputs import DraftTokenIds

        if self.drafts is None:
            return None
        ids, drafts = self.drafts
        self.drafts = None
        return DraftTokenIds(ids, drafts)

    def execute(self, so: Any) -> Any:
        raise NotImplementedError


@dataclass
class _RequestState:
    """A request as a runner keeps it: prompt, generated tokens, block ids per group, computed tokens (V2's runner
    keeps these in its own request-state tables; the harness's V2 reads only these)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)


class RunnerV1(Runner):
    """``GPUModelRunner`` (V1): persistent ``InputBatch``; target forward inside ``maybe_get_kv_connector_output``
    (its exit calls ``get_finished``), then the drafter writes the capture layer, then ``finalize_kv_connector``.
    Only on releases that have V1 (0.17-0.33)."""

    def _new_state(self, nr: Any, tokens: list[int]) -> Any:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        return CachedRequestState(
            **_fields(
                CachedRequestState,
                {
                    "req_id": nr.req_id,
                    "prompt_token_ids": tokens,
                    "mm_features": list(getattr(nr, "mm_features", None) or []),
                    "sampling_params": nr.sampling_params,
                    "pooling_params": getattr(nr, "pooling_params", None),
                    "generator": None,
                    "block_ids": tuple(list(b) for b in nr.block_ids),
                    "num_computed_tokens": nr.num_computed_tokens,
                    "output_token_ids": [],
                    "lora_request": getattr(nr, "lora_request", None),
                },
            )
        )

    def __init__(
        self, cfg: Any, views: dict[str, torch.Tensor], block_sizes: list[int], kernel_block_sizes: list[int]
    ) -> None:
        super().__init__(cfg, views)
        from vllm.v1.worker.gpu_input_batch import InputBatch

        sc = cfg.scheduler_config
        max_len = cfg.model_config.max_model_len
        self.input_batch = InputBatch(
            **_kw(
                InputBatch.__init__,
                {
                    "max_num_reqs": sc.max_num_seqs,
                    "max_model_len": cfg.model_config.max_model_len,
                    "max_num_batched_tokens": sc.max_num_batched_tokens,
                    "device": torch.device("cpu"),
                    "pin_memory": False,
                    "vocab_size": VOCAB,
                    "block_sizes": list(block_sizes),
                    "kernel_block_sizes": list(kernel_block_sizes),
                    "max_num_blocks_per_req": [-(-max_len // bs) + 1 for bs in block_sizes],
                    "is_spec_decode": True,
                    "num_spec_tokens": NUM_SPEC_TOKENS,
                },
            )
        )
        # GPUModelRunner.initialize_kv_cache: register the views (the cross-layer path, 0.12-0.28, only for
        # connectors that prefer cross-layer blocks -- the capture connector must not).
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

        if has_kv_transfer_group():
            group = get_kv_transfer_group()
            assert not getattr(group, "prefer_cross_layer_blocks", False)
            group.register_kv_caches(views)
            group.set_host_xfer_buffer_ops(copy_kv_blocks)

    def _update_states(self, so: Any) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.hashes.pop(rid, None)
        for rid in so.finished_req_ids:
            ib.remove_request(rid)
        self._apply_block_ops(so)
        rd = so.scheduled_cached_reqs
        resumed = set(getattr(rd, "resumed_req_ids", ()) or ())
        unscheduled = set(ib.req_id_to_index) - (set(so.num_scheduled_tokens) - resumed)
        for rid in unscheduled:
            ib.remove_request(rid)
        to_add = []
        for nr in so.scheduled_new_reqs:
            st = self._new_state(nr, list(nr.prompt_token_ids))
            self.requests[nr.req_id] = st
            self.hashes.pop(nr.req_id, None)
            to_add.append(st)
        for i, rid in enumerate(rd.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = rd.num_computed_tokens[i]
            new_blocks = rd.new_block_ids[i]
            num_out = rd.num_output_tokens[i] if hasattr(rd, "num_output_tokens") else None
            if num_out is not None and num_out < len(st.output_token_ids):
                del st.output_token_ids[num_out:]
                self.hashes.pop(rid, None)
            index = ib.req_id_to_index.get(rid)
            if rid not in resumed:
                if new_blocks is not None:
                    for ids, new in zip(st.block_ids, new_blocks, strict=True):
                        ids.extend(new)
            else:
                assert index is None and new_blocks is not None
                st.block_ids = tuple(list(b) for b in new_blocks)
            if index is None:
                to_add.append(st)
                continue
            ib.num_computed_tokens_cpu[index] = st.num_computed_tokens
            if new_blocks is not None:
                ib.block_table.append_row(new_blocks, index)
        for st in to_add:
            ib.add_request(st)
        ib.condense()
        if self.engine.spec.reorder:
            from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

            if reorder_batch_to_split_decodes_and_prefills(ib, so, decode_threshold=1 + NUM_SPEC_TOKENS):
                self.stats.reordered_steps += 1
        ib.refresh_metadata()

    def execute(self, so: Any) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Mixin

        active = has_kv_transfer_group()
        if active:
            conn = get_kv_transfer_group()
            if handle_preemptions_takes_metadata():
                conn.handle_preemptions(so.kv_connector_metadata)
            elif so.preempted_req_ids:
                conn.handle_preemptions(so.preempted_req_ids)
        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            self.stats.no_forward_steps += 1
            self.drafts = None
            if not active:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return Mixin.kv_connector_no_forward(so, self.cfg)

        self.stats.forward_steps += 1
        num_reqs = ib_num_reqs(self.input_batch)
        order = [rid for rid in self.input_batch.req_ids[:num_reqs]]
        assert sorted(order) == sorted(so.num_scheduled_tokens), (order, so.num_scheduled_tokens)
        slots, to_cache, _ = self._prepare(order, so)
        defer = (
            {"defer_finalize": True}
            if "defer_finalize" in _params(Mixin.maybe_get_kv_connector_output)
            else {"clear_metadata": False}
        )
        with self._target_context(slots), Mixin.maybe_get_kv_connector_output(so, **defer) as kv_out:
            pass  # the verifier's own layers are not modelled
        sampled = self._sample(order, so)
        if proposer_runs_connector_cycle():
            # 0.17: the proposer opens a whole connector cycle of its own around the capture layer
            drafter_out = self._write(slots, to_cache, Mixin._get_kv_connector_output(so) if active else None)
            if kv_out and drafter_out:
                kv_out = KVConnectorOutput.merge(kv_out, drafter_out)
            else:
                kv_out = kv_out or drafter_out
            if hasattr(Mixin, "clear_kv_connector_metadata"):
                Mixin.clear_kv_connector_metadata()
        else:
            self._write(slots, to_cache)
            Mixin.finalize_kv_connector()
        return self._output(order, sampled, kv_out)


def ib_num_reqs(ib: Any) -> int:
    n = ib.num_reqs
    return int(n() if callable(n) else n)


@functools.cache
def handle_preemptions_takes_metadata() -> bool:
    """0.19+: ``handle_preemptions(kv_connector_metadata)`` every step; before: ``(preempted_req_ids)`` when any."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    params = list(inspect.signature(KVConnectorBase_V1.handle_preemptions).parameters)
    return "kv_connector_metadata" in params


@functools.cache
def proposer_runs_connector_cycle() -> bool:
    """0.17: ``ExtractHiddenStatesProposer.propose`` takes the scheduler output and wraps the capture layer in a
    connector cycle of its own (the runner then merges both outputs)."""
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    return "scheduler_output" in inspect.signature(ExtractHiddenStatesProposer.propose).parameters


class RunnerV2(Runner):
    """Model Runner V2 (0.29+): request states rebuilt from the scheduler output (resumed requests arrive as new
    requests), batch sorted by ``sort_batch_req_ids``, connector hooks through ``vllm/v1/worker/gpu/kv_connector.py``:
    0.29-0.32 run every post-forward hook after the drafter; 0.33 and 0.34 collect ``get_transfer_results`` before the
    drafter (``post_forward(defer_finalize=True)``) and finalize after it."""

    def __init__(self, cfg: Any, views: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, views)
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector

        self.kv = get_kv_connector(cfg, views)
        self.state_index: dict[str, int] = {}

    def _update_states(self, so: Any) -> None:
        for rid in sorted(set(so.finished_req_ids) | set(so.preempted_req_ids or ())):
            self.requests.pop(rid, None)
            self.hashes.pop(rid, None)
            self.state_index.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            tokens = nr.prefill_token_ids
            assert tokens is not None, "V2 scheduler output without prefill_token_ids"
            self.requests[nr.req_id] = self._new_state(nr, list(tokens))
            self.hashes.pop(nr.req_id, None)
            free = sorted(set(range(len(self.state_index) + 1)) - set(self.state_index.values()))
            self.state_index[nr.req_id] = free[0]
        rd = so.scheduled_cached_reqs
        assert not getattr(rd, "resumed_req_ids", None), "V2: resumed requests must arrive as new requests"
        for i, rid in enumerate(rd.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = rd.num_computed_tokens[i]
            new_blocks = rd.new_block_ids[i]
            if new_blocks is not None:
                for ids, new in zip(st.block_ids, new_blocks, strict=True):
                    ids.extend(new)
        self._apply_block_ops(so)

    def execute(self, so: Any) -> Any:
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            self.stats.no_forward_steps += 1
            self.drafts = None
            return self.kv.no_forward(so)
        self.stats.forward_steps += 1
        order = sort_batch_req_ids(dict(so.num_scheduled_tokens), so.scheduled_spec_decode_tokens, 1 + NUM_SPEC_TOKENS)
        slots, to_cache, num_tokens = self._prepare(order, so)
        pre_params = inspect.signature(self.kv.pre_forward).parameters
        batch = _V2Batch(
            req_ids=list(order),
            idx_mapping=torch.tensor([self.state_index[r] for r in order], dtype=torch.int32),
            num_tokens=num_tokens,
        )
        with self._target_context(slots):
            if "input_batch" in pre_params:
                self.kv.pre_forward(so, batch)
            elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in pre_params.values()):
                self.kv.pre_forward(
                    so, request_state_indices=batch.idx_mapping, request_ids=batch.req_ids, num_tokens=num_tokens
                )
            else:
                self.kv.pre_forward(so)
            # the verifier's own layers are not modelled
        if hasattr(self.kv, "finish_forward"):
            self.kv.finish_forward()
        sampled = self._sample(order, so)
        finished = so.finished_req_ids
        if "defer_finalize" in _params(type(self.kv).post_forward):
            kv_out = self.kv.post_forward(finished, defer_finalize=True)
            self._write(slots, to_cache)
            self.kv.finalize_step()
        else:
            self._write(slots, to_cache)
            kv_out = self.kv.post_forward(finished)
        return self._output(order, sampled, kv_out)


@dataclass
class _V2Batch:
    """What the V2 connector helper reads from the runner's ``InputBatch`` (0.32+): batch order, request-state rows
    and the token count."""

    req_ids: list[str]
    idx_mapping: torch.Tensor
    num_tokens: int


# --------------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------------
ABORT_POINTS = ("waiting", "prefill", "decode", "in_step")


@dataclass(frozen=True)
class RequestPlan:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int  # engine step before which it is added
    abort: str | None = None  # one of ABORT_POINTS: abort when the request is first seen in that state
    hs_capture: dict[str, Any] | None = None  # per-request ``kv_transfer_params["hs_capture"]``


@dataclass
class RequestTrace:
    plan: RequestPlan
    request: Any  # vLLM's Request
    aborted: str | None = None  # the state it was aborted in
    finished_step: int | None = None
    finish_reason: Any = None
    output_params: Any = None  # kv_transfer_params of the EngineCoreOutput that finished it (normal finishes)
    num_computed_at_finish: int | None = None
    token_ids_at_finish: list[int] | None = None
    num_prompt_tokens: int = 0
    times_scheduled: int = 0
    prefix_hit_tokens: int = 0  # num_computed_tokens at its first admission


@dataclass
class Trace:
    requests: dict[str, RequestTrace]
    steps: int = 0
    held_only_steps: int = 0  # steps taken while has_requests() was False but finished requests still held blocks
    stalled_steps: int = 0  # no-forward steps with requests waiting (KV cache full of held or running blocks)
    preemptions: int = 0
    resumed_as_new: int = 0
    resumed_cached: int = 0
    cache_checks: int = 0
    stats: StepStats = field(default_factory=StepStats)
    elapsed_s: float = 0.0


def make_request(engine: Engine, plan: RequestPlan) -> Any:
    """``EngineCoreRequest`` -> ``Request.from_engine_core_request`` with the engine core's block hasher."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": {"hs_capture": dict(plan.hs_capture)}} if plan.hs_capture is not None else None
    sp = SamplingParams(
        **_kw(
            SamplingParams, {"max_tokens": plan.max_tokens, "ignore_eos": True, "temperature": 0.0, "extra_args": extra}
        )
    )
    fields_ = set(getattr(EngineCoreRequest, "__struct_fields__", ()))
    kwargs = {
        "request_id": plan.req_id,
        "prompt_token_ids": list(plan.prompt),
        "mm_features": None,
        "sampling_params": sp,
        "pooling_params": None,
        "eos_token_id": None,
        "arrival_time": time.time(),
        "lora_request": None,
        "cache_salt": None,
        "data_parallel_rank": None,
    }
    ecr = EngineCoreRequest(**{k: v for k, v in kwargs.items() if k in fields_})
    return Request.from_engine_core_request(ecr, engine.block_hasher)


def _abort(engine: Engine, trace: RequestTrace, state: str) -> None:
    from vllm.v1.request import RequestStatus

    req = trace.request
    trace.aborted = state
    trace.num_computed_at_finish = req.num_computed_tokens
    trace.token_ids_at_finish = list(req.all_token_ids)
    engine.scheduler.finish_requests([trace.plan.req_id], RequestStatus.FINISHED_ABORTED)


def _state(req: Any) -> str | None:
    """The abort point a live request is in now (None: none of them)."""
    if req.is_finished():
        return None
    if req.num_computed_tokens == 0 and req.num_output_tokens == 0:
        return "waiting"
    if req.num_output_tokens == 0 and req.num_computed_tokens < req.num_prompt_tokens:
        return "prefill"
    if req.num_output_tokens > 0:
        return "decode"
    return None


def check_cache(engine: Engine, only: set[str] | None = None) -> int:
    """Every running request's computed positions hold exactly the hidden states of its token prefix, read through
    its own capture-group block ids (the scheduler's) -- prefix-cache hits included.  ``only``: just these."""
    from vllm.v1.request import RequestStatus

    from vllm_hs_compat import api

    e = engine
    group = api.resolve_capture_group(e.kv.scheduler, view="scheduler")
    view = api.describe_capture_view(e.view, group, num_planes=h.NUM_PLANES, hidden_size=h.HIDDEN)
    checked = 0
    for req in list(e.scheduler.running):
        if req.status != RequestStatus.RUNNING or req.num_computed_tokens == 0:
            continue
        if only is not None and req.request_id not in only:
            continue
        n = req.num_computed_tokens
        blocks = e.scheduler.kv_cache_manager.get_block_ids(req.request_id)[e.gid]
        rows = api.read_request(e.view, view, req.request_id, blocks, n)
        expect = expected_rows(e, req.request_id, list(req.all_token_ids), n)
        if not torch.equal(rows.view(torch.int16), expect.view(torch.int16)):
            bad = (rows.view(torch.int16) != expect.view(torch.int16)).flatten(1).any(-1).nonzero().flatten()
            raise AssertionError(
                f"request {req.request_id}: cache rows at positions {bad[:8].tolist()} (of {n}) differ from the "
                f"hidden states of its prefix; blocks {blocks}"
            )
        checked += 1
    return checked


def expected_rows(engine: Engine, req_id: str, tokens: list[int], n: int) -> torch.Tensor:
    """``rows_for(prefix_hashes(tokens[:n]))``, extended incrementally per request (tokens only ever grow)."""
    seen, hashes, rows = engine.expected.get(req_id, ([], [], rows_for([])))
    if tokens[: len(seen)] != seen:
        seen, hashes, rows = [], [], rows_for([])
    if n > len(seen):
        seen = tokens[:n]
        extend_hashes(hashes, seen)
        rows = torch.cat([rows, rows_for(hashes[rows.shape[0] :])])
        engine.expected[req_id] = (seen, hashes, rows)
    return rows[:n]


def run_schedule(
    engine: Engine, plans: list[RequestPlan], *, check_every_step: bool = True, max_steps: int = 5000
) -> Trace:
    """Drive the engine as ``EngineCore.step``/``post_step`` do: schedule -> execute -> (aborts that came in during
    the step) -> ``update_from_output`` -> drafts.  Steps continue until every request has left the scheduler
    (finished requests whose blocks the connector holds included)."""
    from vllm.v1.request import RequestStatus

    t0 = time.perf_counter()
    s = engine.scheduler
    traces = {p.req_id: RequestTrace(plan=p, request=None) for p in plans}
    trace = Trace(requests=traces)
    arrivals = sorted(plans, key=lambda p: p.arrival)
    ai = 0
    step = 0
    idle = 0  # consecutive steps that scheduled nothing and finished nothing
    while True:
        while ai < len(arrivals) and arrivals[ai].arrival <= step:
            p = arrivals[ai]
            ai += 1
            req = make_request(engine, p)
            traces[p.req_id].request = req
            traces[p.req_id].num_prompt_tokens = req.num_prompt_tokens
            s.add_request(req)
        for t in traces.values():
            if t.request is None or t.aborted or t.plan.abort in (None, "in_step"):
                continue
            if _state(t.request) == t.plan.abort:
                _abort(engine, t, t.plan.abort)
        live = s.has_requests()
        if not live and not s.requests:
            if ai == len(arrivals):
                break
            step += 1  # idle: nothing to run until the next arrival
            continue
        if not live:
            trace.held_only_steps += 1
        assert step < max_steps and idle < 200, (
            f"no progress at step {step} ({idle} steps without any): {len(s.requests)} requests left: "
            + "; ".join(
                f"{r.request_id} {r.status.name} computed {r.num_computed_tokens}/{r.num_tokens}"
                for r in s.requests.values()
            )
        )
        num_left = len(s.requests)
        so = s.schedule()
        _note_schedule(trace, so)
        if not so.total_num_scheduled_tokens and (s.waiting or s.running):
            trace.stalled_steps += 1
        out = engine.runner.execute(so)
        for rid in so.num_scheduled_tokens:
            t = traces[rid]
            t.times_scheduled += 1
            if t.plan.abort == "in_step" and not t.aborted and t.times_scheduled >= 2 and not t.request.is_finished():
                _abort(engine, t, "in_step")  # EngineCore._process_aborts_queue runs before update_from_output
        outputs = s.update_from_output(so, out)
        for eco in _iter_outputs(outputs):
            if eco.finish_reason is None:
                continue
            t = traces[eco.request_id]
            t.finish_reason = eco.finish_reason
            t.output_params = eco.kv_transfer_params
            t.finished_step = step
            t.num_computed_at_finish = t.request.num_computed_tokens
            t.token_ids_at_finish = list(t.request.all_token_ids)
        drafts = engine.runner.take_draft_token_ids()
        if drafts is not None and so.total_num_scheduled_tokens:
            s.update_draft_token_ids(drafts)
        if check_every_step:
            # the requests written in this step, and every running request every 8th step
            only = None if step % 8 == 0 else set(so.num_scheduled_tokens)
            trace.cache_checks += check_cache(engine, only)
        idle = 0 if so.total_num_scheduled_tokens or len(s.requests) < num_left else idle + 1
        step += 1
    trace.steps = step
    trace.stats = engine.runner.stats
    trace.elapsed_s = time.perf_counter() - t0
    for t in traces.values():
        assert t.request is not None and t.request.status != RequestStatus.RUNNING
    return trace


def _note_schedule(trace: Trace, so: Any) -> None:
    trace.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
    resumed = set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ())
    trace.resumed_cached += len(resumed)
    for nr in so.scheduled_new_reqs:
        t = trace.requests[nr.req_id]
        if t.times_scheduled == 0:
            t.prefix_hit_tokens = nr.num_computed_tokens
        else:
            trace.resumed_as_new += 1


def _iter_outputs(outputs: Any) -> Iterator[Any]:
    if not outputs:
        return
    values = outputs.values() if isinstance(outputs, dict) else [outputs]
    for eco_batch in values:
        yield from eco_batch.outputs


@contextlib.contextmanager
def engine_for(spec: EngineSpec) -> Iterator[Engine]:
    engine = build_engine(spec)
    try:
        yield engine
    finally:
        engine.close()


__all__ = [
    "ABORT_POINTS",
    "Engine",
    "EngineSpec",
    "RequestPlan",
    "Trace",
    "build_engine",
    "check_cache",
    "engine_for",
    "has_v1_runner",
    "has_v2_runner",
    "prefix_hashes",
    "receive_record",
    "rows_for",
    "run_schedule",
    "runner_modes",
    "take_records",
]
