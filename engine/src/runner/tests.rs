//! The runner's state driven by hand, as TGI tests its queue: a real engine on a tiny
//! random model behind an executor that can be told to fail, commands sent through the
//! handle, and one turn of the runner's loop at a time — no thread, no sleeps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use strata_common::{ErrorClass, FinishReason, ModelConfig, Parallelism};

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::comm::CommStats;
use crate::dist::{LeaderExecutor, StepExecutor};
use crate::engine::EngineConfig;
use crate::logits::StepOutput;
use crate::model::random::RandomModelSpec;
use crate::model::Model;
use crate::step::Step;

/// A one-rank executor that fails its steps when told to, with the error class of a
/// lost rank (`Unavailable`) or of a bug (`Internal`), and counts the steps it runs.
struct Faulty {
    inner: LeaderExecutor<CpuBackend>,
    fail: Arc<AtomicUsize>,
    steps: Arc<AtomicUsize>,
}

const HEALTHY: usize = 0;
const RANK_LOST: usize = 1;
const BUG: usize = 2;

impl StepExecutor for Faulty {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn alloc_kv(&mut self, kv: crate::step::KvBlocks) -> Result<()> {
        self.inner.alloc_kv(kv)
    }
    fn execute(&mut self, step: &Step) -> Result<StepOutput> {
        self.steps.fetch_add(1, Ordering::SeqCst);
        match self.fail.load(Ordering::SeqCst) {
            RANK_LOST => Err(Error::Unavailable("rank 1 stopped answering".into())),
            BUG => Err(Error::Internal("a step the executor could not run".into())),
            _ => self.inner.execute(step),
        }
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn kv_element_bytes(&self) -> usize {
        self.inner.kv_element_bytes()
    }
    fn decode_bytes_per_token(&self) -> usize {
        self.inner.decode_bytes_per_token()
    }
    fn comm_stats(&self) -> Option<CommStats> {
        None
    }
}

struct Harness {
    handle: EngineHandle,
    runner: Runner,
    fail: Arc<AtomicUsize>,
    steps: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

fn harness(max_num_seqs: usize, limits: RunnerLimits) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    RandomModelSpec::tiny(strata_common::Architecture::Llama).write(dir.path(), |_, _| {}).unwrap();
    let mut config = EngineConfig { kv_cache_bytes: 1 << 20, block_size: 4, ..Default::default() };
    config.scheduler.max_num_seqs = max_num_seqs;
    let model = Model::load(dir.path(), CpuBackend::new()).unwrap();
    let (fail, steps) = (Arc::new(AtomicUsize::new(HEALTHY)), Arc::new(AtomicUsize::new(0)));
    let exec = Faulty { inner: LeaderExecutor::solo(model), fail: fail.clone(), steps: steps.clone() };
    let engine = Engine::with_executor(Box::new(exec), Parallelism::NONE, &config).unwrap();
    let (handle, runner) = EngineHandle::unspawned(engine, limits);
    Harness { handle, runner, fail, steps, _dir: dir }
}

fn greedy(n: u32) -> SamplingParams {
    SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() }
}

/// The events a stream holds now.
fn drain(s: &mut SequenceStream) -> Vec<SeqEvent> {
    std::iter::from_fn(|| s.rx.try_recv().ok()).collect()
}

fn tokens(events: &[SeqEvent]) -> usize {
    events.iter().filter(|e| matches!(e, SeqEvent::Token { .. })).count()
}

/// Turns until the engine is idle (a bounded number of turns: a runner that never finishes
/// fails the test instead of hanging it).
fn run_dry(h: &mut Harness) {
    for _ in 0..1000 {
        h.runner.turn();
        if !h.runner.engine.has_work() {
            return;
        }
    }
    panic!("the engine still has work after 1000 turns");
}

