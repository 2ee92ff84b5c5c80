/*
 * Loads a flashnext model, decodes a token sequence, prints the five most
 * likely next tokens with their probabilities and the decode speed.
 *
 *   decode MODEL.gguf [TOKEN ...]
 *
 * Without tokens it decodes a fixed short sequence. Exit status 0 on
 * success, 1 on any error (the message comes from fnx_last_error()).
 */
#include "flashnext.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int fail(const char *what, fnx_status st) {
    fprintf(stderr, "%s failed: %s: %s\n", what, fnx_status_name(st), fnx_last_error());
    return 1;
}

static double now_seconds(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    static const int32_t default_tokens[] = {1, 17, 42, 5, 99, 3, 64, 12};
    fnx_model *model = NULL;
    fnx_state *state = NULL;
    float *logits = NULL;
    int32_t *tokens = NULL;
    size_t n_tokens, vocab, i, k;
    int rc = 1;
    fnx_status st;
    double t0, elapsed, max, sum;
    size_t top[5];

    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [TOKEN ...]\n", argv[0]);
        return 2;
    }
    printf("flashnext %s\n", fnx_version());

    st = fnx_load(argv[1], NULL, &model);
    if (st != FNX_OK) return fail("fnx_load", st);
    vocab = fnx_model_vocab_size(model);

    n_tokens = argc > 2 ? (size_t)(argc - 2) : sizeof default_tokens / sizeof default_tokens[0];
    tokens = malloc(n_tokens * sizeof *tokens);
    logits = malloc(vocab * sizeof *logits);
    if (tokens == NULL || logits == NULL) {
        fprintf(stderr, "out of memory\n");
        goto done;
    }
    for (i = 0; i < n_tokens; i++) {
        if (argc > 2) {
            char *end;
            long v = strtol(argv[i + 2], &end, 10);
            if (*end != '\0') {
                fprintf(stderr, "not a token id: %s\n", argv[i + 2]);
                goto done;
            }
            tokens[i] = (int32_t)v;
        } else {
            tokens[i] = default_tokens[i] % (int32_t)vocab;
        }
    }

    st = fnx_new_state(model, &state);
    if (st != FNX_OK) {
        rc = fail("fnx_new_state", st);
        goto done;
    }

    t0 = now_seconds();
    for (i = 0; i < n_tokens; i++) {
        st = fnx_decode_token(state, tokens[i]);
        if (st != FNX_OK) {
            rc = fail("fnx_decode_token", st);
            goto done;
        }
    }
    elapsed = now_seconds() - t0;

    st = fnx_get_logits(state, logits, vocab);
    if (st != FNX_OK) {
        rc = fail("fnx_get_logits", st);
        goto done;
    }

    /* Softmax, then the five largest probabilities. */
    max = logits[0];
    for (i = 1; i < vocab; i++)
        if (logits[i] > max) max = logits[i];
    sum = 0.0;
    for (i = 0; i < vocab; i++) sum += exp(logits[i] - max);
    for (k = 0; k < 5 && k < vocab; k++) {
        size_t best = vocab;
        for (i = 0; i < vocab; i++) {
            size_t j;
            int taken = 0;
            for (j = 0; j < k; j++) taken |= top[j] == i;
            if (!taken && (best == vocab || logits[i] > logits[best])) best = i;
        }
        top[k] = best;
        printf("top%zu token %zu p=%.6f logit=%.6f\n", k + 1, best, exp(logits[best] - max) / sum,
               (double)logits[best]);
    }
    printf("decoded %zu tokens at position %zu in %.3f s: %.1f tok/s\n", n_tokens,
           fnx_state_position(state), elapsed, elapsed > 0 ? (double)n_tokens / elapsed : 0.0);
    rc = 0;

done:
    fnx_free_state(state);
    fnx_free_model(model);
    free(logits);
    free(tokens);
    return rc;
}
