"""The fact behind the ``async_drafts`` refusal, against vLLM's own code per release.

Model Runner V1 under async scheduling moves a request's next positions back by the drafts it believes rejected,
counting the tokens each step emitted with the proposer's ``prepare_next_token_ids_padded``.  Its
``extract_hidden_states`` proposer reads only the first column (vllm-project/vllm#56417): a step that emitted two
tokens is counted as one, and the request's later positions run one place short -- the rows an H100 showed off
(docs/gpu.md).  The adapter runs that method itself; these tests run it on each release's code."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_hs_compat import api

pytestmark = pytest.mark.vllm


def _config(async_scheduling: bool, v2: bool = False) -> Any:
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling), use_v2_model_runner=v2)


def test_the_v1_proposer_counts_one_token_for_a_step_that_emitted_two() -> None:
    adapter = api.get_adapter()
    if not adapter.v1_runner:  # 0.34.0+: Model Runner V1 and its proposer are gone
        assert adapter.v1_draft_feedback() is None
        assert adapter.async_drafts_misplace_rows(_config(True)) is None
        return
    assert adapter.v1_draft_feedback() == 1
    why = adapter.async_drafts_misplace_rows(_config(True))
    assert why is not None and "#56417" in why and "counts one token" in why
    # controls: synchronous scheduling, and Model Runner V2 (it counts the tokens its rejection sampler kept)
    assert adapter.async_drafts_misplace_rows(_config(False)) is None
    assert adapter.async_drafts_misplace_rows(_config(True, v2=True)) is None


def test_a_proposer_that_counts_every_emitted_token_clears_the_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the same method counting every valid column (what the upstream fix does) is observed as 2, and
    the adapter no longer refuses anything -- the check reads behaviour, not the release number."""
    adapter = api.get_adapter()
    if not adapter.v1_runner:
        pytest.skip("no Model Runner V1 on this release")
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    def counts_every_column(self: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        sampled = kwargs["sampled_token_ids"]
        valid = (sampled >= 0).sum(dim=1).to(torch.int32)
        return sampled[:, -1].to(torch.int32), valid

    monkeypatch.setattr(ExtractHiddenStatesProposer, "prepare_next_token_ids_padded", counts_every_column)
    assert adapter.v1_draft_feedback() == 2
    assert adapter.async_drafts_misplace_rows(_config(True)) is None


def test_a_proposer_the_check_cannot_call_is_treated_as_misplacing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reworked method (a GPU kernel, new arguments) cannot be judged on this machine: the records past a
    two-token step still fail, and the reason says the check could not run."""
    adapter = api.get_adapter()
    if not adapter.v1_runner:
        pytest.skip("no Model Runner V1 on this release")
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    def needs_a_gpu(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(ExtractHiddenStatesProposer, "prepare_next_token_ids_padded", needs_a_gpu)
    assert adapter.v1_draft_feedback() is None
    why = adapter.async_drafts_misplace_rows(_config(True))
    assert why is not None and "could not be checked" in why
