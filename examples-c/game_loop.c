/*
 * game_loop: text streams in while a frame loop keeps running.
 *
 *   game_loop MODEL [PROMPT] [--max-tokens N] [--seed S] [--ignore-eos] [--cancel-at-frame F]
 *
 * A game cannot stop drawing while a reply is generated. This program starts
 * the reply as a job (fnx_job_start_text: flashnext generates on a thread of
 * its own), then runs a frame loop at about 1000 frames per second: each
 * frame polls the job (fnx_job_poll never blocks), prints the new text,
 * splits it into visible text and reasoning with a reply parser, and "renders"
 * a frame counter. With --cancel-at-frame the job is cancelled at that frame
 * (fnx_job_cancel), as when the player walks away mid-sentence.
 *
 * The reply goes to stdout; the frame counter and a summary to stderr:
 *   [frame F] N tokens
 *   [frames F, frames with text T, tokens N, bytes B, content C, reasoning R, status S]
 *
 * Build: cc -std=c11 -Iinclude examples-c/game_loop.c -Ltarget/release -lflashnext
 */
#define _POSIX_C_SOURCE 200809L

#include "flashnext.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int fail(const char *what, fnx_status st) {
    fprintf(stderr, "game_loop: %s failed: %s: %s\n", what, fnx_status_name(st), fnx_last_error());
    return 1;
}

static void sleep_ms(long ms) {
    struct timespec t;
    t.tv_sec = ms / 1000;
    t.tv_nsec = (ms % 1000) * 1000000L;
    nanosleep(&t, NULL);
}

/* Takes every pending segment of the parser, counting content and reasoning bytes. */
static fnx_status drain_parser(fnx_chat_parser *parser, size_t *content, size_t *reasoning) {
    char buf[256];
    for (;;) {
        int32_t kind = FNX_CHAT_NONE;
        size_t len = 0;
        fnx_status st = fnx_chat_parser_next(parser, &kind, buf, sizeof buf, &len);
        if (st == FNX_ERR_BUFFER_TOO_SMALL) {
            /* A long segment: take it with a buffer of the size it needs. */
            char *big = malloc(len);
            if (!big) return FNX_ERR_OUT_OF_MEMORY;
            st = fnx_chat_parser_next(parser, &kind, big, len, &len);
            free(big);
        }
        if (st != FNX_OK) return st;
        if (kind == FNX_CHAT_NONE) return FNX_OK;
        if (kind == FNX_CHAT_CONTENT) *content += len;
        if (kind == FNX_CHAT_REASONING) *reasoning += len;
    }
}

