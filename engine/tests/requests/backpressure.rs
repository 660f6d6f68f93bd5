//! A caller that does not read cannot make a replica hold unbounded memory: a sequence
//! whose stream is left unread is cancelled once its buffer fills (the caller is told why),
//! and streams that finished but were never read still count toward admission.

use std::time::{Duration, Instant};

use crate::fixtures::fixtures_dir;
use strata_common::{ErrorClass, SamplingParams, SeqEvent};
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::model::Model;
use strata_engine::scheduler::SchedulerConfig;
use strata_engine::{Engine, EngineConfig, EngineHandle, RunnerLimits};

fn handle(max_num_seqs: usize, limits: RunnerLimits) -> EngineHandle {
    let model = Model::load(&fixtures_dir().join("llama_gqa"), CpuBackend::new()).unwrap();
    let config = EngineConfig {
        kv_cache_bytes: 16 << 20,
        scheduler: SchedulerConfig { max_num_seqs, max_batched_tokens: 256 },
        ..Default::default()
    };
    EngineHandle::spawn(Engine::new(model, &config).unwrap(), limits, "backpressure").unwrap()
}

fn greedy(n: u32) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() }
}

/// Polls until the engine has nothing running or waiting.
fn idle(h: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.load() > 0 {
        assert!(Instant::now() < deadline, "the engine never went idle");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test]
async fn an_unread_stream_is_cancelled_when_its_buffer_fills() {
    let h = handle(4, RunnerLimits { max_waiting: 4, stream_buffer: 8 });
    let mut unread = h.submit(vec![1, 2, 3], greedy(40)).unwrap();
    idle(&h); // cancelled, not generating on into memory
    let mut tokens = 0;
    loop {
        match unread.next().await {
            Some(SeqEvent::Token { finish: None, .. }) => tokens += 1,
            Some(SeqEvent::Failed(e)) => {
                assert_eq!(e.class(), ErrorClass::Overloaded, "{e}");
                assert!(e.to_string().contains("unread"), "{e}");
                break;
            }
            other => panic!("expected the buffered tokens then the reason, got {other:?}"),
        }
    }
    assert_eq!(tokens, 7, "one slot of the 8 is kept for the error");
    // A caller whose buffer never fills gets every token. (Read through the 8-event
    // buffer, 40 tokens raced this test's thread against the engine's: on a loaded
    // 2-core machine the reader was descheduled long enough for 7 to pile up.)
    let h = handle(4, RunnerLimits { max_waiting: 4, stream_buffer: 64 });
    let mut read = h.submit(vec![1, 2, 3], greedy(40)).unwrap();
    let mut n = 0;
    while let Some(ev) = read.next().await {
        match ev {
            SeqEvent::Token { .. } => n += 1,
            SeqEvent::Failed(e) => panic!("{e}"),
            SeqEvent::Prompt(_) | SeqEvent::Embedding(_) => panic!("an event that was not asked for"),
        }
    }
    assert_eq!(n, 40);
}

#[test]
fn finished_but_unread_streams_count_toward_admission() {
    let h = handle(2, RunnerLimits { max_waiting: 2, ..Default::default() });
    let mut held = Vec::new();
    for i in 0..4 {
        held.push(h.submit(vec![1, 2 + i], greedy(2)).unwrap());
        idle(&h); // each finishes; its stream stays unread
    }
    let e = h.submit(vec![1, 9], greedy(2)).err().expect("2 running + 2 waiting streams are still open");
    assert_eq!(e.class(), ErrorClass::Overloaded);
    assert!(e.to_string().contains("not read to the end"), "{e}");
    held.pop();
    h.submit(vec![1, 9], greedy(2)).expect("a dropped stream gives its slot back");
}
