/* opencl/ops.c: the OpenCL backend's MoE operations (tdm_moe__opencl_ops, a table of
 * tandem/moe_ops.h), with kernels of our own and CLBlast's SGEMM.
 *
 * Everything is enqueued on the queue's cl_command_queue (tdm_queue_native): ordinary native
 * commands, so tandem's markers and syncs cover them. Every kernel argument is a (cl_mem,
 * offset in elements) pair resolved from a tandem pointer with tdm_mem_native. Compute is f32
 * (OpenCL 1.2 has no bf16, and PoCL no fp16): the expert's bf16 weights are widened into the
 * workspace, then CLBlastSgemm does gate|up (Wg and Wu are adjacent: one GEMM of width 2I, as
 * in the CPU table) and down. experts(), made for few tokens per expert, skips both the
 * widening and the GEMMs: two matrix-vector kernels over every entry of the group table at
 * once read the bf16 weights directly, once per chunk of tokens; group() is one work-group
 * that sorts the routing by expert on the device. Each open() builds the program for its
 * queue's device (drivers keep a cache of built binaries, PoCL on disk, so a model's later
 * opens are cheap) and a build failure quotes the build log. Only tandem's public API and
 * its OpenCL interop (tandem/opencl.h) are used: the context is tdm_device_native's, the
 * device the queue's.
 *
 * Determinism: no atomics; every sum has a fixed order that does not depend on how work-items
 * are scheduled: rmsnorm is a fixed tree in one work-group per token, a router logit is one
 * work-item's serial dot product, combine sums j ascending, experts() sums each (token, row)
 * in a fixed order and a fixed tree whatever the chunk, entry or group it falls in (so any
 * split of a layer's experts gives the same bits), group() places the routing's entries by
 * scanning idx in order. CLBlast picks its GEMM kernels and their tiling from (device, m, n,
 * k), so for fixed shapes its reduction order is fixed too.
 *
 * Deferral. On drivers where tandem gates host work on the host (TANDEM_OPENCL_DEFER, PoCL's
 * basic driver: TDM_DEVICE_CAP_HOST_DEFERRAL), a host task holds the later commands of its
 * queue on the host, unsubmitted, and native work enqueued meanwhile would overtake them. So,
 * as tandem/opencl.h advises, when the queue has such held work, an op is itself submitted as
 * a host task that enqueues its commands when it runs (in-order queues only, which open()
 * requires). Otherwise ops enqueue directly and never block the caller.
 *
 * A transformer's other operations (get_rows, matmul, rope, attention) are in xfmr.c, their
 * kernels in the same program (ocl_ops.h holds what the two files share).
 *
 * Errors: 0 or a negative TDM_E* code with tandem's message set (tdm_set_error): TDM_EINVAL
 * for arguments, TDM_ERANGE for a buffer too small, TDM_ENOMEM when OpenCL or CLBlast ran out
 * of memory, TDM_EBACKEND for any other OpenCL or CLBlast failure. Indices are device data
 * written by earlier commands: a row outside x gathers zeros and a slot outside out is not
 * written (a kernel cannot report TDM_ERANGE as the CPU table does), as in the CUDA table;
 * experts() skips a token whose row or slot is out of range, and an entry whose tokens leave
 * [0, n) or whose weights leave wbase's allocation. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu/task.h" /* host calls are host tasks, as on the CPU */
#include "ocl_ops.h" /* the state, kernels and helpers xfmr.c shares */
#include "tandem/opencl.h"

#define MOE_WG_MAX 256 /* work-group size ceiling: the largest power of two the device takes */
/* experts()'s kernels, on GPUs: a team of a warp's width per weight row, so that the team's
 * loads of a row are contiguous and its tree short, while a work-group covers several rows.
 * On CPU devices a work-item takes whole rows (its float8 loads are the contiguous ones, and
 * the work-group needs no barrier), and smaller work-groups spread few rows over the cores. */
#define MOE_TEAM_GPU 32
#define MOE_XWG_CPU 64

/* ---- kernels ---- */

/* Built with -DMOE_WG=<the work-group size>, and experts()'s -DMOE_XWG=<work-group size>
 * -DMOE_TEAM=<work-items per weight row, which divides it>. Buffers are (pointer, offset in
 * elements). */
