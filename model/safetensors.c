/* safetensors.c: a Hugging Face model folder (safetensors.h): which shards hold its weights
 * (a single file, an index's weight_map, or every *.safetensors), each shard mapped read-only
 * and its header checked entry by entry before a tensor view is made from it, one sorted view
 * of all the tensors for lookup by name, the index checked against what the shards hold, and
 * config.json's values by key.
 *
 * A shard is an 8-byte little-endian header length N, N bytes of JSON, then the data section:
 * {"<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {...}}, offsets counted from the data section's start. Everything in it is
 * untrusted: a length, a shape or an offset is checked against the file before any pointer is
 * computed from it, and no check may overflow. */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Real headers stay far below this (Qwen3-235B-A22B's ~19k tensors take ~2 MB); a longer one
 * is a broken length field, refused before anything is copied or parsed. */
#define HEADER_MAX (100ull * 1000 * 1000)
/* config.json and the index are read whole; they are kilobytes to a few megabytes. */
#define JSON_FILE_MAX ((size_t)64 << 20)
/* cJSON holds numbers as doubles, exact for integers up to 2^53 only: shapes and offsets
 * above it are refused (no shard is 8 PiB, and a rounded offset would point elsewhere). */
#define EXACT_MAX 9007199254740992.0
/* A name quoted in a message is cut here, so that a hostile name cannot push the file and the
 * problem out of the message buffer. */
#define NAME "%.200s"

typedef struct shard {
  char *path;
  const unsigned char *map; /* the whole file, read-only; NULL when not mapped */
  size_t size;
} shard;

typedef struct entry {
  tdm_mf_tensor t; /* t.name owned; t.data points into its shard's map */
  size_t shard;    /* index into the folder's shards */
} entry;

struct tdm_st {
  char *dir;
  char *config_path;
  cJSON *config;
  shard *shards;
  size_t nshards;
  entry *entries; /* every shard's tensors, shard by shard */
  size_t nentries, cap;
  const entry **sorted; /* the same by name, for bsearch */
};

static char *join(const char *dir, const char *name) {
  size_t a = strlen(dir), b = strlen(name);
  int slash = a > 0 && dir[a - 1] != '/';
  char *p = malloc(a + slash + b + 1);
  if (!p) return NULL;
  memcpy(p, dir, a);
  if (slash) p[a] = '/';
  memcpy(p + a + slash, name, b + 1);
  return p;
}

/* safetensors' dtypes. Those with type -1 are real dtypes with no element type in file.h:
 * known here so that their message says that, not "unknown". */
static const struct {
  const char *name;
  int type;
  int size;
} st_dtypes[] = {
    {"F64", TDM_MF_F64, 8},  {"F32", TDM_MF_F32, 4},    {"F16", TDM_MF_F16, 2},
    {"BF16", TDM_MF_BF16, 2}, {"I64", TDM_MF_I64, 8},   {"I32", TDM_MF_I32, 4},
    {"I16", TDM_MF_I16, 2},  {"I8", TDM_MF_I8, 1},      {"U64", -1, 8},
    {"U32", -1, 4},          {"U16", -1, 2},            {"U8", -1, 1},
    {"BOOL", -1, 1},         {"F8_E4M3", -1, 1},        {"F8_E5M2", -1, 1},
    {"F8_E8M0", -1, 1},      {"F6_E2M3", -1, 1},        {"F6_E3M2", -1, 1},
    {"F4", -1, 1},           {"C64", -1, 8},
};

static int oom(const char *what) {
  return tdm_set_error(TDM_ENOMEM, 0, "tdm_st_open: out of memory (%s)", what);
}

static const char *json_type(const cJSON *j) {
  if (!j) return "missing";
  if (cJSON_IsNull(j)) return "null";
  if (cJSON_IsBool(j)) return "a boolean";
  if (cJSON_IsNumber(j)) return "a number";
  if (cJSON_IsString(j)) return "a string";
  if (cJSON_IsArray(j)) return "an array";
  if (cJSON_IsObject(j)) return "an object";
  return "of no JSON type";
}

/* Why `j` is not an unsigned integer a double holds exactly (written into why), or 0 with *v
 * set. cJSON has already turned the text into a double: 1e300, -1 and 2.5 all arrive here. */
static int json_uint(const cJSON *j, uint64_t *v, char *why, size_t n) {
  double d = cJSON_IsNumber(j) ? j->valuedouble : 0;
  const char *bad = d < 0 ? "is negative" : !(d <= EXACT_MAX) ? "is above 2^53"
                    : d != floor(d) ? "is not an integer" : NULL;
  if (!cJSON_IsNumber(j)) snprintf(why, n, "is %s, not a number", json_type(j));
  else if (bad) snprintf(why, n, "%.17g %s", d, bad);
  else *v = (uint64_t)d;
  return cJSON_IsNumber(j) && !bad ? 0 : -1;
}

static int open_error(const char *path, const char *why_named) {
  int e = errno;
  if (e == ENOENT)
    return tdm_set_error(TDM_ENOENT, e, "%s: no such file%s", path, why_named);
  return tdm_set_error(TDM_EINVAL, e, "%s: cannot open: %s", path, strerror(e));
}

/* Parses n bytes of JSON text that must be an object. The text is copied and NUL-terminated
 * first, so that cJSON never reads a mapping past it. Nothing may follow the value but
 * whitespace. A NUL byte is refused first: cJSON would take it for whitespace between tokens,
 * and inside a string it would cut a tensor's name short. */
static int parse_object(const char *path, const char *what, const unsigned char *bytes,
                        size_t n, cJSON **out) {
  const char *end = NULL, *type;
  const unsigned char *nul = n ? memchr(bytes, 0, n) : NULL;
  char *text;
  cJSON *j;
  if (nul)
    return tdm_set_error(TDM_EINVAL, 0, "%s: %s holds a NUL byte (at byte %zu of %zu)", path,
                         what, (size_t)(nul - bytes), n);
  if (!(text = malloc(n + 1))) return oom(path);
  if (n) memcpy(text, bytes, n);
  text[n] = '\0';
  j = cJSON_ParseWithLengthOpts(text, n + 1, &end, 1);
  /* cJSON cannot tell a failed allocation from bad text; both land here. */
  if (!j || end != text + n) {
    size_t at = end && end >= text && end <= text + n ? (size_t)(end - text) : 0;
    cJSON_Delete(j);
    free(text);
    return tdm_set_error(TDM_EINVAL, 0, "%s: %s is not valid JSON (at byte %zu of %zu)", path,
                         what, at, n);
  }
  free(text);
  if (cJSON_IsObject(j)) {
    *out = j;
    return 0;
  }
  type = json_type(j); /* a static string: it outlives j */
  cJSON_Delete(j);
  return tdm_set_error(TDM_EINVAL, 0, "%s: %s is %s, not a JSON object", path, what, type);
}

/* Maps a whole file read-only (*map stays NULL for an empty one: mmap refuses 0 bytes).
 * why_named ends a missing file's message: who named it. */
static int map_file(const char *path, const char *why_named, const unsigned char **map,
                    size_t *size) {
  struct stat st;
  void *m;
  int e, fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return open_error(path, why_named);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return tdm_set_error(TDM_EINVAL, 0, "%s: not a regular file", path);
  }
  *size = (size_t)st.st_size;
  m = *size ? mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
  e = errno;
  close(fd);
  if (m == MAP_FAILED)
    return tdm_set_error(e == ENOMEM ? TDM_ENOMEM : TDM_EINVAL, e, "%s: mmap of %zu bytes "
                         "failed: %s", path, *size, strerror(e));
  *map = m;
  return 0;
}

