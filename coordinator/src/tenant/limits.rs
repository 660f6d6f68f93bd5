//! One tenant's limits as this coordinator enforces them.
//!
//! Rates are token buckets: requests per second hold one second's worth (at least one
//! request), tokens per minute hold a minute's worth and refill continuously. A request
//! *reserves* its prompt plus its `max_tokens` when admitted (as OpenAI counts a request
//! against a token rate limit), and what it does not generate flows back when it ends, so
//! the tokens a tenant consumes never exceed its quota — the quota holds to within one
//! request by construction, and to the token for a tenant whose requests run to their
//! `max_tokens`. Streams in flight are counted while their permit lives.
//!
//! **Several coordinators.** Each enforces its share of every limit: the limit divided by
//! the number of live coordinators (each announces itself under `<prefix>/coordinators/`
//! bound to its lease). Behind a load balancer that spreads calls evenly the cluster-wide
//! limit holds; when calls are spread unevenly a tenant gets less than its limit, never
//! more. A concurrency limit rounds its share up, so each coordinator admits at least one
//! stream.
//!
//! Checks happen all at once under one lock: a refused request consumes nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_common::tenant::TenantLimits;
use strata_common::{Error, Result};
use tokio::time::Instant;

/// A token bucket's level, refilled lazily.
#[derive(Debug, Default)]
struct Bucket {
    level: f64,
    /// None: never used (starts full).
    at: Option<Instant>,
}

impl Bucket {
    fn refill(&mut self, now: Instant, capacity: f64, per_second: f64) {
        self.level = match self.at {
            None => capacity,
            Some(t) => (self.level + per_second * (now - t).as_secs_f64()).min(capacity),
        };
        self.at = Some(now);
    }

    /// How long until the bucket holds `want` (it may never, if `want` exceeds capacity),
    /// at most a day: a hint, whatever tiny rate it comes from.
    fn wait_for(&self, want: f64, per_second: f64) -> Duration {
        let day = Duration::from_secs(86_400);
        Duration::try_from_secs_f64(((want - self.level) / per_second).max(0.0)).map_or(day, |d| d.min(day))
    }
}

#[derive(Debug)]
struct State {
    limits: TenantLimits,
    /// This coordinator's share of the limits (1 / live coordinators).
    share: f64,
    requests: Bucket,
    tokens: Bucket,
    in_flight: u32,
}

/// The limits of one tenant; shared by its requests through [`Permit`]s.
#[derive(Debug)]
pub struct Limiter {
    tenant: String,
    state: Mutex<State>,
}

/// What a request asks for when it is admitted.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
}

