//! `strata model quantize`: the int8 copy a user writes once and serves from.
//!
//! It must give exactly the numbers `--quantize int8` gives when quantizing at load (the
//! same function made both), on one rank and split across TP and PP ranks (per-row scales
//! follow their rows; column slices keep them whole), take under half the bytes, and
//! refuse what it cannot do with an error that says so.

use std::path::{Path, PathBuf};
use std::process::Command;

use strata_common::Parallelism;
use strata_engine::backend::{BackendOptions, Quantization};
use strata_engine::replica::local_replica;
use strata_engine::{Engine, EngineConfig, SeqId};
use strata_tests::{fixtures_dir, ids, reference, strata_bin};

fn quantize(model: &Path, out: &Path) -> std::process::Output {
    Command::new(strata_bin())
        .args(["model", "quantize", "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run strata model quantize")
}

fn engine(dir: &Path, quantize: Option<Quantization>, par: Parallelism) -> Engine {
    let config = EngineConfig {
        kv_cache_bytes: 8 << 20,
        backend: BackendOptions { quantize, ..Default::default() },
        ..Default::default()
    };
    local_replica(dir, par, &config).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn greedy(e: &mut Engine, prompt: &[u32], n: u32) -> Vec<u32> {
    let params = strata_common::SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() };
    e.add(SeqId(0), prompt.to_vec(), params).unwrap();
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|ev| ev.token));
    }
    out
}

fn quantized_copy(name: &str, tmp: &Path) -> (PathBuf, PathBuf, serde_json::Value) {
    let src = fixtures_dir().join(name);
    let out = tmp.join(name);
    let run = quantize(&src, &out);
    assert!(run.status.success(), "{name}: {}", String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).expect("one JSON report");
    (src, out, report)
}

#[test]
fn an_int8_checkpoint_equals_quantizing_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    // GQA; and MQA with q/k/v biases and tied embeddings (the embedding table is int8 too).
    for name in ["llama_gqa", "qwen2_bias_tied", "llama_bf16"] {
        let (src, out, report) = quantized_copy(name, tmp.path());
        let file = std::fs::metadata(out.join("model.safetensors")).unwrap().len() as f64;
        let bytes_in = report["bytes_in"].as_f64().unwrap();
        assert!(file < 0.55 * bytes_in, "{name}: {file} bytes for {bytes_in} in");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["quantization_config"]["quant_method"], "strata-int8");
        // What placement expects a rank to need is what the copy holds.
        assert_eq!(weight_estimate(&out, ""), report["bytes_out"].as_u64().unwrap(), "{name}");

        let r = reference(&src);
        let short = ids(&r["prompt_ids"]);
        let long: Vec<u32> = short.iter().copied().chain((0..60).map(|i| 3 + i * 5)).collect();
        let mut at_load = engine(&src, Some(Quantization::Int8), Parallelism::NONE);
        let mut stored = engine(&out, None, Parallelism::NONE);
        for prompt in [&short, &long] {
            // Decode-sized rows (integer dots) and prefill-sized rows (widened tiles).
            assert_eq!(
                stored.prompt_logits(prompt).unwrap(),
                at_load.prompt_logits(prompt).unwrap(),
                "{name}"
            );
        }
        assert_eq!(greedy(&mut stored, &short, 12), greedy(&mut at_load, &short, 12), "{name}");
    }
}

/// The coordinator's estimate of one rank's weight bytes (what placement reserves).
fn weight_estimate(dir: &Path, dtype: &str) -> u64 {
    let config = strata_common::ModelConfig::from_dir(dir).unwrap();
    let plan = strata_common::ShardPlan::new(&config, Parallelism::NONE).unwrap();
    plan.max_weight_bytes(
        &config,
        strata_common::WeightBytes::of(
            &config,
            (!dtype.is_empty()).then(|| strata_common::DType::parse(dtype).unwrap()),
        ),
    )
}

/// Placement reserves a rank's weights from config.json alone (the coordinator need not
/// read the weights): on every fixture — f32, f16, bf16, tied, biased, sharded files — the
/// estimate for one rank is exactly the bytes of the checkpoint's tensors (FP8 and MXFP4
/// weights as they load, dequantized).
#[test]
fn weight_estimates_equal_the_checkpoint_bytes() {
    let mut checked = 0;
    for dir in strata_tests::fixture_models() {
        let ck = strata_engine::model::weights::Checkpoint::open(&dir).unwrap();
        let plain: u64 = ck.names().map(|n| ck.tensor(n).unwrap().bytes().len() as u64).sum();
        if !ck.has_packed() {
            assert_eq!(ck.loaded_bytes(), plain, "{}", dir.display());
        }
        assert_eq!(weight_estimate(&dir, ""), ck.loaded_bytes(), "{}", dir.display());
        checked += 1;
    }
    assert!(checked >= 9, "{checked} fixtures");
}

/// PP stages load whole matrices: bit-equal to one rank. Under TP each rank quantizes its
/// own slice of the activations (its own scale), so a split moves logits by the int8
/// activation rounding (about 2% of their scale here) — a rank given another rows' scales
/// would be off by the whole scale.
#[test]
fn an_int8_checkpoint_splits_across_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama_gqa", "qwen2_bias_tied"] {
        let (src, out, _) = quantized_copy(name, tmp.path());
        let prompt = ids(&reference(&src)["prompt_ids"]);
        let mut one = engine(&out, None, Parallelism::NONE);
        let want = one.prompt_logits(&prompt).unwrap();
        let want_tokens = greedy(&mut one, &prompt, 12);
        let mut pp = engine(&out, None, Parallelism::new(1, 2));
        assert_eq!(pp.prompt_logits(&prompt).unwrap(), want, "{name} pp=2");
        assert_eq!(greedy(&mut pp, &prompt, 12), want_tokens, "{name} pp=2");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for par in [Parallelism::new(2, 1), Parallelism::new(2, 2)] {
            let got = engine(&out, None, par).prompt_logits(&prompt).unwrap();
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 0.05 * scale, "{name} {par:?}: logits differ by {diff} (scale {scale})");
        }
    }
}

#[test]
fn quantize_refuses_what_it_cannot_do() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, out, _) = quantized_copy("llama_gqa", tmp.path());
    let again = quantize(&out, &tmp.path().join("twice"));
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("already quantized"), "{err}");
    let onto_itself = quantize(&src, &src);
    let err = String::from_utf8_lossy(&onto_itself.stderr);
    assert!(!onto_itself.status.success() && err.contains("--out"), "{err}");
    let missing = quantize(&tmp.path().join("nothing"), &tmp.path().join("x"));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("model.safetensors"), "{err}");
    for stderr in [&again.stderr, &onto_itself.stderr, &missing.stderr] {
        assert!(!String::from_utf8_lossy(stderr).contains("panicked"));
    }
}