static const char moe_cl_source[] =
    "float bf16(ushort h) { return as_float((uint)h << 16); }\n"
    "\n"
    "/* One work-group per token; a fixed tree. y may alias x. */\n"
    "__kernel void moe_rmsnorm(__global float *yb, ulong yo, __global const float *xb, ulong xo,\n"
    "                          __global const float *wb, ulong wo, int H, float eps) {\n"
    "  __local float part[MOE_WG];\n"
    "  const int l = (int)get_local_id(0);\n"
    "  const size_t t = get_group_id(0);\n"
    "  __global const float *x = xb + xo + t * (size_t)H;\n"
    "  __global float *y = yb + yo + t * (size_t)H;\n"
    "  __global const float *w = wb + wo;\n"
    "  float acc = 0.0f;\n"
    "  for (int c = l; c < H; c += MOE_WG) acc = fma(x[c], x[c], acc);\n"
    "  part[l] = acc;\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (int s = MOE_WG / 2; s > 0; s >>= 1) {\n"
    "    if (l < s) part[l] += part[l + s];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  const float inv = 1.0f / sqrt(part[0] / (float)H + eps);\n"
    "  for (int c = l; c < H; c += MOE_WG) y[c] = x[c] * inv * w[c];\n"
    "}\n"
    "\n"
    "/* One work-group per token. Work-items take experts round-robin, each logit one serial\n"
    " * dot product (h ascending) plus the bias; then work-item 0 does the softmax and the top\n"
    " * k as the CPU table does: ties to the lower index, NaN ranks lowest. */\n"
    "__kernel void moe_router(__global const float *xb, ulong xo, __global const ushort *wb,\n"
    "                         ulong wo, __global const float *bb, ulong bo, int has_bias, int H,\n"
    "                         int E, int k, int renorm, __global int *ib, ulong io,\n"
    "                         __global float *pb, ulong po, __local float *p,\n"
    "                         __local uchar *taken) {\n"
    "  const int l = (int)get_local_id(0);\n"
    "  const size_t t = get_group_id(0);\n"
    "  __global const float *x = xb + xo + t * (size_t)H;\n"
    "  for (int e = l; e < E; e += MOE_WG) {\n"
    "    __global const ushort *we = wb + wo + (size_t)e * H;\n"
    "    float acc = 0.0f;\n"
    "    for (int c = 0; c < H; c++) acc = fma(x[c], bf16(we[c]), acc);\n"
    "    p[e] = has_bias ? acc + bb[bo + e] : acc;\n"
    "    taken[e] = 0;\n"
    "  }\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  if (l != 0) return;\n"
    "  float m = p[0], sum = 0.0f, chosen = 0.0f;\n"
    "  for (int e = 1; e < E; e++)\n"
    "    if (p[e] > m) m = p[e];\n"
    "  for (int e = 0; e < E; e++) {\n"
    "    p[e] = exp(p[e] - m);\n"
    "    sum += p[e];\n"
    "  }\n"
    "  for (int e = 0; e < E; e++) p[e] = p[e] / sum;\n"
    "  __global int *idx = ib + io + t * (size_t)k;\n"
    "  __global float *wt = pb + po + t * (size_t)k;\n"
    "  for (int j = 0; j < k; j++) {\n"
    "    int best = -1;\n"
    "    float bp = 0.0f;\n"
    "    for (int e = 0; e < E; e++) {\n"
    "      if (taken[e]) continue;\n"
    "      float v = isnan(p[e]) ? -INFINITY : p[e];\n"
    "      if (best < 0 || v > bp) {\n"
    "        best = e;\n"
    "        bp = v;\n"
    "      }\n"
    "    }\n"
    "    taken[best] = 1;\n"
    "    idx[j] = best;\n"
    "    wt[j] = p[best];\n"
    "    chosen += p[best];\n"
    "  }\n"
    "  if (renorm)\n"
    "    for (int j = 0; j < k; j++) wt[j] = wt[j] / chosen;\n"
    "}\n"
    "\n"
    "__kernel void moe_widen(__global float *db, ulong dofs, __global const ushort *sb,\n"
    "                        ulong sofs, ulong n) {\n"
    "  const size_t i = get_global_id(0);\n"
    "  if (i < n) db[dofs + i] = bf16(sb[sofs + i]);\n"
    "}\n"
    "\n"
    "/* (column, token): out-of-range rows gather zeros. */\n"
    "__kernel void moe_gather(__global float *db, ulong dofs, __global const float *xb,\n"
    "                         ulong xofs, __global const int *rb, ulong rofs, int H,\n"
    "                         uint limit) {\n"
    "  const size_t c = get_global_id(0), i = get_global_id(1);\n"
    "  if (c >= (size_t)H) return;\n"
    "  const uint r = (uint)rb[rofs + i];\n"
    "  db[dofs + i * H + c] = r < limit ? xb[xofs + (size_t)r * H + c] : 0.0f;\n"
    "}\n"
    "\n"
    "/* gate[j] = silu(gate[j]) * up[j] in place, in rows of [gate (I) | up (I)]. */\n"
    "__kernel void moe_swiglu(__global float *gb, ulong gofs, int I) {\n"
    "  const size_t j = get_global_id(0), i = get_global_id(1);\n"
    "  if (j >= (size_t)I) return;\n"
    "  __global float *g = gb + gofs + i * 2 * (size_t)I;\n"
    "  const float v = g[j];\n"
    "  g[j] = v / (1.0f + exp(-v)) * g[I + j];\n"
    "}\n"
    "\n"
    "/* (column, token): out-of-range slots are not written. */\n"
    "__kernel void moe_scatter(__global float *ob, ulong oofs, __global const float *sb,\n"
    "                          ulong sofs, __global const int *lb, ulong lofs, int H,\n"
    "                          uint limit) {\n"
    "  const size_t c = get_global_id(0), i = get_global_id(1);\n"
    "  if (c >= (size_t)H) return;\n"
    "  const uint s = (uint)lb[lofs + i];\n"
    "  if (s < limit) ob[oofs + (size_t)s * H + c] = sb[sofs + i * H + c];\n"
    "}\n"
    "\n"
    "/* One work-item per element of y; j ascending. */\n"
    "__kernel void moe_combine(__global float *yb, ulong yo, __global const float *ob, ulong oo,\n"
    "                          __global const float *wb, ulong wo, int H, int k, ulong total) {\n"
    "  const size_t i = get_global_id(0);\n"
    "  if (i >= total) return;\n"
    "  const size_t t = i / (size_t)H, c = i % (size_t)H;\n"
    "  __global const float *wt = wb + wo + t * k;\n"
    "  __global const float *o = ob + oo + t * k * (size_t)H + c;\n"
    "  float acc = 0.0f;\n"
    "  for (int j = 0; j < k; j++) acc = fma(wt[j], o[(size_t)j * H], acc);\n"
    "  yb[yo + i] += acc;\n"
    "}\n"
    "\n"
    "/* ---- experts(): a group of experts, matrix-vector shaped ---- */\n"
    "\n"
    "/* An entry of the group table, laid out as tdm_moe_group. */\n"
    "typedef struct { long w; int first; int count; } moe_entry_t;\n"
    "\n"
    "/* A team of MOE_TEAM work-items (one on CPU devices) computes one weight row's dot\n"
    " * products; a work-group of MOE_XWG covers MOE_TEAMS rows. The work-item at `lane` of its\n"
    " * team sums the runs of 8 columns lane, lane + MOE_TEAM, ... (16-byte loads of bf16,\n"
    " * contiguous across the team) in ascending order into the 8 components of a float8, and\n"
    " * the last K % 8 columns, one per work-item, into component 0; then the components are\n"
    " * added in a fixed tree, and the team's sums in another. Tokens go MOE_TC at a time, so\n"
    " * each weight is read once per chunk; a token's sums have their own accumulators and\n"
    " * trees, so its result is the same whichever chunk, entry or group it falls in. */\n"
    "#define MOE_TC 4\n"
    "#define MOE_TEAMS (MOE_XWG / MOE_TEAM)\n"
    "/* A team of one (CPU devices) reads only its own partial sums: no barrier needed. */\n"
    "#if MOE_TEAM > 1\n"
    "#define MOE_TEAM_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)\n"
    "#else\n"
    "#define MOE_TEAM_BARRIER()\n"
    "#endif\n"
    "\n"
    "float8 bf16x8(ushort8 h) { return as_float8(convert_uint8(h) << 16); }\n"
    "\n"
    "/* Columns 8c to 8c + 7 of a bf16 row: one 16-byte load where the rows are 16-byte aligned\n"
    " * (wa), which vload8 cannot assume; the same values either way. */\n"
    "float8 moe_w8(__global const ushort *w, int c, int wa) {\n"
    "  return bf16x8(wa ? ((__global const ushort8 *)w)[c] : vload8(c, w));\n"
    "}\n"
    "\n"
    "float moe_hsum(float8 a) {\n"
    "  return ((a.s0 + a.s1) + (a.s2 + a.s3)) + ((a.s4 + a.s5) + (a.s6 + a.s7));\n"
    "}\n"
    "\n"
    "/* Whether entry g is to be computed: tokens inside [0, n), weights inside [wmin, wmax]. */\n"
    "bool moe_entry(__global const long *gb, ulong go, int g, int n, long wmin, long wmax,\n"
    "               long *w, int *first, int *count) {\n"
    "  __global const moe_entry_t *e = (__global const moe_entry_t *)(gb + go) + g;\n"
    "  *w = e->w;\n"
    "  *first = e->first;\n"
    "  *count = e->count;\n"
    "  return *count > 0 && *first >= 0 && *first <= n - *count && *w >= wmin && *w <= wmax;\n"
    "}\n"
    "\n"
    "/* NT tokens' dot products of one row of K columns: A[j] += X[j] . W, this lane's share. */\n"
    "#define MOE_DOT(NT, K, W, WA, X, A)                                             \\\n"
    "  for (int c = lane; c < (K) / 8; c += MOE_TEAM) {                              \\\n"
    "    const float8 wv = moe_w8(W, c, WA);                                         \\\n"
    "    for (int j = 0; j < (NT); j++) (A)[j] = fma(vload8(c, (X)[j]), wv, (A)[j]); \\\n"
    "  }                                                                             \\\n"
    "  for (int c = (K) / 8 * 8 + lane; c < (K); c += MOE_TEAM) {                    \\\n"
    "    const float wv = bf16((W)[c]);                                              \\\n"
    "    for (int j = 0; j < (NT); j++) (A)[j].s0 = fma((X)[j][c], wv, (A)[j].s0);   \\\n"
    "  }\n"
    "/* The same for two rows at once (gate and up). */\n"
    "#define MOE_DOT2(NT, K, W1, W2, WA, X, A1, A2)                                  \\\n"
    "  for (int c = lane; c < (K) / 8; c += MOE_TEAM) {                              \\\n"
    "    const float8 v1 = moe_w8(W1, c, WA), v2 = moe_w8(W2, c, WA);                \\\n"
    "    for (int j = 0; j < (NT); j++) {                                            \\\n"
    "      const float8 xv = vload8(c, (X)[j]);                                      \\\n"
    "      (A1)[j] = fma(xv, v1, (A1)[j]);                                           \\\n"
    "      (A2)[j] = fma(xv, v2, (A2)[j]);                                           \\\n"
    "    }                                                                           \\\n"
    "  }                                                                             \\\n"
    "  for (int c = (K) / 8 * 8 + lane; c < (K); c += MOE_TEAM) {                    \\\n"
    "    const float v1 = bf16((W1)[c]), v2 = bf16((W2)[c]);                         \\\n"
    "    for (int j = 0; j < (NT); j++) {                                            \\\n"
    "      (A1)[j].s0 = fma((X)[j][c], v1, (A1)[j].s0);                              \\\n"
    "      (A2)[j].s0 = fma((X)[j][c], v2, (A2)[j].s0);                              \\\n"
    "    }                                                                           \\\n"
    "  }\n"
    "/* Runs DOT for nt tokens with a constant count, so the accumulators stay in registers. */\n"
    "#define MOE_BY_COUNT(nt, DOT, ...)       \\\n"
    "  switch (nt) {                          \\\n"
    "  case 1: DOT(1, __VA_ARGS__); break;    \\\n"
    "  case 2: DOT(2, __VA_ARGS__); break;    \\\n"
    "  case 3: DOT(3, __VA_ARGS__); break;    \\\n"
    "  default: DOT(MOE_TC, __VA_ARGS__); break; \\\n"
    "  }\n"
    "\n"
    "/* The team trees over part[q][.] for q < nq; every work-item of the group calls it. */\n"
    "void moe_team_sum(__local float *part, int nq, int l, int lane) {\n"
    "  MOE_TEAM_BARRIER();\n"
    "  for (int s = MOE_TEAM / 2; s > 0; s >>= 1) {\n"
    "    if (lane < s)\n"
    "      for (int q = 0; q < nq; q++) part[q * MOE_XWG + l] += part[q * MOE_XWG + l + s];\n"
    "    MOE_TEAM_BARRIER();\n"
    "  }\n"
    "}\n"
    "\n"
    "/* (block of intermediate rows, entry): h[first + t][i] = silu(x_t . Wg[i]) * (x_t . Wu[i])\n"
    " * for the entry's tokens t, in f32 (h: [n x I]). A row outside x is skipped. */\n"
    "__kernel void moe_gateup(__global const float *xb, ulong xo, __global const int *rb,\n"
    "                         ulong ro, __global const long *gb, ulong go,\n"
    "                         __global const ushort *wb, ulong wo, long wmin, long wmax,\n"
    "                         __global float *hb, ulong ho, int n, int H, int I, uint x_rows) {\n"
    "  __local float part[2 * MOE_TC * MOE_XWG];\n"
    "  const int l = (int)get_local_id(0), lane = l % MOE_TEAM;\n"
    "  const int i = (int)get_group_id(0) * MOE_TEAMS + l / MOE_TEAM;\n"
    "  long w;\n"
    "  int first, count;\n"
    "  if (!moe_entry(gb, go, (int)get_group_id(1), n, wmin, wmax, &w, &first, &count)) return;\n"
    "  const int live = i < I;\n"
    "  __global const ushort *wg = wb + (ulong)((long)wo + w) + (size_t)(live ? i : 0) * H;\n"
    "  __global const ushort *wu = wg + (size_t)I * H;\n"
    "  const int wa = ((ulong)((long)wo + w) % 8 == 0) && H % 8 == 0;\n"
    "  __global const int *rows = rb + ro + first;\n"
    "  for (int t0 = 0; t0 < count; t0 += MOE_TC) {\n"
    "    const int nt = min(MOE_TC, count - t0);\n"
    "    __global const float *x[MOE_TC];\n"
    "    float8 ag[MOE_TC], au[MOE_TC];\n"
    "    for (int j = 0; j < MOE_TC; j++) {\n"
    "      const uint r = j < nt ? (uint)rows[t0 + j] : 0u;\n"
    "      x[j] = xb + xo + (size_t)(r < x_rows ? r : 0u) * H;\n"
    "      ag[j] = au[j] = (float8)(0.0f);\n"
    "    }\n"
    "    if (live) MOE_BY_COUNT(nt, MOE_DOT2, H, wg, wu, wa, x, ag, au)\n"
    "    for (int j = 0; j < MOE_TC; j++) {\n"
    "      part[2 * j * MOE_XWG + l] = moe_hsum(ag[j]);\n"
    "      part[(2 * j + 1) * MOE_XWG + l] = moe_hsum(au[j]);\n"
    "    }\n"
    "    moe_team_sum(part, 2 * nt, l, lane);\n"
    "    for (int j = lane; live && j < nt; j += MOE_TEAM) {\n"
    "      if ((uint)rows[t0 + j] >= x_rows) continue;\n"
    "      const float g = part[2 * j * MOE_XWG + l - lane];\n"
    "      const float u = part[(2 * j + 1) * MOE_XWG + l - lane];\n"
    "      hb[ho + (size_t)(first + t0 + j) * I + i] = g / (1.0f + exp(-g)) * u;\n"
    "    }\n"
    "    MOE_TEAM_BARRIER();\n"
    "  }\n"
    "}\n"
    "\n"
    "/* (block of output columns, entry): out[slot[first + t]][c] = h[first + t] . Wd[c]. A row\n"
    " * outside x or a slot outside out is skipped. */\n"
    "__kernel void moe_down(__global const float *hb, ulong ho, __global const int *rb, ulong ro,\n"
    "                       __global const int *sb, ulong so, __global const long *gb, ulong go,\n"
    "                       __global const ushort *wb, ulong wo, long wmin, long wmax,\n"
    "                       __global float *ob, ulong oo, int n, int H, int I, uint x_rows,\n"
    "                       uint out_rows) {\n"
    "  __local float part[MOE_TC * MOE_XWG];\n"
    "  const int l = (int)get_local_id(0), lane = l % MOE_TEAM;\n"
    "  const int c = (int)get_group_id(0) * MOE_TEAMS + l / MOE_TEAM;\n"
    "  long w;\n"
    "  int first, count;\n"
    "  if (!moe_entry(gb, go, (int)get_group_id(1), n, wmin, wmax, &w, &first, &count)) return;\n"
    "  const int live = c < H;\n"
    "  __global const ushort *wd =\n"
    "      wb + (ulong)((long)wo + w) + 2 * (size_t)I * H + (size_t)(live ? c : 0) * I;\n"
    "  const int wa = ((ulong)((long)wo + w) + 2 * (size_t)I * H) % 8 == 0 && I % 8 == 0;\n"
    "  for (int t0 = 0; t0 < count; t0 += MOE_TC) {\n"
    "    const int nt = min(MOE_TC, count - t0);\n"
    "    __global const float *h[MOE_TC];\n"
    "    float8 a[MOE_TC];\n"
    "    for (int j = 0; j < MOE_TC; j++) {\n"
    "      h[j] = hb + ho + (size_t)(first + t0 + (j < nt ? j : 0)) * I;\n"
    "      a[j] = (float8)(0.0f);\n"
    "    }\n"
    "    if (live) MOE_BY_COUNT(nt, MOE_DOT, I, wd, wa, h, a)\n"
    "    for (int j = 0; j < MOE_TC; j++) part[j * MOE_XWG + l] = moe_hsum(a[j]);\n"
    "    moe_team_sum(part, nt, l, lane);\n"
    "    for (int j = lane; live && j < nt; j += MOE_TEAM) {\n"
    "      const int t = first + t0 + j;\n"
    "      const uint r = (uint)rb[ro + t], s = (uint)sb[so + t];\n"
    "      if (r < x_rows && s < out_rows)\n"
    "        ob[oo + (size_t)s * H + c] = part[j * MOE_XWG + l - lane];\n"
    "    }\n"
    "    MOE_TEAM_BARRIER();\n"
    "  }\n"
    "}\n"
    "\n"
    "/* group(): one work-group. Work-item l owns the experts e with e % MOE_WG == l and\n"
    " * scans idx in order twice: to count its experts' tokens, then to place them. Between\n"
    " * the two, each work-item takes a run of consecutive experts, and a scan over the\n"
    " * work-items' runs turns the counts into offsets (experts ascending) and writes the\n"
    " * table, with no serial pass over E. Every position is fixed without atomics. cnt: E\n"
    " * ints of local memory. */\n"
    "__kernel void moe_group(__global const int *ib, ulong io, int T, int k, int E,\n"
    "                        __global const long *wb, ulong wo, __global int *rb, ulong ro,\n"
    "                        __global int *sb, ulong so, __global long *gb, ulong go, int ng,\n"
    "                        __local int *cnt) {\n"
    "  __local int run_tok[MOE_WG], run_nz[MOE_WG];\n"
    "  const int l = (int)get_local_id(0), total = T * k;\n"
    "  __global const int *idx = ib + io;\n"
    "  for (int e = l; e < E; e += MOE_WG) cnt[e] = 0;\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  if (l < E)\n"
    "    for (int p = 0; p < total; p++) {\n"
    "      const int v = idx[p];\n"
    "      if ((uint)v < (uint)E && v % MOE_WG == l) cnt[v]++;\n"
    "    }\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  const int per = (E + MOE_WG - 1) / MOE_WG, e0 = min(E, l * per), e1 = min(E, e0 + per);\n"
    "  int tok = 0, nz = 0;\n"
    "  for (int e = e0; e < e1; e++) {\n"
    "    tok += cnt[e];\n"
    "    nz += cnt[e] != 0;\n"
    "  }\n"
    "  run_tok[l] = tok;\n"
    "  run_nz[l] = nz;\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (int off = 1; off < MOE_WG; off <<= 1) {\n"
    "    const int a = l >= off ? run_tok[l - off] : 0, b = l >= off ? run_nz[l - off] : 0;\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "    run_tok[l] += a;\n"
    "    run_nz[l] += b;\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  __global moe_entry_t *g = (__global moe_entry_t *)(gb + go);\n"
    "  int at = run_tok[l] - tok, used = run_nz[l] - nz;\n"
    "  for (int e = e0; e < e1; e++) {\n"
    "    const int c = cnt[e];\n"
    "    cnt[e] = at;\n"
    "    if (c == 0) continue;\n"
    "    g[used].w = wb[wo + e];\n"
    "    g[used].first = at;\n"
    "    g[used].count = c;\n"
    "    used++;\n"
    "    at += c;\n"
    "  }\n"
    "  /* The entries past the routed experts: empty, after every routed entry. */\n"
    "  const int routed = run_nz[MOE_WG - 1], placed = run_tok[MOE_WG - 1];\n"
    "  for (int j = routed + l; j < ng; j += MOE_WG) {\n"
    "    g[j].w = 0;\n"
    "    g[j].first = placed;\n"
    "    g[j].count = 0;\n"
    "  }\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  if (l < E)\n"
    "    for (int p = 0; p < total; p++) {\n"
    "      const int v = idx[p];\n"
    "      if ((uint)v >= (uint)E || v % MOE_WG != l) continue;\n"
    "      const int at = cnt[v]++;\n"
    "      rb[ro + at] = p / k;\n"
    "      sb[so + at] = p;\n"
    "    }\n"
    "}\n";

