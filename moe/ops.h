/* ops.h: inside libtandem_moe, the per-backend tables of tandem/moe_ops.h, each defined in its
 * backend's folder (cpu/, cuda/, opencl/) when the build has that backend's BLAS and SDK.
 * Hidden: programs reach them through tdm_moe_ops_for(). */
#ifndef TANDEM_MOE_INTERNAL_OPS_H
#define TANDEM_MOE_INTERNAL_OPS_H

#include "tandem/moe_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef TANDEM_MOE_CPU
extern const tdm_moe_ops tdm_moe__cpu_ops; /* cpu/ops.c (OpenBLAS) */
#endif
#ifdef TANDEM_MOE_CUDA
extern const tdm_moe_ops tdm_moe__cuda_ops; /* cuda/ops.cu (cuBLASLt, cuBLAS) */
#endif
#ifdef TANDEM_MOE_OPENCL
extern const tdm_moe_ops tdm_moe__opencl_ops; /* opencl/ops.c (CLBlast) */
#endif

#ifdef __cplusplus
}
#endif

#endif
