/* test-safetensors.c: the reader of Hugging Face model folders in libtandem_model
 * (model/safetensors.h). Against the folder that the pinned safetensors package wrote
 * (tests/model/st_fixture.py, in $TANDEM_TEST_ST_DIR): every tensor's dtype, shape and bytes
 * as its sidecar expected.json lists them, and config.json's values. Then each malformation the
 * reader must refuse, made in a temporary folder from a copy of the good one, with a message
 * that names the file, the tensor and the problem; and thousands of mutants of one shard (and
 * of the index and config), each read or refused but never a crash. No device needed: each
 * case runs once, on cpu:0 by name only; without the fixture the cases skip. */
#include "harness.h"

#include "safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"
#define INDEX "model.safetensors.index.json"
/* In SHARD1: F32, shape [4, 16]. */
#define GATE0 "model.layers.0.mlp.gate.weight"

/* ---- Files and folders ------------------------------------------------------------------- */

typedef struct buf {
  unsigned char *p; /* NUL-terminated, for JSON text */
  size_t n;
} buf;

static buf file_read(const char *path) {
  buf b = {NULL, 0};
  struct stat st;
  int fd = open(path, O_RDONLY);
  CHECK_MSG(fd >= 0, "%s: %s", path, strerror(errno));
  CHECK(fstat(fd, &st) == 0);
  b.n = (size_t)st.st_size;
  b.p = malloc(b.n + 1);
  CHECK(b.p != NULL);
  CHECK(read(fd, b.p, b.n) == (ssize_t)b.n);
  b.p[b.n] = '\0';
  close(fd);
  return b;
}

static void file_write(const char *path, const void *p, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK_MSG(fd >= 0, "%s: %s", path, strerror(errno));
  CHECK(write(fd, p, n) == (ssize_t)n);
  CHECK(close(fd) == 0);
}

static void file_write_str(const char *path, const char *text) {
  file_write(path, text, strlen(text));
}

/* dir/name in one of a few rotating buffers: enough for the paths one statement needs. */
static const char *at(const char *dir, const char *name) {
  static char bufs[8][PATH_MAX];
  static int next;
  char *p = bufs[next++ % 8];
  int n = snprintf(p, PATH_MAX, "%s/%s", dir, name);
  CHECK(n > 0 && n < PATH_MAX);
  return p;
}

/* The fixture's folder; the case skips where the fixture was not written (no Python, or no
 * safetensors package: st_fixture.py exits 77 and writes nothing). */
static const char *fixture(void) {
  const char *d = getenv("TANDEM_TEST_ST_DIR");
  if (!d || !*d) TH_SKIP("TANDEM_TEST_ST_DIR is not set (tests/model/st_fixture.py's folder)");
  if (access(at(d, "expected.json"), R_OK) != 0)
    TH_SKIP("%s has no expected.json: the fixture was not written (Python or its safetensors "
            "package missing?)", d);
  return d;
}

static char tmp_dir[PATH_MAX];

/* A fresh empty folder under $TMPDIR (or /tmp); tmp_remove() takes it away again. A failing
 * case leaves it behind for a look. */
static const char *tmp_make(void) {
  const char *base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  snprintf(tmp_dir, sizeof tmp_dir, "%s/tandem-st-XXXXXX", base);
  CHECK_MSG(mkdtemp(tmp_dir) != NULL, "mkdtemp %s: %s", tmp_dir, strerror(errno));
  return tmp_dir;
}

static void tmp_remove(void) {
  DIR *d = opendir(tmp_dir);
  struct dirent *de;
  CHECK(d != NULL);
  while ((de = readdir(d)) != NULL)
    if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, ".."))
      CHECK(unlink(at(tmp_dir, de->d_name)) == 0);
  closedir(d);
  CHECK(rmdir(tmp_dir) == 0);
}

static void copy_file(const char *from, const char *to) {
  buf b = file_read(from);
  file_write(to, b.p, b.n);
  free(b.p);
}

/* A fresh temporary copy of the fixture's model folder. */
static const char *tmp_copy(void) {
  const char *src = fixture(), *dir = tmp_make();
  static const char *const names[] = {"config.json", INDEX, SHARD1, SHARD2};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    copy_file(at(src, names[i]), at(dir, names[i]));
  return dir;
}

static cJSON *json_load(const char *path) {
  buf b = file_read(path);
  cJSON *j = cJSON_Parse((const char *)b.p);
  CHECK_MSG(j != NULL, "%s does not parse", path);
  free(b.p);
  return j;
}

static void json_store(const char *path, const cJSON *j) {
  char *text = cJSON_PrintUnformatted(j);
  CHECK(text != NULL);
  file_write_str(path, text);
  cJSON_free(text);
}

/* ---- Shards ------------------------------------------------------------------------------ */

/* Writes a shard: the length of `header`, the header, the data section. */
static void shard_store(const char *path, const char *header, size_t hlen, const buf *data) {
  size_t n = 8 + hlen + data->n;
  unsigned char *p = malloc(n);
  CHECK(p != NULL);
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
  memcpy(p + 8, header, hlen);
  if (data->n) memcpy(p + 8 + hlen, data->p, data->n);
  file_write(path, p, n);
  free(p);
}

