/* gguf-meta.c: reading an open GGUF file: its tensors and metadata by name (binary search over
 * indexes sorted when the file was opened), values converted to what the caller asks for when
 * they fit, and a message naming the key when they do not. Everything read here was checked
 * against the file's length by gguf.c. */
#include "gguf-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Names -------------------------------------------------------------------------------- */

static int name_cmp(const char *a, size_t alen, const char *b, size_t blen) {
  int c = memcmp(a, b, alen < blen ? alen : blen);
  if (c) return c;
  return alen < blen ? -1 : alen > blen;
}

static int entry_cmp(const void *x, const void *y) {
  const tdm__gguf_name *a = x, *b = y;
  int c = name_cmp(a->s, a->len, b->s, b->len);
  if (c) return c;
  return a->i < b->i ? -1 : a->i > b->i; /* equal names: file order, for the message */
}

const tdm__gguf_name *tdm__gguf_sort(tdm__gguf_name *v, size_t n) {
  if (n < 2) return NULL;
  qsort(v, n, sizeof *v, entry_cmp);
  for (size_t i = 1; i < n; i++)
    if (name_cmp(v[i - 1].s, v[i - 1].len, v[i].s, v[i].len) == 0) return &v[i - 1];
  return NULL;
}

const tdm__gguf_name *tdm__gguf_search(const tdm__gguf_name *v, size_t n, const char *s,
                                       size_t len) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = name_cmp(v[mid].s, v[mid].len, s, len);
    if (c == 0) return &v[mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

const char *tdm__gguf_printable(char *buf, size_t cap, const uint8_t *s, size_t len) {
  size_t n = 0, keep = cap - 1;
  if (len > keep) keep = cap > 4 ? cap - 4 : 0; /* room for "..." */
  for (; n < len && n < keep; n++) buf[n] = s[n] >= 0x20 && s[n] < 0x7f ? (char)s[n] : '?';
  if (n < len) {
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

const char *tdm_gguf_type_name(int type) {
  static const char *const names[] = {"u8",  "i8",   "u16",    "i16",   "u32", "i32", "f32",
                                      "bool", "string", "array", "u64", "i64", "f64"};
  return type >= 0 && type <= TDM_GGUF_F64 ? names[type] : "?";
}

/* ---- The handle --------------------------------------------------------------------------- */

int tdm_gguf_version(const tdm_gguf *g) { return g ? g->version : 0; }
const char *tdm_gguf_path(const tdm_gguf *g) { return g ? g->path : NULL; }

void tdm_gguf_mapping(const tdm_gguf *g, const void **base, size_t *size) {
  if (base) *base = g ? g->map : NULL;
  if (size) *size = g ? g->size : 0;
}

size_t tdm_gguf_tensor_count(const tdm_gguf *g) { return g ? g->n_tensors : 0; }

const tdm_mf_tensor *tdm_gguf_tensor_at(const tdm_gguf *g, size_t i) {
  return g && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const tdm_mf_tensor *tdm_gguf_tensor_find(const tdm_gguf *g, const char *name) {
  const tdm__gguf_name *e;
  if (!g || !name) return NULL;
  e = tdm__gguf_search(g->tensors_sorted, g->n_tensors, name, strlen(name));
  return e ? &g->tensors[e->i] : NULL;
}

size_t tdm_gguf_key_count(const tdm_gguf *g) { return g ? g->n_kv : 0; }

int tdm_gguf_key_at(const tdm_gguf *g, size_t i, const char **key, int *type) {
  if (!g || i >= g->n_kv)
    return tdm_set_error(TDM_ERANGE, 0, "%s: no key #%zu (the file has %zu)",
                         g ? g->path : "tdm_gguf_key_at", i, g ? g->n_kv : 0);
  if (key) *key = g->kv[i].key;
  if (type) *type = g->kv[i].type;
  return 0;
}

const tdm__gguf_kv *tdm__gguf_kv_find(const tdm_gguf *g, const char *key) {
  const tdm__gguf_name *e = tdm__gguf_search(g->kv_sorted, g->n_kv, key, strlen(key));
  return e ? &g->kv[e->i] : NULL;
}

/* ---- Values ------------------------------------------------------------------------------- */

/* A number as read from the file: which of the three fields holds it. */
typedef struct num {
  enum { NUM_U, NUM_I, NUM_F } kind;
  uint64_t u;
  int64_t i;
  double f;
} num;

/* The value of a scalar type at p; 0, or -1 for a type that is no number. */
static int load(const uint8_t *p, int type, num *n) {
  uint32_t u32;
  uint64_t u64;
  float f32;
  switch (type) {
    case TDM_GGUF_U8: case TDM_GGUF_BOOL: *n = (num){NUM_U, .u = p[0]}; return 0;
    case TDM_GGUF_I8: *n = (num){NUM_I, .i = (int8_t)p[0]}; return 0;
    case TDM_GGUF_U16: *n = (num){NUM_U, .u = (uint16_t)(p[0] | p[1] << 8)}; return 0;
    case TDM_GGUF_I16: *n = (num){NUM_I, .i = (int16_t)(uint16_t)(p[0] | p[1] << 8)}; return 0;
    case TDM_GGUF_U32: *n = (num){NUM_U, .u = tdm__le32(p)}; return 0;
    case TDM_GGUF_I32: *n = (num){NUM_I, .i = (int32_t)tdm__le32(p)}; return 0;
    case TDM_GGUF_U64: *n = (num){NUM_U, .u = tdm__le64(p)}; return 0;
    case TDM_GGUF_I64: *n = (num){NUM_I, .i = (int64_t)tdm__le64(p)}; return 0;
    case TDM_GGUF_F32:
      u32 = tdm__le32(p);
      memcpy(&f32, &u32, 4);
      *n = (num){NUM_F, .f = f32};
      return 0;
    case TDM_GGUF_F64:
      u64 = tdm__le64(p);
      *n = (num){NUM_F, .f = 0};
      memcpy(&n->f, &u64, 8);
      return 0;
    default: return -1;
  }
}

static int no_key(const tdm_gguf *g, const char *key) {
  return tdm_set_error(TDM_ENOENT, 0, "%s: no key %s", g->path, key);
}

/* The key's entry, or a message: no handle or key, no such key. */
static int lookup(const tdm_gguf *g, const char *key, const tdm__gguf_kv **kv) {
  if (!g || !key)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_gguf_get: handle and key must not be NULL");
  if (!(*kv = tdm__gguf_kv_find(g, key))) return no_key(g, key);
  return 0;
}

/* "has type string", "is an array of u32": for messages. */
static const char *describe(const tdm__gguf_kv *kv, char *buf, size_t cap) {
  if (kv->type == TDM_GGUF_ARRAY)
    snprintf(buf, cap, "is an array of %s", tdm_gguf_type_name(kv->elem_type));
  else
    snprintf(buf, cap, "has type %s", tdm_gguf_type_name(kv->type));
  return buf;
}

static int wrong_type(const tdm_gguf *g, const tdm__gguf_kv *kv, const char *want) {
  char d[64];
  return tdm_set_error(TDM_EINVAL, 0, "%s: key %s %s, not %s", g->path, kv->key,
                       describe(kv, d, sizeof d), want);
}

static int is_integer(int type) {
  return type != TDM_GGUF_F32 && type != TDM_GGUF_F64 && type != TDM_GGUF_BOOL &&
         tdm__gguf_scalar_size(type) != 0;
}

/* n as an unsigned or a signed integer, or a message naming what (a key or an element). */
static int to_u64(const tdm_gguf *g, const char *what, const num *n, uint64_t *v) {
  if (n->kind == NUM_I && n->i < 0)
    return tdm_set_error(TDM_EINVAL, 0, "%s: %s is negative (%lld)", g->path, what,
                         (long long)n->i);
  *v = n->kind == NUM_U ? n->u : (uint64_t)n->i;
  return 0;
}

static int to_i64(const tdm_gguf *g, const char *what, const num *n, int64_t *v) {
  if (n->kind == NUM_U && n->u > (uint64_t)INT64_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%s: %s (%llu) does not fit in int64", g->path, what,
                         (unsigned long long)n->u);
  *v = n->kind == NUM_U ? (int64_t)n->u : n->i;
  return 0;
}

static double to_f64(const num *n) {
  return n->kind == NUM_F ? n->f : n->kind == NUM_U ? (double)n->u : (double)n->i;
}

int tdm__gguf_kv_u64(const tdm_gguf *g, const tdm__gguf_kv *kv, uint64_t *v) {
  char what[300];
  num n;
  if (!is_integer(kv->type) && kv->type != TDM_GGUF_BOOL)
    return wrong_type(g, kv, "an integer");
  load(g->map + kv->at, kv->type, &n);
  snprintf(what, sizeof what, "key %s", kv->key);
  return to_u64(g, what, &n, v);
}

int tdm_gguf_get_u64(const tdm_gguf *g, const char *key, uint64_t *v) {
  const tdm__gguf_kv *kv;
  uint64_t x = 0;
  int rc = lookup(g, key, &kv);
  if (rc || (rc = tdm__gguf_kv_u64(g, kv, &x))) return rc;
  if (v) *v = x;
  return 0;
}

int tdm_gguf_get_i64(const tdm_gguf *g, const char *key, int64_t *v) {
  const tdm__gguf_kv *kv;
  char what[300];
  int64_t x = 0;
  num n;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (!is_integer(kv->type) && kv->type != TDM_GGUF_BOOL)
    return wrong_type(g, kv, "an integer");
  load(g->map + kv->at, kv->type, &n);
  snprintf(what, sizeof what, "key %s", kv->key);
  if ((rc = to_i64(g, what, &n, &x))) return rc;
  if (v) *v = x;
  return 0;
}

int tdm_gguf_get_f64(const tdm_gguf *g, const char *key, double *v) {
  const tdm__gguf_kv *kv;
  num n;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (kv->type == TDM_GGUF_BOOL || load(g->map + kv->at, kv->type, &n) != 0)
    return wrong_type(g, kv, "a number");
  if (v) *v = to_f64(&n);
  return 0;
}

int tdm_gguf_get_bool(const tdm_gguf *g, const char *key, int *v) {
  const tdm__gguf_kv *kv;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (kv->type != TDM_GGUF_BOOL) return wrong_type(g, kv, "a bool");
  if (v) *v = g->map[kv->at] != 0;
  return 0;
}

int tdm_gguf_get_str(const tdm_gguf *g, const char *key, const char **s, size_t *len) {
  const tdm__gguf_kv *kv;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (kv->type != TDM_GGUF_STRING) return wrong_type(g, kv, "a string");
  if (s) *s = kv->str;
  if (len) *len = kv->str_len;
  return 0;
}

/* ---- Arrays ------------------------------------------------------------------------------- */

int tdm_gguf_get_array(const tdm_gguf *g, const char *key, int *elem_type, uint64_t *count) {
  const tdm__gguf_kv *kv;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (kv->type != TDM_GGUF_ARRAY) return wrong_type(g, kv, "an array");
  if (elem_type) *elem_type = kv->elem_type;
  if (count) *count = kv->count;
  return 0;
}

/* The array's i-th element of a fixed-size type (want says which kinds, for the message). */
static int element(const tdm_gguf *g, const char *key, uint64_t i, int floats, num *n,
                   const tdm__gguf_kv **out) {
  const tdm__gguf_kv *kv;
  size_t esize;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  esize = tdm__gguf_scalar_size(kv->elem_type);
  if (kv->type != TDM_GGUF_ARRAY || esize == 0 ||
      (!floats && (kv->elem_type == TDM_GGUF_F32 || kv->elem_type == TDM_GGUF_F64)) ||
      (floats && kv->elem_type == TDM_GGUF_BOOL))
    return wrong_type(g, kv, floats ? "an array of numbers" : "an array of integers");
  if (i >= kv->count)
    return tdm_set_error(TDM_ERANGE, 0, "%s: key %s: index %llu is past the array's end (%llu "
                         "elements)", g->path, key, (unsigned long long)i,
                         (unsigned long long)kv->count);
  load(g->map + kv->at + (size_t)i * esize, kv->elem_type, n);
  *out = kv;
  return 0;
}

int tdm_gguf_array_i64(const tdm_gguf *g, const char *key, uint64_t i, int64_t *v) {
  const tdm__gguf_kv *kv;
  char what[320];
  int64_t x = 0;
  num n;
  int rc = element(g, key, i, 0, &n, &kv);
  if (rc) return rc;
  snprintf(what, sizeof what, "key %s: element %llu", kv->key, (unsigned long long)i);
  if ((rc = to_i64(g, what, &n, &x))) return rc;
  if (v) *v = x;
  return 0;
}

int tdm_gguf_array_f64(const tdm_gguf *g, const char *key, uint64_t i, double *v) {
  const tdm__gguf_kv *kv;
  num n;
  int rc = element(g, key, i, 1, &n, &kv);
  if (rc) return rc;
  if (v) *v = to_f64(&n);
  return 0;
}

int tdm_gguf_array_str(const tdm_gguf *g, const char *key, uint64_t i, const char **s,
                       size_t *len) {
  const tdm__gguf_kv *kv;
  size_t at;
  int rc = lookup(g, key, &kv);
  if (rc) return rc;
  if (kv->type != TDM_GGUF_ARRAY || kv->elem_type != TDM_GGUF_STRING)
    return wrong_type(g, kv, "an array of strings");
  if (i >= kv->count)
    return tdm_set_error(TDM_ERANGE, 0, "%s: key %s: index %llu is past the array's end (%llu "
                         "elements)", g->path, key, (unsigned long long)i,
                         (unsigned long long)kv->count);
  at = kv->elems[i];
  if (s) *s = (const char *)g->map + at + 8;
  if (len) *len = (size_t)tdm__le64(g->map + at);
  return 0;
}
