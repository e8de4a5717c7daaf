/* safetensors.h: inside libtandem_model, the reader of a Hugging Face model folder:
 * config.json and the safetensors shards its weights are in, each shard memory-mapped
 * read-only and its header checked entry by entry before any tensor is handed out (file.h's
 * tdm_mf_tensor views, valid while the folder is open). Internal to libtandem_model. */
#ifndef TANDEM_MODEL_SAFETENSORS_H
#define TANDEM_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include <tandem.h>

#include "file.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A model folder: config.json and its safetensors shards. Opaque; read-only once open, so any
 * number of threads may call the functions below on it at once. */
typedef struct tdm_st tdm_st;

/* Opens `dir`, a folder holding config.json and its weights, found in this order (as
 * transformers looks for them): model.safetensors alone; else model.safetensors.index.json and
 * the shards its weight_map names (each tensor it names must be in the shard it says); else
 * every *.safetensors file in the folder. A tensor name found twice is an error. On success
 * *out is the caller's, freed with tdm_st_close. Errors: TDM_ENOENT (config.json, a shard or
 * any weights absent), TDM_EINVAL (a file that breaks the format or cannot be read: the
 * message names the file, the tensor where there is one, and the problem), TDM_ENOMEM. A
 * tensor's data is where its shard puts it: the format does not promise it aligned. */
int tdm_st_open(const char *dir, tdm_st **out);
/* Unmaps the shards and frees everything; every pointer the folder handed out dies with it.
 * NULL is ignored. */
void tdm_st_close(tdm_st *s);

/* The tensors of all shards, shard by shard (in the order the shards were opened) and, within
 * a shard, in its header's order. Pointers are valid until tdm_st_close. */
size_t tdm_st_tensor_count(const tdm_st *s);
const tdm_mf_tensor *tdm_st_tensor_at(const tdm_st *s, size_t i); /* NULL past the end */
/* By exact name, in O(log n); NULL (and no message) when absent. */
const tdm_mf_tensor *tdm_st_tensor_find(const tdm_st *s, const char *name);

/* config.json's values by key: a top-level key, or a dotted path into nested objects
 * ("rope_scaling.factor"). 0 with *v set; TDM_ENOENT where the key is absent or JSON null (or
 * an object on the path is); TDM_EINVAL where the value is of another type (the message names
 * the type found). _i64 takes JSON numbers that are integers of at most 2^53 in magnitude
 * (beyond that a double no longer holds them exactly); _f64 any number; _bool true or false
 * only. _str's string is NUL-terminated and valid while the folder is open. */
int tdm_st_config_i64(const tdm_st *s, const char *key, int64_t *v);
int tdm_st_config_f64(const tdm_st *s, const char *key, double *v);
int tdm_st_config_str(const tdm_st *s, const char *key, const char **v);
int tdm_st_config_bool(const tdm_st *s, const char *key, int *v);

/* config.json's "architectures"[0] ("Qwen3MoeForCausalLM"); TDM_ENOENT where it has none
 * (the key absent, null or an empty list), TDM_EINVAL where it is not a list of strings.
 * Valid while the folder is open. */
int tdm_st_architecture(const tdm_st *s, const char **name);

/* The folder as given to tdm_st_open. Valid while the folder is open. */
const char *tdm_st_path(const tdm_st *s);

#ifdef __cplusplus
}
#endif

#endif
