/* tandem.c: main of the `tandem` command-line tool: the top-level help, `version`, dispatch to
 * the commands (devices.c, moe.c, overlap.c), and the helpers they share (errors, option
 * parsing, the device and trace checks, the JSON header, byte formatting). Exit codes: 0 ok,
 * 1 run-time failure (output that could not be written to stdout included), 2 usage error.
 */
#include "tool.h"

#include "measure.h" /* bu_join_argv, bu_json_header */

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
    "  run              a whole MoE model from its file (GGUF, safetensors): a prompt of ids,\n"
    "                   then greedy decoding, with experts streamed from host memory\n"
    "  bench -m FILE    a model's prefill and decode rates, as llama-bench prints them\n"
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
    "  -m FILE    a whole model's prefill and decode rates (tandem bench -m FILE --help)\n"
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

/* Reports the option at arg ("--dev=x", as the user wrote it) that getopt_long did not know:
 * ambiguous when it abbreviates more than one option, else unknown. */
static void unknown_long_option(const char *cmd, const char *arg, const struct option *opts) {
  size_t len = strcspn(arg + 2, "=");
  char matches[256] = "";
  int n = 0;
  for (const struct option *o = opts; o->name; o++)
    if (strncmp(o->name, arg + 2, len) == 0) {
      size_t used = strlen(matches);
      snprintf(matches + used, sizeof matches - used, "%s--%s", n++ ? ", " : "", o->name);
    }
  if (n > 1)
    tool_usage_error(cmd, "option '--%.*s' is ambiguous (%s)", (int)len, arg + 2, matches);
  else
    tool_usage_error(cmd, "unknown option '--%.*s'", (int)len, arg + 2);
}

int tool_getopt(const char *cmd, int argc, char **argv, const struct option *opts,
                const char **value) {
  opterr = 0; /* the messages are the tool's own */
  int c = getopt_long(argc, argv, "+:h", opts, NULL); /* +: argv keeps its order */
  /* optind has moved past the option just read, and past its value when it is separate. */
  const char *arg = optind > 0 && optind <= argc ? argv[optind - 1] : "";
  *value = optarg;
  switch (c) {
    case -1:
      if (optind < argc) {
        tool_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
        return '?';
      }
      return -1;
    case ':': /* only long options take values */
      tool_usage_error(cmd, "option '%s' needs a value", arg);
      return '?';
    case '?':
      if (optopt == 0 && strncmp(arg, "--", 2) == 0)
        unknown_long_option(cmd, arg, opts);
      else if (optopt >= TOOL_OPT_LONG)
        tool_usage_error(cmd, "option '%.*s' takes no value", (int)strcspn(arg, "="), arg);
      else
        tool_usage_error(cmd, "unknown option '-%c'", optopt ? optopt : '?');
      return '?';
    default:
      return c;
  }
}

int tool_find_device(const char *cmd, const char *id, tdm_device **dev) {
  int rc = tdm_device_find(id, dev);
  if (rc == 0)
    return TOOL_OK;
  const char *env = getenv("TANDEM_DEVICE");
  const char *named = id && *id ? id : env && *env ? env : NULL;
  if (rc == TDM_ENODEV && named)
    return tool_usage_error(cmd, "no device '%s'%s (see 'tandem devices')", named,
                            named == id ? "" : " in $TANDEM_DEVICE");
  return tool_fail("finding the device", rc);
}

int tool_find_devices(const char *cmd, const char *id, const char *list, tdm_device **devs,
                      int max, int *n) {
  *n = 0;
  if (!list) return tool_find_device(cmd, id, &devs[0]);
  char buf[512], *save = NULL;
  if (strlen(list) >= sizeof buf)
    return tool_usage_error(cmd, "--devices: a list of at most %zu characters", sizeof buf - 1);
  snprintf(buf, sizeof buf, "%s", list);
  for (char *d = strtok_r(buf, ",", &save); d; d = strtok_r(NULL, ",", &save)) {
    if (*n == max) return tool_usage_error(cmd, "--devices: at most %d devices", max);
    int code = tool_find_device(cmd, d, &devs[*n]);
    if (code != TOOL_OK) return code;
    (*n)++;
  }
  if (*n < 2) return tool_usage_error(cmd, "--devices wants 2 to %d devices, not '%s'", max, list);
  if (id) {
    tdm_device *d;
    int code = tool_find_device(cmd, id, &d);
    if (code != TOOL_OK) return code;
    if (d != devs[0])
      return tool_usage_error(cmd, "--device %s is not the first of --devices %s", id, list);
  }
  return TOOL_OK;
}