impl Limiter {
    pub fn new(tenant: &str, limits: TenantLimits) -> Arc<Limiter> {
        let state = State {
            limits,
            share: 1.0,
            requests: Bucket::default(),
            tokens: Bucket::default(),
            in_flight: 0,
        };
        Arc::new(Limiter { tenant: tenant.to_string(), state: Mutex::new(state) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// New limits (an admin changed them) or a new share (coordinators came or went);
    /// the buckets keep their levels, clipped to the new capacity on their next use.
    pub fn update(&self, limits: &TenantLimits, coordinators: usize) {
        let mut s = self.state();
        s.limits = limits.clone();
        s.share = 1.0 / coordinators.max(1) as f64;
    }

    /// Admits a request or says which limit refused it and when to retry; `concurrent`:
    /// whether it counts toward `max_concurrent` (batch work does not).
    pub fn admit(self: &Arc<Self>, ask: Ask, concurrent: bool) -> Result<Permit> {
        let now = Instant::now();
        let mut s = self.state();
        let share = s.share;
        let t = &self.tenant;
        if let Some(max) = s.limits.max_concurrent.filter(|_| concurrent) {
            let here = (f64::from(max) * share).ceil().max(1.0) as u32;
            if s.in_flight >= here {
                return Err(limited(
                    format!("tenant {t:?} has {here} requests in flight, its limit{}", on_this(share)),
                    Duration::from_secs(1),
                ));
            }
        }
        let rps = s.limits.requests_per_second.map(|r| r * share);
        if let Some(rate) = rps {
            s.requests.refill(now, rate.max(1.0), rate);
            if s.requests.level < 1.0 {
                let after = s.requests.wait_for(1.0, rate);
                return Err(limited(
                    format!("tenant {t:?} is over {rate} requests/s{}", on_this(share)),
                    after,
                ));
            }
        }
        let cost = f64::from(ask.prompt_tokens) + f64::from(ask.max_tokens);
        let tpm = s.limits.tokens_per_minute.map(|r| r as f64 * share);
        if let Some(capacity) = tpm {
            if cost > capacity {
                return Err(Error::invalid(
                    "max_tokens",
                    format!(
                        "the prompt's {} tokens plus max_tokens {} exceed tenant {t:?}'s {} tokens per minute{}; ask for fewer",
                        ask.prompt_tokens,
                        ask.max_tokens,
                        capacity.floor(),
                        on_this(share)
                    ),
                ));
            }
            s.tokens.refill(now, capacity, capacity / 60.0);
            if s.tokens.level < cost {
                let after = s.tokens.wait_for(cost, capacity / 60.0);
                return Err(limited(
                    format!("tenant {t:?} is over {} tokens/min{}", capacity.floor(), on_this(share)),
                    after,
                ));
            }
            s.tokens.level -= cost;
        }
        if rps.is_some() {
            s.requests.level -= 1.0;
        }
        s.in_flight += u32::from(concurrent);
        let reserved = if tpm.is_some() { cost } else { 0.0 };
        Ok(Permit { limiter: self.clone(), reserved, used: 0, concurrent })
    }
}

fn on_this(share: f64) -> String {
    if share < 1.0 {
        format!(" (this coordinator's {:.0}% share)", share * 100.0)
    } else {
        String::new()
    }
}

fn limited(reason: String, retry_after: Duration) -> Error {
    // Never "retry in 0 s": a bucket a hair short still needs a moment.
    Error::RateLimited { reason, retry_after: retry_after.max(Duration::from_millis(1)) }
}

/// One admitted request's hold on its tenant's limits; dropping it ends the request
/// (its stream slot frees, unused reserved tokens flow back).
#[derive(Debug)]
pub struct Permit {
    limiter: Arc<Limiter>,
    reserved: f64,
    /// Tokens the request consumed (its prompt and what it generated).
    used: u64,
    /// Counted in the tenant's requests in flight.
    concurrent: bool,
}

impl Permit {
    /// The request consumed `tokens` more (counted against the reservation).
    pub fn consumed(&mut self, tokens: u64) {
        self.used += tokens;
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut s = self.limiter.state();
        s.in_flight = s.in_flight.saturating_sub(u32::from(self.concurrent));
        let unused = self.reserved - self.used as f64;
        if unused > 0.0 {
            s.tokens.level += unused;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(prompt: u32, max: u32) -> Ask {
        Ask { prompt_tokens: prompt, max_tokens: max }
    }

    /// A tiny positive rate (as configured, or divided among many coordinators) gives a
    /// retry hint of at most a day; it panicked every request of the tenant.
    #[tokio::test(start_paused = true)]
    async fn a_tiny_rate_refuses_with_a_bounded_hint() {
        let l = Limiter::new("t", TenantLimits { requests_per_second: Some(1e-300), ..Default::default() });
        drop(l.admit(ask(1, 1), true).unwrap());
        let e = l.admit(ask(1, 1), true).unwrap_err();
        assert_eq!(e.retry_after(), Some(Duration::from_secs(86_400)));
    }

    /// Batch work spends the tenant's token quota (a 2,000 tokens/min tenant's batches
    /// used ~350k a minute) without taking its stream slots.
    #[tokio::test(start_paused = true)]
    async fn batch_work_spends_the_quota_but_takes_no_stream_slot() {
        let limits =
            TenantLimits { tokens_per_minute: Some(100), max_concurrent: Some(1), ..Default::default() };
        let l = Limiter::new("t", limits);
        let online = l.admit(ask(10, 40), true).unwrap();
        let batch = l.admit(ask(10, 40), false).unwrap();
        assert!(l.admit(ask(1, 1), false).unwrap_err().to_string().contains("tokens/min"));
        drop((online, batch));
        tokio::time::advance(Duration::from_secs(60)).await;
        let batch = l.admit(ask(10, 40), false).unwrap();
        assert!(l.admit(ask(10, 40), true).is_ok(), "the batch request holds no stream slot");
        drop(batch);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_per_second_refill_over_time() {
        let l = Limiter::new("t", TenantLimits { requests_per_second: Some(2.0), ..Default::default() });
        let a = l.admit(ask(1, 1), true).unwrap();
        let b = l.admit(ask(1, 1), true).unwrap();
        drop((a, b));
        let e = l.admit(ask(1, 1), true).unwrap_err();
        let after = e.retry_after().unwrap();
        assert!(after > Duration::ZERO && after <= Duration::from_millis(500), "{after:?}");
        assert!(e.to_string().contains("2 requests/s"), "{e}");
        tokio::time::advance(after).await;
        assert!(l.admit(ask(1, 1), true).is_ok(), "the hint was enough");
    }

    #[tokio::test(start_paused = true)]
    async fn token_quotas_reserve_and_give_back() {
        let l = Limiter::new("t", TenantLimits { tokens_per_minute: Some(600), ..Default::default() });
        let mut p = l.admit(ask(100, 400), true).unwrap(); // reserves 500 of 600
        assert!(l.admit(ask(50, 100), true).is_err(), "150 more do not fit in the 100 left");
        p.consumed(100 + 20); // prompt + 20 generated: 380 flow back
        drop(p);
        let e = l.admit(ask(500, 200), true).unwrap_err();
        assert_eq!(
            e.class(),
            strata_common::ErrorClass::InvalidInput,
            "more than a minute's quota never fits"
        );
        let q = l.admit(ask(100, 300), true).unwrap();
        let e = l.admit(ask(100, 100), true).unwrap_err();
        // 80 left of 600 at 10/s: 120 more take 12 s.
        assert_eq!(e.retry_after().unwrap().as_secs(), 12);
        drop(q);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_and_shares() {
        let limits = TenantLimits { max_concurrent: Some(3), ..Default::default() };
        let l = Limiter::new("t", limits.clone());
        l.update(&limits, 2); // two coordinators: ceil(1.5) = 2 here
        let a = l.admit(ask(1, 1), true).unwrap();
        let _b = l.admit(ask(1, 1), true).unwrap();
        let e = l.admit(ask(1, 1), true).unwrap_err();
        assert!(e.to_string().contains("50% share"), "{e}");
        drop(a);
        assert!(l.admit(ask(1, 1), true).is_ok(), "a finished stream frees its slot");
        // A refusal consumes nothing: the request bucket is untouched by refused asks.
        let r = Limiter::new(
            "r",
            TenantLimits {
                requests_per_second: Some(1.0),
                tokens_per_minute: Some(60),
                ..Default::default()
            },
        );
        assert!(r.admit(ask(100, 1), true).is_err());
        assert!(r.admit(ask(10, 1), true).is_ok(), "the refused request did not use the one request/s");
    }
}
