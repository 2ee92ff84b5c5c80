//! Builds `examples-c/decode.c` against `include/flashnext.h` and the cdylib
//! with `-Wall -Wextra -Werror -pedantic`, runs it on a reference fixture,
//! and runs it again under AddressSanitizer (and valgrind when installed).

mod util;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory holding `libflashnext.so` for the profile under test.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        dir.join("libflashnext.so").exists(),
        "{} has no libflashnext.so; build the library first (cargo build)",
        dir.display()
    );
    dir
}

fn compile(extra: &[&str], out: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    let status = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O1", "-g"])
        .args(extra)
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("examples-c/decode.c"))
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lflashnext", "-lm"])
        .status()
        .expect("a C compiler (cc) is installed");
    assert!(status.success(), "compiling examples-c/decode.c failed");
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{cmd:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn c_example_builds_runs_and_is_clean() {
    let dir = std::env::temp_dir().join(format!("flashnext-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = util::fixture_gguf();

    let plain = dir.join("decode");
    compile(&[], &plain);
    let out = run(Command::new(&plain).arg(model).args(["3", "14", "15", "92", "65"]));
    assert!(out.contains("top1 token"), "{out}");
    assert!(out.contains("top5 token"), "{out}");
    assert!(out.contains("decoded 5 tokens at position 5"), "{out}");

    // Errors come back as messages, not crashes.
    let bad = Command::new(&plain).arg(dir.join("missing.gguf")).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("FNX_ERR_IO"));

    // The default (auto) backend probes Vulkan, which loads the driver with
    // dlopen; valgrind then reports glibc's loader reading past strdup'ed
    // rpath strings (a known false positive), so the valgrind run takes the
    // CPU explicitly. AddressSanitizer runs with the probe.
    let asan = dir.join("decode-asan");
    compile(&["-fsanitize=address,undefined", "-fno-omit-frame-pointer"], &asan);
    run(Command::new(&asan).arg(model).env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1"));

    if Command::new("valgrind").arg("--version").output().is_ok() {
        run(Command::new("valgrind")
            .env("FNX_BACKEND", "cpu")
            .args(["--error-exitcode=9", "--leak-check=full", "--errors-for-leak-kinds=definite", "-q"])
            .arg(&plain)
            .arg(model)
            .args(["1", "2", "3"]));
    }
    std::fs::remove_dir_all(&dir).ok();
}
