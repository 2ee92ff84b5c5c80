//! The language bindings and examples, run against the cdylib of the profile
//! under test and the repository's tiny model `models/default.gguf`:
//!
//! - the Python ctypes binding's own unittest suite
//!   (`bindings/python/tests`), with `FLASHNEXT_LIB` pointing at the cdylib;
//! - the C++ wrapper `include/flashnext.hpp` (a generation, a polled job, a
//!   parsed reply) through `examples-cpp/generate.cpp`,
//!   built with `-std=c++17 -Wall -Wextra -Werror -pedantic` (plain and under
//!   AddressSanitizer/UBSan);
//! - the interactive C chat `examples-c/chat.c`, built with
//!   `-std=c11 -Wall -Wextra -Werror -pedantic`, run under AddressSanitizer
//!   and UBSan on a scripted two-turn conversation;
//! - the C frame loop `examples-c/game_loop.c` (a generation job polled each
//!   frame, its reply parsed as it streams), built the same way, run plain and
//!   under AddressSanitizer and UBSan, to the end and cancelled part way.
//!
//! Build the library first: `cargo build --lib` (as `scripts/test.sh` does).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding `libflashnext.so` for the profile under test.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        dir.join("libflashnext.so").exists(),
        "{} has no libflashnext.so; build the library first (cargo build --lib)",
        dir.display()
    );
    dir
}

fn model() -> PathBuf {
    root().join("models/default.gguf")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flashnext-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn show(out: &Output) -> String {
    format!(
        "status {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", show(&out));
    out
}

/// Runs `cmd` with `input` on its stdin.
fn run_with_stdin(cmd: &mut Command, input: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_string();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

const SANITIZE: &[&str] = &["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"];

fn sanitizer_env(cmd: &mut Command) -> &mut Command {
    cmd.env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1")
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
}

fn compile(compiler: &str, std_flags: &[&str], src: &Path, extra: &[&str], out: &Path) {
    let lib = lib_dir();
    run(Command::new(compiler)
        .args(std_flags)
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-O1", "-g"])
        .args(extra)
        .arg("-I")
        .arg(root().join("include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lflashnext", "-lm"]));
}

#[test]
fn python_binding_unittests() {
    let python = match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => "python3",
        _ => {
            eprintln!("SKIPPED the Python binding tests: python3 is not installed");
            return;
        }
    };
    let out = Command::new(python)
        .args(["-m", "unittest", "discover", "-v", "-s", "bindings/python/tests"])
        .current_dir(root())
        .env("FLASHNEXT_LIB", lib_dir())
        .env("FLASHNEXT_TEST_MODEL", model())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "the Python binding tests failed: {}", show(&out));
    assert!(stderr.contains("\nOK"), "unexpected unittest output: {}", show(&out));
}

