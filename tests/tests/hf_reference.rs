//! Strata's CPU engine against HF transformers, on every fixture model.
//!
//! The references were computed by transformers in float32 from the same files
//! (tests/fixtures/make_fixtures.py): greedy tokens must be identical and logits within
//! 1e-4 absolute.

use strata_common::SamplingParams;
use strata_coordinator::request::tokenizer::Tokenizer;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::{Engine, EngineConfig};
use strata_tests::{fixture_models, floats, ids, reference};

const LOGIT_TOL: f32 = 1e-4;

fn engine(dir: &std::path::Path) -> Engine {
    let model = Model::load(dir, CpuBackend::new()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Engine::new(model, &EngineConfig { kv_cache_bytes: 8 << 20, ..Default::default() }).unwrap()
}

fn greedy(n: u32) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Runs sequences to completion; returns each one's tokens.
fn run(engine: &mut Engine, n: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); n];
    while engine.num_running() > 0 {
        for e in engine.step().unwrap() {
            out[e.seq.0 as usize].push(e.token);
        }
    }
    out
}

#[test]
fn greedy_tokens_and_logits_match_transformers() {
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let want = ids(&r["greedy_ids"]);
        let mut e = engine(&dir);

        let logits = e.prompt_logits(&prompt).unwrap();
        let diff = max_abs_diff(&logits, &floats(&r["prompt_last_logits"]));
        assert!(diff <= LOGIT_TOL, "{name}: prompt logits differ by {diff}");

        let mut full = prompt.clone();
        full.extend(&want[..want.len() - 1]);
        let logits = e.prompt_logits(&full).unwrap();
        let diff = max_abs_diff(&logits, &floats(&r["final_logits"]));
        assert!(diff <= LOGIT_TOL, "{name}: logits after {} tokens differ by {diff}", full.len());
        eprintln!("{name}: max |logit - HF| = {diff:.2e}");

        e.add(strata_engine::SeqId(0), prompt, greedy(want.len() as u32)).unwrap();
        let got = run(&mut e, 1).remove(0);
        assert_eq!(got, want, "{name}: greedy tokens differ from transformers");
        assert_eq!(e.free_blocks(), e.total_blocks(), "{name}: blocks leaked");
    }
}

#[test]
fn batched_sequences_match_their_solo_runs() {
    // The reference prompt runs among other sequences that join at different steps and
    // sit at different positions; its tokens must not change.
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let want = ids(&r["greedy_ids"]);
        let mut e = engine(&dir);
        e.add(strata_engine::SeqId(0), prompt.clone(), greedy(want.len() as u32)).unwrap();
        e.add(strata_engine::SeqId(1), prompt[..3].to_vec(), greedy(40)).unwrap();
        let mut out = vec![Vec::new(); 3];
        let mut steps = 0;
        while e.num_running() > 0 {
            if steps == 5 {
                e.add(strata_engine::SeqId(2), prompt.iter().rev().copied().collect(), greedy(7)).unwrap();
            }
            for ev in e.step().unwrap() {
                out[ev.seq.0 as usize].push(ev.token);
            }
            steps += 1;
        }
        assert_eq!(out[0], want, "{name}: batched greedy tokens differ");
        assert_eq!((out[1].len(), out[2].len()), (40, 7), "{name}");
        assert_eq!(e.free_blocks(), e.total_blocks(), "{name}: blocks leaked");
    }
}

#[test]
fn tokenizer_matches_transformers() {
    for dir in fixture_models() {
        let r = reference(&dir);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let prompt = r["text_prompt"].as_str().unwrap();
        assert_eq!(tok.encode(prompt, 4096).unwrap(), ids(&r["text_prompt_ids"]), "{}", dir.display());
        assert_eq!(tok.decode(&ids(&r["greedy_ids"])).unwrap(), r["greedy_text"].as_str().unwrap());
    }
}

