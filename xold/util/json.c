/* json.c: the JSON writer of json.h: separators, indentation, string escaping with UTF-8
 * checking, and numbers that are not finite written as null.
 */
#include "json.h"

#include <math.h>

void bu_json_init(bu_json *j, FILE *f, int flat_from) {
  *j = (bu_json){.f = f, .flat_from = flat_from};
}

/* The length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong forms, no
 * surrogates, nothing above U+10FFFF), or 0 when p does not start one. */
static size_t utf8_length(const unsigned char *p) {
  unsigned char c = p[0];
  unsigned char lo = 0x80, hi = 0xbf;
  size_t n;
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3;
  else if (c >= 0xf0 && c <= 0xf4) n = 4;
  else return 0;
  if (c == 0xe0) lo = 0xa0;
  if (c == 0xed) hi = 0x9f;
  if (c == 0xf0) lo = 0x90;
  if (c == 0xf4) hi = 0x8f;
  /* A NUL ends the string and fails the range check, so p is never read past it. */
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if (p[i] < 0x80 || p[i] > 0xbf) return 0;
  return n;
}

static void write_string(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    unsigned char c = *p;
    if (c >= 0x80) {
      size_t n = utf8_length(p);
      if (n) fwrite(p, 1, n, f);
      else fputs("\\ufffd", f); /* one replacement per byte that is not UTF-8 */
      p += n ? n : 1;
      continue;
    }
    switch (c) {
      case '"': fputs("\\\"", f); break;
      case '\\': fputs("\\\\", f); break;
      case '\b': fputs("\\b", f); break;
      case '\f': fputs("\\f", f); break;
      case '\n': fputs("\\n", f); break;
      case '\r': fputs("\\r", f); break;
      case '\t': fputs("\\t", f); break;
      default:
        if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    p++;
  }
  fputc('"', f);
}

static void indent(bu_json *j, int level) {
  fputc('\n', j->f);
  for (int i = 0; i < level; i++) fputs("  ", j->f);
}

/* Writes what goes before a value: the separator, the line break and indentation, the key.
 * Returns false when the value is to be left out: it is inside a container too deep to
 * track, whose place already holds a null. */
static bool begin_value(bu_json *j, const char *key) {
  if (j->depth > BU_JSON_MAX_DEPTH) return false;
  if (j->done) j->misused = true; /* a second top-level value: written, but reported */
  if (j->depth == 0) {
    if (key) j->misused = true;
    return true;
  }
  int c = j->depth - 1;
  if (j->has_items[c]) fputc(',', j->f);
  if (c < j->flat_from) indent(j, j->depth);
  else if (j->has_items[c]) fputc(' ', j->f);
  j->has_items[c] = true;
  if (j->is_object[c]) {
    if (!key) {
      j->misused = true;
      key = ""; /* an object member needs a name; an empty one keeps the output JSON */
    }
    write_string(j->f, key);
    fputs(": ", j->f);
  } else if (key) {
    j->misused = true;
  }
  return true;
}

/* After a value: the top-level one ends the document with a line break. */
static void end_value(bu_json *j) {
  if (j->depth == 0) {
    fputc('\n', j->f);
    j->done = true;
  }
}

static void open_container(bu_json *j, const char *key, bool object) {
  if (!begin_value(j, key)) {
    j->depth++;
    return;
  }
  if (j->depth == BU_JSON_MAX_DEPTH) {
    /* Too deep to track: a null takes its place, and what it would hold is left out. */
    fputs("null", j->f);
    j->misused = true;
    j->depth++;
    return;
  }
  fputc(object ? '{' : '[', j->f);
  j->is_object[j->depth] = object;
  j->has_items[j->depth] = false;
  j->depth++;
}

void bu_json_object(bu_json *j, const char *key) { open_container(j, key, true); }
void bu_json_array(bu_json *j, const char *key) { open_container(j, key, false); }

void bu_json_end(bu_json *j) {
  if (j->depth == 0) {
    j->misused = true;
    return;
  }
  if (j->depth > BU_JSON_MAX_DEPTH) { /* a container too deep to track: its null is written */
    j->depth--;
    return;
  }
  int c = --j->depth;
  if (j->has_items[c] && c < j->flat_from) indent(j, c);
  fputc(j->is_object[c] ? '}' : ']', j->f);
  end_value(j);
}

void bu_json_string(bu_json *j, const char *key, const char *s) {
  if (!begin_value(j, key)) return;
  if (s) write_string(j->f, s);
  else fputs("null", j->f);
  end_value(j);
}

void bu_json_int(bu_json *j, const char *key, long long v) {
  if (!begin_value(j, key)) return;
  fprintf(j->f, "%lld", v);
  end_value(j);
}

void bu_json_uint(bu_json *j, const char *key, unsigned long long v) {
  if (!begin_value(j, key)) return;
  fprintf(j->f, "%llu", v);
  end_value(j);
}

void bu_json_double(bu_json *j, const char *key, double v, int digits) {
  if (!begin_value(j, key)) return;
  /* Both forms print only what JSON numbers allow ("1e-05" included), for finite values. */
  if (!isfinite(v)) fputs("null", j->f);
  else if (digits >= 0) fprintf(j->f, "%.*f", digits > 17 ? 17 : digits, v);
  else fprintf(j->f, "%.*g", digits < -17 ? 17 : -digits, v);
  end_value(j);
}

void bu_json_bool(bu_json *j, const char *key, bool v) {
  if (!begin_value(j, key)) return;
  fputs(v ? "true" : "false", j->f);
  end_value(j);
}

void bu_json_null(bu_json *j, const char *key) {
  if (!begin_value(j, key)) return;
  fputs("null", j->f);
  end_value(j);
}

void bu_json_raw(bu_json *j, const char *key, const char *json, size_t len) {
  if (!begin_value(j, key)) return;
  fwrite(json, 1, len, j->f);
  end_value(j);
}

int bu_json_finish(bu_json *j) {
  bool bad = j->misused || j->depth != 0 || !j->done;
  if (fflush(j->f) != 0 || ferror(j->f)) bad = true;
  return bad ? -1 : 0;
}
