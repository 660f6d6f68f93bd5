//! How tokens choose experts: a mixture-of-experts router's logits to each expert's rows
//! and weights. Plain host code, the same on every rank; the reference for backends that
//! route on the device ([`super::ExpertOps::device_experts`]).

use strata_common::GroupedRouting;

/// How a layer's router logits become routes.
#[derive(Debug, Clone, PartialEq)]
pub enum Routing {
    /// Top-k of the softmax (Mixtral, Qwen3-MoE, gpt-oss), renormalised when `norm`.
    Softmax { norm: bool },
    /// DeepSeek-V3's grouped sigmoid routing with its per-expert correction bias.
    Grouped { norm: bool, groups: GroupedRouting, correction: Vec<f32> },
}

impl Routing {
    /// Every token's route from its router logits (`[tokens, experts]`).
    pub fn route(&self, logits: &[f32], experts: usize, k: usize) -> Routes {
        match self {
            Routing::Softmax { norm } => route(logits, experts, k, *norm),
            Routing::Grouped { norm, groups, correction } => {
                route_grouped(logits, experts, k, *norm, *groups, correction)
            }
        }
    }
}

/// Which tokens each expert serves, and with what weight.
#[derive(Debug, Default, PartialEq)]
pub struct Routes {
    /// Per expert: the rows (tokens) that chose it, ascending, and each one's weight.
    pub rows: Vec<Vec<usize>>,
    pub weights: Vec<Vec<f32>>,
}

/// Each token's top `k` experts by the softmax of its router logits (`logits`, `[tokens,
/// experts]`), the softmax taken in f32 as transformers takes it; the chosen
/// probabilities renormalised to sum to 1 when `norm` says. Ties go to the lower id.
pub fn route(logits: &[f32], experts: usize, k: usize, norm: bool) -> Routes {
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

/// DeepSeek-V3's choice: sigmoid scores, plus the correction bias, rank the experts; the
/// `topk_group` groups whose two best biased scores sum highest are kept and the `k` best
/// experts among them chosen; their unbiased scores are the weights, renormalised when
/// `norm` says, times the routed scaling factor. Ties go to the lower id.
pub fn route_grouped(
    logits: &[f32],
    experts: usize,
    k: usize,
    norm: bool,
    g: GroupedRouting,
    bias: &[f32],
) -> Routes {
    let mut routes = Routes { rows: vec![Vec::new(); experts], weights: vec![Vec::new(); experts] };
    let per = experts / g.n_group.max(1);
    let best = |v: &[f32], idx: &mut Vec<usize>, n: usize| {
        idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        idx.truncate(n);
    };
    for (t, row) in logits.chunks_exact(experts).enumerate() {
        let scores: Vec<f32> = row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
        let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let group_scores: Vec<f32> = choice
            .chunks_exact(per)
            .map(|grp| {
                let mut idx: Vec<usize> = (0..per).collect();
                best(grp, &mut idx, 2);
                idx.iter().map(|&i| grp[i]).sum()
            })
            .collect();
        let mut groups: Vec<usize> = (0..g.n_group).collect();
        best(&group_scores, &mut groups, g.topk_group);
        let mut masked = vec![f32::NEG_INFINITY; experts];
        for grp in groups {
            masked[grp * per..(grp + 1) * per].copy_from_slice(&choice[grp * per..(grp + 1) * per]);
        }
        let mut chosen: Vec<usize> = (0..experts).collect();
        best(&masked, &mut chosen, k);
        let total: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
        for &e in &chosen {
            let w = if norm { scores[e] / total } else { scores[e] };
            routes.rows[e].push(t);
            routes.weights[e].push(w * g.routed_scaling_factor);
        }
    }
    routes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups are ranked by their two best biased scores and only the best groups'
    /// experts compete: expert 0 scores above expert 7 but its group is dropped. Weights
    /// are the unbiased sigmoid scores, renormalised and scaled.
    #[test]
    fn grouped_routing_keeps_the_best_groups_and_weighs_by_unbiased_scores() {
        let logits = [6.0, -3.0, 0.0, 0.1, 2.5, 2.4, -1.0, 5.0];
        let mut bias = [0.0; 8];
        bias[6] = 2.0;
        let g = GroupedRouting { n_group: 4, topk_group: 2, routed_scaling_factor: 2.5 };
        let routes = route_grouped(&logits, 8, 2, true, g, &bias);
        let chosen: Vec<usize> = (0..8).filter(|&e| !routes.rows[e].is_empty()).collect();
        assert_eq!(chosen, [6, 7]);
        let s = |l: f32| 1.0 / (1.0 + (-l).exp());
        let total = s(-1.0) + s(5.0);
        assert!((routes.weights[6][0] - 2.5 * s(-1.0) / total).abs() < 1e-6);
        assert!((routes.weights[7][0] - 2.5 * s(5.0) / total).abs() < 1e-6);
        let plain = route_grouped(&logits, 8, 2, false, GroupedRouting { topk_group: 4, ..g }, &bias);
        let chosen: Vec<usize> = (0..8).filter(|&e| !plain.rows[e].is_empty()).collect();
        assert_eq!(chosen, [0, 6], "every group kept: expert 0 wins");
        assert!((plain.weights[0][0] - 2.5 * s(6.0)).abs() < 1e-6, "not renormalised");
    }

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
}
