"""Tiny random-weight verifiers, made locally (no model hub): a dense Llama and a hybrid Llama whose layers
alternate sliding-window and full attention (per-layer ``layer_types``).

Both are saved with ``save_pretrained`` next to a byte-level BPE tokenizer trained with ``tokenizers`` and saved
through ``PreTrainedTokenizerFast``, so vLLM loads them like any local checkpoint.  The tokenizer carries the chat
template of :mod:`vllm_hs_compat.capture.data` (with ``{% generation %}`` markers).  The e2e tests, the engine
benchmark and ``vllm-hs-compat demo`` share this module.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_hs_compat.capture.data import tiny_chat_template
from vllm_hs_compat.errors import TinyModelError

# Geometry.  CPU attention needs head_dim >= 32; 4 verifier layers so the capture layer is
# ``cache_only_layers.4`` and layer id 4 is the pre-final-norm output.
HIDDEN = 64
NUM_LAYERS = 4
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 32
VOCAB = 512
MAX_POSITIONS = 4096
SLIDING_WINDOW = 48

#: The final norm's weight (every channel).  A fresh Llama's is 1, and the tiny model's pre-norm rows have an RMS of
#: 0.66-1.49 (most near 1): a post-norm row was then within the demo's 0.08 tolerance of its pre-norm row unless its
#: RMS was far from 1.  With 2, every post-norm row has an RMS of 2 and differs from its pre-norm row by at least
#: 0.33 (relative L2, 12 conversations).  A per-channel random weight would do the same but changes the random
#: verifier's greedy continuation, which the demo's acceptance length measures (an EAGLE-3 drafter's fell from
#: 1.67 to 1.23 with a weight uniform in [0.5, 2], 1.49 in [1.8, 2.2]); a constant keeps every argmax as it was.
FINAL_NORM_WEIGHT = 2.0

KINDS = ("dense", "hybrid")
INFO_FILE = "tiny_model.json"


@dataclass(frozen=True)
class TinyModel:
    """What :func:`make_model` wrote (also saved as ``tiny_model.json`` beside the checkpoint)."""

    path: str
    kind: str
    num_layers: int
    hidden: int
    vocab: int
    tokenizer_vocab: int
    layer_types: tuple[str, ...] | None
    sliding_window: int | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TinyModel:
        d = json.loads(text)
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def corpus(seed: int, lines: int = 2000) -> list[str]:
    """Lines of pseudo-words (the tokenizer's training text, and the demo's prompts)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 20))) for _ in range(lines)]


def make_tokenizer(path: str, vocab: int = VOCAB, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer of at most ``vocab`` entries into ``path``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 8,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    # A chat template with {% generation %} markers (capture's assistant loss mask); the vocabulary is unchanged.
    fast.chat_template = tiny_chat_template()
    fast.save_pretrained(path)
    return int(tok.get_vocab_size())


def make_model(
    path: str,
    kind: str = "dense",
    seed: int = 0,
    *,
    hidden: int = HIDDEN,
    num_layers: int = NUM_LAYERS,
    num_heads: int = NUM_HEADS,
) -> TinyModel:
    """Write a tiny bf16 Llama (``kind`` ``dense`` or ``hybrid``) with random weights to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if kind not in KINDS:
        raise TinyModelError(f"kind must be one of {KINDS}, found {kind!r}")
    os.makedirs(path, exist_ok=True)
    layer_types: tuple[str, ...] | None = None
    extra: dict[str, object] = {}
    if kind == "hybrid":
        layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))
        extra = {"layer_types": list(layer_types), "sliding_window": SLIDING_WINDOW}
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        # Larger than the default 0.02, so attention and MLP move the residual stream visibly: rows of different
        # contexts then differ by far more than bf16 rounding.
        initializer_range=0.1,
        **extra,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # A final norm that is not the identity (see FINAL_NORM_WEIGHT): a post-norm capture then differs from the
    # pre-norm rows on every row, not only on the rows whose RMS happens to be far from 1.
    with torch.no_grad():
        model.model.norm.weight.fill_(FINAL_NORM_WEIGHT)
    model.save_pretrained(path)
    tokenizer_vocab = make_tokenizer(path, VOCAB, seed)
    tiny = TinyModel(
        path=str(Path(path).resolve()),
        kind=kind,
        num_layers=num_layers,
        hidden=hidden,
        vocab=VOCAB,
        tokenizer_vocab=tokenizer_vocab,
        layer_types=layer_types,
        sliding_window=SLIDING_WINDOW if kind == "hybrid" else None,
    )
    Path(path, INFO_FILE).write_text(tiny.to_json())
    return tiny


def load_model_info(path: str) -> TinyModel:
    """The :class:`TinyModel` a directory written by :func:`make_model` describes."""
    return TinyModel.from_json(Path(path, INFO_FILE).read_text())
