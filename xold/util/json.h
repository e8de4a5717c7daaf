/* json.h: the one JSON writer of the tool and the benchmarks. Whatever it is given, what it
 * writes parses: strings are escaped (quotes, backslashes, control characters; bytes that are
 * not UTF-8 become U+FFFD), numbers that are not finite are written as null, and commas and
 * nesting are its business, not the caller's.
 *
 *   bu_json j;
 *   bu_json_init(&j, stdout, 1);
 *   bu_json_object(&j, NULL);
 *   bu_json_string(&j, "device", "cpu:0");
 *   bu_json_double(&j, "hidden_fraction", hidden, 4);  (null when hidden is inf or NaN)
 *   bu_json_end(&j);
 *   if (bu_json_finish(&j) < 0) ... (misuse, or the stream failed)
 *
 * Every value takes a key: its name inside an object, NULL inside an array or at the top.
 */
#ifndef TANDEM_UTIL_JSON_H
#define TANDEM_UTIL_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

enum { BU_JSON_MAX_DEPTH = 16 };

typedef struct bu_json {
  FILE *f;
  int depth;     /* containers open */
  int flat_from; /* containers opened at this depth or deeper are written on one line */
  bool is_object[BU_JSON_MAX_DEPTH];
  bool has_items[BU_JSON_MAX_DEPTH];
  bool done;     /* the top-level value is complete */
  bool misused;  /* a key where none belongs or none where one does, too deep, unbalanced */
} bu_json;

/* Writes to f, which the caller keeps open until bu_json_finish. Containers opened at depth
 * flat_from or deeper (the top-level value is at depth 0) are written on one line; shallower
 * ones put each member on a line of its own, indented. */
void bu_json_init(bu_json *j, FILE *f, int flat_from);

/* Opens an object or an array; bu_json_end closes the innermost one. */
void bu_json_object(bu_json *j, const char *key);
void bu_json_array(bu_json *j, const char *key);
void bu_json_end(bu_json *j);

/* s NULL writes null. */
void bu_json_string(bu_json *j, const char *key, const char *s);
void bu_json_int(bu_json *j, const char *key, long long v);
void bu_json_uint(bu_json *j, const char *key, unsigned long long v);
/* With `digits` digits after the point ("%.*f"), or, when digits < 0, with -digits significant
 * digits ("%.*g"). Infinities and NaN are written as null. */
void bu_json_double(bu_json *j, const char *key, double v, int digits);
void bu_json_bool(bu_json *j, const char *key, bool v);
void bu_json_null(bu_json *j, const char *key);
/* A value that is JSON already (len bytes of it), written as it is. */
void bu_json_raw(bu_json *j, const char *key, const char *json, size_t len);

/* After the top-level value: 0 when it is complete and the writer was used as documented and
 * the stream reported no error, else -1. Flushes; does not close the stream. */
int bu_json_finish(bu_json *j);

#endif /* TANDEM_UTIL_JSON_H */
