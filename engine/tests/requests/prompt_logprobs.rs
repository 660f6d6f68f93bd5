//! Prompt logprobs come from the prefill a request runs anyway: each prompt token's logprob
//! equals teacher forcing on a scratch sequence (which `hf_reference` checks against HF
//! transformers), whatever the chunking, the batch around it, a prefix already cached or a
//! preemption; they arrive once, on the first token, and change no generated token.

use std::collections::HashMap;

use crate::fixtures::fixtures_dir;
use strata_common::{SamplingParams, TokenLogprobs};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{Engine, EngineConfig, SeqId};

fn engine(name: &str, kv_bytes: usize, max_batched_tokens: usize) -> Engine {
    let model = Model::load(&fixtures_dir().join(name), CpuBackend::new()).unwrap();
    let config = EngineConfig {
        kv_cache_bytes: kv_bytes,
        prefix_caching: true,
        scheduler: SchedulerConfig { max_num_seqs: 64, max_batched_tokens },
        ..Default::default()
    };
    Engine::new(model, &config).unwrap()
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut state = seed;
    std::iter::once(1)
        .chain((1..len).map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            3 + ((state >> 33) % 380) as u32
        }))
        .collect()
}

fn params(prompt_logprobs: Option<u32>) -> SamplingParams {
    SamplingParams { max_new_tokens: 6, ignore_eos: true, prompt_logprobs, ..Default::default() }
}

/// Tokens and prompt logprobs (how many times they came) of each request, run together.
type Outcome = (Vec<u32>, Vec<Vec<TokenLogprobs>>);

fn run(e: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<Outcome> {
    for (i, (p, params)) in reqs.iter().enumerate() {
        e.add(SeqId(i as u64), p.clone(), params.clone()).unwrap();
    }
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            let o = out.entry(ev.seq.0).or_default();
            if let Some(p) = ev.prompt_logprobs {
                assert!(o.0.is_empty(), "prompt logprobs after the first token");
                o.1.push(p);
            }
            o.0.push(ev.token);
        }
        assert!(e.take_aborted().is_empty());
    }
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block back in the pool");
    (0..reqs.len() as u64).map(|i| out.remove(&i).unwrap_or_default()).collect()
}

/// Checks `got` against teacher forcing on a fresh engine.
fn check(name: &str, prompt: &[u32], got: &[TokenLogprobs], top: usize) {
    let want = engine(name, 16 << 20, 512).token_logprobs(prompt).unwrap();
    assert_eq!(got.len(), prompt.len() - 1, "{name}: one per prompt token after the first");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.token_id, prompt[i + 1], "{name}: entry {i} is of the wrong token");
        assert!((g.logprob as f64 - w).abs() < 1e-4, "{name}: token {}: {} vs {w}", i + 1, g.logprob);
        assert_eq!(g.top.len(), top);
        assert!(g.top.windows(2).all(|t| t[0].1 >= t[1].1), "{name}: alternatives most likely first");
        assert!(g.rank >= 1);
        let above = g.top.iter().filter(|t| t.1 > g.logprob).count() as u32;
        assert!(g.rank > above, "{name}: rank {} with {above} alternatives above it", g.rank);
        if g.rank == 1 {
            assert!(g.logprob >= g.top[0].1 - 1e-6);
        }
    }
}

#[test]
fn prompt_logprobs_match_teacher_forcing_in_chunks_batches_and_after_cache_hits() {
    for name in ["llama_gqa", "mistral_window", "gemma3_window"] {
        let shared = prompt(7, 70);
        let mut e = engine(name, 16 << 20, 24);
        // The prompt's blocks are cached first: a request for its logprobs still computes
        // every position.
        let first = run(&mut e, &[(shared.clone(), params(None))]);
        let hits_before = e.scheduler_stats().prefix_hit_tokens;
        let reqs = vec![
            (shared.clone(), params(Some(3))),
            (prompt(8, 40), params(None)),
            (prompt(9, 33), params(Some(0))),
            (shared.clone(), params(None)),
            (vec![1], params(Some(2))),
        ];
        let got = run(&mut e, &reqs);
        assert!(e.scheduler_stats().prefix_hit_tokens > hits_before, "{name}: the plain copy hit the cache");
        assert_eq!(got[0].0, first[0].0, "{name}: the same tokens with prompt logprobs");
        assert_eq!(got[3].0, first[0].0);
        for (i, top) in [(0, 3), (2, 0), (4, 2)] {
            assert_eq!(got[i].1.len(), 1, "{name}: request {i}'s prompt logprobs come once");
            check(name, &reqs[i].0, &got[i].1[0], top);
        }
        assert!(got[1].1.is_empty() && got[3].1.is_empty(), "{name}: none where none were asked for");
    }
}

#[test]
fn preempted_sequences_report_their_prompt_logprobs_once() {
    // 512 bytes per position (see batching.rs); 24 blocks of 16: twelve sequences preempt.
    let reqs: Vec<_> = (0..12).map(|i| (prompt(20 + i, 30 + 3 * i as usize), params(Some(1)))).collect();
    let mut e = engine("llama_gqa", 512 * 16 * 24, 96);
    let got = run(&mut e, &reqs);
    assert!(e.scheduler_stats().preemptions > 0, "the test must force preemption");
    for ((p, _), (tokens, lps)) in reqs.iter().zip(&got) {
        assert_eq!(tokens.len(), 6);
        assert_eq!(lps.len(), 1);
        check("llama_gqa", p, &lps[0], 1);
    }
}
