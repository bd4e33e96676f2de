"""``capture --ray N``: the ranks of a capture run as Ray actors, one vLLM engine each, writing one output tree.

Ray does what a job array would: places the N engines (``--ray-gpus-per-actor`` GPUs and ``--ray-cpus-per-actor``
CPUs each, on any node of the cluster at ``--ray-address``), starts them, and reports each one's end.  Actor ``k``
runs exactly ``capture --rank k --world-size N`` in its own process, so the rows are split by the same
deterministic hash of their sample id as ``--rank/--world-size``: a resume, with or without Ray, with the same N,
gives exactly one record per sample, and the tree is the one a job array of N processes writes.

Why not rows from ``ray.data`` to whichever actor is free: Ray Data retries a failed batch on another actor, which
would then capture rows the failed one may already have indexed -- two records for one sample -- and a resume could
not tell which rank owns a row.  The split by sample id keeps both exact; Ray still schedules, places and supervises
the engines.  The output tree must be on storage every node sees (one machine: any local folder).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_hs_compat.errors import CaptureConfigError, ToolError

#: The flags of ``capture`` that only the launcher reads (each rank gets the rest, plus its --rank/--world-size).
LAUNCHER_FLAGS = ("--ray", "--ray-address", "--ray-cpus-per-actor", "--ray-gpus-per-actor")


def rank_argv(argv: Sequence[str], rank: int, world_size: int) -> list[str]:
    """``argv`` (the capture command's arguments after ``capture``) for rank ``rank``: the launcher's own flags,
    any ``--rank``/``--world-size`` and ``--json`` (the launcher prints the merged summary) removed, this rank's
    added."""
    out: list[str] = []
    skip = False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name == "--json":
            continue
        if name in (*LAUNCHER_FLAGS, "--rank", "--world-size"):
            skip = "=" not in word and i + 1 < len(argv)
            continue
        out.append(word)
    return [*out, "--rank", str(rank), "--world-size", str(world_size)]


def run_ranks(
    argv: Sequence[str],
    actors: int,
    *,
    address: str | None = None,
    cpus_per_actor: float = 1.0,
    gpus_per_actor: float = 0.0,
) -> list[tuple[int, int]]:
    """Run ``capture`` ranks ``0..actors-1`` as Ray actors and wait for all; returns each rank's (rank, exit code).

    ``address``: an existing cluster (``ray.init(address=...)``); None starts a local one sized to this machine."""
    if actors < 1:
        raise CaptureConfigError(f"--ray {actors}: expected at least one engine actor")
    try:
        import ray
    except ImportError:
        raise ToolError("capture --ray needs Ray: pip install 'ray[data]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    try:

        @ray.remote(max_restarts=0)
        class Rank:
            """One capture rank: its own process, its own engine."""

            def run(self, rank_args: list[str]) -> int:
                # The engine runs in this process (the capture command's in-process engine); keep vLLM from
                # starting another Ray cluster or worker processes of its own.
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                # vLLM's CPU platform binds an engine's OpenMP threads to cores it picks ("auto"): two actors on
                # one node would pick the same ones.  Ray does not pin actors to cores, so leave the threads free
                # unless the user chose a binding.  (GPU platforms do not read it.)
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
                from vllm_hs_compat.cli import main

                return main(["capture", *rank_args])

        options: dict[str, Any] = {"num_cpus": cpus_per_actor}
        if gpus_per_actor:
            options["num_gpus"] = gpus_per_actor
        handles = [Rank.options(**options).remote() for _ in range(actors)]  # type: ignore[attr-defined]
        refs = [h.run.remote(rank_argv(argv, k, actors)) for k, h in enumerate(handles)]
        codes: list[tuple[int, int]] = []
        for k, ref in enumerate(refs):
            try:
                codes.append((k, int(ray.get(ref))))
            except ray.exceptions.RayError as exc:  # the actor died (OOM, a crashed engine): that rank failed
                print(f"vllm-hs-compat capture --ray: rank {k} died: {type(exc).__name__}: {exc}")
                codes.append((k, 4))
        return codes
    finally:
        if started_here:
            ray.shutdown()
