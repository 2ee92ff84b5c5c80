// flashnext.hpp: header-only C++17 RAII wrapper over the flashnext C API
// (flashnext.h). Link with -lflashnext as for C.
//
//   flashnext::Model model("model.gguf");
//   flashnext::State state(model);
//   flashnext::Sampler sampler("instruct");
//   flashnext::GenerateOptions opts;
//   opts.max_tokens = 64;
//   opts.sampler = &sampler;
//   std::string prompt = model.apply_chat_template({{"user", "Hello"}});
//   state.generate(model.tokenize(prompt, false, true), opts,
//                  [](int32_t, std::string_view piece) { std::cout << piece; return true; });
//
//   // Or without blocking, from a frame loop:
//   flashnext::Job job(state, prompt, opts);  // another state, or this one after the call above
//   std::string reply;
//   while (!job.finished()) { reply += job.poll(); /* ... draw the frame ... */ }
//   std::string json = flashnext::chat_parse(reply);  // content, reasoning, tool calls
//
// Handles are move-only and freed by their destructors. Every failure throws
// flashnext::Error, carrying the status code and fnx_last_error()'s message.
// Exceptions thrown by callbacks are caught before they reach the C library
// and rethrown once the C call has returned.

#ifndef FLASHNEXT_HPP
#define FLASHNEXT_HPP

#include "flashnext.h"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flashnext {

// A failed call: the status (one of the FNX_ERR_* codes), its name and the message.
class Error : public std::runtime_error {
public:
    Error(fnx_status status, const std::string &message)
        : std::runtime_error(std::string(fnx_status_name(status)) + ": " + message),
          status_(status), message_(message) {}

    fnx_status status() const noexcept { return status_; }
    const char *status_name() const noexcept { return fnx_status_name(status_); }
    const std::string &message() const noexcept { return message_; }

private:
    fnx_status status_;
    std::string message_;
};

namespace detail {

inline void check(fnx_status status) {
    if (status != FNX_OK) {
        const char *msg = fnx_last_error();
        throw Error(status, msg ? msg : "");
    }
}

// Holds an exception thrown inside a callback until the C call returns.
struct Pending {
    std::exception_ptr error;
    void rethrow() {
        if (error) {
            std::exception_ptr e = error;
            error = nullptr;
            std::rethrow_exception(e);
        }
    }
};

template <typename T, void (*Free)(T *)>
struct Deleter {
    void operator()(T *p) const noexcept { Free(p); }
};

// Runs `call(buffer, capacity, &len)` with the C API's size query: on
// FNX_ERR_BUFFER_TOO_SMALL `len` is the size needed and the call is retried.
template <typename Buffer, typename Call>
Buffer sized(Call call, size_t capacity) {
    Buffer buf;
    for (int attempt = 0;; attempt++) {
        buf.resize(capacity > 0 ? capacity : 1);
        size_t len = 0;
        fnx_status status = call(&buf[0], buf.size(), &len);
        if (status == FNX_ERR_BUFFER_TOO_SMALL && len > buf.size() && attempt < 4) {
            capacity = len;
            continue;
        }
        check(status);
        buf.resize(len);
        return buf;
    }
}

inline const char *c_str_or_null(const std::optional<std::string> &s) { return s ? s->c_str() : nullptr; }

}  // namespace detail

// The library version, e.g. "0.1.0".
inline std::string version() { return fnx_version(); }

// Sends log messages to `callback(level, message)` (level: FNX_LOG_*); an
// empty function silences them. Process-wide; the callback may run on any
// thread using flashnext, and exceptions it throws are dropped.
inline void set_log_callback(std::function<void(int32_t, const char *)> callback) {
    static std::mutex lock;
    static std::function<void(int32_t, const char *)> current;
    std::lock_guard<std::mutex> guard(lock);
    if (!callback) {
        fnx_set_log_callback(nullptr, nullptr);
        current = nullptr;
        return;
    }
    // Detach before replacing the function the trampoline calls.
    fnx_set_log_callback(nullptr, nullptr);
    current = std::move(callback);
    fnx_set_log_callback(
        [](int32_t level, const char *message, void *user_data) {
            try {
                (*static_cast<std::function<void(int32_t, const char *)> *>(user_data))(level, message);
            } catch (...) {
            }
        },
        &current);
}

