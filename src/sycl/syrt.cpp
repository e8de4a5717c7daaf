/* syrt.cpp: the SYCL backend's one C++ file (see syrt.h): devices, queues, USM, events and
 * gates over Intel's DPC++ runtime, compiled by g++ as host code. Every entry catches at its
 * edge and turns the exception into a TDM_E* code carrying the runtime's words; nothing here
 * exits or aborts. */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <dlfcn.h>

#include <sycl/sycl.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "syrt.h"
#include "tandem.h"

namespace {

sy_error_fn report;

struct device {
  sycl::device dev;
  sycl::context ctx;
  bool opencl, gpu, cpu;
  std::string name;
  uint64_t memory;
};
std::vector<device> *devs;

/* Every context a queue of tandem's lives in, by number: events carry the number, not a copy of
 * the context (a copy costs two atomic operations on the runtime's reference count per event,
 * on the submission path). Devices' contexts first; an adopted queue's own is added. Only
 * grows, until sy_fini. */
std::mutex ctx_mu;
std::vector<sycl::context> *ctxs;

int ctx_number(const sycl::context &c) {
  std::lock_guard<std::mutex> lk(ctx_mu);
  for (size_t i = 0; i < ctxs->size(); i++)
    if ((*ctxs)[i] == c) return static_cast<int>(i);
  ctxs->push_back(c);
  return static_cast<int>(ctxs->size() - 1);
}

/* The OpenCL user-event calls, from the ICD loader the runtime's OpenCL adapter loaded (no
 * link of the module's own: the wheel's loader and the system's share a soname). */
struct {
  cl_event (*create_user)(cl_context, cl_int *);
  cl_int (*set_status)(cl_event, cl_int);
  cl_int (*release)(cl_event);
  cl_int (*release_context)(cl_context);
  bool ok;
} cl;

void find_opencl() {
  void *lib = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return;
  cl.create_user = reinterpret_cast<cl_event (*)(cl_context, cl_int *)>(
      dlsym(lib, "clCreateUserEvent"));
  cl.set_status = reinterpret_cast<cl_int (*)(cl_event, cl_int)>(
      dlsym(lib, "clSetUserEventStatus"));
  cl.release = reinterpret_cast<cl_int (*)(cl_event)>(dlsym(lib, "clReleaseEvent"));
  cl.release_context =
      reinterpret_cast<cl_int (*)(cl_context)>(dlsym(lib, "clReleaseContext"));
  cl.ok = cl.create_user && cl.set_status && cl.release && cl.release_context;
  dlclose(lib); /* NOLOAD took a reference of its own; the runtime keeps the library */
}

/* The code a runtime failure maps to, with its words. */
int fail(const char *what, const std::exception &e) {
  int code = TDM_EBACKEND, native = 0;
  if (auto *s = dynamic_cast<const sycl::exception *>(&e)) {
    native = s->code().value();
    if (s->code() == sycl::errc::memory_allocation) code = TDM_ENOMEM;
  } else if (dynamic_cast<const std::bad_alloc *>(&e)) {
    code = TDM_ENOMEM;
  }
  return report(code, native, "%s: %s", what, e.what());
}

int fail_unknown(const char *what) {
  return report(TDM_EBACKEND, 0, "%s: an exception that is not a std::exception", what);
}

#define SY_TRY(what, body)                 \
  try {                                    \
    body                                   \
  } catch (const std::exception &e_) {     \
    return fail(what, e_);                 \
  } catch (...) {                          \
    return fail_unknown(what);             \
  }

}  // namespace

struct sy_queue {
  sycl::queue *q; /* owned unless adopted */
  int dev, ctx;   /* ctx: its context's number (ctx_number) */
  bool ooo, adopted;
};

/* Made from the event and context it holds: a default-constructed sycl::context would be a
 * new context of the runtime's (costly), and a default sycl::event a new host event. */
struct sy_ev {
  std::atomic<int> refs{1};
  sycl::event ev;
  int ctx; /* its context's number (ctx_number), or -1: imported, its context unknown, so it
              is never waited for natively */
  cl_event user = nullptr; /* gates: the OpenCL user event */
  sy_ev(const sycl::event &e, int c) : ev(e), ctx(c) {}
};

namespace {

sy_ev *ev_new(const sycl::event &e, int ctx) {
  return new (std::nothrow) sy_ev(e, ctx);
}

std::vector<sycl::event> events_of(sy_ev *const *deps, size_t n) {
  std::vector<sycl::event> v;
  v.reserve(n);
  for (size_t i = 0; i < n; i++) v.push_back(deps[i]->ev);
  return v;
}

int give(sy_queue *q, const sycl::event &e, sy_ev **out) {
  if (!out) return 0;
  sy_ev *r = ev_new(e, q->ctx);
  if (!r) return report(TDM_ENOMEM, 0, "no memory for a SYCL event");
  *out = r;
  return 0;
}

}  // namespace