int main(int argc, char **argv) {
    const char *model_path = NULL;
    const char *prompt = "Tell me about the sea.";
    unsigned max_tokens = 48;
    unsigned long long seed = 42;
    long cancel_at = -1;
    bool ignore_eos = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = (unsigned)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--ignore-eos") == 0) {
            ignore_eos = true;
        } else if (strcmp(argv[i], "--cancel-at-frame") == 0 && i + 1 < argc) {
            cancel_at = strtol(argv[++i], NULL, 10);
        } else if (!model_path) {
            model_path = argv[i];
        } else {
            prompt = argv[i];
        }
    }
    if (!model_path) {
        fprintf(stderr, "usage: game_loop MODEL [PROMPT] [--max-tokens N] [--seed S] [--ignore-eos] [--cancel-at-frame F]\n");
        return 2;
    }

    fnx_model *model = NULL;
    fnx_state *state = NULL;
    fnx_sampler *sampler = NULL;
    fnx_chat_parser *parser = NULL;
    fnx_job *job = NULL;
    char *chat = NULL;
    int rc = 1;
    fnx_status st = fnx_load(model_path, NULL, &model);
    if (st != FNX_OK) return fail("fnx_load", st);
    if ((st = fnx_new_state(model, &state)) != FNX_OK) {
        fail("fnx_new_state", st);
        goto done;
    }

    /* The prompt as the model's chat template renders it. */
    fnx_chat_message msg = {"user", prompt, NULL, NULL};
    size_t chat_len = 0;
    st = fnx_apply_chat_template(model, NULL, &msg, 1, NULL, true, true, NULL, 0, &chat_len);
    if (st != FNX_ERR_BUFFER_TOO_SMALL && st != FNX_OK) {
        fail("fnx_apply_chat_template", st);
        goto done;
    }
    chat = malloc(chat_len + 1);
    if (!chat || (st = fnx_apply_chat_template(model, NULL, &msg, 1, NULL, true, true, chat, chat_len, &chat_len)) != FNX_OK) {
        fail("fnx_apply_chat_template", chat ? st : FNX_ERR_OUT_OF_MEMORY);
        goto done;
    }

    fnx_sampler_params sp = fnx_sampler_params_default();
    if ((st = fnx_sampler_params_preset("instruct", &sp)) != FNX_OK) {
        fail("fnx_sampler_params_preset", st);
        goto done;
    }
    sp.seed = seed;
    if ((st = fnx_sampler_new(&sp, &sampler)) != FNX_OK) {
        fail("fnx_sampler_new", st);
        goto done;
    }
    /* A template that ends its generation prompt with "<think>\n" opens the think block. */
    bool thinking = chat_len >= 8 && memcmp(chat + chat_len - 8, "<think>\n", 8) == 0;
    if ((st = fnx_chat_parser_new(thinking, &parser)) != FNX_OK) {
        fail("fnx_chat_parser_new", st);
        goto done;
    }

    fnx_generate_params params = fnx_generate_params_default();
    params.max_tokens = max_tokens;
    params.sampler = sampler;
    params.ignore_eos = ignore_eos;
    if ((st = fnx_job_start_text(state, chat, chat_len, true, &params, &job)) != FNX_OK) {
        fail("fnx_job_start_text", st);
        goto done;
    }

    /* While the job runs, the state is the job's. */
    if (fnx_decode_token(state, 0) != FNX_ERR_BUSY) {
        fprintf(stderr, "game_loop: the state was not busy during the job\n");
        goto done;
    }

    long frame = 0, frames_with_text = 0;
    size_t bytes = 0, tokens = 0, content = 0, reasoning = 0;
    bool finished = false;
    while (!finished) {
        char piece[64];
        size_t len = 0;
        /* Never blocks: whatever text is ready (whole UTF-8 characters). */
        if ((st = fnx_job_poll(job, piece, sizeof piece, &len, &tokens, &finished)) != FNX_OK) {
            fail("fnx_job_poll", st);
            goto done;
        }
        if (len > 0) {
            fwrite(piece, 1, len, stdout);
            fflush(stdout);
            bytes += len;
            frames_with_text++;
            if ((st = fnx_chat_parser_push(parser, piece, len)) != FNX_OK ||
                (st = drain_parser(parser, &content, &reasoning)) != FNX_OK) {
                fail("the reply parser", st);
                goto done;
            }
        }
        if (frame % 16 == 0) fprintf(stderr, "[frame %ld] %zu tokens\n", frame, tokens);
        if (frame == cancel_at && (st = fnx_job_cancel(job)) != FNX_OK) {
            fail("fnx_job_cancel", st);
            goto done;
        }
        frame++;
        sleep_ms(1);
    }
    if ((st = fnx_chat_parser_finish(parser)) != FNX_OK || (st = drain_parser(parser, &content, &reasoning)) != FNX_OK) {
        fail("the reply parser", st);
        goto done;
    }

    /* Finished: the outcome comes at once. */
    size_t n_generated = 0;
    fnx_status outcome = fnx_job_wait(job, &n_generated);
    if (outcome != FNX_OK && outcome != FNX_ERR_CANCELLED) {
        fail("the job", outcome);
        goto done;
    }
    printf("\n");
    fprintf(stderr, "[frames %ld, frames with text %ld, tokens %zu, bytes %zu, content %zu, reasoning %zu, status %s]\n",
            frame, frames_with_text, tokens, bytes, content, reasoning, fnx_status_name(outcome));
    rc = 0;

done:
    fnx_job_free(job); /* a job still running would be cancelled and joined */
    fnx_chat_parser_free(parser);
    fnx_sampler_free(sampler);
    fnx_free_state(state);
    fnx_free_model(model);
    free(chat);
    return rc;
}