/* config.json and the index: small files, parsed whole. */
static int json_read(const char *path, cJSON **out) {
  const unsigned char *map = NULL;
  size_t size = 0;
  int rc = map_file(path, "", &map, &size);
  if (rc == 0 && size > JSON_FILE_MAX)
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: %zu bytes, over the limit of %zu for a JSON file",
                       path, size, JSON_FILE_MAX);
  else if (rc == 0)
    rc = parse_object(path, "the file", map, size, out);
  if (map) munmap((void *)map, size);
  return rc;
}

/* "[4, 16]", for messages. */
static void shape_text(const uint64_t *dims, int n, char *buf, size_t len) {
  size_t at = 0;
  at += (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < n && at < len; i++)
    at += (size_t)snprintf(buf + at, len - at, "%s%llu", i ? ", " : "",
                           (unsigned long long)dims[i]);
  if (at < len) snprintf(buf + at, len - at, "]");
}

static int entry_add(tdm_st *s, const entry *e) {
  if (s->nentries == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 256;
    entry *p = realloc(s->entries, cap * sizeof *p);
    if (!p) return oom("the tensor list");
    s->entries = p;
    s->cap = cap;
  }
  s->entries[s->nentries++] = *e;
  return 0;
}

/* An entry refused: "<shard>: tensor <name>: <why>". */
__attribute__((format(printf, 3, 4))) static int bad_entry(const char *path, const char *name,
                                                           const char *fmt, ...) {
  char why[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  return tdm_set_error(TDM_EINVAL, 0, "%s: tensor " NAME ": %s", path, name, why);
}

typedef unsigned long long ull; /* for printf */

/* One header entry: every field checked, then the view made and appended. */
static int entry_parse(tdm_st *s, size_t si, const cJSON *j, const unsigned char *data,
                       uint64_t data_len) {
  const char *path = s->shards[si].path, *name = j->string;
  const cJSON *dtype, *shape, *offs;
  uint64_t dims[TDM_MF_MAX_DIMS], elements = 1, bytes, off[2];
  char why[128], st[160];
  int ndim, size = 0, type = -1;
  entry e;

  if (!cJSON_IsObject(j))
    return bad_entry(path, name, "its entry is %s, not an object", json_type(j));
  dtype = cJSON_GetObjectItemCaseSensitive(j, "dtype");
  if (!cJSON_IsString(dtype))
    return bad_entry(path, name, "dtype is %s, not a string", json_type(dtype));
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++) {
    if (strcmp(st_dtypes[i].name, dtype->valuestring) != 0) continue;
    if (st_dtypes[i].type < 0)
      return bad_entry(path, name, "dtype %s is not supported (F64, F32, F16, BF16 and I8 to "
                       "I64 are)", dtype->valuestring);
    type = st_dtypes[i].type;
    size = st_dtypes[i].size;
    break;
  }
  if (type < 0) return bad_entry(path, name, "unknown dtype \"%.40s\"", dtype->valuestring);

  shape = cJSON_GetObjectItemCaseSensitive(j, "shape");
  if (!cJSON_IsArray(shape))
    return bad_entry(path, name, "shape is %s, not an array", json_type(shape));
  ndim = cJSON_GetArraySize(shape);
  if (ndim > TDM_MF_MAX_DIMS)
    return bad_entry(path, name, "shape has %d dimensions, more than %d", ndim, TDM_MF_MAX_DIMS);
  for (int i = 0; i < ndim; i++)
    if (json_uint(cJSON_GetArrayItem(shape, i), &dims[i], why, sizeof why) != 0)
      return bad_entry(path, name, "shape entry %d %s", i, why);
  shape_text(dims, ndim, st, sizeof st);
  for (int i = 0; i < ndim; i++)
    if (__builtin_mul_overflow(elements, dims[i], &elements))
      return bad_entry(path, name, "shape %s has more than 2^64 elements", st);
  if (__builtin_mul_overflow(elements, (uint64_t)size, &bytes))
    return bad_entry(path, name, "shape %s of %s is more than 2^64 bytes", st,
                     dtype->valuestring);

  offs = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
    return bad_entry(path, name, "data_offsets is %s, not an array of two offsets",
                     json_type(offs));
  for (int i = 0; i < 2; i++)
    if (json_uint(cJSON_GetArrayItem(offs, i), &off[i], why, sizeof why) != 0)
      return bad_entry(path, name, "data_offsets entry %d %s", i, why);
  if (off[0] > off[1])
    return bad_entry(path, name, "data_offsets [%llu, %llu] end before they begin",
                     (ull)off[0], (ull)off[1]);
  if (off[1] > data_len)
    return bad_entry(path, name, "data_offsets [%llu, %llu] leave the data section (%llu "
                     "bytes)", (ull)off[0], (ull)off[1], (ull)data_len);
  if (off[1] - off[0] != bytes)
    return bad_entry(path, name, "data_offsets [%llu, %llu] hold %llu bytes, but shape %s of %s "
                     "needs %llu", (ull)off[0], (ull)off[1], (ull)(off[1] - off[0]), st,
                     dtype->valuestring, (ull)bytes);

  memset(&e, 0, sizeof e);
  e.shard = si;
  e.t.type = type;
  e.t.ndim = ndim;
  for (int i = 0; i < ndim; i++) e.t.shape[i] = (int64_t)dims[i];
  e.t.data = data + off[0];
  e.t.bytes = (size_t)bytes;
  if (!(e.t.name = strdup(name))) return oom("a tensor name");
  if (entry_add(s, &e) == 0) return 0;
  free((char *)e.t.name);
  return TDM_ENOMEM;
}

