//! The mixture-of-experts MLP part: a router picks each token's top-k experts, each expert
//! that a step's tokens chose runs once over all of them, and its outputs, weighted, are
//! added back to their tokens.
//!
//! A backend that can ([`crate::backend::ExpertOps::device_experts`]: CUDA) runs a layer's routed
//! experts whole on its device — routing, grouping, grouped matmuls, combine — with the
//! same choices and the same order of additions; what follows is the host's way, which
//! every backend has and expert parallelism uses.
//!
//! Routing is computed on the host: the router's logits are `[tokens, experts]` — a few
//! floats a token — and the top-k choice, its softmax and the grouping of tokens by expert
//! are plain Rust, the same on every rank (every TP rank holds the same hidden states and
//! the whole router, so every rank routes every token identically). The router's weights
//! stay in f32 whatever the backend does to the others (`--quantize int8` never moves a
//! routing decision). Experts are visited in id order and each adds `weight · output` to
//! its tokens' rows, the order in which HF transformers combines them.
//!
//! Two ways to split experts across a stage's TP ranks:
//! - by columns (`ep` 1): each rank holds every expert's share of intermediate columns;
//!   the partial sums are all-reduced, as for a dense MLP;
//! - by experts (expert parallelism): each rank holds whole experts. Each rank owns a
//!   contiguous chunk of the step's tokens, sends each of its token-expert pairs' hidden
//!   states to the rank holding that expert (an all-to-all with uneven counts, which every
//!   rank knows because every rank routed every token), the experts run over what they
//!   received, their outputs go back the same way, each rank combines its own tokens (in
//!   expert order, weighted: exactly what one rank computes) and an all-gather gives every
//!   rank every token's output again for the attention that follows.

use strata_common::{Error, Result};

use std::sync::OnceLock;
use std::time::Instant;

use rayon::prelude::*;

use super::parts::{Activation, Linear, PartCx};
use crate::backend::routing::{Routes, Routing};
use crate::backend::{Backend, ExpertLayer, ExpertProjection};
use crate::comm::Exchange;
use crate::metrics::ExpertMetrics;

/// One expert's gated MLP (this rank's intermediate columns of it).
pub(super) struct Expert<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

/// A layer's experts and their router.
pub(super) struct Experts<B: Backend> {
    pub layer: usize,
    pub act: Activation,
    /// `[experts, hidden]` for all the layer's experts, row-major, f32.
    pub router: Vec<f32>,
    /// Added to the router's logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// How the router's logits choose (DeepSeek-V3's grouped sigmoid routing carries its
    /// correction bias).
    pub routing: Routing,
    /// The shared experts every token runs (DeepSeek-V3), as one gated MLP: split by
    /// columns across the TP group like a dense MLP (its partial sums ride the routed
    /// experts' all-reduce), or whole on every rank under expert parallelism (added after
    /// the exchange).
    pub shared: Option<Expert<B>>,
    /// This rank's experts: all of them, or under expert parallelism ids `first..`.
    pub experts: Vec<Expert<B>>,
    pub first: usize,
    pub top_k: usize,
    /// The routed experts prepared to run on the device, where the backend can and the
    /// experts are split by columns (expert parallelism routes on the host: its exchange
    /// needs the counts there).
    pub device: Option<B::DeviceExperts>,
    /// Experts are split by experts (each rank holds whole ones), not by columns.
    pub parallel: bool,
    /// This rank's place in its TP group.
    pub group_rank: usize,
    /// Routing counters, resolved on the first step (after the model is labelled); only
    /// the ranks that count (TP rank 0, or each rank for its own experts) have them.
    pub counts_routes: bool,
    pub metrics: OnceLock<ExpertMetrics>,
}

impl<B: Backend> Experts<B> {
    /// The experts' combined output for `x` (`[tokens, hidden]`), the same on every rank
    /// of the TP group.
    pub fn forward(&self, cx: &mut PartCx<'_, B>, x: &B::Tensor) -> Result<B::Tensor> {
        if let Some(device) = &self.device {
            return self.forward_on_device(cx, x, device);
        }
        let routes = self.route(cx.b, x)?;
        if self.counts_routes {
            let counts: Vec<usize> = routes.rows.iter().map(Vec::len).collect();
            let local = &counts[self.first..self.first + self.experts.len()];
            cx.metrics.expert_pairs(local.iter().sum());
            self.metrics.get_or_init(|| cx.metrics.experts(self.layer, counts.len())).routed(&counts);
        }
        if self.parallel && cx.group.len() > 1 {
            let mut out = self.exchange(cx, x, &routes)?;
            if let Some(shared) = &self.shared {
                cx.b.add_assign(&mut out, &self.run(cx.b, shared, x)?)?;
            }
            return Ok(out);
        }
        let b = cx.b;
        let (tokens, hidden) = b.shape(x);
        let mut out = b.upload(vec![0.0; tokens * hidden], tokens, hidden)?;
        // Experts no token of this step chose are skipped: their weights are not read.
        let chosen: Vec<(usize, &[usize])> = (0..self.experts.len())
            .map(|i| (i, &routes.rows[self.first + i][..]))
            .filter(|(_, rows)| !rows.is_empty())
            .collect();
        for (i, y) in self.run_all(b, &chosen, x)? {
            let e = self.first + i;
            b.scatter_add_rows(&mut out, &y, &routes.rows[e], &routes.weights[e])?;
        }
        if let Some(shared) = &self.shared {
            b.add_assign(&mut out, &self.run(b, shared, x)?)?;
        }
        cx.reduce(&mut out)?;
        Ok(out)
    }

