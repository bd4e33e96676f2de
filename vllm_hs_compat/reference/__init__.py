"""The ground truth records are checked against, shared by ``verify``, ``capture``'s checks, the demo and the tests.

* :mod:`.forward` -- the transformers forward of the verifier's weights: the plane of each vLLM layer id (id
  ``k < L``: HF ``hidden_states[k]``; id ``L``: the final norm's input), the final norm, and the per-row comparison
  (:data:`~.forward.ROW_TOL`);
* :mod:`.models` -- tiny random-weight verifiers and their tokenizer, made locally (no model hub).

Needs transformers and tokenizers (both come with vLLM; the ``capture`` extra on a host without it).
"""
