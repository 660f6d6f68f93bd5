//! The response cache: identical deterministic requests answered without a replica.
//!
//! A request whose output is determined by its inputs — greedy decoding, or sampling with
//! the caller's own seed — on the same model revision gets the same tokens every time, so
//! the coordinator keeps finished responses in memory and replays them. The key is the
//! model, its revision (the deployment's spec generation: a changed deployment never
//! answers from an older one's responses), the prompt's token ids, every generation
//! parameter (sampling knobs, seed, max tokens, stops, logprobs) and the caller's tenant:
//! one tenant's responses never answer another's, so no tenant can learn by timing
//! whether another sent a prompt. A sampled request without
//! a seed is never cached (the coordinator picks it a fresh seed); a caller may opt out
//! per request. A response is stored only when it finished normally on one replica of the
//! key's revision (no failover, no error, no cancellation).
//!
//! The cache is bounded in bytes (keys and responses as they sit in memory: every buffer
//! at its capacity) and evicts the least recently used response first; a tenant holds at
//! most a quarter of it, past which its own oldest go, so one tenant cannot flush the
//! others'. One cache serves a front end's every API (gRPC, HTTP, batch jobs). Hits,
//! misses, evictions and the bytes held are metrics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use lru::LruCache;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use strata_common::metrics::register;
use strata_common::{SamplingParams, TokenLogprobs};

use crate::request::generation::Chunk;
use crate::request::metrics::ModelLabel;

/// What identifies a response.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    tenant: String,
    model: String,
    revision: u64,
    prompt: Vec<u32>,
    /// The generation parameters, canonically serialized.
    params: String,
}

impl Key {
    /// The key of a request, or None when its output is not determined by its inputs
    /// (sampled without the caller's seed) or the caller opted out.
    pub fn of(
        tenant: &str,
        model: &str,
        revision: u64,
        prompt: &[u32],
        params: &SamplingParams,
        wanted: bool,
    ) -> Option<Key> {
        if !wanted || (!params.is_greedy() && params.seed.is_none()) {
            return None;
        }
        let params = serde_json::to_string(params).ok()?;
        Some(Key {
            tenant: tenant.to_string(),
            model: model.to_string(),
            revision,
            prompt: prompt.to_vec(),
            params,
        })
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    fn bytes(&self) -> usize {
        std::mem::size_of::<Key>() + self.model.len() + 4 * self.prompt.len() + self.params.len()
    }
}

/// Bytes a stored chunk holds: every buffer it owns at its capacity — its text, ids,
/// logprobs and their alternatives, the prompt's logprobs, an embedding (once left out:
/// embeddings and prompt logprobs were counted at 1/8 to 1/64 of what they held).
fn chunk_bytes(c: &Chunk) -> usize {
    fn logprobs(l: &[TokenLogprobs], capacity: usize) -> usize {
        capacity * std::mem::size_of::<TokenLogprobs>()
            + l.iter().map(|t| t.top.capacity() * std::mem::size_of::<(u32, f32)>()).sum::<usize>()
    }
    std::mem::size_of::<Chunk>()
        + c.text.capacity()
        + std::mem::size_of::<u32>() * c.token_ids.capacity()
        + logprobs(&c.logprobs, c.logprobs.capacity())
        + c.prompt_logprobs.as_ref().map_or(0, |p| logprobs(p, p.capacity()))
        + c.embedding.as_ref().map_or(0, |e| std::mem::size_of::<f32>() * e.capacity())
}

/// A finished response: its chunks, as they were streamed.
pub type Response = Arc<Vec<Chunk>>;

struct Inner {
    entries: LruCache<Key, (Response, usize)>,
    bytes: usize,
    /// Bytes each tenant's responses hold.
    tenants: HashMap<String, usize>,
}

impl Inner {
    /// Removes `key`'s entry, if stored, from the counts; its bytes.
    fn forget(&mut self, key: &Key, size: usize) {
        self.bytes -= size;
        if let Some(held) = self.tenants.get_mut(&key.tenant) {
            *held -= size;
            if *held == 0 {
                self.tenants.remove(&key.tenant);
            }
        }
    }

