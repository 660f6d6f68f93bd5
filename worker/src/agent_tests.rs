//! The shard slot without transport: loads of one rank and of a two-rank replica split
//! across two agents, the states a coordinator reads, drain and unload, and refusals.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_common::cluster::{EngineLimits, ShardState};
use strata_common::model_roots::ModelRoots;
use strata_common::worker_api::ShardLoad;
use strata_common::{ErrorClass, Parallelism, SamplingParams, SeqEvent};
use strata_engine::EngineConfig;

use super::{AgentConfig, WorkerAgent};

/// The fixture every test loads: a two-layer GQA Llama with HF transformers' greedy tokens.
pub(crate) fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models/llama_gqa")
        .canonicalize()
        .expect("the llama_gqa fixture")
}

pub(crate) fn agent(id: &str, roots: ModelRoots) -> Arc<WorkerAgent> {
    WorkerAgent::new(AgentConfig {
        id: id.into(),
        bind_ip: "127.0.0.1".parse().unwrap(),
        advertise_host: "127.0.0.1".into(),
        backend: Default::default(),
        engine: EngineConfig { kv_cache_bytes: 16 << 20, ..Default::default() },
        runner: Default::default(),
        model_roots: roots,
        rank_threads: Default::default(),
    })
    .unwrap()
}

pub(crate) fn shard(replica: &str, par: Parallelism, rank: usize, rendezvous: Option<String>) -> ShardLoad {
    ShardLoad {
        replica: replica.into(),
        model: "m".into(),
        model_dir: fixture().to_string_lossy().into_owned(),
        dtype: None,
        quantize: String::new(),
        par,
        rank,
        rendezvous,
        limits: EngineLimits::default(),
        group_secret: b"a group secret of the replica".to_vec(),
    }
}

/// Polls the agent's state until it is `want`, failing after 60 s.
pub(crate) fn wait_state(agent: &WorkerAgent, want: ShardState) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = agent.status();
        let state = status.assignment.as_ref().map(|a| a.state);
        if state == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{} never reached {want:?}: {status:?}", agent.id());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// HF transformers' prompt and greedy tokens for the fixture.
fn reference() -> (Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (ids("prompt_ids"), ids("greedy_ids"))
}

