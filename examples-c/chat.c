/*
 * chat: an interactive, streaming chat on a flashnext model.
 *
 *   chat MODEL [--max-tokens N] [--seed S] [--preset thinking|instruct|greedy]
 *              [--system TEXT] [--ctx N]
 *
 * Type a message and press Enter; the reply streams as it is generated.
 * Commands: /reset forgets the conversation, /quit (or Ctrl-D) exits, Ctrl-C
 * interrupts a reply (and exits when pressed at the prompt).
 *
 * Each turn renders the whole conversation with the model's chat template
 * (fnx_apply_chat_template), tokenizes it, decodes only the tokens the state
 * does not hold yet (keeping a copy of the state after each prompt, for when
 * the reply re-tokenizes differently), and generates with a sampler preset;
 * the pieces arrive through fnx_generate's callback. Diagnostics go to stderr, the
 * conversation to stdout.
 *
 * Build: cc -std=c11 -Iinclude examples-c/chat.c -Ltarget/release -lflashnext
 */
#define _POSIX_C_SOURCE 200809L

#include "flashnext.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    char *role;
    char *content;
} message;

typedef struct {
    message *items;
    size_t n, cap;
} conversation;

typedef struct {
    int32_t *items;
    size_t n, cap;
} tokens;

typedef struct {
    char *data;
    size_t len, cap;
} text;

static volatile sig_atomic_t interrupted = 0;

static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

static void *xrealloc(void *p, size_t size) {
    void *q = realloc(p, size ? size : 1);
    if (!q) {
        fprintf(stderr, "chat: out of memory\n");
        exit(1);
    }
    return q;
}

static char *xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = xrealloc(NULL, n);
    memcpy(d, s, n);
    return d;
}

static void conversation_add(conversation *c, const char *role, const char *content) {
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 8;
        c->items = xrealloc(c->items, c->cap * sizeof *c->items);
    }
    c->items[c->n].role = xstrdup(role);
    c->items[c->n].content = xstrdup(content);
    c->n++;
}

static void conversation_truncate(conversation *c, size_t n) {
    while (c->n > n) {
        c->n--;
        free(c->items[c->n].role);
        free(c->items[c->n].content);
    }
}

static void tokens_push(tokens *t, int32_t token) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 256;
        t->items = xrealloc(t->items, t->cap * sizeof *t->items);
    }
    t->items[t->n++] = token;
}

static void tokens_copy(tokens *dst, const tokens *src) {
    dst->n = 0;
    for (size_t i = 0; i < src->n; i++) tokens_push(dst, src->items[i]);
}

/* Whether `a` is a prefix of `b`. */
static bool is_prefix(const tokens *a, const tokens *b) {
    if (a->n > b->n) return false;
    for (size_t i = 0; i < a->n; i++)
        if (a->items[i] != b->items[i]) return false;
    return true;
}

static void text_append(text *t, const char *s, size_t len) {
    if (t->len + len + 1 > t->cap) {
        while (t->len + len + 1 > t->cap) t->cap = t->cap ? 2 * t->cap : 256;
        t->data = xrealloc(t->data, t->cap);
    }
    memcpy(t->data + t->len, s, len);
    t->len += len;
    t->data[t->len] = '\0';
}

static void report(const char *what, fnx_status status) {
    fprintf(stderr, "chat: %s failed: %s: %s\n", what, fnx_status_name(status), fnx_last_error());
}

static void on_log(int32_t level, const char *message, void *user_data) {
    (void)user_data;
    if (level <= FNX_LOG_WARN) fprintf(stderr, "[flashnext] %s\n", message);
}

static bool should_abort(void *user_data) {
    (void)user_data;
    return interrupted != 0;
}

/* Renders the conversation (NUL-terminated, caller frees) with the size query. */
static fnx_status render(const fnx_model *model, const conversation *c, char **out) {
    fnx_chat_message *msgs = xrealloc(NULL, c->n * sizeof *msgs);
    for (size_t i = 0; i < c->n; i++) {
        msgs[i].role = c->items[i].role;
        msgs[i].content = c->items[i].content;
        msgs[i].reasoning_content = NULL;
        msgs[i].tool_calls_json = NULL;
    }
    size_t len = 0;
    fnx_status st = fnx_apply_chat_template(model, NULL, msgs, c->n, NULL, true, false, NULL, 0, &len);
    if (st == FNX_OK || st == FNX_ERR_BUFFER_TOO_SMALL) {
        char *buf = xrealloc(NULL, len + 1);
        st = fnx_apply_chat_template(model, NULL, msgs, c->n, NULL, true, false, buf, len, &len);
        if (st == FNX_OK) {
            buf[len] = '\0';
            *out = buf;
        } else {
            free(buf);
        }
    }
    free(msgs);
    return st;
}