#[test]
fn a_submission_is_admitted_and_streams_its_tokens_to_the_end() {
    let mut h = harness(4, RunnerLimits::default());
    let mut s = h.handle.submit(vec![1, 2, 3], greedy(5)).unwrap();
    assert_eq!(h.handle.stats().waiting, 1, "queued before the runner takes it");
    run_dry(&mut h);
    let events = drain(&mut s);
    assert_eq!(tokens(&events), 5, "{events:?}");
    assert!(matches!(events.last(), Some(SeqEvent::Token { finish: Some(FinishReason::Length), .. })));
    let stats = h.handle.stats();
    assert_eq!((stats.running, stats.waiting), (0, 0));
    assert_eq!(stats.kv_blocks_free, stats.kv_blocks_total, "a finished sequence's blocks are free");
}

#[test]
fn a_dropped_stream_cancels_its_sequence_and_frees_its_blocks() {
    let mut h = harness(4, RunnerLimits::default());
    let mut s = h.handle.submit(vec![1, 2, 3, 4, 5, 6], greedy(100)).unwrap();
    h.runner.turn();
    h.runner.turn();
    assert_eq!(tokens(&drain(&mut s)), 2);
    assert!(h.handle.stats().kv_blocks_free < h.handle.stats().kv_blocks_total);
    drop(s);
    h.runner.turn();
    assert!(!h.runner.engine.has_work(), "cancelled at the next turn");
    let stats = h.handle.stats();
    assert_eq!((stats.running, stats.kv_blocks_free), (0, stats.kv_blocks_total));
}

#[test]
fn a_canary_on_an_idle_engine_runs_one_step_of_its_own() {
    let mut h = harness(4, RunnerLimits::default());
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    h.handle.tx.send(Command::Canary(tx)).unwrap();
    h.runner.turn();
    assert!(matches!(rx.try_recv(), Ok(Ok(()))), "answered after the step it made");
    assert_eq!(h.steps.load(Ordering::SeqCst), 1, "one step: one prompt token, one output token");
    assert!(!h.runner.engine.has_work(), "the canary sequence leaves nothing behind");
    assert_eq!(h.handle.stats().kv_blocks_free, h.handle.stats().kv_blocks_total);
}

#[test]
fn a_canary_on_a_busy_engine_is_answered_by_the_next_step() {
    let mut h = harness(4, RunnerLimits::default());
    let mut s = h.handle.submit(vec![1, 2], greedy(3)).unwrap();
    h.runner.turn();
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    h.handle.tx.send(Command::Canary(tx)).unwrap();
    h.runner.turn();
    assert!(matches!(rx.try_recv(), Ok(Ok(()))));
    assert_eq!(h.steps.load(Ordering::SeqCst), 2, "no step of the canary's own");
    run_dry(&mut h);
    assert_eq!(tokens(&drain(&mut s)), 3);
}

#[test]
fn a_lost_rank_breaks_the_runner_and_fails_everything_after() {
    let mut h = harness(4, RunnerLimits::default());
    let mut s = h.handle.submit(vec![1, 2, 3], greedy(10)).unwrap();
    h.runner.turn();
    h.fail.store(RANK_LOST, Ordering::SeqCst);
    h.runner.turn();
    let events = drain(&mut s);
    let failed = events.iter().find_map(|e| match e {
        SeqEvent::Failed(e) => Some(e.class()),
        _ => None,
    });
    assert_eq!(failed, Some(ErrorClass::Unavailable), "{events:?}");
    let why = h.handle.broken().expect("the runner says why it is broken");
    assert!(why.contains("rank 1"), "{why}");
    let refused = h.handle.submit(vec![1], greedy(1)).err().unwrap();
    assert_eq!(refused.class(), ErrorClass::Unavailable);
    // A canary never goes near the broken replica's ranks.
    let steps = h.steps.load(Ordering::SeqCst);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    h.handle.tx.send(Command::Canary(tx)).unwrap();
    h.runner.turn();
    assert!(matches!(rx.try_recv(), Ok(Err(e)) if e.class() == ErrorClass::Unavailable));
    assert_eq!(h.steps.load(Ordering::SeqCst), steps);
}

