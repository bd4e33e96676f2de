import json, statistics as st, glob
D="benchmarks/results/user_loops_2026-12-02"
def runs(kind):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{D}/{kind}-[0-9].json"))+sorted(glob.glob(f"{D}/large-{kind}-[0-9].json"))]
rows={}
for kind in ("before","after"):
    for r in runs(kind):
        for be in ("nixl","shm"):
            L=r[be]["large"]; lim=st.median(L["limit"]); lmin=min(L["limit"])
            for case,v in L.items():
                if case=="limit" or not v["times"]: continue
                rows.setdefault((be,case),{}).setdefault(kind,[]).append((lim/st.median(v["times"]), lmin/min(v["times"])))
def f(xs): 
    xs=sorted(xs); return f"{xs[0]:.2f} / {st.median(xs):.2f} / {xs[-1]:.2f}"
print("| backend | loop (64 MiB) | before: ratio of medians | after: ratio of medians | before: ratio of minimums | after: ratio of minimums |")
print("|---|---|---|---|---|---|")
for (be,case),d in rows.items():
    b=d.get("before",[]); a=d.get("after",[])
    print(f"| {be} | {case} | {f([x[0] for x in b])} | {f([x[0] for x in a])} | {f([x[1] for x in b])} | {f([x[1] for x in a])} |")
loads=[]
for f_ in glob.glob(f"{D}/*.json"):
    j=json.load(open(f_)); loads+= [j.get("load_start",[0])[0], j.get("load_end",[0])[0]]
print("load", min(loads), max(loads))