/* Tokenizes `s` with special tokens parsed (the template wrote them) into `t`. */
static fnx_status tokenize(const fnx_model *model, const char *s, tokens *t) {
    size_t n = 0;
    size_t len = strlen(s);
    fnx_status st = fnx_tokenize(model, s, len, false, true, NULL, 0, &n);
    if (st != FNX_OK && st != FNX_ERR_BUFFER_TOO_SMALL) return st;
    t->n = 0;
    if (n > t->cap) {
        t->cap = n;
        t->items = xrealloc(t->items, t->cap * sizeof *t->items);
    }
    st = fnx_tokenize(model, s, len, false, true, t->items, t->cap, &n);
    if (st == FNX_OK) t->n = n;
    return st;
}

/* The text of `t` without special tokens (NUL-terminated, caller frees). */
static fnx_status detokenize(const fnx_model *model, const tokens *t, char **out) {
    size_t len = 0;
    fnx_status st = fnx_detokenize(model, t->items, t->n, true, NULL, 0, &len);
    if (st != FNX_OK && st != FNX_ERR_BUFFER_TOO_SMALL) return st;
    char *buf = xrealloc(NULL, len + 1);
    st = fnx_detokenize(model, t->items, t->n, true, buf, len, &len);
    if (st != FNX_OK) {
        free(buf);
        return st;
    }
    buf[len] = '\0';
    *out = buf;
    return FNX_OK;
}

typedef struct {
    tokens generated;
    text streamed;
} reply;

static bool on_token(int32_t token, const char *piece, size_t piece_len, void *user_data) {
    reply *r = user_data;
    tokens_push(&r->generated, token);
    text_append(&r->streamed, piece, piece_len);
    fwrite(piece, 1, piece_len, stdout);
    fflush(stdout);
    return true;
}

