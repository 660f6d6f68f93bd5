//! Tensor and pipeline parallelism give the same tokens and logits as one rank.
//!
//! Every fixture model runs at TP=2, TP=4 (where its heads allow), PP=2 and TP=2×PP=2,
//! ranks as threads joined by the TCP communicator on loopback; greedy tokens must be
//! identical to TP=1 and logits within 1e-4.

use strata_common::{Parallelism, SamplingParams, ShardPlan};
use strata_engine::replica::local_replica;
use strata_engine::{Engine, EngineConfig};
use strata_tests::{fixture_models, ids, reference};

/// Exact f32 compute, so splits can be held to 1e-4 and to HF's float32 tokens
/// (bf16 compute under TP: `bf16_splits_match_one_rank`).
fn config() -> EngineConfig {
    dtype_config(Some(strata_engine::tensor::DType::F32))
}

fn dtype_config(dtype: Option<strata_engine::tensor::DType>) -> EngineConfig {
    EngineConfig {
        kv_cache_bytes: 8 << 20,
        backend: strata_engine::backend::BackendOptions { dtype, ..Default::default() },
        ..Default::default()
    }
}

fn greedy_run(e: &mut Engine, prompt: &[u32], n: u32) -> Vec<u32> {
    e.add(
        strata_engine::SeqId(0),
        prompt.to_vec(),
        SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() },
    )
    .unwrap();
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|ev| ev.token));
    }
    out
}

#[test]
fn every_split_matches_one_rank() {
    let splits = [(2, 1), (4, 1), (1, 2), (2, 2)];
    let mut ran = 0;
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let mut single = local_replica(&dir, Parallelism::NONE, &config()).unwrap();
        let want_logits = single.prompt_logits(&prompt).unwrap();
        let want = greedy_run(&mut single, &prompt, 24);
        let model_config = strata_common::ModelConfig::from_dir(&dir).unwrap();
        for (tp, pp) in splits {
            let par = Parallelism::new(tp, pp);
            if ShardPlan::new(&model_config, par).is_err() {
                continue; // e.g. TP=4 with 2 KV heads and 6 heads
            }
            let mut e = local_replica(&dir, par, &config())
                .unwrap_or_else(|err| panic!("{name} tp={tp} pp={pp}: {err}"));
            let logits = e.prompt_logits(&prompt).unwrap();
            let diff = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-4, "{name} tp={tp} pp={pp}: logits differ by {diff}");
            assert_eq!(greedy_run(&mut e, &prompt, 24), want, "{name} tp={tp} pp={pp}: greedy tokens differ");
            ran += 1;
        }
    }
    assert!(ran >= 30, "only {ran} model × split combinations ran");
}

/// bf16 compute splits the same way: TP changes only how f32 partial sums are added, so
/// logits stay within f32 rounding of one rank's and greedy tokens are equal.
#[test]
fn bf16_splits_match_one_rank() {
    for name in ["llama_bf16", "qwen2_bias_tied"] {
        let dir = strata_tests::fixtures_dir().join(name);
        let prompt = ids(&reference(&dir)["prompt_ids"]);
        let bf16 = dtype_config(Some(strata_engine::tensor::DType::BF16));
        let mut single = local_replica(&dir, Parallelism::NONE, &bf16).unwrap();
        let want_logits = single.prompt_logits(&prompt).unwrap();
        let want = greedy_run(&mut single, &prompt, 24);
        for (tp, pp) in [(2, 1), (1, 2)] {
            let mut e = local_replica(&dir, Parallelism::new(tp, pp), &bf16).unwrap();
            let logits = e.prompt_logits(&prompt).unwrap();
            let diff = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-3, "{name} bf16 tp={tp} pp={pp}: logits differ by {diff}");
            assert_eq!(
                greedy_run(&mut e, &prompt, 24),
                want,
                "{name} bf16 tp={tp} pp={pp}: greedy tokens differ"
            );
        }
    }
}

