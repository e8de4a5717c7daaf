/* devices.c: `tandem devices [--json]`: the backends tandem knows of (loaded, or why not) and
 * every device with its id, backend, name, memory and capabilities.
 */
#include "tool.h"

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
    {TDM_DEVICE_CAP_HOST_DEFERRAL, "host-deferral"},
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

static void print_backend_json(bu_json *j, const tdm_backend_info *b) {
  bu_json_object(j, NULL);
  bu_json_string(j, "name", b->name);
  bu_json_bool(j, "loaded", b->status == 0);
  bu_json_string(j, "status", tdm_err_name(b->status));
  bu_json_int(j, "status_code", b->status);
  bu_json_int(j, "device_count", b->device_count);
  bu_json_string(j, "detail", b->detail);
  bu_json_end(j);
}

static void print_device_json(bu_json *j, const tdm_device_info *d) {
  char mem[32];
  tool_format_bytes(d->total_memory, mem, sizeof mem);
  bu_json_object(j, NULL);
  bu_json_string(j, "id", d->id);
  bu_json_int(j, "index", d->index);
  bu_json_string(j, "backend", d->backend);
  bu_json_int(j, "backend_index", d->backend_index);
  bu_json_string(j, "name", d->name);
  bu_json_uint(j, "total_memory", d->total_memory);
  bu_json_string(j, "memory", mem);
  bu_json_array(j, "caps");
  for (size_t i = 0; i < NCAPS; i++)
    if (d->caps & cap_names[i].bit)
      bu_json_string(j, NULL, cap_names[i].name);
  bu_json_end(j);
  bu_json_uint(j, "caps_bits", d->caps);
  bu_json_end(j);
}

/* Prints both lists; assumes tandem is initialized. */
static int list(int json) {
  int nb, nd, rc;
  char default_id[32];
  bu_json j; /* json: backends and devices one a line */
  bu_json_init(&j, stdout, 2);
  if ((rc = tdm_backend_count(&nb)) < 0)
    return tool_fail("tdm_backend_count", rc);
  if ((rc = tdm_device_count(&nd)) < 0)
    return tool_fail("tdm_device_count", rc);
  default_device_id(default_id, sizeof default_id);

  if (json) {
    bu_json_object(&j, NULL);
    bu_json_string(&j, "version", tdm_version_string());
    bu_json_string(&j, "default_device", default_id);
    bu_json_array(&j, "backends");
  } else {
    printf("backends (%d)\n  %-10s %-18s %7s  %s\n", nb, "NAME", "LOADED", "DEVICES", "DETAIL");
  }
  for (int i = 0; i < nb; i++) {
    tdm_backend_info b;
    if ((rc = tdm_backend_get(i, &b)) < 0)
      return tool_fail("tdm_backend_get", rc);
    if (json)
      print_backend_json(&j, &b);
    else
      print_backend_human(&b);
  }

  if (json) {
    bu_json_end(&j);
    bu_json_array(&j, "devices");
  } else {
    printf("\ndevices (%d)\n  %-10s   %-8s %10s  %-38s %s\n", nd, "ID", "BACKEND", "MEMORY", "CAPS",
           "NAME");
  }
  for (int i = 0; i < nd; i++) {
    tdm_device *dev;
    tdm_device_info d;
    if ((rc = tdm_device_get(i, &dev)) < 0)
      return tool_fail("tdm_device_get", rc);
    if ((rc = tdm_device_info_get(dev, &d)) < 0)
      return tool_fail("tdm_device_info_get", rc);
    if (json)
      print_device_json(&j, &d);
    else
      print_device_human(&d, default_id);
  }
  if (!json) {
    printf("\n  * the default device: $TANDEM_DEVICE if set, else the first GPU, else cpu:0\n");
    return TOOL_OK;
  }
  bu_json_end(&j);
  bu_json_end(&j);
  if (bu_json_finish(&j) < 0) {
    fprintf(stderr, "tandem: writing the JSON to stdout failed\n");
    return TOOL_FAILED;
  }
  return TOOL_OK;
}

int tool_cmd_devices(int argc, char **argv) {
  enum { OPT_JSON = TOOL_OPT_LONG };
  static const struct option opts[] = {
      {"json", no_argument, NULL, OPT_JSON},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  const char *v;
  int c, json = 0;
  while ((c = tool_getopt("devices", argc, argv, opts, &v)) != -1) {
    if (c == 'h') {
      fputs(devices_help, stdout);
      return TOOL_OK;
    }
    if (c != OPT_JSON)
      return TOOL_USAGE;
    json = 1;
  }
  /* tdm_init loads the backends, and with them $TANDEM_TRACE: a trace of no commands. */
  if ((c = tool_trace_check(NULL)) != TOOL_OK)
    return c;
  int rc = tdm_init();
  if (rc < 0)
    return tool_fail("tdm_init", rc);
  int code = list(json);
  tdm_shutdown();
  return code;
}
