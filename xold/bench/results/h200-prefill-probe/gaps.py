# The expert copies of one pass in a tandem trace: when the link (the streamer's two copy
# queues, tids 5 and 6 of cuda:0) was busy and idle. Usage: gaps.py TRACE FROM_MS TO_MS (the
# pass: from the compute queue's first command after FROM_MS to TO_MS, its final sync).
import json, sys, collections
d = json.load(open(sys.argv[1]))
ev = [e for e in d['traceEvents'] if e['ph']=='X' and e['pid']==1]
lo, hi = float(sys.argv[2])*1e3, float(sys.argv[3])*1e3
cq = sorted([e for e in ev if e['tid']==4 and lo <= e['ts'] <= hi], key=lambda e:e['ts'])
t0 = cq[0]['ts']; t1 = hi
cp = sorted([(e['ts'], e['ts']+e['dur'], e['tid']) for e in ev if e['name']=='memcpy' and e['tid'] in (5,6) and t0 <= e['ts'] <= t1])
print('pass from %.3f to %.3f ms: %.2f ms; copies %d' % (t0/1e3, t1/1e3, (t1-t0)/1e3, len(cp)))
busy=0; gaps=[]; cur_s, cur_e = cp[0][0], cp[0][1]
for s,e,t in cp[1:]:
    if s > cur_e:
        busy += cur_e-cur_s; gaps.append((cur_e, s)); cur_s, cur_e = s, e
    else: cur_e = max(cur_e, e)
busy += cur_e-cur_s
print('first copy at +%.3f ms, last ends at +%.3f ms (%.3f before the end); busy %.2f ms' % ((cp[0][0]-t0)/1e3, (cur_e-t0)/1e3, (t1-cur_e)/1e3, busy/1e3))
big = [(a,b) for a,b in gaps if b-a > 20]
print('gaps > 20us: %d, total %.2f ms; all gaps %.2f ms' % (len(big), sum(b-a for a,b in big)/1e3, sum(b-a for a,b in gaps)/1e3))
cqm = [e for e in cq if e['name']=='memcpy']
for a,b in big:
    near = [ '%s+%.3f(%.3f)' % (e['name'], (e['ts']-t0)/1e3, e['dur']/1e3) for e in cq if e['name'] in ('memcpy','wait') and a-3000 <= e['ts'] <= b+500]
    print('  +%.3f ms: %.3f ms idle; compute queue near: %s' % ((a-t0)/1e3, (b-a)/1e3, ' '.join(near[-6:])))
print('compute-queue memcpys:', ' '.join('+%.3f(%.3f)' % ((e['ts']-t0)/1e3, e['dur']/1e3) for e in cqm))
