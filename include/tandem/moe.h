/* tandem/moe.h: a stack of Mixture-of-Experts layers, x += MoE(RMSNorm(x)), whose routed experts live
 * in pinned host memory and reach the device through the expert streamer. Used by
 * `tandem moe` and the MoE tests. */
#ifndef TANDEM_MOE_API_H
#define TANDEM_MOE_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../tandem.h"
#include "moe_ops.h"
#include "streamer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_moe_preset {
  const char *name;
  int hidden, experts, topk, ffn, layers;
  int shared, shared_ffn; /* always-active experts per layer, and their FFN width */
  bool renorm;            /* top-k weights renormalized to sum to 1 */
  const char *note;
} tdm_moe_preset;

TDM_API extern const tdm_moe_preset tdm_moe_presets[];
TDM_API extern const int tdm_moe_npresets;
TDM_API const tdm_moe_preset *tdm_moe_preset_find(const char *name);

/* Where a small ubatch's routed experts that are not on the device are computed (the
 * host-routed grouped path only: a ubatch of more tokens, or a model with every expert
 * resident, computes every expert on the device whatever is set here). */
typedef enum tdm_moe_placement {
  TDM_MOE_PLACE_DEVICE = 0, /* copy them to the device and compute them there (the default) */
  TDM_MOE_PLACE_AUTO = 1,   /* compute a share of them on the host CPU, from their pinned
                               copies, while the link copies the rest: the share the cost model
                               calibrated at creation gives (tdm_moe_placement_get) */
  TDM_MOE_PLACE_HOST = 2    /* compute every one of them on the host; nothing is copied for them */
} tdm_moe_placement;

/* Where a model's weights come from when they are not synthetic (tdm_moe_config.source): a
 * real model's file, read by tandem/model.h. Called during tdm_moe_model_create only. Each
 * returns 0 or a negative TDM_E* code with tdm_last_error() set, which creation returns. */
typedef struct tdm_moe_source {
  void *user;
  /* Writes expert e of layer l in the config's expert_fmt ([Wg (I x H) | Wu (I x H) |
   * Wd (H x I)], tandem/moe_ops.h's layout: bf16, or the file's blocks) to dst: pinned host
   * memory, tdm_moe_expert_size() bytes. Called from several threads at once, each for
   * different experts. */
  int (*expert)(void *user, int l, int e, void *dst);
  /* Layer l's router, bf16 [E x H], and its RMSNorm's weight, f32 [H], into host memory. */
  int (*router)(void *user, int l, tdm_moe_bf16 *dst);
  int (*norm)(void *user, int l, float *dst);
} tdm_moe_source;

