// generate: streams a reply to one prompt with the C++ wrapper
// (include/flashnext.hpp), then the same reply as a polled job, the reply
// parsed into its parts, snapshots and the abort callback.
//
//   generate MODEL [PROMPT] [--tokens N] [--seed S] [--preset NAME]
//
// Build: c++ -std=c++17 -Iinclude examples-cpp/generate.cpp -Ltarget/release -lflashnext

#include "flashnext.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Args {
    std::string model;
    std::string prompt = "Write a haiku about the sea.";
    uint32_t tokens = 32;
    uint64_t seed = 42;
    std::string preset = "instruct";
};

[[noreturn]] void usage() {
    std::cerr << "usage: generate MODEL [PROMPT] [--tokens N] [--seed S] [--preset thinking|instruct|greedy]\n";
    std::exit(2);
}

Args parse(int argc, char **argv) {
    Args a;
    bool have_prompt = false;
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage();
            return argv[++i];
        };
        if (arg == "--tokens") {
            a.tokens = static_cast<uint32_t>(std::strtoul(value().c_str(), nullptr, 10));
        } else if (arg == "--seed") {
            a.seed = std::strtoull(value().c_str(), nullptr, 10);
        } else if (arg == "--preset") {
            a.preset = value();
        } else if (arg.rfind("--", 0) == 0) {
            usage();
        } else if (a.model.empty()) {
            a.model = arg;
        } else if (!have_prompt) {
            a.prompt = arg;
            have_prompt = true;
        } else {
            usage();
        }
    }
    if (a.model.empty()) usage();
    return a;
}

// Generates from the state's current logits, collecting tokens and text.
std::vector<int32_t> continue_with(flashnext::State &state, flashnext::Sampler &sampler, uint32_t n,
                                   std::string *text) {
    flashnext::GenerateOptions opts;
    opts.max_tokens = n;
    opts.sampler = &sampler;
    opts.ignore_eos = true;
    std::vector<int32_t> tokens;
    state.generate({}, opts, [&](int32_t token, std::string_view piece) {
        tokens.push_back(token);
        if (text) text->append(piece);
        return true;
    });
    return tokens;
}

}  // namespace

