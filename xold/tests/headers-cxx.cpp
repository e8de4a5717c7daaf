/* headers-cxx.cpp: a C++ program that includes every public header and calls libtandem
 * through each one that declares functions, on cpu:0: an expert streamed to the device and
 * read back, a tdm_cpu_stream adopted as a queue, a MoE preset looked up, a MoE op workspace
 * sized, a layered library's message set. It links only if every declaration has C linkage
 * (tandem/cuda.h and tandem/opencl.h declare none).
 */
#include <tandem.h>
#include <tandem/cpu.h>
#include <tandem/cuda.h>
#include <tandem/moe.h>
#include <tandem/moe_ops.h>
#include <tandem/opencl.h>
#include <tandem/streamer.h>

#include <cstdio>
#include <cstring>

#define EXPECT(cond)                                                                          \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #cond,               \
                   tdm_last_error());                                                         \
      return 1;                                                                               \
    }                                                                                         \
  } while (0)

static void mark(void *arg) { *static_cast<int *>(arg) = 1; }

/* Streams expert (0, 1) of a two-expert layer to the device and copies it back. */
static int stream_one_expert(tdm_device *dev) {
  enum { N = 256 };
  tdm_queue *compute = nullptr;
  void *host[2] = {nullptr, nullptr};
  void *back = nullptr;
  tdm_streamer *s = nullptr;
  const void *dptr = nullptr;
  tdm_streamer_stats st;
  EXPECT(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &compute) == 0);
  for (int e = 0; e < 2; e++) {
    EXPECT(tdm_malloc(dev, TDM_MEM_PINNED, N, &host[e]) == 0);
    std::memset(host[e], 'a' + e, N);
  }
  EXPECT(tdm_malloc(dev, TDM_MEM_PINNED, N, &back) == 0);

  tdm_streamer_config cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.compute = compute;
  cfg.layers = 1;
  cfg.experts = 2;
  cfg.expert_bytes = N;
  cfg.host = host;
  cfg.staging_slots = 1;
  cfg.policy = TDM_CACHE_LRU;
  EXPECT(tdm_streamer_create(&cfg, &s) == 0);
  EXPECT(tdm_streamer_acquire(s, 0, 1, &dptr, nullptr) == 0);
  EXPECT(tdm_memcpy(compute, back, dptr, N, TDM_COPY_D2H, 0, nullptr, nullptr) == 0);
  EXPECT(tdm_streamer_release(s, 0, 1, nullptr) == 0);
  EXPECT(tdm_queue_sync(compute) == 0);
  EXPECT(std::memcmp(back, host[1], N) == 0);
  EXPECT(tdm_streamer_stats_get(s, &st) == 0);
  EXPECT(st.acquires == 1 && st.bytes_copied == N);
  EXPECT(tdm_streamer_destroy(s) == 0);
  EXPECT(tdm_free(back) == 0 && tdm_free(host[0]) == 0 && tdm_free(host[1]) == 0);
  EXPECT(tdm_queue_destroy(compute) == 0);
  return 0;
}

/* A function launched on a tdm_cpu_stream is covered by a sync of the queue adopting it. */
static int adopt_cpu_stream(tdm_device *dev) {
  tdm_cpu_stream *cs = nullptr;
  tdm_queue *q = nullptr;
  int ran = 0;
  EXPECT(tdm_cpu_stream_create(&cs) == 0);
  EXPECT(tdm_queue_adopt(dev, cs, TDM_QUEUE_IN_ORDER, &q) == 0);
  EXPECT(tdm_cpu_stream_launch(cs, mark, &ran) == 0);
  EXPECT(tdm_queue_sync(q) == 0);
  EXPECT(ran == 1);
  EXPECT(tdm_queue_destroy(q) == 0);
  EXPECT(tdm_cpu_stream_destroy(cs) == 0);
  return 0;
}

int main() {
  tdm_device *dev = nullptr;
  EXPECT(tdm_init() == 0);
  EXPECT(std::strcmp(tdm_err_name(TDM_ENODEV), "TDM_ENODEV") == 0);
  EXPECT(tdm_device_find("cpu:0", &dev) == 0);
  if (stream_one_expert(dev) || adopt_cpu_stream(dev)) return 1;
  const tdm_moe_preset *tiny = tdm_moe_preset_find("tiny");
  EXPECT(tiny != nullptr && tdm_moe_npresets > 0);
  EXPECT(tdm_moe_expert_bytes(tiny) > 0);
  EXPECT(tdm_moe_ops_workspace(1, 8, 8) > 0);
  EXPECT(tdm_moe_bf16_to_f32(tdm_moe_f32_to_bf16(1.5f)) == 1.5f);
  EXPECT(tdm_set_error(TDM_EINVAL, 0, "from C++") == TDM_EINVAL);
  EXPECT(std::strcmp(tdm_last_error(), "TDM_EINVAL: from C++") == 0);
  EXPECT(tdm_shutdown() == 0);
  std::printf("C++: every public header compiled and linked; cpu:0 ran\n");
  return 0;
}
