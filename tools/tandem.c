/* tandem.c: main of the `tandem` command-line tool: the top-level help, `version`, dispatch to
 * the commands (devices.c, overlap.c), and the helpers they share (errors, option parsing,
 * byte formatting). Exit codes: 0 ok, 1 run-time failure, 2 usage error.
 */
#include "tool.h"

#include "benchutil.h" /* bu_join_argv */

#include <tandem.h>

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char main_help[] =
    "usage: tandem <command> [options]\n"
    "\n"
    "Stream-ordered asynchronous work on accelerators.\n"
    "\n"
    "commands:\n"
    "  devices          list backends and devices\n"
    "  moe              MoE layers with experts streamed from host memory (the main job)\n"
    "  bench overlap    measure how well a copy queue overlaps a compute queue\n"
    "  version          print the tool's and the library's versions\n"
    "\n"
    "Run 'tandem <command> --help' for a command's options.\n"
    "Exit codes: 0 ok, 1 run-time failure, 2 usage error.\n";

static const char bench_help[] =
    "usage: tandem bench <benchmark> [options]\n"
    "\n"
    "benchmarks:\n"
    "  overlap    copies on one queue, compute on another, waiting device-side:\n"
    "             overlapped vs serialized time\n"
    "\n"
    "Run 'tandem bench <benchmark> --help' for its options.\n";

static const char version_help[] =
    "usage: tandem version\n"
    "\n"
    "Prints the version the tool was built against and the version of the library loaded.\n";

/* main's argv, kept for tool_command_line(). */
static int saved_argc;
static char **saved_argv;

void tool_command_line(char *buf, size_t size) { bu_join_argv(saved_argc, saved_argv, buf, size); }

int tool_fail(const char *what, int rc) {
  const char *name = tdm_err_name(rc), *msg = tdm_last_error();
  /* The library's messages often start with the code's name already. */
  if (strncmp(msg, name, strlen(name)) == 0)
    fprintf(stderr, "tandem: %s failed: %s\n", what, msg);
  else
    fprintf(stderr, "tandem: %s failed: %s: %s\n", what, name, msg);
  return TOOL_FAILED;
}

int tool_usage_error(const char *cmd, const char *fmt, ...) {
  va_list ap;
  fputs("tandem: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\nRun 'tandem %s%s--help' for usage.\n", cmd ? cmd : "", cmd ? " " : "");
  return TOOL_USAGE;
}

int tool_is_help(const char *arg) { return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0; }

int tool_opt_value(const char *cmd, int argc, char **argv, int *i, const char *name,
                   const char **value) {
  size_t len = strlen(name);
  const char *arg = argv[*i];
  if (strncmp(arg, name, len) != 0)
    return 0;
  if (arg[len] == '=') {
    *value = arg + len + 1;
    return 1;
  }
  if (arg[len] != '\0')
    return 0;
  if (*i + 1 >= argc) {
    tool_usage_error(cmd, "option %s needs a value", name);
    return -1;
  }
  *value = argv[++*i];
  return 1;
}

int tool_parse_count(const char *cmd, const char *name, const char *s, long max, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < 1 || v > max) {
    tool_usage_error(cmd, "%s wants a whole number from 1 to %ld, not '%s'", name, max, s);
    return -1;
  }
  *out = v;
  return 0;
}

int tool_parse_size(const char *cmd, const char *name, const char *s, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  unsigned shift = 0;
  switch (*end) {
  case 'k': case 'K': shift = 10; end++; break;
  case 'm': case 'M': shift = 20; end++; break;
  case 'g': case 'G': shift = 30; end++; break;
  default: break;
  }
  if (*end == 'i' || *end == 'I') /* accept "4MiB" and "4MB" as well as "4M" */
    end++;
  if (*end == 'b' || *end == 'B')
    end++;
  if (errno || end == s || *end || s[0] == '-' || v == 0 || v > (SIZE_MAX >> shift)) {
    tool_usage_error(cmd, "%s wants a positive size in bytes (suffix K, M or G allowed), not '%s'",
                     name, s);
    return -1;
  }
  *out = (size_t)(v << shift);
  return 0;
}

void tool_format_bytes(uint64_t bytes, char *buf, size_t size) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) {
    snprintf(buf, size, "%llu B", (unsigned long long)bytes);
    return;
  }
  double v = (double)bytes / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 3) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, size, "%.1f %s", v, units[u]);
}

static int cmd_version(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (tool_is_help(argv[i])) {
      fputs(version_help, stdout);
      return TOOL_OK;
    }
    return tool_usage_error("version", "unexpected argument '%s'", argv[i]);
  }
  /* tdm_version() needs no tdm_init(): it describes the loaded library, not a runtime. */
  printf("tandem tool %d.%d.%d, library %s\n", TDM_VERSION_MAJOR, TDM_VERSION_MINOR,
         TDM_VERSION_PATCH, tdm_version_string());
  return TOOL_OK;
}

static int cmd_bench(int argc, char **argv) {
  if (argc < 2)
    return tool_usage_error("bench", "bench needs a benchmark name (overlap)");
  if (tool_is_help(argv[1])) {
    fputs(bench_help, stdout);
    return TOOL_OK;
  }
  if (strcmp(argv[1], "overlap") == 0)
    return tool_cmd_overlap(argc - 1, argv + 1);
  return tool_usage_error("bench", "unknown benchmark '%s'", argv[1]);
}

int main(int argc, char **argv) {
  saved_argc = argc;
  saved_argv = argv;
  if (argc < 2) {
    fputs(main_help, stderr);
    return TOOL_USAGE;
  }
  const char *cmd = argv[1];
  if (tool_is_help(cmd) || strcmp(cmd, "help") == 0) {
    fputs(main_help, stdout);
    return TOOL_OK;
  }
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0)
    return cmd_version(argc - 1, argv + 1);
  if (strcmp(cmd, "devices") == 0)
    return tool_cmd_devices(argc - 1, argv + 1);
  if (strcmp(cmd, "moe") == 0)
    return tool_cmd_moe(argc - 1, argv + 1);
  if (strcmp(cmd, "bench") == 0)
    return cmd_bench(argc - 1, argv + 1);
  if (cmd[0] == '-')
    return tool_usage_error(NULL, "unknown option '%s'", cmd);
  return tool_usage_error(NULL, "unknown command '%s'", cmd);
}
