//! Strata's CPU engine against HF transformers, on every fixture model.
//!
//! The references were computed by transformers in float32 from the same files
//! (tests/fixtures/make_fixtures.py): greedy tokens must be identical and logits within
//! 1e-4 absolute. bf16 compute is compared with transformers running the same files in
//! bfloat16 (tests/fixtures/make_bf16_references.py).

use strata_common::SamplingParams;
use strata_coordinator::request::tokenizer::Tokenizer;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::replica::local_replica;
use strata_engine::tensor::DType;
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
        // The others, too, are what they are alone (LongRoPE's short and long sequences
        // share steps here: each rotates with its own factors).
        for (id, p, n) in [(1, prompt[..3].to_vec(), 40), (2, prompt.iter().rev().copied().collect(), 7)] {
            let mut solo = engine(&dir);
            solo.add(strata_engine::SeqId(0), p, greedy(n)).unwrap();
            assert_eq!(run(&mut solo, 1).remove(0), out[id], "{name}: sequence {id} batched vs alone");
        }
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

/// An engine built the way `--dtype` builds it.
fn engine_with_dtype(dir: &std::path::Path, dtype: Option<DType>) -> Engine {
    let config = EngineConfig {
        kv_cache_bytes: 8 << 20,
        backend: strata_engine::backend::BackendOptions { dtype, ..Default::default() },
        ..Default::default()
    };
    local_replica(dir, strata_common::Parallelism::NONE, &config).unwrap()
}

/// bf16 logits may differ from HF's bf16 ones by this share of the logit scale: both
/// round activations to bf16 at every matmul input, but HF also keeps the residual
/// stream, the norms' outputs and the KV cache in bf16 where Strata keeps f32.
const BF16_LOGIT_SHARE: f32 = 0.03;

/// bf16 compute (`--dtype bf16`, and what `auto` picks for a bf16 checkpoint) against HF
/// transformers running every fixture in bfloat16 (reference_bf16.json): logits within
/// a small share of their scale, and greedy tokens equal to HF's until a step where HF's
/// own top two logits are closer than the two logit errors can reach (a genuine tie in
/// bf16; HF's logits are bf16, so its gap is often exactly 0 there).
#[test]
fn bf16_compute_matches_transformers_in_bf16() {
    let (mut agree, mut total, mut ties) = (0, 0, 0);
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let r = reference(&dir);
        let hf = strata_tests::json_file(&dir.join("reference_bf16.json"));
        let prompt = ids(&r["prompt_ids"]);
        let want = ids(&hf["greedy_ids"]);
        let gaps = floats(&hf["greedy_gaps"]);
        let mut e = engine_with_dtype(&dir, Some(DType::BF16));

        let mut err = 0f32;
        for (context, key) in
            [(prompt.clone(), "prompt_last_logits"), (final_context(&prompt, &want), "final_logits")]
        {
            let hf_logits = floats(&hf[key]);
            let scale = hf_logits.iter().fold(1f32, |a, b| a.max(b.abs()));
            let diff = max_abs_diff(&e.prompt_logits(&context).unwrap(), &hf_logits);
            assert!(
                diff <= BF16_LOGIT_SHARE * scale,
                "{name}: {key} differ from HF bf16 by {diff} (scale {scale})"
            );
            err = err.max(diff);
            eprintln!(
                "{name}: {key}: max |logit - HF bf16| = {diff:.4} ({:.2}% of {scale:.2})",
                100.0 * diff / scale
            );
        }

        e.add(strata_engine::SeqId(0), prompt, greedy(want.len() as u32)).unwrap();
        let got = run(&mut e, 1).remove(0);
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        if same < want.len() {
            // Where the logits of both sides are `err` apart, the choice can flip only
            // where HF's top two are within twice that.
            assert!(
                gaps[same] <= 2.0 * err,
                "{name}: step {same}: token {} where HF bf16 picked {} by a clear margin {}",
                got[same],
                want[same],
                gaps[same]
            );
            ties += 1;
            eprintln!("{name}: near-tie at step {same} (HF bf16 gap {})", gaps[same]);
        }
        agree += same;
        total += want.len();
    }
    eprintln!(
        "bf16: greedy tokens equal to HF bf16's before a near-tie: {agree}/{total}; near-ties met: {ties}"
    );
}