// Options for Model's constructor (fnx_load_params with its defaults).
struct LoadOptions {
    uint32_t n_threads = 0;
    uint32_t n_ctx = 0;
    int32_t backend = FNX_BACKEND_AUTO;
    int32_t device_index = 0;
    uint64_t vram_budget_mb = 0;
    int32_t expert_cache_slots = -1;   // -1: as the budget allows
    uint32_t rewind_window = 0;        // 0: the default (4)
    std::optional<std::string> routing_profile;
    int32_t spin_wait = -1;            // -1: spin through GPU waits unless the device is a CPU
    uint32_t micro_batch = 0;          // prompt tokens computed together; 0: the default (512)
    // Called with 0..1 as the load advances; return false to cancel.
    std::function<bool(float)> progress;
};

class State;

// One message of a conversation for Model::apply_chat_template. Absent
// optional fields are passed as NULL (e.g. an assistant turn with tool calls
// and no content).
struct ChatMessage {
    std::string role;                              // "system", "user", "assistant" or "tool"
    std::optional<std::string> content;
    std::optional<std::string> reasoning_content;  // an assistant turn's thinking
    std::optional<std::string> tool_calls_json;    // a JSON array of tool calls
};

// Options of Model::apply_chat_template.
struct ChatOptions {
    bool add_generation_prompt = true;          // end with a new assistant turn's header
    bool enable_thinking = true;                // passed to the template
    std::optional<std::string> tools_json;      // a JSON array of tool schemas
    std::optional<std::string> template_source; // Jinja source replacing the model's template
};

// A loaded model. Move-only; share it between threads freely (const use).
class Model {
public:
    explicit Model(const std::string &path, const LoadOptions &options = LoadOptions()) {
        fnx_load_params params = fnx_load_params_default();
        params.n_threads = options.n_threads;
        params.n_ctx = options.n_ctx;
        params.backend = options.backend;
        params.device_index = options.device_index;
        params.vram_budget_mb = options.vram_budget_mb;
        params.expert_cache_slots = options.expert_cache_slots;
        params.rewind_window = options.rewind_window;
        params.routing_profile = options.routing_profile ? options.routing_profile->c_str() : nullptr;
        params.spin_wait = options.spin_wait;
        params.micro_batch = options.micro_batch;
        struct Progress {
            const std::function<bool(float)> *fn;
            detail::Pending pending;
        } progress{&options.progress, {}};
        if (options.progress) {
            params.progress_callback = [](float fraction, void *user_data) -> bool {
                auto *p = static_cast<Progress *>(user_data);
                if (p->pending.error) return false;
                try {
                    return (*p->fn)(fraction);
                } catch (...) {
                    p->pending.error = std::current_exception();
                    return false;
                }
            };
            params.progress_user_data = &progress;
        }
        fnx_model *model = nullptr;
        fnx_status status = fnx_load(path.c_str(), &params, &model);
        progress.pending.rethrow();
        detail::check(status);
        handle_.reset(model);
    }

    fnx_model *get() const noexcept { return handle_.get(); }
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    size_t vocab_size() const noexcept { return fnx_model_vocab_size(get()); }
    size_t context_length() const noexcept { return fnx_model_context_length(get()); }
    size_t n_layers() const noexcept { return fnx_model_n_layers(get()); }
    size_t hidden_size() const noexcept { return fnx_model_hidden_size(get()); }
    // The end-of-sequence token, or -1 when the file names none.
    int64_t eos_token() const noexcept { return fnx_model_eos_token(get()); }

    // The token ids of UTF-8 `text`. `parse_special` turns special-token text
    // such as "<|im_start|>" into those tokens (leave it off for untrusted text).
    std::vector<int32_t> tokenize(std::string_view text, bool add_special = false,
                                  bool parse_special = false) const {
        return detail::sized<std::vector<int32_t>>(
            [&](int32_t *out, size_t cap, size_t *len) {
                return fnx_tokenize(get(), text.data(), text.size(), add_special, parse_special, out, cap, len);
            },
            text.size() + 8);
    }

