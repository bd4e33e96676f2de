"""Garbage from the network fails with our named errors only, and never takes a server down."""

from __future__ import annotations

import copy
import socket
import time
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_hs_compat import errors as E
from vllm_hs_compat.core.records import RecordMeta
from vllm_hs_compat.errors import RecordFormatError
from vllm_hs_compat.export import protocol as P
from vllm_hs_compat.export.consumer import Claim
from vllm_hs_compat.export.control import Call, ControlClient, ControlServer

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=30,
)
OPS = ["hello", "ping", "claim", "claim_next", "release", "read", "stats", "x"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_of_random_bytes_raises_only_protocol_error(body: bytes) -> None:
    for decode in (P.decode_request, P.decode_reply, P.decode_descriptor):
        try:
            decode(body)
        except E.ProtocolError:
            pass
    assert P.decode_lease_ref(body) is None or isinstance(P.decode_lease_ref(body), P.LeaseRef)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(OPS), st.dictionaries(st.text(max_size=12), plain, max_size=6))
def test_random_requests_decode_to_a_valid_struct_or_a_protocol_error(op: str, fields: dict[str, Any]) -> None:
    try:
        req = P.decode_request(msgspec.msgpack.encode({"op": op, **fields}))
    except E.ProtocolError:
        return
    assert P.decode_request(P.encode(req)) == req  # whatever passed is exactly a schema value


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from([*RecordMeta.__struct_fields__, "request_id", "metadata", "x"]), plain, max_size=12)
)
def test_random_metadata_maps_raise_only_record_format_error(d: dict[str, Any]) -> None:
    try:
        RecordMeta.from_dict(d)
    except RecordFormatError:
        pass


#: values of each metadata field, valid and not, alone and in relation to the others (lengths, order, ranges)
META_FIELDS = {
    "record_id": ["r", "", "x" * 513],
    "token_ids": [[1, 2], [], [1], [7, -1], [1, 2**32]],
    "layer_ids": [[0, 3], [3, 0], [3, 3], [5], [0, 2**20 + 1]],
    "pre_norm": [True, False, 1],
    "dtype": ["bfloat16", "uint8", "complex64"],
    "shape": [[2, 2, 8], [2, 2, 1], [0, 2, 8], [2, 2], [2, 4097, 8]],
    "checksum": [None, 0, 2**64 - 1, -1],
    "checksum_algorithm": ["xxh3_64", "crc32", "md5"],
    "vllm_version": ["", "0.32.0", "v" * 65],
    "start": [0, 2, -1],
    "num_prompt_tokens": [0, 5],
    "sample_id": ["", "s"],
    "source": ["", "d:1"],
    "loss_mask_spans": [None, [], [[2, 3]], [[3, 2]], [[2, 3], [2, 4]], [[0, 1]], [[2, 4]]],
    "metadata_json": ["{}", '{"a":1}', '{"a": 1}', "[]"],
    "schema_version": [2, 1, 3],
}


@st.composite
def _metas(draw: st.DrawFn) -> dict[str, Any]:
    """A valid record's fields (the first value of each) with up to three of them drawn from their lists."""
    d = {k: v[0] for k, v in META_FIELDS.items()}
    for k in draw(st.lists(st.sampled_from(list(META_FIELDS)), max_size=3, unique=True)):
        d[k] = draw(st.sampled_from(META_FIELDS[k]))
    return d


