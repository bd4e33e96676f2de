"""NIXL transport (optional extra ``nixl``, imported lazily on first use).

One DRAM registration per side: the producer's pool, the consumer's landing buffer.  The consumer pulls with
READ, verifies, and releases over the control plane (with the record's outcome).  Agent metadata travels as
bytes inside the trainer's control-plane hello (never to a ticket holder: it would let its holder READ the whole
pool); NIXL's pickle-based descriptor serialisation is never used.

UCX settings (applied with ``os.environ.setdefault`` *before* NIXL is first imported, because UCX reads them
once):

* ``UCX_RCACHE_MAX_UNRELEASED=1024``: bounds UCX's registration cache of freed-but-unreleased regions, the
  leak vLLM works around the same way (vllm-project/vllm#24264).  Set by default.
* ``UCX_MEM_MMAP_HOOK_MODE``: ``none`` turns off UCX's mmap/munmap hooks (the other leak/crash workaround in
  the wild).  Safe for this module, which registers once and never frees registered memory, but it changes
  UCX for the whole process, so it is only set when asked (``UcxSettings(mmap_hook_mode="none")``).
* ``UCX_NET_DEVICES``: which NIC(s) UCX may use, e.g. ``mlx5_0:1`` on an RDMA host, ``lo`` for a single-host
  test. Left to UCX unless given.
* ``UCX_TLS``: transports; left to UCX unless given (``cma,tcp,self`` works on a host without RDMA).
* ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` = ``256k`` (UCX's default is 8 KiB): over TCP a READ is
  answered by the producer in active messages of this size, each needing the producer's progress call; with
  256 KiB segments a 16-64 MiB READ over loopback TCP took about half the time (docs/benchmarks.md, "UCX's TCP
  segment size").  Only UCX's ``tcp`` transport reads them; set by default, the user's value wins.

The TCP segment sizes are also what a transfer depends on: UCX's TCP transport does not negotiate them, and a side
whose receive segment is smaller than what its peer sends corrupts its heap on the first large READ (glibc aborts
the trainer), after which the producer's UCX may abort the producer too (``Fatal: unexpected error: Endpoint
timeout``; seen in one run of four here).  Each agent records the values in effect when UCX read them
(:func:`transfer_settings`); the consumer sends its own in the ``transfer_settings`` request before it loads the
producer's metadata, the producer answers with its own and counts a mismatch, and the consumer refuses a mismatch
by name (:class:`~vllm_hs_compat.errors.TransportSettingsMismatchError`) before any transfer.

Agents run with ``enable_prog_thread=False``: the producer's pump thread polls ``get_new_notifs()`` (which
also drives UCX progress for incoming connections); the consumer polls ``check_xfer_state``.  Every wait has
a deadline.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from vllm_hs_compat import errors as E
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.transport import REGION_MASK, REGION_SHIFT, LandingRegions, host_buffer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class UcxSettings:
    """UCX environment applied before NIXL is imported (``None`` = leave UCX's default / the user's value)."""

    net_devices: str | None = None
    tls: str | None = None
    rcache_max_unreleased: str | None = "1024"
    mmap_hook_mode: str | None = None
    tcp_seg_size: str | None = "256k"

    def env(self) -> dict[str, str]:
        pairs = {
            "UCX_NET_DEVICES": self.net_devices,
            "UCX_TLS": self.tls,
            "UCX_RCACHE_MAX_UNRELEASED": self.rcache_max_unreleased,
            "UCX_MEM_MMAP_HOOK_MODE": self.mmap_hook_mode,
            "UCX_TCP_TX_SEG_SIZE": self.tcp_seg_size,
            "UCX_TCP_RX_SEG_SIZE": self.tcp_seg_size,
        }
        return {k: v for k, v in pairs.items() if v is not None}


#: The UCX settings a transfer depends on, which both sides must share, with UCX's own defaults (its TCP transport's
#: configuration table; in effect when the environment sets none).  UCX reads them when an agent is created.
TRANSFER_SETTINGS: Final = {"UCX_TCP_TX_SEG_SIZE": "8kb", "UCX_TCP_RX_SEG_SIZE": "64kb"}
_MEMUNITS: Final = re.compile(r"\s*(\d+)\s*([kmgt]?)b?\s*", re.IGNORECASE)


def _memunits(value: str) -> str:
    """A UCX memory size as a count of bytes (``256k``, ``256kb`` and ``262144`` are one value); anything else as
    written, lower-cased."""
    m = _MEMUNITS.fullmatch(value)
    if m is None:
        return value.strip().lower()
    return str(int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " ")))


def transfer_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of :data:`TRANSFER_SETTINGS` UCX reads in this process now (``environ``: ``os.environ``), else
    UCX's defaults; sizes as counts of bytes."""
    env = os.environ if environ is None else environ
    return {k: _memunits(env.get(k, default)) for k, default in TRANSFER_SETTINGS.items()}