static void usage(void) {
    fprintf(stderr,
            "usage: chat MODEL [--max-tokens N] [--seed S] [--preset thinking|instruct|greedy]\n"
            "                  [--system TEXT] [--ctx N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *preset = "instruct", *system_prompt = NULL;
    unsigned long max_tokens = 256, n_ctx = 0;
    unsigned long long seed = FNX_SEED_RANDOM;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = strtoul(argv[++i], NULL, 10);
        } else if (strcmp(a, "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(a, "--preset") == 0 && i + 1 < argc) {
            preset = argv[++i];
        } else if (strcmp(a, "--system") == 0 && i + 1 < argc) {
            system_prompt = argv[++i];
        } else if (strcmp(a, "--ctx") == 0 && i + 1 < argc) {
            n_ctx = strtoul(argv[++i], NULL, 10);
        } else if (a[0] == '-' || model_path) {
            usage();
        } else {
            model_path = a;
        }
    }
    if (!model_path) usage();

    int rc = 1;
    fnx_model *model = NULL;
    fnx_state *state = NULL;
    fnx_state *checkpoint = NULL; /* a copy of `state` after the last prompt */
    fnx_sampler *sampler = NULL;
    conversation conv = {0};
    tokens history = {0}; /* what the state holds */
    tokens prompt = {0};
    tokens checkpoint_tokens = {0}; /* what `checkpoint` holds */
    reply r = {{0}, {0}};
    char *line = NULL;
    size_t line_cap = 0;
    const bool interactive = isatty(STDIN_FILENO) != 0;
    fnx_status st;

    fnx_set_log_callback(on_log, NULL);
    fnx_load_params lp = fnx_load_params_default();
    lp.n_ctx = (uint32_t)n_ctx;
    if ((st = fnx_load(model_path, &lp, &model)) != FNX_OK) {
        report("loading the model", st);
        goto done;
    }
    fnx_sampler_params sp;
    if ((st = fnx_sampler_params_preset(preset, &sp)) != FNX_OK) {
        report("choosing the sampler preset", st);
        goto done;
    }
    sp.seed = seed;
    if ((st = fnx_sampler_new(&sp, &sampler)) != FNX_OK || (st = fnx_new_state(model, &state)) != FNX_OK) {
        report("creating the sampler and state", st);
        goto done;
    }
    fnx_state_set_abort_callback(state, should_abort, NULL);
    /* No SA_RESTART: Ctrl-C at the prompt interrupts getline and exits. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    if (system_prompt) conversation_add(&conv, "system", system_prompt);
    const size_t n_fixed = conv.n;
    fprintf(stderr, "flashnext %s: %s (context %zu). /reset forgets, /quit or Ctrl-D exits.\n", fnx_version(),
            model_path, fnx_model_context_length(model));

    for (;;) {
        if (interactive) {
            fputs("you> ", stdout);
            fflush(stdout);
        }
        interrupted = 0;
        ssize_t got = getline(&line, &line_cap, stdin);
        if (got < 0 || interrupted) {
            if (interactive) putchar('\n');
            break;
        }
        while (got > 0 && (line[got - 1] == '\n' || line[got - 1] == '\r')) line[--got] = '\0';
        if (got == 0) continue;
        if (strcmp(line, "/quit") == 0) break;
        if (strcmp(line, "/reset") == 0) {
            conversation_truncate(&conv, n_fixed);
            history.n = 0;
            fnx_state_reset(state);
            fnx_free_state(checkpoint);
            checkpoint = NULL;
            checkpoint_tokens.n = 0;
            fnx_sampler_reset(sampler);
            puts("(conversation reset)");
            continue;
        }

        /* The whole conversation, rendered and tokenized. */
        conversation_add(&conv, "user", line);
        char *rendered = NULL;
        if ((st = render(model, &conv, &rendered)) != FNX_OK) {
            report("applying the chat template", st);
            conversation_truncate(&conv, conv.n - 1);
            continue;
        }
        st = tokenize(model, rendered, &prompt);
        free(rendered);
        if (st != FNX_OK) {
            report("tokenizing", st);
            conversation_truncate(&conv, conv.n - 1);
            continue;
        }

        /* Reuse what the state already holds when the new prompt extends it;
         * else go back to the copy taken after the previous prompt (the reply
         * may tokenize differently once rendered as text); else start over. */
        size_t keep = 0;
        if (is_prefix(&history, &prompt)) {
            keep = history.n;
        } else if (checkpoint && is_prefix(&checkpoint_tokens, &prompt)) {
            fnx_state *copy = NULL;
            if ((st = fnx_state_copy(checkpoint, &copy)) != FNX_OK) {
                report("restoring the checkpoint", st);
                goto done;
            }
            fnx_free_state(state);
            state = copy;
            fnx_state_set_abort_callback(state, should_abort, NULL); /* copies do not inherit it */
            tokens_copy(&history, &checkpoint_tokens);
            keep = history.n;
        } else {
            fnx_state_reset(state);
            history.n = 0;
        }
        fprintf(stderr, "[prompt tokens: %zu] (%zu reused)\n", prompt.n, keep);

        /* Decode the new part of the prompt and keep a copy of the state there. */
        if ((st = fnx_decode_tokens(state, prompt.items + keep, prompt.n - keep)) != FNX_OK) {
            if (st == FNX_ERR_ABORTED)
                fputs("(interrupted)\n", stdout);
            else
                report("decoding the prompt", st);
            if (st == FNX_ERR_CONTEXT_FULL) fputs("(the conversation is too long: /reset to start over)\n", stdout);
            conversation_truncate(&conv, conv.n - 1);
            continue;
        }
        for (size_t i = keep; i < prompt.n; i++) tokens_push(&history, prompt.items[i]);
        fnx_free_state(checkpoint);
        checkpoint = NULL;
        if ((st = fnx_state_copy(state, &checkpoint)) != FNX_OK) {
            report("copying the state", st);
            goto done;
        }
        tokens_copy(&checkpoint_tokens, &history);

        /* Generate from the prompt's logits, streaming the pieces. */
        fnx_generate_params gp = fnx_generate_params_default();
        gp.max_tokens = (uint32_t)max_tokens;
        gp.sampler = sampler;
        r.generated.n = 0;
        r.streamed.len = 0;
        fputs("assistant> ", stdout);
        fflush(stdout);
        size_t n_generated = 0;
        st = fnx_generate(state, NULL, 0, &gp, on_token, &r, &n_generated);
        putchar('\n');
        fflush(stdout);
        if (st != FNX_OK) {
            /* The state is as it was: drop the unanswered turn. */
            if (st == FNX_ERR_ABORTED)
                fputs("(interrupted)\n", stdout);
            else
                report("generating", st);
            conversation_truncate(&conv, conv.n - 1);
            continue;
        }
        for (size_t i = 0; i < r.generated.n; i++) tokens_push(&history, r.generated.items[i]);
        fprintf(stderr, "[generated %zu tokens, %zu streamed bytes, position %zu]\n", n_generated, r.streamed.len,
                fnx_state_position(state));

        /* The reply joins the conversation as text, without special tokens. */
        char *answer = NULL;
        if ((st = detokenize(model, &r.generated, &answer)) != FNX_OK) {
            report("detokenizing", st);
            goto done;
        }
        conversation_add(&conv, "assistant", answer);
        free(answer);
    }
    rc = 0;

done:
    fnx_set_log_callback(NULL, NULL);
    free(line);
    conversation_truncate(&conv, 0);
    free(conv.items);
    free(history.items);
    free(prompt.items);
    free(checkpoint_tokens.items);
    free(r.generated.items);
    free(r.streamed.data);
    fnx_sampler_free(sampler);
    fnx_free_state(checkpoint);
    fnx_free_state(state);
    fnx_free_model(model);
    return rc;
}