/* A shard's parsed header, and a copy of its data section. */
static cJSON *shard_load(const char *path, buf *data) {
  buf b = file_read(path);
  uint64_t n = 0;
  cJSON *h;
  for (int i = 7; i >= 0; i--) n = n << 8 | b.p[i];
  CHECK(n + 8 <= b.n);
  h = cJSON_ParseWithLength((const char *)b.p + 8, (size_t)n);
  CHECK(h != NULL);
  data->n = b.n - 8 - (size_t)n;
  data->p = malloc(data->n + 1);
  CHECK(data->p != NULL);
  memcpy(data->p, b.p + 8 + n, data->n);
  free(b.p);
  return h;
}

static void shard_store_json(const char *path, const cJSON *header, const buf *data) {
  char *text = cJSON_PrintUnformatted(header);
  CHECK(text != NULL);
  shard_store(path, text, strlen(text), data);
  cJSON_free(text);
}

/* In the shard at path, sets `field` of tensor's entry to the JSON text `value` (NULL removes
 * the field). With tensor NULL, `field` is a top-level entry of the header itself. */
static void shard_edit(const char *path, const char *tensor, const char *field,
                       const char *value) {
  buf data;
  cJSON *h = shard_load(path, &data), *obj = h;
  if (tensor) {
    obj = cJSON_GetObjectItemCaseSensitive(h, tensor);
    CHECK_MSG(obj != NULL, "no tensor %s in %s", tensor, path);
  }
  if (!value) {
    cJSON_DeleteItemFromObjectCaseSensitive(obj, field);
  } else {
    cJSON *v = cJSON_Parse(value);
    CHECK_MSG(v != NULL, "test bug: %s is not JSON", value);
    CHECK(cJSON_ReplaceItemInObjectCaseSensitive(obj, field, v));
  }
  shard_store_json(path, h, &data);
  cJSON_Delete(h);
  free(data.p);
}

/* Sets the 8-byte header length of the shard at path. */
static void shard_set_length(const char *path, uint64_t n) {
  buf b = file_read(path);
  for (int i = 0; i < 8; i++) b.p[i] = (unsigned char)(n >> (8 * i));
  file_write(path, b.p, b.n);
  free(b.p);
}

/* ---- Expectations ------------------------------------------------------------------------ */

/* Opening dir fails with `want`, leaves *out NULL, and the message holds every word. */
static void expect_fail_at(int line, const char *dir, int want, const char *const *words) {
  tdm_st *s = (tdm_st *)&s; /* not NULL: the failure must clear it */
  printf("line %d: expecting %s from %s\n", line, tdm_err_name(want), dir);
  CHECK_RC(tdm_st_open(dir, &s), want);
  CHECK(s == NULL);
  for (int i = 0; words[i]; i++)
    CHECK_MSG(strstr(tdm_last_error(), words[i]) != NULL, "line %d: the message\n  %s\nlacks "
              "\"%s\"", line, tdm_last_error(), words[i]);
  printf("  refused: %s\n", tdm_last_error());
}
#define EXPECT_FAIL(dir, want, ...)                                                           \
  expect_fail_at(__LINE__, dir, want, (const char *const[]){__VA_ARGS__, NULL})

