/* test-jsonwriter.c: the JSON writer that the tool and the benchmarks print with
 * (util/json.h), byte for byte: escapes, UTF-8 checking, numbers that are not finite, layout,
 * and what it does when it is misused or its stream fails. It needs no device; each case runs
 * once, on cpu:0 by name only. */
#include "harness.h"

#include "json.h"

#include <math.h>

/* The writer's output so far (a memory stream); free() it. */
typedef struct out {
  FILE *f;
  char *text;
  size_t len;
} out;

static void out_open(out *o) {
  o->text = NULL;
  o->len = 0;
  o->f = open_memstream(&o->text, &o->len);
  CHECK(o->f != NULL);
}

/* Closes the stream and checks what was written. */
static void out_expect(out *o, const char *want) {
  CHECK(fclose(o->f) == 0);
  CHECK_MSG(strcmp(o->text, want) == 0, "wrote\n%s\nwanted\n%s", o->text, want);
  free(o->text);
}

TEST_CASE(escapes) {
  out o;
  bu_json j;
  out_open(&o);
  bu_json_init(&j, o.f, 0);
  bu_json_string(&j, NULL, "q\" b\\ \b\f\n\r\t \x01\x1f \x7f / end");
  CHECK(bu_json_finish(&j) == 0);
  out_expect(&o, "\"q\\\" b\\\\ \\b\\f\\n\\r\\t \\u0001\\u001f \x7f / end\"\n");
}

TEST_CASE(utf8) {
  out o;
  bu_json j;
  out_open(&o);
  bu_json_init(&j, o.f, 1);
  bu_json_array(&j, NULL);
  /* Well-formed: 2, 3 and 4 bytes, the highest code point. */
  bu_json_string(&j, NULL, "\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf");
  /* Not: a lone continuation byte, overlong forms, a surrogate, above U+10FFFF, a byte that
   * never starts one, a sequence cut short by the end of the string. */
  bu_json_string(&j, NULL,
                 "\x80|\xc0\xaf|\xe0\x80\xaf|\xed\xa0\x80|\xf4\x90\x80\x80|\xff|\xe2\x82");
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) == 0);
  out_expect(&o, "[\n"
                 "  \"\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf\",\n"
                 "  \"\\ufffd|\\ufffd\\ufffd|\\ufffd\\ufffd\\ufffd|\\ufffd\\ufffd\\ufffd|"
                 "\\ufffd\\ufffd\\ufffd\\ufffd|\\ufffd|\\ufffd\\ufffd\"\n"
                 "]\n");
}

TEST_CASE(numbers) {
  out o;
  bu_json j;
  out_open(&o);
  bu_json_init(&j, o.f, 0);
  bu_json_array(&j, NULL);
  bu_json_double(&j, NULL, INFINITY, 4);
  bu_json_double(&j, NULL, -INFINITY, -6);
  bu_json_double(&j, NULL, NAN, 2);
  bu_json_double(&j, NULL, 1.0 / 3.0, 4);
  bu_json_double(&j, NULL, 0.01, -6);
  bu_json_double(&j, NULL, 1.5e-5, -4);
  bu_json_double(&j, NULL, 2.0, 0);
  bu_json_int(&j, NULL, -42);
  bu_json_uint(&j, NULL, 18446744073709551615ull);
  bu_json_bool(&j, NULL, true);
  bu_json_bool(&j, NULL, false);
  bu_json_null(&j, NULL);
  bu_json_string(&j, NULL, NULL);
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) == 0);
  out_expect(&o, "[null, null, null, 0.3333, 0.01, 1.5e-05, 2, -42, 18446744073709551615, true, "
                 "false, null, null]\n");
}

TEST_CASE(layout) {
  out o;
  bu_json j;
  out_open(&o);
  bu_json_init(&j, o.f, 2);
  bu_json_object(&j, NULL);
  bu_json_string(&j, "name", "x");
  bu_json_array(&j, "rows");
  bu_json_object(&j, NULL);
  bu_json_int(&j, "a", 1);
  bu_json_array(&j, "b");
  bu_json_end(&j);
  bu_json_object(&j, "c");
  bu_json_end(&j);
  bu_json_end(&j);
  bu_json_object(&j, NULL);
  bu_json_end(&j);
  bu_json_end(&j);
  bu_json_array(&j, "empty");
  bu_json_end(&j);
  bu_json_raw(&j, "raw", "{\"k\": [1, 2]}xyz", 13);
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) == 0);
  out_expect(&o, "{\n"
                 "  \"name\": \"x\",\n"
                 "  \"rows\": [\n"
                 "    {\"a\": 1, \"b\": [], \"c\": {}},\n"
                 "    {}\n"
                 "  ],\n"
                 "  \"empty\": [],\n"
                 "  \"raw\": {\"k\": [1, 2]}\n"
                 "}\n");
}

/* Misuse is reported by bu_json_finish, and what was written still parses. */
TEST_CASE(misuse) {
  out o;
  bu_json j;

  out_open(&o); /* a member without a name, an array element with one */
  bu_json_init(&j, o.f, 0);
  bu_json_object(&j, NULL);
  bu_json_int(&j, NULL, 1);
  bu_json_array(&j, "a");
  bu_json_int(&j, "k", 2);
  bu_json_end(&j);
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) < 0);
  out_expect(&o, "{\"\": 1, \"a\": [2]}\n");

  out_open(&o); /* too deep: the container that does not fit becomes null, its content goes */
  bu_json_init(&j, o.f, 0);
  for (int i = 0; i < BU_JSON_MAX_DEPTH + 3; i++)
    bu_json_array(&j, NULL);
  bu_json_int(&j, NULL, 7);
  for (int i = 0; i < BU_JSON_MAX_DEPTH + 3; i++)
    bu_json_end(&j);
  CHECK(bu_json_finish(&j) < 0);
  char want[3 * BU_JSON_MAX_DEPTH + 8], *p = want;
  for (int i = 0; i < BU_JSON_MAX_DEPTH; i++)
    *p++ = '[';
  p += sprintf(p, "null");
  for (int i = 0; i < BU_JSON_MAX_DEPTH; i++)
    *p++ = ']';
  sprintf(p, "\n");
  out_expect(&o, want);

  out_open(&o); /* left open */
  bu_json_init(&j, o.f, 0);
  bu_json_object(&j, NULL);
  CHECK(bu_json_finish(&j) < 0);
  out_expect(&o, "{");

  out_open(&o); /* closed once too often, a key at the top */
  bu_json_init(&j, o.f, 0);
  bu_json_int(&j, "top", 1);
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) < 0);
  out_expect(&o, "1\n");

  out_open(&o); /* nothing written */
  bu_json_init(&j, o.f, 0);
  CHECK(bu_json_finish(&j) < 0);
  out_expect(&o, "");
}

TEST_CASE(stream_error) {
  FILE *f = fopen("/dev/null", "r"); /* every write fails */
  CHECK(f != NULL);
  bu_json j;
  bu_json_init(&j, f, 0);
  bu_json_object(&j, NULL);
  bu_json_string(&j, "k", "v");
  bu_json_end(&j);
  CHECK(bu_json_finish(&j) < 0);
  fclose(f);
}
