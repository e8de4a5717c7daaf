/* gguf.c: opening a GGUF file: mapping it, and checking its header, metadata and tensor
 * table against the file's length before anything in them is used, so that a truncated,
 * corrupt or hostile file gives a message and never a read outside the mapping.
 *
 * The layout (little-endian): "GGUF", u32 version, u64 tensor count, u64 key count; the keys
 * (string key, u32 type, value); the tensor infos (string name, u32 ndim, u64 ne[ndim] innermost
 * first, u32 type, u64 offset); padding to general.alignment; the data section, which each
 * tensor's offset points into. A string is a u64 length and that many bytes. */
#include "gguf-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
  HEADER_BYTES = 24,
  MIN_KV_BYTES = 8 + 4 + 1,          /* empty key, type, a one-byte value */
  MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8, /* empty name, ndim, one dim, type, offset */
  MIN_NESTED_BYTES = 4 + 8,          /* an inner array's type and count */
  MAX_NESTING = 8,                   /* arrays of arrays, deeper than any writer goes */
  DEFAULT_ALIGNMENT = 32,
};

typedef struct parser {
  tdm_gguf *g;
  size_t pos;
  char what[200]; /* the item being read, for messages: "key general.name" */
} parser;

/* A malformed file: "<path>: <what>: <detail>". */
__attribute__((format(printf, 2, 3))) static int bad(parser *ps, const char *fmt, ...) {
  char detail[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  if (ps->what[0])
    return tdm_set_error(TDM_EINVAL, 0, "%s: %s: %s", ps->g->path, ps->what, detail);
  return tdm_set_error(TDM_EINVAL, 0, "%s: %s", ps->g->path, detail);
}

static int no_memory(parser *ps, const char *what, size_t n) {
  return tdm_set_error(TDM_ENOMEM, 0, "%s: no memory for %s (%zu bytes)", ps->g->path, what, n);
}

/* ---- Reading with bounds ------------------------------------------------------------------ */

static size_t left(const parser *ps) { return ps->g->size - ps->pos; }

static int need(parser *ps, size_t n, const char *field) {
  if (left(ps) >= n) return 0;
  return bad(ps, "%s at offset %zu (%zu bytes) runs past the end of the file (%zu bytes)",
             field, ps->pos, n, ps->g->size);
}

static int rd_u32(parser *ps, uint32_t *v, const char *field) {
  int rc = need(ps, 4, field);
  if (rc) return rc;
  *v = tdm__le32(ps->g->map + ps->pos);
  ps->pos += 4;
  return 0;
}

static int rd_u64(parser *ps, uint64_t *v, const char *field) {
  int rc = need(ps, 8, field);
  if (rc) return rc;
  *v = tdm__le64(ps->g->map + ps->pos);
  ps->pos += 8;
  return 0;
}

/* A string: *at is where its bytes are. */
static int rd_str(parser *ps, size_t *at, size_t *len, const char *field) {
  uint64_t n;
  size_t start = ps->pos;
  int rc = rd_u64(ps, &n, field);
  if (rc) return rc;
  if (n > left(ps))
    return bad(ps, "%s at offset %zu has length %llu, which runs past the end of the file "
               "(%zu bytes)", field, start, (unsigned long long)n, ps->g->size);
  *at = ps->pos;
  *len = (size_t)n;
  ps->pos += (size_t)n;
  return 0;
}

/* Names the key or tensor being read, for messages; the #index where it has no name. */
static void set_what(parser *ps, const char *kind, size_t i, size_t at, size_t len) {
  char name[128];
  if (len == 0) {
    snprintf(ps->what, sizeof ps->what, "%s #%zu (empty name)", kind, i);
    return;
  }
  tdm__gguf_printable(name, sizeof name, ps->g->map + at, len);
  snprintf(ps->what, sizeof ps->what, "%s %s", kind, name);
}

/* Names are looked up as C strings: one holding a NUL could never be found. */
static int check_name(parser *ps, size_t at, size_t len) {
  const uint8_t *nul = memchr(ps->g->map + at, 0, len);
  if (!nul) return 0;
  return bad(ps, "its name holds a NUL byte (at offset %zu)", (size_t)(nul - ps->g->map));
}

/* ---- Values ------------------------------------------------------------------------------- */

static int check_type(parser *ps, uint32_t type, const char *of) {
  if (type <= TDM_GGUF_F64) return 0;
  return bad(ps, "unknown %s type %u at offset %zu", of, type, ps->pos - 4);
}

/* The elements of an array: checked, skipped, and for strings (when elems is given) indexed.
 * Every element takes at least one byte of the file, so this is linear in the file's size. */
static int walk_array(parser *ps, uint32_t type, uint64_t count, int depth, size_t *elems) {
  size_t esize = tdm__gguf_scalar_size((int)type);
  size_t min = esize ? esize : type == TDM_GGUF_STRING ? 8 : MIN_NESTED_BYTES;
  size_t start = ps->pos;
  int rc;
  if (count > left(ps) / min)
    return bad(ps, "array of %llu %s elements at offset %zu runs past the end of the file "
               "(%zu bytes)", (unsigned long long)count, tdm_gguf_type_name((int)type), start,
               ps->g->size);
  if (esize) {
    if (type == TDM_GGUF_BOOL)
      for (uint64_t i = 0; i < count; i++)
        if (ps->g->map[start + i] > 1)
          return bad(ps, "bool element %llu is %u, not 0 or 1", (unsigned long long)i,
                     ps->g->map[start + i]);
    ps->pos += (size_t)count * esize;
    return 0;
  }
  for (uint64_t i = 0; i < count; i++) {
    if (type == TDM_GGUF_STRING) {
      size_t at, len;
      if (elems) elems[i] = ps->pos;
      if ((rc = rd_str(ps, &at, &len, "string element"))) return rc;
      continue;
    }
    /* An array of arrays: each inner array has a type and count of its own. */
    uint32_t inner;
    uint64_t n;
    if (depth >= MAX_NESTING) return bad(ps, "arrays nested more than %d deep", MAX_NESTING);
    if ((rc = rd_u32(ps, &inner, "inner array type"))) return rc;
    if ((rc = check_type(ps, inner, "inner array element"))) return rc;
    if ((rc = rd_u64(ps, &n, "inner array count"))) return rc;
    if ((rc = walk_array(ps, inner, n, depth + 1, NULL))) return rc;
  }
  return 0;
}

static int read_array(parser *ps, tdm__gguf_kv *kv) {
  uint32_t type;
  uint64_t count;
  int rc;
  if ((rc = rd_u32(ps, &type, "array element type"))) return rc;
  if ((rc = check_type(ps, type, "array element"))) return rc;
  if ((rc = rd_u64(ps, &count, "array count"))) return rc;
  kv->elem_type = (int)type;
  kv->count = count;
  kv->at = ps->pos;
  if (type == TDM_GGUF_STRING && count > 0) {
    /* Bounded by the file before allocating: each string takes 8 bytes at least. */
    if (count > left(ps) / 8)
      return bad(ps, "array of %llu strings at offset %zu runs past the end of the file "
                 "(%zu bytes)", (unsigned long long)count, ps->pos, ps->g->size);
    kv->elems = malloc((size_t)count * sizeof *kv->elems);
    if (!kv->elems) return no_memory(ps, ps->what, (size_t)count * sizeof *kv->elems);
  }
  return walk_array(ps, type, count, 1, kv->elems);
}

static int read_value(parser *ps, tdm__gguf_kv *kv) {
  uint32_t type;
  size_t size;
  int rc;
  if ((rc = rd_u32(ps, &type, "value type"))) return rc;
  if ((rc = check_type(ps, type, "value"))) return rc;
  kv->type = (int)type;
  if (type == TDM_GGUF_STRING) return rd_str(ps, &kv->str_at, &kv->str_len, "string value");
  if (type == TDM_GGUF_ARRAY) return read_array(ps, kv);
  size = tdm__gguf_scalar_size((int)type);
  if ((rc = need(ps, size, "value"))) return rc;
  kv->at = ps->pos;
  if (type == TDM_GGUF_BOOL && ps->g->map[ps->pos] > 1)
    return bad(ps, "bool value is %u, not 0 or 1", ps->g->map[ps->pos]);
  ps->pos += size;
  return 0;
}

static int read_kvs(parser *ps, uint64_t n) {
  tdm_gguf *g = ps->g;
  int rc;
  if (n > left(ps) / MIN_KV_BYTES)
    return bad(ps, "the header says %llu metadata keys, more than the file (%zu bytes) can hold",
               (unsigned long long)n, g->size);
  g->kv = calloc(n ? (size_t)n : 1, sizeof *g->kv);
  if (!g->kv) return no_memory(ps, "the metadata keys", (size_t)n * sizeof *g->kv);
  g->n_kv = (size_t)n;
  for (size_t i = 0; i < n; i++) {
    tdm__gguf_kv *kv = &g->kv[i];
    snprintf(ps->what, sizeof ps->what, "key #%zu", i);
    if ((rc = rd_str(ps, &kv->key_at, &kv->key_len, "key"))) return rc;
    set_what(ps, "key", i, kv->key_at, kv->key_len);
    if ((rc = check_name(ps, kv->key_at, kv->key_len))) return rc;
    if ((rc = read_value(ps, kv))) return rc;
  }
  return 0;
}

/* ---- Tensor infos ------------------------------------------------------------------------- */

static int read_tensor(parser *ps, size_t i) {
  tdm_gguf *g = ps->g;
  tdm_mf_tensor *t = &g->tensors[i];
  uint32_t ndim, type;
  uint64_t ne[TDM_MF_MAX_DIMS];
  int64_t elements = 1;
  int block, bbytes, rc;
  uint64_t bytes;
  snprintf(ps->what, sizeof ps->what, "tensor #%zu", i);
  if ((rc = rd_str(ps, &g->tensor_name_at[i], &g->tensor_name_len[i], "name"))) return rc;
  set_what(ps, "tensor", i, g->tensor_name_at[i], g->tensor_name_len[i]);
  if ((rc = check_name(ps, g->tensor_name_at[i], g->tensor_name_len[i]))) return rc;
  if ((rc = rd_u32(ps, &ndim, "dimension count"))) return rc;
  if (ndim < 1 || ndim > TDM_MF_MAX_DIMS)
    return bad(ps, "has %u dimensions (1 to %d are read)", ndim, TDM_MF_MAX_DIMS);
  for (uint32_t d = 0; d < ndim; d++) {
    if ((rc = rd_u64(ps, &ne[d], "dimension"))) return rc;
    if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX)
      return bad(ps, "dimension %u is %llu (must be 1 to 2^63-1)", d, (unsigned long long)ne[d]);
    if (elements > INT64_MAX / (int64_t)ne[d])
      return bad(ps, "its dimensions' product overflows 64 bits (dimension %u is %llu)", d,
                 (unsigned long long)ne[d]);
    elements *= (int64_t)ne[d];
  }
  if ((rc = rd_u32(ps, &type, "type"))) return rc;
  if (tdm_mf_type_block((int)type, &block, &bbytes) != 0)
    return bad(ps, "unknown tensor type %u", type);
  if (ne[0] % (uint64_t)block != 0)
    return bad(ps, "a row of %llu elements is not a whole number of %s blocks (%d elements)",
               (unsigned long long)ne[0], tdm_mf_type_name((int)type), block);
  bytes = (uint64_t)bbytes;
  for (uint32_t d = 0; d < ndim; d++) {
    uint64_t f = d == 0 ? ne[0] / (uint64_t)block : ne[d];
    if (bytes > UINT64_MAX / f || (uint64_t)(size_t)(bytes * f) != bytes * f)
      return bad(ps, "its size in bytes overflows (%lld elements of %s)", (long long)elements,
                 tdm_mf_type_name((int)type));
    bytes *= f;
  }
  if ((rc = rd_u64(ps, &g->tensor_offset[i], "data offset"))) return rc;
  t->type = (int)type;
  t->ndim = (int)ndim;
  for (uint32_t d = 0; d < ndim; d++) t->shape[d] = (int64_t)ne[ndim - 1 - d];
  t->bytes = (size_t)bytes;
  return 0;
}