static uint64_t fnv1a64(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static int type_of(const char *dtype) {
  if (strcmp(dtype, "F32") == 0) return TDM_MF_F32;
  if (strcmp(dtype, "F16") == 0) return TDM_MF_F16;
  if (strcmp(dtype, "BF16") == 0) return TDM_MF_BF16;
  th_fail(__FILE__, __LINE__, "the sidecar has dtype %s, which this test does not know", dtype);
}

static int type_size(int type) {
  switch (type) {
    case TDM_MF_F64: case TDM_MF_I64: return 8;
    case TDM_MF_F32: case TDM_MF_I32: return 4;
    case TDM_MF_F16: case TDM_MF_BF16: case TDM_MF_I16: return 2;
    case TDM_MF_I8: return 1;
    default: th_fail(__FILE__, __LINE__, "type %d is no type the reader gives", type);
  }
}

/* s holds exactly the sidecar's tensors of `shard` (NULL: of every shard), each with its
 * dtype, shape and bytes; and every tensor it lists is found by name, as itself. */
static void check_sidecar(const tdm_st *s, const char *shard) {
  cJSON *side = json_load(at(fixture(), "expected.json"));
  const cJSON *t, *list = cJSON_GetObjectItemCaseSensitive(side, "tensors");
  size_t want = 0;
  cJSON_ArrayForEach(t, list) {
    const char *name = cJSON_GetObjectItemCaseSensitive(t, "name")->valuestring;
    const char *in = cJSON_GetObjectItemCaseSensitive(t, "shard")->valuestring;
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape"), *d;
    const tdm_mf_tensor *got = tdm_st_tensor_find(s, name);
    uint64_t sum;
    int i = 0;
    if (shard && strcmp(in, shard) != 0) {
      CHECK_MSG(got == NULL, "%s (of %s) is found with only %s open", name, in, shard);
      continue;
    }
    want++;
    CHECK_MSG(got != NULL, "tensor %s is not found", name);
    CHECK(strcmp(got->name, name) == 0);
    CHECK_EQ(got->type, type_of(cJSON_GetObjectItemCaseSensitive(t, "dtype")->valuestring));
    CHECK_EQ(got->ndim, cJSON_GetArraySize(shape));
    cJSON_ArrayForEach(d, shape) CHECK_EQ(got->shape[i++], (int64_t)d->valuedouble);
    CHECK_EQ(got->bytes, (int64_t)cJSON_GetObjectItemCaseSensitive(t, "bytes")->valuedouble);
    sum = strtoull(cJSON_GetObjectItemCaseSensitive(t, "fnv1a64")->valuestring, NULL, 16);
    CHECK_MSG(fnv1a64(got->data, got->bytes) == sum, "%s: its bytes differ from the sidecar's",
              name);
  }
  CHECK_EQ(tdm_st_tensor_count(s), want);
  for (size_t i = 0; i < want; i++) {
    const tdm_mf_tensor *t_i = tdm_st_tensor_at(s, i);
    CHECK(t_i != NULL);
    CHECK(tdm_st_tensor_find(s, t_i->name) == t_i);
  }
  CHECK(tdm_st_tensor_at(s, want) == NULL);
  cJSON_Delete(side);
}

/* ---- The fixture, read ------------------------------------------------------------------- */

TEST_CASE(reads_fixture) {
  const char *dir = fixture();
  tdm_st *s = NULL;
  CHECK_OK(tdm_st_open(dir, &s));
  CHECK(strcmp(tdm_st_path(s), dir) == 0);
  check_sidecar(s, NULL);
  CHECK(tdm_st_tensor_find(s, "model.layers.2.mlp.gate.weight") == NULL);
  CHECK(tdm_st_tensor_find(s, "") == NULL);
  CHECK(tdm_st_tensor_find(s, "model") == NULL);
  tdm_st_close(s);
  tdm_st_close(NULL);
}

/* Every value of the sidecar's copy of config.json, through every getter: the right one reads
 * it, the others say which type they found. */
TEST_CASE(config_values) {
  const char *dir = fixture(), *str = NULL;
  cJSON *side = json_load(at(dir, "expected.json"));
  const cJSON *v, *config = cJSON_GetObjectItemCaseSensitive(side, "config");
  tdm_st *s = NULL;
  int64_t i64;
  double f64;
  int b;
  CHECK_OK(tdm_st_open(dir, &s));
  cJSON_ArrayForEach(v, config) {
    const char *k = v->string;
    printf("  %s\n", k);
    if (cJSON_IsNull(v)) {
      CHECK_RC(tdm_st_config_i64(s, k, &i64), TDM_ENOENT);
      CHECK_RC(tdm_st_config_str(s, k, &str), TDM_ENOENT);
    } else if (cJSON_IsBool(v)) {
      CHECK_OK(tdm_st_config_bool(s, k, &b));
      CHECK_EQ(b, cJSON_IsTrue(v));
      CHECK_RC(tdm_st_config_i64(s, k, &i64), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "a boolean") && strstr(tdm_last_error(), k));
    } else if (cJSON_IsNumber(v)) {
      CHECK_OK(tdm_st_config_f64(s, k, &f64));
      CHECK(f64 == v->valuedouble);
      if (v->valuedouble == (double)(int64_t)v->valuedouble) {
        CHECK_OK(tdm_st_config_i64(s, k, &i64));
        CHECK_EQ(i64, (int64_t)v->valuedouble);
      } else {
        CHECK_RC(tdm_st_config_i64(s, k, &i64), TDM_EINVAL);
      }
      CHECK_RC(tdm_st_config_str(s, k, &str), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "a number"));
    } else if (cJSON_IsString(v)) {
      CHECK_OK(tdm_st_config_str(s, k, &str));
      CHECK(strcmp(str, v->valuestring) == 0);
      CHECK_RC(tdm_st_config_bool(s, k, &b), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "a string"));
    } else {
      CHECK_RC(tdm_st_config_f64(s, k, &f64), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "an array") || strstr(tdm_last_error(), "an object"));
    }
  }
  CHECK_OK(tdm_st_architecture(s, &str));
  CHECK(strcmp(str, "Qwen3MoeForCausalLM") == 0);
  CHECK_OK(tdm_st_config_i64(s, "num_experts", &i64));
  CHECK_EQ(i64, 4);
  CHECK_OK(tdm_st_config_f64(s, "rms_norm_eps", &f64));
  CHECK(f64 == 1e-6);
  CHECK_OK(tdm_st_config_f64(s, "rope_theta", &f64));
  CHECK(f64 == 1e6);
  CHECK_RC(tdm_st_config_f64(s, "rope_scaling.factor", &f64), TDM_ENOENT);
  CHECK(strstr(tdm_last_error(), "rope_scaling is null"));
  CHECK_RC(tdm_st_config_i64(s, "no_such_key", &i64), TDM_ENOENT);
  CHECK(strstr(tdm_last_error(), "config.json") && strstr(tdm_last_error(), "no_such_key"));
  CHECK_RC(tdm_st_config_i64(s, "hidden_size.x", &i64), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "hidden_size is a number, not an object"));
  tdm_st_close(s);
  cJSON_Delete(side);
}

/* Dotted keys into nested objects, integers at their limits, and "architectures" of every
 * shape. */
