/* test-random-dag.c: model-based random test of stream ordering, run against every backend.
 *
 * A seeded generator writes random programs over a few device buffers and pinned host buffers:
 * copies (H2D, D2H, D2D, H2H, cross-queue), memsets and host tasks that transform host
 * buffers, spread over 3-4 queues (in-order and out-of-order). Each operation is applied to
 * tandem and, at once, to a sequential reference model in plain C. The generator only writes
 * race-free programs: every operation depends on the last operation that touched any of its
 * buffers, through in-order queue order, a dependency list, a device-side wait
 * (tdm_queue_wait) or a barrier, so program order is a valid sequential execution. After
 * syncing every queue, every buffer must equal the model. Device memory is read only through
 * copies, so GPU backends run this unchanged.
 *
 * Cases seed_N use fixed seeds; random_seed prints its seed (replay with TANDEM_TEST_SEED).
 */
#include "harness.h"

enum {
  NDEV = 4,      /* device buffers: ids 0..NDEV-1 */
  NHOST = 4,     /* pinned host buffers: ids NDEV..NDEV+NHOST-1 */
  NBUF = NDEV + NHOST,
  BUF = 16384,   /* bytes per buffer */
  NQ_MAX = 4,
  NOPS = 300,    /* operations per program */
  PROGRAMS = 3   /* programs per seed, each with fresh queues */
};

enum op_kind { OP_H2D, OP_D2H, OP_D2D, OP_H2H, OP_CROSS, OP_MEMSET, OP_TASK, OP_KINDS };
static const char *const op_name[OP_KINDS] = {"H2D",   "D2H",    "D2D", "H2H",
                                              "cross", "memset", "task"};

/* The last operation that touched a buffer: its event (one reference held here) and the queue
 * it ran on, which makes the dependency implicit for later work on the same in-order queue. */
struct last_access {
  tdm_event *ev;
  int queue;
};

struct world {
  tdm_device *dev;
  int nq;
  tdm_queue *q[NQ_MAX];
  int in_order[NQ_MAX];
  unsigned char *buf[NBUF];   /* tandem's buffers (device or pinned) */
  unsigned char model[NBUF][BUF];
  struct last_access last[NBUF];
  uint64_t rng;
  int verbose;
  /* Host task arguments live until the end of the program. */
  struct task_arg *args;
  int nargs;
};

/* A host task: dst[i] = dst[i] * 3 + src[i] ^ key over a range (src may be NULL). The same
 * function updates the model, so tandem and the model compute identical bytes. */
struct task_arg {
  unsigned char *dst;
  const unsigned char *src;
  size_t n;
  unsigned char key;
  int sleep_us;
};

static void transform(unsigned char *dst, const unsigned char *src, size_t n, unsigned char key) {
  for (size_t i = 0; i < n; i++)
    dst[i] = (unsigned char)(dst[i] * 3u + (src ? src[i] : (unsigned char)i)) ^ key;
}

static int task_transform(void *p) {
  struct task_arg *a = p;
  if (a->sleep_us) usleep((useconds_t)a->sleep_us); /* shakes up interleavings */
  transform(a->dst, a->src, a->n, a->key);
  return 0;
}

static int is_dev(int b) { return b < NDEV; }

static int rand_int(struct world *w, int n) { return (int)th_rand_below(&w->rng, (uint64_t)n); }

static int pick_dev(struct world *w) { return rand_int(w, NDEV); }
static int pick_host(struct world *w) { return NDEV + rand_int(w, NHOST); }

/* A random length: often tiny or whole, else anything. */
static size_t pick_len(struct world *w) {
  switch (rand_int(w, 6)) {
  case 0: return 1;
  case 1: return BUF;
  case 2: return 1 + (size_t)rand_int(w, 16);
  default: return 1 + (size_t)rand_int(w, BUF);
  }
}

static size_t pick_off(struct world *w, size_t len) { return (size_t)rand_int(w, (int)(BUF - len + 1)); }

/* ---- Dependencies ------------------------------------------------------------------------ */

struct deps {
  size_t n;
  tdm_event *ev[4];
};

/* Makes the operation about to be submitted on queue qi follow the last access of buffer b:
 * nothing when in-order queue order implies it, else a device-side wait, a barrier or an entry
 * in the dependency list, chosen at random. */
