//! Routes of one model in cluster mode: its ready replicas from the registry view, each
//! reached over worker.v1 at its rank 0.
//!
//! Load is what this coordinator has outstanding on a replica, or what the replica last
//! reported (`Stats`, polled by the catalog) when that is more — the report also counts
//! other coordinators' requests. A replica a request just failed on is avoided for a few
//! seconds, until the leader coordinator's verdict reaches the view.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use strata_common::{FinishReason, Result};
use strata_proto::worker::v1 as pb;
use strata_worker::{EngineStats, SeqEvent, TokenLogprobs};
use tokio::sync::watch;

use super::clients::WorkerClients;
use super::router::{block_hashes, select, Candidate, PrefixIndex};
use super::view::ClusterView;
use super::worker_service::params_to_pb;
use crate::routing::{sum_stats, EventStream, Job, Replica, Routes};
use crate::status::from_status;

/// How long a replica a request failed on is avoided by this coordinator.
const SUSPECT_FOR: Duration = Duration::from_secs(5);

#[derive(Default)]
struct ReplicaLoad {
    outstanding: AtomicUsize,
    /// Last `Stats` report: running + waiting, and KV blocks.
    reported: Mutex<EngineStats>,
}

pub struct ClusterRoutes {
    model: String,
    view: watch::Receiver<Arc<ClusterView>>,
    clients: Arc<WorkerClients>,
    loads: Mutex<HashMap<String, Arc<ReplicaLoad>>>,
    index: Mutex<PrefixIndex>,
    suspects: Mutex<HashMap<String, Instant>>,
}

impl ClusterRoutes {
    pub fn new(model: &str, view: watch::Receiver<Arc<ClusterView>>, clients: Arc<WorkerClients>) -> Self {
        ClusterRoutes {
            model: model.to_string(),
            view,
            clients,
            loads: Mutex::new(HashMap::new()),
            index: Mutex::new(PrefixIndex::new(1 << 16)),
            suspects: Mutex::new(HashMap::new()),
        }
    }

    fn load(&self, replica: &str) -> Arc<ReplicaLoad> {
        self.loads.lock().unwrap_or_else(|p| p.into_inner()).entry(replica.to_string()).or_default().clone()
    }

    /// Ready replicas: (id, rank 0's address).
    pub fn ready_replicas(&self) -> Vec<(String, String)> {
        let view = self.view.borrow().clone();
        view.ready_replicas(&self.model).map(|r| (r.id.clone(), r.leader_address.clone())).collect()
    }

    /// Refreshes the reported load of each ready replica (called periodically).
    pub async fn poll_stats(&self) {
        for (id, address) in self.ready_replicas() {
            let Ok(mut client) = self.clients.get(&address) else { continue };
            let mut req = tonic::Request::new(pb::StatsRequest {});
            req.set_timeout(Duration::from_secs(2));
            if let Ok(r) = client.stats(req).await {
                let r = r.into_inner();
                *self.load(&id).reported.lock().unwrap_or_else(|p| p.into_inner()) = EngineStats {
                    running: r.running_sequences as usize,
                    waiting: r.waiting_requests as usize,
                    kv_blocks_free: r.kv_blocks_free as usize,
                    kv_blocks_total: r.kv_blocks_total as usize,
                };
            }
        }
        // Forget replicas that left.
        let ready: Vec<String> = self.ready_replicas().into_iter().map(|r| r.0).collect();
        let mut loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<String> = loads.keys().filter(|k| !ready.contains(k)).cloned().collect();
        for g in gone {
            if loads.get(&g).is_some_and(|l| l.outstanding.load(Ordering::Relaxed) == 0) {
                loads.remove(&g);
                self.index.lock().unwrap_or_else(|p| p.into_inner()).forget(&g);
            }
        }
    }
}

#[async_trait::async_trait]
impl Routes for ClusterRoutes {
    fn pick(&self, prompt: &[u32], exclude: &[String]) -> Option<Arc<dyn Replica>> {
        let now = Instant::now();
        let suspects: Vec<String> = {
            let mut s = self.suspects.lock().unwrap_or_else(|p| p.into_inner());
            s.retain(|_, until| *until > now);
            s.keys().cloned().collect()
        };
        let ready: Vec<(String, String)> = self
            .ready_replicas()
            .into_iter()
            .filter(|(id, _)| !exclude.contains(id) && !suspects.contains(id))
            .collect();
        if ready.is_empty() {
            return None;
        }
        let loads: Vec<Arc<ReplicaLoad>> = ready.iter().map(|(id, _)| self.load(id)).collect();
        let outstanding: Vec<usize> = loads
            .iter()
            .zip(&ready)
            .map(|(l, (_, address))| {
                let mine = l.outstanding.load(Ordering::Relaxed);
                let r = match self.clients.local(address) {
                    Some(agent) => agent.status().stats,
                    None => *l.reported.lock().unwrap_or_else(|p| p.into_inner()),
                };
                mine.max(r.running + r.waiting)
            })
            .collect();
        let candidates: Vec<Candidate<'_>> =
            ready.iter().zip(&outstanding).map(|((id, _), &o)| Candidate { id, outstanding: o }).collect();
        let hashes = block_hashes(prompt);
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        let i = select(&candidates, index.best(&hashes, &candidates), prompt);
        index.record(&hashes, &ready[i].0);
        Some(Arc::new(RemoteReplica {
            id: ready[i].0.clone(),
            address: ready[i].1.clone(),
            clients: self.clients.clone(),
            load: loads[i].clone(),
        }))
    }

