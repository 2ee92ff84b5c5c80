//! `scripts/install.sh` and the packaging files: installs into a temporary
//! prefix (with `--lib-dir`, reusing the cdylib of the profile under test
//! instead of a release build), then builds small C and C++ consumers the way
//! users would — with `pkg-config --cflags --libs flashnext`, and with CMake's
//! `find_package(flashnext)` + `flashnext::flashnext` (when cmake is
//! installed; `scripts/setup.sh` installs it) — and runs them on
//! `models/default.gguf`.

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// Runs `cmd`, failing the test with its output unless it succeeds; returns stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("flashnext-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

const C_CONSUMER: &str = r#"
#include <flashnext.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    fnx_model *model = NULL;
    fnx_state *state = NULL;
    const int32_t prompt[] = {1, 2, 3};
    if (argc < 2) return 2;
    if (fnx_load(argv[1], NULL, &model) != FNX_OK) {
        fprintf(stderr, "load: %s\n", fnx_last_error());
        return 1;
    }
    if (fnx_new_state(model, &state) != FNX_OK ||
        fnx_decode_tokens(state, prompt, 3) != FNX_OK) {
        fprintf(stderr, "decode: %s\n", fnx_last_error());
        return 1;
    }
    size_t vocab = fnx_model_vocab_size(model);
    float *logits = malloc(vocab * sizeof *logits);
    if (!logits || fnx_get_logits(state, logits, vocab) != FNX_OK) return 1;
    size_t best = 0;
    for (size_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    printf("c consumer: flashnext %s, vocab %zu, position %zu, top token %zu\n",
           fnx_version(), vocab, fnx_state_position(state), best);
    free(logits);
    fnx_free_state(state);
    fnx_free_model(model);
    return 0;
}
"#;

const CXX_CONSUMER: &str = r#"
#include <flashnext.hpp>
#include <algorithm>
#include <iostream>

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    try {
        flashnext::Model model(argv[1]);
        flashnext::State state(model);
        state.decode(std::vector<int32_t>{1, 2, 3});
        std::vector<float> logits = state.logits();
        auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
        std::cout << "c++ consumer: flashnext " << flashnext::version() << ", vocab " << model.vocab_size()
                  << ", position " << state.position() << ", top token " << best << "\n";
        flashnext::Model missing("/nonexistent/model.gguf");
        return 1;
    } catch (const flashnext::Error &e) {
        std::cout << "expected error: " << e.status_name() << "\n";
        return e.status() == FNX_ERR_IO ? 0 : 1;
    }
}
"#;

const CMAKE_LISTS: &str = r#"
cmake_minimum_required(VERSION 3.16)
project(flashnext_consumer C CXX)

# The version file refuses versions this install cannot satisfy.
find_package(flashnext 99.0 QUIET)
if(flashnext_FOUND)
  message(FATAL_ERROR "find_package(flashnext 99.0) accepted version ${flashnext_VERSION}")
endif()

find_package(flashnext 0.1 REQUIRED)
message(STATUS "found flashnext ${flashnext_VERSION} in ${flashnext_DIR}")

add_executable(consumer_c main.c)
target_link_libraries(consumer_c PRIVATE flashnext::flashnext)
set_target_properties(consumer_c PROPERTIES C_STANDARD 11 C_STANDARD_REQUIRED ON)

