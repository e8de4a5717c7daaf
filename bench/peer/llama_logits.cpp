// llama_logits: the logits llama.cpp computes for a prompt of token ids, through llama.h's
// public API alone, written out in tests/model/ref_model.py's logits.bin layout so that
// bench/peer/compare_logits.py can hold them against the float64 reference (and against
// tandem). An independent cross-check of tandem's and the reference's reading of a GGUF file.
//
// usage: llama_logits MODEL.gguf --tokens 5,17,200 [-n N] [--out FILE] [--feed 1,2,..]
//                     [--ngl N] [--threads N] [--fa off|on|auto] [--kv f32|f16] [--print]
//
// The prompt is decoded as one batch with logits for every position (row i: after prompt
// token i); then N tokens are decoded greedily one at a time (argmax, ties to the lowest id;
// or the ids of --feed, to follow another engine's path), each fed back as one decode step
// (row P+j: after feeding generated token j). The K/V cache is f32 unless --kv f16, and flash
// attention is off unless --fa on|auto (llama.cpp then casts K and V to f16, and its CPU
// kernel Q too: ~1e-3 relative in the logits), so that llama.cpp's matmul kernels, not the cache's or FA's rounding, make the
// difference with the reference.
// Built by scripts/peer-llama build against the libllama it builds.
//
// logits.bin (little-endian): b"TNDREF01", int32 vocab V, rows R = P + N, P, N,
// float64 logits[R][V] (llama.cpp's f32 values widened), int32 generated ids[N].

#include "llama.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

static void usage(void) {
    std::fprintf(stderr,
                 "usage: llama_logits MODEL.gguf --tokens 5,17,200 [-n N] [--out FILE] "
                 "[--feed IDS] [--ngl N] [--threads N] [--fa off|on|auto] [--kv f32|f16] "
                 "[--print] [--verbose]\n");
    std::exit(2);
}

static bool parse_ids(const char * s, std::vector<llama_token> & out) {
    out.clear();
    while (*s) {
        char * end = nullptr;
        errno = 0;
        long v = std::strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX) return false;
        out.push_back((llama_token) v);
        s = end;
        if (*s == ',') s++;
        else if (*s) return false;
    }
    return !out.empty();
}

static int parse_int(const char * s) {
    char * end = nullptr;
    long v = std::strtol(s, &end, 10);
    if (end == s || *end || v < -1 || v > 1000000) usage();
    return (int) v;
}

static bool g_verbose = false;

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (g_verbose || level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

static llama_token argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (row[i] > row[best]) best = i;  // strict: ties go to the lowest id
    return best;
}

