/* context.c: the runtime's one context: reference-counted init and shutdown, the device table,
 * version queries, and the fork guard. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

tdm__ctx tdm__g = {.mu = PTHREAD_MUTEX_INITIALIZER};
_Atomic int tdm__forked;

/* init_mu guards refs and the closing flag; init_cv tells tdm_init calls that wait for a
 * last shutdown in progress that it has finished. The shutdown does not hold init_mu while it
 * drains: host tasks it waits for may call tdm_init. */
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t init_cv = PTHREAD_COND_INITIALIZER;
static bool closing;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) { atomic_store(&tdm__forked, 1); }
static void install_atfork(void) { pthread_atfork(NULL, NULL, on_fork_child); }
void tdm__fork_guard(void) { pthread_once(&atfork_once, install_atfork); }

bool tdm__on_tandem_thread(void) { return tdm__tls_queue || tdm__tls_releasing; }

unsigned tdm_version(void) { return TDM_VERSION; }

const char *tdm_version_string(void) {
#define TDM__STR2(x) #x
#define TDM__STR(x) TDM__STR2(x)
  return TDM__STR(TDM_VERSION_MAJOR) "." TDM__STR(TDM_VERSION_MINOR) "." TDM__STR(
      TDM_VERSION_PATCH);
}

int tdm__enter_fail(void) {
  if (atomic_load_explicit(&tdm__forked, memory_order_relaxed))
    return tdm__error(TDM_EFORK, 0, "this process is a child forked after tdm_init; its "
                                    "threads and devices belong to the parent");
  switch (atomic_load_explicit(&tdm__g.live, memory_order_acquire)) {
    case TDM__CLOSING:
      if (tdm__on_tandem_thread()) return 0; /* the drain waits for this very work */
      return tdm__error(TDM_ENOTINIT, 0, "the last tdm_shutdown is in progress");
    case TDM__SEALED:
      return tdm__error(TDM_ENOTINIT, 0, "the last tdm_shutdown is in progress (every queue "
                                         "has drained)");
    default: /* also LIVE: the call raced the first init, and came before it */
      return tdm__error(TDM_ENOTINIT, 0, "call tdm_init first");
  }
}

int tdm__device_check(tdm_device *dev) {
  if (!dev) return tdm__error(TDM_EINVAL, 0, "device is NULL");
  /* Compared as integers: a pointer into the table but not at an entry's start is foreign. */
  uintptr_t p = (uintptr_t)dev, base = (uintptr_t)tdm__g.devices;
  if (p < base || p >= base + (uintptr_t)tdm__g.ndevices * sizeof *dev ||
      (p - base) % sizeof *dev != 0)
    return tdm__error(TDM_EHANDLE, 0, "%p is not a tandem device", (void *)dev);
  if (atomic_load(&dev->lost))
    return tdm__error(TDM_EDEVLOST, 0, "device %s was lost", dev->info.id);
  return 0;
}

int tdm__device_lost(tdm_device *dev, int code) {
  if (code == TDM_EDEVLOST && dev && !atomic_exchange(&dev->lost, 1))
    fprintf(stderr, "tandem: device %s lost; it refuses all further work\n", dev->info.id);
  return code;
}

/* Registers a backend and its devices; a failed init leaves it listed with its status. */
void tdm__backend_add(const tdm__backend *be, void *dl, const char *detail) {
  if (tdm__g.nbackends == TDM__MAX_BACKENDS) return;
  tdm__backend_slot *slot = &tdm__g.backends[tdm__g.nbackends++];
  memset(slot, 0, sizeof *slot);
  const char *name = tdm__b_name(be);
  snprintf(slot->info.name, sizeof slot->info.name, "%s", name);
  snprintf(slot->info.detail, sizeof slot->info.detail, "%s", detail ? detail : "");
  slot->dl = dl;
  int n = 0;
  int rc = tdm__b_init(be, &n);
  if (rc) {
    slot->info.status = rc;
    snprintf(slot->info.detail, sizeof slot->info.detail, "%s", tdm__last_detail());
    return;
  }
  slot->first_device = tdm__g.ndevices;
  for (int i = 0; i < n && tdm__g.ndevices < TDM__MAX_DEVICES; i++) {
    tdm_device *d = &tdm__g.devices[tdm__g.ndevices];
    memset(d, 0, sizeof *d);
    d->be = be;
    d->bindex = i;
    d->index = tdm__g.ndevices;
    /* A device that cannot describe itself, or whose address range is unknown (a freed
     * pointer in it would pass for host memory), refuses the whole backend: its devices would
     * otherwise be half-known. */
    if ((rc = tdm__b_device_info(d)) || (rc = tdm__b_address_range(d))) {
      slot->info.status = rc;
      snprintf(slot->info.detail, sizeof slot->info.detail, "device %d: %s", i,
               tdm__last_detail());
      tdm__g.ndevices = slot->first_device;
      slot->info.device_count = 0;
      tdm__b_shutdown(be);
      return;
    }
    d->info.index = d->index;
    d->info.backend_index = i;
    snprintf(d->info.backend, sizeof d->info.backend, "%s", name);
    snprintf(d->info.id, sizeof d->info.id, "%s:%d", name, i);
    tdm__g.ndevices++;
    slot->info.device_count++;
  }
  slot->be = be;
}

