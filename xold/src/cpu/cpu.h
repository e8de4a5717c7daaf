/* cpu.h: private pieces shared by the CPU backend's files. */
#ifndef TANDEM_CPU_INTERNAL_H
#define TANDEM_CPU_INTERNAL_H

#include "backend.h"
#include "tandem/cpu.h"

extern const tdm__services *tdm__cpu_svc;

/* stream.c: a worker thread running commands and raw launches in FIFO order. */
int tdm__cpu_stream_new(tdm_cpu_stream **out);
void tdm__cpu_stream_free(tdm_cpu_stream *s);
int tdm__cpu_stream_valid(const tdm_cpu_stream *s);
int tdm__cpu_stream_push(tdm_cpu_stream *s, tdm__cmd *cmd);

#endif
