/* test-gguf.c: the GGUF reader (model/gguf.h). A file written by the gguf Python package
 * (tests/model/gguf_fixture.py, path in $TANDEM_TEST_GGUF) must read back as its JSON sidecar
 * says; files built here byte by byte, each malformed in one way, must be refused with a
 * message that names the file and the problem; and thousands of random mutants of the fixture
 * must each open or be refused, never crash, hang or leak (the ASan build checks the last).
 * It needs no device; each case runs once, on cpu:0 by name only. Cases that need the fixture
 * skip when the gguf package (and so the fixture) is absent. */
#include "harness.h"

#include "gguf.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <sys/stat.h>

/* ---- Files -------------------------------------------------------------------------------- */

static char tmp_file[512]; /* this process's scratch file, removed at the end of each case */

static const char *scratch_path(void) {
  if (!tmp_file[0]) {
    const char *dir = getenv("TMPDIR");
    int fd;
    snprintf(tmp_file, sizeof tmp_file, "%s/tandem-gguf-XXXXXX", dir && *dir ? dir : "/tmp");
    fd = mkstemp(tmp_file);
    CHECK_MSG(fd >= 0, "mkstemp %s: %s", tmp_file, strerror(errno));
    close(fd);
  }
  return tmp_file;
}

static void scratch_remove(void) {
  if (tmp_file[0]) unlink(tmp_file);
  tmp_file[0] = '\0';
}

static void write_file(const char *path, const void *p, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  CHECK_MSG(fd >= 0, "open %s: %s", path, strerror(errno));
  CHECK(n == 0 || write(fd, p, n) == (ssize_t)n);
  CHECK(close(fd) == 0);
}

static unsigned char *read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  unsigned char *p;
  long len;
  CHECK_MSG(f != NULL, "fopen %s: %s", path, strerror(errno));
  CHECK(fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0);
  p = malloc((size_t)len + 1);
  CHECK(p != NULL && fread(p, 1, (size_t)len, f) == (size_t)len);
  p[len] = '\0';
  fclose(f);
  *n = (size_t)len;
  return p;
}

/* The fixture's path, or a skip when the fixture step wrote none. */
static const char *fixture_path(void) {
  const char *p = getenv("TANDEM_TEST_GGUF");
  struct stat st;
  if (!p || !*p) TH_SKIP("TANDEM_TEST_GGUF is not set (tests/model/gguf.cmake sets it)");
  if (stat(p, &st) != 0)
    TH_SKIP("no fixture %s (the gguf package or the venv's python is missing)", p);
  return p;
}

/* ---- Building files byte by byte ---------------------------------------------------------- */

typedef struct gb {
  unsigned char *p;
  size_t len, cap;
} gb;

static void gb_put(gb *b, const void *p, size_t n) {
  if (b->len + n > b->cap) {
    b->cap = (b->len + n) * 2 + 64;
    CHECK((b->p = realloc(b->p, b->cap)) != NULL);
  }
  memcpy(b->p + b->len, p, n);
  b->len += n;
}

static size_t gb_u8(gb *b, uint8_t v) { gb_put(b, &v, 1); return b->len - 1; }
static size_t gb_u32(gb *b, uint32_t v) {
  unsigned char x[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                        (unsigned char)(v >> 24)};
  gb_put(b, x, 4);
  return b->len - 4;
}
static size_t gb_u64(gb *b, uint64_t v) {
  gb_u32(b, (uint32_t)v);
  gb_u32(b, (uint32_t)(v >> 32));
  return b->len - 8;
}
static size_t gb_str(gb *b, const char *s) { /* returns where its length field is */
  size_t at = gb_u64(b, strlen(s));
  gb_put(b, s, strlen(s));
  return at;
}
static void gb_pad(gb *b, size_t align) {
  while (b->len % align) gb_u8(b, 0);
}

static void patch_u32(unsigned char *p, size_t at, uint32_t v) {
  for (int i = 0; i < 4; i++) p[at + i] = (unsigned char)(v >> (8 * i));
}
static void patch_u64(unsigned char *p, size_t at, uint64_t v) {
  for (int i = 0; i < 8; i++) p[at + i] = (unsigned char)(v >> (8 * i));
}

/* What the small file may vary: names (to duplicate one), its alignment key, a nested array. */
typedef struct opts {
  const char *tensor[2];
  const char *key[4];  /* architecture, alignment (NULL: no key), tokens, flag */
  int align_is_string; /* general.alignment as a string, not a u32 */
  uint32_t align;
  int nest;            /* > 0: a key "test.nested", arrays nested this deep */
} opts;

static const opts base_opts = {{"a.weight", "b.weight"},
                               {"general.architecture", "general.alignment",
                                "tokenizer.ggml.tokens", "test.flag"},
                               0, 32, 0};

/* Where each field of the small file is, for the cases that break one. */
typedef struct layout {
  size_t n_tensors, n_kv, key0_len, arch_len, align_type, align_value, tokens_count,
      token0_len, flag_value, nested_type, t0_name_len, t0_ndim, t0_dim0, t0_dim1, t0_type,
      t0_offset, t1_offset, data;
} layout;

/* A valid GGUF v3 file: 4 or 5 keys, then a 2x8 F32 tensor and a 4-element F16 one, with no
 * padding after the last tensor (so that every truncation breaks it). */