    fn report_failure(&self, replica: &str) {
        self.suspects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(replica.to_string(), Instant::now() + SUSPECT_FOR);
    }

    async fn wait_for_change(&self, limit: Duration) -> bool {
        let mut rx = self.view.clone();
        rx.borrow_and_update();
        let deadline = tokio::time::Instant::now() + limit;
        // Suspicion expires too: wake up when it does, so a request can try again.
        let wake = self
            .suspects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .min()
            .map(|t| tokio::time::Instant::from_std(*t))
            .unwrap_or(deadline)
            .min(deadline);
        matches!(tokio::time::timeout_at(wake, rx.changed()).await, Ok(Ok(()))) || wake < deadline
    }

    fn ready(&self) -> usize {
        self.ready_replicas().len()
    }

    fn stats(&self) -> EngineStats {
        let ready = self.ready_replicas();
        sum_stats(ready.iter().map(|(id, address)| {
            if let Some(agent) = self.clients.local(address) {
                return agent.status().stats;
            }
            let l = self.load(id);
            let mut s = *l.reported.lock().unwrap_or_else(|p| p.into_inner());
            s.running = s.running.max(l.outstanding.load(Ordering::Relaxed));
            s
        }))
    }
}

/// A replica's rank 0, over worker.v1.
pub struct RemoteReplica {
    id: String,
    address: String,
    clients: Arc<WorkerClients>,
    load: Arc<ReplicaLoad>,
}

/// Decrements a replica's outstanding count when the request's stream is dropped.
struct Outstanding(Arc<ReplicaLoad>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

fn finish_from(s: &str) -> Option<FinishReason> {
    match s {
        "" => None,
        "length" => Some(FinishReason::Length),
        "eos" => Some(FinishReason::Eos),
        _ => Some(FinishReason::Stop),
    }
}

#[async_trait::async_trait]
impl Replica for RemoteReplica {
    fn id(&self) -> &str {
        &self.id
    }

    async fn submit(&self, job: &Job) -> Result<EventStream> {
        self.load.outstanding.fetch_add(1, Ordering::Relaxed);
        let guard = Outstanding(self.load.clone());
        if let Some(agent) = self.clients.local(&self.address) {
            // In this process: straight to the engine.
            let engine = agent.serving(&self.id)?;
            let seq = engine.submit_resumed(job.prompt.clone(), job.generated.clone(), job.params.clone())?;
            let events = crate::routing::sequence_events(seq);
            return Ok(futures::stream::unfold((events, guard), |(mut ev, g)| async move {
                ev.next().await.map(|e| (e, (ev, g)))
            })
            .boxed());
        }
        let mut req = pb::WorkerGenerateRequest {
            request_id: job.request_id.clone(),
            prompt_token_ids: job.prompt.clone(),
            generated_token_ids: job.generated.clone(),
            replica_id: self.id.clone(),
            ..Default::default()
        };
        params_to_pb(&job.params, &mut req);
        let peer = format!("replica {} at {}", self.id, self.address);
        let mut client = self.clients.get(&self.address)?;
        let stream = client.generate(req).await.map_err(|s| from_status(&s, &peer))?.into_inner();
        // Each message carries tokens; the last carries the finish reason.
        let events = futures::stream::unfold(
            (stream, std::collections::VecDeque::new(), Some(guard), peer),
            |(mut stream, mut queue, guard, peer)| async move {
                loop {
                    if let Some(ev) = queue.pop_front() {
                        return Some((ev, (stream, queue, guard, peer)));
                    }
                    guard.as_ref()?;
                    match stream.message().await {
                        Ok(Some(m)) => {
                            let finish = finish_from(&m.finish_reason);
                            let n = m.tokens.len();
                            for (i, t) in m.tokens.into_iter().enumerate() {
                                let logprobs = t.logprob.map(|logprob| TokenLogprobs {
                                    token_id: t.token_id,
                                    logprob,
                                    top: t
                                        .top_token_ids
                                        .iter()
                                        .copied()
                                        .zip(t.top_logprobs.iter().copied())
                                        .collect(),
                                });
                                let last = i + 1 == n;
                                queue.push_back(SeqEvent::Token {
                                    token: t.token_id,
                                    logprobs,
                                    finish: if last { finish } else { None },
                                });
                            }
                            if finish.is_some() {
                                // Nothing follows; release the load count with the stream.
                                let rest: Vec<SeqEvent> = queue.drain(..).collect();
                                let mut q = std::collections::VecDeque::from(rest);
                                let first = q.pop_front()?;
                                return Some((first, (stream, q, None, peer)));
                            }
                        }
                        Ok(None) => return None,
                        Err(s) => {
                            let e = from_status(&s, &peer);
                            return Some((SeqEvent::Failed(e), (stream, queue, None, peer)));
                        }
                    }
                }
            },
        );
        Ok(events.boxed())
    }
}