/// Greedy tokens from the replica `agent` leads.
async fn generate(agent: &WorkerAgent, replica: &str, prompt: Vec<u32>, n: usize) -> Vec<u32> {
    let handle = agent.serving(replica).expect("a serving leader");
    let params = SamplingParams { max_new_tokens: n as u32, ignore_eos: true, ..Default::default() };
    let mut stream = handle.submit(prompt, params).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = stream.next().await {
        match ev {
            SeqEvent::Token { token, .. } => out.push(token),
            SeqEvent::Failed(e) => panic!("generation failed: {e}"),
            SeqEvent::Prompt(_) | SeqEvent::Embedding(_) => panic!("an event that was not asked for"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn one_rank_loads_serves_drains_and_unloads() {
    let a = agent("w1", ModelRoots::default());
    assert_eq!(a.status().assignment, None);
    let req = shard("r1", Parallelism::NONE, 0, None);
    assert_eq!(a.load(req.clone()).unwrap(), None, "a one-rank replica has no rendezvous");
    wait_state(&a, ShardState::Ready);
    let (prompt, want) = reference();
    assert_eq!(generate(&a, "r1", prompt.clone(), want.len()).await, want);
    assert_eq!(generate(&a, "", prompt, 2).await, want[..2], "an empty replica id means the one held");
    let status = a.status();
    assert_eq!((status.loads, status.served), (1, 2), "{status:?}");

    // The same load again is idempotent; another one is refused while this one is held.
    a.load(req).unwrap();
    assert_eq!(a.status().loads, 1);
    let other = a.load(shard("r2", Parallelism::NONE, 0, None)).unwrap_err();
    assert_eq!(other.class(), ErrorClass::FailedPrecondition, "{other}");
    assert_eq!(a.serving("r2").err().expect("refused").class(), ErrorClass::Unavailable);

    // Draining keeps the engine for streams in flight and refuses new ones.
    a.drain("r1").unwrap();
    assert!(a.status().draining);
    assert!(a.leader("r1").is_ok());
    assert_eq!(a.serving("r1").err().expect("refused").class(), ErrorClass::Unavailable);

    a.unload("r1");
    let status = a.status();
    assert_eq!((status.assignment, status.draining), (None, false));
    assert_eq!(a.leader("r1").err().expect("refused").class(), ErrorClass::Unavailable);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_agents_run_a_tensor_parallel_replica_and_unloading_rank_0_frees_rank_1() {
    let (lead, follow) = (agent("w1", ModelRoots::default()), agent("w2", ModelRoots::default()));
    let par = Parallelism::new(2, 1);
    let rendezvous = lead.load(shard("tp", par, 0, None)).unwrap().expect("rank 0's rendezvous");
    follow.load(shard("tp", par, 1, Some(rendezvous))).unwrap();
    wait_state(&lead, ShardState::Ready);
    wait_state(&follow, ShardState::Ready);
    let err = follow.leader("tp").err().expect("refused");
    assert_eq!(err.class(), ErrorClass::Unavailable, "a follower does not lead: {err}");

    let (prompt, want) = reference();
    assert_eq!(generate(&lead, "tp", prompt, want.len()).await, want, "TP 2 across two agents = HF's greedy");

    // Dropping rank 0's engine shuts the replica down: rank 1 lets go of its shard.
    lead.unload("tp");
    let deadline = Instant::now() + Duration::from_secs(30);
    while follow.status().assignment.is_some() {
        assert!(Instant::now() < deadline, "rank 1 still holds its shard: {:?}", follow.status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[test]
fn bad_loads_are_refused_before_anything_starts() {
    let roots = ModelRoots::new(vec![std::env::temp_dir().join("strata-no-models-here")]);
    let a = agent("w1", roots);
    let refused = |req: ShardLoad| a.load(req).unwrap_err();
    let e = refused(shard("", Parallelism::NONE, 0, None));
    assert!(e.class() == ErrorClass::InvalidInput && e.to_string().contains("replica_id"), "{e}");
    let e = refused(shard("r", Parallelism::NONE, 0, None));
    assert_eq!(e.class(), ErrorClass::PermissionDenied, "outside the model roots: {e}");

    let a = agent("w2", ModelRoots::default());
    let e = a.load(shard("r", Parallelism::new(2, 1), 2, Some("127.0.0.1:1".into()))).unwrap_err();
    assert!(e.class() == ErrorClass::InvalidInput && e.to_string().contains("rank"), "{e}");
    let e = a.load(shard("r", Parallelism::new(2, 1), 1, None)).unwrap_err();
    assert!(e.class() == ErrorClass::InvalidInput && e.to_string().contains("rendezvous"), "{e}");
    let e = a.load(shard("r", Parallelism { tp: 0, pp: 1, ep: 1 }, 0, None)).unwrap_err();
    assert_eq!(e.class(), ErrorClass::InvalidInput, "{e}");
    let status = a.status();
    assert_eq!((&status.assignment, status.loads), (&None, 0), "nothing was started: {status:?}");
}

#[test]
fn a_shard_that_fails_to_load_reports_why_and_can_be_replaced() {
    let empty = tempfile::tempdir().unwrap();
    let a = agent("w1", ModelRoots::default());
    let mut req = shard("broken", Parallelism::NONE, 0, None);
    req.model_dir = empty.path().canonicalize().unwrap().to_string_lossy().into_owned();
    a.load(req).unwrap();
    wait_state(&a, ShardState::Failed);
    let assignment = a.status().assignment.unwrap();
    assert!(assignment.error.contains("config.json"), "the error names what is missing: {assignment:?}");
    assert!(a.leader("broken").err().expect("refused").to_string().contains("failed"));

    // A failed shard does not block the next load.
    a.load(shard("good", Parallelism::NONE, 0, None)).unwrap();
    wait_state(&a, ShardState::Ready);
    assert_eq!(a.status().loads, 2);
}

#[test]
fn a_deployments_max_model_len_limits_its_replicas_context() {
    let a = agent("w1", ModelRoots::default());
    let mut req = shard("short", Parallelism::NONE, 0, None);
    req.limits.max_model_len = 100;
    a.load(req).unwrap();
    wait_state(&a, ShardState::Ready);
    assert_eq!(a.leader("short").unwrap().stats().max_context, 100, "the deployment's, not the model's 512");
}