int main(int argc, char **argv) {
    Args args = parse(argc, argv);
    try {
        flashnext::set_log_callback([](int32_t level, const char *message) {
            if (level <= FNX_LOG_WARN) std::cerr << "[flashnext] " << message << "\n";
        });

        flashnext::LoadOptions load;
        int reported = 0;
        load.progress = [&](float fraction) {
            while (reported < static_cast<int>(fraction * 10)) {
                std::cerr << '.';
                reported++;
            }
            return true;
        };
        flashnext::Model model(args.model, load);
        std::cerr << " loaded " << args.model << " (flashnext " << flashnext::version() << ", vocab "
                  << model.vocab_size() << ", " << model.n_layers() << " layers, context " << model.context_length()
                  << ")\n";

        // The prompt, rendered with the model's chat template.
        std::string rendered = model.apply_chat_template({{"user", args.prompt, std::nullopt, std::nullopt}});
        std::vector<int32_t> prompt = model.tokenize(rendered, false, true);
        if (model.detokenize(prompt) != rendered) throw std::runtime_error("tokenize/detokenize round trip failed");

        // The prompt in one batch, every position's logits kept: the last
        // position's are those of the prompt decoded token by token.
        {
            flashnext::State batched(model), stepped(model);
            batched.decode_batch(prompt);
            for (int32_t t : prompt) stepped.decode(t);
            bool same = batched.logits(prompt.size() - 1) == stepped.logits() && batched.logits() == stepped.logits();
            std::cout << "batch: " << (same ? "matches token by token" : "DIFFERENT") << "\n";
            if (!same) return 1;
        }

        fnx_sampler_params sp = flashnext::Sampler::preset_params(args.preset);
        sp.seed = args.seed;
        flashnext::Sampler sampler(sp);
        flashnext::State state(model);

        // Stream the reply: each piece is whole UTF-8 characters.
        flashnext::GenerateOptions opts;
        opts.max_tokens = args.tokens;
        opts.sampler = &sampler;
        std::vector<int32_t> reply;
        std::string streamed;
        auto start = std::chrono::steady_clock::now();
        std::cout << "assistant: " << std::flush;
        size_t n = state.generate(prompt, opts, [&](int32_t token, std::string_view piece) {
            reply.push_back(token);
            streamed.append(piece);
            std::cout << piece << std::flush;
            return true;
        });
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::cout << "\n";
        std::cout << "generated " << n << " tokens after a " << prompt.size() << "-token prompt in " << secs * 1e3
                  << " ms (position " << state.position() << ")\n";

        // The streamed pieces are the reply's text without special tokens (a
        // character left unfinished at the end is dropped).
        std::string expected = model.detokenize(reply, true);
        bool prefix = expected.compare(0, streamed.size(), streamed) == 0;
        std::string rest = prefix ? expected.substr(streamed.size()) : std::string("x");
        while (rest.size() >= 3 && rest.compare(0, 3, "\xEF\xBF\xBD") == 0) rest.erase(0, 3);
        std::cout << "stream: " << (rest.empty() ? "matches detokenize" : "DIFFERENT") << "\n";
        if (!rest.empty()) return 1;

        // The same reply as a job on flashnext's own thread, polled as a frame
        // loop would: the same text.
        {
            flashnext::State job_state(model);
            flashnext::Sampler job_sampler(sp);
            flashnext::GenerateOptions job_opts = opts;
            job_opts.sampler = &job_sampler;
            flashnext::Job job(job_state, rendered, job_opts);
            std::string polled;
            size_t frames = 0;
            while (!job.finished()) {
                polled += job.poll();
                frames++;
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
            size_t job_n = job.wait();
            bool same = polled == streamed && job_n == n;
            std::cout << "job: " << (same ? "matches generate" : "DIFFERENT") << " (" << frames << " frames)\n";
            if (!same) return 1;

            // A job without a limit, cancelled once it has made a few tokens:
            // meanwhile the state is the job's; afterwards it is as before.
            flashnext::GenerateOptions endless;
            endless.ignore_eos = true;
            flashnext::State fresh(model);
            flashnext::Job running(fresh, prompt, endless);
            std::string busy = "not busy";
            try {
                fresh.decode(prompt[0]);
            } catch (const flashnext::Error &e) {
                busy = e.status_name();
            }
            while (running.n_tokens() < 3 && !running.finished()) running.poll();
            running.cancel();
            try {
                running.wait();
                std::cout << "job cancel: not cancelled\n";
                return 1;
            } catch (const flashnext::Error &e) {
                std::cout << "job cancel: " << e.status_name() << " (state " << busy << " meanwhile, position "
                          << fresh.position() << " after)\n";
            }
        }

        // The reply split into visible text, reasoning and tool calls, whole
        // and piece by piece: the same message.
        {
            std::string whole = flashnext::chat_parse(streamed);
            flashnext::ChatParser parser;
            size_t content = 0;
            for (size_t at = 0; at < streamed.size();) {
                size_t len = 1;
                while (at + len < streamed.size() && (static_cast<unsigned char>(streamed[at + len]) & 0xC0) == 0x80) len++;
                for (const flashnext::ChatSegment &seg : parser.push(std::string_view(streamed).substr(at, len)))
                    if (seg.kind == FNX_CHAT_CONTENT) content += seg.text.size();
                at += len;
            }
            for (const flashnext::ChatSegment &seg : parser.finish())
                if (seg.kind == FNX_CHAT_CONTENT) content += seg.text.size();
            bool same = parser.message_json() == whole;
            std::cout << "parser: " << (same ? "consistent" : "DIFFERENT") << " (" << content << " content bytes)\n";
            if (!same) return 1;
        }

        // The same text through a streaming detokenizer.
        flashnext::Detokenizer detok(model);
        std::string again;
        for (int32_t t : reply) again += detok.push(t);
        again += detok.flush();
        std::cout << "detokenizer: " << (again == model.detokenize(reply) ? "consistent" : "DIFFERENT") << "\n";

        // Snapshots: save, continue with a fresh sampler, restore the snapshot
        // into a new state and continue the same way: the same tokens.
        std::vector<uint8_t> snapshot = state.save();
        size_t saved_at = state.position();
        flashnext::Sampler first_sampler(sp);
        std::vector<int32_t> first = continue_with(state, first_sampler, 8, nullptr);
        flashnext::State restored(model);
        restored.load(snapshot);
        flashnext::Sampler replay_sampler(sp);
        std::vector<int32_t> replay = continue_with(restored, replay_sampler, 8, nullptr);
        std::cout << "snapshot: " << snapshot.size() << " bytes at position " << saved_at << "\n";
        std::cout << "snapshot replay: " << (first == replay ? "identical" : "DIFFERENT") << "\n";
        if (first != replay) return 1;

        // The abort callback stops decoding; the state stays as it was.
        size_t before = state.position();
        state.set_abort_callback([] { return true; });
        try {
            state.decode(prompt);
            std::cout << "abort callback: not called\n";
            return 1;
        } catch (const flashnext::Error &e) {
            std::cout << "abort callback: " << e.status_name() << " (position " << state.position() << ", was "
                      << before << ")\n";
        }
        state.set_abort_callback(nullptr);

        // Structured output: a regular expression the reply must match; the
        // reply ends when the expression is complete (before max_tokens).
        flashnext::Sampler constrained(sp);
        constrained.set_constraint(model, FNX_CONSTRAINT_REGEX, "[0-9]{3}-[a-z]{2,5}");
        flashnext::State cstate(model);
        cstate.decode(prompt);
        std::string ctext;
        size_t cn = 0;
        flashnext::GenerateOptions copts;
        copts.max_tokens = 64;
        copts.sampler = &constrained;
        cstate.generate({}, copts, [&](int32_t, std::string_view piece) {
            ctext.append(piece);
            ++cn;
            return true;
        });
        bool shaped = ctext.size() >= 6 && ctext.size() <= 9 && ctext[3] == '-';
        for (size_t i = 0; i < ctext.size(); ++i) {
            char c = ctext[i];
            if (i != 3 && !(i < 3 ? (c >= '0' && c <= '9') : (c >= 'a' && c <= 'z'))) shaped = false;
        }
        std::cout << "constraint: \"" << ctext << "\" in " << cn << " tokens, "
                  << (shaped ? "matches" : "DOES NOT MATCH") << "\n";
        if (!shaped) return 1;
        try {
            constrained.set_constraint(model, FNX_CONSTRAINT_JSON_SCHEMA, "{\"type\": \"nonsense\"}");
            std::cout << "bad constraint: accepted\n";
            return 1;
        } catch (const flashnext::Error &e) {
            std::cout << "bad constraint: " << e.status_name() << "\n";
        }
        flashnext::set_log_callback(nullptr);
        return 0;
    } catch (const flashnext::Error &e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
    } catch (const std::exception &e) {
        std::cerr << "error: " << e.what() << "\n";
        return 1;
    }
}
