/* gguf-impl.h: what gguf.c (opening and checking a file) and gguf-meta.c (reading its
 * metadata and tensors by name) share: the handle's layout and the little-endian loads. */
#ifndef TANDEM_MODEL_GGUF_IMPL_H
#define TANDEM_MODEL_GGUF_IMPL_H

#include "gguf.h"

/* A name in a sorted index: keys and tensor names are looked up by binary search. */
typedef struct tdm__gguf_name {
  const char *s;
  size_t len;
  size_t i; /* the entry's place in file order */
} tdm__gguf_name;

/* One key and its value. Offsets are into the mapping and were checked when the file was
 * opened: reading at them needs no more checks. */
typedef struct tdm__gguf_kv {
  const char *key; /* NUL-terminated copy */
  size_t key_len;
  size_t key_at;
  int type;
  size_t at;       /* the scalar's bytes, or an array's first element */
  const char *str; /* a string value: NUL-terminated copy */
  size_t str_len;
  size_t str_at;
  int elem_type;   /* arrays */
  uint64_t count;  /* arrays */
  size_t *elems;   /* arrays of strings: where each element's length field is */
} tdm__gguf_kv;

struct tdm_gguf {
  char *path;
  const uint8_t *map;
  size_t size;
  int version;
  size_t n_kv;
  tdm__gguf_kv *kv;
  tdm__gguf_name *kv_sorted;
  size_t n_tensors;
  tdm_mf_tensor *tensors;
  size_t *tensor_name_at, *tensor_name_len; /* where each name lies in the file */
  uint64_t *tensor_offset;                  /* each tensor's offset field */
  tdm__gguf_name *tensors_sorted;
  char *strings; /* one allocation for every NUL-terminated copy */
};

static inline uint32_t tdm__le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t tdm__le64(const uint8_t *p) {
  return (uint64_t)tdm__le32(p) | (uint64_t)tdm__le32(p + 4) << 32;
}

/* The size of one element of a fixed-size value type; 0 for strings, arrays, unknown types. */
static inline size_t tdm__gguf_scalar_size(int type) {
  switch (type) {
    case TDM_GGUF_U8: case TDM_GGUF_I8: case TDM_GGUF_BOOL: return 1;
    case TDM_GGUF_U16: case TDM_GGUF_I16: return 2;
    case TDM_GGUF_U32: case TDM_GGUF_I32: case TDM_GGUF_F32: return 4;
    case TDM_GGUF_U64: case TDM_GGUF_I64: case TDM_GGUF_F64: return 8;
    default: return 0;
  }
}

/* Sorts an index by name; returns the first of two equal names, or NULL. */
const tdm__gguf_name *tdm__gguf_sort(tdm__gguf_name *v, size_t n);
/* The entry named (s, len) in a sorted index, or NULL. */
const tdm__gguf_name *tdm__gguf_search(const tdm__gguf_name *v, size_t n, const char *s,
                                       size_t len);
/* The key's entry, or NULL (no message). */
const tdm__gguf_kv *tdm__gguf_kv_find(const tdm_gguf *g, const char *key);
/* A key's value as an unsigned integer, for the reader's own use (general.alignment): 0, or
 * TDM_EINVAL with a message naming the key. */
int tdm__gguf_kv_u64(const tdm_gguf *g, const tdm__gguf_kv *kv, uint64_t *v);
/* Writes a name for a message: printable ASCII kept, other bytes as '?', long names cut. */
const char *tdm__gguf_printable(char *buf, size_t cap, const uint8_t *s, size_t len);

#endif
