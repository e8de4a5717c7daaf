/* sy.h: private pieces shared by the SYCL backend's C files. */
#ifndef TANDEM_SY_H
#define TANDEM_SY_H

#include <stdbool.h>

#include "backend.h"
#include "syrt.h"

struct tdm__bqueue {
  sy_queue *q;
  int bdev;
  bool ooo;
};

extern const tdm__services *sy_svc;
extern const tdm__backend tdm__sycl_backend;

/* sysubmit.c */
int sy_submit(tdm__bqueue *bq, tdm__cmd *cmd);
int sy_queue_wait_now(tdm__bqueue *bq, tdm__event *ev);
/* Completion notices: the runtime has no completion callback, so one thread of the backend's
 * watches the events tandem was asked about and gives notice when they complete. */
int sy_notices_start(void);
void sy_notices_stop(void);
int sy_native_notify(void *handle, void (*fn)(void *), void *arg);

#endif /* TANDEM_SY_H */
