//! Continuous batching, preemption and prefix caching never change what a request gets:
//! greedy outputs are identical alone, among 32 concurrent requests, with the prefix cache
//! hit or missed, after being preempted and recomputed, and whether a step returns greedy
//! picks or whole logits.

use crate::fixtures::{fixtures_dir, ids, reference};
use strata_common::SamplingParams;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{Engine, EngineConfig};

fn engine(name: &str, config: EngineConfig) -> Engine {
    let model = Model::load(&fixtures_dir().join(name), CpuBackend::new()).unwrap();
    Engine::new(model, &config).unwrap()
}

fn config(kv_bytes: usize, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        kv_cache_bytes: kv_bytes,
        prefix_caching,
        scheduler: SchedulerConfig { max_num_seqs: 64, max_batched_tokens: 96 },
        ..Default::default()
    }
}

struct Req {
    prompt: Vec<u32>,
    max_tokens: u32,
    /// Step at which the request arrives.
    arrives: usize,
}

/// 32 requests of mixed prompt and output lengths, arriving over the first steps.
fn mixed_requests(vocab: u32) -> Vec<Req> {
    let mut state = 12345u64;
    let mut next = move |m: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % m
    };
    (0..32)
        .map(|i| {
            let len = 2 + next(70) as usize;
            let prompt =
                std::iter::once(1).chain((1..len).map(|_| 3 + next(vocab as u64 - 3) as u32)).collect();
            Req { prompt, max_tokens: 1 + next(40) as u32, arrives: (i % 8) * 2 }
        })
        .collect()
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_new_tokens: max_tokens, ignore_eos: true, ..Default::default() }
}

/// Runs requests through one engine, each joining at its arrival step.
fn run_all(e: &mut Engine, reqs: &[Req]) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); reqs.len()];
    let mut step = 0;
    loop {
        for (i, r) in reqs.iter().enumerate() {
            if r.arrives == step {
                e.add(strata_engine::SeqId(i as u64), r.prompt.clone(), greedy(r.max_tokens)).unwrap();
            }
        }
        if !e.has_work() && reqs.iter().all(|r| r.arrives <= step) {
            break;
        }
        for ev in e.step().unwrap() {
            out[ev.seq.0 as usize].push(ev.token);
        }
        assert!(e.take_aborted().is_empty());
        step += 1;
    }
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block back in the pool");
    out
}

fn solo(name: &str, reqs: &[Req]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut e = engine(name, config(16 << 20, false));
            let one = [Req { prompt: r.prompt.clone(), max_tokens: r.max_tokens, arrives: 0 }];
            run_all(&mut e, &one).remove(0)
        })
        .collect()
}

#[test]
fn thirty_two_concurrent_requests_match_their_solo_runs() {
    for name in ["llama_gqa", "qwen2_bias_tied", "mistral_window"] {
        let reqs = mixed_requests(384);
        let alone = solo(name, &reqs);
        let mut e = engine(name, config(16 << 20, true));
        let together = run_all(&mut e, &reqs);
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, b, "{name}: request {i} differs when batched");
            assert_eq!(a.len(), reqs[i].max_tokens as usize);
        }
    }
}

#[test]
fn prefix_cache_hits_give_the_same_tokens_as_misses() {
    let r = reference(&fixtures_dir().join("llama_gqa"));
    let system: Vec<u32> = (0..70).map(|i| 3 + (i * 37) % 380).collect();
    let reqs: Vec<Req> = (0..6)
        .map(|i| {
            let mut p = vec![1];
            p.extend(&system);
            p.extend(ids(&r["prompt_ids"]).iter().skip(i).take(3 + i));
            Req { prompt: p, max_tokens: 12, arrives: i * 20 }
        })
        .collect();
    let mut cold = engine("llama_gqa", config(16 << 20, false));
    let misses = run_all(&mut cold, &reqs);
    assert_eq!(cold.scheduler_stats().prefix_hit_tokens, 0);
    let mut warm = engine("llama_gqa", config(16 << 20, true));
    let hits = run_all(&mut warm, &reqs);
    assert_eq!(hits, misses);
    let hit_tokens = warm.scheduler_stats().prefix_hit_tokens;
    assert!(
        hit_tokens >= 5 * 64,
        "later requests reuse the 4 full blocks of the system prompt ({hit_tokens})"
    );
}

#[test]
fn preempted_requests_resume_with_the_same_tokens() {
    let reqs = mixed_requests(384);
    let alone = solo("llama_gqa", &reqs[..12]);
    // 2 layers × 2 KV heads × 16 dims × 2 (K,V) × 4 bytes = 512 bytes per position;
    // 24 blocks of 16 positions: far less than 12 sequences need at once.
    let mut e = engine("llama_gqa", config(512 * 16 * 24, false));
    let together = run_all(&mut e, &reqs[..12]);
    assert!(e.scheduler_stats().preemptions > 0, "the test must force preemption");
    assert_eq!(together, alone);
}