/// Expert parallelism: each MoE fixture with its experts split whole across 2 (and 4,
/// where the heads allow) ranks of a stage, alone and with 2 pipeline stages — tokens go
/// to their experts' ranks and back over the all-to-all — gives one rank's logits within
/// 1e-4 and its greedy tokens, HF's too; every rank computed a share of the token-expert
/// pairs, and each MoE layer's routing was counted.
#[test]
fn expert_parallel_splits_match_one_rank() {
    let mut ran = 0;
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model_config = strata_common::ModelConfig::from_dir(&dir).unwrap();
        if model_config.moe.is_none() {
            continue;
        }
        let r = reference(&dir);
        let prompt = ids(&r["prompt_ids"]);
        let hf = ids(&r["greedy_ids"]);
        let mut single = local_replica(&dir, Parallelism::NONE, &config()).unwrap();
        let want_logits = single.prompt_logits(&prompt).unwrap();
        let want = greedy_run(&mut single, &prompt, 24);
        assert_eq!(want, hf[..24], "{name}: one rank against HF");
        for (ep, pp) in [(2, 1), (2, 2), (4, 1)] {
            let Ok(par) = Parallelism::with_ep(1, pp, ep) else { continue };
            if ShardPlan::new(&model_config, par).is_err() {
                continue; // e.g. 6 experts over 4 ranks
            }
            let labels = strata_engine::metrics::ReplicaLabels {
                model: format!("{name}-ep{ep}-pp{pp}"),
                replica: "r".into(),
            };
            let config = EngineConfig { labels: labels.clone(), ..config() };
            let mut e = local_replica(&dir, par, &config)
                .unwrap_or_else(|err| panic!("{name} ep={ep} pp={pp}: {err}"));
            let logits = e.prompt_logits(&prompt).unwrap();
            let diff = logits.iter().zip(&want_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-4, "{name} ep={ep} pp={pp}: logits differ by {diff}");
            assert_eq!(greedy_run(&mut e, &prompt, 24), want, "{name} ep={ep} pp={pp}: greedy tokens differ");
            let text = strata_common::metrics::encode();
            let sample = |metric: &str, rank: usize| {
                let key = format!("{metric}{{model=\"{}\",replica=\"r\",rank=\"{rank}\"}}", labels.model);
                text.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse::<f64>().ok())
            };
            for rank in 0..par.world() {
                let pairs = sample("strata_rank_expert_tokens_total", rank).unwrap_or(0.0);
                assert!(pairs > 0.0, "{name} ep={ep} pp={pp}: rank {rank} computed no token-expert pair");
                assert!(
                    sample("strata_all_to_all_seconds_count", rank).unwrap_or(0.0) > 0.0,
                    "{name}: rank {rank}"
                );
            }
            let routed = format!("strata_expert_tokens_total{{model=\"{}\"", labels.model);
            assert!(text.lines().any(|l| l.starts_with(&routed)), "{name}: no routing counted");
            ran += 1;
        }
    }
    assert!(ran >= 4, "only {ran} MoE model × EP split combinations ran");
}

mod processes {
    //! A replica whose ranks are separate `strata worker` processes on loopback.

    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use strata_proto::inference::v1 as pb;
    use strata_proto::inference::v1::inference_client::InferenceClient;
    use strata_tests::{ids, reference, strata_bin, write_slow_model, Server};

    struct Workers(Vec<Child>);

    impl Drop for Workers {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// `strata serve` as rank 0 plus `tp·pp − 1` worker processes, experts split across
    /// `ep` ranks of each stage.
    fn replica(model: &str, tp: usize, pp: usize, ep: usize) -> (Server, Workers) {
        let (tp_s, pp_s, ep_s) = (tp.to_string(), pp.to_string(), ep.to_string());
        let mut server = Server::spawn(&[
            "--model",
            model,
            "--name",
            "m",
            "--tp",
            &tp_s,
            "--pp",
            &pp_s,
            "--ep",
            &ep_s,
            "--worker-rendezvous",
            "127.0.0.1:0",
            "--dtype",
            "f32",
        ]);
        let announced =
            server.out.wait_event("rendezvous", std::time::Duration::from_secs(60), "strata serve");
        let rendezvous = announced["address"].as_str().expect("rendezvous address").to_string();
        let workers = (1..tp * pp)
            .map(|rank| {
                Command::new(strata_bin())
                    .args([
                        "worker",
                        "--model",
                        model,
                        "--tp",
                        &tp_s,
                        "--pp",
                        &pp_s,
                        "--ep",
                        &ep_s,
                        "--rank",
                        &rank.to_string(),
                        "--dtype",
                        "f32",
                    ])
                    .args(["--rendezvous", &rendezvous])
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start strata worker")
            })
            .collect();
        server.addr = server.wait_ready();
        (server, Workers(workers))
    }

