"""``kv_connector_extra_config`` validation without an engine: every mistake a user can type is refused with
what was found, what was expected and how to fix it; every config the package itself writes passes (the negative
control: a checker that refused everything would fail here)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from vllm_hs_compat.commands.serve_args import extra_config
from vllm_hs_compat.connector.config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ConnectorConfig,
    check_kv_transfer_config,
    names_this_connector,
)
from vllm_hs_compat.errors import CaptureConfigError, HsCompatError


def _kv(extra: Any, **kw: Any) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer", "kv_connector_extra_config": extra, **kw}


BAD: list[tuple[dict[str, Any], list[str]]] = [
    ({"captur": "prompt"}, ["'captur'", "did you mean 'capture'", "expected any of", "--kv-transfer-config"]),
    ({"capture": "promt"}, ["'promt'", "prompt", "--kv-transfer-config"]),
    ({"sink": "files"}, ["'files'", "['export', 'file', 'callback']"]),
    ({"export": {"num_slot": 4}}, ["'num_slot'", "did you mean 'num_slots'"]),
    ({"export": {"num_slots": 0}}, ['"num_slots": 0', "int >= 1"]),
    ({"export": {"num_slots": "64"}}, ["'64'", "int >= 1"]),
    ({"export": {"slot_bytes": 1000}}, ["multiple of 64", "1024"]),
    ({"export": {"backend": "rdma"}}, ["'rdma'", "['auto', 'shm', 'nixl']"]),
    ({"export": {"on_full": "block"}}, ["'block'", "['drop', 'wait']"]),
    ({"export": {"shm_handoff": "socket"}}, ["'socket'", "['fd', 'path']"]),
    ({"export": {"port": 70000}}, ["70000", "[0, 65535]"]),
    ({"export": {"lease_ttl_s": -1}}, ["-1", "> 0"]),
    ({"export": {"ready_ttl_s": math.nan}}, ["nan", "or null"]),
    ({"export": {"host": ""}}, ["non-empty string"]),
    ({"export": {"checksum": "md5"}}, ["'md5'", "xxh3_64"]),
    ({"export": ["backend", "shm"]}, ['"export" must be a JSON object', "list"]),
    ({"sink": "file"}, ['"file" needs', '"path"']),
    ({"sink": "callback"}, ['"callback" needs', "module:function"]),
    ({"callback": "no_colon"}, ["'no_colon'", "module:function"]),
    ({"check_requests": -2}, ["-2", "int >= 0"]),
    ({"window": "all of it"}, ["window", "--kv-transfer-config"]),
    ({"read": {"path": "gpu"}}, ['"read".path', "'gpu'", "['staged', 'direct']", "--kv-transfer-config"]),
    ({"read": {"lone_read": False}}, ["'lone_read'", "lone_reads", "--kv-transfer-config"]),
    ({"read": {"lone_reads": "no"}}, ['"read".lone_reads', "true or false", "'no'"]),
    ({"read": "direct"}, ['"read" must be a JSON object', "'direct'"]),
    ({"self_test": {"corrupt_record": -1}}, ['"self_test"', "corrupt_record", "-1"]),
    ({"self_test": {"corrupt_record": True}}, ['"self_test"', "True"]),
    ({"self_test": {"corrupt": 3}}, ['"self_test"', "'corrupt'"]),
    ({"self_test": 3}, ['"self_test" must be', "3"]),
]


@pytest.mark.parametrize(("extra", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_mistake_is_refused_with_what_and_how(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(CaptureConfigError) as info:
        check_kv_transfer_config(_kv(extra))
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("sink", ["export", "file", "callback"])
@pytest.mark.parametrize("capture", ["prompt", "all", "output"])
def test_what_serve_args_writes_passes(sink: str, capture: str, tmp_path: Any) -> None:
    args = argparse.Namespace(
        capture=capture,
        sink=sink,
        backend="shm",
        export_host="0.0.0.0",
        export_port=5555,
        advertise_host="10.0.0.2",
        file_path=str(tmp_path / "records"),
        callback="json:dumps",
    )
    config = check_kv_transfer_config(_kv(extra_config(args)))
    assert config is not None and config.sink == sink and config.capture.mode == capture


def test_every_export_option_at_a_good_value_passes() -> None:
    export = {
        "backend": "nixl",
        "num_slots": 8,
        "slot_bytes": 1 << 20,
        "lease_ttl_s": 30,
        "ready_ttl_s": None,
        "on_full": "wait",
        "wait_timeout_s": 0,
        "host": "0.0.0.0",
        "port": 0,
        "advertise_host": None,
        "checksum": "crc32",
        "shm_dir": "/dev/shm",
        "token_file": "/tmp/t",
        "handshake_timeout_s": 2.5,
        "max_redeliveries": 0,
        "shm_handoff": "path",
    }
    config = ConnectorConfig.from_extra({"export": export, "check_requests": 0})
    assert dict(config.export) == export


def test_only_this_connector_is_checked() -> None:
    bad = {"captur": 1}
    assert check_kv_transfer_config(None) is None
    assert check_kv_transfer_config({"kv_connector": "NixlConnector", "kv_connector_extra_config": bad}) is None
    other_module = _kv(bad, kv_connector_module_path="my_pkg.connector")
    assert not names_this_connector(other_module) and check_kv_transfer_config(other_module) is None
    assert names_this_connector(_kv(bad, kv_connector_module_path=CONNECTOR_MODULE))

    class Kv:  # vLLM's KVTransferConfig is read by attribute
        kv_connector = CONNECTOR_NAME
        kv_connector_module_path = None
        kv_connector_extra_config = bad

    with pytest.raises(CaptureConfigError, match="captur"):
        check_kv_transfer_config(Kv())
    assert check_kv_transfer_config(_kv(None)) is not None  # no extra config: every default


def test_a_file_path_that_is_a_file_is_refused(tmp_path: Any) -> None:
    f = tmp_path / "plain"
    f.write_text("x")
    with pytest.raises(CaptureConfigError, match="not a directory"):
        check_kv_transfer_config(_kv({"sink": "file", "file": {"path": str(f)}}))
    assert check_kv_transfer_config(_kv({"sink": "file", "file": {"path": str(tmp_path / "new")}})) is not None


def test_a_callback_module_that_cannot_be_found_is_refused() -> None:
    with pytest.raises(CaptureConfigError, match="'no_such_module_hs' cannot be found"):
        check_kv_transfer_config(_kv({"sink": "callback", "callback": "no_such_module_hs:f"}))
    assert check_kv_transfer_config(_kv({"sink": "callback", "callback": "json:dumps"})) is not None


def test_a_malformed_token_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HS_COMPAT_EXPORT_TOKEN", "short")
    with pytest.raises(HsCompatError, match="at least"):
        check_kv_transfer_config(_kv({}))
    monkeypatch.setenv("VLLM_HS_COMPAT_EXPORT_TOKEN", "x" * 32)
    assert check_kv_transfer_config(_kv({})) is not None


def test_read_options_come_from_the_config_over_the_environment_read_at_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"read"`` keys win; a key left out takes its variable's value when the config is parsed (never at import),
    and no ``"read"`` at all leaves the choice to the worker's start (``None``)."""
    from vllm_hs_compat.core.transfer import ReadOptions

    config = check_kv_transfer_config(_kv({"read": {"path": "direct"}}))
    assert config is not None and config.read == ReadOptions(path="direct", lone_reads=True, lone_chunks=True)
    monkeypatch.setenv("VLLM_HS_COMPAT_LONE_READ", "0")
    monkeypatch.setenv("VLLM_HS_COMPAT_CAPTURE_PATH", "direct")
    config = check_kv_transfer_config(_kv({"read": {"lone_chunks": False}}))
    assert config is not None and config.read == ReadOptions(path="direct", lone_reads=False, lone_chunks=False)
    assert ReadOptions.from_env() == ReadOptions(path="direct", lone_reads=False, lone_chunks=True)
    plain = check_kv_transfer_config(_kv({}))
    assert plain is not None and plain.read is None
    monkeypatch.setenv("VLLM_HS_COMPAT_CAPTURE_PATH", "dirct")
    with pytest.raises(HsCompatError, match="VLLM_HS_COMPAT_CAPTURE_PATH='dirct'"):
        ReadOptions.from_env()


def test_a_row_reader_takes_its_options_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from vllm_hs_compat.core.layout import ViewOrder, describe_capture_view
    from vllm_hs_compat.core.transfer import ReadOptions, RowReader

    cache = torch.zeros(4, 16, 2, 8)
    view = describe_capture_view(cache, num_planes=2, group_block_size=16, order=ViewOrder.BLOCK_TOKEN_PLANE)
    monkeypatch.setenv("VLLM_HS_COMPAT_LONE_READ", "0")
    assert RowReader(cache, view).options == ReadOptions(lone_reads=False)
    monkeypatch.delenv("VLLM_HS_COMPAT_LONE_READ")
    assert RowReader(cache, view).options == ReadOptions()
    assert RowReader(cache, view, path="direct", options=ReadOptions(lone_chunks=False)).options == ReadOptions(
        path="direct", lone_chunks=False
    )