static int read_tensors(parser *ps, uint64_t n) {
  tdm_gguf *g = ps->g;
  size_t cap;
  int rc;
  if (n > left(ps) / MIN_TENSOR_BYTES)
    return bad(ps, "the header says %llu tensors, more than the rest of the file (%zu of its "
               "%zu bytes) can hold", (unsigned long long)n, left(ps), g->size);
  cap = n ? (size_t)n : 1;
  g->tensors = calloc(cap, sizeof *g->tensors);
  g->tensor_name_at = calloc(cap, sizeof *g->tensor_name_at);
  g->tensor_name_len = calloc(cap, sizeof *g->tensor_name_len);
  g->tensor_offset = calloc(cap, sizeof *g->tensor_offset);
  if (!g->tensors || !g->tensor_name_at || !g->tensor_name_len || !g->tensor_offset)
    return no_memory(ps, "the tensor table", cap * (sizeof *g->tensors + 24));
  g->n_tensors = (size_t)n;
  for (size_t i = 0; i < n; i++)
    if ((rc = read_tensor(ps, i))) return rc;
  ps->what[0] = '\0';
  return 0;
}

/* ---- After the tables: names, duplicates, alignment, data ranges -------------------------- */

/* One allocation holds a NUL-terminated copy of every key, string value and tensor name. */
static int copy_strings(parser *ps) {
  tdm_gguf *g = ps->g;
  size_t total = 1, at = 0;
  char *p;
  /* Each copy takes its length plus one, and each length was read from the file along with 8
   * bytes of its own: the total is below the file's size. */
  for (size_t i = 0; i < g->n_kv; i++) total += g->kv[i].key_len + 1 + g->kv[i].str_len + 1;
  for (size_t i = 0; i < g->n_tensors; i++) total += g->tensor_name_len[i] + 1;
  if (!(g->strings = p = malloc(total))) return no_memory(ps, "the names", total);
#define COPY(dst, src_at, len)                                                                \
  do {                                                                                        \
    memcpy(p + at, g->map + (src_at), (len));                                                 \
    p[at + (len)] = '\0';                                                                     \
    (dst) = p + at;                                                                           \
    at += (len) + 1;                                                                          \
  } while (0)
  for (size_t i = 0; i < g->n_kv; i++) {
    tdm__gguf_kv *kv = &g->kv[i];
    COPY(kv->key, kv->key_at, kv->key_len);
    if (kv->type == TDM_GGUF_STRING) COPY(kv->str, kv->str_at, kv->str_len);
  }
  for (size_t i = 0; i < g->n_tensors; i++)
    COPY(g->tensors[i].name, g->tensor_name_at[i], g->tensor_name_len[i]);
#undef COPY
  return 0;
}

