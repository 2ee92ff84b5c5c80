//! The text commands of the `flashnext` binary, run as a user would:
//! `run` and `chat` on the default model file, and their errors.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/default.gguf").display().to_string()
}

fn flashnext(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flashnext"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn ok(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
    String::from_utf8(out.stdout.clone()).expect("valid UTF-8 on stdout")
}

#[test]
fn run_completes_a_prompt_reproducibly() {
    let m = model();
    // A prompt in the tiny model's own text, which it continues past 10 tokens.
    let args = ["run", "-m", &m, "-p", "In the beginning", "-n", "10", "--seed", "7"];
    let first = flashnext(&args, "");
    let text = ok(&first);
    assert!(text.starts_with("In the beginning") && text.len() > "In the beginning\n".len(), "{text:?}");
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(stderr.contains("generation: 10 tokens") && stderr.contains("(seed 7)"), "{stderr}");
    assert_eq!(text, ok(&flashnext(&args, "")));
    let other = ok(&flashnext(&["run", "-m", &m, "-p", "In the beginning", "-n", "10", "--seed", "8"], ""));
    assert_ne!(text, other, "a different seed gives a different continuation");
}

#[test]
fn run_chat_answers_in_the_chat_format() {
    let m = model();
    let out = flashnext(&["run", "-m", &m, "-p", "Hi", "--chat", "--preset", "greedy", "-n", "6"], "");
    let text = ok(&out);
    assert!(!text.starts_with("Hi"), "the reply, not the prompt: {text:?}");
    // The prompt decoded is the ChatML rendering of one user message.
    let model = flashnext::model::Model::load(Path::new(&m), &Default::default()).unwrap();
    let chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let n = flashnext::tokenizer::Tokenizer::from_metadata(&model.metadata).unwrap().encode(chatml, false, true).unwrap().len();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("prompt: {n} tokens,")), "{stderr}");
}

#[test]
fn chat_reads_turns_from_stdin() {
    let m = model();
    let args = ["chat", "-m", &m, "-n", "5", "--preset", "greedy", "--system", "Be brief."];
    let one_turn = ok(&flashnext(&args, "Hello\n"));
    assert!(one_turn.len() > 1 && one_turn.ends_with('\n'), "{one_turn:?}");
    let two_turns = ok(&flashnext(&args, "Hello\n\nHow are you?\n"));
    assert!(two_turns.starts_with(&one_turn) && two_turns.len() > one_turn.len() + 1, "{two_turns:?}");
    // /reset forgets the first turn: the same message then gets the same reply.
    let reset = ok(&flashnext(&args, "Hello\n/reset\nHello\n/quit\nnever read\n"));
    assert_eq!(reset, one_turn.repeat(2));
}

#[test]
fn errors_are_messages_and_exit_codes() {
    let m = model();
    let missing = flashnext(&["run", "-m", "no-such-model.gguf", "-p", "x"], "");
    assert!(!missing.status.success());
    let msg = String::from_utf8_lossy(&missing.stderr);
    assert!(msg.contains("cannot open no-such-model.gguf"), "{msg}");
    let bad = flashnext(&["run", "-m", &m, "-p", "x", "--top-p", "0"], "");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("top_p"), "{}", String::from_utf8_lossy(&bad.stderr));
    let preset = flashnext(&["chat", "-m", &m, "--preset", "wild"], "");
    assert!(String::from_utf8_lossy(&preset.stderr).contains("unknown preset \"wild\""));
    let long = "word ".repeat(200);
    let full = flashnext(&["chat", "-m", &m, "--ctx", "64"], &format!("{long}\n"));
    assert!(!full.status.success());
    assert!(String::from_utf8_lossy(&full.stderr).contains("of the context remain"));
}
