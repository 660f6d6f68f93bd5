//! Embedding requests: the pooled final hidden states equal HF transformers' (the base
//! model's `last_hidden_state`, tests/fixtures/embeddings) for every pooling, whatever the
//! chunking, the generating requests in the same steps, a cached prefix or a preemption;
//! nothing is generated and every block goes back.

use std::collections::HashMap;

use crate::fixtures::{fixtures_dir, ids};
use strata_common::{Embed, Pooling, SamplingParams};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{Engine, EngineConfig, SeqId};

fn engine(name: &str, kv_bytes: usize, max_batched_tokens: usize) -> Engine {
    let dir = fixtures_dir().join(name);
    let model = Model::load(&dir, CpuBackend::new()).unwrap();
    let config = EngineConfig {
        kv_cache_bytes: kv_bytes,
        prefix_caching: true,
        scheduler: SchedulerConfig { max_num_seqs: 64, max_batched_tokens },
        ..Default::default()
    };
    Engine::new(model, &config).unwrap().with_embed_defaults_from(&dir)
}

fn reference() -> serde_json::Value {
    let path = fixtures_dir().join("../embeddings/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn embed(pooling: Option<Pooling>, normalize: bool) -> SamplingParams {
    let embed = Embed { pooling, normalize: Some(normalize) };
    SamplingParams { max_new_tokens: 1, embed: Some(embed), ..Default::default() }
}

fn generate() -> SamplingParams {
    SamplingParams { max_new_tokens: 5, ignore_eos: true, ..Default::default() }
}

/// Runs `reqs` together: each embedding request's vector, each generating one's tokens.
fn run(e: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<(Option<Vec<f32>>, Vec<u32>)> {
    for (i, (p, params)) in reqs.iter().enumerate() {
        e.add(SeqId(i as u64), p.clone(), params.clone()).unwrap();
    }
    let mut out: HashMap<u64, (Option<Vec<f32>>, Vec<u32>)> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            let o = out.entry(ev.seq.0).or_default();
            match ev.embedding {
                Some(v) => {
                    assert!(o.0.is_none() && ev.finish.is_some(), "one answer, and the request ends");
                    o.0 = Some(v);
                }
                None => o.1.push(ev.token),
            }
        }
        assert!(e.take_aborted().is_empty());
    }
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block back in the pool");
    (0..reqs.len() as u64).map(|i| out.remove(&i).unwrap_or_default()).collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn close(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: width");
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 2e-4, "{name}: differs from HF transformers by {diff}");
}

#[test]
fn every_pooling_equals_hf_transformers_among_generating_requests() {
    let r = reference();
    for case in ["llama_gqa", "qwen3_qk_norm", "gemma3_window", "mistral_window"] {
        let texts = r["texts"].as_array().unwrap().len();
        let mut e = engine(case, 16 << 20, 7);
        // The last text's prefix cached first: pooling the last token may start from it.
        let long = ids(&r[case]["ids"][texts - 1]);
        run(&mut e, &[(long.clone(), generate())]);
        let mut reqs = Vec::new();
        let mut wants = Vec::new();
        for (pooling, key) in [(Pooling::Last, "last"), (Pooling::Mean, "mean"), (Pooling::Cls, "cls")] {
            for t in 0..texts {
                reqs.push((ids(&r[case]["ids"][t]), embed(Some(pooling), false)));
                wants.push((format!("{case} {key} text {t}"), floats(&r[case][key][t])));
            }
        }
        reqs.insert(1, (long.clone(), generate()));
        let got = run(&mut e, &reqs);
        let alone = run(&mut engine(case, 16 << 20, 512), &[(long, generate())]);
        assert_eq!(
            got[1],
            (None, alone[0].1.clone()),
            "{case}: a generating request beside them is unchanged"
        );
        for ((name, want), (v, tokens)) in wants.iter().zip(got.iter().take(1).chain(got.iter().skip(2))) {
            assert!(tokens.is_empty(), "{name}: nothing generated");
            close(name, v.as_ref().expect("an embedding"), want);
        }
    }
}

#[test]
fn defaults_normalize_the_last_token_and_preemption_changes_nothing() {
    let r = reference();
    let case = "llama_gqa";
    let texts = r["texts"].as_array().unwrap().len();
    // 512 bytes per position, 24 blocks of 16 (see batching.rs): twelve requests preempt.
    let mut e = engine(case, 512 * 16 * 24, 64);
    let reqs: Vec<_> = (0..12)
        .map(|i| {
            let long = SamplingParams { max_new_tokens: 80, ..generate() };
            let params = if i % 2 == 0 { embed(Some(Pooling::Mean), false) } else { long };
            let mut p = ids(&r[case]["ids"][i % texts]);
            p.extend((0..40).map(|k| 3 + ((i * 31 + k * 7) % 300) as u32));
            (p, params)
        })
        .collect();
    let got = run(&mut e, &reqs);
    assert!(e.scheduler_stats().preemptions > 0, "the test must force preemption");
    for (i, (p, params)) in reqs.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        let alone = run(&mut engine(case, 16 << 20, 512), &[(p.clone(), params.clone())]);
        close(&format!("request {i}"), got[i].0.as_ref().unwrap(), alone[0].0.as_ref().unwrap());
    }
    let text = ids(&r[case]["ids"][0]);
    let by_default =
        SamplingParams { max_new_tokens: 1, embed: Some(Embed::default()), ..Default::default() };
    let v = run(&mut e, &[(text, by_default)]).remove(0).0.unwrap();
    let want = floats(&r[case]["last"][0]);
    let norm = want.iter().map(|x| x * x).sum::<f32>().sqrt();
    close("default", &v, &want.iter().map(|x| x / norm).collect::<Vec<_>>());

    // `--pooling mean` over the model's default.
    let dir = fixtures_dir().join(case);
    let config = EngineConfig { pooling: Some(Pooling::Mean), ..Default::default() };
    let mut e = Engine::new(Model::load(&dir, CpuBackend::new()).unwrap(), &config)
        .unwrap()
        .with_embed_defaults_from(&dir);
    let unnormalized = SamplingParams {
        max_new_tokens: 1,
        embed: Some(Embed { pooling: None, normalize: Some(false) }),
        ..Default::default()
    };
    let v = run(&mut e, &[(ids(&r[case]["ids"][1]), unnormalized)]).remove(0).0.unwrap();
    close("--pooling mean", &v, &floats(&r[case]["mean"][1]));
}
