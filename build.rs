//! Compiles the GLSL compute shaders in `shaders/` to SPIR-V with `glslc`
//! (Debian/Ubuntu package `glslc`, also in the Vulkan SDK) and writes them to
//! `OUT_DIR`, where `src/vulkan/pipelines.rs` embeds them. Each entry of
//! `VARIANTS` is one SPIR-V module: a `.comp` source plus `#define`s.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (module name, source file, defines)
const VARIANTS: &[(&str, &str, &[&str])] = &[
    ("matvec_f32", "matvec.comp", &["WEIGHT_F32"]),
    ("matvec_f16", "matvec.comp", &["WEIGHT_F16"]),
    ("matvec_bf16", "matvec.comp", &["WEIGHT_BF16"]),
    ("matvec_q8_0", "matvec.comp", &["WEIGHT_Q8_0"]),
    ("expert_f32", "matvec.comp", &["WEIGHT_F32", "ARENA"]),
    ("expert_f16", "matvec.comp", &["WEIGHT_F16", "ARENA"]),
    ("expert_bf16", "matvec.comp", &["WEIGHT_BF16", "ARENA"]),
    ("expert_q8_0", "matvec.comp", &["WEIGHT_Q8_0", "ARENA"]),
    ("hc_norm", "hc_norm.comp", &[]),
    ("hc_combine", "hc_combine.comp", &[]),
    ("ple_mix", "ple_mix.comp", &[]),
    ("gdn_conv", "gdn_conv.comp", &[]),
    ("gdn_recurrent", "gdn_recurrent.comp", &[]),
    ("attn_prep", "attn_prep.comp", &[]),
    ("qsa_index", "qsa_index.comp", &[]),
    ("qsa_score", "qsa_score.comp", &[]),
    ("qsa_topk", "qsa_topk.comp", &[]),
    ("attention", "attention.comp", &[]),
    ("moe_route", "moe_route.comp", &[]),
    ("moe_combine", "moe_combine.comp", &[]),
];

fn main() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=shaders");
    println!("cargo:rerun-if-env-changed=GLSLC");
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    for (name, file, defines) in VARIANTS {
        let mut cmd = Command::new(&glslc);
        cmd.arg("-fshader-stage=compute").arg("--target-env=vulkan1.1").arg("-O").arg("-Werror");
        cmd.arg("-I").arg(&src);
        for d in *defines {
            cmd.arg(format!("-D{d}"));
        }
        cmd.arg(src.join(file)).arg("-o").arg(out.join(format!("{name}.spv")));
        let status = cmd.status().unwrap_or_else(|e| {
            panic!(
                "cannot run `{glslc}` ({e}): the Vulkan shaders need the GLSL compiler. \
                 Install the `glslc` package (apt-get install glslc, or run scripts/setup.sh), \
                 or point GLSLC at a glslc binary"
            )
        });
        assert!(status.success(), "glslc failed on shaders/{file} ({name}); see the messages above");
    }
}
