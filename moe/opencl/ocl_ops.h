/* opencl/ocl_ops.h: inside the OpenCL MoE module (libtandem_moe-opencl.so), what its two files
 * share: the per-queue state, the program's kernels, and the helpers that resolve tandem
 * pointers, launch kernels and submit an op's native work (ops.c defines them, with the MoE
 * operations; xfmr.c holds a transformer's other operations). ops.c's banner says how ops
 * are enqueued, deferred and report errors; everything here follows it. */
#ifndef TANDEM_MOE_OPENCL_OCL_OPS_H
#define TANDEM_MOE_OPENCL_OCL_OPS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* OpenCL 1.2, as tandem's backend: the same entry points on every ICD loader. */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <clblast_c.h>

#include "ops.h" /* moe/ops.h */

/* The kernels of the one program open() builds from ops.c's source followed by xfmr.c's
 * (tdm_moe__ocl_xfmr_source) and quant.c's (tdm_moe__ocl_quant_source); ops.c names them. */
enum {
  K_RMSNORM, K_ROUTER, K_WIDEN, K_GATHER, K_SWIGLU, K_SCATTER, K_COMBINE, K_GATEUP, K_DOWN,
  K_GROUP, K_GET_ROWS, K_ROPE, K_ATTENTION, K_QWIDEN, K_QGATEUP, K_QDOWN, K_QMATMUL, K_COUNT
};

extern const char tdm_moe__ocl_xfmr_source[];
extern const char tdm_moe__ocl_quant_source[];

typedef struct moe_ocl {
  tdm_queue *q;         /* the queue open() bound the state to */
  tdm_device *dev;
  cl_command_queue cq;  /* its native queue, retained */
  bool defer;           /* the device gates host work on the host (ops.c: Deferral) */
  size_t wg;            /* the work-group size the program was built for (MOE_WG) */
  size_t xwg, team;     /* experts()'s work-group size and work-items per weight row */
  cl_ulong router_local; /* local memory the router's two arrays may take */
  cl_ulong group_local;  /* local memory group()'s counts may take */
  cl_ulong attn_local;   /* local memory attention()'s query and output rows may take */
  cl_device_id id;      /* the queue's device */
  cl_program prog;      /* the kernels' program, built by open() */
  cl_kernel k[K_COUNT];
  pthread_mutex_t mu;   /* kernel arguments: set and enqueued under it */
  atomic_int refs;      /* open()'s, and one per op submitted as a host task */
} moe_ocl;

/* A tandem pointer as a kernel sees it: the buffer and an offset in elements. */
typedef struct clbuf {
  cl_mem mem;
  cl_ulong off;
} clbuf;

/* A kernel argument. */
typedef struct karg {
  size_t size;
  const void *value; /* NULL: local memory of `size` bytes */
} karg;

/* v rounded up to a multiple of `to`: a kernel's global size. */
static inline size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

#define KBUF(b) {sizeof(cl_mem), &(b).mem}, {sizeof(cl_ulong), &(b).off}
#define KVAL(v) {sizeof(v), &(v)}

/* Errors, with tandem's message set: 0 when the state was opened on q, else TDM_EINVAL; an
 * op's arguments out of range (TDM_EINVAL); a failed OpenCL or CLBlast call (TDM_ENOMEM when
 * it ran out of memory, else TDM_EBACKEND). */
int tdm_moe__ocl_check_state(moe_ocl *m, tdm_queue *q, const char *op);
int tdm_moe__ocl_bad_args(const char *op);
int tdm_moe__ocl_cl_fail(const char *op, const char *what, cl_int err);
int tdm_moe__ocl_blast_fail(const char *op, const char *what, CLBlastStatusCode st);

/* Resolves p, which must be device memory of m's device aligned to `size` with room for
 * `count` elements; *avail (if not NULL) receives the elements from p to the allocation's end. */
int tdm_moe__ocl_resolve(moe_ocl *m, const char *op, const char *name, const void *p,
                         size_t count, size_t size, clbuf *out, size_t *avail);

/* Sets kernel kid's arguments and enqueues it on m's queue; with m->mu held, from an op's run
 * function. LAUNCH counts the arguments. */
int tdm_moe__ocl_launch(moe_ocl *m, const char *op, int kid, const karg *a, cl_uint na,
                        cl_uint dims, const size_t *global, const size_t *local);
#define LAUNCH(m, op, kid, args, dims, global, local)                                     \
  tdm_moe__ocl_launch(m, op, kid, args, (cl_uint)(sizeof(args) / sizeof((args)[0])), dims, \
                      global, local)

/* An op's native work: enqueues its commands on m->cq, with m->mu held; args are the op's
 * resolved arguments. */
typedef int (*tdm_moe__ocl_run)(moe_ocl *m, const void *args);

/* Runs run(m, args) now, or, when the queue holds work on the host that native commands would
 * overtake, from a host task on it (ops.c: Deferral) with a copy of the `size` bytes of args:
 * args need not outlive the call. 0, or the error of run() or of the host task's submission. */
int tdm_moe__ocl_submit(moe_ocl *m, tdm_moe__ocl_run run, const void *args, size_t size);

/* xfmr.c's entries of the table (tandem/moe_ops.h): a transformer's other operations. */
int tdm_moe__ocl_get_rows(void *st, tdm_queue *q, float *y, const float *table,
                          const int32_t *ids, int T, int H, int V);
int tdm_moe__ocl_matmul(void *st, tdm_queue *q, float *y, const float *x, const float *w, int T,
                        int K, int N, float beta);
int tdm_moe__ocl_matmul_q(void *st, tdm_queue *q, float *y, const float *x, const void *w,
                          int wtype, int T, int K, int N, float beta, void *ws, size_t ws_bytes);
int tdm_moe__ocl_rope(void *st, tdm_queue *q, float *x, int T, int nh, int hd, int pos0,
                      float base, float freq_scale, int neox);
int tdm_moe__ocl_attention(void *st, tdm_queue *q, float *out, const float *qv, const float *kc,
                           const float *vc, int T, int pos0, int nh, int nkv, int hd,
                           float scale);

#endif