/* Set up by the first init; services backends use instead of linking to the core. */
static void event_set_native(tdm__event *ev, void *handle) {
  atomic_store_explicit(&ev->bev, handle, memory_order_release);
}

static void *event_native(tdm__event *ev, const tdm__backend *be) {
  return ev->q->dev->be == be ? atomic_load_explicit(&ev->bev, memory_order_acquire) : NULL;
}

static int event_device(tdm__event *ev, const tdm__backend **be) {
  *be = ev->q->dev->be;
  return ev->q->dev->bindex;
}

static bool event_imported(tdm__event *ev) { return ev->q->imports; }

static void fill_services(tdm__services *s) {
  s->cmd_run = tdm__cmd_run;
  s->cmd_done = tdm__cmd_done;
  s->event_on_complete = tdm__event_on_complete;
  s->error = tdm__error;
  s->option_long = tdm__option_long;
  s->cmd_native = tdm__cmd_native;
  s->threadpool_submit = tdm__threadpool_after_deps;
  s->event_set_native = event_set_native;
  s->event_native = event_native;
  s->event_device = event_device;
  s->event_imported = event_imported;
}

/* ---- returning from main with work pending ----
 * exit() runs the atexit handlers, then the libraries' destructors, the CUDA runtime's among
 * them, which tear down driver state while tandem's threads may still be inside a driver call
 * on work the program left pending (a crash, seen rarely). So the first tdm_init registers a
 * handler that, while tandem is still initialized, first waits for the work already submitted
 * to complete, for at most TANDEM_EXIT_WAIT_MS: tandem's threads are then idle, outside every
 * driver, when the destructors run. Lazily completed commands are handed to their executors
 * (a kick), so none waits for a watcher that will never come. Work that does not complete in
 * time (a host task that never returns) is left as it was, and exit goes on. Not in a forked
 * child, nor when exit() is called from a host task or a keep-alive release: the wait would
 * include the caller's own work. */
static pthread_once_t atexit_once = PTHREAD_ONCE_INIT;

static long exit_pending_kick(void) {
  long pending = 0;
  pthread_mutex_lock(&tdm__g.mu);
  for (tdm__queue *q = tdm__g.queues; q; q = q->next_all) {
    if (atomic_load(&q->magic) != TDM__MAGIC_QUEUE || q->imports) continue;
    long n = atomic_load(&q->n_submitted) - atomic_load(&q->n_done);
    if (n > 0) tdm__exec_kick(q);
    pending += n > 0 ? n : 0;
  }
  pthread_mutex_unlock(&tdm__g.mu);
  return pending;
}

static void on_exit_wait(void) {
  if (atomic_load(&tdm__forked) || atomic_load(&tdm__g.live) != TDM__LIVE ||
      tdm__on_tandem_thread())
    return;
  uint64_t until = tdm__now_ns() + (uint64_t)tdm__g.opts.exit_wait_ms * 1000000u;
  struct timespec t = {0, 500000}; /* 0.5 ms */
  if (exit_pending_kick() == 0) return;
  while (exit_pending_kick() > 0 && tdm__now_ns() < until) nanosleep(&t, NULL);
  /* The last completions are counted before their threads finish the loop they ran in: a
   * moment more for those to reach their idle wait. */
  t.tv_nsec = 1000000;
  nanosleep(&t, NULL);
}