static int index_names(parser *ps) {
  tdm_gguf *g = ps->g;
  const tdm__gguf_name *dup;
  char name[128];
  g->kv_sorted = malloc((g->n_kv ? g->n_kv : 1) * sizeof *g->kv_sorted);
  g->tensors_sorted = malloc((g->n_tensors ? g->n_tensors : 1) * sizeof *g->tensors_sorted);
  if (!g->kv_sorted || !g->tensors_sorted)
    return no_memory(ps, "the name index", (g->n_kv + g->n_tensors) * sizeof *g->kv_sorted);
  for (size_t i = 0; i < g->n_kv; i++)
    g->kv_sorted[i] = (tdm__gguf_name){g->kv[i].key, g->kv[i].key_len, i};
  for (size_t i = 0; i < g->n_tensors; i++)
    g->tensors_sorted[i] = (tdm__gguf_name){g->tensors[i].name, g->tensor_name_len[i], i};
  if ((dup = tdm__gguf_sort(g->kv_sorted, g->n_kv)))
    return bad(ps, "key %s appears twice (keys #%zu and #%zu)",
               tdm__gguf_printable(name, sizeof name, (const uint8_t *)dup->s, dup->len),
               dup[0].i < dup[1].i ? dup[0].i : dup[1].i, dup[0].i < dup[1].i ? dup[1].i : dup[0].i);
  if ((dup = tdm__gguf_sort(g->tensors_sorted, g->n_tensors)))
    return bad(ps, "tensor %s appears twice (tensors #%zu and #%zu)",
               tdm__gguf_printable(name, sizeof name, (const uint8_t *)dup->s, dup->len),
               dup[0].i < dup[1].i ? dup[0].i : dup[1].i, dup[0].i < dup[1].i ? dup[1].i : dup[0].i);
  return 0;
}