/* The program's kernels (ocl_ops.h's K_*), this file's and xfmr.c's. */
static const char *const kernel_names[K_COUNT] = {
    "moe_rmsnorm", "moe_router", "moe_widen", "moe_gather", "moe_swiglu", "moe_scatter",
    "moe_combine", "moe_gateup", "moe_down", "moe_group", "moe_get_rows", "moe_rope",
    "moe_attention", "moe_qwiden", "moe_qgateup", "moe_qdown", "moe_qmatmul"};

/* ---- state (ocl_ops.h) ---- */

static void state_drop(moe_ocl *m) {
  if (atomic_fetch_sub(&m->refs, 1) != 1) return;
  for (int i = 0; i < K_COUNT; i++)
    if (m->k[i]) clReleaseKernel(m->k[i]);
  if (m->prog) clReleaseProgram(m->prog);
  if (m->cq) clReleaseCommandQueue(m->cq);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

/* ---- errors ---- */

static int alloc_failure(cl_int err) {
  return err == CL_OUT_OF_HOST_MEMORY || err == CL_OUT_OF_RESOURCES ||
         err == CL_MEM_OBJECT_ALLOCATION_FAILURE;
}

int tdm_moe__ocl_cl_fail(const char *op, const char *what, cl_int err) {
  return tdm_set_error(alloc_failure(err) ? TDM_ENOMEM : TDM_EBACKEND, err,
                        "moe %s: %s failed with OpenCL error %d", op, what, err);
}

/* CLBlast's statuses are OpenCL's where they overlap (-4, -5, -6 are the allocation ones). */
int tdm_moe__ocl_blast_fail(const char *op, const char *what, CLBlastStatusCode st) {
  return tdm_set_error(alloc_failure((cl_int)st) ? TDM_ENOMEM : TDM_EBACKEND, (int)st,
                        "moe %s: %s failed with CLBlast status %d", op, what, (int)st);
}

int tdm_moe__ocl_bad_args(const char *op) {
  return tdm_set_error(TDM_EINVAL, 0, "moe %s: NULL pointer or size out of range", op);
}

/* ---- arguments ---- */

int tdm_moe__ocl_resolve(moe_ocl *m, const char *op, const char *name, const void *p,
                         size_t count, size_t size, clbuf *out, size_t *avail) {
  tdm_mem_info mi;
  void *mem;
  size_t off;
  int rc = tdm_mem_query(p, &mi);
  if (rc) return rc;
  if (!mi.base || mi.kind != TDM_MEM_DEVICE || mi.device != m->dev)
    return tdm_set_error(TDM_EINVAL, 0, "moe %s: %s (%p) is not device memory of this queue's "
                          "device", op, name, p);
  size_t left = (size_t)((const char *)mi.base + mi.size - (const char *)p) / size;
  if (count > left)
    return tdm_set_error(TDM_ERANGE, 0, "moe %s: %s needs %zu elements, its allocation has %zu "
                          "from there", op, name, count, left);
  if ((rc = tdm_mem_native(p, &mem, &off))) return rc;
  if (off % size)
    return tdm_set_error(TDM_EINVAL, 0, "moe %s: %s is not aligned to %zu bytes", op, name, size);
  out->mem = mem;
  out->off = off / size;
  if (avail) *avail = left;
  return 0;
}

/* Rows of `width` elements in `avail` elements, as a kernel's uint limit. */
static cl_uint row_limit(size_t avail, int width) {
  size_t rows = avail / (size_t)width;
  return rows > UINT32_MAX ? UINT32_MAX : (cl_uint)rows;
}

/* ---- launching ---- */

int tdm_moe__ocl_launch(moe_ocl *m, const char *op, int kid, const karg *a, cl_uint na,
                        cl_uint dims, const size_t *global, const size_t *local) {
  cl_kernel k = m->k[kid];
  for (cl_uint i = 0; i < na; i++) {
    cl_int err = clSetKernelArg(k, i, a[i].size, a[i].value);
    if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail(op, "clSetKernelArg", err);
  }
  cl_int err = clEnqueueNDRangeKernel(m->cq, k, dims, NULL, global, local, 0, NULL, NULL);
  return err == CL_SUCCESS ? 0 : tdm_moe__ocl_cl_fail(op, kernel_names[kid], err);
}

/* ---- the ops' native work, with resolved arguments ---- */

typedef struct rmsnorm_job {
  clbuf y, x, w;
  cl_int T, H;
  cl_float eps;
} rmsnorm_job;

typedef struct router_job {
  clbuf x, wr, bias, idx, wts;
  cl_int T, H, E, k, renorm, has_bias;
} router_job;

typedef struct expert_job {
  clbuf x, rows, slot, w, out; /* w: in ushort elements for bf16, else in bytes */
  clbuf wf, xo, gu, wd; /* workspace regions, f32: weights, rows in and out, gate|up, Wd */
  cl_int n, H, I;
  cl_int gu_t, d_t;     /* the weights' types (quant.c's moe_unit32), 0 for bf16 */
  cl_ulong gu_rb, d_rb; /* and their rows' bytes */
  cl_uint x_rows, out_rows; /* limits for the indices */
} expert_job;

typedef struct combine_job {
  clbuf y, out, wts;
  cl_int T, H, k;
} combine_job;

typedef struct experts_job {
  clbuf x, rows, slot, groups, w, out;
  clbuf h;            /* the workspace's start: h = silu(gate) * up, f32 [n x I] */
  cl_long wmin, wmax; /* the entries' weight offsets that stay in wbase's allocation */
  cl_int n, G, H, I;
  cl_uint x_rows, out_rows;
  cl_int gu_t, d_t;     /* as in expert_job (w in bytes when they are not 0) */
  cl_ulong gu_rb, d_rb;
} experts_job;

typedef struct group_job {
  clbuf idx, wofs, rows, slot, groups;
  cl_int T, k, E, ng; /* ng: the table's entries, min(E, T*k) */
} group_job;

typedef struct job {
  int (*run)(moe_ocl *m, const struct job *j);
  union {
    rmsnorm_job rmsnorm;
    router_job router;
    expert_job expert;
    combine_job combine;
    experts_job experts;
    group_job group;
  } u;
} job;

static int run_rmsnorm(moe_ocl *m, const job *j) {
  const rmsnorm_job *a = &j->u.rmsnorm;
  karg args[] = {KBUF(a->y), KBUF(a->x), KBUF(a->w), KVAL(a->H), KVAL(a->eps)};
  size_t global = (size_t)a->T * m->wg, local = m->wg;
  return LAUNCH(m, "rmsnorm", K_RMSNORM, args, 1, &global, &local);
}

static int run_router(moe_ocl *m, const job *j) {
  const router_job *a = &j->u.router;
  /* Without a bias the kernel never reads it; any valid buffer stands in. */
  clbuf bias = a->has_bias ? a->bias : a->x;
  karg args[] = {KBUF(a->x),      KBUF(a->wr),  KBUF(bias),    KVAL(a->has_bias),
                 KVAL(a->H),      KVAL(a->E),   KVAL(a->k),    KVAL(a->renorm),
                 KBUF(a->idx),    KBUF(a->wts), {(size_t)a->E * sizeof(cl_float), NULL},
                 {(size_t)a->E, NULL}};
  size_t global = (size_t)a->T * m->wg, local = m->wg;
  return LAUNCH(m, "router", K_ROUTER, args, 1, &global, &local);
}

/* Row-major C = A B^T, A [rows x K] with row stride lda, B [N x K], C [rows x N]: SGEMM with
 * B transposed, as the CPU table's cblas_sgemm. */
static int gemm_nt(moe_ocl *m, size_t rows, size_t N, size_t K, clbuf A, size_t lda, clbuf B,
                   clbuf C, const char *what) {
  CLBlastStatusCode st =
      CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, rows, N, K,
                   1.0f, A.mem, A.off, lda, B.mem, B.off, K, 0.0f, C.mem, C.off, N, &m->cq, NULL);
  return st == CLBlastSuccess ? 0 : tdm_moe__ocl_blast_fail("expert", what, st);
}