TEST_CASE(config_nested) {
  const char *dir = tmp_copy(), *str = NULL;
  tdm_st *s = NULL;
  int64_t i64;
  double f64;
  int b;
  file_write_str(at(dir, "config.json"),
                 "{\"architectures\": [], \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0,"
                 " \"original_max_position_embeddings\": 32768, \"inner\": {\"deep\": true,"
                 " \"none\": null}}, \"big\": 1e18, \"neg\": -3, \"frac\": 0.5,"
                 " \"exact\": 9007199254740992, \"a\": {\"b\": 5}}");
  CHECK_OK(tdm_st_open(dir, &s));
  CHECK_OK(tdm_st_config_f64(s, "rope_scaling.factor", &f64));
  CHECK(f64 == 4.0);
  CHECK_OK(tdm_st_config_i64(s, "rope_scaling.factor", &i64));
  CHECK_EQ(i64, 4);
  CHECK_OK(tdm_st_config_str(s, "rope_scaling.type", &str));
  CHECK(strcmp(str, "yarn") == 0);
  CHECK_OK(tdm_st_config_i64(s, "rope_scaling.original_max_position_embeddings", &i64));
  CHECK_EQ(i64, 32768);
  CHECK_OK(tdm_st_config_bool(s, "rope_scaling.inner.deep", &b));
  CHECK_EQ(b, 1);
  CHECK_RC(tdm_st_config_bool(s, "rope_scaling.inner.none", &b), TDM_ENOENT);
  CHECK_RC(tdm_st_config_bool(s, "rope_scaling.inner.missing", &b), TDM_ENOENT);
  CHECK_RC(tdm_st_config_str(s, "rope_scaling.type.x", &str), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "rope_scaling.type is a string, not an object"));
  CHECK_RC(tdm_st_config_i64(s, "rope_scaling", &i64), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "an object"));
  CHECK_RC(tdm_st_config_i64(s, "big", &i64), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "2^53"));
  CHECK_OK(tdm_st_config_f64(s, "big", &f64));
  CHECK(f64 == 1e18);
  CHECK_OK(tdm_st_config_i64(s, "neg", &i64));
  CHECK_EQ(i64, -3);
  CHECK_RC(tdm_st_config_i64(s, "frac", &i64), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "not an integer"));
  CHECK_OK(tdm_st_config_i64(s, "exact", &i64));
  CHECK_EQ(i64, 9007199254740992ll);
  CHECK_OK(tdm_st_config_i64(s, "a.b", &i64));
  CHECK_EQ(i64, 5);
  CHECK_RC(tdm_st_config_i64(s, "a.", &i64), TDM_ENOENT);
  CHECK_RC(tdm_st_architecture(s, &str), TDM_ENOENT);
  CHECK(strstr(tdm_last_error(), "empty"));
  tdm_st_close(s);

  static const struct {
    const char *config;
    int want;
  } arch[] = {
      {"{}", TDM_ENOENT},
      {"{\"architectures\": null}", TDM_ENOENT},
      {"{\"architectures\": \"MixtralForCausalLM\"}", TDM_EINVAL},
      {"{\"architectures\": [5]}", TDM_EINVAL},
      {"{\"architectures\": [\"MixtralForCausalLM\", \"x\"]}", 0},
  };
  for (size_t i = 0; i < sizeof arch / sizeof arch[0]; i++) {
    file_write_str(at(dir, "config.json"), arch[i].config);
    CHECK_OK(tdm_st_open(dir, &s));
    str = NULL;
    CHECK_RC(tdm_st_architecture(s, &str), arch[i].want);
    if (arch[i].want == 0) CHECK(strcmp(str, "MixtralForCausalLM") == 0);
    tdm_st_close(s);
  }
  tmp_remove();
}

/* ---- Folder layouts ---------------------------------------------------------------------- */

/* model.safetensors comes first, as in transformers: the index and the shards beside it are
 * not read. */
TEST_CASE(single_file) {
  const char *dir = tmp_copy();
  tdm_st *s = NULL;
  CHECK(rename(at(dir, SHARD1), at(dir, "model.safetensors")) == 0);
  file_write_str(at(dir, SHARD2), "not a shard");
  CHECK_OK(tdm_st_open(dir, &s));
  check_sidecar(s, SHARD1);
  tdm_st_close(s);
  tmp_remove();
}

/* No index: every *.safetensors of the folder, and nothing else (other files, dot files). */
TEST_CASE(unindexed_shards) {
  const char *dir = tmp_copy();
  tdm_st *s = NULL;
  CHECK(unlink(at(dir, INDEX)) == 0);
  file_write_str(at(dir, "._" SHARD1), "a copy tool's resource fork");
  file_write_str(at(dir, "tokenizer.json"), "{}");
  file_write_str(at(dir, "notes.safetensors.txt"), "not a shard");
  CHECK_OK(tdm_st_open(dir, &s));
  check_sidecar(s, NULL);
  tdm_st_close(s);
  tmp_remove();
}

TEST_CASE(no_weights) {
  const char *dir = tmp_copy();
  CHECK(unlink(at(dir, INDEX)) == 0);
  CHECK(unlink(at(dir, SHARD1)) == 0);
  CHECK(unlink(at(dir, SHARD2)) == 0);
  EXPECT_FAIL(dir, TDM_ENOENT, dir, "no model.safetensors");
  tmp_remove();
}

/* Every dtype that has an element type, a scalar and an empty tensor, in a shard written here
 * with its header padded by spaces (as the format allows); and the dtypes without one. */
