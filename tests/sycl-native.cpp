/* sycl-native.cpp: the sycl:: calls behind tests/sycl-native.h. Host code only: the kernel is
 * OpenCL C, built at run time through the OpenCL interop. */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <dlfcn.h>

#include <sycl/sycl.hpp>

#include <cstdio>

#include "sycl-native.h"

namespace {

template <typename F>
auto guarded(const char *what, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception &e) {
    std::fprintf(stderr, "sycl-native: %s: %s\n", what, e.what());
  }
  return decltype(f())();
}

/* The OpenCL calls, from the loader the runtime loaded (as the backend does). */
template <typename T>
T cl_fn(const char *name) {
  void *lib = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_NOLOAD);
  T f = lib ? reinterpret_cast<T>(dlsym(lib, name)) : nullptr;
  if (lib) dlclose(lib);
  return f;
}

const char *slow_src =
    "__kernel void slow_fill(__global int *dst, int value, long spins) {\n"
    "  size_t i = get_global_id(0);\n"
    "  volatile long x = 0;\n"
    "  for (long k = 0; k < spins; k++) x += k;\n"
    "  dst[i] = value + (int)i + (int)(x & 0);\n"
    "}\n";

}  // namespace

extern "C" {

void *tsy_barrier(void *queue) {
  return guarded("barrier", [&]() -> void * {
    return new sycl::event(static_cast<sycl::queue *>(queue)->ext_oneapi_submit_barrier());
  });
}

int tsy_event_pending(void *event) {
  return guarded("event status", [&]() -> int {
    auto st = static_cast<sycl::event *>(event)
                  ->get_info<sycl::info::event::command_execution_status>();
    return st != sycl::info::event_command_status::complete ? 1 : 0;
  });
}

int tsy_event_wait(void *event) {
  try {
    static_cast<sycl::event *>(event)->wait_and_throw();
    return 0;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "sycl-native: wait: %s\n", e.what());
    return -1;
  }
}

void tsy_event_free(void *event) { delete static_cast<sycl::event *>(event); }

void *tsy_malloc_device(void *context, size_t n) {
  return guarded("malloc_device", [&]() -> void * {
    auto &ctx = *static_cast<sycl::context *>(context);
    return sycl::malloc_device(n, ctx.get_devices().at(0), ctx);
  });
}

void tsy_free(void *context, void *p) {
  guarded("free", [&]() -> int {
    sycl::free(p, *static_cast<sycl::context *>(context));
    return 0;
  });
}

void *tsy_queue_new(void *context, int ooo) {
  return guarded("queue", [&]() -> void * {
    auto &ctx = *static_cast<sycl::context *>(context);
    return ooo ? new sycl::queue(ctx, ctx.get_devices().at(0))
               : new sycl::queue(ctx, ctx.get_devices().at(0), sycl::property::queue::in_order());
  });
}

void tsy_queue_free(void *queue) { delete static_cast<sycl::queue *>(queue); }

void *tsy_slow_fill(void *queue, int *dst, size_t n, int value, long spins) {
  return guarded("slow kernel", [&]() -> void * {
    auto &q = *static_cast<sycl::queue *>(queue);
    auto create = cl_fn<cl_program (*)(cl_context, cl_uint, const char **, const size_t *,
                                       cl_int *)>("clCreateProgramWithSource");
    auto build = cl_fn<cl_int (*)(cl_program, cl_uint, const cl_device_id *, const char *,
                                  void (*)(cl_program, void *), void *)>("clBuildProgram");
    auto kernel = cl_fn<cl_kernel (*)(cl_program, const char *, cl_int *)>("clCreateKernel");
    if (!create || !build || !kernel) throw std::runtime_error("no OpenCL loader in the process");
    cl_context cc = sycl::get_native<sycl::backend::opencl>(q.get_context());
    cl_int err = 0;
    cl_program prog = create(cc, 1, &slow_src, nullptr, &err);
    cl_fn<cl_int (*)(cl_context)>("clReleaseContext")(cc); /* get_native's reference */
    if (!prog || build(prog, 0, nullptr, "", nullptr, nullptr) != CL_SUCCESS)
      throw std::runtime_error("building the OpenCL C kernel failed");
    cl_kernel k = kernel(prog, "slow_fill", &err);
    if (!k) throw std::runtime_error("clCreateKernel failed");
    sycl::kernel sk = sycl::make_kernel<sycl::backend::opencl>(k, q.get_context());
    /* The sycl::kernel holds the kernel, and the kernel its program. */
    cl_fn<cl_int (*)(cl_kernel)>("clReleaseKernel")(k);
    cl_fn<cl_int (*)(cl_program)>("clReleaseProgram")(prog);
    sycl::event e = q.submit([&](sycl::handler &h) {
      h.set_arg(0, dst);
      h.set_arg(1, value);
      h.set_arg(2, static_cast<cl_long>(spins));
      h.parallel_for(sycl::range<1>(n), sk);
    });
    return new sycl::event(e);
  });
}

}  // extern "C"
