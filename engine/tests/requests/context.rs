//! A sequence's context is known when it arrives: the model's, `max_model_len` or what the
//! KV cache holds for one sequence, whichever is least — and a request for more is refused
//! then, naming `max_tokens`, instead of failing once its tokens no longer fit.

use crate::fixtures::fixtures_dir;
use strata_common::{ErrorClass, SamplingParams};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::{Engine, EngineConfig, SeqId};

fn engine(config: EngineConfig) -> strata_common::Result<Engine> {
    let model = Model::load(&fixtures_dir().join("llama_gqa"), CpuBackend::new()).unwrap();
    Engine::new(model, &config)
}

fn greedy(max_new_tokens: u32) -> SamplingParams {
    SamplingParams { max_new_tokens, ignore_eos: true, ..Default::default() }
}

/// Runs every queued sequence to its end; the tokens each produced.
fn run(e: &mut Engine) -> std::collections::HashMap<SeqId, usize> {
    let mut made = std::collections::HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            *made.entry(ev.seq).or_default() += 1;
        }
        assert!(e.take_aborted().is_empty(), "no sequence fails midway");
    }
    made
}

#[test]
fn a_small_kv_cache_limits_the_context_and_longer_requests_are_refused_on_arrival() {
    // The fixture's context is 512 positions; 64 KiB of KV cache hold 128 (f32) or 256.
    let small = EngineConfig { kv_cache_bytes: 64 << 10, block_size: 16, ..Default::default() };
    let mut e = engine(small).unwrap();
    let context = e.max_context();
    assert!((64..512).contains(&context), "the KV cache's limit, not the model's: {context}");
    let prompt: Vec<u32> = (3..53).collect();
    let err = e.add(SeqId(1), prompt.clone(), greedy((context - prompt.len() + 1) as u32)).unwrap_err();
    assert_eq!(err.class(), ErrorClass::InvalidInput, "{err}");
    assert!(
        matches!(&err, strata_common::Error::InvalidArgument { field, .. } if field == "max_tokens"),
        "{err}"
    );
    // Exactly the context fits, and runs to its end.
    let fits = (context - prompt.len()) as u32;
    e.add(SeqId(2), prompt, greedy(fits)).unwrap();
    assert_eq!(run(&mut e)[&SeqId(2)], fits as usize);
}

#[test]
fn max_model_len_limits_the_context_but_never_beyond_the_model() {
    let mut e = engine(EngineConfig { max_model_len: Some(40), ..Default::default() }).unwrap();
    assert_eq!(e.max_context(), 40);
    let err = e.add(SeqId(1), (3..13).collect(), greedy(31)).unwrap_err();
    assert!(
        matches!(&err, strata_common::Error::InvalidArgument { field, .. } if field == "max_tokens"),
        "{err}"
    );
    e.add(SeqId(2), (3..13).collect(), greedy(30)).unwrap();
    assert_eq!(run(&mut e)[&SeqId(2)], 30);

    let too_long = engine(EngineConfig { max_model_len: Some(513), ..Default::default() }).err().unwrap();
    assert!(
        too_long.to_string().contains("max_model_len") && too_long.to_string().contains("512"),
        "{too_long}"
    );
    let zero = engine(EngineConfig { max_model_len: Some(0), ..Default::default() }).err().unwrap();
    assert!(zero.to_string().contains("max_model_len"), "{zero}");
    assert_eq!(engine(EngineConfig::default()).unwrap().max_context(), 512, "unset: the model's context");
}
