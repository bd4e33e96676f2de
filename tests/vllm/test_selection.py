"""Adapter selection against the installed vLLM: range, probes, override, doctor."""

from __future__ import annotations

import json
import logging
import os

import pytest
from packaging.version import Version

from vllm_hs_compat import adapters
from vllm_hs_compat.cli import main as cli_main
from vllm_hs_compat.errors import AdapterProbeMismatchError


def _installed() -> Version:
    return Version(Version(adapters.installed_vllm_version()).base_version)


def test_selected_adapter_is_the_era_of_the_installed_release_and_every_probe_agrees() -> None:
    release = os.environ.get("VLLM_HS_COMPAT_RELEASE")
    if release is not None:  # set by the nox session: the install is the release we asked for
        assert _installed() == Version(release)
    adapter = adapters.select_adapter(adapters.installed_vllm_version(), None)
    # a release newer than every era (nox -s vllm_newest on a day-one release) gets the newest era's adapter, untested
    assert _installed() in adapter.versions or (adapter.untested and adapter.name == adapters.ADAPTERS[-1].name)
    results = adapter.run_probes()
    assert [r.name for r in results if not r.ok] == []
    assert len(results) >= 9


def test_wrong_override_is_refused_naming_the_contradicting_facts() -> None:
    right = adapters.select_adapter(adapters.installed_vllm_version(), None)
    for wrong in (a.name for a in adapters.ADAPTERS if a.name != right.name):
        with pytest.raises(AdapterProbeMismatchError) as err:
            adapters.select_adapter(adapters.installed_vllm_version(), wrong)
        msg = str(err.value)
        assert wrong in msg and "expected" in msg and "observed" in msg and adapters.OVERRIDE_ENV in msg


def test_matching_override_is_accepted() -> None:
    right = adapters.select_adapter(adapters.installed_vllm_version(), None)
    assert adapters.select_adapter(adapters.installed_vllm_version(), right.name).name == right.name


def test_doctor_reports_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["vllm"] == adapters.installed_vllm_version()
    assert all(p["ok"] for p in report["probes"])


def _newer_release() -> str:
    """A release past every era (as if published after this package): the first minor after the supported range."""
    from vllm_hs_compat import releases

    return releases.ERAS[-1][2]


def _facts_a_newer_release_would_differ_in() -> list[str]:
    """The probes on which the installed release (its facts confirmed by its own adapter, test above) differs from
    what the newest era's adapter expects of a release past every era: none on the newest tested release."""
    from vllm_hs_compat.adapters.base import PROBES

    installed = adapters.select_adapter(adapters.installed_vllm_version(), None)
    newest = adapters.ADAPTERS[-1](Version(_newer_release()), untested=True)
    return [p.name for p in PROBES if getattr(installed, p.name) != getattr(newest, p.name)]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_newer_release_is_judged_by_its_facts_and_a_changed_fact_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed vLLM, claimed to be a release newer than every era: it runs with the newest era's adapter when
    every probe agrees (untested: a warning naming it, slot checks on every request), and is refused naming the one
    probe changed by hand (the negative control).  An older release has older facts: refused naming exactly those."""
    from vllm_hs_compat.adapters import base

    newer = _newer_release()
    differ = _facts_a_newer_release_would_differ_in()
    monkeypatch.delenv(adapters.UNTESTED_ENV, raising=False)
    capture = _Capture()
    logger = logging.getLogger("vllm.vllm_hs_compat.adapters")
    logger.addHandler(capture)
    try:
        if not differ:
            adapter = adapters.select_adapter(newer, None)
            assert adapter.untested and adapter.check_every_request and adapter.name == adapters.ADAPTERS[-1].name
            assert any(f"vLLM {newer} is UNTESTED" in m and "probes" in m for m in capture.messages), capture.messages
        else:
            with pytest.raises(AdapterProbeMismatchError, match="newer than every release") as old:
                adapters.select_adapter(newer, None)
            assert all(f"{name}: expected" in str(old.value) for name in differ), (differ, str(old.value))
            assert f"{len(differ)} of" in str(old.value)
    finally:
        logger.removeHandler(capture)
    # negative control: one more fact changed by hand, the rest as installed
    changed = base.Probe("resumed_field", "(changed by hand)", lambda: "resumed_from_preemption")
    monkeypatch.setattr(base, "PROBES", tuple(changed if p.name == changed.name else p for p in base.PROBES))
    with pytest.raises(AdapterProbeMismatchError) as err:
        adapters.select_adapter(newer, None)
    msg = str(err.value)
    assert f"vLLM {newer} is newer than every release" in msg
    assert "resumed_field: expected" in msg and "observed 'resumed_from_preemption'" in msg
    assert f"{len(set(differ) | {'resumed_field'})} of" in msg


def test_doctor_runs_a_newer_release_with_the_warning_and_refuses_a_changed_fact(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installed vLLM claimed to be newer than every era: exit 0 with the warning where its facts are what the
    newest era's adapter expects, exit 1 naming the others; the strict switch refuses it by its number; a fact
    changed by hand is refused by name."""
    from vllm_hs_compat.adapters import base

    newer = _newer_release()
    runs = not _facts_a_newer_release_would_differ_in()
    monkeypatch.delenv(adapters.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(adapters, "installed_vllm_version", lambda: newer)
    capsys.readouterr()
    assert cli_main(["doctor", "--json", "--no-nixl-agent"]) == (0 if runs else 1)
    report = json.loads(capsys.readouterr().out)
    assert report["untested"] is True and report["ok"] is runs
    if runs:
        assert newer in report["warning"]
        assert cli_main(["doctor", "--no-nixl-agent"]) == 0
        assert f"WARNING: vLLM {newer} is UNTESTED" in capsys.readouterr().out
    monkeypatch.setenv(adapters.UNTESTED_ENV, "refuse")  # the strict switch: refused by its number
    assert cli_main(["doctor", "--no-nixl-agent"]) == 1
    assert f"{adapters.UNTESTED_ENV}=refuse" in capsys.readouterr().out
    monkeypatch.delenv(adapters.UNTESTED_ENV)
    changed = base.Probe("v1_runner", "(changed by hand)", lambda: True)
    monkeypatch.setattr(base, "PROBES", tuple(changed if p.name == changed.name else p for p in base.PROBES))
    assert cli_main(["doctor", "--no-nixl-agent"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  v1_runner  expected False, observed True" in out and "refused" in out