/* A mapped shard's header: its length field, then each entry. */
static int shard_parse(tdm_st *s, size_t si) {
  const shard *sh = &s->shards[si];
  uint64_t n = 0;
  cJSON *root = NULL;
  int rc;

  if (sh->size < 8)
    return tdm_set_error(TDM_EINVAL, 0, "%s: %zu bytes, too short for the 8-byte header "
                         "length", sh->path, sh->size);
  for (int i = 7; i >= 0; i--) n = n << 8 | sh->map[i];
  if (n == 0)
    return tdm_set_error(TDM_EINVAL, 0, "%s: header length 0 (a header is at least \"{}\")",
                         sh->path);
  if (n > HEADER_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%s: header length %llu is over the limit of 100 MB",
                         sh->path, (unsigned long long)n);
  if (n > sh->size - 8)
    return tdm_set_error(TDM_EINVAL, 0, "%s: header length %llu runs past the end of the file "
                         "(%zu bytes)", sh->path, (unsigned long long)n, sh->size);
  rc = parse_object(sh->path, "the header", sh->map + 8, (size_t)n, &root);
  if (rc != 0) return rc;
  for (const cJSON *j = root->child; j && rc == 0; j = j->next) {
    if (strcmp(j->string, "__metadata__") == 0) {
      if (!cJSON_IsObject(j))
        rc = tdm_set_error(TDM_EINVAL, 0, "%s: __metadata__ is %s, not an object", sh->path,
                           json_type(j));
      continue;
    }
    rc = entry_parse(s, si, j, sh->map + 8 + n, sh->size - 8 - n);
  }
  cJSON_Delete(root);
  return rc;
}