int main(int argc, char ** argv) {
    const char * model_path = nullptr;
    const char * out_path = nullptr;
    std::vector<llama_token> prompt, feed;
    int n_gen = 0, ngl = 0, threads = 0;
    bool print = false, have_feed = false;
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    ggml_type kv = GGML_TYPE_F32;

    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) usage();
            return argv[++i];
        };
        if (a == "--tokens" || a == "-t") {
            if (!parse_ids(next(), prompt)) usage();
        } else if (a == "-n") {
            n_gen = parse_int(next());
        } else if (a == "--out" || a == "-o") {
            out_path = next();
        } else if (a == "--feed") {
            if (!parse_ids(next(), feed)) usage();
            have_feed = true;
        } else if (a == "--ngl") {
            ngl = parse_int(next());
        } else if (a == "--threads") {
            threads = parse_int(next());
        } else if (a == "--fa") {
            std::string v = next();
            fa = v == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
               : v == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED
               : v == "auto" ? LLAMA_FLASH_ATTN_TYPE_AUTO : (usage(), fa);
        } else if (a == "--kv") {
            std::string v = next();
            kv = v == "f32" ? GGML_TYPE_F32 : v == "f16" ? GGML_TYPE_F16 : (usage(), kv);
        } else if (a == "--print") {
            print = true;
        } else if (a == "--verbose" || a == "-v") {
            g_verbose = true;
        } else if (a[0] == '-' || model_path) {
            usage();
        } else {
            model_path = argv[i];
        }
    }
    if (!model_path || prompt.empty() || n_gen < 0) usage();
    if (have_feed && (int) feed.size() < n_gen) {
        std::fprintf(stderr, "llama_logits: --feed has %zu ids, -n wants %d\n", feed.size(), n_gen);
        return 2;
    }
    if (threads <= 0) threads = (int) std::thread::hardware_concurrency();
    if (threads <= 0) threads = 1;

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        std::fprintf(stderr, "llama_logits: llama.cpp could not load %s (run with --verbose)\n",
                     model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int V = llama_vocab_n_tokens(vocab);
    const int P = (int) prompt.size();
    for (llama_token t : prompt)
        if (t >= V) {
            std::fprintf(stderr, "llama_logits: token %d is not below the vocabulary's %d\n", t, V);
            return 2;
        }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (P + n_gen + 1);
    cp.n_batch = (uint32_t) P;   // the prompt in one batch ...
    cp.n_ubatch = (uint32_t) P;  // ... and one physical batch, as the reference's one eval
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = fa;
    cp.type_k = kv;
    cp.type_v = kv;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "llama_logits: llama.cpp could not create a context\n");
        return 1;
    }

    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    std::fprintf(stderr, "llama_logits: %s, vocab %d, prompt %d, generate %d, threads %d, kv %s, fa %s\n",
                 desc, V, P, n_gen, threads, kv == GGML_TYPE_F32 ? "f32" : "f16",
                 llama_flash_attn_type_name(fa));

    const int R = P + n_gen;
    std::vector<float> logits((size_t) R * V);
    std::vector<llama_token> gen;

    llama_batch batch = llama_batch_init(P, 0, 1);
    batch.n_tokens = P;
    for (int i = 0; i < P; i++) {
        batch.token[i] = prompt[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    int rc = llama_decode(ctx, batch);
    if (rc != 0) {
        std::fprintf(stderr, "llama_logits: llama_decode of the prompt failed (%d)\n", rc);
        return 1;
    }
    for (int i = 0; i < P; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row) {
            std::fprintf(stderr, "llama_logits: no logits for prompt position %d\n", i);
            return 1;
        }
        std::memcpy(&logits[(size_t) i * V], row, sizeof(float) * V);
    }

    llama_token next = argmax(&logits[(size_t) (P - 1) * V], V);
    for (int j = 0; j < n_gen; j++) {
        llama_token t = have_feed ? feed[j] : next;
        gen.push_back(t);
        batch.n_tokens = 1;
        batch.token[0] = t;
        batch.pos[0] = P + j;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        rc = llama_decode(ctx, batch);
        if (rc != 0) {
            std::fprintf(stderr, "llama_logits: llama_decode of step %d failed (%d)\n", j, rc);
            return 1;
        }
        const float * row = llama_get_logits_ith(ctx, -1);
        if (!row) {
            std::fprintf(stderr, "llama_logits: no logits for step %d\n", j);
            return 1;
        }
        std::memcpy(&logits[(size_t) (P + j) * V], row, sizeof(float) * V);
        next = argmax(row, V);
    }
    llama_batch_free(batch);

    // argmax of rows P-1 .. R-1: the ids llama.cpp would pick
    std::printf("greedy:");
    for (int r = P - 1; r < R; r++) std::printf(" %d", argmax(&logits[(size_t) r * V], V));
    std::printf("\n");
    if (print) {
        for (int r = 0; r < R; r++) {
            std::printf("row %d:", r);
            for (int v = 0; v < V; v++) std::printf(" %.9g", logits[(size_t) r * V + v]);
            std::printf("\n");
        }
    }

    if (out_path) {
        FILE * f = std::fopen(out_path, "wb");
        if (!f) {
            std::fprintf(stderr, "llama_logits: %s: %s\n", out_path, std::strerror(errno));
            return 1;
        }
        int32_t head[4] = {V, R, P, n_gen};
        std::vector<double> wide(logits.begin(), logits.end());
        bool ok = std::fwrite("TNDREF01", 1, 8, f) == 8 &&
                  std::fwrite(head, sizeof head, 1, f) == 1 &&
                  std::fwrite(wide.data(), sizeof(double), wide.size(), f) == wide.size() &&
                  (gen.empty() ||
                   std::fwrite(gen.data(), sizeof(int32_t), gen.size(), f) == gen.size());
        if (std::fclose(f) != 0) ok = false;
        if (!ok) {
            std::fprintf(stderr, "llama_logits: writing %s failed\n", out_path);
            return 1;
        }
    }

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