static void build(gb *b, layout *L, const opts *o) {
  int nkv = 3 + (o->key[1] != NULL) + (o->nest > 0);
  memset(b, 0, sizeof *b);
  gb_put(b, "GGUF", 4);
  gb_u32(b, 3);
  L->n_tensors = gb_u64(b, 2);
  L->n_kv = gb_u64(b, (uint64_t)nkv);
  L->key0_len = gb_str(b, o->key[0]);
  gb_u32(b, TDM_GGUF_STRING);
  L->arch_len = gb_str(b, "qwen3moe");
  if (o->key[1]) {
    gb_str(b, o->key[1]);
    L->align_type = gb_u32(b, o->align_is_string ? TDM_GGUF_STRING : TDM_GGUF_U32);
    L->align_value = o->align_is_string ? gb_str(b, "32") : gb_u32(b, o->align);
  }
  gb_str(b, o->key[2]);
  gb_u32(b, TDM_GGUF_ARRAY);
  gb_u32(b, TDM_GGUF_STRING);
  L->tokens_count = gb_u64(b, 2);
  L->token0_len = gb_str(b, "a");
  gb_str(b, "bc");
  gb_str(b, o->key[3]);
  gb_u32(b, TDM_GGUF_BOOL);
  L->flag_value = gb_u8(b, 1);
  if (o->nest > 0) {
    gb_str(b, "test.nested");
    L->nested_type = gb_u32(b, TDM_GGUF_ARRAY);
    for (int d = 1; d < o->nest; d++) { /* an array holding one array, ... */
      gb_u32(b, TDM_GGUF_ARRAY);
      gb_u64(b, 1);
    }
    gb_u32(b, TDM_GGUF_I32); /* ... holding two i32 */
    gb_u64(b, 2);
    gb_u32(b, 7);
    gb_u32(b, 8);
  }
  L->t0_name_len = gb_str(b, o->tensor[0]);
  L->t0_ndim = gb_u32(b, 2);
  L->t0_dim0 = gb_u64(b, 8);
  L->t0_dim1 = gb_u64(b, 2);
  L->t0_type = gb_u32(b, TDM_MF_F32);
  L->t0_offset = gb_u64(b, 0);
  gb_str(b, o->tensor[1]);
  gb_u32(b, 1);
  gb_u64(b, 4);
  gb_u32(b, TDM_MF_F16);
  L->t1_offset = gb_u64(b, 64);
  gb_pad(b, o->key[1] && !o->align_is_string && o->align ? o->align : 32);
  L->data = b->len;
  for (int i = 0; i < 64 + 8; i++) gb_u8(b, (uint8_t)i);
}

/* ---- Checking outcomes -------------------------------------------------------------------- */

/* Opens path; returns the code, with the message in msg. *g is set only on success. */
static int try_open(const char *path, tdm_gguf **g, char *msg, size_t cap) {
  tdm_gguf *const sentinel = (tdm_gguf *)&tmp_file;
  tdm_gguf *h = sentinel;
  int rc;
  tdm_clear_error();
  rc = tdm_gguf_open(path, &h);
  snprintf(msg, cap, "%s", tdm_last_error());
  if (rc != 0) CHECK_MSG(h == sentinel, "a failed open wrote *out (rc %d)", rc);
  *g = rc == 0 ? h : NULL;
  return rc;
}

/* The bytes must be refused with `code`, and a message that starts with the code's name,
 * names the file and says each of the (up to two) words given. */
static void expect_refused(const void *p, size_t n, int code, const char *say, const char *say2) {
  const char *path = scratch_path();
  char msg[1600];
  tdm_gguf *g;
  int rc;
  write_file(path, p, n);
  rc = try_open(path, &g, msg, sizeof msg);
  if (rc == 0) tdm_gguf_close(g);
  CHECK_MSG(rc == code, "%zu bytes: got %s, want %s; message: %s", n, tdm_err_name(rc),
            tdm_err_name(code), msg);
  CHECK_MSG(th_message_fits(msg, rc, NULL), "message does not start with the code: %s", msg);
  CHECK_MSG(strstr(msg, path) != NULL, "message does not name the file: %s", msg);
  CHECK_MSG(!say || strstr(msg, say), "message does not say \"%s\": %s", say, msg);
  CHECK_MSG(!say2 || strstr(msg, say2), "message does not say \"%s\": %s", say2, msg);
  printf("  refused: %s\n", msg);
}

static tdm_gguf *open_ok(const void *p, size_t n) {
  const char *path = scratch_path();
  char msg[1600];
  tdm_gguf *g;
  write_file(path, p, n);
  CHECK_MSG(try_open(path, &g, msg, sizeof msg) == 0, "open failed: %s", msg);
  return g;
}

/* ---- The fixture against its sidecar ------------------------------------------------------ */

static uint64_t fnv1a(const unsigned char *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

static cJSON *load_sidecar(const char *gguf_path) {
  char path[1024];
  size_t n, len = strlen(gguf_path);
  unsigned char *text;
  cJSON *j;
  CHECK(len > 5 && len < sizeof path);
  snprintf(path, sizeof path, "%.*s.json", (int)(len - 5), gguf_path);
  text = read_file(path, &n);
  j = cJSON_Parse((const char *)text);
  free(text);
  CHECK_MSG(j != NULL, "cannot parse %s", path);
  return j;
}

static const char *jstr(const cJSON *o, const char *name) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
  CHECK_MSG(cJSON_IsString(v), "sidecar: no string %s", name);
  return v->valuestring;
}

/* An integer written as a decimal string: its value as u64 and whether it is negative. */
static uint64_t jint(const cJSON *v, int *negative) {
  CHECK(cJSON_IsString(v));
  *negative = v->valuestring[0] == '-';
  return *negative ? (uint64_t)strtoll(v->valuestring, NULL, 10)
                   : strtoull(v->valuestring, NULL, 10);
}

static void check_int(tdm_gguf *g, const char *key, const cJSON *v) {
  int neg;
  uint64_t u = jint(v, &neg), gu;
  int64_t gi;
  double f;
  if (neg) {
    CHECK_RC(tdm_gguf_get_u64(g, key, &gu), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "negative"));
  } else {
    CHECK_OK(tdm_gguf_get_u64(g, key, &gu));
    CHECK_MSG(gu == u, "%s: %llu != %llu", key, (unsigned long long)gu, (unsigned long long)u);
  }
  if (!neg && u > (uint64_t)INT64_MAX) {
    CHECK_RC(tdm_gguf_get_i64(g, key, &gi), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "does not fit"));
  } else {
    CHECK_OK(tdm_gguf_get_i64(g, key, &gi));
    CHECK_MSG(gi == (int64_t)u, "%s: %lld", key, (long long)gi);
  }
  CHECK_OK(tdm_gguf_get_f64(g, key, &f));
  CHECK(f == (neg ? (double)(int64_t)u : (double)u));
  CHECK_RC(tdm_gguf_get_str(g, key, NULL, NULL), TDM_EINVAL);
  CHECK(strstr(tdm_last_error(), "not a string") && strstr(tdm_last_error(), key));
  CHECK_RC(tdm_gguf_get_bool(g, key, NULL), TDM_EINVAL);
}