    // The bytes of one token (possibly part of a UTF-8 character).
    std::string token_to_piece(int32_t token, bool special = true) const {
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) {
                return fnx_token_to_piece(get(), token, special, out, cap, len);
            },
            32);
    }

    // The text of `tokens` (invalid UTF-8 becomes U+FFFD).
    std::string detokenize(const std::vector<int32_t> &tokens, bool remove_special = false) const {
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) {
                return fnx_detokenize(get(), tokens.data(), tokens.size(), remove_special, out, cap, len);
            },
            tokens.size() * 8 + 16);
    }

    // Renders a conversation with the model's chat template (or
    // options.template_source); tokenize the result with parse_special = true.
    std::string apply_chat_template(const std::vector<ChatMessage> &messages,
                                    const ChatOptions &options = ChatOptions()) const {
        std::vector<fnx_chat_message> raw;
        raw.reserve(messages.size());
        size_t guess = 256;
        for (const ChatMessage &m : messages) {
            raw.push_back(fnx_chat_message{m.role.c_str(), detail::c_str_or_null(m.content),
                                           detail::c_str_or_null(m.reasoning_content),
                                           detail::c_str_or_null(m.tool_calls_json)});
            guess += m.role.size() + (m.content ? m.content->size() : 0) + 32;
        }
        // The buffer's size is also the most the C API lets the text take
        // (when it is above FNX_CHAT_TEMPLATE_MAX_BYTES): leave room.
        guess = 2 * guess + (options.tools_json ? 2 * options.tools_json->size() : 0);
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) {
                return fnx_apply_chat_template(get(), detail::c_str_or_null(options.template_source), raw.data(),
                                               raw.size(), detail::c_str_or_null(options.tools_json),
                                               options.add_generation_prompt, options.enable_thinking, out, cap,
                                               len);
            },
            guess);
    }

private:
    std::unique_ptr<fnx_model, detail::Deleter<fnx_model, fnx_free_model>> handle_;
};

// A sampler: settings, seeded random generator, accepted tokens. Move-only.
class Sampler {
public:
    // The default settings (temperature 1, no truncation, random seed).
    Sampler() : Sampler(fnx_sampler_params_default()) {}

    // A named preset: "thinking", "instruct" or "greedy".
    explicit Sampler(const std::string &preset) : Sampler(preset_params(preset)) {}

    explicit Sampler(const fnx_sampler_params &params) {
        fnx_sampler *s = nullptr;
        detail::check(fnx_sampler_new(&params, &s));
        handle_.reset(s);
    }

    // A preset's settings, to change before constructing a Sampler.
    static fnx_sampler_params preset_params(const std::string &name) {
        fnx_sampler_params p = fnx_sampler_params_default();
        detail::check(fnx_sampler_params_preset(name.c_str(), &p));
        return p;
    }

    fnx_sampler *get() const noexcept { return handle_.get(); }

    int32_t sample(const float *logits, size_t n) {
        int32_t token = -1;
        detail::check(fnx_sampler_sample(get(), logits, n, &token));
        return token;
    }
    int32_t sample(const std::vector<float> &logits) { return sample(logits.data(), logits.size()); }
    void accept(int32_t token) { detail::check(fnx_sampler_accept(get(), token)); }
    void reset() { detail::check(fnx_sampler_reset(get())); }

    // Structured output: the sampled tokens follow a grammar of `kind`
    // (FNX_CONSTRAINT_JSON_SCHEMA, FNX_CONSTRAINT_REGEX or FNX_CONSTRAINT_LARK)
    // compiled for `model`'s vocabulary. Throws Error (FNX_ERR_INVALID_ARGUMENT,
    // with the compiler's message) for a bad schema or grammar; the sampler is
    // then unchanged.
    void set_constraint(const Model &model, int32_t kind, const std::string &text) {
        detail::check(fnx_sampler_set_constraint(get(), model.get(), kind, text.c_str()));
    }
    // Removes the constraint.
    void clear_constraint() { detail::check(fnx_sampler_set_constraint(get(), nullptr, FNX_CONSTRAINT_NONE, nullptr)); }

private:
    std::unique_ptr<fnx_sampler, detail::Deleter<fnx_sampler, fnx_sampler_free>> handle_;
};

// Turns a stream of tokens into text, never splitting a UTF-8 character.
// Move-only; one thread at a time.
class Detokenizer {
public:
    explicit Detokenizer(const Model &model) {
        fnx_detokenizer *d = nullptr;
        detail::check(fnx_detokenizer_new(model.get(), &d));
        handle_.reset(d);
    }

