/* copy-loop.c: 20000 tiny pinned-to-device copies on cpu:0, a sync every 64: the program
 * bench/results/cpu-handles-instructions.json counts tdm_memcpy's instructions in (callgrind). */
#include <tandem.h>
#include <stdio.h>
int main(void) {
  tdm_device *d; tdm_queue *q; void *h, *dv;
  if (tdm_init() || tdm_device_find("cpu:0", &d) || tdm_queue_create(d, 0, &q)) return 1;
  if (tdm_malloc(d, TDM_MEM_PINNED, 1 << 16, &h) || tdm_malloc(d, TDM_MEM_DEVICE, 1 << 16, &dv))
    return 1;
  for (int i = 0; i < 20000; i++) {
    size_t off = (size_t)(i % 1000) * 64;
    if (tdm_memcpy(q, (char *)dv + off, (char *)h + off, 64, TDM_COPY_H2D, 0, NULL, NULL)) return 2;
    if (i % 64 == 63 && tdm_queue_sync(q)) return 3;
  }
  tdm_queue_sync(q);
  return tdm_shutdown();
}