typedef struct tdm_moe_config {
  const tdm_moe_preset *preset;
  int layers;              /* 0: the preset's */
  tdm_device *device;
  uint64_t seed;
  double skew;             /* Zipf exponent of expert popularity */
  double locality;         /* correlation of successive decode tokens, in [0, 1) */
  int max_tokens;          /* the largest ubatch forward() will be given */
  size_t budget_bytes;     /* resident experts on the device; one that holds every expert makes
                              them all resident (loaded at creation, the static policy) */
  bool all_resident;       /* every expert resident: the reference run */
  int staging_slots;       /* slots besides the budget that always exist (0: 16, or 64 where
                              max_tokens is over 4096: a large ubatch's streamed groups fill
                              the GPU better) */
  int prefetch_depth;      /* prefetch copies in flight at most (0: the policy's default:
                              under TDM_CACHE_STATIC a layer's experts, so a prefill ubatch's
                              copies all queue in the order they are needed and the next
                              layer's look-ahead is not dropped while this layer's copies are
                              still on their way; under TDM_CACHE_LRU the staging slots) */
  tdm_cache_policy policy;
  int threads;             /* for filling the weights (0: all cores) */
  bool predict;            /* look ahead: layer L+1's router applied to layer L's input picks
                              experts to prefetch while layer L computes (right or wrong, the
                              output is the same: misses are fetched on demand) */
  bool time_link;          /* time the streamer's copies on the device (tdm_streamer_config
                              time_copies), for tdm_moe_pass_stats.link_busy_seconds */
  int predict_depth;       /* with predict: layers L+1 .. L+depth are predicted from layer L's
                              input, and their experts prefetched in layer order, so the copy
                              queue has work queued across the host's part of each layer
                              (0: 1; at most TDM_MOE_PREDICT_DEPTH_MAX; negative: TDM_EINVAL) */
  /* Host placement. An expert is a host candidate when it is neither on the device nor on its
   * way there when its layer is routed; host experts run on the host device's queues, joined
   * to the compute queue by device-side waits, and are never copied (nor prefetched). */
  tdm_moe_placement placement;
  tdm_device *host;        /* the CPU device that computes host experts (NULL: cpu:0); any
                              other kind of device is TDM_EINVAL */
  int host_queues;         /* host experts run on this many in-order queues of the host device,
                              round-robin, each with its own op state and workspace (0: one;
                              at most 256 are made; negative: TDM_EINVAL). Each expert's rows
                              are split between the host's cores whatever the count (the CPU
                              table's few-token path) */
  int host_threads;        /* the threads that split a host expert's rows, the queue's own
                              among them (0: TANDEM_MOE_CPU_THREADS if set, else the cores this
                              process may run on, less 4 when the device is not the host: they
                              are left to the threads that feed the device, so that none of
                              them preempts a thread in the middle of an expert; at least 1).
                              The CPU table's pool is one per process: a model sizes it only
                              when no other user has it running */
  double host_share;       /* AUTO: the share of a layer's non-resident experts to compute on
                              the host, in (0, 1], taken as given (rounded; no join is
                              subtracted); 0: the cost model's (tdm_moe_placement_info). The
                              model is calibrated either way, and reports what it would have
                              chosen. Outside [0, 1], or set under DEVICE or HOST: TDM_EINVAL */
  bool time_host;          /* time the host experts on the host queues (TDM_QUEUE_TIMING), for
                              tdm_moe_pass_stats.host_busy_seconds. Timed queues complete
                              every command through their executor, so this perturbs what it
                              measures a little, as time_link does */
  bool time_chain;         /* time each layer's chain on the compute queue (TDM_QUEUE_TIMING),
                              for tdm_moe_pass_stats' chain_* figures: timed markers at the
                              routing's copy back, the device's experts' start and end, the
                              join with the host experts and the combine. Like time_host, it
                              perturbs what it measures a little. A pass whose routing stays
                              on the device (every expert resident) has no chain to time */
  const tdm_moe_source *source; /* NULL: synthetic weights (seed, skew); else a real model's:
                              no router bias, experts ranked by index for the static resident
                              set, no shared experts (a preset with some is TDM_EINVAL) */
  float norm_eps;          /* the layers' RMSNorm epsilon (0: 1e-6) */
  tdm_moe_wfmt expert_fmt; /* the routed experts' weight format (tandem/moe_ops.h): {0, 0} is
                              bf16; another crosses the link as it is, and needs the device's
                              table (and, with host placement, the CPU's) to have expert_q()
                              and experts_q() (TDM_ENOTSUP otherwise). Synthetic weights are
                              random blocks of it; a source writes its experts in it. Each
                              expert then takes tdm_moe_expert_size() bytes, rounded up to 16 */
  const tdm_moe_wfmt *layer_fmt; /* NULL: expert_fmt for every layer; else one format a layer
                              (the layers' count of them), as a file may mix them (Q4_K_M's
                              down projections are Q6_K in some layers). An expert's slot
                              takes the largest layer's bytes */
  /* Expert parallelism: NULL, or ndevices devices (2 to TDM_MOE_DEVICES_MAX, no repeats),
   * devices[0] being `device`. Each layer's routed experts are dealt out to the devices by
   * popularity rank in snake order (ranks 0..n-1 to devices 0..n-1, the next n back from n-1
   * to 0...: even expected loads; a source's experts are ranked by index; tdm_moe_rebalance
   * deals them out again by measured load), each device's
   * streamed from the one pinned host copy on its own copy queues into its own budget_bytes
   * and staging slots (its resident set: its most popular experts). The
   * first device keeps the rest: the dense weights, the activations, RMSNorm, the router,
   * the shared experts. A layer's normalized input and routing go from it to the others,
   * each of which sums its experts' weighted outputs into a partial sum that comes back to be
   * added, in device order, after a device-side wait: by a peer copy between devices of one
   * backend, else through pinned host memory. Results are those of one device within
   * rounding (the sums group the k outputs by device). Routing stays on the host (no
   * device-routed passes, no recorded graphs); placement DEVICE only; predict applies to
   * the first device's experts. */
  tdm_device *const *devices;
  int ndevices;            /* 0 or 1: `device` alone */
} tdm_moe_config;