#[test]
fn cpp_example_builds_and_runs() {
    let dir = temp_dir("cpp");
    let src = root().join("examples-cpp/generate.cpp");
    let std = ["-std=c++17"];

    let plain = dir.join("generate");
    compile("c++", &std, &src, &[], &plain);
    let out = run(Command::new(&plain).arg(model()).arg("Hello, how are you?").args(["--tokens", "12"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("assistant: ") && stdout.contains("generated "), "{}", show(&out));
    assert!(stdout.contains("batch: matches token by token"), "{}", show(&out));
    assert!(stdout.contains("detokenizer: consistent"), "{}", show(&out));
    assert!(stdout.contains("stream: matches detokenize"), "{}", show(&out));
    assert!(stdout.contains("job: matches generate"), "{}", show(&out));
    assert!(
        stdout.contains("job cancel: FNX_ERR_CANCELLED (state FNX_ERR_BUSY meanwhile, position 0 after)"),
        "{}",
        show(&out)
    );
    assert!(stdout.contains("parser: consistent"), "{}", show(&out));
    assert!(stdout.contains("snapshot replay: identical"), "{}", show(&out));
    assert!(stdout.contains("abort callback: FNX_ERR_ABORTED"), "{}", show(&out));
    assert!(stdout.contains("tokens, matches\n"), "{}", show(&out));
    assert!(stdout.contains("bad constraint: FNX_ERR_INVALID_ARGUMENT"), "{}", show(&out));

    // Errors arrive as flashnext::Error with the status and message.
    let bad = Command::new(&plain).arg(dir.join("missing.gguf")).output().unwrap();
    assert_eq!(bad.status.code(), Some(1), "{}", show(&bad));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("FNX_ERR_IO"), "{}", show(&bad));

    let asan = dir.join("generate-asan");
    compile("c++", &std, &src, SANITIZE, &asan);
    run(sanitizer_env(Command::new(&asan).arg(model()).arg("Sanitized").args(["--tokens", "6"])));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn c_chat_example_two_turns_under_asan() {
    let dir = temp_dir("chat");
    let src = root().join("examples-c/chat.c");

    let plain = dir.join("chat");
    compile("cc", &["-std=c11"], &src, &[], &plain);
    let asan = dir.join("chat-asan");
    compile("cc", &["-std=c11"], &src, SANITIZE, &asan);

    // Two turns, a reset, a third turn, and end of input (Ctrl-D).
    let script = "Hello there!\nTell me more, please.\n/reset\nStart again.\n";
    let out = run_with_stdin(
        sanitizer_env(Command::new(&asan).arg(model()).args(["--max-tokens", "24", "--seed", "7"])),
        script,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "chat failed: {}", show(&out));
    assert_eq!(stdout.matches("assistant> ").count(), 3, "three replies expected: {}", show(&out));
    assert!(stdout.contains("(conversation reset)"), "{}", show(&out));

    // chat.c reports each turn on stderr:
    //   [prompt tokens: N] (K reused)
    //   [generated G tokens, B streamed bytes, position P]
    let stderr = String::from_utf8_lossy(&out.stderr);
    let numbers = |prefix: &str| -> Vec<Vec<usize>> {
        stderr
            .lines()
            .filter(|l| l.starts_with(prefix))
            .map(|l| l.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect())
            .collect()
    };
    let prompts = numbers("[prompt tokens: ");
    let turns = numbers("[generated ");
    assert_eq!((prompts.len(), turns.len()), (3, 3), "{}", show(&out));
    // The conversation grows: the second prompt holds the first turn, and
    // reuses the state decoded for the first prompt.
    assert!(prompts[1][0] > prompts[0][0] + turns[0][0] / 2, "{prompts:?} {turns:?}");
    assert!(prompts[1][1] >= prompts[0][0], "the second turn re-decoded the first prompt: {prompts:?}");
    // /reset forgets it.
    assert!(prompts[2][0] < prompts[1][0] && prompts[2][1] == 0, "{prompts:?}");
    for (turn, prompt) in turns.iter().zip(&prompts) {
        let (generated, position) = (turn[0], turn[2]);
        assert!(generated > 0 && generated <= 24, "{turns:?}");
        assert_eq!(position, prompt[0] + generated, "{prompts:?} {turns:?}");
    }
    // Every streamed byte reached stdout, and nothing else did: the replies
    // are exactly the pieces fnx_generate passed to the callback.
    let streamed: usize = turns.iter().map(|t| t[1]).sum();
    let framing = 3 * ("assistant> ".len() + 1) + "(conversation reset)\n".len();
    assert_eq!(out.stdout.len(), framing + streamed, "{}", show(&out));
    // 72 sampled tokens of the tiny model: some of them are text.
    assert!(streamed > 0, "no text streamed: {}", show(&out));

    // /quit ends the session before the end of input.
    let out = run_with_stdin(
        Command::new(&plain).arg(model()).args(["--max-tokens", "4"]),
        "Hi\n/quit\nnever read\n",
    );
    assert!(out.status.success(), "{}", show(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).matches("assistant> ").count(), 1, "{}", show(&out));

    // Empty input: exits at once, cleanly.
    let out = run_with_stdin(Command::new(&plain).arg(model()), "");
    assert!(out.status.success(), "{}", show(&out));

    // A bad model path is reported, not crashed on.
    let out = run_with_stdin(Command::new(&plain).arg(dir.join("missing.gguf")), "");
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FNX_ERR_IO"), "{}", show(&out));
    std::fs::remove_dir_all(&dir).ok();
}

/// The numbers of game_loop's summary line:
/// `[frames F, frames with text T, tokens N, bytes B, content C, reasoning R, status S]`.
fn game_loop_summary(out: &Output) -> (Vec<usize>, String) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr.lines().find(|l| l.starts_with("[frames ")).unwrap_or_else(|| panic!("no summary: {}", show(out)));
    let numbers = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    let status = line.rsplit("status ").next().unwrap().trim_end_matches(']').to_string();
    (numbers, status)
}

#[test]
fn c_game_loop_example_streams_while_frames_run() {
    let dir = temp_dir("game-loop");
    let src = root().join("examples-c/game_loop.c");
    let plain = dir.join("game_loop");
    compile("cc", &["-std=c11"], &src, &[], &plain);
    let asan = dir.join("game_loop-asan");
    compile("cc", &["-std=c11"], &src, SANITIZE, &asan);

    for exe in [&plain, &asan] {
        let out = run(sanitizer_env(Command::new(exe).arg(model()).args(["--max-tokens", "32", "--seed", "5"])));
        let (n, status) = game_loop_summary(&out);
        let (frames, with_text, tokens, bytes, content, reasoning) = (n[0], n[1], n[2], n[3], n[4], n[5]);
        assert_eq!(status, "FNX_OK", "{}", show(&out));
        assert!(tokens > 0 && tokens <= 32, "{}", show(&out));
        // The frame loop ran on while the text streamed in, and every polled byte reached stdout.
        assert!(frames >= 2 && with_text >= 1 && with_text <= frames, "{}", show(&out));
        assert_eq!(out.stdout.len(), bytes + 1, "{}", show(&out));
        // The reply parser saw the same bytes (tags, if any, are not counted).
        assert!(content + reasoning <= bytes, "{}", show(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("[frame 0] "), "{}", show(&out));

        // Cancelled at the third frame: no limit and no end-of-turn stop, so only the cancel (or, far later, a
        // full context) ends it.
        let args = ["--max-tokens", "0", "--ignore-eos", "--cancel-at-frame", "2"];
        let out = run(sanitizer_env(Command::new(exe).arg(model()).args(args)));
        let (n, status) = game_loop_summary(&out);
        assert_eq!(status, "FNX_ERR_CANCELLED", "{}", show(&out));
        assert!(n[0] >= 3, "{}", show(&out));
    }

    // A bad model path is reported, not crashed on.
    let out = Command::new(&plain).arg(dir.join("missing.gguf")).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("FNX_ERR_IO"), "{}", show(&out));
    std::fs::remove_dir_all(&dir).ok();
}