static void check_array(tdm_gguf *g, const char *key, const cJSON *e) {
  const char *et = jstr(e, "elem_type");
  const cJSON *vals = cJSON_GetObjectItemCaseSensitive(e, "values");
  uint64_t count, n = (uint64_t)cJSON_GetArraySize(vals);
  int type;
  CHECK_OK(tdm_gguf_get_array(g, key, &type, &count));
  CHECK_MSG(strcmp(tdm_gguf_type_name(type), et) == 0, "%s: elements %s", key, et);
  CHECK_EQ(count, n);
  for (uint64_t i = 0; i < n; i++) {
    const cJSON *v = cJSON_GetArrayItem(vals, (int)i);
    int64_t x;
    double f;
    const char *s;
    size_t len;
    if (type == TDM_GGUF_STRING) {
      CHECK_OK(tdm_gguf_array_str(g, key, i, &s, &len));
      CHECK_MSG(len == strlen(v->valuestring) && memcmp(s, v->valuestring, len) == 0,
                "%s[%llu]: \"%.*s\"", key, (unsigned long long)i, (int)len, s);
    } else if (type == TDM_GGUF_F32 || type == TDM_GGUF_F64) {
      CHECK_OK(tdm_gguf_array_f64(g, key, i, &f));
      CHECK_MSG(f == v->valuedouble, "%s[%llu]: %.17g", key, (unsigned long long)i, f);
      CHECK_RC(tdm_gguf_array_i64(g, key, i, &x), TDM_EINVAL);
    } else if (type == TDM_GGUF_BOOL) {
      CHECK_OK(tdm_gguf_array_i64(g, key, i, &x));
      CHECK_EQ(x, cJSON_IsTrue(v));
    } else if (type == TDM_GGUF_ARRAY) { /* elements of nested arrays are not read */
      CHECK_RC(tdm_gguf_array_i64(g, key, i, &x), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "array of array"));
      CHECK_RC(tdm_gguf_array_str(g, key, i, &s, &len), TDM_EINVAL);
    } else {
      int neg;
      uint64_t u = jint(v, &neg);
      if (!neg && u > (uint64_t)INT64_MAX) {
        CHECK_RC(tdm_gguf_array_i64(g, key, i, &x), TDM_EINVAL);
      } else {
        CHECK_OK(tdm_gguf_array_i64(g, key, i, &x));
        CHECK_EQ(x, (int64_t)u);
      }
      CHECK_OK(tdm_gguf_array_f64(g, key, i, &f));
      CHECK(f == (neg ? (double)(int64_t)u : (double)u));
    }
  }
  CHECK_RC(tdm_gguf_array_i64(g, key, n, NULL), type == TDM_GGUF_STRING || type == TDM_GGUF_ARRAY ||
           type == TDM_GGUF_F32 || type == TDM_GGUF_F64 ? TDM_EINVAL : TDM_ERANGE);
  if (type == TDM_GGUF_STRING) {
    const char *s;
    size_t len;
    CHECK_RC(tdm_gguf_array_str(g, key, n, &s, &len), TDM_ERANGE);
    CHECK(strstr(tdm_last_error(), "past the array's end"));
  }
}

static void check_kv(tdm_gguf *g, size_t i, const cJSON *e) {
  const char *key = jstr(e, "key"), *type = jstr(e, "type"), *got, *s;
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(e, "value");
  int t, b;
  double f;
  size_t len;
  CHECK_OK(tdm_gguf_key_at(g, i, &got, &t));
  CHECK_MSG(strcmp(got, key) == 0, "key #%zu is %s, want %s", i, got, key);
  CHECK_MSG(strcmp(tdm_gguf_type_name(t), type) == 0, "%s has type %s, want %s", key,
            tdm_gguf_type_name(t), type);
  if (t == TDM_GGUF_STRING) {
    CHECK_OK(tdm_gguf_get_str(g, key, &s, &len));
    CHECK(len == strlen(v->valuestring) && memcmp(s, v->valuestring, len) == 0 && !s[len]);
    CHECK_RC(tdm_gguf_get_u64(g, key, NULL), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "has type string, not an integer"));
  } else if (t == TDM_GGUF_BOOL) {
    uint64_t u;
    CHECK_OK(tdm_gguf_get_bool(g, key, &b));
    CHECK_EQ(b, cJSON_IsTrue(v));
    CHECK_OK(tdm_gguf_get_u64(g, key, &u));
    CHECK_EQ(u, cJSON_IsTrue(v));
    CHECK_RC(tdm_gguf_get_f64(g, key, &f), TDM_EINVAL);
  } else if (t == TDM_GGUF_F32 || t == TDM_GGUF_F64) {
    CHECK_OK(tdm_gguf_get_f64(g, key, &f));
    CHECK_MSG(f == v->valuedouble, "%s: %.17g != %.17g", key, f, v->valuedouble);
    CHECK_RC(tdm_gguf_get_i64(g, key, NULL), TDM_EINVAL);
  } else if (t == TDM_GGUF_ARRAY) {
    check_array(g, key, e);
    CHECK_RC(tdm_gguf_get_u64(g, key, NULL), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "is an array of"));
  } else {
    check_int(g, key, v);
  }
  if (t != TDM_GGUF_ARRAY) CHECK_RC(tdm_gguf_get_array(g, key, NULL, NULL), TDM_EINVAL);
}