    fnx_detokenizer *get() const noexcept { return handle_.get(); }

    // Adds a token; returns the text it completes (possibly empty).
    std::string push(int32_t token) {
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) { return fnx_detokenizer_push(get(), token, out, cap, len); },
            64);
    }

    // Ends the stream: what was held back (an unfinished character as U+FFFD).
    std::string flush() {
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) { return fnx_detokenizer_flush(get(), out, cap, len); }, 16);
    }

private:
    std::unique_ptr<fnx_detokenizer, detail::Deleter<fnx_detokenizer, fnx_detokenizer_free>> handle_;
};

// Options for State::generate (fnx_generate_params).
struct GenerateOptions {
    uint32_t max_tokens = 0;                 // 0 = no limit
    Sampler *sampler = nullptr;              // nullptr = greedy
    std::vector<int32_t> stop_tokens;        // besides the model's EOS
    std::vector<std::string> stop_strings;   // stop once the text contains one
    bool ignore_eos = false;                 // true: the EOS token does not stop
};

namespace detail {

// fnx_generate_params for `options`; valid while `options` and this object live.
struct Params {
    fnx_generate_params params = fnx_generate_params_default();
    std::vector<const char *> stops;

    explicit Params(const GenerateOptions &options) {
        params.max_tokens = options.max_tokens;
        params.sampler = options.sampler ? options.sampler->get() : nullptr;
        params.stop_tokens = options.stop_tokens.data();
        params.n_stop_tokens = options.stop_tokens.size();
        stops.reserve(options.stop_strings.size());
        for (const std::string &s : options.stop_strings) stops.push_back(s.c_str());
        params.stop_strings = stops.data();
        params.n_stop_strings = stops.size();
        params.ignore_eos = options.ignore_eos;
    }
};

}  // namespace detail

// Receives each generated token and its text (UTF-8, whole characters);
// return false to stop after it.
using TokenCallback = std::function<bool(int32_t token, std::string_view piece)>;

// The decode state of one sequence. Move-only; one thread at a time.
class State {
public:
    explicit State(const Model &model) : State(model.get(), model.vocab_size()) {}

    fnx_state *get() const noexcept { return handle_.get(); }

    size_t position() const noexcept { return fnx_state_position(get()); }

    void decode(int32_t token) { call(fnx_decode_token(get(), token)); }
    void decode(const int32_t *tokens, size_t n) { call(fnx_decode_tokens(get(), tokens, n)); }
    void decode(const std::vector<int32_t> &tokens) { decode(tokens.data(), tokens.size()); }
    // decode(), keeping every position's logits for logits(i) until the next decode.
    void decode_batch(const std::vector<int32_t> &tokens) {
        call(fnx_decode_batch(get(), tokens.data(), tokens.size(), true));
    }

    // The logits of the last decoded token (vocab_size floats).
    std::vector<float> logits() const {
        std::vector<float> out(vocab_);
        detail::check(fnx_get_logits(get(), out.data(), out.size()));
        return out;
    }

    // The logits after the i-th token of the last decode_batch().
    std::vector<float> logits(size_t i) const {
        std::vector<float> out(vocab_);
        detail::check(fnx_get_logits_ith(get(), i, out.data(), out.size()));
        return out;
    }

    void reset() { detail::check(fnx_state_reset(get())); }

    // Back to `position` (rewind_floor() .. position()) without copying anything.
    void rewind(size_t position) { call(fnx_state_rewind(get(), position)); }
    size_t rewind_floor() const {
        size_t floor = 0;
        detail::check(fnx_state_rewind_floor(get(), &floor));
        return floor;
    }

    // A snapshot of the state, for load().
    std::vector<uint8_t> save() const {
        size_t size = 0;
        detail::check(fnx_state_save_size(get(), &size));
        std::vector<uint8_t> out(size);
        size_t written = 0;
        detail::check(fnx_state_save(get(), out.data(), out.size(), &written));
        out.resize(written);
        return out;
    }

    void load(const uint8_t *data, size_t size) { call(fnx_state_load(get(), data, size)); }
    void load(const std::vector<uint8_t> &snapshot) { load(snapshot.data(), snapshot.size()); }

    // An independent copy (same sequence so far; no abort callback).
    State copy() const {
        fnx_state *s = nullptr;
        detail::check(fnx_state_copy(get(), &s));
        return State(s, vocab_);
    }

