"""The demo's trainer: a process of its own that reads records -- from the capture's output tree (the default
demo) or streamed from the serving process's export (``demo --serve``) --, verifies each against a transformers
forward of the same weights, measures the acceptance length of an untrained drafter, trains a tiny EAGLE-3-style
drafter on the records (with their loss masks), measures it again and saves it (``<out>/drafter``).

    python -m vllm_hs_compat.demo.trainer_proc ARGS.json

It speaks JSON lines on stdout (``{"event": ...}``: ``start``, ``loaded``, ``record``, ``received``,
``acceptance``, ``step``, ``done``); the demo command renders them.  Everything else (library logs, warnings)
goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_hs_compat.errors import HsCompatError


# --- the record source: the ONE place that knows how records arrive ---------------------------------------------
class TreeSource:
    """The records a capture tree's index names, through
    :meth:`vllm_hs_compat.trainer.HiddenStatesDataset.from_capture` in the ``eagle3`` layout (the same dicts as
    :class:`RecordSource`, plus each record's ``sample_id``); a record that fails to read (checksum, format) is
    counted and yielded as an error at the end, and the reading goes on."""

    transport = "files (capture tree)"

    def __init__(self, tree: str) -> None:
        from vllm_hs_compat.trainer import HiddenStatesDataset

        self.tree = tree
        self.dataset = HiddenStatesDataset.from_capture(tree, layout="eagle3", on_error="skip")

    def __iter__(self) -> Iterator[dict[str, Any] | HsCompatError]:
        yield from self.dataset
        # on_error="skip" logs each failed record (the trainer's log) and counts it: each becomes a failed result
        for _ in range(int(self.dataset.stats.get("skipped", 0))):
            yield HsCompatError(f"a record of {self.tree} failed to read (its error is in trainer.log)")

    def close(self) -> dict[str, Any]:
        return {"tree": self.tree, **self.dataset.stats}


class RecordSource:
    """Records of one producer through :class:`vllm_hs_compat.trainer.HiddenStatesDataset` in the ``eagle3``
    layout (dicts with ``input_ids`` ``[T]``, ``hidden_states`` ``[T, C]`` (the last plane, pre-norm),
    ``aux_hidden_states`` ``[T, (P-1)*C]``, ``loss_mask`` ``[T]``, ``record_id``, ``layer_ids``); a record that
    failed on the way (checksum, lease, read) is yielded as its error, and the stream goes on."""

    def __init__(
        self, endpoint: str, token: str, *, max_records: int, backend: str = "auto", idle_timeout_s: float = 120.0
    ) -> None:
        from vllm_hs_compat.trainer import HiddenStatesDataset

        self.endpoint, self._token, self._backend = endpoint, token, backend
        self.max_records = max_records
        self.dataset = HiddenStatesDataset.from_export(
            endpoint,
            token,
            max_records=max_records,
            wait_s=idle_timeout_s,
            layout="eagle3",
            consumer_kwargs={"backend": backend, "timeout_s": 30.0},
        )
        self.transport = "?"

    def __iter__(self) -> Iterator[dict[str, Any] | HsCompatError]:
        seen = 0
        while seen < self.max_records:
            stream = iter(self.dataset)  # after a failed record, iterating again continues with the next one
            try:
                for item in stream:
                    seen += 1
                    yield item
                    if seen >= self.max_records:
                        return
                return  # no record for idle_timeout_s
            except HsCompatError as exc:
                seen += 1
                yield exc
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()

    def close(self) -> dict[str, Any]:
        """The producer's ledger and the transport, as a second trainer-token consumer sees them."""
        from vllm_hs_compat.export import ExportConsumer

        try:
            with ExportConsumer(self.endpoint, self._token, backend=self._backend, timeout_s=30.0) as c:
                self.transport = str(c.hello.get("transport", {}).get("kind", "?"))
                return c.remote_stats()
        except HsCompatError as exc:
            return {"error": str(exc)}


def planes_of(item: dict[str, Any]) -> torch.Tensor:
    """``[T, P, C]`` back from an ``eagle3`` item (aux planes, then the base plane)."""
    base = item["hidden_states"]
    t, c = base.shape
    aux = item["aux_hidden_states"].reshape(t, -1, c)
    return torch.cat([aux, base[:, None]], dim=1)


# --- the process ------------------------------------------------------------------------------------------------
@dataclass
class TrainerArgs:
    """``endpoint`` + ``token_file`` (stream from an export) or ``tree`` (read a capture tree).  ``prompts``: the
    token ids sent (stream), or ``expected``: sample id -> ``{"input_ids", "loss_mask"}`` as transformers
    templates each row (tree).  ``eval_prompts``: the prompts of the acceptance measurement."""

    endpoint: str
    token_file: str
    model: str
    prompts: list[list[int]]
    steps: int
    out_dir: str
    backend: str = "auto"
    batch: int = 8
    seed: int = 0
    lr: float = 3e-3
    idle_timeout_s: float = 120.0
    tree: str | None = None
    expected: dict[str, dict[str, list[int]]] | None = None
    eval_prompts: list[list[int]] = field(default_factory=list)
    eval_k: int = 3
    eval_new_tokens: int = 32

    @classmethod
    def load(cls, path: str) -> TrainerArgs:
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(asdict(self)))


