"""Pair every captured record with every reference and demand a permutation matrix.

A row (one token position, all planes) *matches* when every plane is within bf16 tolerance of the reference:
``||a - b|| / ||b|| <= ROW_TOL`` per plane.  Prompts share prefixes on purpose (prefix caching), and rows whose
context is shared by two prompts are equal for both, so they cannot tell records apart.  The matrix therefore
scores each reference ``j`` on its *distinguishing* positions ``[u_j, T_j)``, where ``u_j`` is the longest token
prefix ``j`` shares with any other reference:

    M[i][j] = (# positions t in [u_j, T_j) where record i has a row t matching reference j row t) / (T_j - u_j)

The case passes only if ``M`` is the identity (diagonal exactly 1.0, everything else exactly 0.0) AND each record
matches its own reference on EVERY position (shared prefix included), has exactly its length, and carries
exactly its token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# bf16 has an 8-bit mantissa (relative step 2^-8 = 0.0039); vLLM and transformers round differently in every
# matmul and norm, and the error grows with depth.  Measured on the tiny models: diagonal rows stay below ~0.036,
# rows of a different context are >= ~0.25 apart (both are printed with every matrix).
ROW_TOL = 0.08


@dataclass
class Record:
    """One captured record, normalised across sinks."""

    label: str  # who it claims to be (request index as text, or the record id)
    token_ids: list[int]
    layer_ids: list[int]
    hidden_states: torch.Tensor  # [T, P, C]
    start: int = 0  # first position the record holds (windows)
    source: str = ""


@dataclass
class Pairing:
    matrix: list[list[float]]
    labels: list[str]
    full_match: list[bool]
    length_ok: list[bool]
    tokens_ok: list[bool]
    layers_ok: list[bool]
    diag_max_err: float
    offdiag_min_err: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        n = len(self.matrix)
        ident = all(self.matrix[i][j] == (1.0 if i == j else 0.0) for i in range(n) for j in range(n))
        return ident and all(self.full_match) and all(self.length_ok) and all(self.tokens_ok) and all(self.layers_ok)

    def render(self, title: str) -> str:
        n = len(self.matrix)
        lines = [f"{title}: {n} records x {n} references -> {'PASS' if self.ok else 'FAIL'}"]
        lines.append(
            f"  rows within tol {ROW_TOL}: diagonal max rel err {self.diag_max_err:.4f}; "
            f"off-diagonal min rel err on distinguishing rows {self.offdiag_min_err:.4f}"
        )
        diag = [self.matrix[i][i] for i in range(n)]
        off = [self.matrix[i][j] for i in range(n) for j in range(n) if i != j]
        lines.append(
            f"  diagonal min {min(diag, default=float('nan')):.3f}  off-diagonal max {max(off) if off else 0.0:.3f}  "
            f"full-row matches {sum(self.full_match)}/{n}  lengths {sum(self.length_ok)}/{n}  "
            f"token ids+start {sum(self.tokens_ok)}/{n}  layer ids {sum(self.layers_ok)}/{n}"
        )
        header = "  rec\\ref " + " ".join(f"{j:>4}" for j in range(n))
        lines.append(header)
        for i in range(n):
            cells = " ".join("1.00" if v == 1.0 else ("   ." if v == 0.0 else f"{v:4.2f}") for v in self.matrix[i])
            lines.append(f"  {i:>7} {cells}   {self.labels[i]}")
        lines.extend(f"  note: {s}" for s in self.notes)
        return "\n".join(lines)


def row_errors(rec: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position, the worst plane's relative L2 error; ``[min(T_rec, T_ref)]``."""
    t = min(rec.shape[0], ref.shape[0])
    a = rec[:t].float()
    b = ref[:t].float()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return err.max(dim=-1).values if t else torch.zeros(0)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def distinguishing_starts(contexts: Sequence[Sequence[int]]) -> list[int]:
    """Per context, the longest token prefix it shares with any other context."""
    return [
        max((common_prefix(tj, tk) for k, tk in enumerate(contexts) if k != j), default=0)
        for j, tj in enumerate(contexts)
    ]