static int run_expert(moe_ocl *m, const job *j) {
  const expert_job *a = &j->u.expert;
  const size_t n = (size_t)a->n, H = (size_t)a->H, I = (size_t)a->I, wg = m->wg;
  cl_ulong count = 3 * (cl_ulong)H * I;
  int rc;
  if (a->gu_t) { /* [Wg; Wu] then Wd, widened from their blocks */
    cl_int nr = 2 * a->I;
    clbuf src_d = {a->w.mem, a->w.off + 2 * I * a->gu_rb};
    karg gu[] = {KBUF(a->wf), KBUF(a->w), KVAL(a->gu_rb), KVAL(a->H), KVAL(nr), KVAL(a->gu_t)};
    karg d[] = {KBUF(a->wd), KBUF(src_d), KVAL(a->d_rb), KVAL(a->I), KVAL(a->H), KVAL(a->d_t)};
    size_t g_gu[2] = {H / 32, 2 * I}, g_d[2] = {I / 32, H};
    if ((rc = LAUNCH(m, "expert", K_QWIDEN, gu, 2, g_gu, NULL)) ||
        (rc = LAUNCH(m, "expert", K_QWIDEN, d, 2, g_d, NULL)))
      return rc;
  } else {
    karg widen[] = {KBUF(a->wf), KBUF(a->w), KVAL(count)};
    size_t g1 = round_up(3 * H * I, wg);
    if ((rc = LAUNCH(m, "expert", K_WIDEN, widen, 1, &g1, &wg))) return rc;
  }

  karg gather[] = {KBUF(a->xo), KBUF(a->x), KBUF(a->rows), KVAL(a->H), KVAL(a->x_rows)};
  size_t gh[2] = {round_up(H, wg), n}, lh[2] = {wg, 1};
  if ((rc = LAUNCH(m, "expert", K_GATHER, gather, 2, gh, lh))) return rc;

  /* [gate | up] = X [Wg; Wu]^T, one GEMM of width 2I. */
  if ((rc = gemm_nt(m, n, 2 * I, H, a->xo, H, a->wf, a->gu, "CLBlastSgemm (gate|up)"))) return rc;

  karg swiglu[] = {KBUF(a->gu), KVAL(a->I)};
  size_t gi[2] = {round_up(I, wg), n};
  if ((rc = LAUNCH(m, "expert", K_SWIGLU, swiglu, 2, gi, lh))) return rc;

  /* out rows = h Wd^T, h being the first I columns of each gate|up row. */
  if ((rc = gemm_nt(m, n, H, I, a->gu, 2 * I, a->wd, a->xo, "CLBlastSgemm (down)"))) return rc;

  karg scatter[] = {KBUF(a->out), KBUF(a->xo), KBUF(a->slot), KVAL(a->H), KVAL(a->out_rows)};
  return LAUNCH(m, "expert", K_SCATTER, scatter, 2, gh, lh);
}

