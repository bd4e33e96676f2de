"""``vllm-hs-compat convert SRC --to FORMAT --out DIR``: records already on disk (the file sink's native records in
SRC), or streamed from a running server's export (SRC = tcp://HOST:PORT, one or several: the engines of
--data-parallel-size N, several servers), rewritten in a drafter trainer's own on-disk contract (see
vllm_hs_compat.trainer.formats):

  speculators        OUT/hidden_states/hs_<i>.safetensors + OUT as its prepared Arrow dataset (loss masks) +
                     OUT/token_freq.pt; base plane pre-norm (speculators applies the verifier's norm)
  specforge-eagle3   OUT/rows_<k>/data_<i>.ckpt: input_ids, loss_mask, hidden_state [1,T,C] AFTER the verifier's
                     final norm (computed from --verifier's weight and eps), aux_hidden_state [1,T,(P-1)C]
  specforge-dflash   OUT/rows_<k>/data_<i>.ckpt: input_ids, loss_mask, hidden_states [1,T,P*C]
  modelopt           OUT/<record>.pt: input_ids, hidden_states (base, pre-norm), aux_hidden_states, loss_mask,
                     hidden_states_prenorm=True
  native             the package's own records (a copy)

It prints the layer ids the trainer's drafter config must use, in that trainer's numbering (SpecForge and
ModelOpt name layer outputs: vLLM id - 1), and with --drafter-config refuses a config whose ids are off by one.
With --verifier it then checks the written base plane's norm state against what the format declares.

From an export: the trainer token comes from --token-file, else $VLLM_HS_COMPAT_EXPORT_TOKEN, else the default
token file (--token also works, but shows in the process list).  Records are taken from the producer as they are
written (each is then in OUT, or in OUT/failed.jsonl when it failed on the way); the command stops after
--max-records records, or when none arrived for --wait-s seconds, or at Ctrl-C (what was written is finished and
usable).  A wrong token or an unreachable producer is refused before anything is written.

Exit codes: 0 written (and checked); 1 a record or the check failed (or the producer is unreachable); 2 a usage
error (a setting, a refused drafter config, no trainer token or a wrong one).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_hs_compat.commands import progress


def register(sub: Any) -> None:
    """Add ``convert`` to the ``vllm-hs-compat`` subparsers."""
    p = sub.add_parser(
        "convert",
        help="rewrite records on disk in a trainer's format (speculators, specforge-eagle3, modelopt, ...)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "src",
        metavar="SRC",
        nargs="+",
        help="the file sink's folder of native records (<record>.json + .safetensors), or export endpoints "
        "tcp://HOST:PORT (one or several)",
    )
    p.add_argument(
        "--to",
        required=True,
        dest="format",
        choices=("speculators", "specforge-eagle3", "specforge-dflash", "modelopt", "native"),
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--verifier", default=None, help="the verifier's local model folder (config.json, safetensors)")
    p.add_argument("--num-hidden-layers", type=int, default=None, help="instead of --verifier (formats without norm)")
    p.add_argument(
        "--loss-mask",
        choices=("auto", "record", "all", "generated"),
        default="auto",
        help="rows in the loss: auto (default) = the record's own mask (loss_mask_spans) when it has one, else all; "
        "record = refuse records without one; hs_format.json counts which mask each record got",
    )
    p.add_argument("--drafter-config", default=None, help="a drafter config JSON whose layer ids are checked")
    p.add_argument("--final-norm", choices=("rmsnorm",), default=None, help="the norm type of an unlisted model_type")
    p.add_argument("--compress", action="store_true", help="specforge: .ckpt.gz")
    p.add_argument("--no-checksum", action="store_true", help="do not verify the records' checksums")
    p.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    g = p.add_argument_group("from an export (SRC = tcp://HOST:PORT)")
    g.add_argument(
        "--token-file",
        default=None,
        help="the trainer token file (default: $VLLM_HS_COMPAT_EXPORT_TOKEN, else the default token file)",
    )
    g.add_argument(
        "--token",
        default=None,
        help="the trainer token itself (visible in the process list: prefer the environment or --token-file)",
    )
    g.add_argument("--max-records", type=int, default=None, help="stop after this many records (default: no limit)")
    g.add_argument("--wait-s", type=float, default=30.0, help="stop when no record arrived for this long (default 30)")
    g.add_argument("--batch", type=int, default=8, help="records claimed and read per round trip (default 8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The ``convert`` command."""
    from vllm_hs_compat.errors import AuthError, DatasetConfigError, ExportConfigError, HsCompatError
    from vllm_hs_compat.trainer.formats import check_output, convert, convert_export, is_endpoint

    kwargs: dict[str, Any] = {
        "verifier": args.verifier,
        "num_hidden_layers": args.num_hidden_layers,
        "loss_mask": args.loss_mask,
        "drafter_config": args.drafter_config,
        "final_norm_kind": args.final_norm,
        "compress": args.compress,
    }
    endpoints = [s for s in args.src if is_endpoint(s)]
    if endpoints and len(endpoints) != len(args.src):
        progress("convert: SRC is either export endpoints (tcp://HOST:PORT) or one folder of records, not both")
        return 2
    if not endpoints and len(args.src) != 1:
        progress(f"convert: one folder of records at a time, found {len(args.src)}: {args.src}")
        return 2
    try:
        if endpoints:
            from vllm_hs_compat.export.credentials import read_token

            token = args.token if args.token is not None else read_token(args.token_file)
            progress(f"convert: streaming from {', '.join(endpoints)} into {args.out} as {args.format} ...")
            summary = convert_export(
                endpoints,
                args.out,
                args.format,
                token=token,
                max_records=args.max_records,
                wait_s=args.wait_s,
                batch=args.batch,
                verify_checksum=not args.no_checksum,
                **kwargs,
            )
        else:
            summary = convert(args.src[0], args.out, args.format, verify_checksum=not args.no_checksum, **kwargs)
        if args.verifier is not None:
            summary["check"] = check_output(args.out, args.verifier, final_norm_kind=args.final_norm)
    except (DatasetConfigError, ExportConfigError, AuthError) as exc:
        progress(f"{type(exc).__name__}: {exc}")
        return 2
    except HsCompatError as exc:
        progress(f"{type(exc).__name__}: {exc}")
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {summary['records']} records ({summary['failed']} failed) to {summary['out']} as {args.format}")
        if "stream" in summary:
            st = summary["stream"]
            print(
                f"stream: {st['records']} records from {', '.join(summary['source'])}; {st['failed']} failed on the "
                f"way, {st['duplicates']} redelivered copies dropped, {st['lease_expired']} leases expired (handed "
                f"out again){'; stopped by Ctrl-C' if st['interrupted'] else ''}"
            )
        if "layer_ids_line" in summary:
            print(f"layer ids: {summary['layer_ids_line']}")
            print(f"base plane: {summary['base_plane_note']}")
            print(f"train with: {summary['command']}")
        if "drafter_config" in summary:
            print(f"drafter config: {summary['drafter_config']}")
        if "check" in summary:
            print(f"check: {summary['check']['verdict']}")
    if summary.get("failed"):  # each failed record is named in the output (failed.jsonl / <record>.error.json)
        progress(f"convert: {summary['failed']} record(s) failed (non_finite, at the source ...), see {args.out}")
        return 1
    return 0
