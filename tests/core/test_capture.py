"""Which positions a record holds, block tracking through scheduler steps, and the connector's config."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_hs_compat.connector.config import ConnectorConfig
from vllm_hs_compat.core.capture import (
    BlockTracker,
    CaptureSpec,
    NoRecord,
    ScheduledCached,
    ScheduledNew,
    StepInfo,
)
from vllm_hs_compat.core.vocabulary import REASON_DISABLED, REASON_EMPTY, REASON_PROMPT_INCOMPLETE
from vllm_hs_compat.errors import CaptureConfigError

bounds = st.one_of(st.none(), st.integers(-300, 300))


@given(
    mode=st.sampled_from(["prompt", "all", "output"]),
    window=st.one_of(st.none(), st.tuples(bounds, bounds)),
    prompt=st.integers(1, 200),
    extra=st.integers(-200, 200),
)
def test_positions_are_the_slice_of_the_selected_range(
    mode: str, window: tuple[int | None, int | None] | None, prompt: int, extra: int
) -> None:
    valid = max(0, prompt + extra)
    spec = CaptureSpec.parse({"capture": mode, "window": list(window) if window else None}, what="t")
    base = {"prompt": range(prompt), "all": range(valid), "output": range(prompt, max(prompt, valid))}[mode]
    want = list(base[slice(*window)] if window else base)
    if mode == "prompt" and valid < prompt:
        with pytest.raises(NoRecord) as e:
            spec.positions(num_prompt_tokens=prompt, num_valid=valid)
        assert e.value.reason == REASON_PROMPT_INCOMPLETE
        return
    if not want:
        with pytest.raises(NoRecord) as e:
            spec.positions(num_prompt_tokens=prompt, num_valid=valid)
        assert e.value.reason == REASON_EMPTY
        return
    lo, hi = spec.positions(num_prompt_tokens=prompt, num_valid=valid)
    assert list(range(lo, hi)) == want
    assert hi <= valid


def test_disabled_and_bad_settings_are_named() -> None:
    off = CaptureSpec.parse({"enabled": False}, what="req")
    with pytest.raises(NoRecord) as e:
        off.positions(num_prompt_tokens=3, num_valid=3)
    assert e.value.reason == REASON_DISABLED
    for bad, text in (
        ({"capture": "everything"}, "capture must be one of"),
        ({"window": [0]}, "window must be"),
        ({"window": ["a", 1]}, r"window\[0\] must be an int"),
        ({"enabled": "yes"}, "enabled must be"),
        ({"mode": "all"}, "unknown keys"),
    ):
        with pytest.raises(CaptureConfigError, match=text):
            CaptureSpec.parse(bad, what="req")
    base = CaptureSpec.parse({"capture": "all", "window": [-8, None]}, what="cfg")
    over = CaptureSpec.parse({"window": None}, base=base, what="req")
    assert over.mode == "all" and over.window is None


def test_connector_config_validates_every_key() -> None:
    cfg = ConnectorConfig.from_extra({"capture": "output", "window": [0, 64], "sink": "file", "file": {"path": "/x"}})
    assert cfg.capture.mode == "output" and cfg.capture.window == (0, 64) and cfg.file_path == "/x"
    assert ConnectorConfig.from_extra({}).sink == "export"
    for bad, text in (
        ({"sinks": "file"}, "unknown keys"),
        ({"sink": "s3"}, '"sink" must be one of'),
        ({"sink": "file"}, "needs"),
        ({"sink": "callback"}, "needs"),
        ({"callback": "nocolon"}, "module:function"),
        ({"export": {"bakend": "shm"}}, '"export" has unknown keys'),
        ({"check_requests": -1}, "check_requests"),
    ):
        with pytest.raises(CaptureConfigError, match=text):
            ConnectorConfig.from_extra(bad)


def test_every_export_key_is_an_export_producer_argument() -> None:
    """The connector forwards ``export`` settings to ExportProducer (``token_file`` is the sink's own): each key is
    a field of the ExportSettings the producer takes (as the object, or field by field as keywords)."""
    import dataclasses
    import inspect

    from vllm_hs_compat.connector.config import export_keys
    from vllm_hs_compat.export import ExportProducer, ExportSettings

    keys = export_keys() - {"token_file"}
    assert "settings" in inspect.signature(ExportProducer).parameters
    defaults = ExportSettings()
    assert dataclasses.replace(defaults, **{k: getattr(defaults, k) for k in keys}) == defaults  # every key a field
    assert ConnectorConfig.from_extra({"export": {"handshake_timeout_s": 2.0}}).export["handshake_timeout_s"] == 2.0


def _new(rid: str, *blocks: int, computed: int = 0) -> ScheduledNew:
    return ScheduledNew(rid, ((99,), tuple(blocks)), computed)


def _cached(rid: str, *blocks: int, resumed: bool = False) -> ScheduledCached:
    return ScheduledCached(rid, ((99,), tuple(blocks)) if blocks or resumed else None, resumed, 0)


def _step(
    new: tuple[ScheduledNew, ...] = (), cached: tuple[ScheduledCached, ...] = (), **kw: frozenset[str]
) -> StepInfo:
    return StepInfo(new=new, cached=cached, num_scheduled_tokens={}, **kw)


def test_block_tracker_follows_appends_preemption_resumption_and_finish() -> None:
    t = BlockTracker(group_index=1)
    t.watch(_new("a", 3, 4))
    t.apply(_step(new=(_new("a", 3, 4), _new("b", 7))))  # b is not watched
    assert t.blocks("a") == (3, 4) and "b" not in t
    t.apply(_step(cached=(_cached("a", 9),)))
    assert t.blocks("a") == (3, 4, 9)
    t.apply(_step(cached=(_cached("a"),)))  # scheduled, no new block
    assert t.blocks("a") == (3, 4, 9)
    t.apply(_step(preempted=frozenset({"a"})))
    assert "a" in t and t.blocks("a") == ()
    t.apply(_step(cached=(_cached("a", 5, 6, resumed=True),)))  # V1: resumed with its full list
    assert t.blocks("a") == (5, 6)
    t.apply(_step(preempted=frozenset({"a"})))
    t.apply(_step(new=(_new("a", 8, 2),)))  # V2: resumed as a new request
    assert t.blocks("a") == (8, 2)
    t.apply(_step(finished=frozenset({"a"})))
    assert "a" not in t and len(t) == 0
    with pytest.raises(CaptureConfigError, match="in group 3"):
        BlockTracker(group_index=3).watch(_new("c", 1))
