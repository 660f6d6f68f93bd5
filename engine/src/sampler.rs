//! Choosing the next token from a sequence's logits.
//!
//! Order of processing (HF transformers' and vLLM's): repetition penalty, presence and
//! frequency penalties, then temperature, top-k, top-p and min-p, then a draw from the
//! sequence's own seeded ChaCha stream, so a seed reproduces a generation exactly whatever
//! else shares the batch. A request with temperature and at most top-p and min-p draws by
//! walking its kept tokens in id order ([`crate::logits::draw`]), the same on the host and
//! on a device that draws where the logits are; any other walks them most likely first.
//! Reported logprobs are those of the model's raw distribution (log-softmax of the
//! unprocessed logits), as vLLM reports them.

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use strata_common::SamplingParams;

use crate::guide::TokenMask;
use crate::logits::{Candidates, Draw, Pick, MAX_TOP};

/// Candidates beyond top-k a step returns: logits that differ may be equal once divided by
/// the temperature, and the draw breaks such ties by id.
const TIE_ROOM: usize = 8;

pub use strata_common::TokenLogprobs;

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens seen in the prompt or output (for the repetition penalty).
    seen: HashSet<u32>,
    /// Output token counts (for presence and frequency penalties).
    counts: HashMap<u32, u32>,
    /// Its constraint's masks are applied where the logits are, before they reach it: its
    /// rows are reduced and drawn as an unconstrained request's.
    masked_upstream: bool,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        let seen =
            if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Sampler { params, rng, seen, counts: HashMap::new(), masked_upstream: false }
    }

    /// Whether a constrained request's masks may be applied where the logits are: a mask
    /// changes the distribution's log-sum-exp, so a request that reports logprobs (those
    /// of the raw distribution) has its mask applied on the host.
    pub fn can_mask_upstream(&self) -> bool {
        self.params.constraint.is_some() && self.params.logprobs.is_none()
    }

    /// From now on the logits this sampler gets are masked already (see
    /// [`Sampler::can_mask_upstream`]).
    pub fn mask_upstream(&mut self) {
        self.masked_upstream = self.can_mask_upstream();
    }

    /// Whether its masks are applied where the logits are.
    pub fn masked_upstream(&self) -> bool {
        self.masked_upstream
    }

    /// A constraint this sampler applies itself, on the host.
    fn host_constraint(&self) -> bool {
        self.params.constraint.is_some() && !self.masked_upstream
    }

    /// A sampler that continues a generation whose first tokens were `generated`
    /// elsewhere (failover): penalties count them as output, and a seeded random stream
    /// is advanced past their draws, so the continuation is the one the original replica
    /// would have produced.
    pub fn resume(params: SamplingParams, prompt: &[u32], generated: &[u32]) -> Self {
        let mut s = Sampler::new(params, prompt);
        for &t in generated {
            if !s.params.is_greedy() {
                let _: f32 = s.rng.random();
            }
            s.record(t);
        }
        s
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token among those `mask` allows (all without one) and records it
    /// as output. Logprobs stay those of the raw row.
    pub fn sample(&mut self, raw: &[f32], mask: Option<&TokenMask>) -> (u32, Option<TokenLogprobs>) {
        if let Some(mask) = mask.filter(|_| !self.penalised()) {
            return self.sample_allowed(raw, mask);
        }
        let mut logits = raw.to_vec();
        if let Some(mask) = mask {
            mask.apply(&mut logits);
        }
        self.apply_penalties(&mut logits);
        let token = if self.params.is_greedy() {
            argmax(&logits)
        } else if self.drawable() {
            // As a device draws it (the walk in id order), so a backend that draws where
            // the logits are gives the same token for the same row.
            let draw = self.next_draw();
            crate::logits::draw::host_draw(&logits, &draw) as u32
        } else {
            // Tokens a constraint masked out cannot be drawn: they need no sorting.
            let finite = logits.iter().enumerate().filter(|(_, l)| **l > f32::NEG_INFINITY);
            self.draw(finite.map(|(i, &l)| (i as u32, l)).collect())
        };
        let logprobs = self.params.logprobs.map(|n| logprobs(raw, token, n as usize));
        self.record(token);
        (token, logprobs)
    }

    /// [`Sampler::sample`] under a mask without penalties: only the allowed tokens are
    /// read (a constraint usually allows few of a large vocabulary), with the same result
    /// as masking the whole row.
    fn sample_allowed(&mut self, raw: &[f32], mask: &TokenMask) -> (u32, Option<TokenLogprobs>) {
        let allowed: Vec<u32> = mask.allowed().into_iter().filter(|&t| (t as usize) < raw.len()).collect();
        let token = if allowed.is_empty() {
            argmax(raw)
        } else if self.params.is_greedy() {
            // The first of the largest, as `torch.argmax` on the masked row.
            allowed.iter().copied().fold(allowed[0], |best, t| {
                if raw[t as usize] > raw[best as usize] {
                    t
                } else {
                    best
                }
            })
        } else {
            self.draw(allowed.iter().map(|&t| (t, raw[t as usize])).collect())
        };
        let logprobs = self.params.logprobs.map(|n| logprobs(raw, token, n as usize));
        self.record(token);
        (token, logprobs)
    }

    /// What of a row choosing the next token needs: `Some(0)`, a greedy [`Pick`] (plain
    /// greedy decoding); `Some(k)`, the row's `k` most likely tokens ([`Candidates`]:
    /// greedy with top logprobs, or top-k sampling, k ≤ [`MAX_TOP`] with room for ties the
    /// temperature may make); `None`, the whole row (penalties move the logits; top-p or
    /// min-p without top-k need the whole distribution, and so does a constraint's mask).
    pub fn candidates_needed(&self) -> Option<usize> {
        let p = &self.params;
        if self.penalised() || self.host_constraint() {
            return None;
        }
        let n = p.logprobs.unwrap_or(0) as usize;
        let k = match (p.is_greedy(), p.top_k as usize) {
            (true, _) => n,
            (false, 0) => return None,
            (false, k) => k + TIE_ROOM,
        };
        Some(k.max(n)).filter(|&k| k <= MAX_TOP)
    }

    /// Whether this sequence's tokens can be drawn where the logits are
    /// ([`crate::logits::draw`]): temperature sampling with top-p, min-p or neither, and
    /// nothing else that needs the host — no top-k (its candidates serve it), penalties,
    /// logprobs or a constraint masked on the host. A property of the request (and its
    /// replica) alone, so whether a token is drawn on the device never depends on what
    /// shares the batch.
    pub fn drawable(&self) -> bool {
        let p = &self.params;
        !p.is_greedy() && p.top_k == 0 && p.logprobs.is_none() && !self.penalised() && !self.host_constraint()
    }

    /// Whether penalties move this sequence's logits (so its rows go to the host whole).
    fn penalised(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// The next token's [`Draw`]: this sequence's parameters and the next number of its
    /// stream (consumed as [`Sampler::sample`] would). Only for a
    /// [`drawable`](Sampler::drawable) sampler; the token comes back to
    /// [`Sampler::accept_drawn`].
    pub fn next_draw(&mut self) -> Draw {
        let p = &self.params;
        let (temperature, top_p, min_p) = (p.temperature, p.top_p, p.min_p);
        Draw { temperature, top_p, min_p, u: self.rng.random() }
    }

    /// Records the token the backend drew with [`Sampler::next_draw`]'s parameters.
    pub fn accept_drawn(&mut self, token: u32) -> (u32, Option<TokenLogprobs>) {
        debug_assert!(self.drawable(), "a drawn token for a sampler that draws on the host");
        self.record(token);
        (token, None)
    }

    /// Takes the token from a row's most likely tokens (for a sampler whose
    /// [`candidates_needed`](Sampler::candidates_needed) they cover) and records it: the
    /// same token and logprobs [`Sampler::sample`] gives on the whole row.
    pub fn take(&mut self, c: &Candidates) -> (u32, Option<TokenLogprobs>) {
        debug_assert!(self.candidates_needed().is_some_and(|k| k <= c.top.len().max(1)));
        let token = if self.params.is_greedy() { c.top[0].0 } else { self.draw(c.top.clone()) };
        let logprobs = self.params.logprobs.map(|n| {
            let logit = c.top.iter().find(|t| t.0 == token).map_or(f32::NEG_INFINITY, |t| t.1);
            let top = c.top.iter().take(n as usize).map(|&(t, l)| (t, l - c.log_z)).collect();
            TokenLogprobs { token_id: token, logprob: logit - c.log_z, rank: 0, top }
        });
        self.record(token);
        (token, logprobs)
    }

    /// Takes the token a greedy pick chose (only for a sampler whose
    /// [`candidates_needed`](Sampler::candidates_needed) is `Some(0)`) and records it as
    /// output: the same token and logprob [`Sampler::sample`] gives on that row's logits.
    pub fn accept(&mut self, pick: Pick) -> (u32, Option<TokenLogprobs>) {
        debug_assert_eq!(self.candidates_needed(), Some(0), "a pick for a sampler that needs more");
        let logprobs = self.params.logprobs.map(|_| TokenLogprobs {
            token_id: pick.token,
            logprob: pick.logprob(),
            rank: 1,
            top: Vec::new(),
        });
        self.record(pick.token);
        (pick.token, logprobs)
    }

    /// Records `token` as output.
    fn record(&mut self, token: u32) {
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        *self.counts.entry(token).or_insert(0) += 1;
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
    }

    /// Draws from `cand` (token, logit after penalties): the whole row, or its most likely
    /// tokens when they hold the top k.
    fn draw(&mut self, mut cand: Vec<(u32, f32)>) -> u32 {
        let p = &self.params;
        cand.iter_mut().for_each(|c| c.1 /= p.temperature);
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = p.top_k as usize;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit_desc);
            cand.truncate(k);
        }
        cand.sort_unstable_by(by_logit_desc);
        // Softmax over the candidates, then the nucleus and min-p cuts.
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0f32;
            for (i, q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let kept = &probs[..keep];
        let total: f32 = kept.iter().sum();
        let mut u = self.rng.random::<f32>() * total;
        for (i, q) in kept.iter().enumerate() {
            if u < *q {
                return cand[i].0;
            }
            u -= q;
        }
        cand[keep - 1].0
    }
}

/// Index of the largest logit; the first on ties (as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of `raw` at `token`, plus the `n` most likely tokens.
pub fn logprobs(raw: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + crate::backend::cpu::vmath::sum_exp(raw, max).ln() as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in raw.iter().enumerate() {
            if top.len() < n || l > top[top.len() - 1].1 {
                let at = top.partition_point(|&(_, v)| v >= l);
                top.insert(at, (i as u32, l));
                top.truncate(n);
            }
        }
    }
    TokenLogprobs {
        token_id: token,
        logprob: raw[token as usize] - log_z,
        rank: 0,
        top: top.into_iter().map(|(i, l)| (i, l - log_z)).collect(),
    }
}

#[cfg(test)]
mod tests;
