/* handle.c: the handles callers hold. A tdm_queue * or tdm_event * is not the address of the
 * object but a 64-bit value, [generation:32][kind:2][index:30], naming a slot of one table and
 * the generation the slot had when the handle was issued. A slot belongs to one object struct
 * for the struct's whole life; structs are recycled, and every reuse issues a new
 * generation, so a handle of a destroyed or released object stays invalid after its memory is
 * reused, and a value that was never a handle (a stray pointer, a handle of another kind) is
 * never taken for one. The struct keeps its slot's generation while it owns the slot and the
 * handle of its current use, so checking one costs two loads and a compare (tdm__event_get,
 * tdm__queue_get), and issuing one (tdm__handle_make) writes only the struct: the hot paths
 * never write this table.
 *
 * The table outlives tdm_shutdown: chunks are never returned, so a handle kept across a
 * shutdown and a new init is still recognized as stale (its slot went back to the free list
 * and is issued again only with a later generation). */
#include <stdlib.h>

#include "internal.h"

_Static_assert(sizeof(void *) == sizeof(uint64_t), "handles are 64-bit values in pointer types");

#define CHUNK_SHIFT TDM__SLOT_CHUNK_SHIFT
#define CHUNK_SLOTS (1u << CHUNK_SHIFT)
#define MAX_CHUNKS TDM__SLOT_MAX_CHUNKS
#define NO_SLOT UINT32_MAX

typedef tdm__slot slot;

/* Read without a lock by tdm__handle_obj (internal.h). */
_Atomic(tdm__slot *) tdm__slot_chunks[TDM__SLOT_MAX_CHUNKS];
static pthread_mutex_t slot_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t nslots;             /* slots ever made; under slot_mu */
static uint32_t free_head = NO_SLOT; /* under slot_mu */

static slot *slot_at(uint32_t i) {
  slot *c = atomic_load_explicit(&tdm__slot_chunks[i >> CHUNK_SHIFT], memory_order_acquire);
  return &c[i & (CHUNK_SLOTS - 1)];
}

int tdm__slot_new(void *obj, uint32_t *out, uint32_t *gen) {
  pthread_mutex_lock(&slot_mu);
  uint32_t i = free_head;
  if (i != NO_SLOT) {
    free_head = slot_at(i)->next_free;
  } else if (nslots < MAX_CHUNKS * CHUNK_SLOTS) {
    i = nslots;
    if (!atomic_load_explicit(&tdm__slot_chunks[i >> CHUNK_SHIFT], memory_order_relaxed)) {
      slot *c = tdm__calloc(CHUNK_SLOTS, sizeof *c);
      if (!c) {
        pthread_mutex_unlock(&slot_mu);
        return tdm__error(TDM_ENOMEM, 0, "no memory for the handle table");
      }
      atomic_store_explicit(&tdm__slot_chunks[i >> CHUNK_SHIFT], c, memory_order_release);
    }
    nslots++;
  } else {
    pthread_mutex_unlock(&slot_mu);
    return tdm__error(TDM_ENOMEM, 0, "every one of %u handles is in use", nslots);
  }
  slot *s = slot_at(i);
  atomic_store_explicit(&s->obj, obj, memory_order_release);
  *gen = s->gen; /* the struct goes on from the last generation the slot issued */
  pthread_mutex_unlock(&slot_mu);
  *out = i;
  return 0;
}

void tdm__slot_free(uint32_t i, uint32_t gen) {
  pthread_mutex_lock(&slot_mu);
  slot *s = slot_at(i);
  atomic_store_explicit(&s->obj, NULL, memory_order_release);
  s->gen = gen;
  s->next_free = free_head;
  free_head = i;
  pthread_mutex_unlock(&slot_mu);
}
