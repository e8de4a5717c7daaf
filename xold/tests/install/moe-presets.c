/* moe-presets.c: a user of the installed libtandem_moe (tests/install-check.sh builds it with
 * pkg-config's tandem-moe and with find_package(tandem)'s tandem::moe): it lists the MoE
 * presets and finds cpu:0's op table, so both libraries must be found and loaded. A device
 * named on the command line (opencl:0) must have its op table too: the library's module for
 * that backend must load from the installed tree. */
#include <stdio.h>

#include <tandem.h>
#include <tandem/moe.h>
#include <tandem/moe_ops.h>

int main(int argc, char **argv) {
  tdm_device *dev;
  if (tdm_init() != 0 || tdm_device_find("cpu:0", &dev) != 0) {
    fprintf(stderr, "moe-presets: %s\n", tdm_last_error());
    return 1;
  }
  for (int i = 0; i < tdm_moe_npresets; i++)
    printf("%s: %zu bytes per expert\n", tdm_moe_presets[i].name,
           tdm_moe_expert_bytes(&tdm_moe_presets[i]));
  const tdm_moe_ops *ops = tdm_moe_ops_for(dev);
  printf("cpu:0 ops: %s\n", ops ? ops->name : tdm_last_error());
  int rc = tdm_moe_npresets > 0 && tdm_moe_ops_workspace(1, 8, 8) > 0 ? 0 : 1;
  if (argc > 1) {
    const tdm_moe_ops *gpu = NULL;
    if (tdm_device_find(argv[1], &dev) == 0) gpu = tdm_moe_ops_for(dev);
    printf("%s ops: %s\n", argv[1], gpu ? gpu->name : tdm_last_error());
    if (!gpu) rc = 1;
  }
  return tdm_shutdown() == 0 ? rc : 1;
}
