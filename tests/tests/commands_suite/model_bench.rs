//! `strata model bench` as a user runs it, with every CPU kernel level this machine can
//! run (`STRATA_CPU_KERNELS` caps the level, so an AVX-512 machine also runs the AVX2 and
//! portable paths an older host would).

use std::process::Command;

use serde_json::Value;
use strata_tests::{fixtures_dir, strata_bin};

fn bench_with(kernels: &str, extra: &[&str]) -> std::process::Output {
    let model = fixtures_dir().join("llama_bf16");
    Command::new(strata_bin())
        .args(["model", "bench", "--model"])
        .arg(&model)
        .args(["--prompt-len", "24", "--decode-tokens", "4", "--repeats", "1", "--batch-sizes", "3"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .env("RAYON_NUM_THREADS", "2")
        .env("STRATA_CPU_KERNELS", kernels)
        .output()
        .expect("run strata model bench")
}

fn json(out: std::process::Output, what: &str) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "model bench {what} failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stderr}"))
}

fn bench(kernels: &str) -> Value {
    json(bench_with(kernels, &[]), &format!("with {kernels} kernels"))
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
            "compute_peak_gflops",
            "prefill_gflops",
            "prefill_share_of_compute_roofline",
        ] {
            let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing: {v}"));
            assert!(x.is_finite() && x > 0.0, "{key} = {x} with {kernels} kernels");
        }
        let batched = &v["batched_decode"][0];
        assert_eq!(batched[0], 3, "{v}");
        assert!(batched[1].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert_eq!(v["prompt_len"], 24);
        // The compute roofline is the unit prefill runs on, above what prefill reaches.
        let unit = v["compute_unit"].as_str().unwrap_or_else(|| panic!("compute_unit: {v}"));
        assert!(
            ["amx-bf16", "amx-int8", "avx512-bf16", "avx512-f32", "avx2-f32", "portable"].contains(&unit),
            "{v}"
        );
        let (peak, got) = (v["compute_peak_gflops"].as_f64().unwrap(), v["prefill_gflops"].as_f64().unwrap());
        assert!(got < peak, "prefill at {got} GFLOP/s above its roofline {peak}: {v}");
    }
    // A value that names no level leaves the choice to the CPU.
    let v = bench("sse9");
    let native = v["cpu_kernels"].as_str().expect("cpu_kernels");
    assert!(["amx", "avx512", "avx2", "portable"].contains(&native), "{v}");
}

/// `--kernels-ab` alternates two levels in one process: each side reports its own
/// figures under its own name, with their ratio; levels past the CPU's are refused.
#[test]
fn alternates_two_kernel_levels_in_one_process() {
    let all = ["portable", "avx2", "avx512", "amx"];
    let native = bench("native")["cpu_kernels"].as_str().expect("cpu_kernels").to_string();
    let top = all.iter().position(|l| *l == native).expect("a known level");
    if top > 0 {
        // Unpacked f32 weights, so every level reads them.
        let (a, b) = (all[top], all[top - 1]);
        let v = json(
            bench_with("native", &["--kernels-ab", &format!("{a},{b}"), "--dtype", "float32"]),
            "--kernels-ab",
        );
        assert_eq!((v["a"]["kernels"].as_str(), v["b"]["kernels"].as_str()), (Some(a), Some(b)), "{v}");
        assert_eq!(v["rounds"], 1, "{v}");
        let (pa, pb) = (
            v["a"]["prefill_tokens_per_s"].as_f64().unwrap(),
            v["b"]["prefill_tokens_per_s"].as_f64().unwrap(),
        );
        assert!(pa > 0.0 && pb > 0.0, "{v}");
        assert!((v["prefill_ratio"].as_f64().unwrap() - pb / pa).abs() < 1e-9, "{v}");
        assert_eq!(v["batched_decode"], Value::Null, "{v}");
        assert_eq!(v["a"]["batched_decode"][0][0], 3, "{v}");
        assert!(v["batched_decode_ratio"][0][1].as_f64().is_some_and(|r| r > 0.0), "{v}");
    } else {
        eprintln!("only portable kernels here: nothing to alternate");
    }
    if let Some(above) = all.get(top + 1) {
        let out = bench_with("native", &["--kernels-ab", &format!("{native},{above}")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{above} ran on a CPU that runs up to {native}");
        assert!(stderr.contains(&format!("up to {native}, not {above}")), "{stderr}");
    }
}