static void check_tensor(tdm_gguf *g, size_t i, const cJSON *e, uint64_t align) {
  const tdm_mf_tensor *t = tdm_gguf_tensor_at(g, i);
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
  const char *name = jstr(e, "name");
  const void *base;
  size_t size;
  int64_t n = 1;
  char hex[20];
  CHECK(t != NULL);
  CHECK_MSG(strcmp(t->name, name) == 0, "tensor #%zu is %s, want %s", i, t->name, name);
  CHECK(tdm_gguf_tensor_find(g, name) == t);
  CHECK_EQ(t->type, cJSON_GetObjectItemCaseSensitive(e, "type")->valueint);
  CHECK(strcmp(tdm_mf_type_name(t->type), jstr(e, "type_name")) == 0);
  CHECK_EQ(t->ndim, cJSON_GetArraySize(shape));
  for (int d = 0; d < t->ndim; d++) {
    CHECK_EQ(t->shape[d], cJSON_GetArrayItem(shape, d)->valueint);
    n *= t->shape[d];
  }
  CHECK_EQ(tdm_mf_elements(t), n);
  CHECK_EQ(t->bytes, cJSON_GetObjectItemCaseSensitive(e, "bytes")->valuedouble);
  tdm_gguf_mapping(g, &base, &size);
  CHECK((const char *)t->data >= (const char *)base &&
        (size_t)((const char *)t->data - (const char *)base) + t->bytes <= size);
  CHECK_MSG((size_t)((const char *)t->data - (const char *)base) % align == 0,
            "%s: data at file offset %zu is not %llu-aligned", name,
            (size_t)((const char *)t->data - (const char *)base), (unsigned long long)align);
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fnv1a(t->data, t->bytes));
  CHECK_MSG(strcmp(hex, jstr(e, "fnv1a")) == 0, "%s: data FNV-1a %s, want %s", name, hex,
            jstr(e, "fnv1a"));
}

TEST_CASE(fixture_matches_sidecar) {
  const char *path = fixture_path();
  cJSON *side = load_sidecar(path);
  const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(side, "kv");
  const cJSON *ts = cJSON_GetObjectItemCaseSensitive(side, "tensors");
  uint64_t align = (uint64_t)cJSON_GetObjectItemCaseSensitive(side, "alignment")->valuedouble;
  char msg[1600];
  tdm_gguf *g;
  CHECK_MSG(try_open(path, &g, msg, sizeof msg) == 0, "%s", msg);
  CHECK_EQ(tdm_gguf_version(g), cJSON_GetObjectItemCaseSensitive(side, "version")->valueint);
  CHECK(strcmp(tdm_gguf_path(g), path) == 0);
  CHECK_EQ(tdm_gguf_key_count(g), cJSON_GetArraySize(kvs));
  for (size_t i = 0; i < tdm_gguf_key_count(g); i++)
    check_kv(g, i, cJSON_GetArrayItem(kvs, (int)i));
  CHECK_RC(tdm_gguf_key_at(g, tdm_gguf_key_count(g), NULL, NULL), TDM_ERANGE);
  CHECK_EQ(tdm_gguf_tensor_count(g), cJSON_GetArraySize(ts));
  for (size_t i = 0; i < tdm_gguf_tensor_count(g); i++)
    check_tensor(g, i, cJSON_GetArrayItem(ts, (int)i), align);
  CHECK(tdm_gguf_tensor_at(g, tdm_gguf_tensor_count(g)) == NULL);
  CHECK(tdm_gguf_tensor_find(g, "blk.0") == NULL && tdm_gguf_tensor_find(g, "") == NULL);
  CHECK(tdm_gguf_tensor_find(g, "blk.0.attn_q.weightx") == NULL);
  CHECK_RC(tdm_gguf_get_u64(g, "no.such.key", NULL), TDM_ENOENT);
  CHECK(strstr(tdm_last_error(), "no.such.key") && strstr(tdm_last_error(), path));
  tdm_gguf_close(g);
  cJSON_Delete(side);
}

/* The C table against the gguf package's GGML_QUANT_SIZES, by name and number. */
TEST_CASE(block_sizes_match_package) {
  cJSON *side = load_sidecar(fixture_path());
  const cJSON *sizes = cJSON_GetObjectItemCaseSensitive(side, "block_sizes");
  const cJSON *nums = cJSON_GetObjectItemCaseSensitive(side, "type_numbers");
  int known = 0;
  for (int type = 0; type < 64; type++) {
    int block, bytes, found = 0;
    const cJSON *e;
    if (tdm_mf_type_block(type, &block, &bytes) != 0) {
      CHECK(strcmp(tdm_mf_type_name(type), "?") == 0);
      continue;
    }
    known++;
    cJSON_ArrayForEach(e, nums) {
      if (e->valueint != type) continue;
      const cJSON *s = cJSON_GetObjectItemCaseSensitive(sizes, e->string);
      found = 1;
      CHECK_MSG(strcmp(e->string, tdm_mf_type_name(type)) == 0, "type %d: %s vs %s", type,
                e->string, tdm_mf_type_name(type));
      CHECK_EQ(block, cJSON_GetArrayItem(s, 0)->valueint);
      /* The package gives Q8_1 40 bytes (two f32); ggml's block_q8_1 holds two f16: 36. */
      if (type == TDM_MF_Q8_1)
        CHECK_EQ(bytes, 36);
      else
        CHECK_MSG(bytes == cJSON_GetArrayItem(s, 1)->valueint, "%s: %d bytes, package %d",
                  e->string, bytes, cJSON_GetArrayItem(s, 1)->valueint);
    }
    CHECK_MSG(found, "type %d (%s) is not in the gguf package", type, tdm_mf_type_name(type));
  }
  CHECK_EQ(known, 21);
  cJSON_Delete(side);
}

/* The model library's dequantization of Q8_0, Q4_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1 and
 * Q5_K blocks (model/quant.c) against the gguf package's (gguf.quants) on random blocks with
 * edge scales (zero, the largest and smallest f16, E8M0's extremes): the same bits, value for
 * value. */
