/* handle.c: the handles callers hold. A tdm_queue * or tdm_event * is not the address of the
 * object but a 64-bit value, [generation:32][kind:2][index:30], naming a slot of one table and
 * the generation the slot had when the handle was issued. A slot belongs to one object struct
 * for the struct's whole life; structs are pooled and recycled, and every reuse issues a new
 * generation, so a handle of a destroyed or released object stays invalid after its memory is
 * reused, and a value that was never a handle (a stray pointer, a handle of another kind) is
 * never dereferenced. Checking one costs two loads and a compare.
 *
 * The table outlives tdm_shutdown: chunks are never returned, so a handle kept across a
 * shutdown and a new init is still recognized as stale (its slot went back to the free list
 * and is issued again only with a later generation). */
#include <stdlib.h>

#include "internal.h"

_Static_assert(sizeof(void *) == sizeof(uint64_t), "handles are 64-bit values in pointer types");

#define CHUNK_SHIFT 12
#define CHUNK_SLOTS (1u << CHUNK_SHIFT)
#define MAX_CHUNKS 4096u /* 16M slots: more live queues and events than memory could hold */
#define INDEX_BITS 30
#define NO_SLOT UINT32_MAX

typedef struct slot {
  _Atomic uint64_t handle; /* the live handle, or 0 while retired */
  void *obj;               /* the struct that owns the slot */
  uint32_t gen;            /* the last generation issued; only the owner touches it */
  uint32_t next_free;      /* free list link, under slot_mu */
} slot;

static _Atomic(slot *) chunks[MAX_CHUNKS];
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t nslots;             /* slots ever made; under slot_mu */
static uint32_t free_head = NO_SLOT; /* under slot_mu */

static slot *slot_at(uint32_t i) {
  slot *c = atomic_load_explicit(&chunks[i >> CHUNK_SHIFT], memory_order_acquire);
  return &c[i & (CHUNK_SLOTS - 1)];
}

int tdm__slot_new(void *obj, uint32_t *out) {
  pthread_mutex_lock(&slot_mu);
  uint32_t i = free_head;
  if (i != NO_SLOT) {
    free_head = slot_at(i)->next_free;
  } else if (nslots < MAX_CHUNKS * CHUNK_SLOTS) {
    i = nslots;
    if (!atomic_load_explicit(&chunks[i >> CHUNK_SHIFT], memory_order_relaxed)) {
      slot *c = tdm__calloc(CHUNK_SLOTS, sizeof *c);
      if (!c) {
        pthread_mutex_unlock(&slot_mu);
        return tdm__error(TDM_ENOMEM, 0, "no memory for the handle table");
      }
      atomic_store_explicit(&chunks[i >> CHUNK_SHIFT], c, memory_order_release);
    }
    nslots++;
  } else {
    pthread_mutex_unlock(&slot_mu);
    return tdm__error(TDM_ENOMEM, 0, "every one of %u handles is in use", nslots);
  }
  slot *s = slot_at(i);
  s->obj = obj;
  atomic_store_explicit(&s->handle, 0, memory_order_relaxed);
  pthread_mutex_unlock(&slot_mu);
  *out = i;
  return 0;
}

uint64_t tdm__slot_issue(uint32_t i, unsigned kind) {
  slot *s = slot_at(i);
  if (++s->gen == 0) s->gen = 1; /* a handle is never 0 */
  uint64_t h = (uint64_t)s->gen << 32 | (uint64_t)kind << INDEX_BITS | i;
  atomic_store_explicit(&s->handle, h, memory_order_release);
  return h;
}

void tdm__slot_retire(uint32_t i) {
  atomic_store_explicit(&slot_at(i)->handle, 0, memory_order_release);
}

void tdm__slot_free(uint32_t i) {
  tdm__slot_retire(i);
  pthread_mutex_lock(&slot_mu);
  slot *s = slot_at(i);
  s->obj = NULL;
  s->next_free = free_head;
  free_head = i;
  pthread_mutex_unlock(&slot_mu);
}

void *tdm__handle_obj(const void *handle, unsigned kind) {
  uint64_t h = (uint64_t)(uintptr_t)handle;
  uint32_t i = (uint32_t)h & ((1u << INDEX_BITS) - 1);
  if (((uint32_t)h >> INDEX_BITS) != kind || (i >> CHUNK_SHIFT) >= MAX_CHUNKS) return NULL;
  slot *c = atomic_load_explicit(&chunks[i >> CHUNK_SHIFT], memory_order_acquire);
  if (!c) return NULL;
  slot *s = &c[i & (CHUNK_SLOTS - 1)];
  return atomic_load_explicit(&s->handle, memory_order_acquire) == h ? s->obj : NULL;
}