    fn request(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
        pb::GenerateRequest {
            model: "m".into(),
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt })),
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        }
    }

    /// Greedy tokens and their top-5 logprobs from a single in-process rank.
    fn single_rank(dir: &std::path::Path, prompt: &[u32], n: u32) -> (Vec<u32>, Vec<Vec<(u32, f32)>>) {
        let mut e =
            strata_engine::replica::local_replica(dir, strata_common::Parallelism::NONE, &super::config())
                .unwrap();
        let params = strata_common::SamplingParams {
            max_new_tokens: n,
            ignore_eos: true,
            logprobs: Some(5),
            ..Default::default()
        };
        e.add(strata_engine::SeqId(0), prompt.to_vec(), params).unwrap();
        let (mut tokens, mut tops) = (Vec::new(), Vec::new());
        while e.has_work() {
            for ev in e.step().unwrap() {
                tokens.push(ev.token);
                tops.push(ev.logprobs.unwrap().top);
            }
        }
        (tokens, tops)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn worker_processes_match_one_rank_for_every_model_and_split() {
        let mut ran = 0;
        for dir in strata_tests::fixture_models() {
            let name = dir.file_name().unwrap().to_string_lossy().to_string();
            let r = reference(&dir);
            let prompt = ids(&r["prompt_ids"]);
            let (want, want_top) = single_rank(&dir, &prompt, 16);
            assert_eq!(want, ids(&r["greedy_ids"])[..16].to_vec(), "{name}: single rank vs HF");
            let config = strata_common::ModelConfig::from_dir(&dir).unwrap();
            // Expert parallelism (ep 2) only where the model has experts.
            for (tp, pp, ep) in [(2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)] {
                let par = strata_common::Parallelism { tp, pp, ep };
                if strata_common::ShardPlan::new(&config, par).is_err() {
                    continue;
                }
                let (server, _workers) = replica(&dir.to_string_lossy(), tp, pp, ep);
                let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
                let mut req = request(prompt.clone(), 16);
                req.logprobs = Some(5);
                let got = c.generate(req).await.unwrap().into_inner();
                assert_eq!(got.token_ids, want, "{name} tp={tp} pp={pp} ep={ep} across processes");
                for (lp, top) in got.logprobs.iter().zip(&want_top) {
                    for (a, b) in lp.top.iter().zip(top) {
                        assert_eq!(a.token_id, b.0, "{name} tp={tp} pp={pp}: top-5 order");
                        assert!(
                            (a.logprob - b.1).abs() <= 1e-4,
                            "{name} tp={tp} pp={pp}: logprob {} vs {}",
                            a.logprob,
                            b.1
                        );
                    }
                }
                ran += 1;
            }
        }
        assert!(ran >= 30, "only {ran} model × split combinations ran");
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn killing_a_rank_fails_the_stream_promptly() {
        let tmp = tempfile::tempdir().unwrap();
        write_slow_model(tmp.path());
        let (server, mut workers) = replica(&tmp.path().to_string_lossy(), 2, 2, 1);
        let mut c = InferenceClient::connect(server.endpoint()).await.unwrap();
        let mut stream = c.generate_stream(request(vec![1, 2, 3], 1500)).await.unwrap().into_inner();
        for _ in 0..3 {
            assert!(stream.message().await.unwrap().is_some());
        }
        workers.0[2].kill().unwrap(); // rank 3: last stage, TP rank 1
        let killed = Instant::now();
        let status = loop {
            match tokio::time::timeout(Duration::from_secs(20), stream.message()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => panic!("the stream finished normally after a rank died"),
                Ok(Err(status)) => break status,
                Err(_) => panic!("the stream hung after a rank died"),
            }
        };
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(killed.elapsed() < Duration::from_secs(10), "took {:?}", killed.elapsed());
        // The server itself stays up and says so.
        let again = c.generate(request(vec![1, 2], 2)).await.expect_err("the replica is broken");
        assert_eq!(again.code(), tonic::Code::Unavailable, "{again:?}");
    }
}

#[test]
fn each_rank_holds_its_share_of_the_weights() {
    use strata_engine::backend::cpu::CpuBackend;
    use strata_engine::model::Model;
    // 4 layers, untied: a tp=2 × pp=2 rank holds half the matrices of two layers and half
    // the embedding (first stage) or half the LM head (last stage): a quarter of the model.
    let dir = strata_tests::fixtures_dir().join("llama_sharded");
    let whole = Model::load(&dir, CpuBackend::new()).unwrap().weight_bytes();
    let par = Parallelism::new(2, 2);
    let mut total = 0;
    for rank in 0..4 {
        let bytes = Model::load_shard(&dir, CpuBackend::new(), par, rank).unwrap().weight_bytes();
        let share = bytes as f64 / whole as f64;
        assert!((0.24..=0.26).contains(&share), "rank {rank} holds {share:.3} of the weights");
        total += bytes;
    }
    assert_eq!(total, whole, "the shards add up to the model, nothing replicated");
}