static void depend_on(struct world *w, int qi, int b, struct deps *d) {
  struct last_access *la = &w->last[b];
  if (!la->ev) return;
  if (la->queue == qi && w->in_order[qi]) return;
  for (size_t i = 0; i < d->n; i++)
    if (d->ev[i] == la->ev) return;
  switch (rand_int(w, 4)) {
  case 0: CHECK_OK(tdm_queue_wait(w->q[qi], la->ev)); break;
  case 1: CHECK_OK(tdm_queue_barrier(w->q[qi], 1, &la->ev, NULL)); break;
  default: d->ev[d->n++] = la->ev; break;
  }
}

/* Records that buffers b1 (and b2, if >= 0) were last touched by ev, run on queue qi. Takes
 * over the caller's reference to ev. */
static void set_last(struct world *w, int b, int qi, tdm_event *ev) {
  if (w->last[b].ev) CHECK_OK(tdm_event_release(w->last[b].ev));
  w->last[b] = (struct last_access){ev, qi};
}

static void touched(struct world *w, int qi, tdm_event *ev, int b1, int b2) {
  if (b2 >= 0 && b2 != b1) {
    CHECK_OK(tdm_event_retain(ev)); /* one reference per buffer slot */
    set_last(w, b2, qi, ev);
  }
  set_last(w, b1, qi, ev);
}

/* The event that marks an operation: its own, or sometimes a marker recorded right after it
 * (a marker follows all earlier work of the queue, so it covers the operation too). */
static tdm_event **want_out(struct world *w, tdm_event **slot, int *use_marker) {
  *slot = NULL;
  *use_marker = rand_int(w, 4) == 0;
  return *use_marker ? NULL : slot;
}

static void finish_out(struct world *w, int qi, tdm_event **slot, int use_marker) {
  if (use_marker) CHECK_OK(tdm_event_record(w->q[qi], slot));
  CHECK(*slot != NULL);
}

/* ---- Operations -------------------------------------------------------------------------- */

/* A copy between two buffers on one queue, explicit direction or AUTO. */
static void op_copy(struct world *w, enum op_kind kind) {
  int src, dst;
  tdm_copy_dir dir;
  switch (kind) {
  case OP_H2D: src = pick_host(w), dst = pick_dev(w), dir = TDM_COPY_H2D; break;
  case OP_D2H: src = pick_dev(w), dst = pick_host(w), dir = TDM_COPY_D2H; break;
  case OP_D2D: src = pick_dev(w), dst = pick_dev(w), dir = TDM_COPY_D2D; break;
  default: src = pick_host(w), dst = pick_host(w), dir = TDM_COPY_H2H; break;
  }
  if (src == dst) dst = is_dev(dst) ? (dst + 1) % NDEV : NDEV + (dst - NDEV + 1) % NHOST;
  if (rand_int(w, 4) == 0) dir = TDM_COPY_AUTO;
  size_t len = pick_len(w), so = pick_off(w, len), dso = pick_off(w, len);
  int qi = rand_int(w, w->nq), use_marker;
  struct deps d = {0, {NULL}};
  tdm_event *ev;
  depend_on(w, qi, src, &d);
  depend_on(w, qi, dst, &d);
  if (w->verbose)
    printf("%s q%d b%d[%zu] <- b%d[%zu] len %zu deps %zu\n", op_name[kind], qi, dst, dso, src, so,
           len, d.n);
  CHECK_OK(tdm_memcpy(w->q[qi], w->buf[dst] + dso, w->buf[src] + so, len, dir, d.n,
                      d.n ? d.ev : NULL, want_out(w, &ev, &use_marker)));
  finish_out(w, qi, &ev, use_marker);
  memcpy(w->model[dst] + dso, w->model[src] + so, len);
  touched(w, qi, ev, src, dst);
}

/* Device to device through tdm_memcpy_cross: runs on the source queue, the destination queue
 * waits. The copy does not follow the destination queue's own work, so the dependency on the
 * destination buffer's last access is explicit unless the source queue's order implies it. */