#define TDM_MOE_DEVICES_MAX 8

#define TDM_MOE_PREDICT_DEPTH_MAX 16

typedef struct tdm_moe_model tdm_moe_model;

/* Generates the weights (bf16, seeded, in parallel) in pinned host memory and sets up the
 * device side; returns once the resident experts have landed. Host memory too small, a budget that cannot hold an expert...: an error with
 * the reason in tdm_last_error(). */
TDM_API int tdm_moe_model_create(const tdm_moe_config *cfg, tdm_moe_model **out);
TDM_API void tdm_moe_model_destroy(tdm_moe_model *m);

TDM_API size_t tdm_moe_expert_bytes(const tdm_moe_preset *p);
/* The bytes one routed expert of p takes in format f (tdm_moe_config.expert_fmt; {0, 0} is
 * bf16, tdm_moe_expert_bytes()) in host memory, in the device's slots and on the link: 0 when
 * p's rows are not whole blocks of f's types. */
TDM_API size_t tdm_moe_expert_stride(const tdm_moe_preset *p, tdm_moe_wfmt f);
TDM_API size_t tdm_moe_host_bytes(const tdm_moe_preset *p, int layers);

/* The synthetic input of n tokens starting at `pos`: prefill tokens are independent; decode
 * tokens follow each other with the configured locality. Host f32 [n x H]. */
TDM_API void tdm_moe_make_input(const tdm_moe_model *m, float *x, int n, uint64_t pos, bool decode);

typedef struct tdm_moe_pass_stats {
  double seconds;           /* wall time of the pass, host clock */
  double wait_seconds;      /* of which the host waited for the device (routing results, the
                               final sync); the rest it spent submitting work, so a pass with
                               little waiting is bound by the host, not the device */
  double ops_seconds;       /* host time in the backend's expert operations (kernel launches,
                               BLAS calls) */
  double streamer_seconds;  /* host time in the streamer's calls and the events they take */
  uint64_t bytes_copied;     /* expert bytes copied host-to-device during the pass */
  /* Where each routed expert was found, as tdm_streamer_stats counts it: every acquire counts
   * once in resident_hits, inflight_hits or demand_misses, so acquires is their sum. */
  uint64_t acquires;
  uint64_t hits;            /* resident_hits + inflight_hits ("resident or in flight"), kept for
                               older callers; it is not a cache hit rate */
  uint64_t misses;          /* = demand_misses, kept for older callers */
  int experts_computed;     /* routed experts computed (routed, non-empty) */
  uint64_t resident_hits;   /* resident when routed, copy complete: a cache hit, nothing waits */
  uint64_t inflight_hits;   /* covered by a copy already in flight (a prefetch's or an earlier
                               demand's): nothing new copied, but the compute waits for it */
  uint64_t demand_misses;   /* neither: copied on demand, the compute waits for the whole copy */
  uint64_t host_experts;    /* routed experts computed on the host instead of copied (not
                               acquired, so in none of the three counts above):
                               experts_computed = acquires + host_experts */
  uint64_t device_routed_layers; /* layers whose routing stayed on the device (a grouped
                               ubatch with every expert resident: a small one, or a prefill's
                               of up to 16384 routing entries where the table groups it):
                               their experts count as resident hits, read from the routing
                               after the pass */
  uint64_t host_candidates; /* routed experts that were neither on the device nor on their way
                               when placed (placement AUTO or HOST; 0 under DEVICE): the pool
                               host_experts was taken from */
  double link_busy_seconds; /* time_link: how long at least one expert copy was on the link
                               during the pass, by the device's timestamps; 0 otherwise */
  double host_busy_seconds; /* time_host: how long the host queues spent on the pass's host
                               experts, from a layer's first one starting on a queue to its last
                               one there ending, summed over layers and queues (with one queue,
                               the time the host computed experts); 0 otherwise */
  /* time_chain: where each layer's time went on the compute queue, by its timestamps, summed
   * over the pass's layers (0 otherwise); with the pass's first upload before them, they add
   * up to the device's part of the pass. A layer's routing comes back to the host, which
   * groups it, places the experts, starts the host's and submits the device's; the device's
   * experts wait for their copies; the join waits for the host's; then the combine. */
  double chain_route_seconds;   /* the end of the layer before (for the first, of the input's
                                   upload) to the routing's arrival in host memory: RMSNorm,
                                   the router and the copies back */
  double chain_submit_seconds;  /* the routing's arrival to the device's experts' first
                                   command: the predictor's routers, and the host's turnaround
                                   (waking, grouping, placing, submitting) */
  double chain_device_seconds;  /* the device's experts, waits for their copies included */
  double chain_join_seconds;    /* the device's experts' end to the join's passing: the compute
                                   queue waiting for the host's experts */
  double chain_combine_seconds; /* the join to the layer's end: the host's rows copied in, the
                                   shared experts and the combine */
} tdm_moe_pass_stats;