/* Adds dir/name to the shards (tdm_st_close frees it from then on), maps it and checks its
 * header. why_named ends a missing file's message: who named it. */
static int shard_open(tdm_st *s, const char *name, const char *why_named) {
  shard *sh = realloc(s->shards, (s->nshards + 1) * sizeof *sh);
  int rc;
  if (!sh) return oom("the shard list");
  s->shards = sh;
  sh = &s->shards[s->nshards];
  memset(sh, 0, sizeof *sh);
  if (!(sh->path = join(s->dir, name))) return oom("a shard's path");
  s->nshards++;
  rc = map_file(sh->path, why_named, &sh->map, &sh->size);
  return rc == 0 ? shard_parse(s, s->nshards - 1) : rc;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Opens the named shards in sorted order, each once. names is sorted here. */
static int shards_open_all(tdm_st *s, const char **names, size_t n, const char *why_named) {
  qsort(names, n, sizeof *names, cmp_str);
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && strcmp(names[i], names[i - 1]) == 0) continue;
    int rc = shard_open(s, names[i], why_named);
    if (rc != 0) return rc;
  }
  return 0;
}

/* The shards that the index's weight_map names. HF writes them into the folder itself, so a
 * value that is no plain file name (a path, "..") is refused rather than followed. */
static int open_indexed(tdm_st *s, const char *index_path, const cJSON *index) {
  const cJSON *wm = cJSON_GetObjectItemCaseSensitive(index, "weight_map");
  const char **names;
  size_t n = 0;
  int rc;
  if (!cJSON_IsObject(wm))
    return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map is %s, not an object", index_path,
                         json_type(wm));
  names = malloc(((size_t)cJSON_GetArraySize(wm) + 1) * sizeof *names);
  if (!names) return oom("the index's shard names");
  for (const cJSON *j = wm->child; j; j = j->next) {
    const char *f = cJSON_IsString(j) ? j->valuestring : NULL;
    if (!f) {
      free(names);
      return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map's entry for tensor " NAME " is %s, "
                           "not a file name", index_path, j->string, json_type(j));
    }
    if (!*f || strchr(f, '/') || strcmp(f, ".") == 0 || strcmp(f, "..") == 0) {
      free(names);
      return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map puts tensor " NAME " in \"%.200s\", "
                           "not a file name in the folder", index_path, j->string, f);
    }
    names[n++] = f;
  }
  if (n == 0) {
    free(names);
    return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map names no tensors", index_path);
  }
  rc = shards_open_all(s, names, n, " (model.safetensors.index.json's weight_map names it)");
  free(names);
  return rc;
}