    /// Each `(expert, rows)`'s MLP over `x`'s `rows`, in the order given. A backend whose
    /// ops fan out over rayon's pool runs the experts side by side (a decode step's few
    /// small matmuls share one parallel region instead of a fork-join each); outputs are
    /// combined afterwards in expert order, so the numbers do not depend on it.
    fn run_all(&self, b: &B, chosen: &[(usize, &[usize])], x: &B::Tensor) -> Result<Vec<(usize, B::Tensor)>> {
        let one = |&(i, rows): &(usize, &[usize])| -> Result<(usize, B::Tensor)> {
            Ok((i, self.run(b, &self.experts[i], &b.gather_rows(x, rows)?)?))
        };
        match b.uses_thread_pool() {
            true => chosen.par_iter().map(one).collect(),
            false => chosen.iter().map(one).collect(),
        }
    }

    /// Every token's route, from the router's logits computed on the host.
    fn route(&self, b: &B, x: &B::Tensor) -> Result<Routes> {
        let (_, hidden) = b.shape(x);
        let total = self.router.len() / hidden.max(1);
        if total * hidden != self.router.len() || total < self.first + self.experts.len() {
            return Err(Error::Internal(format!(
                "a router of {} values for hidden size {hidden}",
                self.router.len()
            )));
        }
        let host = b.to_host(x)?;
        let bias = |e: usize| self.router_bias.as_ref().map_or(0.0, |b| b[e]);
        let logits: Vec<f32> = host
            .chunks_exact(hidden)
            .flat_map(|t| self.router.chunks_exact(hidden).enumerate().map(move |(e, r)| dot(t, r) + bias(e)))
            .collect();
        Ok(self.routing.route(&logits, total, self.top_k))
    }

    /// The backend's device path (see the module): the same output as the host's.
    fn forward_on_device(
        &self,
        cx: &mut PartCx<'_, B>,
        x: &B::Tensor,
        device: &B::DeviceExperts,
    ) -> Result<B::Tensor> {
        let b = cx.b;
        let mut out = b.run_experts(x, device)?;
        if self.counts_routes {
            if let Some(counts) = b.routed_counts(device)? {
                let counts: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
                cx.metrics.expert_pairs(counts.iter().sum());
                self.metrics.get_or_init(|| cx.metrics.experts(self.layer, counts.len())).routed(&counts);
            }
        }
        if let Some(shared) = &self.shared {
            b.add_assign(&mut out, &self.run(b, shared, x)?)?;
        }
        cx.reduce(&mut out)?;
        Ok(out)
    }

