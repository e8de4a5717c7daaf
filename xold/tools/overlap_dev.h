/* overlap_dev.h: the compute side of `tandem bench overlap` on a device whose memory the host
 * cannot read (overlap_cl.c: an OpenCL kernel enqueued on tandem's exported queue). */
#ifndef TANDEM_TOOL_OVERLAP_DEV_H
#define TANDEM_TOOL_OVERLAP_DEV_H

#include <stddef.h>

#include <tandem.h>

typedef struct odev odev;

/* TDM_ENOTSUP when the device's backend has no such path. */
int odev_open(tdm_device *dev, tdm_queue *q, int lanes, long chunks, odev **out);
/* Enqueues chunk `index`'s compute on the queue, in stream order, reading x (device). */
int odev_enqueue(odev *c, const float *x, size_t n, int passes, long index);
/* Syncs the queue and turns the device partials into one result per chunk. */
int odev_collect(odev *c, long chunks, double *results);
void odev_close(odev *c);

#endif
