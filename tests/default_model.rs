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

#[test]
fn demo_runs_on_the_embedded_model() {
    let out = Command::new(env!("CARGO_BIN_EXE_flashnext")).args(["demo", "-n", "8"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("embedded default model: 4 layers"), "{stdout}");
    assert!(stdout.contains("greedy continuation (8 tokens)"), "{stdout}");
}