static int run_combine(moe_ocl *m, const job *j) {
  const combine_job *a = &j->u.combine;
  cl_ulong total = (cl_ulong)a->T * (cl_ulong)a->H;
  karg args[] = {KBUF(a->y), KBUF(a->out), KBUF(a->wts), KVAL(a->H), KVAL(a->k), KVAL(total)};
  size_t global = round_up((size_t)total, m->wg), local = m->wg;
  return LAUNCH(m, "combine", K_COMBINE, args, 1, &global, &local);
}

/* Two kernels over all entries at once (the entry in the NDRange's second dimension): gate
 * and up with SwiGLU into h, then down into out. */
static int run_experts_q(moe_ocl *m, const experts_job *a) {
  karg gateup[] = {KBUF(a->x),    KBUF(a->rows), KBUF(a->groups), KBUF(a->w),
                   KVAL(a->wmin), KVAL(a->wmax), KBUF(a->h),      KVAL(a->n),
                   KVAL(a->H),    KVAL(a->I),    KVAL(a->x_rows), KVAL(a->gu_t),
                   KVAL(a->gu_rb)};
  size_t g1[2] = {(size_t)a->I, (size_t)a->G};
  int rc = LAUNCH(m, "experts", K_QGATEUP, gateup, 2, g1, NULL);
  if (rc) return rc;
  karg down[] = {KBUF(a->h),       KBUF(a->rows),   KBUF(a->slot), KBUF(a->groups),
                 KBUF(a->w),       KVAL(a->wmin),   KVAL(a->wmax), KBUF(a->out),
                 KVAL(a->n),       KVAL(a->H),      KVAL(a->I),    KVAL(a->x_rows),
                 KVAL(a->out_rows), KVAL(a->d_t),   KVAL(a->gu_rb), KVAL(a->d_rb)};
  size_t g2[2] = {(size_t)a->H, (size_t)a->G};
  return LAUNCH(m, "experts", K_QDOWN, down, 2, g2, NULL);
}

static int run_experts(moe_ocl *m, const job *j) {
  const experts_job *a = &j->u.experts;
  if (a->gu_t) return run_experts_q(m, a);
  const size_t wg = m->xwg, teams = wg / m->team; /* rows per work-group */
  size_t local[2] = {wg, 1};
  karg gateup[] = {KBUF(a->x),    KBUF(a->rows), KBUF(a->groups), KBUF(a->w),
                   KVAL(a->wmin), KVAL(a->wmax), KBUF(a->h),      KVAL(a->n),
                   KVAL(a->H),    KVAL(a->I),    KVAL(a->x_rows)};
  size_t g1[2] = {(((size_t)a->I + teams - 1) / teams) * wg, (size_t)a->G};
  int rc = LAUNCH(m, "experts", K_GATEUP, gateup, 2, g1, local);
  if (rc) return rc;
  karg down[] = {KBUF(a->h),    KBUF(a->rows), KBUF(a->slot), KBUF(a->groups),
                 KBUF(a->w),    KVAL(a->wmin), KVAL(a->wmax), KBUF(a->out),
                 KVAL(a->n),    KVAL(a->H),    KVAL(a->I),    KVAL(a->x_rows),
                 KVAL(a->out_rows)};
  size_t g2[2] = {(((size_t)a->H + teams - 1) / teams) * wg, (size_t)a->G};
  return LAUNCH(m, "experts", K_DOWN, down, 2, g2, local);
}

static int run_group(moe_ocl *m, const job *j) {
  const group_job *a = &j->u.group;
  karg args[] = {KBUF(a->idx),  KVAL(a->T),      KVAL(a->k),      KVAL(a->E),
                 KBUF(a->wofs), KBUF(a->rows),   KBUF(a->slot),   KBUF(a->groups),
                 KVAL(a->ng),   {(size_t)a->E * sizeof(cl_int), NULL}};
  size_t global = m->wg, local = m->wg;
  return LAUNCH(m, "group", K_GROUP, args, 1, &global, &local);
}

/* ---- submission ---- */

/* Whether q holds work on the host that native commands would overtake: under deferral, its
 * last command (or a tracked event) is incomplete and has no native event yet. When it cannot
 * tell, it says yes: the host-task path is correct either way. */
static bool held_work(moe_ocl *m) {
  if (!m->defer) return false;
  tdm_event *deps[8];
  size_t n = 0;
  if (tdm_queue_dependencies(m->q, deps, 8, &n) != 0) return true;
  bool held = false;
  for (size_t i = 0; i < n; i++) {
    void *native = NULL;
    if (!held && tdm_event_query(deps[i]) == TDM_EAGAIN &&
        tdm_event_native(deps[i], &native) != 0)
      held = true;
    tdm_event_release(deps[i]);
  }
  return held;
}

/* An op submitted as a host task, with a copy of its arguments. refs: one for the task, one
 * for the keep-alive that frees it (a task skipped after a failure never runs, so it cannot
 * free the block itself). */
typedef struct held_job {
  moe_ocl *m;
  tdm_moe__ocl_run run;
  atomic_int refs;
  max_align_t args[]; /* the op's arguments: a job of this file's, or one of xfmr.c's */
} held_job;

static void held_free(void *arg) {
  held_job *h = arg;
  state_drop(h->m);
  free(h);
}

static void held_drop(held_job *h) {
  if (atomic_fetch_sub(&h->refs, 1) == 1) held_free(h);
}

static int held_run(void *arg) {
  held_job *h = arg;
  pthread_mutex_lock(&h->m->mu);
  int rc = h->run(h->m, h->args);
  pthread_mutex_unlock(&h->m->mu);
  held_drop(h);
  return rc;
}