    // `callback()` is polled before each decoded token; true aborts the call
    // (Error with FNX_ERR_ABORTED, state unchanged). An empty function removes it.
    void set_abort_callback(std::function<bool()> callback) {
        if (!abort_) abort_.reset(new Abort());
        if (!callback) {
            detail::check(fnx_state_set_abort_callback(get(), nullptr, nullptr));
            abort_->fn = nullptr;
            return;
        }
        abort_->fn = std::move(callback);
        detail::check(fnx_state_set_abort_callback(
            get(),
            [](void *user_data) -> bool {
                auto *a = static_cast<Abort *>(user_data);
                if (a->pending.error) return true;
                try {
                    return a->fn();
                } catch (...) {
                    a->pending.error = std::current_exception();
                    return true;
                }
            },
            abort_.get()));
    }

    // Decodes `prompt`, then generates (see fnx_generate); returns the number
    // of generated tokens. An exception from `on_token` stops generation and
    // is rethrown (the tokens generated so far stay decoded).
    size_t generate(const std::vector<int32_t> &prompt, const GenerateOptions &options = GenerateOptions(),
                    const TokenCallback &on_token = TokenCallback()) {
        detail::Params p(options);
        fnx_generate_params &params = p.params;

        struct Ctx {
            const TokenCallback *fn;
            detail::Pending pending;
        } ctx{&on_token, {}};
        fnx_token_callback trampoline = nullptr;
        if (on_token) {
            trampoline = [](int32_t token, const char *piece, size_t len, void *user_data) -> bool {
                auto *c = static_cast<Ctx *>(user_data);
                try {
                    return (*c->fn)(token, std::string_view(piece, len));
                } catch (...) {
                    c->pending.error = std::current_exception();
                    return false;
                }
            };
        }
        size_t n = 0;
        fnx_status status = fnx_generate(get(), prompt.data(), prompt.size(), &params, trampoline, &ctx, &n);
        if (abort_) abort_->pending.rethrow();
        detail::check(status);
        ctx.pending.rethrow();
        return n;
    }

private:
    struct Abort {
        std::function<bool()> fn;
        detail::Pending pending;
    };

    State(fnx_model *model, size_t vocab) : vocab_(vocab), abort_(new Abort()) {
        fnx_state *s = nullptr;
        detail::check(fnx_new_state(model, &s));
        handle_.reset(s);
    }
    State(fnx_state *owned, size_t vocab) : handle_(owned), vocab_(vocab), abort_(new Abort()) {}

    // Checks a decoding call's status, rethrowing an abort callback's exception first.
    void call(fnx_status status) {
        if (abort_) abort_->pending.rethrow();
        detail::check(status);
    }

    std::unique_ptr<fnx_state, detail::Deleter<fnx_state, fnx_free_state>> handle_;
    size_t vocab_;
    // Heap-allocated so that its address (the callback's user_data) survives moves.
    std::unique_ptr<Abort> abort_;
};

// A generation that runs on flashnext's own thread (fnx_job_*), so the
// caller's loop never blocks: poll() for text each frame. The state (and
// the sampler) are the job's while it runs: other calls on them throw Error
// with FNX_ERR_BUSY. Move-only; the destructor cancels a job still running
// and waits for it (it stops before its next token).
class Job {
public:
    // Decodes `prompt`, then generates as State::generate does (everything
    // `options` holds is copied before this returns).
    Job(State &state, const std::vector<int32_t> &prompt, const GenerateOptions &options = GenerateOptions()) {
        detail::Params p(options);
        fnx_job *job = nullptr;
        detail::check(fnx_job_start(state.get(), prompt.data(), prompt.size(), &p.params, &job));
        handle_.reset(job);
    }

    // The prompt as text, tokenized with the model's tokenizer
    // (`parse_special`: true for the output of apply_chat_template).
    Job(State &state, std::string_view text, const GenerateOptions &options = GenerateOptions(),
        bool parse_special = true) {
        detail::Params p(options);
        fnx_job *job = nullptr;
        detail::check(fnx_job_start_text(state.get(), text.data(), text.size(), parse_special, &p.params, &job));
        handle_.reset(job);
    }

    fnx_job *get() const noexcept { return handle_.get(); }