    /// Offers the layer's routed experts to the backend to run on its device (not under
    /// expert parallelism); keeps the host's way where the backend declines.
    pub fn prepare_device(&mut self, b: &B) -> Result<()> {
        if self.parallel {
            return Ok(());
        }
        let projection = |f: fn(&Expert<B>) -> &Linear<B>| -> Result<ExpertProjection<'_, B>> {
            let biases: Vec<&B::Tensor> = self.experts.iter().filter_map(|e| f(e).bias.as_ref()).collect();
            Ok(ExpertProjection {
                weights: self.experts.iter().map(|e| &f(e).weight).collect(),
                biases: match biases.len() {
                    0 => None,
                    n if n == self.experts.len() => Some(biases),
                    n => {
                        return Err(Error::Internal(format!(
                            "{n} of {} experts have biases",
                            self.experts.len()
                        )))
                    }
                },
            })
        };
        let layer = ExpertLayer {
            router: &self.router,
            router_bias: self.router_bias.as_deref(),
            routing: &self.routing,
            top_k: self.top_k,
            act: self.act,
            gate: projection(|e| &e.gate)?,
            up: projection(|e| &e.up)?,
            down: projection(|e| &e.down)?,
        };
        self.device = b.device_experts(layer)?;
        Ok(())
    }

    /// One expert's gated MLP over its tokens' rows.
    fn run(&self, b: &B, expert: &Expert<B>, x: &B::Tensor) -> Result<B::Tensor> {
        let [g, u] = Linear::apply_many(b, x, [&expert.gate, &expert.up])?;
        expert.down.apply(b, &b.gated(self.act, &g, &u)?)
    }

    /// Expert parallelism (see the module): dispatch, compute, return, combine, gather.
    fn exchange(&self, cx: &mut PartCx<'_, B>, x: &B::Tensor, routes: &Routes) -> Result<B::Tensor> {
        let b = cx.b;
        let (n, hidden) = b.shape(x);
        let plan = ExchangePlan::new(routes, n, cx.group.len(), self.group_rank, self.experts.len());
        let started = Instant::now();
        let sent = b.gather_rows(x, &plan.send_rows)?;
        let got = cx.comm.all_to_all(b, &sent, Exchange { send: &plan.send, recv: &plan.recv }, cx.group)?;
        let received: usize = plan.recv.iter().sum();
        let mut outs = b.upload(vec![0.0; received * hidden], received, hidden)?;
        let chosen: Vec<(usize, &[usize])> = plan
            .mine
            .iter()
            .enumerate()
            .map(|(i, at)| (i, &at[..]))
            .filter(|(_, at)| !at.is_empty())
            .collect();
        for (i, y) in self.run_all(b, &chosen, &got)? {
            let at = &plan.mine[i];
            b.scatter_add_rows(&mut outs, &y, at, &vec![1.0; at.len()])?;
        }
        let back = cx.comm.all_to_all(b, &outs, Exchange { send: &plan.recv, recv: &plan.send }, cx.group)?;
        let mut own = b.upload(vec![0.0; plan.chunk * hidden], plan.chunk, hidden)?;
        for (e, (at, tokens)) in plan.returned.iter().enumerate() {
            if !at.is_empty() {
                let weights: Vec<f32> = tokens.iter().map(|&t| weight(routes, e, t)).collect();
                let rows: Vec<usize> = tokens.iter().map(|&t| t - plan.first_token).collect();
                b.scatter_add_rows(&mut own, &b.gather_rows(&back, at)?, &rows, &weights)?;
            }
        }
        let all = cx.comm.all_gather(b, &own, cx.group)?;
        let bytes = (plan.send_rows.len() + received + plan.chunk * cx.group.len()) * hidden * 4;
        cx.metrics.all_to_all(started.elapsed(), bytes);
        b.gather_rows(&all, &(0..n).collect::<Vec<_>>())
    }
}

/// The weight of token `t`'s route to expert `e`.
fn weight(routes: &Routes, e: usize, t: usize) -> f32 {
    routes.rows[e].binary_search(&t).map_or(0.0, |k| routes.weights[e][k])
}

/// Who sends what to whom in an expert-parallel step, computed alike on every rank.
#[derive(Debug, PartialEq)]
struct ExchangePlan {
    /// Tokens each rank owns (the last rank's share may be short) and this rank's first.
    chunk: usize,
    first_token: usize,
    /// This rank's token-expert pairs' token rows, sent to the experts' ranks in rank
    /// order, each rank's in expert order, each expert's in token order; the counts.
    send_rows: Vec<usize>,
    send: Vec<usize>,
    /// Rows received from each rank; per local expert, where its pairs lie among them.
    recv: Vec<usize>,
    mine: Vec<Vec<usize>>,
    /// Per expert (every expert of the layer), where its results for this rank's tokens
    /// lie in what comes back, and those tokens.
    returned: Vec<(Vec<usize>, Vec<usize>)>,
}