@dataclass
class RecordResult:
    record_id: str
    ok: bool
    sample_id: str = ""
    tokens: int = 0
    loss_tokens: int = 0
    nbytes: int = 0
    layer_ids: list[int] = field(default_factory=list)
    max_rel: list[float] = field(default_factory=list)
    max_abs: list[float] = field(default_factory=list)
    pull_s: float = 0.0
    reason: str = ""


def emit(event: str, **data: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **data}) + "\n")
    sys.stdout.flush()


def verify_item(
    item: dict[str, Any],
    model: str,
    prompts: dict[tuple[int, ...], int],
    expected: dict[str, dict[str, list[int]]] | None = None,
) -> RecordResult:
    """One record against the transformers forward of the same weights: its token ids must be a prompt the
    engine was sent (``prompts``) or, with ``expected``, exactly the ids and loss mask transformers' own chat
    templating gives its sample; every plane within :data:`~vllm_hs_compat.reference.forward.ROW_TOL` of its
    reference."""
    from vllm_hs_compat.reference.forward import ROW_TOL, record_errors, reference

    rows = planes_of(item)
    ids = [int(x) for x in item["input_ids"]]
    layer_ids = [int(x) for x in item["layer_ids"]]
    mask = [int(x) for x in item["loss_mask"]]
    res = RecordResult(
        record_id=str(item["record_id"]),
        ok=False,
        sample_id=str(item.get("sample_id") or ""),
        tokens=len(ids),
        loss_tokens=sum(mask),
        nbytes=rows.numel() * rows.element_size(),
        layer_ids=layer_ids,
    )
    if expected is not None:
        want = expected.get(res.sample_id)
        if want is None:
            res.reason = f"sample id {res.sample_id!r} is none of the rows captured"
            return res
        if ids != want["input_ids"]:
            res.reason = "token ids differ from transformers' apply_chat_template of the row"
            return res
        if mask != want["loss_mask"]:
            res.reason = "loss mask differs from transformers' assistant_masks of the row"
            return res
    elif tuple(ids) not in prompts:
        res.reason = "token ids are none of the prompts sent"
        return res
    errs = record_errors(rows, reference(model, ids, layer_ids))
    res.max_rel = [e.max_rel for e in errs]
    res.max_abs = [e.max_abs for e in errs]
    bad = [f"layer {k}: rel {e.max_rel:.3f}" for k, e in zip(layer_ids, errs, strict=True) if not e.ok]
    res.ok = not bad
    res.reason = "" if res.ok else f"differs from transformers beyond {ROW_TOL} ({', '.join(bad)})"
    return res


def _acceptance(model: str, head: Any, aux_layer_ids: list[int], args: TrainerArgs) -> dict[str, Any]:
    """The drafter's mean acceptance length (:mod:`vllm_hs_compat.drafter.acceptance`) on ``args.eval_prompts``."""
    from vllm_hs_compat.drafter.acceptance import DrafterProposer, Verifier, measure
    from vllm_hs_compat.reference.forward import load_hf

    t = time.monotonic()
    verifier = Verifier(load_hf(model, torch.float32), aux_layer_ids)
    res = measure(verifier, DrafterProposer(head), args.eval_prompts, k=args.eval_k, new_tokens=args.eval_new_tokens)
    return {**res.to_dict(), "seconds": time.monotonic() - t}