static int alignment(parser *ps, uint64_t *align) {
  const tdm__gguf_kv *kv = tdm__gguf_kv_find(ps->g, "general.alignment");
  int rc;
  *align = DEFAULT_ALIGNMENT;
  if (!kv) return 0;
  if ((rc = tdm__gguf_kv_u64(ps->g, kv, align))) return rc;
  if (*align == 0 || (*align & (*align - 1)) != 0)
    return bad(ps, "key general.alignment is %llu, which is not a power of two",
               (unsigned long long)*align);
  return 0;
}

/* Every tensor's data: aligned, and inside the file. */
static int place_tensors(parser *ps) {
  tdm_gguf *g = ps->g;
  uint64_t align, data;
  int rc;
  if ((rc = alignment(ps, &align))) return rc;
  if (ps->pos > UINT64_MAX - (align - 1))
    return bad(ps, "the data section's start overflows with alignment %llu",
               (unsigned long long)align);
  data = (ps->pos + (align - 1)) & ~(align - 1);
  for (size_t i = 0; i < g->n_tensors; i++) {
    tdm_mf_tensor *t = &g->tensors[i];
    uint64_t off = g->tensor_offset[i];
    set_what(ps, "tensor", i, g->tensor_name_at[i], g->tensor_name_len[i]);
    if (off % align != 0)
      return bad(ps, "data offset %llu is not a multiple of the alignment (%llu)",
                 (unsigned long long)off, (unsigned long long)align);
    if (data > g->size || off > g->size - data || t->bytes > g->size - data - off)
      return bad(ps, "data [offset %llu, %zu bytes] runs past the end of the file (%zu bytes; "
                 "the data section starts at %llu)", (unsigned long long)off, t->bytes, g->size,
                 (unsigned long long)data);
    t->data = g->map + data + off;
  }
  ps->what[0] = '\0';
  return 0;
}

