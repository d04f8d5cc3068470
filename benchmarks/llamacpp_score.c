/* llama.cpp's own log-likelihood of a token stream, window by window: the pipeline's perplexity
 * (optimize/evaluate/generation.py: consecutive windows, each scored without context) computed by
 * llama.cpp's kernels on a GGUF file as it is. llama-server returns no prompt logprobs and
 * llama-perplexity scores half-windows after a BOS, so neither gives the same figure; this calls
 * libllama directly. benchmarks/llamacpp_perplexity.py compiles and runs it.
 *
 *   llamacpp_score MODEL.gguf WINDOW THREADS REPACK UBATCH < ids
 *
 * ids: whitespace-separated token ids. REPACK 1 lets llama.cpp repack weights for its CPU kernels
 * (its default), 0 keeps the file's layout. UBATCH: rows per physical batch. Prints one JSON line:
 * {"nll": SUM, "tokens": SCORED, "vocab": N, "per_token": [EACH SCORED TOKEN'S NLL, IN ORDER]}.
 * Exit 2: bad arguments or ids; 3: the model or context did not load; 4: llama_decode failed. */
#include "llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int read_ids(llama_token ** ids, int * count) {
    int capacity = 4096, n = 0, value;
    llama_token * out = malloc(capacity * sizeof(llama_token));
    while (out && scanf("%d", &value) == 1) {
        if (n == capacity) {
            capacity *= 2;
            out = realloc(out, capacity * sizeof(llama_token));
            if (!out) return 0;
        }
        out[n++] = value;
    }
    *ids = out;
    *count = n;
    return out != NULL && feof(stdin);
}

/* -log p(token | the logits row): a log-sum-exp over the vocabulary, in double. */
static double negative_log_likelihood(const float * logits, int vocab, llama_token token) {
    float top = logits[0];
    for (int v = 1; v < vocab; v++) top = logits[v] > top ? logits[v] : top;
    double sum = 0.0;
    for (int v = 0; v < vocab; v++) sum += exp((double)logits[v] - top);
    return -((double)logits[token] - top - log(sum));
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL.gguf WINDOW THREADS REPACK UBATCH < ids\n", argv[0]);
        return 2;
    }
    int window = atoi(argv[2]), threads = atoi(argv[3]), repack = atoi(argv[4]), ubatch = atoi(argv[5]);
    llama_token * ids;
    int count;
    if (window < 2 || threads < 1 || ubatch < 1 || !read_ids(&ids, &count) || count < 2) {
        fprintf(stderr, "need WINDOW >= 2, THREADS >= 1, UBATCH >= 1 and at least 2 integer ids on stdin\n");
        return 2;
    }
    llama_backend_init();
    struct llama_model_params model_params = llama_model_default_params();
    model_params.use_extra_bufts = repack != 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], model_params);
    if (!model) return 3;
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= vocab) {
            fprintf(stderr, "token id %d at position %d is outside the model's vocabulary of %d\n", ids[i], i, vocab);
            return 2;
        }
    }
    struct llama_context_params context_params = llama_context_default_params();
    context_params.n_ctx = window;
    context_params.n_batch = window;
    context_params.n_ubatch = ubatch < window ? ubatch : window;
    context_params.n_threads = context_params.n_threads_batch = threads;
    struct llama_context * ctx = llama_init_from_model(model, context_params);
    if (!ctx) return 3;
    struct llama_batch batch = llama_batch_init(window, 0, 1);
    double nll = 0.0, * per_token = malloc(count * sizeof(double));
    long scored = 0;
    if (!per_token) return 2;
    for (int start = 0; start < count - 1; start += window) {
        int length = count - start < window ? count - start : window;
        if (length < 2) break;
        llama_memory_clear(llama_get_memory(ctx), 1); /* each window without context */
        batch.n_tokens = length;
        for (int i = 0; i < length; i++) {
            batch.token[i] = ids[start + i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i < length - 1; /* the last position predicts past the window */
        }
        if (llama_decode(ctx, batch) != 0) return 4;
        for (int i = 0; i < length - 1; i++) {
            per_token[scored] = negative_log_likelihood(llama_get_logits_ith(ctx, i), vocab, ids[start + i + 1]);
            nll += per_token[scored++];
        }
    }
    printf("{\"nll\": %.10f, \"tokens\": %ld, \"vocab\": %d, \"per_token\": [", nll, scored, vocab);
    for (long k = 0; k < scored; k++) printf(k ? ", %.8f" : "%.8f", per_token[k]);
    printf("]}\n");
    free(per_token);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    free(ids);
    return 0;
}