/* Every *.safetensors file of the folder (no index): sorted, as HF's shard names sort in
 * their order. Dot files (a copy tool's "._x") are not shards. */
static int open_all_in_dir(tdm_st *s) {
  DIR *d = opendir(s->dir);
  char **names = NULL, **p;
  size_t n = 0;
  int rc = 0;
  struct dirent *de;
  if (!d) return open_error(s->dir, "");
  while (rc == 0 && (de = readdir(d)) != NULL) {
    size_t len = strlen(de->d_name);
    if (de->d_name[0] == '.' || len <= 12 || strcmp(de->d_name + len - 12, ".safetensors") != 0)
      continue;
    if (!(p = realloc(names, (n + 1) * sizeof *p)) || !(p[n] = strdup(de->d_name)))
      rc = oom("the folder's shard names");
    if (p) names = p;
    if (rc == 0) n++;
  }
  closedir(d);
  if (rc == 0 && n == 0)
    rc = tdm_set_error(TDM_ENOENT, 0, "%s: no model.safetensors, model.safetensors.index.json "
                       "or other *.safetensors file", s->dir);
  if (rc == 0) rc = shards_open_all(s, (const char **)names, n, "");
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  return rc;
}

static int cmp_entry(const void *a, const void *b) {
  const entry *x = *(const entry *const *)a;
  const entry *y = *(const entry *const *)b;
  return strcmp(x->t.name, y->t.name);
}

static int cmp_key(const void *key, const void *b) {
  return strcmp(key, (*(const entry *const *)b)->t.name);
}

/* The sorted view; a name found twice (across shards, or twice in one header) is refused. */
static int build_sorted(tdm_st *s) {
  s->sorted = malloc((s->nentries + 1) * sizeof *s->sorted);
  if (!s->sorted) return oom("the tensor index");
  for (size_t i = 0; i < s->nentries; i++) s->sorted[i] = &s->entries[i];
  qsort(s->sorted, s->nentries, sizeof *s->sorted, cmp_entry);
  for (size_t i = 1; i < s->nentries; i++) {
    const entry *a = s->sorted[i - 1], *b = s->sorted[i];
    size_t lo = a->shard < b->shard ? a->shard : b->shard;
    size_t hi = a->shard < b->shard ? b->shard : a->shard;
    if (strcmp(a->t.name, b->t.name) != 0) continue;
    if (lo == hi)
      return tdm_set_error(TDM_EINVAL, 0, "%s: tensor " NAME " is in the header twice",
                           s->shards[lo].path, a->t.name);
    return tdm_set_error(TDM_EINVAL, 0, "tensor " NAME " is in two shards: %s and %s",
                         a->t.name, s->shards[lo].path, s->shards[hi].path);
  }
  return 0;
}

static const entry *find_entry(const tdm_st *s, const char *name) {
  const entry **e;
  if (!s || !name || s->nentries == 0) return NULL;
  e = bsearch(name, s->sorted, s->nentries, sizeof *s->sorted, cmp_key);
  return e ? *e : NULL;
}