/* ---- Opening ------------------------------------------------------------------------------ */

static int check_header(parser *ps, uint64_t *n_tensors, uint64_t *n_kv) {
  const uint8_t *m = ps->g->map;
  uint32_t version = tdm__le32(m + 4);
  uint32_t swapped = __builtin_bswap32(version);
  char magic[16];
  if (memcmp(m, "GGUF", 4) != 0)
    return bad(ps, "not a GGUF file: it starts with \"%s\", not \"GGUF\"%s",
               tdm__gguf_printable(magic, sizeof magic, m, 4),
               memcmp(m, "FUGG", 4) == 0 ? " (byte-swapped: a big-endian file? only "
                                           "little-endian files are read)" : "");
  if (swapped >= 1 && swapped <= 3)
    return bad(ps, "a big-endian GGUF file (version field 0x%08x, version %u byte-swapped); "
               "only little-endian files are read", version, swapped);
  if (version == 1)
    return bad(ps, "GGUF version 1 is not supported (32-bit counts); versions 2 and 3 are");
  if (version != 2 && version != 3)
    return bad(ps, "unknown GGUF version %u (versions 2 and 3 are read)", version);
  if (ps->g->size < HEADER_BYTES)
    return bad(ps, "the file is %zu bytes, shorter than a GGUF header (%d bytes)", ps->g->size,
               HEADER_BYTES);
  ps->g->version = (int)version;
  *n_tensors = tdm__le64(m + 8);
  *n_kv = tdm__le64(m + 16);
  ps->pos = HEADER_BYTES;
  return 0;
}