    /// Evicts `tenant`'s least recently used response; false when it has none.
    fn evict_oldest_of(&mut self, tenant: &str) -> bool {
        let Some(key) = self.entries.iter().rev().find(|(k, _)| k.tenant == tenant).map(|(k, _)| k.clone())
        else {
            return false;
        };
        if let Some((_, size)) = self.entries.pop(&key) {
            self.forget(&key, size);
        }
        true
    }
}

/// A byte-bounded LRU map from request keys to finished responses.
pub struct ResponseCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl ResponseCache {
    /// A cache holding at most `capacity` bytes (0: nothing is stored).
    pub fn new(capacity: usize) -> Self {
        let inner = Inner { entries: LruCache::unbounded(), bytes: 0, tenants: HashMap::new() };
        ResponseCache { capacity, inner: Mutex::new(inner) }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The stored response for `key` (now the most recently used), counting a hit or a miss.
    pub fn get(&self, key: &Key) -> Option<Response> {
        if self.capacity == 0 {
            return None;
        }
        let found = self.lock().entries.get(key).map(|(r, _)| r.clone());
        let label = ModelLabel { model: key.model.clone() };
        let m = metrics();
        match &found {
            Some(_) => m.hits.get_or_create(&label).inc(),
            None => m.misses.get_or_create(&label).inc(),
        };
        found
    }

    /// Most bytes one tenant's responses hold: a quarter of the cache.
    fn tenant_share(&self) -> usize {
        self.capacity / 4
    }

    /// Stores `response` under `key`, evicting its tenant's least recently used responses
    /// past the tenant's share, then anyone's until it fits; a response larger than a
    /// tenant's share is not stored.
    pub fn put(&self, key: Key, response: Vec<Chunk>) {
        let size = key.bytes() + response.iter().map(chunk_bytes).sum::<usize>();
        if size > self.tenant_share() {
            return;
        }
        let mut inner = self.lock();
        if let Some((_, old)) = inner.entries.pop(&key) {
            inner.forget(&key, old);
        }
        let mut evicted = 0u64;
        // A tenant past its share evicts its own responses, never another's.
        let share = self.tenant_share();
        while inner.tenants.get(&key.tenant).is_some_and(|held| held + size > share) {
            if !inner.evict_oldest_of(&key.tenant) {
                break;
            }
            evicted += 1;
        }
        while inner.bytes + size > self.capacity {
            let Some((old_key, (_, freed))) = inner.entries.pop_lru() else { break };
            inner.forget(&old_key, freed);
            evicted += 1;
        }
        *inner.tenants.entry(key.tenant.clone()).or_default() += size;
        inner.entries.put(key, (Arc::new(response), size));
        inner.bytes += size;
        let m = metrics();
        m.evictions.inc_by(evicted);
        m.bytes.set(inner.bytes as i64);
        m.entries.set(inner.entries.len() as i64);
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }
}

struct CacheMetrics {
    hits: Family<ModelLabel, Counter>,
    misses: Family<ModelLabel, Counter>,
    evictions: Counter,
    bytes: Gauge,
    entries: Gauge,
}

fn metrics() -> &'static CacheMetrics {
    static METRICS: OnceLock<CacheMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = CacheMetrics {
            hits: Family::default(),
            misses: Family::default(),
            evictions: Counter::default(),
            bytes: Gauge::default(),
            entries: Gauge::default(),
        };
        register(
            "response_cache_hits",
            "Deterministic requests answered from the response cache, by model",
            m.hits.clone(),
        );
        register(
            "response_cache_misses",
            "Cacheable requests the response cache did not hold, by model",
            m.misses.clone(),
        );
        register("response_cache_evictions", "Responses evicted to make room", m.evictions.clone());
        register("response_cache_bytes", "Bytes the response cache holds", m.bytes.clone());
        register("response_cache_entries", "Responses the response cache holds", m.entries.clone());
        m
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_common::FinishReason;

    fn chunk(text: &str, token: u32, finish: Option<FinishReason>) -> Chunk {
        Chunk { text: text.into(), token_ids: vec![token], finish, revision: 1, ..Default::default() }
    }

    fn greedy() -> SamplingParams {
        SamplingParams { max_new_tokens: 4, ..Default::default() }
    }

