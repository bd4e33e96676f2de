"""ExportSettings is the producer's settings, not a copy kept by hand: the producer takes the object (or its fields
as keywords, nothing else), the connector's ``"export"`` keys are its fields, and every one of them -- the nested
UCX and control-plane limits included -- reaches a producer started from vLLM's config."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vllm_hs_compat.connector.config import check_kv_transfer_config, export_keys
from vllm_hs_compat.connector.sinks import ExportSink
from vllm_hs_compat.errors import CaptureConfigError, ExportConfigError
from vllm_hs_compat.export import ExportProducer
from vllm_hs_compat.export.control import ControlLimits
from vllm_hs_compat.export.nixl_backend import UcxSettings
from vllm_hs_compat.export.settings import ExportSettings

#: a value other than the default for fields a test producer can take (shm, loopback)
CHANGED: dict[str, Any] = {
    "num_slots": 3,
    "slot_bytes": 8192,
    "lease_ttl_s": 7.0,
    "claimed_spin_s": 0.25,
    "plain_port": None,
}


def test_the_producer_takes_its_settings_or_their_fields_as_keywords() -> None:
    """The settings object and the same fields as keywords make the same producer; keywords apply over an object;
    the connector's keys are the fields."""
    settings = ExportSettings(backend="shm", **CHANGED)
    with ExportProducer(settings) as a, ExportProducer(backend="shm", **CHANGED) as b:
        assert a.settings == b.settings == settings
        assert (a.pool.num_slots, a.pool.slot_bytes, a.plain_endpoint) == (3, 8192, None)
    with ExportProducer(settings, num_slots=5) as c:
        assert c.settings == dataclasses.replace(settings, num_slots=5) and c.pool.num_slots == 5
    assert export_keys() == {f.name for f in dataclasses.fields(ExportSettings)} | {"token_file"}


def test_a_keyword_that_is_no_setting_is_refused() -> None:
    """Negative control: a keyword the settings type does not have never reaches a producer."""
    with pytest.raises(TypeError, match="num_slot"):
        ExportProducer(backend="shm", num_slot=4)


def test_nested_settings_come_from_maps_and_are_checked() -> None:
    s = ExportSettings.from_options(
        {"ucx": {"tls": "tcp", "tcp_seg_size": "64k"}, "control_limits": {"max_inflight": 8}, "direct_port": None}
    )
    assert s.ucx == UcxSettings(tls="tcp", tcp_seg_size="64k") and s.control_limits == ControlLimits(max_inflight=8)
    for bad, words in [
        ({"ucx": {"tsl": "tcp"}}, ["ucx", "'tsl'", "tls"]),
        ({"ucx": {"tls": 5}}, ["UCX strings", "5"]),
        ({"control_limits": {"max_inflight": 0}}, ["max_inflight", "[1, 65536]"]),
        ({"control_limits": "lots"}, ["control_limits", "JSON object"]),
        ({"direct_port": 70000}, ['"direct_port": 70000', "[0, 65535]"]),
        ({"plain_port": -1}, ['"plain_port": -1', "[0, 65535]"]),
        ({"claimed_spin_s": -1}, ['"claimed_spin_s": -1', ">= 0"]),
        ({"num_slot": 4}, ["unknown export settings", "'num_slot'"]),
    ]:
        with pytest.raises(ExportConfigError) as info:
            ExportSettings.from_options(bad)
        assert all(w in str(info.value) for w in words), (bad, str(info.value))


def test_the_connector_takes_every_setting_and_the_producer_gets_it(tmp_path: object) -> None:
    export = {
        "backend": "shm",
        "num_slots": 2,
        "slot_bytes": 4096,
        "direct_port": None,
        "plain_port": None,
        "claimed_spin_s": 0.25,
        "control_limits": {"max_inflight": 8, "reply_queue": 2},
        "token_file": str(tmp_path) + "/token",
    }
    kv = {"kv_connector": "HiddenStatesCaptureConnector", "kv_connector_extra_config": {"export": export}}
    assert check_kv_transfer_config(kv) is not None
    sink = ExportSink(export)
    try:
        p = sink.producer
        assert p._server.limits == ControlLimits(max_inflight=8, reply_queue=2)
        assert p.direct_endpoint is None  # "direct_port": null: no direct socket
        assert p.plain_endpoint is None  # "plain_port": null: no plain channel
    finally:
        sink.close()
    kv["kv_connector_extra_config"] = {"export": {**export, "control_limits": {"max_inflight": 0}}}
    with pytest.raises(CaptureConfigError, match='"export": control_limits: .*max_inflight'):
        check_kv_transfer_config(kv)