TEST_CASE(dequant_matches_package) {
  char path[1024];
  snprintf(path, sizeof path, "%s", fixture_path());
  char *slash = strrchr(path, '/');
  snprintf(slash ? slash + 1 : path, sizeof path - (size_t)(slash ? slash + 1 - path : 0),
           "quant-fixture.bin");
  FILE *f = fopen(path, "rb");
  if (!f) TH_SKIP("no %s (the fixture's gguf package is missing)", path);
  char magic[8];
  int32_t sections;
  CHECK(fread(magic, 1, 8, f) == 8 && memcmp(magic, "TNDQNT01", 8) == 0);
  CHECK(fread(&sections, sizeof sections, 1, f) == 1 && sections == 9);
  int seen[9] = {0};
  for (int s = 0; s < sections; s++) {
    int32_t hdr[2];
    CHECK(fread(hdr, sizeof hdr, 1, f) == 1);
    int type = hdr[0], n = hdr[1], block = 0, bytes = 0;
    CHECK(tdm_mf_dequant_type(type) && n > 0 && n < 100000);
    CHECK_OK(tdm_mf_type_block(type, &block, &bytes));
    size_t nv = (size_t)n * block;
    uint8_t *raw = malloc((size_t)n * bytes);
    float *want = malloc(nv * sizeof *want), *got = malloc(nv * sizeof *got);
    CHECK(raw && want && got);
    CHECK(fread(raw, (size_t)bytes, (size_t)n, f) == (size_t)n);
    CHECK(fread(want, sizeof *want, nv, f) == nv);
    for (size_t i = 0; i < nv; i++) got[i] = NAN;
    CHECK_OK(tdm_mf_dequant(type, raw, (size_t)n, got));
    int finite = 0;
    for (size_t i = 0; i < nv; i++) {
      CHECK_MSG(memcmp(&got[i], &want[i], sizeof got[i]) == 0, "%s block %zu value %zu: %.9g, "
                "gguf.quants %.9g", tdm_mf_type_name(type), i / (size_t)block,
                i % (size_t)block, got[i], want[i]);
      finite += isfinite(got[i]) && got[i] != 0.0f;
    }
    CHECK(finite > (int)(nv / 2)); /* random blocks, not zeros */
    printf("%s: %d blocks (%zu values) bitwise gguf.quants' dequantization\n",
           tdm_mf_type_name(type), n, nv);
    seen[s] = type;
    free(raw); free(want); free(got);
  }
  static const int want[9] = {TDM_MF_Q8_0, TDM_MF_Q4_K, TDM_MF_Q6_K, TDM_MF_MXFP4, TDM_MF_Q4_0,
                              TDM_MF_Q4_1, TDM_MF_Q5_0, TDM_MF_Q5_1, TDM_MF_Q5_K};
  for (int s = 0; s < 9; s++) CHECK_EQ(seen[s], want[s]);
  uint8_t none[4] = {0};
  float out[2];
  CHECK_EQ(tdm_mf_dequant(TDM_MF_F16, none, 1, out), -1); /* not a block type it widens */
  CHECK(!tdm_mf_dequant_type(TDM_MF_Q3_K) && !tdm_mf_dequant_type(TDM_MF_BF16));
  fclose(f);
}

/* ---- Small files built here --------------------------------------------------------------- */

TEST_CASE(small_file_reads) {
  gb b;
  layout L;
  opts o = base_opts;
  const tdm_mf_tensor *t;
  const char *s;
  size_t len;
  int64_t x;
  for (int with_key = 1; with_key >= 0; with_key--) {
    o.key[1] = with_key ? "general.alignment" : NULL; /* without: the default, 32 */
    build(&b, &L, &o);
    tdm_gguf *g = open_ok(b.p, b.len);
    CHECK_EQ(tdm_gguf_tensor_count(g), 2);
    CHECK_EQ(tdm_gguf_key_count(g), 3 + with_key);
    t = tdm_gguf_tensor_find(g, "a.weight");
    CHECK(t && t->type == TDM_MF_F32 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 8);
    CHECK(t->bytes == 64 && ((const unsigned char *)t->data)[0] == 0);
    t = tdm_gguf_tensor_find(g, "b.weight");
    CHECK(t && t->type == TDM_MF_F16 && t->ndim == 1 && t->shape[0] == 4 && t->bytes == 8);
    CHECK(((const unsigned char *)t->data)[0] == 64);
    CHECK_OK(tdm_gguf_array_str(g, "tokenizer.ggml.tokens", 1, &s, &len));
    CHECK(len == 2 && memcmp(s, "bc", 2) == 0);
    CHECK_RC(tdm_gguf_array_i64(g, "tokenizer.ggml.tokens", 0, &x), TDM_EINVAL);
    CHECK(strstr(tdm_last_error(), "is an array of string, not an array of integers"));
    tdm_gguf_close(g);
    free(b.p);
  }
  scratch_remove();
}

TEST_CASE(truncated_everywhere) {
  gb b;
  layout L;
  build(&b, &L, &base_opts);
  /* A count checked against the bytes left says so ("more than the file can hold"). */
  for (size_t n = 0; n < b.len; n++) {
    expect_refused(b.p, n, TDM_EINVAL, NULL, NULL);
    const char *msg = tdm_last_error();
    CHECK_MSG(n < 24 ? strstr(msg, "shorter than a GGUF header") != NULL
                     : strstr(msg, "past the end of the file") || strstr(msg, "can hold"),
              "truncated to %zu bytes: %s", n, msg);
  }
  tdm_gguf_close(open_ok(b.p, b.len));
  free(b.p);
  scratch_remove();
}

/* The small file with the field at byte `at` overwritten (width 4 or 8). */
static void refuse_field(size_t at, int width, uint64_t v, const opts *o, const char *say,
                         const char *say2) {
  gb b;
  layout L;
  build(&b, &L, o ? o : &base_opts);
  if (width == 4)
    patch_u32(b.p, at, (uint32_t)v);
  else
    patch_u64(b.p, at, v);
  expect_refused(b.p, b.len, TDM_EINVAL, say, say2);
  free(b.p);
}

/* Where a field is, in the small file built with o. */
static layout where(const opts *o) {
  gb b;
  layout L;
  build(&b, &L, o ? o : &base_opts);
  free(b.p);
  return L;
}