int tdm_moe__ocl_submit(moe_ocl *m, tdm_moe__ocl_run run, const void *args, size_t size) {
  if (!held_work(m)) {
    pthread_mutex_lock(&m->mu);
    int rc = run(m, args);
    pthread_mutex_unlock(&m->mu);
    return rc;
  }
  held_job *h = malloc(sizeof *h + size);
  if (!h) return tdm_set_error(TDM_ENOMEM, 0, "moe: no host memory for a deferred op");
  h->m = m;
  h->run = run;
  memcpy(h->args, args, size);
  atomic_init(&h->refs, 2);
  atomic_fetch_add(&m->refs, 1);
  int rc = tdm_host_task(m->q, held_run, h, 0, NULL, NULL);
  if (rc) {
    held_free(h);
    return rc;
  }
  /* Queued: if the keep-alive cannot be, the task and this call share the block instead. */
  if (tdm_keep_alive(m->q, held_free, h) != 0) held_drop(h);
  return 0;
}

/* This file's ops: a job, run by its own function. */
static int run_job(moe_ocl *m, const void *args) {
  const job *j = args;
  return j->run(m, j);
}

static int submit(moe_ocl *m, const job *j) {
  return tdm_moe__ocl_submit(m, run_job, j, sizeof *j);
}

int tdm_moe__ocl_check_state(moe_ocl *m, tdm_queue *q, const char *op) {
  if (m && q && m->q == q) return 0;
  return tdm_set_error(TDM_EINVAL, 0, "moe %s: the state was not opened on this queue", op);
}

/* ---- the table's entries ---- */

static int ocl_moe_rmsnorm(void *st, tdm_queue *q, float *y, const float *x, const float *w,
                           int T, int H, float eps) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "rmsnorm");
  if (rc) return rc;
  if (!y || !x || !w || T < 0 || H <= 0 || !(eps >= 0.0f)) return tdm_moe__ocl_bad_args("rmsnorm");
  if (T == 0) return 0;
  job j = {.run = run_rmsnorm, .u.rmsnorm = {.T = T, .H = H, .eps = eps}};
  rmsnorm_job *a = &j.u.rmsnorm;
  size_t TH = (size_t)T * H;
  if ((rc = tdm_moe__ocl_resolve(m, "rmsnorm", "y", y, TH, sizeof(float), &a->y, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "rmsnorm", "x", x, TH, sizeof(float), &a->x, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "rmsnorm", "w", w, (size_t)H, sizeof(float), &a->w, NULL)))
    return rc;
  return submit(m, &j);
}

static int ocl_moe_router(void *st, tdm_queue *q, const float *x, const tdm_moe_bf16 *wr,
                          const float *bias, int T, int H, int E, int k, int renorm, int32_t *idx,
                          float *weights) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "router");
  if (rc) return rc;
  if (!x || !wr || !idx || !weights || T < 0 || H <= 0 || E <= 0 || k <= 0 || k > E)
    return tdm_moe__ocl_bad_args("router");
  if (T == 0) return 0;
  if ((cl_ulong)E * (sizeof(cl_float) + 1) > m->router_local)
    return tdm_set_error(TDM_EINVAL, 0, "moe router: %d experts need more local memory than "
                          "the device's %llu bytes", E, (unsigned long long)m->router_local);
  job j = {.run = run_router,
           .u.router = {.T = T, .H = H, .E = E, .k = k, .renorm = renorm != 0,
                        .has_bias = bias != NULL}};
  router_job *a = &j.u.router;
  size_t Tk = (size_t)T * k;
  if ((rc = tdm_moe__ocl_resolve(m, "router", "x", x, (size_t)T * H, sizeof(float), &a->x, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "router", "wr", wr, (size_t)E * H, sizeof(tdm_moe_bf16), &a->wr,
                                 NULL)) ||
      (bias && (rc = tdm_moe__ocl_resolve(m, "router", "bias", bias, (size_t)E, sizeof(float),
                                          &a->bias, NULL))) ||
      (rc = tdm_moe__ocl_resolve(m, "router", "idx", idx, Tk, sizeof(int32_t), &a->idx, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "router", "weights", weights, Tk, sizeof(float), &a->wts,
                                 NULL)))
    return rc;
  return submit(m, &j);
}

/* Workspace layout, as the CPU table's, each region on a 256-byte boundary within
 * tdm_moe_ops_workspace(n, H, I): the weights in f32 [Wg | Wu | Wd] (3HI), the gathered rows
 * (n x H, reused for the output rows), then gate|up side by side (n x 2I), h = silu(gate) *
 * up overwriting the gate half. */
static size_t round256(size_t b) { return (b + 255) / 256 * 256; }

/* The weight format as the kernels take it: types 0 for bf16 (moe_widen, moe_gateup,
 * moe_down), else quant.c's (rows of whole blocks, and of multiples of 32 values). */
static int ocl_fmt(tdm_moe_wfmt fmt, int H, int I, const char *op, cl_int *gu_t, cl_int *d_t,
                   cl_ulong *gu_rb, cl_ulong *d_rb) {
  *gu_t = *d_t = 0;
  if (fmt.gu == TDM_MOE_W_BF16 && fmt.d == TDM_MOE_W_BF16) return 0;
  size_t a = tdm_moe_row_bytes(fmt.gu, H), b = tdm_moe_row_bytes(fmt.d, I);
  if (!a || !b || fmt.gu == TDM_MOE_W_BF16 || fmt.d == TDM_MOE_W_BF16 || H % 32 || I % 32 ||
      !tdm_moe_expert_size(fmt, H, I))
    return tdm_set_error(TDM_EINVAL, 0, "moe %s: weight format {%d, %d} with H=%d, I=%d: a type "
                         "the OpenCL table lacks, or rows that are not whole blocks (and "
                         "multiples of 32)", op, fmt.gu, fmt.d, H, I);
  *gu_t = fmt.gu, *d_t = fmt.d, *gu_rb = a, *d_rb = b;
  return 0;
}

static int ocl_moe_expert_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                            const int32_t *slot, int n, const void *w, tdm_moe_wfmt fmt, int H,
                            int I, float *out, void *workspace, size_t workspace_bytes) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "expert");
  if (rc) return rc;
  if (!x || !rows || !slot || !w || !out || n < 0 || H <= 0 || I <= 0 || I > INT_MAX / 2)
    return tdm_moe__ocl_bad_args("expert");
  cl_int gu_t, d_t;
  cl_ulong gu_rb = 0, d_rb = 0;
  if ((rc = ocl_fmt(fmt, H, I, "expert", &gu_t, &d_t, &gu_rb, &d_rb))) return rc;
  if (n == 0) return 0;
  size_t need = tdm_moe__workspace(n, H, I);
  if (!workspace || need == 0 || workspace_bytes < need || (uintptr_t)workspace % sizeof(float))
    return tdm_set_error(TDM_EINVAL, 0,
                          "moe expert: workspace %p of %zu bytes; n=%d H=%d I=%d need %zu, "
                          "aligned", workspace, workspace_bytes, n, H, I, need);
  job j = {.run = run_expert, .u.expert = {.n = n, .H = H, .I = I, .gu_t = gu_t, .d_t = d_t,
                                           .gu_rb = gu_rb, .d_rb = d_rb}};
  expert_job *a = &j.u.expert;
  const size_t sH = (size_t)H, sI = (size_t)I, sn = (size_t)n;
  size_t x_avail, out_avail;
  clbuf ws;
  if ((rc = tdm_moe__ocl_resolve(m, "expert", "x", x, sH, sizeof(float), &a->x, &x_avail)) ||
      (rc = tdm_moe__ocl_resolve(m, "expert", "rows", rows, sn, sizeof(int32_t), &a->rows, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "expert", "slot", slot, sn, sizeof(int32_t), &a->slot, NULL)) ||
      (rc = gu_t ? tdm_moe__ocl_resolve(m, "expert", "w", w, tdm_moe_expert_size(fmt, H, I), 1,
                                        &a->w, NULL)
                 : tdm_moe__ocl_resolve(m, "expert", "w", w, 3 * sH * sI, sizeof(tdm_moe_bf16),
                                        &a->w, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "expert", "out", out, sH, sizeof(float), &a->out,
                                 &out_avail)) ||
      (rc = tdm_moe__ocl_resolve(m, "expert", "workspace", workspace, need / sizeof(float),
                                 sizeof(float), &ws, NULL)))
    return rc;
  /* CLBlast's single-kernel GEMM takes offsets as int. */
  if (ws.off + need / sizeof(float) > INT_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "moe expert: the workspace lies beyond 8 GiB into its "
                          "buffer, where CLBlast cannot address it");
  size_t xo = round256(3 * sH * sI * sizeof(float)) / sizeof(float);
  size_t gu = xo + round256(sn * sH * sizeof(float)) / sizeof(float);
  a->wf = ws;
  a->wd = (clbuf){ws.mem, ws.off + 2 * sH * sI};
  a->xo = (clbuf){ws.mem, ws.off + xo};
  a->gu = (clbuf){ws.mem, ws.off + gu};
  a->x_rows = row_limit(x_avail, H);
  a->out_rows = row_limit(out_avail, H);
  return submit(m, &j);
}

