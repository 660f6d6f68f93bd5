//! Constrained decoding in the engine: constrained and free sequences share batches
//! without changing each other's tokens; a constrained output always matches; failover
//! continues exactly where the first replica stopped; a replica without a tokenizer, or a
//! constraint that cannot compile, refuses the request on arrival.

use std::collections::HashMap;

use crate::fixtures::fixtures_dir;
use strata_common::Parallelism;
use strata_common::{Constraint, ErrorClass, FinishReason, SamplingParams, SeqEvent};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::replica::local_replica;
use strata_engine::runner::{EngineHandle, RunnerLimits};
use strata_engine::{Engine, EngineConfig, SeqId};

fn engine() -> Engine {
    local_replica(&fixtures_dir().join("llama_gqa"), Parallelism::NONE, &EngineConfig::default()).unwrap()
}

fn schema() -> Constraint {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["red", "green", "blue"]},
            "name": {"type": "string", "maxLength": 5}
        },
        "required": ["id", "tag", "name"],
        "additionalProperties": false
    });
    Constraint::JsonSchema(schema.to_string())
}

fn params(constraint: Option<Constraint>, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams { max_new_tokens: 64, temperature, seed: Some(seed), constraint, ..Default::default() }
}

/// Runs every queued sequence to its end: each one's tokens and finish reason.
fn run(e: &mut Engine) -> HashMap<SeqId, (Vec<u32>, Option<FinishReason>)> {
    let mut out: HashMap<SeqId, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            let entry = out.entry(ev.seq).or_default();
            entry.0.push(ev.token);
            entry.1 = ev.finish;
        }
        assert!(e.take_aborted().is_empty(), "no sequence fails midway");
    }
    out
}

fn text(tokens: &[u32]) -> String {
    let g = engine().grammars().unwrap();
    let body: Vec<u32> = tokens.iter().copied().filter(|&t| t != 2).collect();
    String::from_utf8(g.decode(&body)).unwrap()
}

#[test]
fn constrained_and_free_sequences_share_batches_and_each_gets_its_own() {
    let prompt: Vec<u32> = (3..20).collect();
    // Alone, each sequence's tokens.
    let mut alone = HashMap::new();
    for (i, c) in [None, Some(schema()), None, Some(Constraint::Choice(vec!["left".into(), "right".into()]))]
        .into_iter()
        .enumerate()
    {
        let mut e = engine();
        e.add(SeqId(i as u64), prompt.clone(), params(c.clone(), 0.8 * (i % 2) as f32, i as u64)).unwrap();
        alone.insert(i, (c, run(&mut e).remove(&SeqId(i as u64)).unwrap()));
    }
    let mut e = engine();
    for (i, (c, _)) in &alone {
        e.add(SeqId(*i as u64), prompt.clone(), params(c.clone(), 0.8 * (i % 2) as f32, *i as u64)).unwrap();
    }
    let together = run(&mut e);
    for (i, (c, (tokens, finish))) in &alone {
        assert_eq!(&together[&SeqId(*i as u64)].0, tokens, "sequence {i}: the same tokens in a batch");
        match c {
            Some(Constraint::JsonSchema(_)) => {
                let ended = matches!(finish, Some(FinishReason::Stop | FinishReason::Eos));
                assert!(ended, "the schema's end ends it, not max_tokens: {finish:?}");
                let v: serde_json::Value = serde_json::from_str(&text(tokens)).unwrap();
                assert!(v["id"].as_u64().unwrap() <= 999 && v["name"].as_str().unwrap().chars().count() <= 5);
                assert!(["red", "green", "blue"].contains(&v["tag"].as_str().unwrap()), "{v}");
            }
            Some(Constraint::Choice(_)) => assert!(["left", "right"].contains(&text(tokens).as_str())),
            _ => assert_eq!(tokens.len(), 64, "free sequences run to max_tokens or EOS as before"),
        }
    }
}

#[test]
fn failover_resumes_a_constrained_sequence_where_it_stopped() {
    let prompt: Vec<u32> = (3..20).collect();
    let mut e = engine();
    e.add(SeqId(1), prompt.clone(), params(Some(schema()), 1.0, 7)).unwrap();
    let (whole, _) = run(&mut e).remove(&SeqId(1)).unwrap();
    assert!(whole.len() > 6, "{whole:?}");
    // Another replica, given the first six tokens, produces the rest.
    let mut other = engine();
    other.add_resumed(SeqId(2), prompt.clone(), whole[..6].to_vec(), params(Some(schema()), 1.0, 7)).unwrap();
    let (rest, _) = run(&mut other).remove(&SeqId(2)).unwrap();
    assert_eq!(rest, whole[6..], "the continuation the first replica would have made");
    // Tokens the constraint never allowed cannot be resumed.
    let bad: Vec<u32> = vec![whole[0], 300, 301];
    let err = other.add_resumed(SeqId(3), prompt, bad, params(Some(schema()), 1.0, 7)).unwrap_err();
    assert_eq!(err.class(), ErrorClass::InvalidInput, "{err}");
}

#[test]
fn a_replica_refuses_what_it_cannot_enforce_on_arrival() {
    // Built without its model directory: no tokenizer to compile against.
    let model = Model::load(&fixtures_dir().join("llama_gqa"), CpuBackend::new()).unwrap();
    let mut bare = Engine::new(model, &EngineConfig::default()).unwrap();
    let err =
        bare.add(SeqId(1), vec![3, 4], params(Some(Constraint::Regex("a+".into())), 0.0, 1)).unwrap_err();
    assert!(err.to_string().contains("guided_regex") && err.to_string().contains("tokenizer"), "{err}");
    let mut e = engine();
    let err = e.add(SeqId(1), vec![3, 4], params(Some(Constraint::Regex("(".into())), 0.0, 1)).unwrap_err();
    assert_eq!(err.class(), ErrorClass::InvalidInput, "{err}");
}

#[tokio::test]
async fn the_runner_compiles_off_its_thread_and_reports_refusals_to_the_caller() {
    let handle = EngineHandle::spawn(engine(), RunnerLimits::default(), "constrained").unwrap();
    let prompt: Vec<u32> = (3..12).collect();
    let mut ok =
        handle.submit(prompt.clone(), params(Some(Constraint::Choice(vec!["up".into()])), 0.0, 1)).unwrap();
    let mut bad = handle.submit(prompt.clone(), params(Some(Constraint::Regex("[".into())), 0.0, 1)).unwrap();
    let mut free = handle.submit(prompt, params(None, 0.0, 1)).unwrap();
    let mut tokens = Vec::new();
    while let Some(ev) = ok.next().await {
        match ev {
            SeqEvent::Token { token, .. } => tokens.push(token),
            SeqEvent::Failed(e) => panic!("{e}"),
            SeqEvent::Prompt(_) | SeqEvent::Embedding(_) => panic!("an event that was not asked for"),
        }
    }
    assert_eq!(text(&tokens), "up");
    match bad.next().await {
        Some(SeqEvent::Failed(e)) => assert_eq!(e.class(), ErrorClass::InvalidInput, "{e}"),
        other => panic!("a refusal, got {other:?}"),
    }
    let mut n = 0;
    while let Some(SeqEvent::Token { .. }) = free.next().await {
        n += 1;
    }
    assert_eq!(n, 64);
    // Every submission left the queue: nothing counted as waiting.
    assert_eq!(handle.stats().waiting, 0);
}
