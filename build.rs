//! Puts the SPIR-V of every Vulkan shader module in `OUT_DIR`, where
//! `src/vulkan/pipelines.rs` embeds it.
//!
//! The SPIR-V is committed (`shaders/spirv/`, written by
//! `scripts/build-shaders.sh`; the modules and the manifest are in
//! `build/shaders.rs`), so a build needs only cargo. A module whose sources
//! changed since its SPIR-V was made is compiled here with `glslc` (Debian and
//! Ubuntu package `glslc`, also in the Vulkan SDK; `GLSLC` names another
//! binary) and a warning says to refresh the committed files; without `glslc`
//! the build stops rather than embed SPIR-V that does not match the sources.
//! `FNX_BUILD_SHADERS=1` compiles every module with `glslc` regardless.

#[path = "build/shaders.rs"]
#[allow(dead_code)] // regeneration is for scripts/build-shaders.sh
mod shaders;

use std::path::PathBuf;

fn main() {
    // Read when the script runs (not when it was compiled): a build script
    // compiled for one checkout may be reused by another at another path.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let src = root.join("shaders");
    let spirv = src.join("spirv");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=shaders");
    println!("cargo:rerun-if-env-changed=GLSLC");
    println!("cargo:rerun-if-env-changed=FNX_BUILD_SHADERS");
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    let force = std::env::var("FNX_BUILD_SHADERS").is_ok_and(|v| !v.is_empty() && v != "0");
    let manifest = shaders::Manifest::read(&spirv);

    let mut stale = Vec::new();
    for m in shaders::modules() {
        let target = out.join(format!("{}.spv", m.name));
        if force {
            stale.push((m, "FNX_BUILD_SHADERS is set".to_string()));
            continue;
        }
        match shaders::committed(&src, &spirv, manifest.as_ref(), &m) {
            Ok(bytes) => {
                std::fs::write(&target, bytes).unwrap_or_else(|e| panic!("cannot write {}: {e}", target.display()))
            }
            Err(why) => stale.push((m, why)),
        }
    }
    if stale.is_empty() {
        return;
    }
    let list: Vec<String> = stale.iter().map(|(m, why)| format!("  {}: {why}", m.name)).collect();
    if !force && shaders::glslc_version(&glslc).is_none() {
        fail(&format!(
            "the committed SPIR-V in shaders/spirv/ does not match the shader sources:\n{}\n\
             Compiling the shaders needs the GLSL compiler `{glslc}`, which cannot be run. \
             Install it (apt-get install glslc, or bash scripts/setup.sh) or point GLSLC at a glslc \
             binary, then run `bash scripts/build-shaders.sh` to refresh shaders/spirv/ (or undo the \
             shader edits).",
            list.join("\n")
        ));
    }
    for (m, _) in &stale {
        let target = out.join(format!("{}.spv", m.name));
        if let Err(e) = shaders::compile(&glslc, &src, m, &target) {
            fail(&format!(
                "{e}. The Vulkan shaders need the GLSL compiler: install the `glslc` package \
                 (apt-get install glslc, or run scripts/setup.sh), or point GLSLC at a glslc binary"
            ));
        }
    }
    if !force {
        println!(
            "cargo:warning=compiled {} shader module(s) with {glslc}: the committed SPIR-V is stale; \
             run `bash scripts/build-shaders.sh` and commit shaders/spirv/",
            stale.len()
        );
        for line in &list {
            println!("cargo:warning={}", line.trim_start());
        }
    }
}

/// Stops the build with `message` (no panic, so no backtrace around it).
fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}