static int ocl_moe_expert(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                          const int32_t *slot, int n, const tdm_moe_bf16 *w, int H, int I,
                          float *out, void *workspace, size_t workspace_bytes) {
  return ocl_moe_expert_q(st, q, x, rows, slot, n, w,
                          (tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, H, I, out, workspace,
                          workspace_bytes);
}

static int ocl_moe_combine(void *st, tdm_queue *q, float *y, const float *out,
                           const float *weights, int T, int H, int k) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "combine");
  if (rc) return rc;
  if (!y || !out || !weights || T < 0 || H <= 0 || k <= 0) return tdm_moe__ocl_bad_args("combine");
  if (T == 0) return 0;
  job j = {.run = run_combine, .u.combine = {.T = T, .H = H, .k = k}};
  combine_job *a = &j.u.combine;
  size_t TH = (size_t)T * H, Tk = (size_t)T * k;
  if ((rc = tdm_moe__ocl_resolve(m, "combine", "y", y, TH, sizeof(float), &a->y, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "combine", "out", out, Tk * H, sizeof(float), &a->out, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "combine", "weights", weights, Tk, sizeof(float), &a->wts,
                                 NULL)))
    return rc;
  return submit(m, &j);
}

/* wbase's buffer (offsets in elements of `unit` bytes: 2 for bf16 weights, 1 for blocks), and
 * the range [*wmin, *wmax] of offsets from it (in 2-byte units, as entries give them) at which
 * an expert of `need` bytes lies inside its allocation: the kernels skip an entry outside it.
 * An allocation that cannot hold one expert is the caller's error, as in expert(). */
static int resolve_weights(moe_ocl *m, const void *wbase, size_t need, size_t unit, clbuf *out,
                           cl_long *wmin, cl_long *wmax) {
  size_t after;
  tdm_mem_info mi;
  int rc = tdm_moe__ocl_resolve(m, "experts", "wbase", wbase, 0, unit, out, &after);
  if (rc || (rc = tdm_mem_query(wbase, &mi))) return rc;
  size_t before = (size_t)((const char *)wbase - (const char *)mi.base);
  after *= unit;
  if (need > before + after)
    return tdm_set_error(TDM_ERANGE, 0, "moe experts: an expert needs %zu bytes, wbase's "
                         "allocation holds %zu", need, before + after);
  cl_long room = (cl_long)after - (cl_long)need; /* floor(room / 2): below wmin, none fits */
  *wmin = -(cl_long)(before / 2);
  *wmax = room >= 0 ? room / 2 : -((1 - room) / 2);
  return 0;
}

static int ocl_moe_experts_q(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                             const int32_t *slot, int n, const void *wbase, tdm_moe_wfmt fmt,
                             const tdm_moe_group *groups, int G, int H, int I, float *out,
                             void *workspace, size_t workspace_bytes) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "experts");
  if (rc) return rc;
  if (!x || !rows || !slot || !wbase || !groups || !out || n < 0 || G < 0 || H <= 0 || I <= 0 ||
      I > INT_MAX / 2)
    return tdm_moe__ocl_bad_args("experts");
  cl_int gu_t, d_t;
  cl_ulong gu_rb = 0, d_rb = 0;
  if ((rc = ocl_fmt(fmt, H, I, "experts", &gu_t, &d_t, &gu_rb, &d_rb))) return rc;
  if (n == 0 || G == 0) return 0;
  size_t need = tdm_moe__workspace(n, H, I);
  if (!workspace || need == 0 || workspace_bytes < need || (uintptr_t)workspace % sizeof(float))
    return tdm_set_error(TDM_EINVAL, 0,
                         "moe experts: workspace %p of %zu bytes; n=%d H=%d I=%d need %zu, "
                         "aligned", workspace, workspace_bytes, n, H, I, need);
  job j = {.run = run_experts, .u.experts = {.n = n, .G = G, .H = H, .I = I, .gu_t = gu_t,
                                             .d_t = d_t, .gu_rb = gu_rb, .d_rb = d_rb}};
  experts_job *a = &j.u.experts;
  const size_t sH = (size_t)H, sI = (size_t)I, sn = (size_t)n;
  size_t x_avail, out_avail;
  if ((rc = tdm_moe__ocl_resolve(m, "experts", "x", x, sH, sizeof(float), &a->x, &x_avail)) ||
      (rc = tdm_moe__ocl_resolve(m, "experts", "rows", rows, sn, sizeof(int32_t), &a->rows,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "experts", "slot", slot, sn, sizeof(int32_t), &a->slot,
                                 NULL)) ||
      (rc = resolve_weights(m, wbase, gu_t ? tdm_moe_expert_size(fmt, H, I) : 6 * sH * sI,
                            gu_t ? 1 : sizeof(tdm_moe_bf16), &a->w, &a->wmin, &a->wmax)) ||
      (rc = tdm_moe__ocl_resolve(m, "experts", "groups", groups, 2 * (size_t)G, sizeof(int64_t),
                                 &a->groups, NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "experts", "out", out, sH, sizeof(float), &a->out,
                                 &out_avail)) ||
      (rc = tdm_moe__ocl_resolve(m, "experts", "workspace", workspace, need / sizeof(float),
                                 sizeof(float), &a->h, NULL)))
    return rc;
  a->x_rows = row_limit(x_avail, H);
  a->out_rows = row_limit(out_avail, H);
  return submit(m, &j);
}

static int ocl_moe_experts(void *st, tdm_queue *q, const float *x, const int32_t *rows,
                           const int32_t *slot, int n, const tdm_moe_bf16 *wbase,
                           const tdm_moe_group *groups, int G, int H, int I, float *out,
                           void *workspace, size_t workspace_bytes) {
  return ocl_moe_experts_q(st, q, x, rows, slot, n, wbase,
                           (tdm_moe_wfmt){TDM_MOE_W_BF16, TDM_MOE_W_BF16}, groups, G, H, I, out,
                           workspace, workspace_bytes);
}

static int ocl_moe_group(void *st, tdm_queue *q, const int32_t *idx, int T, int k, int E,
                         const int64_t *wofs, int32_t *rows, int32_t *slot,
                         tdm_moe_group *groups) {
  moe_ocl *m = st;
  int rc = tdm_moe__ocl_check_state(m, q, "group");
  if (rc) return rc;
  if (!idx || !wofs || !rows || !slot || !groups || T < 0 || k <= 0 || E <= 0 ||
      (int64_t)T * k > INT_MAX)
    return tdm_moe__ocl_bad_args("group");
  if (T == 0) return 0;
  if ((cl_ulong)E * sizeof(cl_int) > m->group_local)
    return tdm_set_error(TDM_EINVAL, 0, "moe group: %d experts need more local memory than "
                         "the device's %llu bytes", E, (unsigned long long)m->group_local);
  const int Tk = T * k, ng = E < Tk ? E : Tk;
  job j = {.run = run_group, .u.group = {.T = T, .k = k, .E = E, .ng = ng}};
  group_job *a = &j.u.group;
  if ((rc = tdm_moe__ocl_resolve(m, "group", "idx", idx, (size_t)Tk, sizeof(int32_t), &a->idx,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "group", "wofs", wofs, (size_t)E, sizeof(int64_t), &a->wofs,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "group", "rows", rows, (size_t)Tk, sizeof(int32_t), &a->rows,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "group", "slot", slot, (size_t)Tk, sizeof(int32_t), &a->slot,
                                 NULL)) ||
      (rc = tdm_moe__ocl_resolve(m, "group", "groups", groups, 2 * (size_t)ng, sizeof(int64_t),
                                 &a->groups, NULL)))
    return rc;
  return submit(m, &j);
}

/* ---- open / close ---- */

/* The largest power of two, at most MOE_WG_MAX, that the device takes as a work-group. */
static int pick_wg(cl_device_id id, size_t *wg) {
  size_t dev_max = 0, items[64], items_size = 0;
  cl_int err = clGetDeviceInfo(id, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof dev_max, &dev_max,
                               NULL);
  if (err == CL_SUCCESS)
    err = clGetDeviceInfo(id, CL_DEVICE_MAX_WORK_ITEM_SIZES, 0, NULL, &items_size);
  if (err == CL_SUCCESS && (items_size < sizeof items[0] || items_size > sizeof items))
    err = CL_INVALID_VALUE;
  if (err == CL_SUCCESS)
    err = clGetDeviceInfo(id, CL_DEVICE_MAX_WORK_ITEM_SIZES, items_size, items, NULL);
  if (err != CL_SUCCESS)
    return tdm_moe__ocl_cl_fail("open", "clGetDeviceInfo (work-group sizes)", err);
  size_t cap = MOE_WG_MAX < dev_max ? MOE_WG_MAX : dev_max;
  if (items[0] < cap) cap = items[0];
  *wg = 1;
  while (*wg * 2 <= cap) *wg *= 2;
  return 0;
}

