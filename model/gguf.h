/* gguf.h: inside libtandem_model, the reader of GGUF files (versions 2 and 3, little-endian):
 * the file is memory-mapped read-only and checked whole when it is opened, so that every
 * tensor, key and array element handed out afterwards is known to lie inside the file.
 *
 * Errors follow include/tandem.h: 0 or a negative TDM_E* code, out-parameters untouched on
 * failure, and a message (tdm_last_error) that names the file, the key or tensor, and what is
 * wrong with it. An open handle is never changed, so any number of threads may read it at once;
 * closing it while they do is theirs to prevent. The mapping is MAP_PRIVATE: a file truncated
 * by another process while it is open faults (SIGBUS) on access, as any mapping does. */
#ifndef TANDEM_MODEL_GGUF_H
#define TANDEM_MODEL_GGUF_H

#include <tandem.h>

#include "file.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Metadata value types, GGUF's numbers. */
typedef enum tdm_gguf_type {
  TDM_GGUF_U8 = 0,
  TDM_GGUF_I8 = 1,
  TDM_GGUF_U16 = 2,
  TDM_GGUF_I16 = 3,
  TDM_GGUF_U32 = 4,
  TDM_GGUF_I32 = 5,
  TDM_GGUF_F32 = 6,
  TDM_GGUF_BOOL = 7,
  TDM_GGUF_STRING = 8,
  TDM_GGUF_ARRAY = 9,
  TDM_GGUF_U64 = 10,
  TDM_GGUF_I64 = 11,
  TDM_GGUF_F64 = 12,
} tdm_gguf_type;

typedef struct tdm_gguf tdm_gguf;

/* Opens, maps and checks the file at path. Fails with TDM_EINVAL for anything but a
 * well-formed GGUF file (a directory, a FIFO, an empty file included), TDM_ENOENT when the
 * path does not exist (errno ENOENT or ENOTDIR), TDM_EBACKEND when open, stat or mmap fails
 * otherwise (EACCES, ...), TDM_ENOMEM; an errno is kept as the native code
 * (tdm_last_native_error). Refused besides what would overrun the file: duplicate keys or
 * tensor names, names holding a NUL, unknown value or tensor types, rows that are not whole
 * blocks, more than 4 dimensions. Arrays of arrays (up to 8 deep) are accepted, but their
 * elements are not read (the getters say so). The caller frees *out with tdm_gguf_close. */
int tdm_gguf_open(const char *path, tdm_gguf **out);
/* Unmaps the file: every pointer this handle gave out becomes invalid. NULL is ignored. */
void tdm_gguf_close(tdm_gguf *g);

int tdm_gguf_version(const tdm_gguf *g);      /* 2 or 3 */
const char *tdm_gguf_path(const tdm_gguf *g); /* the path as given to open */
/* The whole mapping (to register it with a device, say): valid until close. */
void tdm_gguf_mapping(const tdm_gguf *g, const void **base, size_t *size);

/* Tensors, in the file's order. The pointers stay valid until close. */
size_t tdm_gguf_tensor_count(const tdm_gguf *g);
const tdm_mf_tensor *tdm_gguf_tensor_at(const tdm_gguf *g, size_t i); /* NULL past the end */
const tdm_mf_tensor *tdm_gguf_tensor_find(const tdm_gguf *g, const char *name); /* or NULL */

/* Metadata keys, in the file's order: the key (a NUL-terminated copy) and its value's type. */
size_t tdm_gguf_key_count(const tdm_gguf *g);
int tdm_gguf_key_at(const tdm_gguf *g, size_t i, const char **key, int *type);
const char *tdm_gguf_type_name(int type); /* "u32", "string", "array"; "?" when unknown */

/* Scalars by key: 0, TDM_ENOENT (no such key) or TDM_EINVAL (the value has another type,
 * or does not fit: the message says which). get_u64 takes any integer type that is not
 * negative, and bool (0 or 1); get_i64 any integer that fits in int64_t, and bool; get_f64 f32,
 * f64 and the integers; get_bool bool alone. */
int tdm_gguf_get_u64(const tdm_gguf *g, const char *key, uint64_t *v);
int tdm_gguf_get_i64(const tdm_gguf *g, const char *key, int64_t *v);
int tdm_gguf_get_f64(const tdm_gguf *g, const char *key, double *v);
int tdm_gguf_get_bool(const tdm_gguf *g, const char *key, int *v);
/* A string value: *s is a NUL-terminated copy, valid until close; *len (may be NULL) its length
 * in bytes (the string may hold NULs of its own). */
int tdm_gguf_get_str(const tdm_gguf *g, const char *key, const char **s, size_t *len);

/* Arrays: the element type (a tdm_gguf_type) and count. An empty array is an array. */
int tdm_gguf_get_array(const tdm_gguf *g, const char *key, int *elem_type, uint64_t *count);
/* The i-th element of an array of integers or bools (array_i64; a u64 above INT64_MAX is
 * TDM_EINVAL) or of numbers (array_f64: floats and integers). TDM_ERANGE when i >= count. */
int tdm_gguf_array_i64(const tdm_gguf *g, const char *key, uint64_t i, int64_t *v);
int tdm_gguf_array_f64(const tdm_gguf *g, const char *key, uint64_t i, double *v);
/* The i-th string of an array of strings: *s points into the mapping and is NOT
 * NUL-terminated (tokenizer arrays hold 150k strings, which are not copied); *len is required. */
int tdm_gguf_array_str(const tdm_gguf *g, const char *key, uint64_t i, const char **s,
                       size_t *len);

#ifdef __cplusplus
}
#endif

#endif