static void op_cross(struct world *w) {
  if (w->nq < 2) return;
  int src = pick_dev(w), dst = (src + 1 + rand_int(w, NDEV - 1)) % NDEV;
  int sq = rand_int(w, w->nq), dq = (sq + 1 + rand_int(w, w->nq - 1)) % w->nq;
  size_t len = pick_len(w), so = pick_off(w, len), dso = pick_off(w, len);
  struct deps d = {0, {NULL}};
  tdm_event *ev = NULL;
  /* Only explicit dependencies here: a wait or barrier on sq would be fine too, but
   * tdm_memcpy_cross's own dependency list is what this operation exercises. */
  struct last_access *ls = &w->last[src], *ld = &w->last[dst];
  if (ls->ev && !(ls->queue == sq && w->in_order[sq])) d.ev[d.n++] = ls->ev;
  if (ld->ev && ld->ev != ls->ev && !(ld->queue == sq && w->in_order[sq])) d.ev[d.n++] = ld->ev;
  if (w->verbose)
    printf("cross q%d->q%d b%d[%zu] <- b%d[%zu] len %zu deps %zu\n", sq, dq, dst, dso, src, so,
           len, d.n);
  CHECK_OK(tdm_memcpy_cross(w->q[sq], w->q[dq], w->buf[dst] + dso, w->buf[src] + so, len, d.n,
                            d.n ? d.ev : NULL, &ev));
  memcpy(w->model[dst] + dso, w->model[src] + so, len);
  touched(w, sq, ev, src, dst);
}

static void op_memset(struct world *w) {
  int b = rand_int(w, NBUF);
  size_t len = pick_len(w), off = pick_off(w, len);
  int value = 1 + rand_int(w, 255), qi = rand_int(w, w->nq), use_marker;
  struct deps d = {0, {NULL}};
  tdm_event *ev;
  depend_on(w, qi, b, &d);
  if (w->verbose) printf("memset q%d b%d[%zu] len %zu = %d\n", qi, b, off, len, value);
  CHECK_OK(tdm_memset(w->q[qi], w->buf[b] + off, value, len, d.n, d.n ? d.ev : NULL,
                      want_out(w, &ev, &use_marker)));
  finish_out(w, qi, &ev, use_marker);
  memset(w->model[b] + off, value, len);
  touched(w, qi, ev, b, -1);
}

static void op_task(struct world *w) {
  int dst = pick_host(w), src = rand_int(w, 2) ? pick_host(w) : -1;
  if (src == dst) src = -1;
  size_t len = pick_len(w), off = pick_off(w, len), soff = pick_off(w, len);
  int qi = rand_int(w, w->nq), use_marker;
  struct deps d = {0, {NULL}};
  tdm_event *ev;
  CHECK(w->nargs < NOPS);
  struct task_arg *a = &w->args[w->nargs++];
  *a = (struct task_arg){w->buf[dst] + off, src >= 0 ? w->buf[src] + soff : NULL, len,
                         (unsigned char)rand_int(w, 256), rand_int(w, 8) == 0 ? 200 : 0};
  depend_on(w, qi, dst, &d);
  if (src >= 0) depend_on(w, qi, src, &d);
  if (w->verbose) printf("task q%d b%d[%zu] from b%d len %zu\n", qi, dst, off, src, len);
  CHECK_OK(tdm_host_task(w->q[qi], task_transform, a, d.n, d.n ? d.ev : NULL,
                         want_out(w, &ev, &use_marker)));
  finish_out(w, qi, &ev, use_marker);
  transform(w->model[dst] + off, src >= 0 ? w->model[src] + soff : NULL, len, a->key);
  touched(w, qi, ev, dst, src);
}

static void random_op(struct world *w) {
  static const enum op_kind mix[] = {OP_H2D, OP_H2D, OP_D2H, OP_D2H, OP_D2D, OP_D2D, OP_H2H,
                                     OP_CROSS, OP_CROSS, OP_MEMSET, OP_TASK, OP_TASK, OP_TASK};
  enum op_kind k = mix[rand_int(w, (int)(sizeof mix / sizeof mix[0]))];
  switch (k) {
  case OP_CROSS: op_cross(w); break;
  case OP_MEMSET: op_memset(w); break;
  case OP_TASK: op_task(w); break;
  default: op_copy(w, k); break;
  }
}

/* ---- One program ------------------------------------------------------------------------- */

