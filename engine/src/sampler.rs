//! Choosing the next token from a sequence's logits.
//!
//! Order of processing (HF transformers' and vLLM's): repetition penalty, presence and
//! frequency penalties, then temperature, top-k, top-p and min-p, then a draw from the
//! sequence's own seeded ChaCha stream, so a seed reproduces a generation exactly whatever
//! else shares the batch. Reported logprobs are those of the model's raw distribution
//! (log-softmax of the unprocessed logits), as vLLM reports them.

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use strata_common::SamplingParams;

use crate::logits::Pick;

pub use strata_common::TokenLogprobs;

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens seen in the prompt or output (for the repetition penalty).
    seen: HashSet<u32>,
    /// Output token counts (for presence and frequency penalties).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        let seen =
            if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Sampler { params, rng, seen, counts: HashMap::new() }
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

    /// Picks the next token and records it as output.
    pub fn sample(&mut self, raw: &[f32]) -> (u32, Option<TokenLogprobs>) {
        let mut logits = raw.to_vec();
        self.apply_penalties(&mut logits);
        let token = if self.params.is_greedy() { argmax(&logits) } else { self.draw(&logits) };
        let logprobs = self.params.logprobs.map(|n| logprobs(raw, token, n as usize));
        self.record(token);
        (token, logprobs)
    }

    /// Whether choosing the next token needs the row's whole logits: anything but plain
    /// greedy decoding (penalties move the argmax; top logprobs need the distribution).
    /// When it does not, the step can return a [`Pick`] instead ([`Sampler::accept`]).
    pub fn needs_full_logits(&self) -> bool {
        let p = &self.params;
        !p.is_greedy()
            || p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || p.logprobs.is_some_and(|n| n > 0)
    }

    /// Takes the token a greedy pick chose (only for a sampler that does not
    /// [`need_full_logits`](Sampler::needs_full_logits)) and records it as output: the
    /// same token and logprob [`Sampler::sample`] gives on that row's logits.
    pub fn accept(&mut self, pick: Pick) -> (u32, Option<TokenLogprobs>) {
        debug_assert!(!self.needs_full_logits(), "a pick for a sampler that needs the logits");
        let logprobs = self.params.logprobs.map(|_| TokenLogprobs {
            token_id: pick.token,
            logprob: pick.logprob(),
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

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
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
    let log_z = max + raw.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
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
        top: top.into_iter().map(|(i, l)| (i, l - log_z)).collect(),
    }
}

#[cfg(test)]
mod tests;