/* Each tensor the index names must be in the shard it names. Tensors of a shard that the
 * index does not list are kept: it is a table of contents, not a filter. */
static int check_index(const tdm_st *s, const char *index_path, const cJSON *index) {
  const cJSON *wm = cJSON_GetObjectItemCaseSensitive(index, "weight_map");
  for (const cJSON *j = wm->child; j; j = j->next) {
    const entry *e = find_entry(s, j->string);
    const char *base;
    if (!e)
      return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map names tensor " NAME " in %.200s, "
                           "which has no such tensor", index_path, j->string, j->valuestring);
    base = strrchr(s->shards[e->shard].path, '/');
    base = base ? base + 1 : s->shards[e->shard].path;
    if (strcmp(base, j->valuestring) != 0)
      return tdm_set_error(TDM_EINVAL, 0, "%s: weight_map puts tensor " NAME " in %.200s, but "
                           "it is in %s", index_path, j->string, j->valuestring,
                           s->shards[e->shard].path);
  }
  return 0;
}

/* Whether dir/name is there. lstat: a dangling link (a half-copied HF cache) is, and its open
 * says why; so is anything when memory runs out, and then its open says that. */
static int present(const tdm_st *s, const char *name) {
  struct stat st;
  char *path = join(s->dir, name);
  int there = !path || lstat(path, &st) == 0 || errno != ENOENT;
  free(path);
  return there;
}

/* The weights, in transformers' order of preference. */
static int open_weights(tdm_st *s) {
  static const char index_name[] = "model.safetensors.index.json";
  char *ipath;
  cJSON *index = NULL;
  int rc;
  if (present(s, "model.safetensors")) return shard_open(s, "model.safetensors", "");
  if (!present(s, index_name)) return open_all_in_dir(s);
  if (!(ipath = join(s->dir, index_name))) return oom("a path");
  rc = json_read(ipath, &index);
  if (rc == 0) rc = open_indexed(s, ipath, index);
  if (rc == 0) rc = build_sorted(s);
  if (rc == 0) rc = check_index(s, ipath, index);
  cJSON_Delete(index);
  free(ipath);
  return rc;
}

int tdm_st_open(const char *dir, tdm_st **out) {
  tdm_st *s;
  int rc;
  if (!dir || !out)
    return tdm_set_error(TDM_EINVAL, 0, "tdm_st_open: NULL %s", dir ? "out" : "dir");
  *out = NULL;
  s = calloc(1, sizeof *s);
  if (!s) return oom("the folder");
  s->dir = strdup(dir);
  s->config_path = join(dir, "config.json");
  if (!s->dir || !s->config_path) {
    tdm_st_close(s);
    return oom("a path");
  }
  rc = json_read(s->config_path, &s->config);
  if (rc == 0) rc = open_weights(s);
  /* The indexed path sorts before it checks the index against the shards; the others here. */
  if (rc == 0 && !s->sorted) rc = build_sorted(s);
  if (rc != 0) {
    tdm_st_close(s);
    return rc;
  }
  *out = s;
  return 0;
}

void tdm_st_close(tdm_st *s) {
  if (!s) return;
  for (size_t i = 0; i < s->nentries; i++) free((char *)s->entries[i].t.name);
  for (size_t i = 0; i < s->nshards; i++) {
    if (s->shards[i].map) munmap((void *)s->shards[i].map, s->shards[i].size);
    free(s->shards[i].path);
  }
  cJSON_Delete(s->config);
  free(s->sorted);
  free(s->entries);
  free(s->shards);
  free(s->config_path);
  free(s->dir);
  free(s);
}

size_t tdm_st_tensor_count(const tdm_st *s) { return s ? s->nentries : 0; }

const tdm_mf_tensor *tdm_st_tensor_at(const tdm_st *s, size_t i) {
  return s && i < s->nentries ? &s->entries[i].t : NULL;
}

const tdm_mf_tensor *tdm_st_tensor_find(const tdm_st *s, const char *name) {
  const entry *e = find_entry(s, name);
  return e ? &e->t : NULL;
}

