/* ops.c: picks a device's MoE op table by its backend, and sizes the workspace expert()
 * needs. Only the public API: a device's backend is what tdm_device_info_get() says. */
#include <stdint.h>
#include <string.h>

#include "ops.h"

const tdm_moe_ops *tdm_moe_ops_for(tdm_device *dev) {
  tdm_device_info info;
  if (tdm_device_info_get(dev, &info) != 0) return NULL; /* the message is set */
  const tdm_moe_ops *ops = NULL;
#ifdef TANDEM_MOE_CPU
  if (strcmp(info.backend, "cpu") == 0) ops = &tdm_moe__cpu_ops;
#endif
#ifdef TANDEM_MOE_CUDA
  if (strcmp(info.backend, "cuda") == 0) ops = &tdm_moe__cuda_ops;
#endif
#ifdef TANDEM_MOE_OPENCL
  if (strcmp(info.backend, "opencl") == 0) ops = &tdm_moe__opencl_ops;
#endif
  if (!ops)
    tdm_set_error(TDM_ENOTSUP, 0, "no MoE operations for %s's backend (%s) in this build",
                  info.id, info.backend);
  return ops;
}

/* a * b, or 0 when it overflows (every size here is nonzero when valid). */
static size_t mul(size_t a, size_t b) { return b && a > SIZE_MAX / b ? 0 : a * b; }

static size_t add(size_t a, size_t b) { return a && b && a <= SIZE_MAX - b ? a + b : 0; }

/* Each region rounded up to 256 bytes, so that every region starts aligned when they are laid
 * out back to back: the f32 copy of one expert's weights (3HI), the gathered rows and output
 * (n x H f32), gate|up (n x 2I f32), and n x H bf16 (for backends that stage activations in
 * bf16). The sum covers n x (2I + H) f32 + n x H bf16 + 3HI f32, rounded up to 256. 0 when the
 * arguments are not positive or the size does not fit in size_t. */
size_t tdm_moe_ops_workspace(int n, int H, int I) {
  if (n <= 0 || H <= 0 || I <= 0) return 0;
  size_t nH = mul((size_t)n, (size_t)H), HI = mul((size_t)H, (size_t)I);
  size_t parts[4] = {mul(mul(3, HI), sizeof(float)), mul(nH, sizeof(float)),
                     mul(mul((size_t)n, 2 * (size_t)I), sizeof(float)),
                     mul(nH, sizeof(tdm_moe_bf16))};
  size_t total = 0;
  for (int i = 0; i < 4; i++) {
    if (parts[i] == 0 || parts[i] > SIZE_MAX - 255) return 0;
    size_t r = (parts[i] + 255) / 256 * 256;
    total = i == 0 ? r : add(total, r);
    if (total == 0) return 0;
  }
  return total;
}
