/* modules.c: finds backend modules (libtandem-<name>.so) next to libtandem and on
 * $TANDEM_BACKEND_PATH, refuses a table of another version, and unloads them at the last
 * shutdown, after every backend has joined its threads. Once every backend is in, it reports
 * a TANDEM_BACKENDS or TANDEM_DEVICE that names none of them. */
#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

typedef const void *(*entry_fn)(void);

static void refuse(const char *name, int status, const char *detail) {
  if (tdm__g.nbackends == TDM__MAX_BACKENDS) return;
  tdm__backend_slot *slot = &tdm__g.backends[tdm__g.nbackends++];
  memset(slot, 0, sizeof *slot);
  snprintf(slot->info.name, sizeof slot->info.name, "%s", name);
  slot->info.status = status;
  snprintf(slot->info.detail, sizeof slot->info.detail, "%.*s", (int)sizeof slot->info.detail - 1, detail);
}

static bool known(const char *name) {
  for (int i = 0; i < tdm__g.nbackends; i++)
    if (strcmp(tdm__g.backends[i].info.name, name) == 0) return true;
  return false;
}

static void load_one(const char *dir, const char *file) {
  char name[16], path[1200], msg[1400];
  const char *start = file + strlen("libtandem-");
  size_t len = strlen(start) - strlen(".so");
  if (len == 0 || len >= sizeof name) return;
  memcpy(name, start, len);
  name[len] = 0;
  if (known(name) || !tdm__backend_allowed(name)) return; /* the first folder wins */
  snprintf(path, sizeof path, "%s/%s", dir, file);
  /* NODELETE: a driver stack (an OpenCL ICD loader, say) may keep process-lifetime state
   * that must stay mapped; the module's threads are joined before it is closed anyway. */
  void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!dl) {
    snprintf(msg, sizeof msg, "%s", dlerror());
    refuse(name, TDM_ENODEV, msg);
    return;
  }
  entry_fn entry = (entry_fn)dlsym(dl, "tdm_backend_module");
  const tdm__backend *be = entry ? entry() : NULL;
  if (!be) {
    snprintf(msg, sizeof msg, "%s has no tdm_backend_module table", path);
    refuse(name, TDM_EVERSION, msg);
    dlclose(dl);
    return;
  }
  unsigned version = 0;
  if (tdm__b_check_version(be, &version)) {
    snprintf(msg, sizeof msg, "%s: table version 0x%x, this libtandem needs 0x%x", path,
             version, TDM__BACKEND_ABI);
    refuse(name, TDM_EVERSION, msg);
    dlclose(dl);
    return;
  }
  tdm__backend_add(be, dl, path);
}

/* Known backends load first and in this order, so device indices, and the default device (the
 * first GPU), do not depend on directory order: CUDA before OpenCL on an NVIDIA machine. */
static const char *const known_names[] = {"cuda", "opencl"};

static void scan(const char *dir) {
  char file[64];
  for (size_t i = 0; i < sizeof known_names / sizeof known_names[0]; i++) {
    snprintf(file, sizeof file, "libtandem-%s.so", known_names[i]);
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (access(path, F_OK) == 0) load_one(dir, file);
  }
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t n = strlen(e->d_name);
    if (n > 13 && strncmp(e->d_name, "libtandem-", 10) == 0 &&
        strcmp(e->d_name + n - 3, ".so") == 0)
      load_one(dir, e->d_name);
  }
  closedir(d);
}

/* A backend name tandem knows of: built in, one it looks for, or a module it found. */
static bool backend_name(const char *name, size_t len) {
  if (len == 3 && strncmp(name, "cpu", 3) == 0) return true;
  for (size_t i = 0; i < sizeof known_names / sizeof known_names[0]; i++)
    if (strlen(known_names[i]) == len && strncmp(known_names[i], name, len) == 0) return true;
  for (int i = 0; i < tdm__g.nbackends; i++)
    if (strlen(tdm__g.backends[i].info.name) == len &&
        strncmp(tdm__g.backends[i].info.name, name, len) == 0)
      return true;
  return false;
}

/* TANDEM_BACKENDS names backends, so it can be checked only once they are all in. */
static void report_unknown_backends(void) {
  const char *list = tdm__g.opts.backends;
  int known_entries = 0, unknown_entries = 0;
  for (const char *p = list; *p; p += *p == ',') {
    size_t len = strcspn(p, ",");
    if (len && backend_name(p, len)) known_entries++;
    else if (len) unknown_entries++;
    p += len;
  }
  if (*list && !known_entries)
    fprintf(stderr, "tandem: TANDEM_BACKENDS=%s names no known backend (cpu, cuda, opencl, or a "
            "libtandem-<name>.so module), so there are no devices\n", list);
  else if (unknown_entries)
    for (const char *p = list; *p; p += *p == ',') {
      size_t len = strcspn(p, ",");
      if (len && !backend_name(p, len))
        fprintf(stderr, "tandem: ignoring \"%.*s\" in TANDEM_BACKENDS=%s (no such backend)\n",
                (int)len, p, list);
      p += len;
    }
}

/* Likewise TANDEM_DEVICE. A device that does not exist is not replaced by another: asking for
 * the default device then fails with TDM_ENODEV, rather than running the program somewhere it
 * did not ask for. */
static void report_missing_device(void) {
  const char *want = tdm__g.opts.device;
  if (!*want) return;
  char ids[256] = "";
  size_t used = 0;
  for (int i = 0; i < tdm__g.ndevices; i++) {
    if (strcmp(tdm__g.devices[i].info.id, want) == 0) return;
    int n = snprintf(ids + used, sizeof ids - used, "%s%s", used ? " " : "",
                     tdm__g.devices[i].info.id);
    if (n > 0 && (size_t)n < sizeof ids - used) used += (size_t)n;
  }
  fprintf(stderr, "tandem: TANDEM_DEVICE=%s names no device (there are: %s), so there is no "
          "default device\n", want, used ? ids : "none");
}

void tdm__modules_load(void) {
  char paths[sizeof tdm__g.opts.backend_path];
  snprintf(paths, sizeof paths, "%s", tdm__g.opts.backend_path);
  char *save = NULL;
  for (char *dir = strtok_r(paths, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) scan(dir);
  /* Then the folder libtandem itself was loaded from; known backends not found are listed. */
  Dl_info info;
  if (dladdr((void *)tdm__modules_load, &info) && info.dli_fname) {
    char self[1024];
    snprintf(self, sizeof self, "%s", info.dli_fname);
    char *slash = strrchr(self, '/');
    if (slash) {
      *slash = 0;
      scan(self);
    }
  }
  for (size_t i = 0; i < sizeof known_names / sizeof known_names[0]; i++)
    if (!known(known_names[i]) && tdm__backend_allowed(known_names[i])) {
      char msg[128];
      snprintf(msg, sizeof msg, "libtandem-%s.so not found (not built, or not on "
               "TANDEM_BACKEND_PATH)", known_names[i]);
      refuse(known_names[i], TDM_ENODEV, msg);
    }
  report_unknown_backends();
  report_missing_device();
}

void tdm__modules_unload(void) {
  for (int i = tdm__g.nbackends - 1; i >= 0; i--) {
    tdm__backend_slot *s = &tdm__g.backends[i];
    if (s->be) tdm__b_shutdown(s->be);
    if (s->dl) dlclose(s->dl);
    s->be = NULL;
    s->dl = NULL;
  }
  tdm__g.nbackends = 0;
  tdm__g.ndevices = 0;
}
