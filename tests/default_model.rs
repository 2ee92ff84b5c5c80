//! The embedded default model is exactly what the converter makes from the
//! committed `trained_kjv` fixture today (the small model `tools/demo/` trained
//! on the King James Bible), and the main job answers with English words on it.
//! Regenerate with `flashnext convert tests/fixtures/trained_kjv/hf models/default.gguf --type f16`.

use flashnext::convert::{convert, ConvertOptions, OutType};
use flashnext::model::LogitsFor;
use flashnext::{LoadOptions, Model, State};
use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

#[test]
fn embedded_model_is_the_converted_fixture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("flashnext-default-{}.gguf", std::process::id()));
    convert(&root.join("tests/fixtures/trained_kjv/hf"), &out, &ConvertOptions::new(OutType::F16)).unwrap();
    let fresh = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).ok();
    let committed = std::fs::read(root.join("models/default.gguf")).unwrap();
    assert!(
        fresh == committed,
        "models/default.gguf is stale: regenerate it with \
         `flashnext convert tests/fixtures/trained_kjv/hf models/default.gguf --type f16`"
    );
}

fn demo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flashnext")).arg("demo").args(args).output().unwrap();
    let stdout = String::from_utf8(out.stdout).expect("the demo prints valid UTF-8");
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// The demo's output without the figures of its timing lines (load time and speeds vary).
fn without_timings(stdout: &str) -> String {
    stdout
        .lines()
        .map(|l| match l.contains("tok/s") || l.contains("loaded in") {
            true => l.chars().filter(|c| !c.is_ascii_digit() && *c != '.').collect(),
            false => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The words of the text the model was trained on (lower case, one a line).
fn corpus_words() -> HashSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained_kjv/corpus_words.txt");
    std::fs::read_to_string(path).unwrap().lines().map(str::to_string).collect()
}

#[test]
fn demo_chats_on_the_embedded_model() {
    // The default message and length, as a newcomer runs it.
    let stdout = demo(&[]);
    assert!(stdout.starts_with("embedded default model: 4 layers"), "{stdout}");
    assert!(stdout.contains("\nuser: Hello! Who are you?\nassistant: "), "{stdout}");
    let reply = stdout.split("assistant: ").nth(1).unwrap().split("\nprompt: ").next().unwrap();
    assert!(!reply.bytes().any(|b| b < 0x20 && b != b'\n' && b != b'\t'), "control bytes reach the terminal: {reply:?}");
    // The ChatML prompt of one user message: `<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n`.
    let stats = stdout.lines().last().unwrap();
    let generated: usize = stats.split("generation: ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!((1..=48).contains(&generated), "{stats}");
    // Real English: at least 8 words, and at least 9 in 10 of them words of the training text.
    let corpus = corpus_words();
    let words: Vec<String> = reply
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphabetic()).to_lowercase())
        .filter(|w| !w.is_empty())
        .collect();
    let known = words.iter().filter(|w| corpus.contains(w.as_str())).count();
    assert!(words.len() >= 8 && known * 10 >= words.len() * 9, "{known} of {} words known: {reply:?}", words.len());
    // A fixed seed: the same reply every run.
    assert_eq!(without_timings(&stdout), without_timings(&demo(&[])));
}

/// Another message, in another script, still gets a clean reply.
#[test]
fn demo_answers_any_message() {
    let stdout = demo(&["-n", "12", "-p", "Hi! 你好"]);
    assert!(stdout.contains("\nuser: Hi! 你好\nassistant: "), "{stdout}");
    let reply = stdout.split("assistant: ").nth(1).unwrap().split("\nprompt: ").next().unwrap();
    assert!(!reply.trim().is_empty(), "empty reply: {stdout}");
    assert!(!reply.bytes().any(|b| b < 0x20 && b != b'\n' && b != b'\t'), "control bytes reach the terminal: {reply:?}");
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// The held-out windows (`tools/demo/held_out.json`: chapters the model never
/// saw, each window from `<|endoftext|>`), every `stride`-th one: their tokens
/// and transformers' sum of -log p over each window's predicted tokens.
fn held_out(stride: usize) -> Vec<(Vec<u32>, f64)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let held: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tools/demo/held_out.json")).unwrap()).unwrap();
    let seqs = held["sequences"].as_array().unwrap();
    let nll = held["nll"].as_array().unwrap();
    assert_eq!(seqs.len(), nll.len());
    seqs.iter()
        .zip(nll)
        .step_by(stride)
        .map(|(s, n)| (s.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect(), n.as_f64().unwrap()))
        .collect()
}

/// Mean -log p per predicted token of `windows` on the model at `path`, each
/// window decoded from a fresh state as the training script did.
fn mean_nll(path: &Path, windows: &[(Vec<u32>, f64)]) -> f64 {
    let model = Model::load(path, &LoadOptions::default()).unwrap();
    let vocab = model.vocab_size();
    let mut state = State::new(model).unwrap();
    let (mut nll, mut n) = (0f64, 0usize);
    for (tokens, _) in windows {
        state.reset().unwrap();
        let logits = state.decode_batch(tokens, LogitsFor::All).unwrap();
        for (row, &next) in logits.chunks_exact(vocab).zip(&tokens[1..]) {
            nll -= log_softmax(row)[next as usize];
            n += 1;
        }
    }
    nll / n as f64
}

/// flashnext's loss on held-out text is transformers' (F32 within 1e-3
/// nats/token, the embedded F16 within 1e-2), on every `stride`-th window.
fn held_out_matches_transformers(stride: usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let windows = held_out(stride);
    let n: usize = windows.iter().map(|(t, _)| t.len() - 1).sum();
    let want = windows.iter().map(|(_, s)| s).sum::<f64>() / n as f64;
    let f32_path = std::env::temp_dir().join(format!("flashnext-kjv-f32-{}-{stride}.gguf", std::process::id()));
    convert(&root.join("tests/fixtures/trained_kjv/hf"), &f32_path, &ConvertOptions::new(OutType::F32)).unwrap();
    let f32 = mean_nll(&f32_path, &windows);
    std::fs::remove_file(&f32_path).ok();
    let f16 = mean_nll(&root.join("models/default.gguf"), &windows);
    println!(
        "held-out loss (perplexity) over {} windows, {n} tokens: transformers {want:.4} ({:.2}), \
         flashnext F32 {f32:.4} ({:.2}), embedded F16 {f16:.4} ({:.2})",
        windows.len(),
        want.exp(),
        f32.exp(),
        f16.exp()
    );
    assert!((f32 - want).abs() <= 1e-3, "F32 {f32} vs transformers {want}");
    assert!((f16 - want).abs() <= 1e-2, "F16 {f16} vs transformers {want}");
}

#[test]
fn held_out_loss_is_the_references() {
    held_out_matches_transformers(8);
}

/// All 30k held-out tokens: the figures of tools/demo/README.md (two minutes;
/// `cargo test --release --test default_model -- --ignored --nocapture`).
#[test]
#[ignore]
fn held_out_perplexity_all_windows() {
    held_out_matches_transformers(1);
}