TEST_CASE(bad_magic_and_versions) {
  layout L;
  refuse_field(0, 4, 0x58554747, NULL, "not a GGUF file", "GGUX");      /* "GGUX" */
  refuse_field(0, 4, 0x47475546, NULL, "not a GGUF file", "big-endian"); /* "FUGG" */
  refuse_field(4, 4, 1, NULL, "version 1 is not supported", NULL);
  refuse_field(4, 4, 4, NULL, "unknown GGUF version 4", NULL);
  refuse_field(4, 4, 0, NULL, "unknown GGUF version 0", NULL);
  refuse_field(4, 4, 0x03000000, NULL, "big-endian", "little-endian files");
  /* Version 2 has the same layout as 3 and is read. */
  {
    gb b;
    build(&b, &L, &base_opts);
    patch_u32(b.p, 4, 2);
    tdm_gguf *g = open_ok(b.p, b.len);
    CHECK_EQ(tdm_gguf_version(g), 2);
    tdm_gguf_close(g);
    free(b.p);
  }
  scratch_remove();
}

TEST_CASE(bad_alignment) {
  layout L = where(NULL);
  opts o = base_opts;
  refuse_field(L.align_value, 4, 0, NULL, "general.alignment is 0", "not a power of two");
  refuse_field(L.align_value, 4, 3, NULL, "general.alignment is 3", "not a power of two");
  refuse_field(L.align_value, 4, 48, NULL, "not a power of two", NULL);
  o.align_is_string = 1;
  L = where(&o);
  refuse_field(L.n_kv, 8, 4, &o, "key general.alignment has type string, not an integer",
               NULL);
  scratch_remove();
}

TEST_CASE(bad_tensor_offsets) {
  layout L = where(NULL);
  refuse_field(L.t1_offset, 8, 96, NULL, "tensor b.weight: data [offset 96, 8 bytes]",
               "runs past the end of the file");
  refuse_field(L.t1_offset, 8, 4, NULL, "tensor b.weight: data offset 4",
               "not a multiple of the alignment (32)");
  refuse_field(L.t0_offset, 8, UINT64_MAX - 31, NULL, "tensor a.weight", "past the end");
  refuse_field(L.t0_offset, 8, (uint64_t)1 << 62, NULL, "tensor a.weight", "past the end");
  scratch_remove();
}

TEST_CASE(bad_dims) {
  layout L = where(NULL);
  refuse_field(L.t0_dim0, 8, (uint64_t)1 << 32, NULL, NULL, NULL); /* 8 KiB x 2: past end */
  {
    gb b;
    build(&b, &L, &base_opts);
    patch_u64(b.p, L.t0_dim0, (uint64_t)1 << 40);
    patch_u64(b.p, L.t0_dim1, (uint64_t)1 << 40);
    expect_refused(b.p, b.len, TDM_EINVAL, "tensor a.weight", "overflows 64 bits");
    patch_u64(b.p, L.t0_dim0, (uint64_t)1 << 62);
    patch_u64(b.p, L.t0_dim1, 1);
    expect_refused(b.p, b.len, TDM_EINVAL, "tensor a.weight", "size in bytes overflows");
    free(b.p);
  }
  refuse_field(L.t0_dim0, 8, 0, NULL, "tensor a.weight: dimension 0 is 0", NULL);
  refuse_field(L.t0_dim1, 8, UINT64_MAX, NULL, "dimension 1 is 18446744073709551615", NULL);
  refuse_field(L.t0_ndim, 4, 5, NULL, "tensor a.weight: has 5 dimensions", NULL);
  refuse_field(L.t0_ndim, 4, 0, NULL, "has 0 dimensions", NULL);
  scratch_remove();
}

TEST_CASE(bad_tensor_types) {
  layout L = where(NULL);
  refuse_field(L.t0_type, 4, 99, NULL, "tensor a.weight: unknown tensor type 99", NULL);
  refuse_field(L.t0_type, 4, 16, NULL, "unknown tensor type 16", NULL); /* IQ2_XXS: not read */
  refuse_field(L.t0_type, 4, TDM_MF_Q8_0, NULL, "a row of 8 elements", "Q8_0 blocks");
  scratch_remove();
}

TEST_CASE(huge_counts) {
  layout L = where(NULL);
  const uint64_t huge[] = {(uint64_t)1 << 62, (uint64_t)1 << 63, UINT64_MAX, 1u << 20};
  for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
    refuse_field(L.n_tensors, 8, huge[i], NULL, "tensors, more than the rest of the file", NULL);
    refuse_field(L.n_kv, 8, huge[i], NULL, "metadata keys, more than the file", NULL);
    refuse_field(L.tokens_count, 8, huge[i], NULL, "key tokenizer.ggml.tokens: array of",
                 "runs past the end");
  }
  refuse_field(L.n_tensors, 8, 3, NULL, "tensor #2 (empty name)", NULL); /* reads padding */
  scratch_remove();
}

TEST_CASE(string_lengths_past_end) {
  layout L = where(NULL);
  const uint64_t lens[] = {(uint64_t)1 << 62, UINT64_MAX, 100000};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    refuse_field(L.key0_len, 8, lens[i], NULL, "key #0: key at offset 24", "past the end");
    refuse_field(L.arch_len, 8, lens[i], NULL, "key general.architecture: string value",
                 "past the end");
    refuse_field(L.token0_len, 8, lens[i], NULL, "key tokenizer.ggml.tokens: string element",
                 "past the end");
    refuse_field(L.t0_name_len, 8, lens[i], NULL, "tensor #0: name", "past the end");
  }
  scratch_remove();
}

TEST_CASE(duplicates) {
  opts o = base_opts;
  gb b;
  layout L;
  o.tensor[1] = "a.weight";
  build(&b, &L, &o);
  expect_refused(b.p, b.len, TDM_EINVAL, "tensor a.weight appears twice", "#0 and #1");
  free(b.p);
  o = base_opts;
  o.key[3] = "general.architecture";
  build(&b, &L, &o);
  expect_refused(b.p, b.len, TDM_EINVAL, "key general.architecture appears twice", "#0 and #3");
  free(b.p);
  scratch_remove();
}

