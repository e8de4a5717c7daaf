#!/usr/bin/python3
"""test-json.py: whatever the tandem tool prints with --json parses, and so does every Chrome
trace the runtime writes for it (--trace FILE, $TANDEM_TRACE), edge cases included: a budget
that keeps every expert resident (nothing copied, so no hidden fraction), a budget of 0, a
trace whose path holds a quote, a backslash, a tab and a byte that is not UTF-8, a trace of no
commands at all. The `moe` runs also say where their experts were found: every acquire counts
once as resident, in flight or a demand miss, and experts computed on the host come on top
(experts = acquires + host_experts); all resident shows resident hits only; decode under LRU
with no budget and placement device has demand misses and copies bytes every token; placement
host copies nothing for decode, computes experts on the host and passes the tolerance check.

usage: test-json.py TANDEM DEVICE

TANDEM is the tool, DEVICE the device to run on (cpu:0, opencl:0). Exit codes: 0 ok, 1 a check
failed, 77 DEVICE is not there (skipped).
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

TIMEOUT = 240


class Failed(Exception):
    pass


def reject_constant(name):
    # Python's json reads NaN and Infinity; JSON has neither.
    raise ValueError(f"{name} is not JSON")


def parse(data, what):
    try:
        return json.loads(data.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise Failed(f"{what} is not JSON: {e}\n--- it reads:\n{data.decode('utf-8', 'replace')}")


def run(tool, args, what, env=None):
    """Runs the tool (args: bytes), expects exit 0, returns (stdout parsed, the command line)."""
    argv = [os.fsencode(tool)] + args
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=TIMEOUT, env=env)
    if proc.returncode != 0:
        raise Failed(f"{what}: exit {proc.returncode}\n{proc.stderr.decode('utf-8', 'replace')}")
    return parse(proc.stdout, f"{what}: stdout"), b" ".join(argv).decode("utf-8", "replace")


def check_trace(path, what, commands):
    with open(path, "rb") as f:
        trace = parse(f.read(), f"{what}: the trace {path!r}")
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        raise Failed(f"{what}: the trace has no traceEvents")
    ran = sum(1 for e in events if e.get("ph") == "X")
    if commands and ran == 0:
        raise Failed(f"{what}: the trace holds no command")
    if not commands and ran != 0:
        raise Failed(f"{what}: the trace holds {ran} commands where none ran")


def check_header(doc, command, what):
    """The members every report of the tool starts with."""
    if doc.get("command") != command:
        raise Failed(f"{what}: command is {doc.get('command')!r}, not {command!r}")
    for key in ("commit", "tandem_version", "date"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise Failed(f"{what}: no {key}")
    if not isinstance(doc.get("machine"), dict):
        raise Failed(f"{what}: no machine")


def check_number_or_null(doc, key, what):
    v = doc.get(key, "missing")
    if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
        raise Failed(f"{what}: {key} is {v!r}")
    return v


def devices(tool, device, tmp):
    doc, _ = run(tool, [b"devices", b"--json"], "devices --json")
    ids = [d["id"] for d in doc["devices"]]
    if not isinstance(doc.get("backends"), list) or not doc.get("version"):
        raise Failed("devices --json: no backends or no version")
    # Loading the backends is all `devices` does with the runtime: a trace of no commands.
    trace = os.path.join(tmp, "devices.json")
    env = dict(os.environ, TANDEM_TRACE=trace)
    run(tool, [b"devices", b"--json"], "TANDEM_TRACE=... devices --json", env)
    check_trace(trace, "TANDEM_TRACE=... devices --json", commands=False)
    return ids


def check_found(r, prefix, what, host=False):
    """Every acquire counts once: resident, in flight or a demand miss; hit_rate is the first
    two together; experts computed on the host are not acquired, and there are none unless
    `host` (a run that may place experts on the host)."""
    get = lambda key: r[prefix + key]
    n = get("acquires")
    if get("resident_hits") + get("inflight_hits") + get("demand_misses") != n:
        raise Failed(f"{what}: run {r['name']!r}: {prefix}resident + in flight + misses "
                     f"!= {n} acquires")
    if not host and get("host_experts") != 0:
        raise Failed(f"{what}: run {r['name']!r}: {get('host_experts')} {prefix}host experts")
    if not prefix and r["experts"] != n + get("host_experts"):
        raise Failed(f"{what}: run {r['name']!r}: {r['experts']} experts computed, not "
                     f"{n} acquires + {get('host_experts')} on the host")
    if n and abs(get("hit_rate") - (get("resident_hits") + get("inflight_hits")) / n) > 1e-3:
        raise Failed(f"{what}: run {r['name']!r}: {prefix}hit_rate {get('hit_rate')}")


def moe(tool, device, tmp):
    base = [b"moe", b"--device", device.encode(), b"--tokens", b"16", b"--json"]
    # Every expert resident: nothing is copied, so there is no hidden fraction.
    what = "moe --device-budget 100%"
    doc, command = run(tool, base + [b"--device-budget", b"100%"], what)
    check_header(doc, command, what)
    if check_number_or_null(doc, "hidden_fraction", what) is not None:
        raise Failed(f"{what}: a hidden fraction of {doc['hidden_fraction']} with nothing copied")
    for r in doc["runs"]:
        if r["host_experts"] != 0 or r["check"] not in (None, "bitwise"):
            raise Failed(f"{what}: run {r['name']!r}: {r['host_experts']} host experts with "
                         f"every expert resident, check {r['check']!r}")
        if r["bytes_copied"] != 0:
            raise Failed(f"{what}: run {r['name']!r} copied {r['bytes_copied']} bytes")
        check_found(r, "", what)
        if r["resident_hits"] != r["acquires"] or not r["acquires"]:
            raise Failed(f"{what}: run {r['name']!r}: {r['resident_hits']} resident hits of "
                         f"{r['acquires']} acquires")
    # Nothing resident, with decode: every figure is a number or null.
    what = "moe --device-budget 0 --decode 2"
    doc, command = run(tool, base + [b"--device-budget", b"0", b"--decode", b"2"], what)
    check_header(doc, command, what)
    for key in ("hidden_fraction", "overlap_efficiency", "link_utilization",
                "decode_bound_tokens_per_s"):
        check_number_or_null(doc, key, what)
    if doc.get("check") != "ok":
        raise Failed(f"{what}: check is {doc.get('check')!r}")
    # Decode under LRU with a budget that holds none of the working set: the serialized run
    # copies nothing ahead, so it has demand misses and copies bytes every token.
    what = "moe --device-budget 0 --cache-policy lru --decode 4 --placement device"
    doc, command = run(tool, base + [b"--device-budget", b"0", b"--cache-policy", b"lru",
                                     b"--decode", b"4", b"--slots", b"2",
                                     b"--placement", b"device"], what)
    check_header(doc, command, what)
    for r in doc["runs"]:
        check_found(r, "", what)
        check_found(r, "decode_", what)
        # each decode token's latency: median <= 90th percentile <= maximum, all positive
        lat = [r.get("decode_token_ms_" + k) for k in ("p50", "p90", "max")]
        if not (all(isinstance(v, (int, float)) for v in lat) and 0 < lat[0] <= lat[1] <= lat[2]):
            raise Failed(f"{what}: run {r['name']!r}: decode token latency (p50, p90, max) {lat}")
    ser = [r for r in doc["runs"] if r["name"] == "streamed, serialized"][0]
    if not (ser["decode_demand_misses"] > 0 and ser["decode_bytes_per_token"] > 0):
        raise Failed(f"{what}: serialized decode has {ser['decode_demand_misses']} demand "
                     f"misses and copies {ser['decode_bytes_per_token']} bytes a token")
    if not (doc["decode_bytes_per_token"] > 0 and doc["decode_bound_tokens_per_s"] > 0):
        raise Failed(f"{what}: decode copies {doc['decode_bytes_per_token']} bytes a token, "
                     f"bound {doc['decode_bound_tokens_per_s']}")
    if doc.get("placement") != "device" or doc.get("host_share") != 0:
        raise Failed(f"{what}: placement {doc.get('placement')!r}, share {doc.get('host_share')}")
    for key in ("decode_split_bound_tokens_per_s", "decode_best_split_bound_tokens_per_s"):
        if doc.get(key, 0) is not None:
            raise Failed(f"{what}: {key} is {doc.get(key)!r} with no expert on the host")
    # Placement host: every decode expert not on the device is computed on the host, so decode
    # copies nothing; the check ran within the tolerance; the calibration is reported.
    what = "moe --device-budget 0 --cache-policy lru --decode 4 --placement host"
    doc, command = run(tool, base + [b"--device-budget", b"0", b"--cache-policy", b"lru",
                                     b"--decode", b"4", b"--slots", b"2", b"--placement",
                                     b"host", b"--host-queues", b"2"], what)
    check_header(doc, command, what)
    if doc.get("check") != "ok" or doc.get("placement") != "host" or doc.get("host_queues") != 2:
        raise Failed(f"{what}: check {doc.get('check')!r}, placement {doc.get('placement')!r}, "
                     f"{doc.get('host_queues')} host queues")
    if not (isinstance(doc.get("host_threads"), int) and doc["host_threads"] >= 1):
        raise Failed(f"{what}: host_threads is {doc.get('host_threads')!r}")
    # tiny's top-k of 4, none resident, dealt over 2 queues: calls of 2 experts calibrated.
    if doc.get("host_group") != 2:
        raise Failed(f"{what}: host_group is {doc.get('host_group')!r}, not 2")
    for key in ("link_gbs", "host_gbs", "link_gbs_shared", "host_gbs_shared"):
        if not (isinstance(doc.get(key), (int, float)) and doc[key] > 0):
            raise Failed(f"{what}: {key} is {doc.get(key)!r}")
    if not 0 <= doc.get("host_share", -1) <= 1:
        raise Failed(f"{what}: host_share is {doc.get('host_share')!r}")
    if doc.get("host_share_model") != doc.get("host_share") or doc.get("predict_depth") != 0:
        raise Failed(f"{what}: host_share_model {doc.get('host_share_model')!r} (share "
                     f"{doc.get('host_share')!r}), predict_depth {doc.get('predict_depth')!r}")
    for r in doc["runs"]:
        streamed = r["name"] != "all resident"
        check_found(r, "", what, host=streamed)
        check_found(r, "decode_", what, host=streamed)
        if streamed and not (r["decode_host_experts"] > 0 and r["decode_bytes_copied"] == 0
                             and r["check"] == "rel_l2" and r["matches_resident"]):
            raise Failed(f"{what}: run {r['name']!r}: {r['decode_host_experts']} decode host "
                         f"experts, {r['decode_bytes_copied']} decode bytes copied, check "
                         f"{r['check']!r} {r['matches_resident']}")
    # The host's bytes a decode token and the bounds the calibrated rates set from them: the
    # best split of the same bytes is never slower than this run's.
    main = [r for r in doc["runs"] if r["name"] == "streamed, overlapped"][0]
    want = main["decode_host_experts"] * doc["expert_bytes"] / doc["decode"]
    if abs(doc.get("decode_host_bytes_per_token", -1) - want) > 1:
        raise Failed(f"{what}: decode_host_bytes_per_token {doc.get('decode_host_bytes_per_token')}"
                     f", {want} from the host experts")
    split = doc.get("decode_split_bound_tokens_per_s")
    best = doc.get("decode_best_split_bound_tokens_per_s")
    if not (isinstance(split, (int, float)) and isinstance(best, (int, float)) and
            0 < split <= best * (1 + 1e-6)):
        raise Failed(f"{what}: decode bounds {split} with this split, {best} with the best")
    if doc.get("time_link") is not False or main.get("decode_link_busy_fraction") is not None \
            or main.get("link_busy_fraction") is not None or main.get("link_busy_gbs") is not None:
        raise Failed(f"{what}: time_link {doc.get('time_link')!r}, decode_link_busy_fraction "
                     f"{main.get('decode_link_busy_fraction')!r}, link_busy_fraction "
                     f"{main.get('link_busy_fraction')!r}, link_busy_gbs "
                     f"{main.get('link_busy_gbs')!r} without --time-link")
    if doc.get("time_host") is not False or main.get("decode_host_busy_fraction") is not None:
        raise Failed(f"{what}: time_host {doc.get('time_host')!r}, decode_host_busy_fraction "
                     f"{main.get('decode_host_busy_fraction')!r} without --time-host")
    if doc.get("time_chain") is not False or main.get("decode_chain_us", 0) is not None:
        raise Failed(f"{what}: time_chain {doc.get('time_chain')!r}, decode_chain_us "
                     f"{main.get('decode_chain_us', 0)!r} without --time-chain")
    # --time-host with every expert on the host, on one host queue: the host computed experts
    # for part of each streamed run's decode, by the host queue's clock. --time-chain: each
    # streamed run's decode layers, by the compute queue's clock, in five parts of at least 0
    # (the routing's way back above 0) that add up to no more than a layer's share of decode;
    # the all-resident run routes on the device and has none.
    what = ("moe --device-budget 0 --cache-policy lru --decode 4 --placement host --time-host "
            "--time-chain")
    doc, command = run(tool, base + [b"--device-budget", b"0", b"--cache-policy", b"lru",
                                     b"--decode", b"4", b"--slots", b"2", b"--placement",
                                     b"host", b"--time-host", b"--time-chain"], what)
    check_header(doc, command, what)
    if doc.get("time_host") is not True or doc.get("time_chain") is not True:
        raise Failed(f"{what}: time_host {doc.get('time_host')!r}, time_chain "
                     f"{doc.get('time_chain')!r}")
    parts = ["route", "submit", "device", "join", "combine"]
    for r in doc["runs"]:
        f = r.get("decode_host_busy_fraction")
        if r["name"] != "all resident" and not (isinstance(f, (int, float)) and 0 < f <= 1.05):
            raise Failed(f"{what}: run {r['name']!r}: decode_host_busy_fraction {f!r}")
        chain = r.get("decode_chain_us", 0)
        if r["name"] == "all resident":
            if chain is not None:
                raise Failed(f"{what}: the all-resident run has decode_chain_us {chain!r}")
            continue
        layer_us = 1e6 / r["decode_tokens_per_s"] / doc["layers"]
        if not (isinstance(chain, dict) and sorted(chain) == sorted(parts) and
                all(isinstance(chain[p], (int, float)) and chain[p] >= 0 for p in parts) and
                chain["route"] > 0 and sum(chain.values()) <= 1.05 * layer_us + 100):
            raise Failed(f"{what}: run {r['name']!r}: decode_chain_us {chain!r} (a layer "
                         f"of decode takes {layer_us:.1f} us)")
    # --time-link with every expert copied: the link had a copy on it for part of each streamed
    # run's decode, by the device's clock (a little slack for that clock against the host's).
    what = "moe --device-budget 0 --cache-policy lru --decode 4 --placement device --time-link"
    doc, command = run(tool, base + [b"--device-budget", b"0", b"--cache-policy", b"lru",
                                     b"--decode", b"4", b"--slots", b"2", b"--placement",
                                     b"device", b"--time-link"], what)
    check_header(doc, command, what)
    for r in doc["runs"]:
        f = r.get("decode_link_busy_fraction")
        if r["name"] != "all resident" and not (isinstance(f, (int, float)) and 0 < f <= 1.05):
            raise Failed(f"{what}: run {r['name']!r}: decode_link_busy_fraction {f!r}")
        # The whole run likewise, and the link's rate while busy: the bytes over that time.
        f, g = r.get("link_busy_fraction"), r.get("link_busy_gbs")
        if r["name"] == "all resident":
            if f != 0 or g is not None:
                raise Failed(f"{what}: the all-resident run: link_busy_fraction {f!r}, "
                             f"link_busy_gbs {g!r} with nothing copied")
        elif not (isinstance(f, (int, float)) and 0 < f <= 1.05 and isinstance(g, (int, float))
                  and g > 0):
            raise Failed(f"{what}: run {r['name']!r}: link_busy_fraction {f!r}, "
                         f"link_busy_gbs {g!r}")
    # A trace whose path needs escaping in the command string, and is not even UTF-8.
    trace = os.path.join(os.fsencode(tmp), b'a "quoted" \\ back\tslash \xff.json')
    what = "moe --trace <a path with a quote, a backslash, a tab, a byte not UTF-8>"
    doc, command = run(tool, base + [b"--trace", trace], what)
    check_header(doc, command, what)
    check_trace(trace, what, commands=True)


def overlap(tool, device, tmp):
    trace = os.path.join(tmp, 'overlap "trace".json')
    what = "bench overlap --json --trace"
    doc, command = run(tool, [b"bench", b"overlap", b"--device", device.encode(), b"--reps", b"1",
                              b"--chunks", b"4", b"--chunk-bytes", b"256K", b"--json",
                              b"--trace", trace.encode()], what)
    check_header(doc, command, what)
    for key in ("speedup", "overlap_efficiency", "hidden_fraction"):
        check_number_or_null(doc, key, what)
    check_trace(trace, what, commands=True)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tool, device = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="tandem-json-")
    try:
        ids = devices(tool, device, tmp)
        if device not in ids:
            print(f"skipped: no {device} here (devices: {', '.join(ids)})")
            return 77
        moe(tool, device, tmp)
        overlap(tool, device, tmp)
    except (Failed, subprocess.TimeoutExpired) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"ok: devices, moe and bench overlap on {device} print JSON, and their traces are JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
