/* lfstack.h: a lock-free stack of items whose first member is their `next` pointer. Any thread
 * pushes; the owner takes the whole stack with one exchange, so taking has no ABA hazard. The
 * core's pools and the CUDA module's event pool are built on it. */
#ifndef TANDEM_LFSTACK_H
#define TANDEM_LFSTACK_H

#include <stdatomic.h>

typedef struct tdm__link {
  struct tdm__link *next;
} tdm__link;

/* Pushes the list first..last, already linked by `next`, with one compare-and-swap (retried
 * while other pushes land between). */
static inline void tdm__lfstack_push_list(_Atomic(void *) *top, void *first, void *last) {
  tdm__link *tail = last;
  void *head = atomic_load_explicit(top, memory_order_relaxed);
  do tail->next = head;
  while (!atomic_compare_exchange_weak_explicit(top, &head, first, memory_order_release,
                                                memory_order_relaxed));
}

/* Pushes item (its first member is the link). */
static inline void tdm__lfstack_push(_Atomic(void *) *top, void *item) {
  tdm__lfstack_push_list(top, item, item);
}

/* Takes every item pushed so far, as a list linked by `next`, or NULL. */
static inline void *tdm__lfstack_take(_Atomic(void *) *top) {
  return atomic_exchange_explicit(top, NULL, memory_order_acquire);
}

#endif
