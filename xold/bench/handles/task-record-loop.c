/* task-record-loop.c: 20000 rounds of an empty host task and a marker released at once on
 * cpu:0, a sync every 64: bench/results/cpu-handles-instructions.json counts the instructions
 * of tdm_host_task, tdm_event_record and tdm_event_release in it (callgrind). */
#include <tandem.h>
static int nop(void *a) { (void)a; return 0; }
int main(void) {
  tdm_device *d; tdm_queue *q;
  if (tdm_init() || tdm_device_find("cpu:0", &d) || tdm_queue_create(d, 0, &q)) return 1;
  for (int i = 0; i < 20000; i++) {
    tdm_event *e;
    if (tdm_host_task(q, nop, 0, 0, 0, 0)) return 2;
    if (tdm_event_record(q, &e) || tdm_event_release(e)) return 3;
    if (i % 64 == 63 && tdm_queue_sync(q)) return 4;
  }
  return tdm_shutdown();
}