TEST_CASE(all_dtypes) {
  static const char header[] =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[16,32]},"
      "\"c\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[32,38]},"
      "\"d\":{\"dtype\":\"BF16\",\"shape\":[1,1,1,3],\"data_offsets\":[38,44]},"
      "\"e\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[44,52]},"
      "\"f\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[52,56]},"
      "\"g\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[56,60]},"
      "\"h\":{\"dtype\":\"I8\",\"shape\":[4],\"data_offsets\":[60,64]},"
      "\"i\":{\"dtype\":\"F32\",\"shape\":[0,16],\"data_offsets\":[64,64]}}      ";
  static const struct {
    const char *name;
    int type, ndim;
    size_t offset, bytes;
  } want[] = {
      {"a", TDM_MF_F64, 1, 0, 16}, {"b", TDM_MF_F32, 2, 16, 16}, {"c", TDM_MF_F16, 1, 32, 6},
      {"d", TDM_MF_BF16, 4, 38, 6}, {"e", TDM_MF_I64, 0, 44, 8}, {"f", TDM_MF_I32, 1, 52, 4},
      {"g", TDM_MF_I16, 1, 56, 4},  {"h", TDM_MF_I8, 1, 60, 4},  {"i", TDM_MF_F32, 2, 64, 0},
  };
  unsigned char bytes[64];
  buf data = {bytes, sizeof bytes};
  const char *dir = tmp_make();
  const unsigned char *base;
  tdm_st *s = NULL;
  for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)i;
  file_write_str(at(dir, "config.json"), "{}");
  shard_store(at(dir, "model.safetensors"), header, strlen(header), &data);
  CHECK_OK(tdm_st_open(dir, &s));
  CHECK_EQ(tdm_st_tensor_count(s), 9);
  base = tdm_st_tensor_find(s, "a")->data;
  CHECK(base[0] == 0 && base[63] == 63);
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const tdm_mf_tensor *t = tdm_st_tensor_find(s, want[i].name);
    int64_t n = 1;
    CHECK(t != NULL);
    CHECK(tdm_st_tensor_at(s, i) == t); /* one shard: the header's order */
    CHECK_EQ(t->type, want[i].type);
    CHECK_EQ(t->ndim, want[i].ndim);
    CHECK_EQ((const unsigned char *)t->data - base, want[i].offset);
    CHECK_EQ(t->bytes, want[i].bytes);
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    CHECK_EQ((int64_t)t->bytes, n * type_size(t->type));
  }
  tdm_st_close(s);

  static const char *const unsupported[] = {"U8", "BOOL", "U16", "F8_E4M3", "F8_E5M2"};
  for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
    char h[160], why[64];
    snprintf(h, sizeof h, "{\"x\":{\"dtype\":\"%s\",\"shape\":[4],\"data_offsets\":[0,4]}}",
             unsupported[i]);
    shard_store(at(dir, "model.safetensors"), h, strlen(h), &data);
    snprintf(why, sizeof why, "dtype %s is not supported", unsupported[i]);
    EXPECT_FAIL(dir, TDM_EINVAL, "model.safetensors: tensor x: ", why);
  }
  tmp_remove();
}

/* ---- Malformed shards -------------------------------------------------------------------- */

TEST_CASE(header_length_past_end) {
  const char *dir = tmp_copy();
  struct stat st;
  CHECK(stat(at(dir, SHARD1), &st) == 0);
  shard_set_length(at(dir, SHARD1), (uint64_t)st.st_size - 7);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": header length", "runs past the end of the file");
  tmp_remove();
}

TEST_CASE(header_length_zero) {
  const char *dir = tmp_copy();
  shard_set_length(at(dir, SHARD2), 0);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD2 ": header length 0");
  tmp_remove();
}

TEST_CASE(header_length_over_limit) {
  const char *dir = tmp_copy();
  shard_set_length(at(dir, SHARD1), 100000001);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": header length 100000001 is over the limit of 100 MB");
  shard_set_length(at(dir, SHARD1), UINT64_MAX);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": header length 18446744073709551615 is over");
  tmp_remove();
}

TEST_CASE(file_too_short) {
  const char *dir = tmp_copy();
  file_write(at(dir, SHARD2), "\x02\0\0\0", 4);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD2 ": 4 bytes, too short");
  file_write(at(dir, SHARD2), "", 0);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD2 ": 0 bytes, too short");
  tmp_remove();
}

TEST_CASE(header_not_json) {
  static const char *const bad[] = {
      "{\"x\": {\"dtype\": \"F32\",", /* cut short */
      "not json at all",
      "{\"x\": 1} trailing",
  };
  const char *dir = tmp_copy();
  buf data = {NULL, 0};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    shard_store(at(dir, SHARD1), bad[i], strlen(bad[i]), &data);
    EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": the header is not valid JSON (at byte");
  }
  /* NUL padding (the format pads with spaces; cJSON would skip NULs as whitespace), and a
   * NUL inside a name (which would cut it short). */
  shard_store(at(dir, SHARD1), "{}\0\0", 4, &data);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": the header holds a NUL byte (at byte 2 of 4)");
  shard_store(at(dir, SHARD1), "{\"a\0b\":{}}", 10, &data);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": the header holds a NUL byte (at byte 3 of 10)");
  shard_store(at(dir, SHARD1), "[1, 2]", 6, &data);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": the header is an array, not a JSON object");
  tmp_remove();
}

/* One field of GATE0's entry replaced (value NULL: removed); the message names the shard, the
 * tensor and `why`. */
typedef struct edit {
  const char *field, *value, *why;
} edit;

static void run_edits(const edit *e, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const char *dir = tmp_copy();
    printf("%s = %s\n", e[i].field, e[i].value ? e[i].value : "(removed)");
    shard_edit(at(dir, SHARD1), GATE0, e[i].field, e[i].value);
    EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": tensor " GATE0 ": ", e[i].why);
    tmp_remove();
  }
}

