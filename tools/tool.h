/* tool.h: what the pieces of the `tandem` command-line tool share: the commands, exit codes,
 * error reporting and option parsing. tandem.c holds main and the helpers; each command has
 * its own file (devices.c, overlap.c).
 */
#ifndef TANDEM_TOOL_H
#define TANDEM_TOOL_H

#include <stddef.h>
#include <stdint.h>

enum {
  TOOL_OK = 0,      /* success */
  TOOL_FAILED = 1,  /* a tandem call or a check failed at run time */
  TOOL_USAGE = 2    /* bad command line */
};

/* Commands: argv[0] is the command's own name ("devices", "overlap"). They return an exit code. */
int tool_cmd_devices(int argc, char **argv);
int tool_cmd_overlap(int argc, char **argv);
int tool_cmd_moe(int argc, char **argv);

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

/* Whether argv[i] is "--help" or "-h". */
int tool_is_help(const char *arg);
/* Matches option `name` ("--device") at argv[*i], as "--device VALUE" or "--device=VALUE".
 * Returns 1 and sets *value (advancing *i past a separate value), 0 when argv[*i] is another
 * option, or -1 (after reporting a usage error for cmd) when the value is missing. */
int tool_opt_value(const char *cmd, int argc, char **argv, int *i, const char *name,
                   const char **value);
/* Parses a positive count (at most max) or a byte size with an optional K/M/G suffix (powers
 * of 1024). Returns 0, or reports a usage error for cmd and returns -1. */
int tool_parse_count(const char *cmd, const char *name, const char *s, long max, long *out);
int tool_parse_size(const char *cmd, const char *name, const char *s, size_t *out);

/* "15.6 GiB", "512.0 MiB", "4.0 KiB", "12 B". */
void tool_format_bytes(uint64_t bytes, char *buf, size_t size);

#endif /* TANDEM_TOOL_H */
