"""The fourth round's table (docs/benchmarks.md): ratio of medians and of minimums per loop, before -> after."""

import glob
import json
import statistics as st

D = "benchmarks/results/user_loops_2026-12-02"


def runs(kind: str) -> list[dict]:
    names = sorted(glob.glob(f"{D}/{kind}-[0-9].json")) + sorted(glob.glob(f"{D}/large-{kind}-[0-9].json"))
    return [json.load(open(f)) for f in names]


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.2f} / {st.median(xs):.2f} / {xs[-1]:.2f}" if xs else "-"


rows: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
for kind in ("before", "after"):
    for r in runs(kind):
        for be in ("nixl", "shm"):
            large = r[be]["large"]
            lim, lmin = st.median(large["limit"]), min(large["limit"])
            for case, v in large.items():
                if case == "limit" or not v["times"]:
                    continue
                ratio = (lim / st.median(v["times"]), lmin / min(v["times"]))
                rows.setdefault((be, case), {}).setdefault(kind, []).append(ratio)
print("| backend | loop (64 MiB) | before: ratio of medians | after | before: ratio of minimums | after |")
print("|---|---|---|---|---|---|")
for (be, case), d in rows.items():
    b, a = d.get("before", []), d.get("after", [])
    med = (spread([x[0] for x in b]), spread([x[0] for x in a]))
    mins = (spread([x[1] for x in b]), spread([x[1] for x in a]))
    print(f"| {be} | {case} | {med[0]} | {med[1]} | {mins[0]} | {mins[1]} |")
loads: list[float] = []
for name in glob.glob(f"{D}/*.json"):
    j = json.load(open(name))
    loads += [j.get("load_start", [0])[0], j.get("load_end", [0])[0]]
print("load", min(loads), max(loads))
