/* cpu.c: the CPU backend's table. Devices are the host (TANDEM_CPU_DEVICES of them, all the
 * same machine); "device" memory is host memory that the core tags as device memory, so copy
 * directions are checked as on a GPU. In-order queues are tdm_cpu_streams; out-of-order queues
 * share the core's thread pool. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu.h"

const tdm__services *tdm__cpu_svc;
static long ndev;
static char cpu_name[128];

struct tdm__bqueue {
  tdm_cpu_stream *stream; /* NULL for out-of-order queues */
  bool owns_stream;
};

static void read_cpu_name(void) {
  snprintf(cpu_name, sizeof cpu_name, "host CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[256];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *v = strchr(line, ':');
      if (v) {
        v++;
        while (*v == ' ') v++;
        v[strcspn(v, "\n")] = 0;
        snprintf(cpu_name, sizeof cpu_name, "%s", v);
      }
      break;
    }
  }
  fclose(f);
}

static int cpu_init(const tdm__services *svc, int *ndevices) {
  tdm__cpu_svc = svc;
  ndev = svc->option_long("TANDEM_CPU_DEVICES", 1);
  read_cpu_name();
  *ndevices = (int)ndev;
  return 0;
}

static void cpu_shutdown(void) {}

static int cpu_device_info(int bdev, tdm_device_info *info) {
  memset(info, 0, sizeof *info);
  snprintf(info->name, sizeof info->name, "%s", cpu_name);
  info->total_memory = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  info->caps = TDM_DEVICE_CAP_TIMING | TDM_DEVICE_CAP_OUT_OF_ORDER | TDM_DEVICE_CAP_ADOPT |
               TDM_DEVICE_CAP_HOST_MEMORY;
  return 0;
}

static int cpu_queue_create(int bdev, unsigned flags, void *adopt, tdm__bqueue **out) {
  const tdm__services *svc = tdm__cpu_svc;
  if (adopt && (flags & TDM_QUEUE_OUT_OF_ORDER))
    return svc->error(TDM_EINVAL, 0, "an adopted tdm_cpu_stream is in-order");
  if (adopt && !tdm__cpu_stream_valid(adopt))
    return svc->error(TDM_EHANDLE, 0, "%p is not a tdm_cpu_stream", adopt);
  tdm__bqueue *bq = calloc(1, sizeof *bq);
  if (!bq) return svc->error(TDM_ENOMEM, 0, "no memory for a CPU queue");
  int rc = 0;
  if (flags & TDM_QUEUE_OUT_OF_ORDER) {
    /* served by the core's thread pool */
  } else if (adopt) {
    bq->stream = adopt;
  } else {
    bq->owns_stream = true;
    rc = tdm__cpu_stream_new(&bq->stream);
    if (rc) svc->error(rc, 0, "cannot start a CPU queue's worker thread");
  }
  if (rc) {
    free(bq);
    return rc;
  }
  *out = bq;
  return 0;
}

static void cpu_queue_destroy(tdm__bqueue *bq) {
  if (bq->owns_stream) tdm__cpu_stream_free(bq->stream);
  free(bq);
}

static int cpu_queue_native(tdm__bqueue *bq, void **native) {
  if (!bq->stream)
    return tdm__cpu_svc->error(TDM_ENOTSUP, 0, "an out-of-order CPU queue has no native stream");
  *native = bq->stream;
  return 0;
}

static int cpu_submit(tdm__bqueue *bq, tdm__cmd *cmd) {
  if (!bq->stream) {
    tdm__cpu_svc->threadpool_submit(cmd);
    return 0;
  }
  int rc = tdm__cpu_stream_push(bq->stream, cmd);
  return rc ? tdm__cpu_svc->error(rc, 0, "the CPU stream is shutting down") : 0;
}

/* No handle: a CPU pointer is all there is to the memory. */
static int cpu_mem_alloc(int bdev, tdm_mem_kind kind, size_t size, void **ptr, tdm__bmem *bm) {
  /* Device memory is aligned like a GPU allocation; pinned memory to a page. */
  size_t align = kind == TDM_MEM_DEVICE ? 256 : kind == TDM_MEM_PINNED ? 4096 : 16;
  size_t rounded = (size + align - 1) / align * align;
  void *p = NULL;
  if (rounded < size || posix_memalign(&p, align, rounded))
    return tdm__cpu_svc->error(TDM_ENOMEM, 0, "cannot allocate %zu bytes", size);
  *ptr = p;
  return 0;
}

static void cpu_mem_free(int bdev, tdm_mem_kind kind, void *ptr, const tdm__bmem *bm) {
  free(ptr);
}

const tdm__backend tdm__cpu_backend = {
    .abi_version = TDM__BACKEND_ABI,
    .name = "cpu",
    .init = cpu_init,
    .shutdown = cpu_shutdown,
    .device_info = cpu_device_info,
    .queue_create = cpu_queue_create,
    .queue_destroy = cpu_queue_destroy,
    .queue_native = cpu_queue_native,
    .submit = cpu_submit,
    .mem_alloc = cpu_mem_alloc,
    .mem_free = cpu_mem_free,
    .host_register = NULL,
    .host_unregister = NULL,
};