TEST_CASE(bad_dtype) {
  static const edit e[] = {
      {"dtype", "\"Q9\"", "unknown dtype \"Q9\""},
      {"dtype", "\"f32\"", "unknown dtype \"f32\""},
      {"dtype", "\"U8\"", "dtype U8 is not supported"},
      {"dtype", "\"F8_E4M3\"", "dtype F8_E4M3 is not supported"},
      {"dtype", "7", "dtype is a number, not a string"},
      {"dtype", NULL, "dtype is missing, not a string"},
  };
  run_edits(e, sizeof e / sizeof e[0]);
}

TEST_CASE(bad_shape) {
  static const edit e[] = {
      {"shape", "[-1, 16]", "shape entry 0 -1 is negative"},
      {"shape", "[4, 2.5]", "shape entry 1 2.5 is not an integer"},
      {"shape", "[1e300, 16]", "shape entry 0 1.0000000000000001e+300 is above 2^53"},
      {"shape", "[9007199254740994, 1]", "shape entry 0 9007199254740994 is above 2^53"},
      {"shape", "[\"4\", 16]", "shape entry 0 is a string, not a number"},
      {"shape", "[4294967296, 4294967296, 4294967296]",
       "shape [4294967296, 4294967296, 4294967296] has more than 2^64 elements"},
      {"shape", "[4294967296, 2147483648]",
       "shape [4294967296, 2147483648] of F32 is more than 2^64 bytes"},
      {"shape", "[1, 1, 1, 1, 64]", "shape has 5 dimensions, more than 4"},
      {"shape", "16", "shape is a number, not an array"},
      {"shape", NULL, "shape is missing, not an array"},
      {"shape", "[8, 16]", "hold 256 bytes, but shape [8, 16] of F32 needs 512"},
      {"shape", "[]", "hold 256 bytes, but shape [] of F32 needs 4"},
  };
  run_edits(e, sizeof e / sizeof e[0]);
}

TEST_CASE(bad_offsets) {
  const char *dir = tmp_copy();
  buf data;
  cJSON *h = shard_load(at(dir, SHARD1), &data);
  const cJSON *o = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(h, GATE0), "data_offsets");
  unsigned long long b = (unsigned long long)cJSON_GetArrayItem(o, 0)->valuedouble;
  unsigned long long e = (unsigned long long)cJSON_GetArrayItem(o, 1)->valuedouble;
  unsigned long long len = data.n;
  char v[6][64], w[6][160];
  CHECK_EQ(e - b, 256);
  snprintf(v[0], 64, "[%llu, %llu]", len - 200, len + 56);
  snprintf(w[0], 160, "data_offsets [%llu, %llu] leave the data section (%llu bytes)", len - 200,
           len + 56, len);
  snprintf(v[1], 64, "[%llu, %llu]", e, b);
  snprintf(w[1], 160, "data_offsets [%llu, %llu] end before they begin", e, b);
  snprintf(v[2], 64, "[%llu, %llu]", b, e - 4);
  snprintf(w[2], 160, "data_offsets [%llu, %llu] hold 252 bytes, but shape [4, 16] of F32 "
           "needs 256", b, e - 4);
  snprintf(v[3], 64, "[%llu, %llu]", len, len + 256);
  snprintf(w[3], 160, "data_offsets [%llu, %llu] leave the data section", len, len + 256);
  snprintf(v[4], 64, "[%llu.5, %llu]", b, e);
  snprintf(w[4], 160, "data_offsets entry 0 %llu.5 is not an integer", b);
  snprintf(v[5], 64, "[%llu]", b);
  snprintf(w[5], 160, "data_offsets is an array, not an array of two offsets");
  const edit edits[] = {
      {"data_offsets", v[0], w[0]}, {"data_offsets", v[1], w[1]},
      {"data_offsets", v[2], w[2]}, {"data_offsets", v[3], w[3]},
      {"data_offsets", v[4], w[4]}, {"data_offsets", v[5], w[5]},
      {"data_offsets", "[0, 1e17]", "data_offsets entry 1 1e+17 is above 2^53"},
      {"data_offsets", "[0, 18446744073709551616]", "entry 1 1.8446744073709552e+19 is above"},
      {"data_offsets", "[-256, 0]", "data_offsets entry 0 -256 is negative"},
      {"data_offsets", "[0, null]", "data_offsets entry 1 is null, not a number"},
      {"data_offsets", "{}", "data_offsets is an object, not an array of two offsets"},
      {"data_offsets", NULL, "data_offsets is missing"},
  };
  cJSON_Delete(h);
  free(data.p);
  tmp_remove();
  run_edits(edits, sizeof edits / sizeof edits[0]);
}

TEST_CASE(bad_entries) {
  const char *dir = tmp_copy();
  shard_edit(at(dir, SHARD1), NULL, GATE0, "[1, 2]");
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": tensor " GATE0 ": its entry is an array, not an object");
  shard_edit(at(dir, SHARD1), NULL, "__metadata__", "\"pt\"");
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": __metadata__ is a string, not an object");
  tmp_remove();
}

/* ---- Malformed folders ------------------------------------------------------------------- */

TEST_CASE(missing_shard) {
  const char *dir = tmp_copy();
  CHECK(unlink(at(dir, SHARD2)) == 0);
  EXPECT_FAIL(dir, TDM_ENOENT, SHARD2 ": no such file", "weight_map names it");
  tmp_remove();
}

