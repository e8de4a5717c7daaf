/* tool.h: what the pieces of the `tandem` command-line tool share: the commands, exit codes,
 * error reporting, option parsing, the device and trace checks every command makes before it
 * runs, and the header of its JSON. tandem.c holds main and the helpers; each command has its
 * own file (devices.c, moe.c, overlap.c).
 */
#ifndef TANDEM_TOOL_H
#define TANDEM_TOOL_H

#include <getopt.h>
#include <stddef.h>
#include <stdint.h>

#include <tandem.h>

#include "json.h"

enum {
  TOOL_OK = 0,      /* success */
  TOOL_FAILED = 1,  /* a tandem call or a check failed at run time */
  TOOL_USAGE = 2    /* bad command line */
};

/* Commands: argv[0] is the command's own name ("devices", "overlap"). They return an exit code. */
int tool_cmd_devices(int argc, char **argv);
int tool_cmd_overlap(int argc, char **argv);
int tool_cmd_moe(int argc, char **argv);
int tool_cmd_run(int argc, char **argv);        /* run.c */
int tool_cmd_model_bench(int argc, char **argv); /* run.c: tandem bench -m */

/* The whole command line, argv joined with spaces, for result files. */
void tool_command_line(char *buf, size_t size);

/* Prints "tandem: WHAT failed: TDM_ECODE: <tdm_last_error()>" to stderr; returns TOOL_FAILED. */
int tool_fail(const char *what, int rc);
/* Prints "tandem: <message>" and a hint to run 'tandem CMD --help' (cmd NULL: the top level);
 * returns TOOL_USAGE. */
int tool_usage_error(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* The val of long options that have no short form starts here, above every character. */
enum { TOOL_OPT_LONG = 256 };

/* getopt_long over a command's arguments (argv[0] is the command's name; the only short option
 * is -h, val 'h', which --help shares), with the tool's wording for mistakes. Returns the next
 * option's val with *value its argument (NULL when it takes none), -1 after the last option,
 * or '?' after reporting a usage error for cmd (an unknown, ambiguous or malformed option, a
 * missing value, an argument that is not an option). opts ends with a zeroed entry. getopt's
 * state is global: one command line per process. */
int tool_getopt(const char *cmd, int argc, char **argv, const struct option *opts,
                const char **value);
/* Parses a positive count (at most max) or a byte size with an optional K/M/G suffix (powers
 * of 1024). Returns 0, or reports a usage error for cmd and returns -1. */
int tool_parse_count(const char *cmd, const char *name, const char *s, long max, long *out);
int tool_parse_size(const char *cmd, const char *name, const char *s, size_t *out);

/* The device that --device names (id; NULL or "": the default device) into *dev. A device that
 * does not exist is a usage error of cmd, whether --device or $TANDEM_DEVICE names it. Returns
 * TOOL_OK, or TOOL_USAGE or TOOL_FAILED after reporting; needs tdm_init. */
int tool_find_device(const char *cmd, const char *id, tdm_device **dev);

/* --devices LIST (comma-separated ids, 2 to max) into devs[0..*n), beside --device (id): the
 * list's first replaces it, or must be it. list NULL: *n = 0 and devs[0] is --device's. Returns
 * as tool_find_device. */
int tool_find_devices(const char *cmd, const char *id, const char *list, tdm_device **devs,
                      int max, int *n);

/* Before tdm_init: --trace FILE (path; NULL when not given) becomes $TANDEM_TRACE, which the
 * runtime reads at init and writes at shutdown; then the file that $TANDEM_TRACE names, if
 * any, must be writable now, not only when the run is over. Returns TOOL_OK, or TOOL_FAILED
 * after saying why. */
int tool_trace_check(const char *path);

/* The members every JSON report of the tool starts with, in the object open in j: the
 * command line, the commit, the date, tandem's version and the machine. */
void tool_json_header(bu_json *j);

/* The link's peak in GB/s: pinned host-to-device copies of 256 MiB (64 MiB on a host-memory
 * device), the best of three after a warm-up (moe.c). */
int tool_measure_link(tdm_device *dev, double *gbps);

/* "15.6 GiB", "512.0 MiB", "4.0 KiB", "12 B". */
void tool_format_bytes(uint64_t bytes, char *buf, size_t size);

#endif /* TANDEM_TOOL_H */
