"""The capture tree's names and its ``run.json``: what makes a folder this command's tree, and its records
comparable.

``OUT/run.json`` holds the tree's format, version and ``run_config`` (model, layers, capture mode, template hash,
...); :func:`check_run_json` writes it into a new folder (whichever rank starts first) or refuses a tree made with
other settings (:class:`RunConfigMismatchError` naming the keys that differ), another version, or a folder that is
not a tree.  The ``*_RE`` patterns name the folders and files each rank owns.

Pure Python (the standard library only).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from vllm_hs_compat.errors import CaptureStoreError, RunConfigMismatchError

from .durable import fsync_path

TREE_FORMAT: Final = "vllm-hs-compat capture tree"
TREE_VERSION: Final = 1

#: ``shard-R-NNNNN``: rank R's record folders.
SHARD_RE: Final = re.compile(r"^shard-(\d+)-(\d+)$")
#: ``index/rank-R.journal``: rank R's rows adopted since its last index part.
JOURNAL_RE: Final = re.compile(r"^rank-(\d+)\.journal$")
#: ``.staging/rank-R``: where rank R's file sink writes.
STAGING_RE: Final = re.compile(r"^rank-(\d+)$")


def json_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` as it reads back from JSON (sorted keys), or :class:`CaptureStoreError` naming why it cannot
    be kept."""
    if not isinstance(run_config, Mapping):
        raise CaptureStoreError(f"run_config must be a mapping, found {type(run_config).__name__}")
    try:
        normal: dict[str, Any] = json.loads(json.dumps(dict(run_config), sort_keys=True))
    except (TypeError, ValueError) as e:
        raise CaptureStoreError(
            f"run_config must be JSON-able (str/int/float/bool/None, lists, string-keyed dicts): {e}"
        ) from None
    return normal


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_run_json(out: Path, rank: int, run_config: dict[str, Any]) -> None:
    """Make ``out/run.json`` for a new tree, or check the one there against ``run_config`` (see the module
    docstring)."""
    path = out / "run.json"
    doc = {"format": TREE_FORMAT, "version": TREE_VERSION, "run_config": run_config}
    if not path.exists():
        # a tree is made in a new folder (other ranks starting at the same time may have made these already)
        foreign = [
            p.name
            for p in out.iterdir()
            if p.name not in ("index", ".staging", "logs", "run.json") and not p.name.startswith(".run.json.")
        ]
        if foreign:
            raise CaptureStoreError(
                f"{out} is not empty ({', '.join(sorted(foreign)[:5])}) and is not a capture tree (no "
                "run.json): --out must be a new or empty folder, or a tree this command made"
            )
        tmp = out / f".run.json.rank-{rank}.{os.getpid()}.tmp"
        tmp.write_bytes(json.dumps(doc, indent=1, sort_keys=True).encode())
        try:
            os.link(tmp, path)  # creates run.json only if no other rank did first
        except (FileExistsError, FileNotFoundError):
            pass
        else:
            fsync_path(out, directory=True)
        finally:
            tmp.unlink(missing_ok=True)
    try:
        found = json.loads(path.read_text())
        theirs = found["run_config"]
        if found.get("format") != TREE_FORMAT or not isinstance(theirs, dict):
            raise ValueError("not a capture tree's run.json")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CaptureStoreError(
            f"{path} cannot be read as a capture tree's run.json ({e}); --out must be a new folder or a tree "
            "this command made"
        ) from None
    if found.get("version") != TREE_VERSION:
        raise CaptureStoreError(
            f"{out} is a capture tree of version {found.get('version')}, this build writes "
            f"{TREE_VERSION}; use another --out or the vllm-hs-compat version that made it"
        )
    if theirs != run_config:
        keys = sorted(set(theirs) | set(run_config))
        diff = [k for k in keys if theirs.get(k, "<absent>") != run_config.get(k, "<absent>")]
        shown = "; ".join(
            f"{k}: tree has {_short(theirs.get(k, '<absent>'))}, this run has {_short(run_config.get(k, '<absent>'))}"
            for k in diff
        )
        raise RunConfigMismatchError(
            f"{out} was made with other settings ({shown}); records of both would be mixed in one index. "
            "Use another --out for these settings, or re-run with the tree's settings to resume it"
        )
