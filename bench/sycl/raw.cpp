/* raw.cpp: the raw DPC++ side of bench-sycl (raw.h). Host code only. */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <dlfcn.h>

#include <sycl/sycl.hpp>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "raw.h"

struct raw {
  sycl::context ctx;
  sycl::queue a, b;
  unsigned char *host, *dev;
  size_t span;
  std::vector<sycl::event> kept;
  cl_event gate; /* holds A in the pending-wait benchmark */
};

namespace {
int fail(const char *what, const std::exception &e) {
  std::fprintf(stderr, "bench-sycl: raw %s: %s\n", what, e.what());
  return -1;
}

/* The OpenCL calls, from the loader the runtime loaded. */
template <typename T>
T cl_fn(const char *name) {
  void *lib = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_NOLOAD);
  T f = lib ? reinterpret_cast<T>(dlsym(lib, name)) : nullptr;
  if (lib) dlclose(lib);
  if (!f) throw std::runtime_error(std::string("no ") + name + " in the process");
  return f;
}

}  // namespace

extern "C" {

raw *raw_open(void *sycl_context, size_t span, long n) {
  try {
    auto &ctx = *static_cast<sycl::context *>(sycl_context);
    auto dev = ctx.get_devices().at(0);
    sycl::property_list in_order{sycl::property::queue::in_order()};
    raw *r = new raw{ctx, sycl::queue(ctx, dev, in_order), sycl::queue(ctx, dev, in_order),
                     nullptr, nullptr, span, {}, nullptr};
    r->host = sycl::malloc_host<unsigned char>(span, ctx);
    r->dev = sycl::malloc_device<unsigned char>(span, dev, ctx);
    for (size_t i = 0; i < span; i++) r->host[i] = static_cast<unsigned char>(i * 7 + 1);
    r->kept.reserve(static_cast<size_t>(n));
    return r;
  } catch (const std::exception &e) {
    fail("setup", e);
    return nullptr;
  }
}

void raw_close(raw *r) {
  if (!r) return;
  try {
    r->a.wait();
    r->b.wait();
    sycl::free(r->host, r->ctx);
    sycl::free(r->dev, r->ctx);
  } catch (const std::exception &e) {
    fail("teardown", e);
  }
  delete r;
}

int raw_submit(raw *r, long n, size_t bytes) {
  try {
    size_t slots = r->span / bytes;
    for (long i = 0; i < n; i++) {
      size_t off = static_cast<size_t>(i) % slots * bytes;
      r->a.memcpy(r->dev + off, r->host + off, bytes);
    }
    return 0;
  } catch (const std::exception &e) {
    return fail("memcpy", e);
  }
}

int raw_record(raw *r, long n) {
  try {
    for (long i = 0; i < n; i++) r->a.ext_oneapi_submit_barrier();
    return 0;
  } catch (const std::exception &e) {
    return fail("ext_oneapi_submit_barrier", e);
  }
}

/* A is held behind an OpenCL user event, as tandem holds its queue behind a host task: a
 * SYCL host_task would do, but the runtime then blocks every later submission to A on the
 * host until it has run. */
int raw_prepare_waits(raw *r, long n, int held) {
  try {
    r->kept.clear();
    if (held) {
      cl_context cc = sycl::get_native<sycl::backend::opencl>(r->ctx);
      cl_int err = 0;
      r->gate = cl_fn<cl_event (*)(cl_context, cl_int *)>("clCreateUserEvent")(cc, &err);
      cl_fn<cl_int (*)(cl_context)>("clReleaseContext")(cc);
      if (!r->gate) throw std::runtime_error("clCreateUserEvent failed");
      sycl::event g = sycl::detail::make_event(reinterpret_cast<ur_native_handle_t>(r->gate),
                                               r->ctx, false, sycl::backend::opencl);
      r->a.ext_oneapi_submit_barrier({g});
    }
    for (long i = 0; i < n; i++) r->kept.push_back(r->a.ext_oneapi_submit_barrier());
    if (!held && !r->kept.empty()) r->kept.back().wait();
    return 0;
  } catch (const std::exception &e) {
    return fail("preparing waits", e);
  }
}

int raw_waits(raw *r, long n) {
  try {
    for (long i = 0; i < n; i++) r->b.ext_oneapi_submit_barrier({r->kept[static_cast<size_t>(i)]});
    return 0;
  } catch (const std::exception &e) {
    return fail("ext_oneapi_submit_barrier({e})", e);
  }
}

void raw_open_gate(raw *r) {
  if (!r->gate) return;
  cl_fn<cl_int (*)(cl_event, cl_int)>("clSetUserEventStatus")(r->gate, CL_COMPLETE);
  cl_fn<cl_int (*)(cl_event)>("clReleaseEvent")(r->gate);
  r->gate = nullptr;
}

int raw_round_trips(raw *r, long n, size_t bytes) {
  try {
    size_t slots = r->span / bytes;
    for (long i = 0; i < n; i++) {
      size_t off = static_cast<size_t>(i) % slots * bytes;
      r->a.memcpy(r->dev + off, r->host + off, bytes);
      r->a.wait();
    }
    return 0;
  } catch (const std::exception &e) {
    return fail("memcpy + wait", e);
  }
}

int raw_drain(raw *r) {
  try {
    raw_open_gate(r);
    r->a.wait();
    r->b.wait();
    r->kept.clear();
    return 0;
  } catch (const std::exception &e) {
    return fail("wait", e);
  }
}

}  // extern "C"
