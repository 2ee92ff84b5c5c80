//! The embedded default model is exactly what the converter makes from the
//! committed `tiny_flat` fixture today, and the main job runs on it.
//! Regenerate with `flashnext convert tests/fixtures/tiny_flat/hf models/default.gguf --type f32`.

use flashnext::convert::{convert, ConvertOptions, OutType};
use std::path::Path;
use std::process::Command;

#[test]
fn embedded_model_is_the_converted_fixture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("flashnext-default-{}.gguf", std::process::id()));
    convert(&root.join("tests/fixtures/tiny_flat/hf"), &out, &ConvertOptions::new(OutType::F32)).unwrap();
    let fresh = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).ok();
    let committed = std::fs::read(root.join("models/default.gguf")).unwrap();
    assert!(
        fresh == committed,
        "models/default.gguf is stale: regenerate it with \
         `flashnext convert tests/fixtures/tiny_flat/hf models/default.gguf --type f32`"
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

#[test]
fn demo_chats_on_the_embedded_model() {
    let stdout = demo(&["-n", "12", "-p", "Hi! 你好"]);
    assert!(stdout.starts_with("embedded default model: 4 layers"), "{stdout}");
    assert!(stdout.contains("\nuser: Hi! 你好\nassistant: "), "{stdout}");
    let reply = stdout.split("assistant: ").nth(1).unwrap().split("\nprompt: ").next().unwrap();
    assert!(!reply.trim().is_empty(), "empty reply: {stdout}");
    assert!(!reply.bytes().any(|b| b < 0x20 && b != b'\n' && b != b'\t'), "control bytes reach the terminal: {reply:?}");
    // The ChatML prompt of one user message: `<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n`.
    let stats = stdout.lines().last().unwrap();
    let generated: usize = stats.split("generation: ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!((1..=12).contains(&generated), "{stats}");
    // A fixed seed: the same reply every run.
    assert_eq!(without_timings(&stdout), without_timings(&demo(&["-n", "12", "-p", "Hi! 你好"])));
}