TEST_CASE(index_absent_tensor) {
  const char *dir = tmp_copy();
  cJSON *ix = json_load(at(dir, INDEX));
  cJSON_AddStringToObject(cJSON_GetObjectItemCaseSensitive(ix, "weight_map"),
                          "model.layers.7.mlp.gate.weight", SHARD2);
  json_store(at(dir, INDEX), ix);
  cJSON_Delete(ix);
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": weight_map names tensor model.layers.7.mlp.gate.weight "
              "in " SHARD2 ", which has no such tensor");
  tmp_remove();
}

TEST_CASE(index_wrong_shard) {
  const char *dir = tmp_copy();
  cJSON *ix = json_load(at(dir, INDEX));
  cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(ix, "weight_map"),
                                         "model.norm.weight", cJSON_CreateString(SHARD1));
  json_store(at(dir, INDEX), ix);
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": weight_map puts tensor model.norm.weight in " SHARD1
              ", but it is in ", SHARD2);
  cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(ix, "weight_map"),
                                         "model.norm.weight",
                                         cJSON_CreateString("../" SHARD2));
  json_store(at(dir, INDEX), ix);
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": weight_map puts tensor model.norm.weight in \"../",
              "not a file name in the folder");
  cJSON_Delete(ix);
  file_write_str(at(dir, INDEX), "{\"weight_map\": [\"" SHARD1 "\"]}");
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": weight_map is an array, not an object");
  file_write_str(at(dir, INDEX), "{\"weight_map\": {}}");
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": weight_map names no tensors");
  file_write_str(at(dir, INDEX), "{\"weight_map\": {\"model.norm.weight\": ");
  EXPECT_FAIL(dir, TDM_EINVAL, INDEX ": the file is not valid JSON");
  tmp_remove();
}

/* A tensor of shard 1 given again in shard 2 (an entry with valid offsets there). */
TEST_CASE(duplicate_across_shards) {
  const char *dir = tmp_copy();
  buf data;
  cJSON *h = shard_load(at(dir, SHARD2), &data);
  cJSON *copy = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(h, "model.norm.weight"), 1);
  cJSON_AddItemToObject(h, "model.layers.0.input_layernorm.weight", copy);
  shard_store_json(at(dir, SHARD2), h, &data);
  EXPECT_FAIL(dir, TDM_EINVAL, "tensor model.layers.0.input_layernorm.weight is in two shards",
              SHARD1, SHARD2);
  cJSON_Delete(h);
  free(data.p);
  /* And twice in one header (JSON allows a key twice; the format does not). */
  copy_file(at(fixture(), SHARD2), at(dir, SHARD2));
  h = shard_load(at(dir, SHARD1), &data);
  copy = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(h, GATE0), 1);
  cJSON_AddItemToObject(h, GATE0, copy);
  shard_store_json(at(dir, SHARD1), h, &data);
  EXPECT_FAIL(dir, TDM_EINVAL, SHARD1 ": tensor " GATE0 " is in the header twice");
  cJSON_Delete(h);
  free(data.p);
  tmp_remove();
}

TEST_CASE(missing_config) {
  const char *dir = tmp_copy();
  CHECK(unlink(at(dir, "config.json")) == 0);
  EXPECT_FAIL(dir, TDM_ENOENT, "config.json: no such file");
  tmp_remove();
  EXPECT_FAIL("/nonexistent/tandem-st", TDM_ENOENT, "/nonexistent/tandem-st/config.json");
}

TEST_CASE(config_not_json) {
  const char *dir = tmp_copy();
  file_write_str(at(dir, "config.json"), "{\"hidden_size\": 16,, }");
  EXPECT_FAIL(dir, TDM_EINVAL, "config.json: the file is not valid JSON (at byte", " of 22)");
  file_write_str(at(dir, "config.json"), "");
  EXPECT_FAIL(dir, TDM_EINVAL, "config.json: the file is not valid JSON");
  file_write_str(at(dir, "config.json"), "[{\"hidden_size\": 16}]");
  EXPECT_FAIL(dir, TDM_EINVAL, "config.json: the file is an array, not a JSON object");
  tmp_remove();
}

/* ---- Mutants ----------------------------------------------------------------------------- */

/* Opens dir, which may be broken in any way: 0 or a refusal with a message of its own, never
 * a crash. An accepted folder's tensors are read to their last byte (a view past its mapping
 * would fault here), are consistent, and span at most `span` bytes from the first to the end of
 * the last (the data section, where one shard is open). Returns the code. */
static int open_any(const char *dir, uint64_t span) {
  const unsigned char *lo = NULL, *hi = NULL;
  tdm_st *s = NULL;
  int rc;
  tdm_clear_error();
  rc = tdm_st_open(dir, &s);
  if (rc != 0) {
    CHECK_MSG(rc == TDM_EINVAL || rc == TDM_ENOENT, "%s", tdm_err_name(rc));
    CHECK(s == NULL);
    CHECK(th_message_fits(tdm_last_error(), rc, NULL));
    return rc;
  }
  for (size_t i = 0; i < tdm_st_tensor_count(s); i++) {
    const tdm_mf_tensor *t = tdm_st_tensor_at(s, i);
    int64_t n = 1;
    CHECK(t->ndim >= 0 && t->ndim <= TDM_MF_MAX_DIMS);
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    CHECK_EQ((int64_t)t->bytes, n * type_size(t->type));
    CHECK(tdm_st_tensor_find(s, t->name) == t);
    (void)fnv1a64(t->data, t->bytes);
    if (!lo || (const unsigned char *)t->data < lo) lo = t->data;
    if (!hi || (const unsigned char *)t->data + t->bytes > hi)
      hi = (const unsigned char *)t->data + t->bytes;
  }
  if (lo)
    CHECK_MSG((uint64_t)(hi - lo) <= span, "tensors span %td bytes, more than the %llu of the "
              "data section", hi - lo, (unsigned long long)span);
  tdm_st_close(s);
  return 0;
}

