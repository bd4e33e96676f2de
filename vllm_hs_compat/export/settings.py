"""The export's settings as one type: what ``ExportProducer`` takes besides its token, and what a deployment may set
in ``kv_connector_extra_config["export"]`` -- the connector's allowed keys are this type's fields (plus
``token_file``), never a second list.  The producer takes the object (``ExportProducer(settings, token=...)``) or
the same fields as keywords.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.checksums import CHECKSUM_ALGORITHMS, DEFAULT_CHECKSUM
from vllm_hs_compat.export.nixl_backend import UcxSettings
from vllm_hs_compat.export.pool import DEFAULT_MAX_REDELIVERIES
from vllm_hs_compat.export.server import ControlLimits
from vllm_hs_compat.export.shm import DEFAULT_SHM_DIR

#: After a claim the pump polls every ``claimed_poll_interval_s`` while the claimed leases are out, for at most
#: this long.
CLAIMED_SPIN_S: Final = 1.0
#: The pump's pause between polls while a claim's READ may be in flight.  Not 0 (back to back, yielding only the
#: GIL): on a host with no idle core a thread that never sleeps loses the scheduler's favour and answers later
#: (benchmarks/bench_pump.py on 2 loaded vCPUs: a READ after an idle spell 0.63-0.95 ms with 50 us, 0.79-2.83 ms
#: back to back, 2.7-3.7 ms before the claim woke the pump).
CLAIMED_POLL_S: Final = 50e-6
#: The connector's own key besides the fields: where the trainer token lives (the producer takes the token).
TOKEN_FILE_KEY: Final = "token_file"


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """Every ``ExportProducer`` setting but the token.

    * The pool: ``num_slots`` slots of ``slot_bytes`` (a record takes a run of slots); ``on_full``: ``"drop"`` a
      record no run of slots is free for, or ``"wait"`` up to ``wait_timeout_s``; ``checksum``: ``xxh3_64`` or
      ``crc32``; ``backend``: ``"nixl"``, ``"shm"`` or ``"auto"`` (NIXL if importable); ``shm_dir``, ``ucx``
      (:class:`~vllm_hs_compat.export.nixl_backend.UcxSettings`): the transports'.
    * Leases: ``lease_ttl_s``: how long a consumer may hold a claimed record before it is taken back; a record
      taken back unreleased goes back to the queue under a new lease, up to ``max_redeliveries`` times
      (at-least-once delivery: a consumer that dies loses nothing), then it is counted ``expired_claimed``; ``0``
      gives at-most-once.  ``ready_ttl_s``: how long a published (or requeued) record waits unclaimed (None: ever).
    * The pump (NIXL only; UCX answers a consumer's READ only while this process progresses it, e.g. over TCP):
      every ``claimed_poll_interval_s`` (50 us; ``0``: back to back, yielding only the GIL between polls) from a
      claim until its leases are released, for at most ``claimed_spin_s`` after the latest claim; every
      ``poll_interval_s`` while leases stay claimed longer, or within 0.5 s of a hello or a claim; otherwise it
      waits ``idle_poll_interval_s`` -- or until the next hello or claim wakes it (so the idle wait only paces
      UCX's background work: keepalives, a peer's disconnect).  Leases whose bytes went out in their claim's answer
      (small records fetched by id) need no READ, so they keep the pump waiting, as pings, releases and reads over
      the control plane do.
    * The control plane: ``host`` and ``port`` (loopback and an ephemeral port by default; ``advertise_host``: what
      tickets name when ``host`` is a wildcard), ``handshake_timeout_s``, ``control_limits``
      (:class:`~vllm_hs_compat.export.server.ControlLimits`).  ``direct_port``: the trainer's direct control socket
      in the producer's process, past the gate (its ZAP handler admits the trainer's key only): ``0`` an ephemeral
      port on ``host``, ``N`` that port, ``None`` none.  ``plain_port``: the trainer's plain control channel
      (:mod:`vllm_hs_compat.export.plain`: a bare TCP connection to the serving thread, authenticated both ways by
      the token, not encrypted -- it carries what the data plane carries; trainers use it before the direct
      socket): ``0``, ``N`` or ``None`` likewise (``None``: the trainer's requests stay CURVE-encrypted).
    * ``shm_handoff`` (shm only): ``"fd"`` the pool has no name and the trainer gets its descriptor over an abstract
      Unix socket (nothing is left in ``shm_dir``, whatever kills the process; the trainer must share the producer's
      network namespace), ``"path"`` the named ``hsx2-<pid>-<instance>.pool`` file (left behind by a SIGKILL until
      the next producer's sweep).
    """

    backend: str = "auto"
    num_slots: int = 64
    slot_bytes: int = 16 << 20
    lease_ttl_s: float = 30.0
    ready_ttl_s: float | None = 300.0
    on_full: str = "drop"
    wait_timeout_s: float = 1.0
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    checksum: str = DEFAULT_CHECKSUM
    shm_dir: str = DEFAULT_SHM_DIR
    ucx: UcxSettings | None = None
    poll_interval_s: float = 200e-6
    idle_poll_interval_s: float = 20e-3
    claimed_poll_interval_s: float = CLAIMED_POLL_S
    claimed_spin_s: float = CLAIMED_SPIN_S
    handshake_timeout_s: float = 5.0
    max_redeliveries: int = DEFAULT_MAX_REDELIVERIES
    control_limits: ControlLimits | None = None
    direct_port: int | None = 0
    plain_port: int | None = 0
    shm_handoff: str = "fd"

    @classmethod
    def keys(cls) -> frozenset[str]:
        """The keys of ``kv_connector_extra_config["export"]``: the fields, and ``token_file``."""
        return frozenset(f.name for f in dataclasses.fields(cls)) | {TOKEN_FILE_KEY}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ExportSettings:
        """Settings from a JSON-like map (``token_file`` left out: it is the sink's).  ``ucx`` and
        ``control_limits`` may be maps of their own fields.  Raises :class:`~vllm_hs_compat.errors.ExportConfigError`
        naming the key, the value and what it must be."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in options if k not in fields)
        if unknown:
            raise E.ExportConfigError(f"unknown export settings {unknown}; expected any of {sorted(fields)}")
        values = dict(options)
        for key, kind in (("ucx", UcxSettings), ("control_limits", ControlLimits)):
            raw = values.get(key)
            if isinstance(raw, Mapping):
                values[key] = _nested(key, kind, raw)
            elif raw is not None and not isinstance(raw, kind):
                raise E.ExportConfigError(f"{key} must be a JSON object of {kind.__name__} fields, found {raw!r}")
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Types and ranges of every field (the producer's own checks run again when it starts)."""
        _choice("backend", self.backend, ("auto", "shm", "nixl"))
        _choice("on_full", self.on_full, ("drop", "wait"))
        _choice("shm_handoff", self.shm_handoff, ("fd", "path"))
        _choice("checksum", self.checksum, tuple(CHECKSUM_ALGORITHMS))
        _int("num_slots", self.num_slots, 1)
        _int("slot_bytes", self.slot_bytes, 64)
        if self.slot_bytes % 64:
            up = -(-self.slot_bytes // 64) * 64
            raise E.ExportConfigError(f'"slot_bytes": {self.slot_bytes} must be a multiple of 64; round it up to {up}')
        _int("port", self.port, 0, 65535)
        for name in ("direct_port", "plain_port"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, 65535)
        _int("max_redeliveries", self.max_redeliveries, 0)
        for name in ("lease_ttl_s", "handshake_timeout_s"):
            _seconds(name, getattr(self, name), positive=True)
        _seconds("ready_ttl_s", self.ready_ttl_s, positive=True, none_ok=True)
        for name in ("wait_timeout_s", "poll_interval_s", "idle_poll_interval_s", "claimed_poll_interval_s"):
            _seconds(name, getattr(self, name), positive=False)
        _seconds("claimed_spin_s", self.claimed_spin_s, positive=False)
        for name in ("host", "shm_dir"):
            _text(name, getattr(self, name))
        if self.advertise_host is not None:
            _text("advertise_host", self.advertise_host)


def _nested(key: str, kind: type[Any], raw: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(str(k) for k in raw if k not in names)
    if unknown:
        raise E.ExportConfigError(f"{key} has unknown keys {unknown}; expected any of {sorted(names)}")
    if kind is UcxSettings:
        bad = {k: v for k, v in raw.items() if v is not None and not isinstance(v, str)}
        if bad:
            raise E.ExportConfigError(f"{key} values are UCX strings (or null), found {bad}")
    try:
        return kind(**raw)
    except (TypeError, E.ExportConfigError) as e:
        raise E.ExportConfigError(f"{key}: {e}") from None


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        span = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        raise E.ExportConfigError(f'"{name}": {value!r} must be {span}')


def _seconds(name: str, value: Any, *, positive: bool, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if ok and (value > 0 if positive else value >= 0):
        return
    want = "a number of seconds " + ("> 0" if positive else ">= 0") + (" or null" if none_ok else "")
    raise E.ExportConfigError(f'"{name}": {value!r} must be {want}')


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise E.ExportConfigError(f'"{name}": {value!r} must be one of {list(choices)}')


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise E.ExportConfigError(f'"{name}": {value!r} must be a non-empty string')
