#!/usr/bin/env python3
"""Where a prefill pass's link is idle, by the device's clock.

Reads the stderr of a `tandem moe` run built with probe.patch and run with TANDEM_PROBE=1,
--time-link and --time-chain: every expert copy's interval (queue, layer, expert, start, end, in
ms from the streamer's first marker) and every layer's chain markers on the compute queue
(routed, started, device, joined, combined); with probe2.patch also the host's clock when each
copy was issued and at points of the pass (aligned to the device's by layer 0's routing: the
host wakes when it lands). Takes the timed overlapped pass of the largest
ubatch (the last such pass in the file) and prints, per layer, its markers and its copies' span,
then every interval of 20 us or more in which the link had no copy, with what came next.

    python3 gaps.py probe.err
"""
import sys

MARKS = ["routed", "started", "device", "joined", "combined"]

passes, cur = [], {"spans": [], "chain": [], "issue": {}, "host": []}
for line in open(sys.argv[1]):
    f = line.split()
    if not f:
        continue
    if f[0] == "span":
        cur["spans"].append((f[1], int(f[2]), int(f[3]), float(f[4]), float(f[5])))
    elif f[0] == "issue":
        cur["issue"].setdefault((f[1], int(f[2]), int(f[3])), float(f[4]))
    elif f[0] == "host":
        cur["host"].append((f[1], int(f[2]), float(f[3])))
    elif f[0] == "chain":
        cur["chain"].append((int(f[1]), int(f[2]), float(f[3])))
    elif f[0] == "pass":
        kv = dict(x.split("=") for x in f[2:])
        cur.update(T=int(kv["T"]), overlap=int(kv["overlap"]), seconds=float(kv["seconds"]),
                   bytes=int(kv["bytes"]))
        passes.append(cur)
        cur = {"spans": [], "chain": [], "issue": {}, "host": []}

ovl = [p for p in passes if p["overlap"] and p["chain"]]
Tmax = max(p["T"] for p in ovl)
p = [q for q in ovl if q["T"] == Tmax][-1]
start = min(c[2] for c in p["chain"] if c[0] < 0)
end = max(c[2] for c in p["chain"])
spans = sorted(p["spans"], key=lambda s: s[3])
print("pass: T=%d, %.3f ms by the host, %.3f GB copied in %d copies (%d demand)" % (
    p["T"], p["seconds"] * 1e3, p["bytes"] / 1e9, len(spans), sum(s[0] == "D" for s in spans)))
print("times in ms from the pass's start marker; the last marker at %.3f" % (end - start))
first = min([s[3] for s in spans] + [start])
print("first copy starts at %.3f" % (first - start))

# host clock -> device clock, by layer 0's routing
off = None
hr = [h[2] for h in p["host"] if h[0] == "routed" and h[1] == 0]
dr = [c[2] for c in p["chain"] if c[0] == 0 and c[1] == 0]
if hr and dr:
    off = hr[0] - dr[0]
    print("host, on the device's clock: " + ", ".join(
        "%s %d %.3f" % (h[0], h[1], h[2] - off - start) for h in p["host"]))
    print("first copies: issued -> start .. end")
    for s_ in spans[:24]:
        i = p["issue"].get((s_[0], s_[1], s_[2]))
        print("  %s %d %d: %s -> %.3f .. %.3f" % (s_[0], s_[1], s_[2],
              "?" if i is None else "%.3f" % (i - off - start), s_[3] - start, s_[4] - start))

layers = sorted({c[0] for c in p["chain"] if c[0] >= 0})
for l in layers:
    m = {k: t - start for (ll, k, t) in p["chain"] if ll == l}
    ls = [s for s in spans if s[1] == l]
    cs = " ".join("%s %.3f" % (MARKS[k], m[k]) for k in sorted(m))
    if ls:
        cs += "; copies %d: %.3f .. %.3f" % (len(ls), min(s[3] for s in ls) - start,
                                            max(s[4] for s in ls) - start)
    print("layer %d: %s" % (l, cs))

# idle intervals of the link: between the union of the spans
busy, idle, t = 0.0, [], None
for s in spans:
    if t is None:
        t = s[4]
        busy += s[4] - s[3]
        continue
    if s[3] > t:
        if s[3] - t >= 0.02:
            idle.append((t, s[3] - t, s))
        busy += s[4] - s[3]
        t = s[4]
    elif s[4] > t:
        busy += s[4] - t
        t = s[4]
span_all = end - start
print("link busy %.3f ms of %.3f (%.3f); idle before the first copy %.3f, after the last %.3f" % (
    busy, span_all, busy / span_all, first - start, end - t))
tot = 0.0
for (a, d, s) in idle:
    tot += d
    # the layer whose markers bracket the gap
    near = [(ll, k, tt - start) for (ll, k, tt) in p["chain"] if ll >= 0 and abs(tt - a) < 1.0]
    i = p["issue"].get((s[0], s[1], s[2])) if off is not None else None
    print("idle %.3f ms at %.3f, then %s layer %d expert %d%s; markers near: %s" % (
        d, a - start, s[0], s[1], s[2], "" if i is None else " (issued %.3f)" % (i - off - start),
        ", ".join("%d.%s %.3f" % (ll, MARKS[k], tt) for (ll, k, tt) in near)))
print("idle inside the pass (gaps of 20 us or more): %.3f ms" % tot)