typedef struct tally {
  int read, refused;
} tally;

/* Writes p as dir/file and opens dir. Where file is the one shard, the tensors must lie in the
 * data section that its length field leaves. */
static void mutant(const char *dir, const char *file, const unsigned char *p, size_t n,
                   tally *t) {
  uint64_t span = UINT64_MAX, hlen = 0;
  if (strcmp(file, "model.safetensors") == 0 && n >= 8) {
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | p[i];
    span = hlen <= n - 8 ? n - 8 - hlen : 0;
  }
  file_write(at(dir, file), p, n);
  if (open_any(dir, span) == 0) t->read++;
  else t->refused++;
}

/* A random edit of the header text of a copy of `shard` (hlen bytes after the length): a
 * digit changed into another or into a sign, point or exponent, a digit inserted or a byte
 * deleted (the length field then follows, so that the parser sees the edit), any byte
 * replaced, a bit flipped (the length field included). Returns the mutant's length. */
static size_t mutate_header(const buf *shard, uint64_t hlen, unsigned char *out, uint64_t *rng) {
  static const char digitish[] = "0123456789-+.eE";
  size_t n = shard->n, pos = 8 + th_rand_below(rng, hlen);
  int kind = (int)th_rand_below(rng, 6);
  memcpy(out, shard->p, n);
  if (kind <= 2) { /* find a digit at or after pos */
    size_t at_ = pos;
    while (at_ < 8 + hlen && !(out[at_] >= '0' && out[at_] <= '9')) at_++;
    if (at_ < 8 + hlen) pos = at_;
  }
  switch (kind) {
    case 0: case 1:
      out[pos] = (unsigned char)digitish[th_rand_below(rng, sizeof digitish - 1)];
      return n;
    case 2: case 3: { /* insert (a digit) or delete, and fix the length field */
      uint64_t h = hlen;
      if (kind == 2) {
        memmove(out + pos + 1, out + pos, n - pos);
        out[pos] = (unsigned char)('0' + th_rand_below(rng, 10));
        n++, h++;
      } else {
        memmove(out + pos, out + pos + 1, n - pos - 1);
        n--, h--;
      }
      for (int i = 0; i < 8; i++) out[i] = (unsigned char)(h >> (8 * i));
      return n;
    }
    case 4:
      out[pos] = (unsigned char)th_rand(rng);
      return n;
    default:
      pos = th_rand_below(rng, 8 + hlen);
      out[pos] ^= (unsigned char)(1u << th_rand_below(rng, 8));
      return n;
  }
}

/* Thousands of broken copies of the fixture's first shard, alone in a folder as
 * model.safetensors (so that each reaches the header's checks, not the index's): every
 * truncation up to past the header, then random edits of the header's text. Then edits of
 * the index and of config.json beside both good shards. */
TEST_CASE(mutants) {
  const char *src = fixture(), *dir = tmp_make();
  uint64_t rng = th_seed(), hlen = 0;
  buf shard = file_read(at(src, SHARD1)), ix = file_read(at(src, INDEX));
  buf config = file_read(at(src, "config.json"));
  unsigned char *m = malloc(shard.n + 1);
  tally t = {0, 0};
  struct timespec t0, t1;
  int count = 0;
  CHECK(m != NULL);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | shard.p[i];
  CHECK(8 + hlen <= shard.n);
  file_write(at(dir, "config.json"), config.p, config.n);

  /* Every length through the header and 64 bytes on, then every 97th. */
  for (size_t n = 0; n < shard.n; n += n < 8 + hlen + 64 ? 1 : 97, count++)
    mutant(dir, "model.safetensors", shard.p, n, &t);
  CHECK(t.refused >= (int)(8 + hlen)); /* no cut header reads */
  for (int i = 0; i < 6000; i++, count++) {
    size_t n = mutate_header(&shard, hlen, m, &rng);
    mutant(dir, "model.safetensors", m, n, &t);
  }
  printf("shard: %d mutants, %d read, %d refused\n", count, t.read, t.refused);

  /* The index and config.json: a byte replaced, or a digit changed. */
  CHECK(unlink(at(dir, "model.safetensors")) == 0);
  copy_file(at(src, SHARD1), at(dir, SHARD1));
  copy_file(at(src, SHARD2), at(dir, SHARD2));
  for (int i = 0; i < 600; i++, count++) {
    const buf *b = i % 2 ? &ix : &config;
    const char *file = i % 2 ? INDEX : "config.json";
    size_t pos = th_rand_below(&rng, b->n);
    unsigned char keep = b->p[pos];
    b->p[pos] = i % 4 < 2 ? (unsigned char)th_rand(&rng)
                          : (unsigned char)("0123456789-.e\"{"[th_rand_below(&rng, 15)]);
    mutant(dir, file, b->p, b->n, &t);
    b->p[pos] = keep;
    file_write(at(dir, file), b->p, b->n);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("all: %d mutants, %d read, %d refused, %.2f s\n", count, t.read, t.refused,
         (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  CHECK(t.read > 0 && t.refused > 0);
  free(m);
  free(shard.p);
  free(ix.p);
  free(config.p);
  tmp_remove();
}