impl ExchangePlan {
    fn new(routes: &Routes, tokens: usize, ranks: usize, me: usize, per: usize) -> Self {
        let chunk = tokens.div_ceil(ranks).max(1);
        let owner = |t: usize| t / chunk;
        let total = routes.rows.len();
        let mut plan = ExchangePlan {
            chunk,
            first_token: me * chunk,
            send_rows: Vec::new(),
            send: vec![0; ranks],
            recv: vec![0; ranks],
            mine: vec![Vec::new(); per],
            returned: vec![(Vec::new(), Vec::new()); total],
        };
        for (e, rows) in routes.rows.iter().enumerate() {
            for &t in rows.iter().filter(|&&t| owner(t) == me) {
                plan.returned[e].0.push(plan.send_rows.len());
                plan.returned[e].1.push(t);
                plan.send_rows.push(t);
                plan.send[e / per] += 1;
            }
        }
        let mut at = 0;
        for (src, recv) in plan.recv.iter_mut().enumerate() {
            for (i, e) in (me * per..(me + 1) * per).enumerate() {
                for _ in routes.rows[e].iter().filter(|&&t| owner(t) == src) {
                    plan.mine[i].push(at);
                    at += 1;
                    *recv += 1;
                }
            }
        }
        plan
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
    fn an_exchange_plan_sends_each_pair_to_its_experts_rank_and_back() {
        // Five tokens, four experts of two ranks (two each), top 2.
        let rows = vec![vec![0, 3], vec![1, 2, 4], vec![0, 1, 3], vec![2, 4]];
        let routes = Routes { weights: rows.iter().map(|r| vec![0.5; r.len()]).collect(), rows };
        let (a, b) = (ExchangePlan::new(&routes, 5, 2, 0, 2), ExchangePlan::new(&routes, 5, 2, 1, 2));
        // Rank 0 owns tokens 0..3, rank 1 tokens 3..5.
        assert_eq!((a.chunk, a.first_token, b.first_token), (3, 0, 3));
        // Rank 0's pairs by expert: e0 {0}, e1 {1, 2}, e2 {0, 1}, e3 {2}.
        assert_eq!(a.send_rows, [0, 1, 2, 0, 1, 2]);
        assert_eq!(a.send, [3, 3]);
        // What one rank sends the other, the other expects: send counts meet receive counts.
        assert_eq!((a.send[1], b.recv[0]), (3, 3));
        assert_eq!((b.send[0], a.recv[1]), (2, 2));
        // Rank 1 receives rank 0's three pairs for experts 2 and 3 first, then its own.
        assert_eq!(b.mine, [vec![0, 1, 3], vec![2, 4]]);
        assert_eq!(a.returned[1], (vec![1, 2], vec![1, 2]));
        // Every pair goes somewhere exactly once.
        let pairs: usize = routes.rows.iter().map(Vec::len).sum();
        assert_eq!(a.send.iter().sum::<usize>() + b.send.iter().sum::<usize>(), pairs);
        assert_eq!(a.recv.iter().sum::<usize>() + b.recv.iter().sum::<usize>(), pairs);
        // Fewer tokens than ranks: the last rank owns none and sends nothing.
        let one = Routes { rows: vec![vec![0], vec![0]], weights: vec![vec![0.5], vec![0.5]] };
        assert_eq!(ExchangePlan::new(&one, 1, 2, 1, 1).send, [0, 0]);
    }

    #[test]
    fn skewed_routes_send_everything_to_one_rank_and_nothing_to_another() {
        // Four tokens all routed to experts 2 and 3, both on rank 1 of 2.
        let rows = vec![vec![], vec![], vec![0, 1, 2, 3], vec![0, 1, 2, 3]];
        let routes = Routes { weights: rows.iter().map(|r| vec![0.5; r.len()]).collect(), rows };
        let (a, b) = (ExchangePlan::new(&routes, 4, 2, 0, 2), ExchangePlan::new(&routes, 4, 2, 1, 2));
        assert_eq!(
            (a.send.clone(), a.recv.clone()),
            (vec![0, 4], vec![0, 0]),
            "rank 0's experts get nothing"
        );
        assert_eq!((b.send.clone(), b.recv.clone()), (vec![0, 4], vec![4, 4]), "rank 1's get every pair");
        assert_eq!(b.mine, [vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
        assert!(a.mine.iter().all(Vec::is_empty));
    }

    /// `strata model random --arch qwen3-moe` writes a model this engine loads, and a decode
    /// step of one token counts only the experts it reads: here 2 of 4.
    #[test]
    fn a_random_moe_model_loads_and_decode_reads_its_active_experts() {
        use crate::backend::cpu::CpuBackend;
        use crate::model::random::RandomModelSpec;
        use crate::model::Model;
        for arch in [strata_common::Architecture::Qwen3Moe, strata_common::Architecture::Mixtral] {
            let dir = tempfile::tempdir().unwrap();
            let spec = RandomModelSpec::tiny(arch);
            spec.write(dir.path(), |_, _| {}).unwrap();
            let model = Model::load(dir.path(), CpuBackend::new()).unwrap();
            let moe = model.config.moe.clone().unwrap();
            assert_eq!((moe.num_experts, moe.top_k), (spec.experts, spec.top_k), "{arch:?}");
            // f32 experts: gate, up and down of expert_intermediate × hidden each.
            let per_expert = 3 * spec.expert_intermediate * spec.hidden * 4;
            let idle = spec.layers * (spec.experts - spec.top_k) * per_expert;
            let embed = spec.vocab * spec.hidden * 4;
            let read = model.weight_bytes() - if spec.tie_word_embeddings { 0 } else { embed };
            assert_eq!(model.decode_bytes_per_token(), read - idle, "{arch:?}");
        }
    }

    #[test]
    fn dot_products_add_in_lanes() {
        let a: Vec<f32> = (0..11).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..11).map(|i| 1.0 - i as f32 * 0.1).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-5);
    }
}