/// The tokens HF's final logits were taken after: the prompt and all but the last
/// greedy token.
fn final_context(prompt: &[u32], greedy: &[u32]) -> Vec<u32> {
    let mut c = prompt.to_vec();
    c.extend(&greedy[..greedy.len() - 1]);
    c
}

/// `--dtype auto` follows the checkpoint: a bf16 model computes in bf16 (the same
/// numbers as `--dtype bf16`; different from f32 where the CPU has bf16 dot products),
/// and `--dtype f32` is exact against HF's float32 reference.
#[test]
fn dtype_auto_follows_the_checkpoint_and_f32_stays_exact() {
    let dir = strata_tests::fixtures_dir().join("llama_bf16");
    let r = reference(&dir);
    let mut prompt = ids(&r["prompt_ids"]);
    // Longer than the decode kernels' rows, so the prefill GEMM runs too.
    prompt.extend((0..60).map(|i| 3 + i * 5));
    let auto = engine_with_dtype(&dir, None).prompt_logits(&prompt).unwrap();
    let bf16 = engine_with_dtype(&dir, Some(DType::BF16)).prompt_logits(&prompt).unwrap();
    let f32 = engine_with_dtype(&dir, Some(DType::F32)).prompt_logits(&prompt).unwrap();
    let exact = engine(&dir).prompt_logits(&prompt).unwrap();
    assert_eq!(auto, bf16, "auto on a bf16 checkpoint must compute as --dtype bf16");
    assert_eq!(f32, exact, "--dtype f32 must be the exact f32 path");
    if CpuBackend::bf16_compute_available() {
        assert!(max_abs_diff(&auto, &f32) > 0.0, "bf16 compute must actually have run");
    } else {
        assert_eq!(auto, f32, "without AVX512-BF16, bf16 weights compute in f32");
        eprintln!("this CPU has no AVX512-BF16: bf16 weights computed in f32");
    }
    let short = ids(&r["prompt_ids"]);
    let diff = max_abs_diff(
        &engine_with_dtype(&dir, Some(DType::F32)).prompt_logits(&short).unwrap(),
        &floats(&r["prompt_last_logits"]),
    );
    assert!(diff <= LOGIT_TOL, "--dtype f32 differs from HF float32 by {diff}");
}

/// Teacher-forced log-probabilities (`strata model compare`'s log-likelihood) are HF's
/// log-softmax at the same positions.
#[test]
fn token_logprobs_match_transformers() {
    for dir in fixture_models() {
        let r = reference(&dir);
        let greedy_ids = ids(&r["greedy_ids"]);
        let mut tokens = ids(&r["prompt_ids"]);
        let first = tokens.len() - 1; // the row predicting greedy_ids[0]
        tokens.extend(&greedy_ids);
        let got = engine(&dir).token_logprobs(&tokens).unwrap();
        assert_eq!(got.len(), tokens.len() - 1);
        let log_softmax_at = |logits: &[f32], id: u32| {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
            logits[id as usize] as f64 - max - sum.ln()
        };
        let want_first = log_softmax_at(&floats(&r["prompt_last_logits"]), greedy_ids[0]);
        let want_last = log_softmax_at(&floats(&r["final_logits"]), greedy_ids[greedy_ids.len() - 1]);
        let name = dir.display();
        assert!((got[first] - want_first).abs() < 1e-4, "{name}: {} vs HF {want_first}", got[first]);
        assert!(
            (got[got.len() - 1] - want_last).abs() < 1e-4,
            "{name}: {} vs HF {want_last}",
            got[got.len() - 1]
        );
    }
}

/// `--quantize int8` (one scale per output channel; int8 × int8 VNNI dots at decode
/// sizes, widened int8 for prefill, or AMX-INT8 tiles from 16 rows — their model under
/// `STRATA_CPU_TILES=model`): the logits of every fixture stay within a small share
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