static void setup(struct world *w, int ooo_ok) {
  w->nq = 3 + rand_int(w, 2);
  for (int i = 0; i < w->nq; i++) {
    /* q0 in-order, q1 out-of-order where supported, the rest at random. */
    w->in_order[i] = !ooo_ok || i == 0 || (i > 1 && rand_int(w, 2));
    CHECK_OK(tdm_queue_create(w->dev, w->in_order[i] ? TDM_QUEUE_IN_ORDER : TDM_QUEUE_OUT_OF_ORDER,
                              &w->q[i]));
  }
  unsigned char *init = NULL;
  CHECK_OK(tdm_malloc(w->dev, TDM_MEM_PINNED, BUF, (void **)&init));
  for (int b = 0; b < NBUF; b++) {
    CHECK_OK(tdm_malloc(w->dev, is_dev(b) ? TDM_MEM_DEVICE : TDM_MEM_PINNED, BUF,
                        (void **)&w->buf[b]));
    th_fill_random(w->model[b], BUF, &w->rng);
    if (is_dev(b)) {
      memcpy(init, w->model[b], BUF);
      CHECK_OK(tdm_memcpy(w->q[0], w->buf[b], init, BUF, TDM_COPY_H2D, 0, NULL, NULL));
      CHECK_OK(tdm_queue_sync(w->q[0]));
    } else {
      memcpy(w->buf[b], w->model[b], BUF);
    }
    w->last[b] = (struct last_access){NULL, 0};
  }
  CHECK_OK(tdm_free(init));
  w->nargs = 0;
}

/* Syncs everything, then compares every buffer with the model. */
static void check_and_teardown(struct world *w, int program) {
  unsigned char *back = NULL;
  for (int i = 0; i < w->nq; i++) CHECK_OK(tdm_queue_sync(w->q[i]));
  for (int b = 0; b < NBUF; b++) {
    if (w->last[b].ev) {
      CHECK_OK(tdm_event_query(w->last[b].ev));
      CHECK_OK(tdm_event_release(w->last[b].ev));
    }
  }
  CHECK_OK(tdm_malloc(w->dev, TDM_MEM_PINNED, BUF, (void **)&back));
  for (int b = 0; b < NBUF; b++) {
    const unsigned char *got = w->buf[b];
    if (is_dev(b)) {
      CHECK_OK(tdm_memcpy(w->q[0], back, w->buf[b], BUF, TDM_COPY_D2H, 0, NULL, NULL));
      CHECK_OK(tdm_queue_sync(w->q[0]));
      got = back;
    }
    long at = th_first_diff(got, w->model[b], BUF);
    CHECK_MSG(at < 0, "program %d: %s buffer %d differs from the model at byte %ld", program,
              is_dev(b) ? "device" : "host", b, at);
  }
  CHECK_OK(tdm_free(back));
  for (int b = 0; b < NBUF; b++) CHECK_OK(tdm_free(w->buf[b]));
  for (int i = 0; i < w->nq; i++) CHECK_OK(tdm_queue_destroy(w->q[i]));
}

static void run_seed(uint64_t seed) {
  struct world *w = calloc(1, sizeof *w);
  CHECK(w != NULL);
  w->rng = seed;
  w->verbose = getenv("TANDEM_TEST_VERBOSE") != NULL;
  w->args = calloc(NOPS, sizeof *w->args);
  w->dev = th_open();
  tdm_device_info info;
  CHECK_OK(tdm_device_info_get(w->dev, &info));
  int ooo_ok = (info.caps & TDM_DEVICE_CAP_OUT_OF_ORDER) != 0;
  for (int p = 0; p < PROGRAMS; p++) {
    setup(w, ooo_ok);
    printf("program %d: %d queues (", p, w->nq);
    for (int i = 0; i < w->nq; i++) printf("%s%s", i ? " " : "", w->in_order[i] ? "in" : "ooo");
    printf("), %d operations\n", NOPS);
    for (int i = 0; i < NOPS; i++) random_op(w);
    check_and_teardown(w, p);
  }
  tdm_stats st;
  CHECK_OK(tdm_stats_get(&st));
  CHECK_EQ(st.pending, 0);
  th_close();
  free(w->args);
  free(w);
}

TEST_CASE(seed_1) { run_seed(1); }
TEST_CASE(seed_2) { run_seed(2); }
TEST_CASE(seed_3) { run_seed(3); }
TEST_CASE(seed_4) { run_seed(0x5eed0004); }
TEST_CASE(seed_5) { run_seed(0xdecafbad); }
TEST_CASE(seed_6) { run_seed(20261130); }
TEST_CASE(random_seed) { run_seed(th_seed()); }
