/* overlap_cl.c: the compute side of `tandem bench overlap` on an OpenCL device, as user code
 * would write it: an OpenCL kernel built in tandem's exported context and enqueued on the
 * compute queue's exported cl_command_queue, reading the chunk through tdm_mem_native. tandem
 * orders it (tdm_queue_wait before it, tdm_event_record after it cover foreign work). The
 * OpenCL library is opened at run time, so the tool still starts where there is none. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tandem.h>
#include <tandem/opencl.h>

#include "overlap_dev.h"

#if defined(__has_include)
#if __has_include(<CL/cl.h>)
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#define HAVE_CL 1
#endif
#endif

#ifndef HAVE_CL
int odev_open(tdm_device *dev, tdm_queue *q, int lanes, long chunks, odev **out) {
  (void)dev, (void)q, (void)lanes, (void)chunks, (void)out;
  return TDM_ENOTSUP;
}
int odev_enqueue(odev *c, const float *x, size_t n, int passes, long index) { return TDM_ENOTSUP; }
int odev_collect(odev *c, long chunks, double *results) { return TDM_ENOTSUP; }
void odev_close(odev *c) {}
#else

/* The same arithmetic as chunk_compute() in overlap.c, one work-item per lane; contraction off
 * so each operation rounds as the host's does. */
static const char kernel_src[] =
    "#pragma OPENCL FP_CONTRACT OFF\n"
    "__kernel void chunk(__global const float *x, ulong xoff, ulong n, int passes, int lanes,\n"
    "                    __global float *part, ulong poff) {\n"
    "  int l = get_global_id(0);\n"
    "  x += xoff;\n"
    "  part += poff;\n"
    "  float avg = 0.0f, dot = 0.0f, avg0 = 0.0f, dot0 = 0.0f;\n"
    "  ulong full = n / lanes * lanes;\n"
    "  for (int p = 0; p < passes; p++) {\n"
    "    const float a = 1.0f - 1.0f / (float)(64 + p % 64), b = 1.0f - a;\n"
    "    for (ulong i = 0; i < full; i += lanes) {\n"
    "      avg = avg * a + x[i + l] * b;\n"
    "      dot += x[i + l] * avg;\n"
    "    }\n"
    "    if (l == 0) { for (ulong i = full; i < n; i++) dot += x[i] * avg; }\n"
    "  }\n"
    "  part[2 * l] = dot;\n"
    "  part[2 * l + 1] = avg;\n"
    "}\n";

typedef struct cl_api {
  void *lib;
  cl_program (*CreateProgramWithSource)(cl_context, cl_uint, const char **, const size_t *,
                                        cl_int *);
  cl_int (*BuildProgram)(cl_program, cl_uint, const cl_device_id *, const char *,
                         void(CL_CALLBACK *)(cl_program, void *), void *);
  cl_kernel (*CreateKernel)(cl_program, const char *, cl_int *);
  cl_int (*SetKernelArg)(cl_kernel, cl_uint, size_t, const void *);
  cl_int (*EnqueueNDRangeKernel)(cl_command_queue, cl_kernel, cl_uint, const size_t *,
                                 const size_t *, const size_t *, cl_uint, const cl_event *,
                                 cl_event *);
  cl_int (*ReleaseKernel)(cl_kernel);
  cl_int (*ReleaseProgram)(cl_program);
} cl_api;

struct odev {
  cl_api cl;
  cl_program prog;
  cl_kernel k;
  cl_command_queue q;
  tdm_queue *tq;
  tdm_device *dev;
  int lanes;
  float *part; /* device: chunks x lanes x 2 partials */
};

static int load_api(cl_api *a) {
  a->lib = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!a->lib) return TDM_ENOTSUP;
#define SYM(name) (*(void **)&a->name = dlsym(a->lib, "cl" #name)) != NULL
  if (SYM(CreateProgramWithSource) && SYM(BuildProgram) && SYM(CreateKernel) &&
      SYM(SetKernelArg) && SYM(EnqueueNDRangeKernel) && SYM(ReleaseKernel) && SYM(ReleaseProgram))
    return 0;
#undef SYM
  dlclose(a->lib);
  a->lib = NULL;
  return TDM_ENOTSUP;
}

