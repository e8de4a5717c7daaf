/* errors.c: error names and messages from the one table in tandem.h, and the thread-local
 * message that says what went wrong in words. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Room for a failure's own words (a task's, up to TDM__WHY_MAX) with what relays it around
 * them (a wait's hops, a sync), so the origin's words reach the caller whole. */
static _Thread_local char tls_msg[1536];
static _Thread_local char tls_detail[1480]; /* tls_msg without the code name */
static _Thread_local int tls_native;

const char *tdm_err_name(int code) {
  switch (code) {
    case 0: return "TDM_OK";
#define TDM__ERR_NAME(name, value, msg) \
  case TDM_##name: return "TDM_" #name;
    TDM_ERRNO_MAP(TDM__ERR_NAME)
#undef TDM__ERR_NAME
    default: return "TDM_UNKNOWN";
  }
}

const char *tdm_strerror(int code) {
  switch (code) {
    case 0: return "success";
#define TDM__ERR_MSG(name, value, msg) \
  case TDM_##name: return msg;
    TDM_ERRNO_MAP(TDM__ERR_MSG)
#undef TDM__ERR_MSG
    default: return "unknown error";
  }
}

const char *tdm_last_error(void) { return tls_msg[0] ? tls_msg : "no error"; }

int tdm_last_native_error(void) { return tls_native; }

void tdm_clear_error(void) {
  tls_msg[0] = '\0';
  tls_detail[0] = '\0';
  tls_native = 0;
}

const char *tdm__last_detail(void) { return tls_detail; }

/* The detail may quote tdm__last_detail() or tdm_last_error() (a nested failure), so it is
 * formatted aside. */
static int set_error(int code, int native, const char *fmt, va_list ap) {
  char detail[sizeof tls_detail];
  vsnprintf(detail, sizeof detail, fmt, ap);
  memcpy(tls_detail, detail, sizeof detail);
  if (native)
    snprintf(tls_msg, sizeof tls_msg, "%s: %s (native error %d)", tdm_err_name(code), detail,
             native);
  else
    snprintf(tls_msg, sizeof tls_msg, "%s: %s", tdm_err_name(code), detail);
  tls_native = native;
  return code;
}

int tdm__error(int code, int native, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(code, native, fmt, ap);
  va_end(ap);
  return code;
}

/* The public entry for layered libraries: the same message, the same thread. */
int tdm_set_error(int code, int native, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(code, native, fmt ? fmt : "", ap);
  va_end(ap);
  return code;
}