/* A failed build's message quotes the start of the driver's log. */
static int build_failed(cl_program prog, cl_device_id id, const char *name) {
  char log[301] = "";
  size_t len = 0;
  if (clGetProgramBuildInfo(prog, id, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, &len) !=
      CL_SUCCESS)
    log[0] = '\0';
  return tdm_set_error(TDM_EBACKEND, CL_BUILD_PROGRAM_FAILURE,
                       "moe open: the kernels do not build on %s: %.300s", name, log);
}

/* The kernels' program for m's device, built for work-groups of m->wg. */
static int build_program(moe_ocl *m, cl_context ctx, const char *name) {
  int rc = pick_wg(m->id, &m->wg);
  if (rc) return rc;
  cl_device_type type = 0;
  cl_int err = clGetDeviceInfo(m->id, CL_DEVICE_TYPE, sizeof type, &type, NULL);
  if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "clGetDeviceInfo (type)", err);
  bool cpu = (type & CL_DEVICE_TYPE_CPU) != 0;
  m->xwg = cpu && m->wg > MOE_XWG_CPU ? MOE_XWG_CPU : m->wg;
  m->team = cpu ? 1 : m->wg < MOE_TEAM_GPU ? m->wg : MOE_TEAM_GPU;
  char opts[96];
  snprintf(opts, sizeof opts, "-DMOE_WG=%zu -DMOE_XWG=%zu -DMOE_TEAM=%zu", m->wg, m->xwg,
           m->team);
  const char *src[3] = {moe_cl_source, tdm_moe__ocl_xfmr_source, tdm_moe__ocl_quant_source};
  m->prog = clCreateProgramWithSource(ctx, 3, src, NULL, &err);
  if (!m->prog) return tdm_moe__ocl_cl_fail("open", "clCreateProgramWithSource", err);
  err = clBuildProgram(m->prog, 1, &m->id, opts, NULL, NULL);
  if (err == CL_BUILD_PROGRAM_FAILURE) return build_failed(m->prog, m->id, name);
  return err == CL_SUCCESS ? 0 : tdm_moe__ocl_cl_fail("open", "clBuildProgram", err);
}

/* The local memory kernel kid leaves for its local-memory arguments, of dev_local. */
static int local_left(moe_ocl *m, int kid, cl_ulong dev_local, cl_ulong *left) {
  cl_ulong used = 0;
  cl_int err = clGetKernelWorkGroupInfo(m->k[kid], m->id, CL_KERNEL_LOCAL_MEM_SIZE, sizeof used,
                                        &used, NULL);
  if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "local memory query", err);
  *left = dev_local > used ? dev_local - used : 0;
  return 0;
}

/* Kernels of its own (their arguments are per state), and the limits they run under. */
static int make_kernels(moe_ocl *m, const char *name) {
  cl_int err;
  for (int i = 0; i < K_COUNT; i++) {
    m->k[i] = clCreateKernel(m->prog, kernel_names[i], &err);
    if (!m->k[i]) return tdm_moe__ocl_cl_fail("open", "clCreateKernel", err);
    size_t kwg = 0;
    err = clGetKernelWorkGroupInfo(m->k[i], m->id, CL_KERNEL_WORK_GROUP_SIZE, sizeof kwg, &kwg,
                                   NULL);
    if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "clGetKernelWorkGroupInfo", err);
    size_t want = i == K_GATEUP || i == K_DOWN ? m->xwg : m->wg;
    if (kwg < want && i < K_QWIDEN) /* quant.c's kernels leave their size to the device */
      return tdm_set_error(TDM_ENOTSUP, 0, "moe open: %s runs work-groups of %zu on %s, not "
                           "%zu", kernel_names[i], kwg, name, want);
  }
  cl_ulong dev_local = 0;
  err = clGetDeviceInfo(m->id, CL_DEVICE_LOCAL_MEM_SIZE, sizeof dev_local, &dev_local, NULL);
  if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "local memory query", err);
  int rc = local_left(m, K_ROUTER, dev_local, &m->router_local);
  if (!rc) rc = local_left(m, K_GROUP, dev_local, &m->group_local);
  return rc ? rc : local_left(m, K_ATTENTION, dev_local, &m->attn_local);
}

/* The native queue (retained), its device, the program and the kernels. */
static int state_setup(moe_ocl *m, cl_command_queue cq, cl_context ctx, const char *name) {
  cl_int err = clRetainCommandQueue(cq);
  if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "clRetainCommandQueue", err);
  m->cq = cq;
  err = clGetCommandQueueInfo(cq, CL_QUEUE_DEVICE, sizeof m->id, &m->id, NULL);
  if (err != CL_SUCCESS) return tdm_moe__ocl_cl_fail("open", "clGetCommandQueueInfo (device)", err);
  int rc = build_program(m, ctx, name);
  return rc ? rc : make_kernels(m, name);
}

/* Only in-order queues of OpenCL devices: the ops take no dependency lists. */
static int ocl_moe_open(tdm_queue *q, void **state) {
  if (!q || !state) return tdm_set_error(TDM_EINVAL, 0, "moe open: NULL argument");
  tdm_device *dev;
  tdm_device_info info;
  unsigned flags;
  void *native, *ctx;
  int rc;
  if ((rc = tdm_queue_device(q, &dev)) || (rc = tdm_device_info_get(dev, &info)) ||
      (rc = tdm_queue_flags(q, &flags)))
    return rc;
  if (strcmp(info.backend, "opencl") != 0)
    return tdm_set_error(TDM_ENOTSUP, 0, "moe open: %s is not an OpenCL device", info.id);
  if (flags & TDM_QUEUE_OUT_OF_ORDER)
    return tdm_set_error(TDM_EINVAL, 0, "moe open: the ops need an in-order queue");
  if ((rc = tdm_queue_native(q, &native)) || (rc = tdm_device_native(dev, &ctx))) return rc;

  moe_ocl *m = calloc(1, sizeof *m);
  if (!m) return tdm_set_error(TDM_ENOMEM, 0, "moe open: no host memory");
  m->q = q;
  m->dev = dev;
  m->defer = (info.caps & TDM_DEVICE_CAP_HOST_DEFERRAL) != 0;
  pthread_mutex_init(&m->mu, NULL);
  atomic_init(&m->refs, 1);
  if ((rc = state_setup(m, (cl_command_queue)native, (cl_context)ctx, info.name))) {
    state_drop(m);
    return rc;
  }
  *state = m;
  return 0;
}

/* Waits for the native queue, so nothing enqueued here is still running; ops still held as
 * host tasks keep the state alive until they have run. Call it before destroying the queue,
 * and never from a host task on it. */
static void ocl_moe_close(void *state) {
  moe_ocl *m = state;
  if (!m) return;
  clFinish(m->cq); /* nothing to report to */
  state_drop(m);
}

static int ocl_moe_host_call(void *st, tdm_queue *q, void (*fn)(void *), void *arg) {
  int rc = tdm_moe__ocl_check_state(st, q, "host_call");
  return rc ? rc : tdm_moe__host_call_task(q, fn, arg);
}

const tdm_moe_ops tdm_moe__opencl_ops = {
    .name = "opencl",
    .open = ocl_moe_open,
    .close = ocl_moe_close,
    .rmsnorm = ocl_moe_rmsnorm,
    .router = ocl_moe_router,
    .expert = ocl_moe_expert,
    .experts = ocl_moe_experts,
    .expert_q = ocl_moe_expert_q,
    .experts_q = ocl_moe_experts_q,
    .group = ocl_moe_group,
    .combine = ocl_moe_combine,
    .get_rows = tdm_moe__ocl_get_rows,
    .matmul = tdm_moe__ocl_matmul,
    .matmul_q = tdm_moe__ocl_matmul_q,
    .rope = tdm_moe__ocl_rope,
    .attention = tdm_moe__ocl_attention,
    .host_call = ocl_moe_host_call,
};

/* The entry libtandem_moe looks up when it loads this module (libtandem_moe-opencl.so). */
__attribute__((visibility("default"))) const tdm_moe_ops *tdm_moe_ops_module(int abi) {
  return abi == TDM_MOE__OPS_ABI ? &tdm_moe__opencl_ops : NULL;
}
