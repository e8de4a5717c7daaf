/* ops.c: picks a device's MoE op table by its backend (built in for the CPU, a module of this
 * library for each GPU backend, loaded once, at first use), sizes the workspace expert()
 * needs, and runs a host pass (a layer's host-placed experts, called from a device's stream).
 * Only the public API: a device's backend is what tdm_device_info_get() says. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ops.h"

/* A GPU backend's module: tried once; what it gave, or why it gave nothing. */
typedef struct module {
  const char *backend;
  bool tried;
  const tdm_moe_ops *ops;
  char why[384];
} module;

static pthread_mutex_t modules_mu = PTHREAD_MUTEX_INITIALIZER;
static module modules[] = {{.backend = "cuda"}, {.backend = "opencl"}};

/* libtandem_moe-<backend>.so from this library's own folder (a build tree, or the installed
 * lib/ folder). NODELETE and never closed: the BLAS libraries under it keep process-wide state
 * (CLBlast's kernel cache, cuBLAS's handles) that must stay mapped. Under modules_mu. */
static void module_load(module *mod) {
  Dl_info self;
  char path[1024];
  mod->tried = true;
  if (!dladdr((void *)&tdm_moe_ops_for, &self) || !self.dli_fname) {
    snprintf(mod->why, sizeof mod->why, "cannot tell where libtandem_moe was loaded from");
    return;
  }
  const char *slash = strrchr(self.dli_fname, '/');
  int dir = slash ? (int)(slash - self.dli_fname) : 1;
  snprintf(path, sizeof path, "%.*s/libtandem_moe-%s.so", dir, slash ? self.dli_fname : ".",
           mod->backend);
  /* The module takes some of this library's functions from the process's global scope; where
   * the library was loaded local (a Python extension's dependency is), it is made global, once
   * (the reference stays: the library is not unloaded under its modules). */
  if (!dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL)) {
    snprintf(mod->why, sizeof mod->why, "%.380s", dlerror());
    return;
  }
  void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!dl) {
    snprintf(mod->why, sizeof mod->why, "%.380s", dlerror());
    return;
  }
  tdm_moe__module_fn entry = (tdm_moe__module_fn)dlsym(dl, TDM_MOE__MODULE_ENTRY);
  mod->ops = entry ? entry(TDM_MOE__OPS_ABI) : NULL;
  if (!mod->ops)
    snprintf(mod->why, sizeof mod->why, "%.300s is not a module of this libtandem_moe (no table "
             "of version %d)", path, TDM_MOE__OPS_ABI);
}

/* The module's table, or NULL with the reason in *why (static storage). */
static const tdm_moe_ops *module_ops(const char *backend, const char **why) {
  const tdm_moe_ops *ops = NULL;
  *why = "no such backend";
  pthread_mutex_lock(&modules_mu);
  for (size_t i = 0; i < sizeof modules / sizeof modules[0]; i++) {
    if (strcmp(modules[i].backend, backend) != 0) continue;
    if (!modules[i].tried) module_load(&modules[i]);
    ops = modules[i].ops;
    *why = modules[i].why;
  }
  pthread_mutex_unlock(&modules_mu);
  return ops;
}

const tdm_moe_ops *tdm_moe_ops_for(tdm_device *dev) {
  tdm_device_info info;
  if (tdm_device_info_get(dev, &info) != 0) return NULL; /* the message is set */
  const char *why = "this build has none (no OpenBLAS)";
  const tdm_moe_ops *ops = NULL;
  if (strcmp(info.backend, "cpu") == 0) {
#ifdef TANDEM_MOE_CPU
    ops = &tdm_moe__cpu_ops;
#endif
  } else {
    ops = module_ops(info.backend, &why);
  }
  if (!ops)
    tdm_set_error(TDM_ENOTSUP, 0, "no MoE operations for %s (backend %s): %s", info.id,
                  info.backend, why);
  return ops;
}

size_t tdm_moe_ops_workspace(int n, int H, int I) { return tdm_moe__workspace(n, H, I); }

void tdm_moe_host_pass_run(void *pass) {
  tdm_moe_host_pass *p = (tdm_moe_host_pass *)pass;
  if (!p) return;
  int rc, n = p->T > 0 && p->k > 0 && p->T <= INT32_MAX / p->k ? p->T * p->k : -1;
  if (!p->ops || !p->ops->name || strcmp(p->ops->name, "cpu") != 0) {
    rc = tdm_set_error(TDM_EINVAL, 0, "moe host pass: the table is not a CPU device's");
  } else if (n < 0 || p->E <= 0) {
    rc = tdm_set_error(TDM_EINVAL, 0, "moe host pass: T %d, k %d, E %d", p->T, p->k, p->E);
  } else {
    int mine = 0; /* a layer whose routing gives the host nothing costs no round trip */
    for (int i = 0; i < n && !mine; i++) mine = p->idx[i] >= 0 && p->idx[i] < p->E;
    if (!mine) {
      p->runs++;
      return;
    }
    int G = p->E < n ? p->E : n;
    rc = p->ops->group(p->st, p->q, p->idx, p->T, p->k, p->E, p->wofs, p->rows, p->slot,
                       p->groups);
    if (!rc)
      rc = p->ops->experts(p->st, p->q, p->x, p->rows, p->slot, n, p->wbase, p->groups, G, p->H,
                           p->I, p->out, p->workspace, p->workspace_bytes);
    int synced = tdm_queue_sync(p->q); /* the host's work is done when this returns */
    if (!rc) rc = synced;
  }
  p->runs++;
  if (rc && !p->status) {
    p->status = rc;
    snprintf(p->failure, sizeof p->failure, "%s", tdm_last_error());
  }
}