add_executable(consumer_cxx main.cpp)
target_link_libraries(consumer_cxx PRIVATE flashnext::flashnext)
set_target_properties(consumer_cxx PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
"#;

fn install(prefix: &Path) {
    run(Command::new("bash")
        .arg(root().join("scripts/install.sh"))
        .arg("--lib-dir")
        .arg(lib_dir())
        .arg(prefix));
}

#[test]
fn install_layout_and_pkg_config_consumer() {
    let tmp = TempDir::new("pkgconfig");
    let prefix = tmp.0.join("prefix");
    install(&prefix);
    for f in [
        "lib/libflashnext.so",
        "include/flashnext.h",
        "include/flashnext.hpp",
        "lib/pkgconfig/flashnext.pc",
        "lib/cmake/flashnext/flashnextConfig.cmake",
        "lib/cmake/flashnext/flashnextConfigVersion.cmake",
    ] {
        assert!(prefix.join(f).is_file(), "install.sh did not install {f}");
    }
    let pc = std::fs::read_to_string(prefix.join("lib/pkgconfig/flashnext.pc")).unwrap();
    assert!(!pc.contains('@'), "unsubstituted placeholder in flashnext.pc:\n{pc}");
    assert!(pc.contains(&format!("Version: {}", env!("CARGO_PKG_VERSION"))), "{pc}");
    for f in ["flashnextConfig.cmake", "flashnextConfigVersion.cmake"] {
        let text = std::fs::read_to_string(prefix.join("lib/cmake/flashnext").join(f)).unwrap();
        assert!(!text.contains("@PREFIX@") && !text.contains("@VERSION@"), "unsubstituted placeholder in {f}");
    }

    // A staged install (DESTDIR) puts the files under the stage but names
    // the final prefix in the configuration.
    let stage = tmp.0.join("stage");
    run(Command::new("bash")
        .arg(root().join("scripts/install.sh"))
        .arg(format!("--lib-dir={}", lib_dir().display()))
        .arg("/opt/flashnext")
        .env("DESTDIR", &stage));
    let staged_pc = std::fs::read_to_string(stage.join("opt/flashnext/lib/pkgconfig/flashnext.pc")).unwrap();
    assert!(staged_pc.contains("prefix=/opt/flashnext\n"), "{staged_pc}");
    assert!(stage.join("opt/flashnext/lib/libflashnext.so").is_file());
    assert!(stage.join("opt/flashnext/lib/cmake/flashnext/flashnextConfig.cmake").is_file());

    // Usage errors.
    let bad = Command::new("bash").arg(root().join("scripts/install.sh")).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let bad = Command::new("bash")
        .arg(root().join("scripts/install.sh"))
        .args(["--lib-dir", "/nonexistent"])
        .arg(tmp.0.join("nowhere"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("libflashnext.so does not exist"));

    if !have("pkg-config") {
        eprintln!("SKIPPED the pkg-config consumer: pkg-config is not installed (bash scripts/setup.sh installs it)");
        return;
    }
    let pkg = |args: &[&str]| -> Vec<String> {
        let out = run(Command::new("pkg-config")
            .args(args)
            .arg("flashnext")
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
        out.split_whitespace().map(str::to_string).collect()
    };
    assert_eq!(pkg(&["--modversion"]), [env!("CARGO_PKG_VERSION")]);
    let cflags = pkg(&["--cflags"]);
    let libs = pkg(&["--libs"]);
    let libdir = pkg(&["--variable=libdir"]).concat();
    assert!(libs.iter().any(|l| l == "-lflashnext"), "{libs:?}");
    assert_eq!(Path::new(&libdir), prefix.join("lib"));

    let src = tmp.0.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("main.c"), C_CONSUMER).unwrap();
    std::fs::write(src.join("main.cpp"), CXX_CONSUMER).unwrap();

    let c_exe = tmp.0.join("consumer_c");
    run(Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .args(&cflags)
        .arg(src.join("main.c"))
        .arg("-o")
        .arg(&c_exe)
        .args(&libs)
        .arg(format!("-Wl,-rpath,{libdir}")));
    let out = run(Command::new(&c_exe).arg(model()));
    assert!(out.contains("c consumer: flashnext 0.") && out.contains("position 3"), "{out}");

    let cxx_exe = tmp.0.join("consumer_cxx");
    run(Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .args(&cflags)
        .arg(src.join("main.cpp"))
        .arg("-o")
        .arg(&cxx_exe)
        .args(&libs)
        .arg(format!("-Wl,-rpath,{libdir}")));
    let out = run(Command::new(&cxx_exe).arg(model()));
    assert!(out.contains("c++ consumer: flashnext 0.") && out.contains("expected error: FNX_ERR_IO"), "{out}");
}

#[test]
fn cmake_find_package_consumer() {
    if !have("cmake") {
        eprintln!("SKIPPED the CMake consumer: cmake is not installed (bash scripts/setup.sh installs it)");
        return;
    }
    let tmp = TempDir::new("cmake");
    let prefix = tmp.0.join("prefix");
    install(&prefix);
    let src = tmp.0.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("CMakeLists.txt"), CMAKE_LISTS).unwrap();
    std::fs::write(src.join("main.c"), C_CONSUMER).unwrap();
    std::fs::write(src.join("main.cpp"), CXX_CONSUMER).unwrap();
    let build = tmp.0.join("build");
    let configure = run(Command::new("cmake")
        .arg("-S")
        .arg(&src)
        .arg("-B")
        .arg(&build)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
        .arg("-DCMAKE_BUILD_TYPE=Debug"));
    assert!(configure.contains("found flashnext 0."), "{configure}");
    run(Command::new("cmake").arg("--build").arg(&build));

    // The imported target links by name (no SONAME in the cdylib), and CMake's
    // build RPATH points at the installed library.
    let out = run(Command::new(build.join("consumer_c")).arg(model()));
    assert!(out.contains("c consumer: flashnext 0.") && out.contains("position 3"), "{out}");
    let out = run(Command::new(build.join("consumer_cxx")).arg(model()));
    assert!(out.contains("c++ consumer") && out.contains("expected error: FNX_ERR_IO"), "{out}");

    // The installed tree is relocatable: the config finds the library
    // relative to itself.
    let moved = tmp.0.join("moved");
    std::fs::rename(&prefix, &moved).unwrap();
    let build2 = tmp.0.join("build2");
    let configure = run(Command::new("cmake")
        .arg("-S")
        .arg(&src)
        .arg("-B")
        .arg(&build2)
        .arg(format!("-DCMAKE_PREFIX_PATH={}", moved.display())));
    // flashnextConfig.cmake reports "not found" when the library or header it
    // computes is missing, so configuring proves the paths follow the move.
    assert!(configure.contains(&format!("in {}", moved.join("lib/cmake/flashnext").display())), "{configure}");
}
