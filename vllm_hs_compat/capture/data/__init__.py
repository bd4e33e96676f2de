"""Data files shipped with the package for the tiny local model (:mod:`vllm_hs_compat.reference.models`).

* :data:`TINY_CHAT_TEMPLATE` -- a chat template with ``{% generation %}`` markers; :func:`make_tokenizer
  <vllm_hs_compat.reference.models.make_tokenizer>` saves it as the tiny tokenizer's own ``chat_template``;
* :data:`CONVERSATIONS` -- a small multi-turn conversation set (OpenAI ``messages`` rows with ids), written for it.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: The tiny tokenizer's chat template (Jinja, with generation markers around each assistant turn).
TINY_CHAT_TEMPLATE: Path = _HERE / "tiny_chat_template.jinja"
#: The conversation set (JSONL, one ``{"id", "messages", "metadata"}`` row per line).
CONVERSATIONS: Path = _HERE / "conversations.jsonl"


def tiny_chat_template() -> str:
    """The text of :data:`TINY_CHAT_TEMPLATE`."""
    return TINY_CHAT_TEMPLATE.read_text(encoding="utf-8")
