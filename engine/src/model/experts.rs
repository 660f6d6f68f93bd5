//! The mixture-of-experts MLP part: a router picks each token's top-k experts, each expert
//! that a step's tokens chose runs once over all of them, and its outputs, weighted, are
//! added back to their tokens.
//!
//! Routing is computed on the host: the router's logits are `[tokens, experts]` — a few
//! floats a token — and the top-k choice, its softmax and the grouping of tokens by expert
//! are plain Rust, the same on every rank (every TP rank holds the same hidden states and
//! the whole router, so every rank routes every token identically). The router's weights
//! stay in f32 whatever the backend does to the others (`--quantize int8` never moves a
//! routing decision). Experts are visited in id order and each adds `weight · output` to
//! its tokens' rows, the order in which HF transformers combines them. Under tensor
//! parallelism each rank holds every expert's slice of intermediate columns and the
//! combined partial sums are all-reduced, as for a dense MLP.

use strata_common::{Error, Result};

use super::parts::{Activation, Linear, PartCx};
use crate::backend::Backend;

/// One expert's gated MLP (this rank's intermediate columns of it).
pub(super) struct Expert<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

/// A layer's experts and their router.
pub(super) struct Experts<B: Backend> {
    pub act: Activation,
    /// `[experts, hidden]`, row-major, f32.
    pub router: Vec<f32>,
    pub experts: Vec<Expert<B>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// Which tokens each expert serves, and with what weight.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Routes {
    /// Per expert: the rows (tokens) that chose it, ascending, and each one's weight.
    pub rows: Vec<Vec<usize>>,
    pub weights: Vec<Vec<f32>>,
}

/// Each token's top `k` experts by the softmax of its router logits (`logits`, `[tokens,
/// experts]`), the softmax taken in f32 as transformers takes it; the chosen
/// probabilities renormalised to sum to 1 when `norm` says. Ties go to the lower id.
pub(super) fn route(logits: &[f32], experts: usize, k: usize, norm: bool) -> Routes {
    let mut routes = Routes { rows: vec![Vec::new(); experts], weights: vec![Vec::new(); experts] };
    for (t, row) in logits.chunks_exact(experts).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exp: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
        let sum: f32 = exp.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let probs: Vec<f32> = chosen.iter().map(|&e| exp[e] / sum).collect();
        let total: f32 = probs.iter().sum();
        for (&e, &p) in chosen.iter().zip(&probs) {
            routes.rows[e].push(t);
            routes.weights[e].push(if norm { p / total } else { p });
        }
    }
    routes
}

impl<B: Backend> Experts<B> {
    /// The experts' combined output for `x` (`[tokens, hidden]`), summed across the TP
    /// group.
    pub fn forward(&self, cx: &mut PartCx<'_, B>, x: &B::Tensor) -> Result<B::Tensor> {
        let b = cx.b;
        let (tokens, hidden) = b.shape(x);
        let n = self.experts.len();
        if self.router.len() != n * hidden {
            return Err(Error::Internal(format!("a router of {} values for {n} experts", self.router.len())));
        }
        let host = b.to_host(x)?;
        let logits: Vec<f32> = host
            .chunks_exact(hidden)
            .flat_map(|t| self.router.chunks_exact(hidden).map(move |r| dot(t, r)))
            .collect();
        let routes = route(&logits, n, self.top_k, self.norm_topk_prob);
        let mut out = b.upload(vec![0.0; tokens * hidden], tokens, hidden)?;
        for (e, expert) in self.experts.iter().enumerate() {
            let rows = &routes.rows[e];
            if rows.is_empty() {
                continue; // no token of this step chose it: its weights are not read
            }
            let xe = b.gather_rows(x, rows)?;
            let [g, u] = Linear::apply_many(b, &xe, [&expert.gate, &expert.up])?;
            let y = expert.down.apply(b, &b.gated(self.act, &g, &u)?)?;
            b.scatter_add_rows(&mut out, &y, rows, &routes.weights[e])?;
        }
        (cx.reduce)(&mut out)?;
        Ok(out)
    }
}

/// `Σ a[i] · b[i]` in f32, four lanes as a vectorised matmul adds them.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_goes_to_its_top_experts_with_softmax_weights() {
        // Two tokens, four experts, top 2.
        let logits = [1.0, 3.0, 2.0, 0.0, 0.5, 0.5, -1.0, 4.0];
        let r = route(&logits, 4, 2, true);
        assert_eq!(r.rows, [vec![1], vec![0], vec![0], vec![1]], "token 1's tie goes to expert 0");
        let (e1, e2) = (3f32.exp(), 2f32.exp());
        assert!((r.weights[1][0] - e1 / (e1 + e2)).abs() < 1e-6);
        assert!((r.weights[1][0] + r.weights[2][0] - 1.0).abs() < 1e-6, "renormalised");
        // Without renormalising, the weights are the softmax over every expert.
        let raw = route(&logits, 4, 2, false);
        let z: f32 = [1.0f32, 3.0, 2.0, 0.0].iter().map(|l| l.exp()).sum();
        assert!((raw.weights[1][0] - e1 / z).abs() < 1e-6);
        assert!(raw.weights[1][0] + raw.weights[2][0] < 1.0);
    }

    #[test]
    fn dot_products_add_in_lanes() {
        let a: Vec<f32> = (0..11).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..11).map(|i| 1.0 - i as f32 * 0.1).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-5);
    }
}
