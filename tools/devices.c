/* devices.c: `tandem devices [--json]`: the backends tandem knows of (loaded, or why not) and
 * every device with its id, backend, name, memory and capabilities.
 */
#include "tool.h"

#include "benchutil.h" /* bu_json_string */

#include <tandem.h>

#include <stdio.h>
#include <string.h>

static const char devices_help[] =
    "usage: tandem devices [--json]\n"
    "\n"
    "Lists the backends tandem knows of, loaded or not (and why not), and every device with\n"
    "its id, backend, memory, capabilities and name. The default device (what --device\n"
    "defaults to: $TANDEM_DEVICE, else the first GPU, else cpu:0) is marked with '*'.\n"
    "\n"
    "options:\n"
    "  --json     print JSON on stdout instead of tables\n"
    "  -h, --help show this help\n";

/* The capability bits with their names, in the order they are printed. */
static const struct {
  unsigned bit;
  const char *name;
} cap_names[] = {
    {TDM_DEVICE_CAP_TIMING, "timing"},
    {TDM_DEVICE_CAP_OUT_OF_ORDER, "out-of-order"},
    {TDM_DEVICE_CAP_ADOPT, "adopt"},
    {TDM_DEVICE_CAP_HOST_MEMORY, "host-memory"},
    {TDM_DEVICE_CAP_GPU, "gpu"},
};
#define NCAPS (sizeof cap_names / sizeof cap_names[0])

/* "timing,adopt", "-" when there are none; bits the tool does not know of appear in hex. */
static void format_caps(unsigned caps, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < NCAPS; i++) {
    if (caps & cap_names[i].bit)
      used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? "," : "", cap_names[i].name);
    caps &= ~cap_names[i].bit;
    if (used >= size)
      return;
  }
  if (caps)
    snprintf(buf + used, size - used, "%s0x%x", used ? "," : "", caps);
  else if (!used)
    snprintf(buf, size, "-");
}

/* The id of the default device into buf, or "" when there is none (not an error here). */
static void default_device_id(char *buf, size_t size) {
  tdm_device *dev;
  tdm_device_info info;
  buf[0] = '\0';
  if (tdm_device_find(NULL, &dev) == 0 && tdm_device_info_get(dev, &info) == 0)
    snprintf(buf, size, "%s", info.id);
}

static void print_backend_human(const tdm_backend_info *b) {
  char status[64];
  if (b->status == 0)
    snprintf(status, sizeof status, "loaded");
  else
    snprintf(status, sizeof status, "no: %s", tdm_err_name(b->status));
  printf("  %-10s %-18s %7d  %s\n", b->name, status, b->device_count,
         b->detail[0] ? b->detail : "-");
}

static void print_device_human(const tdm_device_info *d, const char *default_id) {
  char mem[32], caps[96];
  int is_default = strcmp(d->id, default_id) == 0;
  tool_format_bytes(d->total_memory, mem, sizeof mem);
  format_caps(d->caps, caps, sizeof caps);
  printf("  %-10s %c %-8s %10s  %-38s %s\n", d->id, is_default ? '*' : ' ', d->backend, mem, caps,
         d->name);
}

static void print_backend_json(const tdm_backend_info *b, int first) {
  printf("%s\n    {\"name\": ", first ? "" : ",");
  bu_json_string(stdout, b->name);
  printf(", \"loaded\": %s, \"status\": ", b->status == 0 ? "true" : "false");
  bu_json_string(stdout, tdm_err_name(b->status));
  printf(", \"status_code\": %d, \"device_count\": %d, \"detail\": ", b->status, b->device_count);
  bu_json_string(stdout, b->detail);
  fputs("}", stdout);
}

static void print_device_json(const tdm_device_info *d, int first) {
  char mem[32];
  tool_format_bytes(d->total_memory, mem, sizeof mem);
  printf("%s\n    {\"id\": ", first ? "" : ",");
  bu_json_string(stdout, d->id);
  printf(", \"index\": %d, \"backend\": ", d->index);
  bu_json_string(stdout, d->backend);
  printf(", \"backend_index\": %d, \"name\": ", d->backend_index);
  bu_json_string(stdout, d->name);
  printf(", \"total_memory\": %llu, \"memory\": ", (unsigned long long)d->total_memory);
  bu_json_string(stdout, mem);
  printf(", \"caps\": [");
  int n = 0;
  for (size_t i = 0; i < NCAPS; i++)
    if (d->caps & cap_names[i].bit)
      printf("%s\"%s\"", n++ ? ", " : "", cap_names[i].name);
  printf("], \"caps_bits\": %u}", d->caps);
}

/* Prints both lists; assumes tandem is initialized. */
static int list(int json) {
  int nb, nd, rc;
  char default_id[32];
  if ((rc = tdm_backend_count(&nb)) < 0)
    return tool_fail("tdm_backend_count", rc);
  if ((rc = tdm_device_count(&nd)) < 0)
    return tool_fail("tdm_device_count", rc);
  default_device_id(default_id, sizeof default_id);

  if (json) {
    printf("{\n  \"version\": \"%s\",\n  \"default_device\": ", tdm_version_string());
    bu_json_string(stdout, default_id);
    printf(",\n  \"backends\": [");
  } else {
    printf("backends (%d)\n  %-10s %-18s %7s  %s\n", nb, "NAME", "LOADED", "DEVICES", "DETAIL");
  }
  for (int i = 0; i < nb; i++) {
    tdm_backend_info b;
    if ((rc = tdm_backend_get(i, &b)) < 0)
      return tool_fail("tdm_backend_get", rc);
    if (json)
      print_backend_json(&b, i == 0);
    else
      print_backend_human(&b);
  }

  if (json)
    printf("\n  ],\n  \"devices\": [");
  else
    printf("\ndevices (%d)\n  %-10s   %-8s %10s  %-38s %s\n", nd, "ID", "BACKEND", "MEMORY", "CAPS",
           "NAME");
  for (int i = 0; i < nd; i++) {
    tdm_device *dev;
    tdm_device_info d;
    if ((rc = tdm_device_get(i, &dev)) < 0)
      return tool_fail("tdm_device_get", rc);
    if ((rc = tdm_device_info_get(dev, &d)) < 0)
      return tool_fail("tdm_device_info_get", rc);
    if (json)
      print_device_json(&d, i == 0);
    else
      print_device_human(&d, default_id);
  }
  if (json)
    printf("\n  ]\n}\n");
  else
    printf("\n  * the default device: $TANDEM_DEVICE if set, else the first GPU, else cpu:0\n");
  return TOOL_OK;
}

int tool_cmd_devices(int argc, char **argv) {
  int json = 0;
  for (int i = 1; i < argc; i++) {
    if (tool_is_help(argv[i])) {
      fputs(devices_help, stdout);
      return TOOL_OK;
    } else if (strcmp(argv[i], "--json") == 0) {
      json = 1;
    } else {
      const char *what = argv[i][0] == '-' ? "unknown option" : "unexpected argument";
      return tool_usage_error("devices", "%s '%s'", what, argv[i]);
    }
  }
  int rc = tdm_init();
  if (rc < 0)
    return tool_fail("tdm_init", rc);
  int code = list(json);
  tdm_shutdown();
  return code;
}