    // Never blocks: the text generated since the last poll (whole UTF-8
    // characters; empty when nothing is new).
    std::string poll() {
        std::string out;
        char buf[4096];
        for (;;) {
            size_t len = 0;
            detail::check(fnx_job_poll(get(), buf, sizeof buf, &len, &n_tokens_, &finished_));
            out.append(buf, len);
            if (len + 4 <= sizeof buf) return out;
        }
    }

    // Whether the last poll() found the job ended and all its text taken.
    bool finished() const noexcept { return finished_; }
    // Tokens generated as of the last poll().
    size_t n_tokens() const noexcept { return n_tokens_; }

    // Asks the job to stop before its next token; returns at once. wait()
    // then throws Error with FNX_ERR_CANCELLED; the state is as before the job.
    void cancel() { detail::check(fnx_job_cancel(get())); }

    // Blocks until the job has ended; returns the number of generated tokens,
    // or throws its failure (FNX_ERR_CANCELLED after cancel()). Text not yet
    // polled stays for poll().
    size_t wait() {
        size_t n = 0;
        detail::check(fnx_job_wait(get(), &n));
        return n;
    }

private:
    std::unique_ptr<fnx_job, detail::Deleter<fnx_job, fnx_job_free>> handle_;
    size_t n_tokens_ = 0;
    bool finished_ = false;
};

// A classified piece of a reply: kind is FNX_CHAT_CONTENT,
// FNX_CHAT_REASONING, FNX_CHAT_TOOL_CALL or FNX_CHAT_TOOL_CALL_END.
struct ChatSegment {
    int32_t kind;
    std::string text;
};

// Splits a reply of a Qwen-family model into visible text, reasoning and
// tool calls as its pieces arrive (fnx_chat_parser_*). Move-only.
class ChatParser {
public:
    // `in_reasoning`: the prompt opened a think block (Qwen's generation
    // prompt with thinking on ends with "<think>\n").
    explicit ChatParser(bool in_reasoning = false) {
        fnx_chat_parser *p = nullptr;
        detail::check(fnx_chat_parser_new(in_reasoning, &p));
        handle_.reset(p);
    }

    fnx_chat_parser *get() const noexcept { return handle_.get(); }

    // Adds a piece; returns the segments it completes (a tag split across
    // pieces waits for the next one).
    std::vector<ChatSegment> push(std::string_view piece) {
        detail::check(fnx_chat_parser_push(get(), piece.data(), piece.size()));
        return take();
    }

    // Ends the reply: the segments still held back.
    std::vector<ChatSegment> finish() {
        detail::check(fnx_chat_parser_finish(get()));
        return take();
    }

    // The message so far as OpenAI-style JSON (see fnx_chat_parse).
    std::string message_json(const std::optional<std::string> &tools_json = std::nullopt) const {
        return detail::sized<std::string>(
            [&](char *out, size_t cap, size_t *len) {
                return fnx_chat_parser_message(get(), detail::c_str_or_null(tools_json), out, cap, len);
            },
            256);
    }

private:
    std::vector<ChatSegment> take() {
        std::vector<ChatSegment> out;
        for (;;) {
            int32_t kind = FNX_CHAT_NONE;
            std::string text = detail::sized<std::string>(
                [&](char *buf, size_t cap, size_t *len) { return fnx_chat_parser_next(get(), &kind, buf, cap, len); },
                256);
            if (kind == FNX_CHAT_NONE) return out;
            out.push_back(ChatSegment{kind, std::move(text)});
        }
    }

    std::unique_ptr<fnx_chat_parser, detail::Deleter<fnx_chat_parser, fnx_chat_parser_free>> handle_;
};

// A whole reply split into its parts, as OpenAI-style JSON: "content",
// "reasoning_content", "tool_calls" (and "invalid_tool_calls"); see fnx_chat_parse.
inline std::string chat_parse(std::string_view reply, bool in_reasoning = false,
                              const std::optional<std::string> &tools_json = std::nullopt) {
    return detail::sized<std::string>(
        [&](char *out, size_t cap, size_t *len) {
            return fnx_chat_parse(reply.data(), reply.size(), in_reasoning, detail::c_str_or_null(tools_json), out,
                                  cap, len);
        },
        reply.size() + 256);
}

}  // namespace flashnext

#endif  // FLASHNEXT_HPP
