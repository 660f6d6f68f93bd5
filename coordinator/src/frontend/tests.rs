//! The front end owns its state: two front ends over one catalog (two coordinators in
//! one process) share no cache, gate, ledger or online count.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use strata_common::{EngineStats, FinishReason, ModelConfig, Result, SamplingParams, SeqEvent};
use tokio::sync::Notify;

use super::admission::{GenerateRequest, Priority, Prompt};
use super::{FrontEnd, FrontEndOptions};
use crate::request::generation::RouteLimits;
use crate::request::tokenizer::Tokenizer;
use crate::routing::{Catalog, EventStream, GateSize, Job, ModelEntry, Replica, Routes};
use crate::tenant::{Caller, Tenants};

/// One replica that counts its jobs, answers each with three tokens, and can hold every
/// job at its first token until released.
#[derive(Default)]
struct CountingReplica {
    jobs: AtomicUsize,
    held: Mutex<bool>,
    release: Arc<Notify>,
}

#[async_trait::async_trait]
impl Replica for CountingReplica {
    fn id(&self) -> &str {
        "r0"
    }

    async fn submit(&self, _job: &Job) -> Result<EventStream> {
        self.jobs.fetch_add(1, Ordering::SeqCst);
        let hold = *self.held.lock().unwrap();
        let release = self.release.clone();
        let token = |t: u32, finish| SeqEvent::Token { token: t, logprobs: None, finish };
        Ok(futures::stream::once(async move { token(5, None) })
            .chain(futures::stream::once(async move {
                if hold {
                    release.notified().await;
                }
                token(6, None)
            }))
            .chain(futures::stream::iter([token(7, Some(FinishReason::Length))]))
            .boxed())
    }
}

struct OneReplica(Arc<CountingReplica>);

#[async_trait::async_trait]
impl Routes for OneReplica {
    fn pick(&self, _prompt: &[u32], _revision: u64, exclude: &[String]) -> Option<Arc<dyn Replica>> {
        (!exclude.iter().any(|r| r == "r0")).then(|| self.0.clone() as Arc<dyn Replica>)
    }

    fn ready(&self) -> usize {
        1
    }

    async fn stats(&self) -> EngineStats {
        EngineStats::default()
    }

    fn gate_size(&self) -> GateSize {
        GateSize { slots: 1, queue: 8 }
    }
}

struct Models(Arc<ModelEntry>);

impl Catalog for Models {
    fn get(&self, name: &str) -> Result<Arc<ModelEntry>> {
        match name == self.0.name {
            true => Ok(self.0.clone()),
            false => Err(crate::routing::not_found(name, std::slice::from_ref(&self.0.name))),
        }
    }

    fn all(&self) -> Vec<Arc<ModelEntry>> {
        vec![self.0.clone()]
    }
}

fn catalog(replica: Arc<CountingReplica>) -> Arc<dyn Catalog> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/llama_gqa");
    Arc::new(Models(Arc::new(ModelEntry {
        name: "m".into(),
        config: ModelConfig::from_dir(&dir).unwrap(),
        tokenizer: Tokenizer::from_dir(&dir).unwrap(),
        routes: Arc::new(OneReplica(replica)),
    })))
}

fn request(cache: bool) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: Some(Prompt::TokenIds(vec![1, 2, 3])),
        max_tokens: Some(3),
        fill_context: false,
        params: SamplingParams::default(),
        priority: Priority::Online,
        cache,
    }
}

async fn tokens(front: &FrontEnd, caller: &Caller, cache: bool) -> Vec<u32> {
    let mut started = front.begin(request(cache), "req".into(), None, caller).await.unwrap();
    let mut ids = Vec::new();
    while let Some(chunk) = started.rx.recv().await {
        ids.extend(chunk.unwrap().token_ids);
    }
    ids
}

#[tokio::test]
async fn two_front_ends_share_no_cache_ledger_gate_or_online_count() {
    let replica = Arc::new(CountingReplica::default());
    let models = catalog(replica.clone());
    // A request that cannot get a slot gives up after 5 s (not the default minute).
    let opts = FrontEndOptions {
        route: RouteLimits { wait: std::time::Duration::from_secs(5), ..Default::default() },
        ..Default::default()
    };
    let (a, b) = (FrontEnd::new(models.clone(), opts), FrontEnd::new(models, opts));
    let caller = Tenants::default().authenticate(None, "metadata").unwrap();

    // A deterministic request is generated once by `a`, then answered from a's cache; `b`
    // has a cache of its own, empty.
    assert_eq!(tokens(&a, &caller, true).await, [5, 6, 7]);
    assert_eq!(tokens(&a, &caller, true).await, [5, 6, 7]);
    assert_eq!(replica.jobs.load(Ordering::SeqCst), 1, "the second answered from a's cache");
    assert!(a.cache().bytes() > 0);
    assert_eq!(b.cache().bytes(), 0);
    assert_eq!(tokens(&b, &caller, true).await, [5, 6, 7]);
    assert_eq!(replica.jobs.load(Ordering::SeqCst), 2, "b does not see a's cache");

    // Each ledger counts its own requests.
    let now = strata_common::cluster::now_ms() / 1000;
    let requests = |f: &FrontEnd| {
        let f = f.ledger().clone();
        async move { f.query(None, None, now - 60, now + 60).await.unwrap()[0].counts.requests }
    };
    assert_eq!((requests(&a).await, requests(&b).await), (2, 1));

    // A request held at the replica counts as online in its own front end only, and holds
    // that front end's one slot of the model: b still admits a request meanwhile.
    *replica.held.lock().unwrap() = true;
    let mut held = a.begin(request(false), "held".into(), None, &caller).await.unwrap();
    assert_eq!(held.rx.recv().await.unwrap().unwrap().token_ids, [5]);
    assert_eq!((a.online_in_flight(), b.online_in_flight()), (1, 0));
    *replica.held.lock().unwrap() = false;
    assert_eq!(tokens(&b, &caller, false).await, [5, 6, 7], "b's gate has its own slot");
    replica.release.notify_one();
    while held.rx.recv().await.is_some() {}
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.online_in_flight() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the ended request is still counted");
        tokio::task::yield_now().await;
    }
}