/* Runs every layer on a ubatch of T tokens: x (host f32 [T x H]) in, y out. overlap false makes
 * copies and compute alternate: each copy waits for the compute before it, none runs ahead
 * (experts placed on the host still run beside them: they copy nothing). One pass at a time
 * per model (the model's buffers serve every pass). */
TDM_API int tdm_moe_forward(tdm_moe_model *m, const float *x, float *y, int T, bool overlap, tdm_moe_pass_stats *st);

/* A pass layer by layer, for programs that run other work between the MoE layers on the
 * model's compute queue (tandem/model.h puts attention there): tdm_moe_pass_begin() starts a
 * pass of T tokens whose input the caller has written, or will write on tdm_moe_queue() before
 * the first layer, into tdm_moe_activations() (device f32 [max_tokens x H], rows 0..T);
 * tdm_moe_pass_layer() submits layer l, x += MoE(RMSNorm(x)), in place, in stream order on the
 * queue (it waits on the host for the layer's routing, as tdm_moe_forward does); any layers,
 * any order, each once or more. tdm_moe_pass_end() syncs the queue (covering the caller's own
 * work on it) and fills st; it must follow a begin that succeeded, whatever happened between,
 * with rc the first error the caller met (0 if none), which it returns if nonzero. The routing
 * takes the same paths as tdm_moe_forward's, except that a small ubatch with every expert
 * resident is never recorded as a graph: the same bits, more host time. One pass at a time. */
TDM_API tdm_queue *tdm_moe_queue(const tdm_moe_model *m);
TDM_API float *tdm_moe_activations(const tdm_moe_model *m);
/* The op table (tandem/moe_ops.h) and its state that the model runs its layers with, on
 * tdm_moe_queue(): a program may run its own ops on that state between a pass's layers, and
 * record them and the layers into one graph (graph_begin) where the pass is on the device
 * (below). The model owns the state; the program never closes it. */
TDM_API const tdm_moe_ops *tdm_moe_model_ops(const tdm_moe_model *m, void **state);
/* True while a pass is underway whose every layer runs on the device: a grouped ubatch (a
 * small one, or a prefill's as above) with every expert resident, routed on the device, so
 * that its layers submit work and never wait on the host, and the same buffers serve every
 * such pass of T tokens: a graph recorded around tdm_moe_pass_layer() calls replays them. */
