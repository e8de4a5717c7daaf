/* moe-presets.c: a user of the installed libtandem_moe (tests/install-check.sh builds it with
 * pkg-config's tandem-moe and with find_package(tandem)'s tandem::moe): it lists the MoE
 * presets and finds cpu:0's op table, so both libraries must be found and loaded. */
#include <stdio.h>

#include <tandem.h>
#include <tandem/moe.h>
#include <tandem/moe_ops.h>

int main(void) {
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
  return tdm_shutdown() == 0 ? rc : 1;
}