static int parse(tdm_gguf *g) {
  parser ps = {.g = g};
  uint64_t n_tensors = 0, n_kv = 0;
  int rc;
  if ((rc = check_header(&ps, &n_tensors, &n_kv))) return rc;
  if ((rc = read_kvs(&ps, n_kv))) return rc;
  ps.what[0] = '\0';
  if ((rc = read_tensors(&ps, n_tensors))) return rc;
  if ((rc = copy_strings(&ps))) return rc;
  if ((rc = index_names(&ps))) return rc;
  return place_tensors(&ps);
}

/* An errno from open, stat or mmap, as tandem's code. */
static int os_error(const char *path, const char *call, int e) {
  int code = e == ENOMEM ? TDM_ENOMEM
             : e == ENOENT || e == ENOTDIR ? TDM_ENOENT : TDM_EBACKEND;
  return tdm_set_error(code, e, "%s: %s failed: %s", path, call, strerror(e));
}

/* Maps the file: a regular file of at least 8 bytes (magic and version), else a message. */
static int map_file(tdm_gguf *g) {
  struct stat st;
  void *m;
  /* O_NONBLOCK: a FIFO given as the path must not block the open; it is refused below. */
  int fd = open(g->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK), rc = 0;
  if (fd < 0) return os_error(g->path, "open", errno);
  if (fstat(fd, &st) != 0) {
    rc = os_error(g->path, "fstat", errno);
  } else if (S_ISDIR(st.st_mode)) {
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: is a directory, not a GGUF file", g->path);
  } else if (!S_ISREG(st.st_mode)) {
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: is not a regular file", g->path);
  } else if ((uint64_t)st.st_size < 8) {
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: the file is %lld bytes, shorter than a GGUF header "
                       "(%d bytes)", g->path, (long long)st.st_size, HEADER_BYTES);
  } else if ((uint64_t)st.st_size > SIZE_MAX) {
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: the file (%lld bytes) is larger than the address "
                       "space", g->path, (long long)st.st_size);
  } else {
    m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      rc = os_error(g->path, "mmap", errno);
    } else {
      g->map = m;
      g->size = (size_t)st.st_size;
    }
  }
  close(fd);
  return rc;
}

int tdm_gguf_open(const char *path, tdm_gguf **out) {
  tdm_gguf *g;
  int rc;
  if (!path || !out)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_gguf_open: path and out must not be NULL");
  g = calloc(1, sizeof *g);
  if (!g || !(g->path = strdup(path))) {
    free(g);
    return tdm_set_error(TDM_ENOMEM, 0, "%s: no memory to open it", path);
  }
  if ((rc = map_file(g)) == 0) rc = parse(g);
  if (rc != 0) {
    tdm_gguf_close(g);
    return rc;
  }
  *out = g;
  return 0;
}

void tdm_gguf_close(tdm_gguf *g) {
  if (!g) return;
  if (g->kv)
    for (size_t i = 0; i < g->n_kv; i++) free(g->kv[i].elems);
  free(g->kv);
  free(g->kv_sorted);
  free(g->tensors);
  free(g->tensor_name_at);
  free(g->tensor_name_len);
  free(g->tensor_offset);
  free(g->tensors_sorted);
  free(g->strings);
  if (g->map) munmap((void *)g->map, g->size);
  free(g->path);
  free(g);
}