int odev_open(tdm_device *dev, tdm_queue *q, int lanes, long chunks, odev **out) {
  tdm_device_info info;
  int rc = tdm_device_info_get(dev, &info);
  if (rc) return rc;
  if (strcmp(info.backend, "opencl") != 0) return TDM_ENOTSUP;
  odev *c = calloc(1, sizeof *c);
  if (!c) return TDM_ENOMEM;
  c->tq = q;
  c->dev = dev;
  c->lanes = lanes;
  void *ctx = NULL, *nq = NULL;
  cl_int err = CL_SUCCESS;
  if ((rc = load_api(&c->cl)) || (rc = tdm_device_native(dev, &ctx)) ||
      (rc = tdm_queue_native(q, &nq)))
    goto fail;
  c->q = nq;
  const char *src = kernel_src;
  c->prog = c->cl.CreateProgramWithSource(ctx, 1, &src, NULL, &err);
  if (c->prog) err = c->cl.BuildProgram(c->prog, 0, NULL, "", NULL, NULL);
  if (err == CL_SUCCESS) c->k = c->cl.CreateKernel(c->prog, "chunk", &err);
  if (err != CL_SUCCESS) {
    fprintf(stderr, "tandem: bench overlap: building the OpenCL kernel failed (%d)\n", err);
    rc = TDM_EBACKEND;
    goto fail;
  }
  if ((rc = tdm_malloc(dev, TDM_MEM_DEVICE, (size_t)chunks * lanes * 2 * sizeof(float),
                       (void **)&c->part)))
    goto fail;
  *out = c;
  return 0;
fail:
  odev_close(c);
  return rc;
}

int odev_enqueue(odev *c, const float *x, size_t n, int passes, long index) {
  void *xm, *pm;
  size_t xoff, poff;
  float *part = c->part + (size_t)index * c->lanes * 2;
  int rc = tdm_mem_native(x, &xm, &xoff);
  if (!rc) rc = tdm_mem_native(part, &pm, &poff);
  if (rc) return rc;
  /* A kernel takes whole buffers: the pointers' offsets (in floats) go as arguments. */
  cl_ulong nn = n, xo = xoff / sizeof(float), po = poff / sizeof(float);
  cl_int err = c->cl.SetKernelArg(c->k, 0, sizeof(cl_mem), &xm);
  err |= c->cl.SetKernelArg(c->k, 1, sizeof xo, &xo);
  err |= c->cl.SetKernelArg(c->k, 2, sizeof nn, &nn);
  err |= c->cl.SetKernelArg(c->k, 3, sizeof(int), &passes);
  err |= c->cl.SetKernelArg(c->k, 4, sizeof(int), &c->lanes);
  err |= c->cl.SetKernelArg(c->k, 5, sizeof(cl_mem), &pm);
  err |= c->cl.SetKernelArg(c->k, 6, sizeof po, &po);
  size_t global = (size_t)c->lanes;
  if (err == CL_SUCCESS) err = c->cl.EnqueueNDRangeKernel(c->q, c->k, 1, NULL, &global, NULL, 0, NULL, NULL);
  return err == CL_SUCCESS ? 0 : TDM_EBACKEND;
}

int odev_collect(odev *c, long chunks, double *results) {
  size_t bytes = (size_t)chunks * c->lanes * 2 * sizeof(float);
  float *h;
  int rc = tdm_malloc(c->dev, TDM_MEM_PINNED, bytes, (void **)&h);
  if (rc) return rc;
  rc = tdm_memcpy(c->tq, h, c->part, bytes, TDM_COPY_D2H, 0, NULL, NULL);
  if (!rc) rc = tdm_queue_sync(c->tq);
  for (long i = 0; !rc && i < chunks; i++) {
    double sum = 0.0;
    for (int l = 0; l < c->lanes; l++)
      sum += (double)h[(i * c->lanes + l) * 2] + (double)h[(i * c->lanes + l) * 2 + 1];
    results[i] = sum;
  }
  tdm_free(h);
  return rc;
}

void odev_close(odev *c) {
  if (!c) return;
  if (c->part) tdm_free(c->part);
  if (c->k) c->cl.ReleaseKernel(c->k);
  if (c->prog) c->cl.ReleaseProgram(c->prog);
  if (c->cl.lib) dlclose(c->cl.lib);
  free(c);
}
#endif
