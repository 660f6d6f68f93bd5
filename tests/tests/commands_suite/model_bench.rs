//! `strata model bench` as a user runs it, with every CPU kernel level this machine can
//! run (`STRATA_CPU_KERNELS` caps the level, so an AVX-512 machine also runs the AVX2 and
//! portable paths an older host would).

use std::process::Command;

use serde_json::Value;
use strata_tests::{fixtures_dir, strata_bin};

fn bench(kernels: &str) -> Value {
    let model = fixtures_dir().join("llama_bf16");
    let out = Command::new(strata_bin())
        .args(["model", "bench", "--model"])
        .arg(&model)
        .args(["--prompt-len", "24", "--decode-tokens", "4", "--repeats", "1", "--batch-sizes", "3"])
        .env("RUST_LOG", "warn")
        .env("RAYON_NUM_THREADS", "2")
        .env("STRATA_CPU_KERNELS", kernels)
        .output()
        .expect("run strata model bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "model bench with {kernels} kernels failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stderr}"))
}

/// The levels below AVX-512 that this CPU can run, each capping the one before.
fn levels() -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        if avx2 {
            return vec!["avx2", "portable"];
        }
    }
    vec!["portable"]
}

#[test]
fn reports_its_measurements_at_every_kernel_level() {
    for kernels in levels() {
        let v = bench(kernels);
        assert_eq!(v["cpu_kernels"], kernels, "{v}");
        for key in [
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "bandwidth_gb_per_s",
            "gemv_gb_per_s",
            "roofline_decode_tokens_per_s",
        ] {
            let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing: {v}"));
            assert!(x.is_finite() && x > 0.0, "{key} = {x} with {kernels} kernels");
        }
        let batched = &v["batched_decode"][0];
        assert_eq!(batched[0], 3, "{v}");
        assert!(batched[1].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert_eq!(v["prompt_len"], 24);
    }
    // A value that names no level leaves the choice to the CPU.
    let v = bench("sse9");
    let native = v["cpu_kernels"].as_str().expect("cpu_kernels");
    assert!(["avx512", "avx2", "portable"].contains(&native), "{v}");
}
