"""Min / median / max over runs of bench_export.py JSON files, as a markdown table (docs/benchmarks.md):

    python benchmarks/summarize_export.py DIR before after      # DIR/before-*.json against DIR/after-*.json

Rows whose figure the runs do not have (an older benchmark, an API the "before" tree lacks) are left out or "–".
"""

import glob
import json
import os
import statistics
import sys


def load(tag):
    return [json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], f"{tag}-*.json")))]


B, A = load(sys.argv[2]), load(sys.argv[3])


def mmm(xs, fmt):
    xs = sorted(xs)
    return " / ".join(fmt(x) for x in (xs[0], statistics.median(xs), xs[-1]))


def ms(x):
    return f"{x * 1e3:.2f}"


def us(x):
    return f"{x:.1f}"


def rx(x):
    return f"{x:.3f}"


rows = []
for be in ("nixl", "shm"):
    for m in (64, 16, 2):
        s = f"_{m}"
        lim = "raw" if be == "nixl" else "memcpy"
        for key, label in (
            ("default", "fetch() default"),
            ("overlap", "fetch(), overlap_verification=True"),
            ("noverify", "fetch() default, verify_checksum=False"),
            ("nocopy", "fetch(copy=False)+release"),
            (lim, "LIMIT " + ("raw NIXL READ" if be == "nixl" else "memcpy")),
            ("xxh3", "xxh3_64 alone"),
            ("claim", "claim round trip"),
            ("ping", "ping round trip"),
            ("zmq", "bare ZeroMQ round trip (CURVE)"),
            ("pub", "publish() in caller"),
            ("pubnw", "publish_nowait() in caller (wall)"),
        ):
            k = key + s
            if all(k in r[be] for r in A):
                b = mmm([r[be][k] for r in B], ms) if all(k in r.get(be, {}) for r in B) else "–"
                rows.append((be, f"{m} MiB", label + " (ms)", b, mmm([r[be][k] for r in A], ms)))
        for key, label in (
            ("default", "RATIO fetch() default / limit"),
            ("overlap", "RATIO fetch(), overlap_verification=True / limit"),
            ("noverify", "RATIO fetch() default, verify_checksum=False / limit"),
            ("nocopy", "RATIO fetch(copy=False) / limit"),
        ):
            k = key + s
            if not all(k in r[be] for r in A):
                continue
            if not all(k in r[be] for r in B):
                rows.append((be, f"{m} MiB", label, "–", mmm([r[be][lim + s] / r[be][k] for r in A], rx)))
                continue
            rb = [r[be][lim + s] / r[be][k] for r in B]
            ra = [r[be][lim + s] / r[be][k] for r in A]
            rows.append((be, f"{m} MiB", label, mmm(rb, rx), mmm(ra, rx)))
    for key, label in (
        ("fb_2", "fetch_batch of 32 ids (ms)"),
        ("fbseq_2", "fetch() of each of the 32 ids (ms)"),
        ("fblimit_2", "LIMIT " + ("raw NIXL READ of the 32 ranges" if be == "nixl" else "memcpy") + " (ms)"),
    ):
        if all(key in r[be] for r in A):
            b = mmm([r[be][key] for r in B], ms) if all(key in r[be] for r in B) else "–"
            rows.append((be, "32 x 2 MiB by id", label, b, mmm([r[be][key] for r in A], ms)))
    for key, label in (("fb_2", "RATIO fetch_batch / limit"), ("fbseq_2", "RATIO fetch() each / limit")):
        if all(key in r[be] for r in A):
            b = mmm([r[be]["fblimit_2"] / r[be][key] for r in B], rx) if all(key in r[be] for r in B) else "–"
            rows.append((be, "32 x 2 MiB by id", label, b, mmm([r[be]["fblimit_2"] / r[be][key] for r in A], rx)))
    n = 10000
    if be == "nixl":
        lim = "raw_small_batched_s"
    else:  # the first round's benchmark had no memmove limit: its torch copy_ per record then
        lim = "memmove_small_loop_s" if all("memmove_small_loop_s" in r[be] for r in B + A) else "memcpy_small_loop_s"
    for key, label in (
        ("api_batches_small_s", "iter_batches"),
        ("api_small_s", "iter_records"),
        ("raw_small_batched_s", "LIMIT raw NIXL 256/request"),
        ("raw_small_single_s", "raw NIXL 1/request"),
        ("memcpy_small_loop_s", "torch copy_ 1/record" + (" (LIMIT)" if lim == "memcpy_small_loop_s" else "")),
        ("memmove_small_loop_s", "C memmove 1/record" + (" (LIMIT)" if lim == "memmove_small_loop_s" else "")),
        ("publish_small_s", "publish() in caller"),
        ("publish_nowait_small_s", "publish_nowait() in caller, wall"),
        ("publish_nowait_small_cpu_s", "publish_nowait() in caller, CPU"),
        ("drain_small_s", "publish_nowait(): writer drain after"),
    ):
        if all(key in r[be] for r in A):
            b = mmm([r[be][key] / n * 1e6 for r in B], us) if all(key in r[be] for r in B) else "–"
            rows.append((be, "4 KiB x 10,000", label + " (us/record)", b, mmm([r[be][key] / n * 1e6 for r in A], us)))
    for key, label in (("api_batches_small_s", "iter_batches"), ("api_small_s", "iter_records")):
        if not all(key in r[be] for r in A):
            continue
        b = mmm([r[be][lim] / r[be][key] for r in B], rx) if all(key in r[be] for r in B) else "–"
        rows.append((be, "4 KiB x 10,000", f"RATIO {label} / limit", b, mmm([r[be][lim] / r[be][key] for r in A], rx)))
print(f"| backend | case | figure | before: min / median / max (n={len(B)}) | after: min / median / max (n={len(A)}) |")
print("|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