#[test]
fn a_step_that_fails_for_another_reason_fails_its_sequences_only() {
    let mut h = harness(4, RunnerLimits::default());
    let mut s = h.handle.submit(vec![1, 2, 3], greedy(10)).unwrap();
    h.fail.store(BUG, Ordering::SeqCst);
    h.runner.turn();
    assert!(drain(&mut s).iter().any(|e| matches!(e, SeqEvent::Failed(_))));
    assert_eq!(h.handle.broken(), None, "not a lost rank: the replica still serves");
    h.fail.store(HEALTHY, Ordering::SeqCst);
    let mut next = h.handle.submit(vec![4, 5], greedy(2)).unwrap();
    run_dry(&mut h);
    assert_eq!(tokens(&drain(&mut next)), 2);
    assert_eq!(h.handle.stats().kv_blocks_free, h.handle.stats().kv_blocks_total);
}

#[test]
fn a_full_queue_refuses_at_once() {
    // One running slot, two waiting: the fourth submission is refused before the runner
    // sees any of them.
    let limits = RunnerLimits { max_waiting: 2, ..Default::default() };
    let mut h = harness(1, limits);
    let streams: Vec<_> = (0..2).map(|i| h.handle.submit(vec![1 + i], greedy(4)).unwrap()).collect();
    let refused = h.handle.submit(vec![9], greedy(4)).err().unwrap();
    assert_eq!(refused.class(), ErrorClass::Overloaded, "{refused}");
    h.runner.turn();
    // One admitted, one waiting in the scheduler: room for one more waiter, no more.
    let third = h.handle.submit(vec![7], greedy(4)).unwrap();
    assert_eq!(h.handle.submit(vec![8], greedy(4)).err().unwrap().class(), ErrorClass::Overloaded);
    run_dry(&mut h);
    for mut s in streams.into_iter().chain([third]) {
        assert_eq!(tokens(&drain(&mut s)), 4);
    }
}

#[test]
fn a_caller_that_never_reads_has_its_sequence_cancelled() {
    let limits = RunnerLimits { stream_buffer: 3, ..Default::default() };
    let mut h = harness(4, limits);
    let mut s = h.handle.submit(vec![1, 2], greedy(50)).unwrap();
    run_dry(&mut h);
    let events = drain(&mut s);
    assert_eq!(tokens(&events), 2, "the buffer less the slot kept for the error: {events:?}");
    assert!(
        matches!(events.last(), Some(SeqEvent::Failed(e)) if e.class() == ErrorClass::Overloaded),
        "{events:?}"
    );
    assert_eq!(h.handle.stats().kv_blocks_free, h.handle.stats().kv_blocks_total);
}

#[test]
fn a_request_the_engine_refuses_fails_its_stream_not_the_runner() {
    let mut h = harness(4, RunnerLimits::default());
    let vocab = h.runner.engine.executor().config().vocab_size as u32;
    let mut s = h.handle.submit(vec![vocab + 5], greedy(2)).unwrap();
    h.runner.turn();
    let events = drain(&mut s);
    assert!(
        matches!(&events[..], [SeqEvent::Failed(e)] if e.class() == ErrorClass::InvalidInput),
        "{events:?}"
    );
    assert_eq!(h.steps.load(Ordering::SeqCst), 0);
    let mut good = h.handle.submit(vec![3], greedy(1)).unwrap();
    run_dry(&mut h);
    assert_eq!(tokens(&drain(&mut good)), 1);
}

/// A canary that timed out blames the replica only when its steps stopped: a step that
/// completed meanwhile, or one running no longer than three of the last, means a healthy
/// replica under load (a 0.9B MoE replica whose steps took ~7 s was failed 7 times).
#[test]
fn a_timed_out_canary_blames_only_a_replica_whose_steps_stopped() {
    use std::time::Duration;
    let ago = |s: u64| Some(Instant::now() - Duration::from_secs(s));
    let before = Progress { steps: 5, last_step: Duration::from_secs(2), running_since: ago(1) };
    assert!(Progress { steps: 6, running_since: None, ..before }.still_working(&before));
    assert!(Progress { running_since: ago(5), ..before }.still_working(&before), "a long step still running");
    assert!(
        !Progress { running_since: ago(7), ..before }.still_working(&before),
        "a step stuck past 3× the last"
    );
    assert!(!Progress { running_since: None, ..before }.still_working(&before), "no step ran at all");
}