static void install_atexit(void) { (void)atexit(on_exit_wait); }

int tdm_init(void) {
  tdm__fork_guard();
  if (atomic_load(&tdm__forked))
    return tdm__error(TDM_EFORK, 0, "tdm_init in a child forked after tdm_init");
  pthread_mutex_lock(&init_mu);
  if (closing && tdm__on_tandem_thread()) {
    /* The shutdown waits for this thread's work: waiting for the shutdown would be a cycle. */
    pthread_mutex_unlock(&init_mu);
    return tdm__error(TDM_EDEADLK, 0, "tdm_init from a %s while the last tdm_shutdown drains "
                      "its queue", tdm__tls_queue ? "host task" : "keep-alive release");
  }
  while (closing) pthread_cond_wait(&init_cv, &init_mu); /* a fresh context once it is done */
  if (tdm__g.refs++ > 0) {
    pthread_mutex_unlock(&init_mu);
    return 0;
  }
  atomic_fetch_add(&tdm__g.epoch, 1);
  tdm__options_load(&tdm__g.opts);
  fill_services(&tdm__g.svc);
  tdm__g.nbackends = 0;
  tdm__g.ndevices = 0;
  tdm__g.next_queue_id = 0;
  if (tdm__backend_allowed("cpu")) tdm__backend_add(&tdm__cpu_backend, NULL, "built in");
  tdm__modules_load();
  tdm__trace_start();
  int rc = tdm__release_start();
  if (rc) {
    tdm__modules_unload();
    tdm__g.refs = 0;
    pthread_mutex_unlock(&init_mu);
    return rc;
  }
  atomic_store(&tdm__g.live, TDM__LIVE);
  pthread_mutex_unlock(&init_mu);
  /* After the backends: atexit handlers run in reverse, so this one runs before any that a
   * driver registered while it loaded. */
  pthread_once(&atexit_once, install_atexit);
  return 0;
}

static void nap_us(long us) {
  struct timespec t = {0, us * 1000L};
  nanosleep(&t, NULL);
}

/* A live queue nobody is destroying, claimed for the caller; NULL if none. *others counts the
 * live queues that other threads are destroying (host tasks and releases may destroy queues
 * while the shutdown drains). */
static tdm__queue *claim_live_queue(int *others) {
  *others = 0;
  pthread_mutex_lock(&tdm__g.mu);
  tdm__queue *got = NULL;
  for (tdm__queue *q = tdm__g.queues; q && !got; q = q->next_all) {
    if (atomic_load(&q->magic) != TDM__MAGIC_QUEUE || q->imports) continue;
    if (atomic_exchange(&q->claimed, true))
      ++*others;
    else
      got = q;
  }
  pthread_mutex_unlock(&tdm__g.mu);
  return got;
}

/* Drains and destroys every live queue, including those that host tasks and keep-alive
 * releases create while it runs, until none is left and no release is pending. */
static void drain_everything(void) {
  tdm__defaults_destroy_all();
  for (;;) {
    int others;
    tdm__queue *q = claim_live_queue(&others);
    if (q) {
      q->owned_by_tandem = false;
      tdm__queue_destroy_final(q);
      continue;
    }
    if (others == 0 && tdm__release_pending() == 0) return;
    nap_us(200); /* another thread's destroy, or a release, is still underway */
  }
}

/* The last shutdown. It releases init_mu while it drains (host tasks it waits for may call
 * tdm_init, which then fails at once instead of waiting on it), and frees nothing until the
 * program's calls in progress have returned and tandem's threads are joined. */
