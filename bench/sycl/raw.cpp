/* raw.cpp: the raw DPC++ side of bench-sycl (raw.h). Host code only. */
#include <sycl/sycl.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "raw.h"

struct raw {
  sycl::context ctx;
  sycl::queue a, b;
  unsigned char *host, *dev;
  size_t span;
  std::vector<sycl::event> kept;
  std::atomic<int> open{0};
};

namespace {
int fail(const char *what, const std::exception &e) {
  std::fprintf(stderr, "bench-sycl: raw %s: %s\n", what, e.what());
  return -1;
}
}  // namespace

extern "C" {

raw *raw_open(void *sycl_context, size_t span, long n) {
  try {
    auto &ctx = *static_cast<sycl::context *>(sycl_context);
    auto dev = ctx.get_devices().at(0);
    sycl::property_list in_order{sycl::property::queue::in_order()};
    raw *r = new raw{ctx, sycl::queue(ctx, dev, in_order), sycl::queue(ctx, dev, in_order),
                     nullptr, nullptr, span, {}, {}};
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

int raw_prepare_waits(raw *r, long n, int held) {
  try {
    r->kept.clear();
    r->open.store(0);
    if (held) {
      std::atomic<int> *open = &r->open;
      r->a.submit([open](sycl::handler &h) {
        h.host_task([open] {
          while (!open->load()) std::this_thread::sleep_for(std::chrono::microseconds(20));
        });
      });
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

void raw_open_gate(raw *r) { r->open.store(1); }

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
    r->open.store(1);
    r->a.wait();
    r->b.wait();
    r->kept.clear();
    return 0;
  } catch (const std::exception &e) {
    return fail("wait", e);
  }
}

}  // extern "C"