def run(args: TrainerArgs) -> int:
    from vllm_hs_compat.drafter.head import Eagle3Head, make_item, save_drafter, train
    from vllm_hs_compat.export.credentials import read_token
    from vllm_hs_compat.reference.forward import final_norm, load_hf

    torch.set_num_threads(1)  # the engine shares this machine
    emit("start", pid=os.getpid())
    hf = load_hf(args.model)
    norm, lm_head = final_norm(hf), hf.get_output_embeddings()
    emit("loaded", model=args.model)
    prompts = {tuple(p): i for i, p in enumerate(args.prompts)}
    source: TreeSource | RecordSource
    if args.tree is not None:
        source = TreeSource(args.tree)
        expected_count = len(args.expected or {})
    else:
        source = RecordSource(
            args.endpoint,
            read_token(args.token_file),
            max_records=len(args.prompts),
            backend=args.backend,
            idle_timeout_s=args.idle_timeout_s,
        )
        expected_count = len(args.prompts)
    results: list[RecordResult] = []
    items = []
    seen_prompts: set[tuple[int | str, ...]] = set()
    t0 = time.monotonic()
    it = iter(source)
    while True:
        t = time.monotonic()
        try:
            got = next(it)
        except StopIteration:
            break
        pull = time.monotonic() - t
        if isinstance(got, HsCompatError):
            res = RecordResult(record_id="?", ok=False, pull_s=pull, reason=f"{type(got).__name__}: {got}")
        else:
            res = verify_item(got, args.model, prompts, args.expected)
            res.pull_s = pull
            key = (res.sample_id,) if args.expected is not None else tuple(int(x) for x in got["input_ids"])
            if res.ok and key in seen_prompts:
                res.ok, res.reason = False, "a second record of the same sample"
            seen_prompts.add(key)
            if res.ok:
                mask = got["loss_mask"]
                item = make_item(got["input_ids"], got["aux_hidden_states"], got["hidden_states"], mask, norm, lm_head)
                if item is not None:
                    items.append(item)
        results.append(res)
        emit("record", **asdict(res))
    receive_s = time.monotonic() - t0
    ledger = source.close()
    transport = source.transport
    emit("received", records=len(results), seconds=receive_s, transport=transport)
    losses: list[float] = []
    accs: list[float] = []
    acceptance: dict[str, Any] = {}
    drafter_dir: str | None = None
    if items and args.steps > 0:
        torch.manual_seed(args.seed)
        head = Eagle3Head(
            hidden=int(hf.config.hidden_size),
            num_aux=items[0].aux.shape[1] // int(hf.config.hidden_size),
            embed=hf.get_input_embeddings().weight,
            lm_head=lm_head.weight,
        )
        # the auxiliary planes: every captured layer id but the last (the base plane), as the eagle3 layout splits
        aux_layer_ids = sorted(next((r.layer_ids for r in results if r.ok), []))[:-1]
        if args.eval_prompts:
            acceptance["before"] = _acceptance(args.model, head, aux_layer_ids, args)
            emit("acceptance", phase="before", **acceptance["before"])

        def on_step(s: Any) -> None:
            losses.append(s.loss)
            accs.append(s.accuracy)
            emit("step", step=s.step, loss=s.loss, accuracy=s.accuracy)

        train(items, head, args.steps, batch=args.batch, lr=args.lr, seed=args.seed, on_step=on_step)
        if args.eval_prompts:
            acceptance["after"] = _acceptance(args.model, head, aux_layer_ids, args)
            emit("acceptance", phase="after", **acceptance["after"])
        drafter_dir = str(
            save_drafter(head, Path(args.out_dir) / "drafter", verifier=args.model, aux_layer_ids=aux_layer_ids)
        )
    emit(
        "done",
        records=[asdict(r) for r in results],
        expected=expected_count,
        acceptance=acceptance,
        drafter=drafter_dir,
        receive_s=receive_s,
        transport=transport,
        ledger=ledger,
        losses=losses,
        accuracies=accs,
        trained_on=len(items),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(TrainerArgs.load(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
