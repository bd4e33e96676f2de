"""Adapter selection against the installed vLLM: range, probes, override, doctor."""

from __future__ import annotations

import json
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
    assert _installed() in adapter.versions
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