extern "C" {

int sy_init(sy_error_fn error, int *ndevices) {
  report = error;
  SY_TRY("listing SYCL devices", {
    auto *list = new std::vector<device>;
    for (auto &p : sycl::platform::get_platforms()) {
      for (auto &d : p.get_devices()) {
        if (!d.has(sycl::aspect::usm_device_allocations) ||
            !d.has(sycl::aspect::usm_host_allocations))
          continue; /* tandem's memory is USM */
        device x;
        x.dev = d;
        x.ctx = p.khr_get_default_context();
        x.opencl = p.get_backend() == sycl::backend::opencl;
        x.gpu = d.is_gpu() || d.is_accelerator();
        x.cpu = d.is_cpu();
        x.name = d.get_info<sycl::info::device::name>();
        x.memory = d.get_info<sycl::info::device::global_mem_size>();
        list->push_back(x);
      }
    }
    devs = list;
    ctxs = new std::vector<sycl::context>;
    find_opencl();
    *ndevices = static_cast<int>(devs->size());
    return 0;
  })
}

void sy_fini(void) {
  if (!devs) return;
  delete devs;
  delete ctxs;
  ctxs = nullptr;
  devs = nullptr;
}

void sy_device_describe(int dev, sy_device_desc *d) {
  const device &x = (*devs)[dev];
  std::memset(d, 0, sizeof *d);
  std::snprintf(d->name, sizeof d->name, "%s", x.name.c_str());
  d->memory = x.memory;
  d->gpu = x.gpu;
  d->cpu = x.cpu;
  d->opencl = x.opencl && cl.ok;
}

void *sy_device_context(int dev) { return &(*devs)[dev].ctx; }

int sy_queue_new(int dev, bool ooo, bool timing, void *adopt, sy_queue **out) {
  const device &x = (*devs)[dev];
  SY_TRY("creating a SYCL queue", {
    sycl::queue *q;
    if (adopt) {
      q = static_cast<sycl::queue *>(adopt);
      if (q->get_device() != x.dev)
        return report(TDM_EINVAL, 0, "the adopted queue belongs to another device than sycl:%d",
                      dev);
      if (q->is_in_order() == ooo)
        return report(TDM_EINVAL, 0, "the adopted queue is %s, the flags ask for %s",
                      q->is_in_order() ? "in-order" : "out-of-order",
                      ooo ? "out-of-order" : "in-order");
      if (timing && !q->has_property<sycl::property::queue::enable_profiling>())
        return report(TDM_EINVAL, 0, "TDM_QUEUE_TIMING needs a queue with enable_profiling");
    } else {
      sycl::property_list props =
          ooo ? (timing ? sycl::property_list{sycl::property::queue::enable_profiling()}
                        : sycl::property_list{})
              : (timing ? sycl::property_list{sycl::property::queue::in_order(),
                                              sycl::property::queue::enable_profiling()}
                        : sycl::property_list{sycl::property::queue::in_order()});
      q = new sycl::queue(x.ctx, x.dev, props);
    }
    sy_queue *s = new (std::nothrow) sy_queue;
    if (!s) {
      if (!adopt) delete q;
      return report(TDM_ENOMEM, 0, "no memory for a SYCL queue");
    }
    s->q = q;
    s->dev = dev;
    s->ooo = ooo;
    s->adopted = adopt != nullptr;
    s->ctx = ctx_number(q->get_context());
    *out = s;
    return 0;
  })
}

void sy_queue_free(sy_queue *q) {
  try {
    if (!q->adopted) delete q->q;
  } catch (...) {
    /* the runtime's destructor does not throw; nothing to report at teardown */
  }
  delete q;
}

void *sy_queue_native(sy_queue *q) { return q->q; }

int sy_copy(sy_queue *q, void *dst, const void *src, size_t n, sy_ev *const *deps, size_t ndeps,
            sy_ev **out) {
  SY_TRY("SYCL memcpy", {
    sycl::event e = q->q->memcpy(dst, src, n, events_of(deps, ndeps));
    return give(q, e, out);
  })
}

int sy_fill(sy_queue *q, void *dst, int value, size_t n, sy_ev *const *deps, size_t ndeps,
            sy_ev **out) {
  SY_TRY("SYCL memset", {
    sycl::event e = q->q->memset(dst, value, n, events_of(deps, ndeps));
    return give(q, e, out);
  })
}

int sy_barrier(sy_queue *q, bool all, sy_ev *const *deps, size_t ndeps, sy_ev **out) {
  SY_TRY("SYCL barrier", {
    std::vector<sycl::event> w = events_of(deps, ndeps);
    sycl::event e;
    if (w.empty()) {
      e = q->q->ext_oneapi_submit_barrier(); /* every earlier command, whoever enqueued it */
    } else {
      /* An in-order queue orders the barrier after its earlier commands anyway; an
       * out-of-order one needs a barrier of its own for them. */
      if (all && q->ooo) w.push_back(q->q->ext_oneapi_submit_barrier());
      e = q->q->ext_oneapi_submit_barrier(w);
    }
    return give(q, e, out);
  })
}

int sy_gate_new(sy_queue *q, sy_ev **out) {
  const device &x = (*devs)[q->dev];
  if (!x.opencl || !cl.ok)
    return report(TDM_ENOTSUP, 0, "sycl:%d is not reached through OpenCL, and tandem gates its "
                  "queues with OpenCL user events (a SYCL host_task would make the runtime "
                  "block later submissions on the host): host tasks and waits for other "
                  "backends' events are not supported on it", q->dev);
  SY_TRY("making a SYCL gate", {
    sycl::context ctx = q->q->get_context(); /* an adopted queue's may not be the device's */
    cl_context cc = sycl::get_native<sycl::backend::opencl>(ctx);
    cl_int err = CL_SUCCESS;
    cl_event user = cl.create_user(cc, &err);
    cl.release_context(cc); /* get_native gave a reference of the caller's */
    if (!user)
      return report(err == CL_OUT_OF_HOST_MEMORY ? TDM_ENOMEM : TDM_EBACKEND, err,
                    "clCreateUserEvent for a gate");
    sy_ev *g;
    try {
      /* The runtime takes a reference of its own, given back with its last event. */
      g = new sy_ev(sycl::detail::make_event(reinterpret_cast<ur_native_handle_t>(user), ctx,
                                             /*KeepOwnership=*/false, sycl::backend::opencl),
                    q->ctx);
    } catch (...) {
      cl.set_status(user, CL_COMPLETE);
      cl.release(user);
      throw;
    }
    g->user = user;
    *out = g;
    return 0;
  })
}

void sy_gate_open(sy_ev *g) {
  if (g->user) cl.set_status(g->user, CL_COMPLETE);
}

void sy_ev_retain(sy_ev *e) { e->refs.fetch_add(1, std::memory_order_relaxed); }

void sy_ev_release(sy_ev *e) {
  if (e->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  /* The runtime took a reference of its own when it wrapped the user event, and gives it
   * back with its last event; this is the one clCreateUserEvent gave. */
  if (e->user) cl.release(e->user);
  try {
    delete e;
  } catch (...) {
  }
}

int sy_ev_wait(sy_ev *e, int *native) {
  try {
    e->ev.wait();
    return 0;
  } catch (const sycl::exception &x) {
    *native = x.code().value();
    return report(TDM_EBACKEND, *native, "SYCL event: %s", x.what());
  } catch (const std::exception &x) {
    return report(TDM_EBACKEND, 0, "SYCL event: %s", x.what());
  } catch (...) {
    return fail_unknown("SYCL event");
  }
}

bool sy_ev_complete(sy_ev *e) {
  try {
    return e->ev.get_info<sycl::info::event::command_execution_status>() ==
           sycl::info::event_command_status::complete;
  } catch (...) {
    return true; /* an event the runtime cannot describe any more has ended */
  }
}

bool sy_ev_usable(const sy_ev *e, const sy_queue *q) {
  return e->ctx >= 0 && e->ctx == q->ctx;
}

void *sy_ev_native(sy_ev *e) { return &e->ev; }

int sy_ev_import(int dev, void *native, sy_ev **out) {
  SY_TRY("importing a SYCL event", {
    const sycl::event &src = *static_cast<const sycl::event *>(native);
    sy_ev *r = ev_new(src, -1);
    if (!r) return report(TDM_ENOMEM, 0, "no memory for a SYCL event");
    (void)dev;
    *out = r;
    return 0;
  })
}

int sy_ev_elapsed(sy_ev *start, sy_ev *end, double *ms) {
  SY_TRY("SYCL profiling", {
    uint64_t a = start->ev.get_profiling_info<sycl::info::event_profiling::command_end>();
    uint64_t b = end->ev.get_profiling_info<sycl::info::event_profiling::command_end>();
    *ms = (static_cast<double>(b) - static_cast<double>(a)) / 1e6;
    return 0;
  })
}

int sy_alloc(int dev, int kind, size_t size, void **ptr) {
  const device &x = (*devs)[dev];
  SY_TRY("SYCL allocation", {
    void *p = nullptr;
    if (kind == 1)
      p = sycl::malloc_device(size, x.dev, x.ctx);
    else if (kind == 2)
      p = sycl::malloc_host(size, x.ctx);
    else
      p = std::aligned_alloc(64, (size + 63) / 64 * 64);
    if (!p)
      return report(TDM_ENOMEM, 0, "cannot allocate %zu bytes of %s memory on sycl:%d", size,
                    kind == 1 ? "device" : "host", dev);
    *ptr = p;
    return 0;
  })
}

void sy_free(int dev, int kind, void *ptr) {
  if (kind == 3) {
    std::free(ptr);
    return;
  }
  try {
    sycl::free(ptr, (*devs)[dev].ctx);
  } catch (...) {
    /* freeing memory of a context the runtime no longer knows: nothing left to free */
  }
}

int sy_usm_check(int dev, void *ptr) {
  SY_TRY("inspecting a USM pointer", {
    if (sycl::get_pointer_type(ptr, (*devs)[dev].ctx) == sycl::usm::alloc::unknown)
      return report(TDM_EINVAL, 0, "%p is not USM memory of sycl:%d's context", ptr, dev);
    return 0;
  })
}

}  // extern "C"