TEST_CASE(bad_values) {
  layout L = where(NULL);
  opts o = base_opts;
  refuse_field(L.arch_len - 4, 4, 13, NULL, "key general.architecture: unknown value type 13",
               NULL);
  refuse_field(L.tokens_count - 4, 4, 77, NULL, "unknown array element type 77", NULL);
  gb b;
  build(&b, &L, &base_opts);
  b.p[L.flag_value] = 2;
  expect_refused(b.p, b.len, TDM_EINVAL, "key test.flag: bool value is 2", NULL);
  free(b.p);
  o.nest = 3;
  L = where(&o);
  /* value type, its element type, count; the first inner array's type: */
  refuse_field(L.nested_type + 4, 4, 200, &o, "unknown array element type 200", NULL);
  refuse_field(L.nested_type + 16, 4, 200, &o, "unknown inner array element type 200", NULL);
  /* A NUL in a key or tensor name: it could not be looked up. */
  build(&b, &L, &base_opts);
  b.p[L.key0_len + 8 + 3] = 0;
  expect_refused(b.p, b.len, TDM_EINVAL, "key gen?ral.architecture: its name holds a NUL", NULL);
  b.p[L.key0_len + 8 + 3] = 'e';
  b.p[L.t0_name_len + 8] = 0;
  expect_refused(b.p, b.len, TDM_EINVAL, "tensor ?.weight: its name holds a NUL byte", NULL);
  free(b.p);
  scratch_remove();
}

/* Arrays of arrays are accepted (a writer may use them) but their elements are not read. */
TEST_CASE(nested_arrays) {
  opts o = base_opts;
  gb b;
  layout L;
  for (int depth = 2; depth <= 10; depth++) {
    o.nest = depth;
    build(&b, &L, &o);
    if (depth <= 8) {
      int type;
      uint64_t count;
      int64_t x;
      tdm_gguf *g = open_ok(b.p, b.len);
      CHECK_OK(tdm_gguf_get_array(g, "test.nested", &type, &count));
      CHECK(type == TDM_GGUF_ARRAY && count == 1);
      CHECK_RC(tdm_gguf_array_i64(g, "test.nested", 0, &x), TDM_EINVAL);
      CHECK(strstr(tdm_last_error(), "key test.nested is an array of array"));
      CHECK(tdm_gguf_tensor_find(g, "b.weight") != NULL); /* what follows is read */
      tdm_gguf_close(g);
    } else {
      expect_refused(b.p, b.len, TDM_EINVAL, "key test.nested: arrays nested more than 8", NULL);
    }
    free(b.p);
  }
  scratch_remove();
}

TEST_CASE(open_errors) {
  char msg[1600], dir[600], fifo[600];
  const char *missing = "/nonexistent-tandem-dir/model.gguf";
  tdm_gguf *g;
  CHECK_EQ(try_open(missing, &g, msg, sizeof msg), TDM_ENOENT);
  CHECK(strstr(msg, missing) && strstr(msg, "open failed") && tdm_last_native_error() == ENOENT);
  snprintf(dir, sizeof dir, "%s.d", scratch_path());
  CHECK(mkdir(dir, 0700) == 0);
  CHECK_EQ(try_open(dir, &g, msg, sizeof msg), TDM_EINVAL);
  CHECK(strstr(msg, dir) && strstr(msg, "is a directory"));
  rmdir(dir);
  snprintf(fifo, sizeof fifo, "%s.fifo", scratch_path());
  CHECK(mkfifo(fifo, 0600) == 0);
  CHECK_EQ(try_open(fifo, &g, msg, sizeof msg), TDM_EINVAL); /* and does not block */
  CHECK(strstr(msg, "not a regular file"));
  unlink(fifo);
  expect_refused("", 0, TDM_EINVAL, "the file is 0 bytes", "shorter than a GGUF header");
  expect_refused("GGUF\3\0\0\0", 8, TDM_EINVAL, "the file is 8 bytes", NULL);
  CHECK_RC(tdm_gguf_open(NULL, &g), TDM_EINVAL);
  CHECK_RC(tdm_gguf_open(missing, NULL), TDM_EINVAL);
  tdm_gguf_close(NULL);
  scratch_remove();
}