int tdm_shutdown(void) {
  if (atomic_load(&tdm__forked)) return tdm__error(TDM_EFORK, 0, "tdm_shutdown in a forked child");
  pthread_mutex_lock(&init_mu);
  if (tdm__g.refs == 0) {
    pthread_mutex_unlock(&init_mu);
    return tdm__error(TDM_ENOTINIT, 0, "%s",
                      closing ? "tdm_shutdown while the last tdm_shutdown is in progress"
                              : "tdm_shutdown without tdm_init");
  }
  if (tdm__g.refs == 1 && tdm__on_tandem_thread()) {
    /* The last shutdown joins the thread this caller runs on. */
    pthread_mutex_unlock(&init_mu);
    return tdm__error(TDM_EDEADLK, 0, "the last tdm_shutdown from a %s would wait for itself",
                      tdm__tls_queue ? "host task" : "keep-alive release");
  }
  if (--tdm__g.refs > 0) {
    pthread_mutex_unlock(&init_mu);
    return 0;
  }
  closing = true;
  atomic_store_explicit(&tdm__g.live, TDM__CLOSING, memory_order_seq_cst);
  pthread_mutex_unlock(&init_mu);
  /* The program's calls that entered before: they may create queues or destroy them. */
  while (atomic_load_explicit(&tdm__g.calls, memory_order_seq_cst) > 0) nap_us(100);
  drain_everything();
  atomic_store(&tdm__g.live, TDM__SEALED);
  tdm__imports_stop();
  tdm__release_stop();
  tdm__threadpool_stop();
  tdm__trace_flush();
  tdm__mem_free_all();
  tdm__queues_release_native();
  tdm__modules_unload();
  tdm__queues_free_all();
  atomic_store(&tdm__g.n_queues, 0);
  pthread_mutex_lock(&init_mu);
  atomic_store(&tdm__g.live, TDM__OFF);
  closing = false;
  pthread_cond_broadcast(&init_cv);
  pthread_mutex_unlock(&init_mu);
  return 0;
}

int tdm_backend_count(int *count) {
  TDM__ENTER();
  if (!count) return tdm__error(TDM_EINVAL, 0, "tdm_backend_count: count is NULL");
  *count = tdm__g.nbackends;
  return 0;
}

int tdm_backend_get(int index, tdm_backend_info *info) {
  TDM__ENTER();
  if (!info) return tdm__error(TDM_EINVAL, 0, "tdm_backend_get: info is NULL");
  if (index < 0 || index >= tdm__g.nbackends)
    return tdm__error(TDM_EINVAL, 0, "backend index %d out of [0, %d)", index, tdm__g.nbackends);
  *info = tdm__g.backends[index].info;
  return 0;
}

int tdm_device_count(int *count) {
  TDM__ENTER();
  if (!count) return tdm__error(TDM_EINVAL, 0, "tdm_device_count: count is NULL");
  *count = tdm__g.ndevices;
  return 0;
}

int tdm_device_get(int index, tdm_device **out) {
  TDM__ENTER();
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_device_get: out is NULL");
  if (index < 0 || index >= tdm__g.ndevices)
    return tdm__error(TDM_ENODEV, 0, "device index %d out of [0, %d)", index, tdm__g.ndevices);
  *out = &tdm__g.devices[index];
  return 0;
}

int tdm_device_find(const char *id, tdm_device **out) {
  TDM__ENTER();
  if (!out) return tdm__error(TDM_EINVAL, 0, "tdm_device_find: out is NULL");
  if (!id || !*id) id = tdm__g.opts.device;
  if (!*id) {
    /* The first GPU device, else cpu:0. */
    tdm_device *pick = NULL;
    for (int i = 0; i < tdm__g.ndevices && !pick; i++)
      if (tdm__g.devices[i].info.caps & TDM_DEVICE_CAP_GPU) pick = &tdm__g.devices[i];
    for (int i = 0; i < tdm__g.ndevices && !pick; i++)
      if (strcmp(tdm__g.devices[i].info.backend, "cpu") == 0) pick = &tdm__g.devices[i];
    if (!pick) return tdm__error(TDM_ENODEV, 0, "no devices");
    *out = pick;
    return 0;
  }
  for (int i = 0; i < tdm__g.ndevices; i++)
    if (strcmp(tdm__g.devices[i].info.id, id) == 0) {
      *out = &tdm__g.devices[i];
      return 0;
    }
  return tdm__error(TDM_ENODEV, 0, "no device \"%s\" (see `tandem devices`)", id);
}

int tdm_device_info_get(tdm_device *dev, tdm_device_info *info) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!info) return tdm__error(TDM_EINVAL, 0, "tdm_device_info_get: info is NULL");
  *info = dev->info;
  return 0;
}

int tdm_device_native(tdm_device *dev, void **native) {
  TDM__ENTER();
  int rc = tdm__device_check(dev);
  if (rc) return rc;
  if (!native) return tdm__error(TDM_EINVAL, 0, "tdm_device_native: native is NULL");
  void *n = NULL;
  if ((rc = tdm__b_device_native(dev, &n))) return rc;
  *native = n;
  return 0;
}