def settings_differ(mine: Mapping[str, str], theirs: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The settings of :data:`TRANSFER_SETTINGS` whose values differ: ``{name: (mine, theirs)}`` (a setting one
    side does not report counts as UCX's default there)."""
    out: dict[str, tuple[str, str]] = {}
    for key, default in TRANSFER_SETTINGS.items():
        a, b = mine.get(key, _memunits(default)), theirs.get(key, _memunits(default))
        if a != b:
            out[key] = (a, b)
    return out


#: Import names tried in order: the ``nixl`` meta package (it picks the CUDA major itself), then the backend
#: wheels directly, so ``pip install nixl-cu12`` alone (no meta package, no CUDA 13 libraries) is enough.
NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
#: A READ is polled without pause for this long, then with 50 us sleeps (a sleep is ~100 us on a loaded VM: a
#: 2 MiB READ, ~0.5 ms, lost a fifth of its speed to the sleeps when polling paused after 64 polls).
SPIN_S = 2e-3
#: A read of at least this many ranges builds its descriptor lists as numpy arrays (see `_descs_many`).
MANY_RANGES = 16
LEAN_INSTALL = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"


def _findable(name: str) -> bool:
    import importlib.util

    if name in sys.modules:
        return sys.modules[name] is not None  # None: import deliberately blocked
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def nixl_available() -> bool:
    """True if a NIXL package can be imported (checked without importing it)."""
    return any(_findable(m) for m in NIXL_MODULES)


def _load(ucx: UcxSettings) -> Any:
    """Apply UCX settings, then import NIXL's ``_api`` module; a named error when no NIXL is installed."""
    already = any(m == "nixl" or m.startswith("nixl_cu") for m in sys.modules)
    for key, value in ucx.env().items():
        if key in os.environ:
            continue
        if already:
            log.warning(
                "NIXL was imported before vllm-hs-compat could set %s=%s; set it in the environment",
                key,
                value,
            )
        os.environ[key] = value
    failures: list[str] = []
    for name in NIXL_MODULES:
        if not _findable(name):
            failures.append(f"{name}: not installed")
            continue
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as e:
            failures.append(f"{name}: {e}")
    raise E.TransportUnavailableError(
        f"the NIXL transport needs a NIXL package ({'; '.join(failures)}); install the lean way: "
        f"{LEAN_INSTALL} (never a bare 'pip install nixl', it pulls CUDA torch and libraries), "
        "or use backend='shm' on a single host"
    )


def _nixl_errors() -> dict[str, type[E.ExportError]]:
    return {
        "nixlRemoteDisconnectError": E.RemoteDisconnectedError,
        "nixlNotFoundError": E.DescriptorError,
        "nixlInvalidParamError": E.DescriptorError,
        "nixlMismatchError": E.StaleMetadataError,
        "nixlNotAllowedError": E.StaleMetadataError,
    }


def _translate(exc: Exception, what: str) -> E.ExportError:
    name = type(exc).__name__
    cls = _nixl_errors().get(name, E.TransportError)
    hints: dict[type[E.ExportError], str] = {
        E.RemoteDisconnectedError: "the peer process died or restarted; reconnect for fresh metadata",
        E.DescriptorError: "a descriptor lies outside the registered memory (or lengths disagree)",
        E.StaleMetadataError: "the agent metadata is stale, garbled or already loaded under that name",
    }
    hint = hints.get(cls, "see the NIXL log lines above")
    return cls(f"NIXL {what} failed with {name}: {exc}; {hint}")


def _agent(api: Any, name: str) -> Any:
    cfg = api.nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    try:
        agent = api.nixl_agent(name, cfg)
    except Exception as e:
        raise _translate(e, "agent creation") from None
    if "UCX" not in getattr(agent, "backends", {}):
        raise E.TransportUnavailableError(
            "NIXL loaded but its UCX backend did not start; check UCX_NET_DEVICES / UCX_TLS and the NIXL log"
        )
    return agent


class NixlProducerTransport:
    kind = "nixl"

    def __init__(self, pool_bytes: int, instance: str, ucx: UcxSettings | None = None) -> None:
        api = _load(ucx or UcxSettings())
        self.pool_bytes = pool_bytes
        self.buffer = host_buffer(pool_bytes)
        self.agent_name = f"hsx-p-{instance}"
        #: the settings a transfer depends on, as UCX read them for this agent (see :func:`transfer_settings`)
        self.settings = transfer_settings()
        self._agent = _agent(api, self.agent_name)
        try:
            self._reg = self._agent.register_memory([(self.buffer.data_ptr(), pool_bytes, 0, "")], "DRAM")
            self._metadata = bytes(self._agent.get_agent_metadata())
        except Exception as e:
            raise _translate(e, "pool registration") from None

    def describe(self) -> dict[str, Any]:
        """The agent's name and metadata and the pool's address range (for the trainer's hello only)."""
        return {
            "kind": self.kind,
            "agent": self.agent_name,
            "metadata": self._metadata,
            "base": int(self.buffer.data_ptr()),
            "size": self.pool_bytes,
        }

    def poll_notifications(self) -> list[bytes]:
        """Poll NIXL (this also progresses UCX: wire-up and the consumers' READs need it)."""
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # keep serving; the pump logs and counts
            raise _translate(e, "notification poll") from None
        return [bytes(m) for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.warning("NIXL deregistration failed: %s", e)
        self._agent = None


class PostedRead:
    """A READ posted by :meth:`NixlConsumerTransport.post_read`: its NIXL handle, the state ``transfer`` returned,
    and whether the READ is known to be done."""

    __slots__ = ("done", "handle", "state")

    def __init__(self, handle: Any, state: str = "PROC") -> None:
        self.handle = handle
        self.state = state
        self.done = False


class NixlConsumerTransport:
    """One NIXL agent with the landing buffer registered; READs from the attached producer's pool."""

    kind = "nixl"

    def __init__(self, landing_bytes: int, ucx: UcxSettings | None = None) -> None:
        api = _load(ucx or UcxSettings())
        self.landing = host_buffer(landing_bytes)
        self.agent_name = f"hsx-c-{uuid.uuid4().hex}"
        #: the settings a transfer depends on, as UCX read them for this agent (see :func:`transfer_settings`)
        self.settings = transfer_settings()
        self._agent = _agent(api, self.agent_name)
        try:
            self._reg = self._agent.register_memory([(self.landing.data_ptr(), landing_bytes, 0, "")], "DRAM")
        except Exception as e:
            raise _translate(e, "landing-buffer registration") from None
        self.regions = LandingRegions(self.landing)
        self._region_regs: dict[int, Any] = {}
        self._remote: str | None = None
        self._base = 0
        self._size = 0

    def attach(self, info: Mapping[str, Any] | P.ShmInfo | P.NixlInfo) -> None:
        """Load the producer's agent metadata (``info``: its ``describe()``); forgets any earlier producer."""
        desc = P.convert_transport(info)
        if not isinstance(desc, P.NixlInfo):
            raise E.TransportUnavailableError("producer offers transport 'shm', this is nixl")
        name, metadata, base, size = desc.agent, desc.metadata, desc.base, desc.size
        self.detach()
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _translate(e, "loading the producer's agent metadata") from None
        loaded_s = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_s != name:
            self._remote = loaded_s
            self.detach()
            raise E.StaleMetadataError(
                f"agent metadata names agent {loaded_s!r}, the producer said {name!r}; refusing it"
            )
        self._remote, self._base, self._size = name, base, size

    def detach(self) -> None:
        if self._remote is not None:
            try:
                self._agent.remove_remote_agent(self._remote)
            except Exception as e:
                log.debug("remove_remote_agent(%s): %s", self._remote, e)
            self._remote = None

    def read(self, items: Sequence[tuple[int, int, int]], deadline: float) -> None:
        """One READ request for every range (each checked against both buffers first), polled to completion or
        the deadline."""
        local, remote = self._descs(items)
        self._read_raw(local, remote, deadline)

    def post_read(self, items: Sequence[tuple[int, int, int]]) -> PostedRead:
        """Post one READ request for ``(remote_offset, local_offset, nbytes)`` ranges (checked as :meth:`read`
        checks them) and return at once.  The caller owns the result: it waits for it (:meth:`wait_read`) and
        always releases it (:meth:`release_read`).  Its ``done`` says the transport moved the bytes while posting
        (UCX's same-host shared memory does; TCP and RDMA move them later)."""
        local, remote = self._descs(items)
        posted = self._post(local, remote)
        posted.done = posted.state == "DONE"
        return posted

    def wait_read(self, posted: PostedRead, deadline: float, spin_s: float = SPIN_S) -> None:
        """Poll a posted READ until it is done, or failed (a named error), or past the deadline (an
        :class:`ExportTimeoutError`, the READ still in flight).  Polls without pause for ``spin_s``, then with
        50 us sleeps (over UCX TCP nothing moves the bytes between polls).  The handle stays the caller's: it
        releases it with :meth:`release_read` in every case."""
        if not posted.done:
            self._wait(posted.handle, deadline, spin_s, None)
            posted.done = True

    def release_read(self, posted: PostedRead) -> None:
        """Release a posted READ (twice is harmless).  Over (done or failed): only frees its handle.  In flight:
        NIXL tries to cancel it and UCX may still write the bytes, so the caller never reuses the landing range
        of a READ it released in flight."""
        self._release(posted.handle)

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:
            log.debug("releasing a NIXL handle: %s", e)

    def _descs(self, items: Sequence[tuple[int, int, int]]) -> tuple[Any, Any]:
        """NIXL's local and remote descriptors for ``(remote_offset, local_offset, nbytes)`` ranges, each checked
        against the pool and the landing regions (a :class:`DescriptorError` otherwise)."""
        if self._remote is None:
            raise E.StaleMetadataError("no producer attached; call attach() first")
        cap = self.landing.numel()
        lbase = int(self.landing.data_ptr())
        if len(items) >= MANY_RANGES:
            return self._descs_many(items, cap, lbase)
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        for roff, loff, n in items:
            if roff < 0 or n <= 0 or roff + n > self._size or loff < 0:
                raise E.DescriptorError(
                    f"range remote[{roff}:{roff + n}] -> landing[{loff}:{loff + n}] is outside the pool "
                    f"({self._size} bytes) or the landing buffer ({cap} bytes)"
                )
            if loff + n <= cap:
                local.append((lbase + loff, n, 0))
            else:  # another landing region (or outside every one: DescriptorError)
                buf, lo = self.regions.locate(loff, n)
                local.append((int(buf.data_ptr()) + lo, n, 0))
            remote.append((self._base + roff, n, 0))
        return local, remote

    def add_region(self, buf: torch.Tensor) -> int:
        """Register ``buf`` as a landing region (see ``transport.REGION_SHIFT``); its region number."""
        try:
            reg = self._agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
        except Exception as e:
            raise _translate(e, "landing-region registration") from None
        k = self.regions.add(buf)
        self._region_regs[k] = reg
        return k

    def drop_region(self, k: int) -> None:
        reg = self._region_regs.pop(k, None)
        self.regions.drop(k)
        if reg is not None:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.debug("NIXL deregistration of a landing region failed: %s", e)

    def _descs_many(self, items: Sequence[tuple[int, int, int]], cap: int, lbase: int) -> tuple[Any, Any]:
        """:meth:`_descs` of many ranges: checked and turned into NIXL's ``N x 3`` descriptor arrays with
        whole-array operations (NIXL reads numpy arrays of descriptors without a Python object per descriptor)."""
        import numpy as np

        arr = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        roff, loff, n = arr[:, 0], arr[:, 1], arr[:, 2]
        region = loff >> REGION_SHIFT
        if region.any():  # ranges in several landing regions: each region's base and size
            bufs = self.regions.bufs
            bases = np.array([int(b.data_ptr()) if b is not None else 0 for b in bufs], dtype=np.int64)
            caps = np.array([b.numel() if b is not None else -1 for b in bufs], dtype=np.int64)
            known = (region >= 0) & (region < len(bufs))
            k = np.where(known, region, 0)
            lo = loff & REGION_MASK
            outside = ~known | (lo + n > np.where(known, caps[k], -1))
            laddr = bases[k] + lo
        else:
            outside = loff + n > cap
            laddr = loff + lbase
        bad = (roff < 0) | (n <= 0) | (roff + n > self._size) | (loff < 0) | outside
        if bad.any():
            k0 = int(np.flatnonzero(bad)[0])
            r, lo0, m = (int(x) for x in arr[k0])
            raise E.DescriptorError(
                f"range remote[{r}:{r + m}] -> landing[{lo0}:{lo0 + m}] is outside the pool ({self._size} bytes) or "
                f"the landing buffer ({cap} bytes)"
            )
        local = np.zeros_like(arr)
        local[:, 0] = laddr
        local[:, 1] = n
        remote = np.zeros_like(arr)
        remote[:, 0] = roff + self._base
        remote[:, 1] = n
        return local, remote

    def _read_raw(self, local: Any, remote: Any, deadline: float) -> None:
        """READ absolute address ranges (no range checks: tests use it to prove NIXL's own checks map)."""
        posted = self._post(local, remote)
        try:
            if posted.state != "DONE":
                self._wait(posted.handle, deadline, SPIN_S, local)
        finally:
            self._release(posted.handle)  # done: frees the handle; at the deadline: NIXL's attempt to cancel it

    def _post(self, local: Any, remote: Any) -> PostedRead:
        """Make and post one READ request, with no notification (the release goes over the control plane): its
        NIXL handle and the state ``transfer`` returned (the handle is released here when posting fails)."""
        agent = self._agent
        handle = None
        try:
            ldesc = agent.get_xfer_descs(local, "DRAM")
            rdesc = agent.get_xfer_descs(remote, "DRAM")
            handle = agent.initialize_xfer("READ", ldesc, rdesc, self._remote, b"")
            state = agent.transfer(handle)
        except Exception as e:
            if handle is not None:
                self._release(handle)
            raise _translate(e, "READ") from None
        if state not in ("DONE", "PROC"):
            self._release(handle)
            raise E.TransportError(f"NIXL READ failed as it was posted (state {state!r}); see the NIXL log lines above")
        return PostedRead(handle, state)

    def _wait(self, handle: Any, deadline: float, spin_s: float, local: Any) -> None:
        """Poll ``handle`` until it is done, failed (a named error) or past the deadline (it is not released)."""
        agent = self._agent
        try:
            state = agent.check_xfer_state(handle)
            spin_until = time.monotonic() + spin_s
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    what = f"of {sum(int(d[1]) for d in local)} bytes " if local is not None else ""
                    raise E.ExportTimeoutError(
                        f"NIXL READ {what}still in progress at its deadline; the producer may be stalled (is its "
                        "pump running?) or the network down"
                    )
                if now > spin_until:  # a long transfer: poll without burning the core
                    time.sleep(50e-6)
                state = agent.check_xfer_state(handle)
        except E.ExportError:
            raise
        except Exception as e:
            raise _translate(e, "READ") from None
        if state != "DONE":
            raise E.TransportError(f"NIXL READ ended in state {state!r}")

    @property
    def remote_base(self) -> int:
        return self._base

    def close(self) -> None:
        self.detach()
        for k in list(self._region_regs):
            self.drop_region(k)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            log.debug("NIXL deregistration failed: %s", e)


def describe_nixl(ucx: UcxSettings | None = None, create_agent: bool = True) -> dict[str, Any]:
    """What this host's NIXL can do, for ``vllm-hs-compat doctor``: ``importable`` (and ``module``), the installed
    ``packages`` and their versions, ``plugins`` (the backend plugins NIXL found), whether an agent with the UCX
    backend starts (``ucx_agent``; ``error`` says why not) and the ``ucx_env`` in effect.  Never raises."""
    import importlib.metadata

    packages: dict[str, str] = {}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            packages[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    out: dict[str, Any] = {
        "importable": nixl_available(),
        "module": next((m for m in NIXL_MODULES if _findable(m)), None),
        "packages": packages,
        "plugins": [],
        "ucx_agent": False,
        "error": None,
    }
    if not out["importable"]:
        out["error"] = f"no NIXL package; install the lean way: {LEAN_INSTALL}"
    elif create_agent:
        try:
            api = _load(ucx or UcxSettings())
            agent = _agent(api, f"hsx-doctor-{uuid.uuid4().hex[:8]}")
            out["plugins"] = sorted(str(p) for p in agent.get_plugin_list())
            out["backends"] = sorted(str(b) for b in getattr(agent, "backends", {}))
            out["ucx_agent"] = "UCX" in out["backends"]
        except Exception as e:  # a doctor reports, it does not fail
            out["error"] = f"{type(e).__name__}: {e}"
    out["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return out
