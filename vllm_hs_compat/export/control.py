"""The export control plane on ZeroMQ: a CURVE ROUTER socket held by a supervised child process (the gate,
:mod:`vllm_hs_compat.export.gate`) and one serving thread in the producer (no thread per connection), DEALER
clients; messages are the typed structs of :mod:`vllm_hs_compat.export.protocol`.

Security (see docs/export.md, "Security model" and "Faults a peer can cause"):

* **CURVE** on every connection.  The producer's key pair is derived from the trainer token, so a trainer that
  holds the token knows the producer's public key and the producer proves it holds the token by completing the
  handshake (a process that grabbed a recycled port cannot).  A ticket carries the producer's *public* key for
  ticket holders.  Messages are encrypted and authenticated (the hidden states themselves move over the data
  transport, in clear).
* **Who is asking** is decided in the handshake by a ZAP handler in the gate: a client whose CURVE key is the
  one derived from the token is the ``trainer``; any other client that completes the handshake is a ``record``
  principal, which may only present a ticket's capability for one record.  Peers that do not complete the
  handshake within ``handshake_timeout_s`` never deliver a message; they are counted.
* **Bounded before allocation**: ``zmq.MAXMSGSIZE`` (32 KiB + the CURVE box) refuses a longer frame as soon as
  its header arrives; per connection, the gate bounds replies queued and requests in flight and drops a
  connection over either (:class:`ControlLimits`); replies never block (a reply that cannot be queued drops its
  connection, the client reconnects and retries by request id).  What libzmq cannot bound (the frames of a
  multipart message that never ends) is bounded by the gate's address-space limit: the gate dies, the producer
  restarts it, the model worker never notices.
* **The trainer's plain channel** (:mod:`vllm_hs_compat.export.plain`): the trainer's requests over a bare TCP
  connection served by the same thread, authenticated by a challenge-response on a token-derived key, not
  encrypted (it carries what the data plane carries); off with ``plain=False``.
* **Every message is survivable**: a body that fails decoding in any way (nesting, memory, types) is a
  ``protocol`` error to its sender; an exception while handling one request fails that request; a failure of the
  serving loop itself restarts it (``control_restarts``).

A long poll (``claim_next`` with ``wait_s``) is parked, not slept on: the handler answers ``None``, the request
waits in a bounded queue (and at most ``max_parked_per_peer`` per connection) and is retried when the producer
signals a publish (:meth:`ControlServer.wake`) or its deadline passes.

The modules, one job each: :mod:`~vllm_hs_compat.export.credentials` (the token, its file, every key derived from
it), :mod:`~vllm_hs_compat.export.server` (:class:`ControlServer`: the serving thread, the direct socket, the routes
of the gate's and the plain channel's requests), :mod:`~vllm_hs_compat.export.supervisor` (starts, watches and
restarts the gate), :mod:`~vllm_hs_compat.export.gate` (the gate process), :mod:`~vllm_hs_compat.export.client`
(:class:`ControlClient`), :mod:`~vllm_hs_compat.export.plain` (the trainer's plain channel, both sides),
:mod:`~vllm_hs_compat.export.protocol` (the messages, the error codes, the endpoints).  This module names them all,
for callers that import the control plane as one.
"""

from __future__ import annotations

from vllm_hs_compat.export.client import ControlClient, PostedRequests
from vllm_hs_compat.export.credentials import (
    MIN_TOKEN_CHARS,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    check_token,
    curve_keys,
    default_token_file,
    load_or_create_token,
    new_token,
    plain_key,
    read_token,
    server_key,
)
from vllm_hs_compat.export.protocol import ERROR_CODES, error_code, parse_endpoint
from vllm_hs_compat.export.server import Call, ControlLimits, ControlServer, Handler

__all__ = [
    "ERROR_CODES",
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Call",
    "ControlClient",
    "ControlLimits",
    "ControlServer",
    "Handler",
    "PostedRequests",
    "check_token",
    "curve_keys",
    "default_token_file",
    "error_code",
    "load_or_create_token",
    "new_token",
    "parse_endpoint",
    "plain_key",
    "read_token",
    "server_key",
]