def pair(
    records: Sequence[Record],
    refs: Sequence[torch.Tensor],
    contexts: Sequence[Sequence[int]],
    ref_layer_ids: Sequence[int],
    offsets: Sequence[int] | None = None,
) -> Pairing:
    """``records[i]`` claims to be reference ``i``.  ``refs[j]`` is ``[T_j, P, C]``: positions
    ``[offsets[j], offsets[j] + T_j)`` of the token context ``contexts[j]``, plane ``p`` = layer id
    ``ref_layer_ids[p]``.  Each record is compared plane by plane through its OWN ``layer_ids`` (which must be
    exactly the configured set), and must carry ``contexts[j][offsets[j]:]`` as its token ids and
    ``offsets[j]`` as its start."""
    if len(records) != len(refs):
        raise ValueError(f"{len(records)} records for {len(refs)} references")
    n = len(refs)
    offs = list(offsets) if offsets is not None else [0] * n
    ref_tokens = [list(c[o:]) for c, o in zip(contexts, offs, strict=True)]
    # Distinguishing positions are decided on the full contexts (the rows depend on everything before them).
    starts = [max(0, u - o) for u, o in zip(distinguishing_starts(contexts), offs, strict=True)]
    for j, (u, ref) in enumerate(zip(starts, refs, strict=True)):
        if u >= ref.shape[0]:
            raise ValueError(f"reference {j}: its window lies inside a prefix shared with another reference")
    matrix = [[0.0] * n for _ in range(n)]
    diag_max = 0.0
    off_min = float("inf")
    full, length_ok, tokens_ok, layers_ok = [], [], [], []
    notes: list[str] = []
    for i, rec in enumerate(records):
        layers_ok.append(
            sorted(rec.layer_ids) == sorted(ref_layer_ids) and len(set(rec.layer_ids)) == len(rec.layer_ids)
        )
        order = [list(ref_layer_ids).index(k) if k in ref_layer_ids else -1 for k in rec.layer_ids]
        for j, full_ref in enumerate(refs):
            ref = full_ref[:, order] if layers_ok[-1] else full_ref
            if rec.hidden_states.shape[1:] != ref.shape[1:]:
                matrix[i][j] = 0.0
                if i == j:
                    full.append(False)
                continue
            err = row_errors(rec.hidden_states, ref)
            u, tj = starts[j], ref.shape[0]
            seg = err[u:tj]
            matrix[i][j] = float((seg <= ROW_TOL).sum()) / (tj - u)
            if i == j:
                diag_max = max(diag_max, float(err.max()) if err.numel() else 0.0)
                full.append(rec.hidden_states.shape[0] == tj and bool((err <= ROW_TOL).all()))
                off = (err > ROW_TOL).nonzero().flatten().tolist()
                if off:  # where they are says why (a decode step's rows, a block, the record's end)
                    at = [offs[i] + t for t in off]
                    notes.append(
                        f"record {i}: {len(off)} of {tj} rows off its reference at positions "
                        f"{at[:16]}{' ...' if len(at) > 16 else ''} (context {len(contexts[i])} tokens)"
                    )
            elif seg.numel():
                off_min = min(off_min, float(seg.min()))
        length_ok.append(rec.hidden_states.shape[0] == refs[i].shape[0])
        tokens_ok.append(list(rec.token_ids) == list(ref_tokens[i]) and rec.start == offs[i])
    return Pairing(
        matrix=matrix,
        labels=[r.label for r in records],
        full_match=full,
        length_ok=length_ok,
        tokens_ok=tokens_ok,
        layers_ok=layers_ok,
        diag_max_err=diag_max,
        offdiag_min_err=off_min if off_min != float("inf") else float("nan"),
        notes=notes,
    )
