/* examples/copy-overlap.c: a copy queue feeds a compute queue, which waits for the copy on the
 * device (the host never blocks), copies the data back and runs a host task on it. Every call
 * is checked: on a failure it prints what went wrong and exits with status 1.
 *
 *   cc copy-overlap.c $(pkg-config --cflags --libs tandem) -o copy-overlap
 *   TANDEM_DEVICE=cpu:0 ./copy-overlap    (default: the first GPU, else cpu:0)
 */
#include <tandem.h>
#include <stdio.h>

/* Every fallible call returns 0 or a negative TDM_E* code, and tdm_last_error() says why.
 * The last tdm_shutdown() drains every queue and frees what tandem allocated. */
#define CHECK(call)                                                               \
  do {                                                                            \
    if ((call) < 0) {                                                             \
      fprintf(stderr, "copy-overlap: %s: %s\n", #call, tdm_last_error());         \
      tdm_shutdown();                                                             \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

enum { N = 1 << 20 };

static int report(void *arg) {   /* a host task: runs after the copy back, on a tandem thread */
  const float *x = arg;
  printf("back on the host: %g ... %g\n", x[0], x[N - 1]);
  return 0;
}

int main(void) {
  tdm_device *dev;
  tdm_queue *copy, *compute;
  tdm_event *landed;
  float *host, *dev_buf, *back;
  size_t bytes = N * sizeof *host;

  if (tdm_init() < 0) {
    fprintf(stderr, "copy-overlap: tdm_init: %s\n", tdm_last_error());
    return 1;
  }
  CHECK(tdm_device_find(NULL, &dev));   /* $TANDEM_DEVICE, else the first GPU, else cpu:0 */
  CHECK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &copy));
  CHECK(tdm_queue_create(dev, TDM_QUEUE_IN_ORDER, &compute));
  CHECK(tdm_malloc(dev, TDM_MEM_PINNED, bytes, (void **)&host));
  CHECK(tdm_malloc(dev, TDM_MEM_DEVICE, bytes, (void **)&dev_buf));
  CHECK(tdm_malloc(dev, TDM_MEM_PINNED, bytes, (void **)&back));
  for (int i = 0; i < N; i++) host[i] = (float)i;

  CHECK(tdm_memcpy(copy, dev_buf, host, bytes, TDM_COPY_H2D, 0, NULL, &landed));
  CHECK(tdm_queue_wait(compute, landed));   /* device-side: returns at once */
  CHECK(tdm_memcpy(compute, back, dev_buf, bytes, TDM_COPY_D2H, 0, NULL, NULL));
  CHECK(tdm_host_task(compute, report, back, 0, NULL, NULL));
  CHECK(tdm_queue_sync(compute));           /* the first error since the last sync, or 0 */

  CHECK(tdm_event_release(landed));
  CHECK(tdm_queue_destroy(copy));
  CHECK(tdm_queue_destroy(compute));
  CHECK(tdm_free(host));
  CHECK(tdm_free(dev_buf));
  CHECK(tdm_free(back));
  if (tdm_shutdown() < 0) {
    fprintf(stderr, "copy-overlap: tdm_shutdown: %s\n", tdm_last_error());
    return 1;
  }
  return 0;
}