/* A vocabulary of 150k tokens and 20k tensors: opening stays fast, and lookups do too. */
TEST_CASE(big_tables) {
  enum { TOKENS = 150000, TENSORS = 20000 };
  struct timespec t0, t1;
  char name[64];
  gb b = {0};
  const char *s;
  size_t len;
  gb_put(&b, "GGUF", 4);
  gb_u32(&b, 3);
  gb_u64(&b, TENSORS);
  gb_u64(&b, 1);
  gb_str(&b, "tokenizer.ggml.tokens");
  gb_u32(&b, TDM_GGUF_ARRAY);
  gb_u32(&b, TDM_GGUF_STRING);
  gb_u64(&b, TOKENS);
  for (int i = 0; i < TOKENS; i++) {
    snprintf(name, sizeof name, "tok%d", i);
    gb_str(&b, name);
  }
  for (int i = 0; i < TENSORS; i++) { /* each a 1-element F32 at its own aligned offset */
    snprintf(name, sizeof name, "blk.%d.w", i);
    gb_str(&b, name);
    gb_u32(&b, 1);
    gb_u64(&b, 1);
    gb_u32(&b, TDM_MF_F32);
    gb_u64(&b, (uint64_t)i * 32);
  }
  gb_pad(&b, 32);
  for (int i = 0; i < TENSORS; i++) {
    float v = (float)i;
    gb_put(&b, &v, 4);
    gb_pad(&b, 32);
  }
  write_file(scratch_path(), b.p, b.len);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  tdm_gguf *g;
  CHECK_OK(tdm_gguf_open(scratch_path(), &g));
  for (int i = 0; i < TENSORS; i++) {
    snprintf(name, sizeof name, "blk.%d.w", i);
    const tdm_mf_tensor *t = tdm_gguf_tensor_find(g, name);
    CHECK(t && *(const float *)t->data == (float)i);
  }
  CHECK_OK(tdm_gguf_array_str(g, "tokenizer.ggml.tokens", TOKENS - 1, &s, &len));
  CHECK(len == 9 && memcmp(s, "tok149999", 9) == 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
  printf("open (%zu bytes) and %d lookups: %.1f ms\n", b.len, TENSORS, ms);
  CHECK_MSG(ms < 5000, "%.1f ms", ms); /* a quadratic reader takes minutes */
  tdm_gguf_close(g);
  free(b.p);
  scratch_remove();
}

/* ---- Mutants ------------------------------------------------------------------------------ */

/* Everything an open file offers, read end to end: every pointer it gives must lie inside the
 * mapping (or be a NUL-terminated copy), and every call must return 0 or a code. */
static uint64_t read_everything(tdm_gguf *g) {
  const unsigned char *base;
  size_t size;
  uint64_t h = 0;
  tdm_gguf_mapping(g, (const void **)&base, &size);
  for (size_t i = 0; i < tdm_gguf_tensor_count(g); i++) {
    const tdm_mf_tensor *t = tdm_gguf_tensor_at(g, i);
    const unsigned char *d = t->data;
    CHECK(d >= base && (size_t)(d - base) <= size && t->bytes <= size - (size_t)(d - base));
    CHECK(tdm_gguf_tensor_find(g, t->name) != NULL);
    CHECK(tdm_mf_elements(t) > 0);
    h ^= fnv1a(d, t->bytes);
  }
  for (size_t i = 0; i < tdm_gguf_key_count(g); i++) {
    const char *key, *s;
    int type, et;
    uint64_t u, count;
    int64_t x;
    double f;
    size_t len;
    CHECK_OK(tdm_gguf_key_at(g, i, &key, &type));
    h += (uint64_t)tdm_gguf_get_u64(g, key, &u) + (uint64_t)tdm_gguf_get_i64(g, key, &x);
    h += (uint64_t)tdm_gguf_get_f64(g, key, &f) + (uint64_t)tdm_gguf_get_bool(g, key, &et);
    if (tdm_gguf_get_str(g, key, &s, &len) == 0) h += fnv1a((const unsigned char *)s, len + 1);
    if (tdm_gguf_get_array(g, key, &et, &count) != 0) continue;
    for (uint64_t j = 0; j < count && j < 64; j++) {
      h += (uint64_t)tdm_gguf_array_i64(g, key, j, &x) + (uint64_t)tdm_gguf_array_f64(g, key, j, &f);
      if (tdm_gguf_array_str(g, key, j, &s, &len) == 0) {
        const unsigned char *p = (const unsigned char *)s;
        CHECK(p >= base && (size_t)(p - base) <= size && len <= size - (size_t)(p - base));
        h ^= fnv1a(p, len);
      }
    }
    CHECK(tdm_gguf_array_i64(g, key, count, &x) != 0);
  }
  return h;
}

/* Where a mutation goes: anywhere before the data section, or near its two ends (the header
 * and scalar keys; the tensor table), where most of what the reader checks lies. Flips in the
 * data section change nothing it checks. */
static size_t mutation_at(uint64_t *st, size_t meta_end, size_t width) {
  size_t span = meta_end - width, near = span < 1536 ? span : 1536;
  switch (th_rand_below(st, 3)) {
    case 0: return (size_t)th_rand_below(st, span);
    case 1: return (size_t)th_rand_below(st, near);
    default: return span - (size_t)th_rand_below(st, near);
  }
}

/* $TANDEM_TEST_GGUF_MUTANTS mutants (4000 by default; more for a soak). */
TEST_CASE(mutants) {
  const char *env = getenv("TANDEM_TEST_GGUF_MUTANTS");
  const int MUTANTS = env && atoi(env) > 0 ? atoi(env) : 4000;
  static const uint64_t big[] = {(uint64_t)1 << 62, (uint64_t)1 << 63, UINT64_MAX,
                                 (uint64_t)1 << 32, 0xffffffffu, 0, 1, 64};
  uint64_t seed = th_seed(), st = seed;
  size_t n, meta_end;
  unsigned char *orig = read_file(fixture_path(), &n), *m = malloc(n);
  const char *path = scratch_path();
  const void *base;
  int opened = 0, refused = 0;
  struct timespec t0, t1;
  tdm_gguf *g;
  char msg[1600];
  CHECK(m != NULL);
  CHECK_OK(tdm_gguf_open(fixture_path(), &g));
  tdm_gguf_mapping(g, &base, NULL);
  meta_end = (size_t)((const unsigned char *)tdm_gguf_tensor_at(g, 0)->data -
                      (const unsigned char *)base);
  tdm_gguf_close(g);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int k = 0; k < MUTANTS; k++) {
    size_t len = n;
    memcpy(m, orig, n);
    switch (th_rand_below(&st, 3)) {
      case 0: len = (size_t)th_rand_below(&st, n); break;
      case 1:
        for (int f = 1 + (int)th_rand_below(&st, 8); f > 0; f--)
          m[mutation_at(&st, meta_end, 1)] ^= (unsigned char)(1u << th_rand_below(&st, 8));
        break;
      default:
        patch_u64(m, mutation_at(&st, meta_end, 8),
                  th_rand_below(&st, 3) == 0 ? th_rand(&st)
                                             : big[th_rand_below(&st, sizeof big / 8)]);
        if (th_rand_below(&st, 4) == 0) len = (size_t)th_rand_below(&st, n);
    }
    write_file(path, m, len);
    int rc = try_open(path, &g, msg, sizeof msg);
    if (rc == 0) {
      read_everything(g);
      tdm_gguf_close(g);
      opened++;
      continue;
    }
    CHECK_MSG(rc == TDM_EINVAL || rc == TDM_ENOMEM, "mutant %d (seed %llu): %s: %s", k,
              (unsigned long long)seed, tdm_err_name(rc), msg);
    CHECK_MSG(th_message_fits(msg, rc, NULL) && strstr(msg, path), "mutant %d: %s", k, msg);
    refused++;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("%d mutants: %d opened, %d refused, %.2f s\n", MUTANTS, opened, refused,
         (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
  CHECK(refused > MUTANTS / 4 && opened > 0);
  free(m);
  free(orig);
  scratch_remove();
}
