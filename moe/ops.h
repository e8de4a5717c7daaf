/* ops.h: inside libtandem_moe, the per-backend tables of tandem/moe_ops.h, each defined in its
 * backend's folder when the build has that backend's BLAS and SDK: the CPU's (cpu/, OpenBLAS)
 * is built into the library; the GPU backends' (cuda/, opencl/) are modules of the library,
 * libtandem_moe-<backend>.so, which ops.c loads from the library's own folder at first use,
 * so that libtandem_moe needs no GPU runtime to load. Programs reach every table through
 * tdm_moe_ops_for(). */
#ifndef TANDEM_MOE_INTERNAL_OPS_H
#define TANDEM_MOE_INTERNAL_OPS_H

#include <stdlib.h>

#include "tandem/moe_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The version of tdm_moe_ops a module is built against: a module returns its table only when
 * asked for this version (the table's layout changes with it). */
#define TDM_MOE__OPS_ABI 9

/* What a module exports: its table, or NULL when abi is not TDM_MOE__OPS_ABI. */
typedef const tdm_moe_ops *(*tdm_moe__module_fn)(int abi);
#define TDM_MOE__MODULE_ENTRY "tdm_moe_ops_module"

/* tdm_moe_ops_workspace() is here, so that the modules size workspaces as the library does
 * without linking it (the library depends on them, not the other way round). */

/* a * b, or 0 when it overflows (every size here is nonzero when valid). */
static inline size_t tdm_moe__mul(size_t a, size_t b) {
  return b && a > SIZE_MAX / b ? 0 : a * b;
}

static inline size_t tdm_moe__add(size_t a, size_t b) {
  return a && b && a <= SIZE_MAX - b ? a + b : 0;
}

/* Each region rounded up to 256 bytes, so that every region starts aligned when they are laid
 * out back to back: the f32 copy of one expert's weights (3HI), the gathered rows and output
 * (n x H f32), gate|up (n x 2I f32), and n x H bf16 (for backends that stage activations in
 * bf16). The sum covers n x (2I + H) f32 + n x H bf16 + 3HI f32, rounded up to 256. 0 when the
 * arguments are not positive or the size does not fit in size_t. */
static inline size_t tdm_moe__workspace(int n, int H, int I) {
  if (n <= 0 || H <= 0 || I <= 0) return 0;
  size_t nH = tdm_moe__mul((size_t)n, (size_t)H), HI = tdm_moe__mul((size_t)H, (size_t)I);
  size_t parts[4] = {tdm_moe__mul(tdm_moe__mul(3, HI), sizeof(float)),
                     tdm_moe__mul(nH, sizeof(float)),
                     tdm_moe__mul(tdm_moe__mul((size_t)n, 2 * (size_t)I), sizeof(float)),
                     tdm_moe__mul(nH, sizeof(tdm_moe_bf16))};
  size_t total = 0;
  for (int i = 0; i < 4; i++) {
    if (parts[i] == 0 || parts[i] > SIZE_MAX - 255) return 0;
    size_t r = (parts[i] + 255) / 256 * 256;
    total = i == 0 ? r : tdm_moe__add(total, r);
    if (total == 0) return 0;
  }
  return total;
}

/* The environment variable `name` as a decimal integer in [lo, hi]; dflt when it is unset,
 * empty, not a number or out of range. */
static inline long tdm_moe__env_long(const char *name, long lo, long hi, long dflt) {
  const char *env = getenv(name);
  if (!env || !*env) return dflt;
  char *end;
  long v = strtol(env, &end, 10);
  return *end || v < lo || v > hi ? dflt : v;
}

#ifdef TANDEM_MOE_CPU
extern const tdm_moe_ops tdm_moe__cpu_ops; /* cpu/ops.c (OpenBLAS) */
#endif
extern const tdm_moe_ops tdm_moe__cuda_ops;   /* cuda/ops.cu, in libtandem_moe-cuda.so */
extern const tdm_moe_ops tdm_moe__opencl_ops; /* opencl/ops.c, in libtandem_moe-opencl.so */

#ifdef __cplusplus
}
#endif

#endif