TDM_API bool tdm_moe_pass_on_device(const tdm_moe_model *m);
TDM_API int tdm_moe_pass_begin(tdm_moe_model *m, int T, bool overlap, tdm_moe_pass_stats *st);
TDM_API int tdm_moe_pass_layer(tdm_moe_model *m, int l, tdm_moe_pass_stats *st);
TDM_API int tdm_moe_pass_end(tdm_moe_model *m, int rc, tdm_moe_pass_stats *st);

TDM_API tdm_streamer *tdm_moe_streamer(tdm_moe_model *m);
/* With several devices (tdm_moe_config.devices), device d's streamer (0: tdm_moe_streamer's);
 * NULL for an index outside them. Its stats tell what crossed that device's link. */
TDM_API tdm_streamer *tdm_moe_streamer_at(tdm_moe_model *m, int device);
/* With several devices: deals each layer's routed experts out again by the tokens routed to
 * each since creation (or the last call), so that the devices' loads come out even (the most
 * loaded first, each to the least loaded device so far). Experts held in a device's static
 * resident set stay with it. Between passes (TDM_ESTATE during one); with one device, 0 and
 * nothing done. Results stay those of one device within rounding. */
TDM_API int tdm_moe_rebalance(tdm_moe_model *m);

/* What the model's placement decided at creation. Under AUTO and HOST the cost model is
 * calibrated then, on expert-sized work: the link's GB/s from pinned host-to-device copies of
 * experts, the host's GB/s of expert weights from experts computed on one token on the
 * host_queues queues (weight bytes / time), in experts() calls of host_group experts each as
 * decode groups a layer's host experts on a queue; each side first alone and then both at
 * once (the copies' DMA and the host's cores read the same host memory, so each slows the
 * other). Each figure is the best of three trials of a few milliseconds (both figures at once
 * from the same trial), so that a moment of other work on the host does not halve the share.
 * host_share = host_gbs_shared / (host_gbs_shared + link_gbs_shared): the share of a layer's
 * non-resident experts that the host and the link would finish at about the same time, were
 * it not for the host's join (host_join_us, which AUTO subtracts); 0 when host_gbs_shared +
 * link_gbs_shared is not 5% above link_gbs, since such a split would move the bytes no faster
 * than copying them all (HOST computes all of them whatever the share). Under DEVICE nothing
 * is calibrated: every figure is 0. */
typedef struct tdm_moe_placement_info {
  tdm_moe_placement placement;
  int host_queues;        /* the queues host experts run on (the configured 0 resolved) */
  double link_gbs;        /* GB/s of expert-sized copies to the device, alone */
  double host_gbs;        /* GB/s of expert weights the host computes, alone */
  double host_share;      /* in [0, 1]: the share AUTO uses (the configuration's, if given) */
  double host_share_model; /* the cost model's share, whether or not it is the one used */
  double link_gbs_shared; /* the link's GB/s while the host computes experts */
  double host_gbs_shared; /* the host's GB/s while the link copies experts */
  int host_threads;       /* the pool's threads that split each host expert (the caller among
                             them): host_threads resolved, and what could be started */
  double host_join_us;    /* the host join's round trip, microseconds: the compute queue waits
                             for a host queue, then routes a token and copies the routing back
                             to the host. A layer's host experts add it to its critical path,
                             its copies do not: AUTO puts share * n - host_join_us / (th + tl)
                             of a layer's n non-resident experts on the host (th, tl: an
                             expert's time on the host and on the link, at once), rounded */
  int host_group;         /* the experts a host call computed in the host figures: those a
                             host queue gets in a decode layer at the share (top-k x share x
                             the part of all experts the budget leaves off the device /
                             host_queues, rounded, in [1, top-k]). The share is first taken
                             as given (HOST: 1; AUTO's model: 0.5); when the share measured so
                             groups a different count, the figures are measured again at it */
} tdm_moe_placement_info;

TDM_API int tdm_moe_placement_get(const tdm_moe_model *m, tdm_moe_placement_info *out);

#ifdef __cplusplus
}
#endif

#endif
