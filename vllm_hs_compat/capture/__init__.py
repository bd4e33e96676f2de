"""``vllm-hs-compat capture``: from a dataset of conversations to sharded, indexed, resumable capture records.

* :mod:`.sources` -- where rows come from (JSONL / JSON / Parquet files or folders, ``hf:NAME[:split]``);
* :mod:`.samples` -- rows templated and tokenized into :class:`~.samples.Sample` (or a per-row
  :class:`~.samples.RowError`), and :func:`~.samples.check_template`, run before any engine starts;
* :mod:`.store` -- the output tree of one rank (shards, Parquet index parts, resume, rank split, summaries); its
  parts, whose public names it re-exports: :mod:`.rows`, :mod:`.policy`, :mod:`.tree`, :mod:`.durable`,
  :mod:`.index`, :mod:`.staged`, :mod:`.recovery`, :mod:`.summary`;
* :mod:`.batches` -- the command's batches through the engine and into the store, side by side by way of
  :mod:`.pipeline`; :mod:`.feed` queues their requests in the engine and steps it until their records are read.

See docs/capture.md.
"""