#[test]
fn opt_in_bf16_prefill_stays_close_to_exact() {
    // A prompt longer than the decode path's 48 rows takes the bf16 × bf16 GEMM.
    let dir = strata_tests::fixtures_dir().join("llama_bf16");
    let r = reference(&dir);
    let mut prompt = ids(&r["prompt_ids"]);
    prompt.extend(ids(&r["greedy_ids"]));
    prompt.extend((0..30).map(|i| 3 + i * 7));
    let config = |bf16_prefill| EngineConfig {
        kv_cache_bytes: 8 << 20,
        backend: strata_engine::backend::BackendOptions { bf16_prefill, ..Default::default() },
        ..Default::default()
    };
    let load = |bf16| {
        let backend = CpuBackend::new().with_bf16_prefill(bf16);
        Engine::new(Model::load(&dir, backend).unwrap(), &config(bf16)).unwrap()
    };
    let exact = load(false).prompt_logits(&prompt).unwrap();
    let fast = load(true).prompt_logits(&prompt).unwrap();
    let diff = max_abs_diff(&exact, &fast);
    if !CpuBackend::bf16_prefill_available() {
        // Without AVX512-BF16 the option falls back to the exact path, bit for bit.
        assert_eq!(diff, 0.0, "without AVX512-BF16, --bf16-prefill must keep the exact path");
        eprintln!("this CPU has no AVX512-BF16: checked that --bf16-prefill falls back to the exact path");
        return;
    }
    let scale = exact.iter().fold(0f32, |a, b| a.max(b.abs()));
    assert!(diff > 0.0, "the bf16 path must actually have run");
    assert!(diff < 0.05 * scale, "bf16 prefill moved logits by {diff} (scale {scale})");
    // The greedy choice can only move between tokens that the error band covers.
    let top = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let (te, tf) = (top(&exact), top(&fast));
    assert!(exact[tf] >= exact[te] - 2.0 * diff, "bf16 prefill picked token {tf} far below {te}");
    eprintln!("bf16 prefill: max |Δlogit| = {diff:.4} (logit scale {scale:.2}); top token {te} → {tf}");
}

/// `--quantize int8` (one scale per output channel; int8 × int8 VNNI dots at decode
/// sizes, widened int8 for prefill): the logits of every fixture stay within a small share
/// of their scale of HF's float32 ones, and where the greedy choice moves, it moves only
/// between tokens the quantization error band covers. Prints the greedy agreement rate.
#[test]
fn int8_weights_stay_close_to_exact() {
    use strata_engine::backend::Quantization;
    let (mut agree, mut total) = (0usize, 0usize);
    for dir in fixture_models() {
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let want = floats(&r["prompt_last_logits"]);
        let backend = CpuBackend::new().with_quantize(Some(Quantization::Int8));
        let model = Model::load(&dir, backend).unwrap();
        let mut e =
            Engine::new(model, &EngineConfig { kv_cache_bytes: 8 << 20, ..Default::default() }).unwrap();
        // Decode-sized (VNNI) and prefill-sized (widened) paths both run here.
        let got = e.prompt_logits(&prompt).unwrap();
        let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let diff = max_abs_diff(&got, &want);
        assert!(diff < 0.08 * scale, "{}: int8 moved logits by {diff} (scale {scale})", dir.display());
        e.add(strata_engine::SeqId(0), prompt.clone(), greedy(32)).unwrap();
        let tokens = run(&mut e, 1).remove(0);
        let reference = ids(&r["greedy_ids"]);
        let same = tokens.iter().zip(&reference).take_while(|(a, b)| a == b).count();
        agree += same;
        total += reference.len();
        if same == 0 {
            let top = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            let (te, tq) = (top(&want), top(&got));
            assert!(want[tq] >= want[te] - 2.0 * diff, "{}: int8 picked {tq} far below {te}", dir.display());
        }
    }
    eprintln!("int8: greedy tokens equal to HF's before the first divergence: {agree}/{total}");
}
