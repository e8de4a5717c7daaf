/* bcuda.c: the pieces bench-cuda's sub-benchmarks share: checked calls into CUDA, cuBLAS and
 * tandem with the run's failure note, random data, comparisons, size formatting.
 */
#include "bcuda.h"

#include <stdarg.h>
#include <string.h>

static long failures;
static char first_failure[512];

static void note(const char *msg) {
  failures++;
  fprintf(stderr, "bench-cuda: %s\n", msg);
  fflush(stderr);
  if (!first_failure[0])
    snprintf(first_failure, sizeof first_failure, "%s", msg);
}

void bc_failf(const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  note(msg);
}

long bc_failures(void) { return failures; }
const char *bc_first_failure(void) { return first_failure; }
void bc_note_reset(void) { first_failure[0] = '\0'; }

/* Only the file's base name: the build's absolute paths say nothing useful. */
static const char *base(const char *file) {
  const char *s = strrchr(file, '/');
  return s ? s + 1 : file;
}

int bc__cuda(cudaError_t e, const char *call, const char *file, int line) {
  if (e == cudaSuccess)
    return 0;
  bc_failf("%s:%d: %s failed: %s (%d): %s", base(file), line, call, cudaGetErrorName(e), (int)e,
           cudaGetErrorString(e));
  return -1;
}

int bc__blas(cublasStatus_t s, const char *call, const char *file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS)
    return 0;
  bc_failf("%s:%d: %s failed: %s (%d): %s", base(file), line, call, cublasGetStatusName(s), (int)s,
           cublasGetStatusString(s));
  return -1;
}

int bc__tdm(int rc, const char *call, const char *file, int line) {
  if (rc >= 0)
    return 0;
  /* Copied before any other tandem call: it describes this thread's last failure. */
  char msg[384];
  snprintf(msg, sizeof msg, "%s", tdm_last_error());
  int native = tdm_last_native_error();
  bc_failf("%s:%d: %s failed: %s: %s (native error %d)", base(file), line, call, tdm_err_name(rc),
           msg, native);
  return -1;
}

void *bc_native(const void *tandem_ptr) {
  void *native = NULL;
  size_t offset = 0;
  if (TDM_CALL(tdm_mem_native(tandem_ptr, &native, &offset)) < 0)
    return NULL;
  return (char *)native + offset;
}

static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void bc_fill_random(void *p, size_t n, uint64_t seed) {
  unsigned char *b = p;
  size_t words = n / 8;
  for (size_t i = 0; i < words; i++) {
    uint64_t v = splitmix64(&seed);
    memcpy(b + 8 * i, &v, 8);
  }
  if (n % 8) {
    uint64_t v = splitmix64(&seed);
    memcpy(b + 8 * words, &v, n % 8);
  }
}

void bc_fill_bf16(uint16_t *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 4) {
    uint64_t r = splitmix64(&seed);
    for (size_t j = 0; j < 4 && i + j < n; j++, r >>= 16) {
      /* sign: bit 15; exponent 120..127 (3 random bits); mantissa: 7 random bits */
      unsigned sign = (unsigned)(r >> 15) & 1u, exp = 120u + ((unsigned)(r >> 7) & 7u);
      unsigned mant = (unsigned)r & 0x7fu;
      p[i + j] = (uint16_t)(sign << 15 | exp << 7 | mant);
    }
  }
}

int bc_compare(const void *got, const void *want, size_t n, const char *what) {
  if (memcmp(got, want, n) == 0)
    return 0;
  const unsigned char *g = got, *w = want;
  size_t i = 0, bad = 0;
  while (i < n && g[i] == w[i])
    i++;
  for (size_t j = i; j < n; j++)
    bad += g[j] != w[j];
  bc_failf("check failed: %s: %zu of %zu bytes differ, the first at byte %zu (got 0x%02x, want "
           "0x%02x)",
           what, bad, n, i, g[i], w[i]);
  return -1;
}

uint64_t bc_next_seed(bc_ctx *c) { return splitmix64(&c->seed); }

int bc_upload(bc_ctx *c, tdm_queue *q, void *dst, const void *src, size_t n) {
  int rc = -1;
  void *stage = NULL;
  CK_TDM(tdm_malloc(c->dev, TDM_MEM_PINNED, n, &stage));
  memcpy(stage, src, n);
  CK_TDM(tdm_memcpy(q, dst, stage, n, TDM_COPY_H2D, 0, NULL, NULL));
  CK_TDM(tdm_queue_sync(q));
  rc = 0;
out:
  if (stage)
    TDM_CALL(tdm_free(stage));
  return rc;
}

void bc_format_size(size_t n, char *buf, size_t size) {
  if (n >= GIB && n % GIB == 0)
    snprintf(buf, size, "%zu GiB", n / GIB);
  else if (n >= MIB && n % MIB == 0)
    snprintf(buf, size, "%zu MiB", n / MIB);
  else if (n >= KIB && n % KIB == 0)
    snprintf(buf, size, "%zu KiB", n / KIB);
  else
    snprintf(buf, size, "%zu B", n);
}