    #[test]
    fn only_deterministic_requests_have_keys() {
        assert!(Key::of("t", "m", 1, &[1, 2], &greedy(), true).is_some());
        assert!(Key::of("t", "m", 1, &[1, 2], &greedy(), false).is_none(), "opted out");
        let sampled = SamplingParams { temperature: 0.8, ..greedy() };
        assert!(Key::of("t", "m", 1, &[1, 2], &sampled, true).is_none(), "no seed: a fresh draw each time");
        let seeded = SamplingParams { seed: Some(7), ..sampled };
        assert!(Key::of("t", "m", 1, &[1, 2], &seeded, true).is_some());
        // Every input is part of the key.
        let k = Key::of("t", "m", 1, &[1, 2], &greedy(), true);
        assert_ne!(k, Key::of("t", "m", 2, &[1, 2], &greedy(), true), "revision");
        assert_ne!(k, Key::of("t", "m", 1, &[1, 3], &greedy(), true), "prompt");
        assert_ne!(k, Key::of("t", "n", 1, &[1, 2], &greedy(), true), "model");
        assert_ne!(k, Key::of("u", "m", 1, &[1, 2], &greedy(), true), "another tenant");
        let longer = SamplingParams { max_new_tokens: 5, ..greedy() };
        assert_ne!(k, Key::of("t", "m", 1, &[1, 2], &longer, true), "max tokens");
    }

    #[test]
    fn the_least_recently_used_response_goes_first_and_bytes_stay_bounded() {
        let key = |i: u32| Key::of("t", "m", 1, &[i], &greedy(), true).unwrap();
        let response = |i: u32| vec![chunk("a", i, None), chunk("b", i + 1, Some(FinishReason::Length))];
        let one = key(0).bytes() + response(0).iter().map(chunk_bytes).sum::<usize>();
        // One tenant's share (a quarter) holds three responses.
        let cache = ResponseCache::new(12 * one);
        for i in 0..3 {
            cache.put(key(i), response(i));
        }
        assert!(cache.get(&key(0)).is_some(), "0 is now the most recently used");
        cache.put(key(3), response(3));
        assert!(cache.get(&key(1)).is_none(), "1 was the least recently used");
        for i in [0, 2, 3] {
            assert_eq!(*cache.get(&key(i)).unwrap(), response(i));
        }
        assert!(cache.bytes() <= cache.capacity());
        // Larger than a tenant's share: not stored, nothing evicted.
        let huge = vec![chunk(&"x".repeat(4 * one), 9, Some(FinishReason::Stop))];
        cache.put(key(9), huge);
        assert!(cache.get(&key(9)).is_none() && cache.get(&key(0)).is_some());
        // A zero-sized cache stores nothing.
        let off = ResponseCache::new(0);
        off.put(key(0), response(0));
        assert!(off.get(&key(0)).is_none());
    }

    /// Probed: one tenant's responses flushed everyone's. A tenant past its quarter evicts
    /// its own.
    #[test]
    fn one_tenant_cannot_flush_anothers_responses() {
        let key = |t: &str, i: u32| Key::of(t, "m", 1, &[i], &greedy(), true).unwrap();
        let response = |i: u32| vec![chunk("a", i, Some(FinishReason::Length))];
        let one = key("quiet", 0).bytes() + response(0).iter().map(chunk_bytes).sum::<usize>();
        let cache = ResponseCache::new(40 * one);
        cache.put(key("quiet", 0), response(0));
        for i in 0..1000 {
            cache.put(key("loud", i), response(i));
        }
        assert!(cache.get(&key("quiet", 0)).is_some(), "the quiet tenant's response was flushed");
        assert!(cache.lock().tenants["loud"] <= cache.capacity() / 4);
        assert!(cache.get(&key("loud", 999)).is_some() && cache.get(&key("loud", 0)).is_none());
    }

    /// Probed: embeddings and prompt logprobs were counted at a fraction of what they hold.
    #[test]
    fn what_a_chunk_holds_is_counted() {
        let embedding = Chunk { embedding: Some(vec![0.5; 4096]), ..Default::default() };
        assert!(chunk_bytes(&embedding) >= 4 * 4096);
        let top = vec![(1u32, -0.5f32); 20];
        let lp = TokenLogprobs { token_id: 1, logprob: -0.1, rank: 1, top };
        let prompt = Chunk { prompt_logprobs: Some(vec![lp; 1000]), ..Default::default() };
        let held = 1000 * (std::mem::size_of::<TokenLogprobs>() + 20 * 8);
        assert!(chunk_bytes(&prompt) >= held, "{} < {held}", chunk_bytes(&prompt));
    }
}