int tool_trace_check(const char *path) {
  if (path && setenv("TANDEM_TRACE", path, 1) != 0) {
    fprintf(stderr, "tandem: cannot set TANDEM_TRACE: %s\n", strerror(errno));
    return TOOL_FAILED;
  }
  const char *file = getenv("TANDEM_TRACE");
  if (!file || !*file)
    return TOOL_OK;
  /* Appending leaves a file that is there as it is; the runtime rewrites it at shutdown. */
  FILE *f = fopen(file, "a");
  if (!f) {
    fprintf(stderr, "tandem: cannot write the trace to '%s' (%s): %s\n", file,
            path ? "--trace" : "$TANDEM_TRACE", strerror(errno));
    return TOOL_FAILED;
  }
  fclose(f);
  return TOOL_OK;
}

void tool_json_header(bu_json *j) {
  char command[1024];
  bu_machine m;
  tool_command_line(command, sizeof command);
  bu_machine_get(&m);
  bu_json_header(j, command, TANDEM_GIT_COMMIT, tdm_version_string(), &m);
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
  static const struct option opts[] = {{"help", no_argument, NULL, 'h'}, {NULL, 0, NULL, 0}};
  const char *v;
  int c;
  while ((c = tool_getopt("version", argc, argv, opts, &v)) != -1) {
    if (c != 'h')
      return TOOL_USAGE;
    fputs(version_help, stdout);
    return TOOL_OK;
  }
  /* tdm_version() needs no tdm_init(): it describes the loaded library, not a runtime. */
  printf("tandem tool %d.%d.%d, library %s\n", TDM_VERSION_MAJOR, TDM_VERSION_MINOR,
         TDM_VERSION_PATCH, tdm_version_string());
  return TOOL_OK;
}

static int cmd_bench(int argc, char **argv) {
  if (argc < 2)
    return tool_usage_error("bench", "bench needs a benchmark name (overlap)");
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    fputs(bench_help, stdout);
    return TOOL_OK;
  }
  if (argv[1][0] == '-' && strcmp(argv[1], "--help") != 0 && strcmp(argv[1], "-h") != 0)
    return tool_cmd_model_bench(argc, argv);
  if (strcmp(argv[1], "overlap") == 0)
    return tool_cmd_overlap(argc - 1, argv + 1);
  return tool_usage_error("bench", "unknown benchmark '%s'", argv[1]);
}

/* Output that could not be written (stdout on a full disk, a closed descriptor) fails the
 * command instead of passing with its results lost: checked once, after any command, with
 * what the last flush and close say. A command that failed keeps its own code. A stdout that
 * was closed to begin with and never written to loses nothing (close's EBADF). */
static int close_stdout(int code) {
  int bad = ferror(stdout) != 0, err = 0;
  errno = 0;
  if (fflush(stdout) != 0) {
    bad = 1;
    err = errno;
  }
  errno = 0;
  if (fclose(stdout) != 0 && !bad && errno != EBADF) {
    bad = 1;
    err = errno;
  }
  if (!bad)
    return code;
  fprintf(stderr, "tandem: writing to stdout failed%s%s\n", err ? ": " : "",
          err ? strerror(err) : "");
  return code == TOOL_OK ? TOOL_FAILED : code;
}

static int dispatch(int argc, char **argv) {
  if (argc < 2) {
    fputs(main_help, stderr);
    return TOOL_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    fputs(main_help, stdout);
    return TOOL_OK;
  }
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0)
    return cmd_version(argc - 1, argv + 1);
  if (strcmp(cmd, "devices") == 0)
    return tool_cmd_devices(argc - 1, argv + 1);
  if (strcmp(cmd, "run") == 0)
    return tool_cmd_run(argc - 1, argv + 1);
  if (strcmp(cmd, "moe") == 0)
    return tool_cmd_moe(argc - 1, argv + 1);
  if (strcmp(cmd, "bench") == 0)
    return cmd_bench(argc - 1, argv + 1);
  if (cmd[0] == '-')
    return tool_usage_error(NULL, "unknown option '%s'", cmd);
  return tool_usage_error(NULL, "unknown command '%s'", cmd);
}

int main(int argc, char **argv) {
  saved_argc = argc;
  saved_argv = argv;
  return close_stdout(dispatch(argc, argv));
}