@settings(max_examples=400, deadline=None)
@given(_metas())
def test_metadata_is_validated_once_and_the_same_way_decoded_or_built(d: dict[str, Any]) -> None:
    """The wire decoder (decode_typed: types and bounds checked by msgspec, then the one pass with only the fields'
    relations left), msgspec's decoder alone (the whole pass in Python after it) and a RecordMeta built in Python
    accept and refuse the same values as the whole pass run alone on the raw values, name the same first fault and
    make the same value.  Both sides are drawn: the unchanged record is accepted, most single changes are refused
    (the control: a typed entry that skipped a relation accepts what the others refuse)."""
    from vllm_hs_compat.core.records import decode_typed

    # the reference: the whole pass (RecordMeta.validate, typed=False) run alone on these values
    probe = copy.copy(RecordMeta("r", (1,), (0,), True, "uint8", (1, 1, 1)))  # (a copy runs no __post_init__)
    for k, v in d.items():
        msgspec.structs.force_setattr(probe, k, tuple(v) if k in ("token_ids", "layer_ids", "shape") else v)
    try:
        probe.validate()
        named = None
    except RecordFormatError as e:
        named = str(e)
    valid = named is None
    raw = msgspec.msgpack.encode(d)
    made = []
    for make in (
        lambda: decode_typed(msgspec.msgpack.Decoder(RecordMeta), raw),
        lambda: msgspec.msgpack.decode(raw, type=RecordMeta),
        lambda: RecordMeta(**d),
    ):
        try:
            made.append(make())
        except msgspec.ValidationError:  # the decoder's own bounds (a typed entry never gets these values)
            made.append(None)
        except RecordFormatError as e:
            assert str(e) == named, (str(e), named)  # the pass names the same fault whichever entry ran it
            made.append(None)
    assert made[0] == made[1] == made[2], made
    assert (made[2] is not None) == valid, (made, valid)


def test_the_one_pass_reads_the_fields_in_their_declared_order() -> None:
    """check_meta unpacks RecordMeta's fields as one tuple, by position: its list is the struct's."""
    from vllm_hs_compat.core.record_checks import FIELDS

    assert RecordMeta.__struct_fields__ == FIELDS


@settings(max_examples=200, deadline=None)
@given(plain)
def test_random_descriptors_raise_only_named_errors(d: Any) -> None:
    meta = RecordMeta("r", (1,), (0,), True, "uint8", (1, 1, 8), checksum=3)
    good = msgspec.to_builtins(
        P.RecordDesc(1, "ab" * 8, 0, 8, 8, 12, 5, "ab", meta.without_token_ids()), builtin_types=(bytes,)
    )
    assert Claim.parse(good).extent == 12
    for cand in (d, {**good, "meta": d}, {**good, "offset": d}, {**good, "nbytes": d}, {**good, "extent": d}):
        for form in (cand, msgspec.msgpack.encode(cand)):
            try:
                Claim.parse(form)
            except (E.ProtocolError, RecordFormatError):
                pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=4), st.binary(max_size=64))
def test_server_survives_random_bytes_before_and_after_the_handshake(chunks: list[bytes], body: bytes) -> None:
    srv = _SERVER
    host, port = srv.address
    s = socket.create_connection((host, port), timeout=2)  # raw TCP: not even the ZMTP greeting
    try:
        for ch in chunks:
            s.sendall(ch)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(2)
        while s.recv(4096):
            pass
    except OSError:
        pass
    finally:
        s.close()
    c = ControlClient(srv.endpoint, TOKEN, timeout_s=5)  # authenticated, then garbage in well-formed frames
    try:
        for frames in ([P.HEADER, P.new_rid(), body], [P.HEADER, body], [body], [P.HEADER, P.new_rid(), body, body]):
            c._sock.send_multipart(frames)
        ok = c.call(P.PingReq())[0]  # still serving
        assert isinstance(ok, P.PongReply)
    finally:
        c.close()


TOKEN = "f" * 24


def _handler(req: P.Request, call: Call) -> P.Reply:
    if isinstance(req, P.PingReq):
        return P.PongReply("ab")
    raise E.ProtocolError(f"unsupported here: {type(req).__name__}")


_SERVER = ControlServer(_handler, TOKEN, producer="ab", handshake_timeout_s=1.0)


def teardown_module() -> None:
    _SERVER.close()
    time.sleep(0)