/// A model whose every layer attends within a sliding window (Mistral's and Phi-3's
/// fixtures) runs a sequence longer than its whole KV cache: blocks that fall behind the
/// window go back to the pool as it runs (and are counted), the tokens are still HF's,
/// and nothing leaks. A model mixing windowed and global layers (Gemma 2/3, gpt-oss) runs
/// in a budget that a storage a layer could not hold the sequence in: its layers form KV
/// groups sharing storage, the windowed groups keeping only the window, the global one
/// every position.
#[test]
fn windowed_models_release_blocks_behind_the_window() {
    let (mut ran, mut mixed_ran) = (0, 0);
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let config = strata_common::ModelConfig::from_dir(&dir).unwrap();
        let Some(window) = config.sliding_window else { continue };
        let all_windowed = (0..config.num_layers).all(|l| config.layer_windowed(l));
        let r = reference(&dir);
        let (prompt, want) = (ids(&r["prompt_ids"]), ids(&r["greedy_ids"]));
        let (block, chunk) = (4, 8);
        let positions = prompt.len() + want.len();
        let layer_block = 2 * config.num_kv_heads * config.head_dim * 4 * block;
        let groups = config.kv_groups();
        let storages = groups.slots_of(0..config.num_layers).len();
        let windowed_groups = groups.windows.iter().filter(|w| w.is_some()).count();
        // The most a windowed group holds for one sequence: its window, the blocks at
        // either end and a chunk.
        let window_blocks = window.div_ceil(block) + 3 + chunk / block;
        // Windowed: room for the window, a prefill chunk and a block of slack — under the
        // sequence. Mixed: the whole sequence in the global group, the window in each
        // windowed one, and a block of slack.
        let blocks = match (all_windowed, groups.num_groups() > 1) {
            (true, _) => (window + chunk).div_ceil(block) + 2,
            (false, true) => positions.div_ceil(block) + windowed_groups * window_blocks + 2,
            (false, false) => continue,
        };
        let budget = blocks * storages * layer_block;
        let engine_config = EngineConfig {
            kv_cache_bytes: budget,
            block_size: block,
            scheduler: strata_engine::scheduler::SchedulerConfig {
                max_num_seqs: 1,
                max_batched_tokens: chunk,
            },
            ..Default::default()
        };
        let model = Model::load(&dir, CpuBackend::new()).unwrap();
        let mut e = Engine::new(model, &engine_config).unwrap();
        assert_eq!(e.total_blocks(), blocks, "{name}");
        e.add(strata_engine::SeqId(0), prompt.clone(), greedy(want.len() as u32)).unwrap();
        assert_eq!(run(&mut e, 1).remove(0), want, "{name}: greedy tokens differ from transformers");
        let released = e.scheduler_stats().window_released_blocks as usize;
        // Again, the prompt's blocks partly released, partly still cached by prefix.
        e.add(strata_engine::SeqId(0), prompt, greedy(want.len() as u32)).unwrap();
        assert_eq!(run(&mut e, 1).remove(0), want, "{name}: again, after blocks were released");
        // The fixtures whose sequences run past their window (the others' windows are
        // transformers' defaults, thousands of positions).
        let exceeded = positions > blocks * block;
        if all_windowed && exceeded {
            // Every block but those the last window and chunk still held went back early.
            assert!(released >= positions.div_ceil(block) - blocks, "{name}: {released} released");
        }
        let a_storage_a_layer = budget / (config.num_layers * layer_block);
        if !all_windowed && positions > a_storage_a_layer * block {
            // A storage for every layer would not have held the sequence.
            assert!(e.max_kv_positions() >= positions, "{name}: {} positions", e.max_kv_positions());
            let least = windowed_groups * (positions.div_ceil(block) - window_blocks);
            assert!(released >= least, "{name}: {released} released, {least} at least");
            mixed_ran += 1;
        }
        assert_eq!(e.free_blocks(), e.total_blocks(), "{name}: blocks leaked");
        ran += usize::from(all_windowed && exceeded);
    }
    assert!(ran >= 2, "Mistral's and Phi-3's windowed fixtures ran");
    assert!(mixed_ran >= 3, "Gemma 2's, Gemma 3's and gpt-oss's mixed fixtures ran ({mixed_ran})");
}