const char *tdm_st_path(const tdm_st *s) { return s ? s->dir : NULL; }

/* ---- config.json ---------------------------------------------------------------------- */

/* The value at a dotted key; TDM_ENOENT where it or an object on its way is absent or null.
 * Segments are compared in place, so a key of any length needs no copy. */
static int config_get(const tdm_st *s, const char *key, const cJSON **out) {
  const cJSON *cur;
  const char *p = key;
  if (!s || !key || !out) return tdm_set_error(TDM_EINVAL, 0, "tdm_st_config: NULL argument");
  cur = s->config;
  for (;;) {
    const char *dot = strchr(p, '.');
    size_t len = dot ? (size_t)(dot - p) : strlen(p);
    const cJSON *c = cur->child;
    while (c && !(strncmp(c->string, p, len) == 0 && c->string[len] == '\0')) c = c->next;
    if (!c)
      return tdm_set_error(TDM_ENOENT, 0, "%s: no key %s", s->config_path, key);
    if (cJSON_IsNull(c))
      return tdm_set_error(TDM_ENOENT, 0, "%s: no key %s (%.*s is null)", s->config_path, key,
                           (int)(p + len - key), key);
    if (!dot) {
      *out = c;
      return 0;
    }
    if (!cJSON_IsObject(c))
      return tdm_set_error(TDM_EINVAL, 0, "%s: key %s: %.*s is %s, not an object",
                           s->config_path, key, (int)(dot - key), key, json_type(c));
    cur = c;
    p = dot + 1;
  }
}

/* The value at key, which must be of the cJSON type `type` (a mask: cJSON_True | cJSON_False
 * for a boolean); `want` names it in the message. */
static int config_typed(const tdm_st *s, const char *key, int type, const char *want,
                        const cJSON **out) {
  int rc = config_get(s, key, out);
  if (rc == 0 && !((*out)->type & type))
    rc = tdm_set_error(TDM_EINVAL, 0, "%s: key %s is %s, not %s", s->config_path, key,
                       json_type(*out), want);
  return rc;
}

int tdm_st_config_i64(const tdm_st *s, const char *key, int64_t *v) {
  const cJSON *j;
  int rc = config_typed(s, key, cJSON_Number, "an integer", &j);
  if (rc != 0) return rc;
  if (j->valuedouble != floor(j->valuedouble) || fabs(j->valuedouble) > EXACT_MAX)
    return tdm_set_error(TDM_EINVAL, 0, "%s: key %s is %.17g, not an integer of at most 2^53 "
                         "in magnitude", s->config_path, key, j->valuedouble);
  if (v) *v = (int64_t)j->valuedouble;
  return 0;
}

int tdm_st_config_f64(const tdm_st *s, const char *key, double *v) {
  const cJSON *j;
  int rc = config_typed(s, key, cJSON_Number, "a number", &j);
  if (rc == 0 && v) *v = j->valuedouble;
  return rc;
}

int tdm_st_config_str(const tdm_st *s, const char *key, const char **v) {
  const cJSON *j;
  int rc = config_typed(s, key, cJSON_String, "a string", &j);
  if (rc == 0 && v) *v = j->valuestring;
  return rc;
}

int tdm_st_config_bool(const tdm_st *s, const char *key, int *v) {
  const cJSON *j;
  int rc = config_typed(s, key, cJSON_True | cJSON_False, "true or false", &j);
  if (rc == 0 && v) *v = cJSON_IsTrue(j);
  return rc;
}

int tdm_st_architecture(const tdm_st *s, const char **name) {
  const cJSON *j, *first;
  int rc = config_typed(s, "architectures", cJSON_Array, "an array of strings", &j);
  if (rc != 0) return rc;
  first = j->child;
  if (!first)
    return tdm_set_error(TDM_ENOENT, 0, "%s: architectures is an empty array", s->config_path);
  if (!cJSON_IsString(first))
    return tdm_set_error(TDM_EINVAL, 0, "%s: architectures[0] is %s, not a string",
                         s->config_path, json_type(first));
  if (name) *name = first->valuestring;
  return 0;
}