#[test]
fn a_resumed_sequence_continues_exactly_where_it_stopped() {
    // What failover relies on: a sequence restarted from prompt + the tokens already
    // produced yields the rest of the uninterrupted output, greedy and seeded-sampled.
    let name = "llama_gqa";
    let r = reference(&fixtures_dir().join(name));
    let prompt = ids(&r["prompt_ids"]);
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(11),
        frequency_penalty: 0.3,
        max_new_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    for params in [greedy(24), sampled] {
        let mut e = engine(name, config(8 << 20, true));
        e.add(strata_engine::SeqId(0), prompt.clone(), params.clone()).unwrap();
        let mut whole = Vec::new();
        while e.has_work() {
            whole.extend(e.step().unwrap().into_iter().map(|ev| ev.token));
        }
        assert_eq!(whole.len(), 24);
        let mut other = engine(name, config(8 << 20, true));
        other
            .add_resumed(strata_engine::SeqId(1), prompt.clone(), whole[..9].to_vec(), params.clone())
            .unwrap();
        let mut rest = Vec::new();
        let mut last_finish = None;
        while other.has_work() {
            for ev in other.step().unwrap() {
                rest.push(ev.token);
                last_finish = ev.finish;
            }
        }
        assert_eq!(rest, whole[9..].to_vec(), "temperature {}", params.temperature);
        assert_eq!(
            last_finish,
            Some(strata_common::FinishReason::Length),
            "max_tokens counts resumed tokens"
        );
        // Already at max_tokens: nothing to resume.
        let e =
            other.add_resumed(strata_engine::SeqId(2), prompt.clone(), whole.clone(), params).unwrap_err();
        assert!(e.to_string().contains("generated"), "{e}");
    }
}

#[test]
fn greedy_picks_equal_sampling_from_the_whole_logits() {
    // Plain greedy steps return one pick per row (argmax and log-normaliser, merged over
    // tensor-parallel shards on the device); asking for top logprobs makes the step return
    // whole rows instead. Both must choose the same tokens with the same logprobs.
    for name in ["llama_gqa", "qwen2_bias_tied", "mistral_window"] {
        let reqs = mixed_requests(384);
        let run = |top: u32| {
            let mut e = engine(name, config(16 << 20, true));
            for (i, r) in reqs.iter().take(8).enumerate() {
                let params = SamplingParams { logprobs: Some(top), ..greedy(r.max_tokens) };
                e.add(strata_engine::SeqId(i as u64), r.prompt.clone(), params).unwrap();
            }
            let mut out = vec![Vec::new(); 8];
            while e.has_work() {
                for ev in e.step().unwrap() {
                    let lp = ev.logprobs.expect("logprobs were asked for");
                    assert_eq!(lp.token_id, ev.token);
                    assert_eq!(lp.top.len(), top as usize);
                    out[ev.seq.0 as usize].push((ev.token, lp.logprob));
                }
            }
            out
        };
        let (picks, full) = (run(0), run(1));
        for (i, (p, f)) in picks.iter().zip(&full).enumerate() {
            assert_eq!(p.len(), reqs[i].max_tokens as usize);
            let tokens = |v: &[(u32, f32)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(tokens(p), tokens(f), "{name}: request {i} tokens differ");
            for ((_, a), (_, b)) in p.iter().zip(f) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{name}: logprob {a} vs {b}");
                assert!(*a <= 0.0);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_canary_is_answered_by_the_next_step_idle_or_busy() {
    use std::time::Duration;
    use strata_engine::{EngineHandle, RunnerLimits, SeqEvent};
    let handle =
        EngineHandle::spawn(engine("llama_gqa", config(8 << 20, true)), RunnerLimits::default(), "t")
            .unwrap();
    // Idle: the runner makes a one-token canary sequence, and leaves nothing behind.
    tokio::time::timeout(Duration::from_secs(10), handle.canary()).await.unwrap().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = handle.stats();
        if s.running == 0 && s.kv_blocks_free == s.kv_blocks_total {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the canary left work behind: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Busy: answered by a step of the running work, which is not disturbed.
    let mut seq = handle.submit(vec![1, 2, 3], greedy(40)).unwrap();
    tokio::time::timeout(Duration::from_secs(10), handle.canary()).await.unwrap().unwrap();
    let mut n = 0;
    while let Some(ev) = seq.next().await {
        match ev {
            SeqEvent::Token { finish, .. } => {
                n += 1;
                if finish.is_some() {
                    break;
                }
            }
            SeqEvent::Failed(e) => panic!("{e}"),
            SeqEvent::Prompt(_) | SeqEvent::Embedding(_) => panic!("an event that was not asked for"),
        }
    }
    assert_eq!(n, 40);
    assert!(handle.broken().is_none());
}
