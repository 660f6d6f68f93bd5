//! Drawing a row's token where its logits are, so that only the token crosses to the host.
//!
//! Top-p, min-p and plain temperature sampling need the whole tempered distribution of a
//! row, which the host would otherwise copy across (a vocabulary of floats per row per
//! step). A backend that draws on the device ([`LogitsOps::draws_on_device`]) is handed
//! each such row's [`Draw`] — its temperature, top-p, min-p and the uniform number the
//! sequence's own seeded stream gave for this token — and returns the token as a
//! [`Pick`] (with the row's largest logit and log-sum-exp, so the host still sees a row
//! that was not finite).
//!
//! The kept tokens are the sampler's: after temperature, the fewest most likely tokens
//! (logit descending, the smaller id first on ties) whose probability reaches top-p, of
//! them those whose probability is at least min-p times the largest (and not 0). The
//! draw walks the kept tokens in id order to `u` times their total weight, which needs
//! no sort: the same distribution as a walk most likely first. The host sampler draws
//! such requests the same way ([`host_draw`]), so a row gives the same token on the host and on the
//! device (but where the two sum weights differently and a cut falls within rounding),
//! and whether a row is drawn on the device depends on its request alone, never on what
//! shares its batch: a seed still reproduces a generation.
//!
//! [`LogitsOps::draws_on_device`]: crate::backend::LogitsOps::draws_on_device

/// Floats per row of a draw's parameters, as the device reads them.
pub const DRAW_PARAMS: usize = 4;

/// One row's sampling parameters and uniform number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// > 0; a row with 0 gets its greedy pick (the rows of a batch that are not drawn).
    pub temperature: f32,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// In [0, 1]; 0 keeps every token.
    pub min_p: f32,
    /// In [0, 1): where the draw falls in the kept tokens' total weight.
    pub u: f32,
}

impl Draw {
    /// Parameters for a row that is not drawn: its greedy pick comes back, unused.
    pub const NONE: Draw = Draw { temperature: 0.0, top_p: 1.0, min_p: 0.0, u: 0.0 };
}

/// Draws as the device reads them: [`DRAW_PARAMS`] floats per row.
pub fn draws_to_f32s(draws: &[Draw]) -> Vec<f32> {
    draws.iter().flat_map(|d| [d.temperature, d.top_p, d.min_p, d.u]).collect()
}

/// The columns `draw` keeps of `row`, in id order, with their tempered weights
/// `exp(l/T − max/T)` (the definition the device kernel follows without sorting).
pub fn kept(row: &[f32], draw: &Draw) -> Vec<(usize, f32)> {
    if draw.top_p >= 1.0 {
        return kept_without_nucleus(row, draw);
    }
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_unstable_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let Some(&first) = order.first() else { return Vec::new() };
    let top_t = row[first] / draw.temperature;
    let weights: Vec<f32> = row.iter().map(|&l| (l / draw.temperature - top_t).exp()).collect();
    let need = draw.top_p as f64 * weights.iter().map(|&w| w as f64).sum::<f64>();
    let mut cum = 0f64;
    let mut keep = Vec::new();
    for &c in &order {
        if draw.top_p < 1.0 && cum >= need && !keep.is_empty() {
            break;
        }
        let w = weights[c];
        cum += w as f64;
        if (w >= draw.min_p && w > 0.0) || keep.is_empty() {
            keep.push((c, w));
        }
    }
    keep.sort_unstable_by_key(|k| k.0);
    keep
}

/// [`kept`] when top-p keeps everything: no order is needed (min-p is a threshold on the
/// weight, which is relative to the most likely token's), so the row is read twice and
/// never sorted — the same columns and weights, at a fraction of the cost on a large
/// vocabulary.
fn kept_without_nucleus(row: &[f32], draw: &Draw) -> Vec<(usize, f32)> {
    // The most likely token, the smaller id first on ties (the sorted order's first).
    let Some(first) =
        (0..row.len()).reduce(|best, c| if row[c].total_cmp(&row[best]).is_gt() { c } else { best })
    else {
        return Vec::new();
    };
    let top_t = row[first] / draw.temperature;
    row.iter()
        .enumerate()
        .filter_map(|(c, &l)| {
            let w = (l / draw.temperature - top_t).exp();
            ((w >= draw.min_p && w > 0.0) || c == first).then_some((c, w))
        })
        .collect()
}

/// The column `draw` picks of `row`: its kept tokens walked in id order to `u` times
/// their weight (the host's draw, and the reference of the device kernel).
pub fn host_draw(row: &[f32], draw: &Draw) -> usize {
    if draw.temperature.is_nan() || draw.temperature <= 0.0 || row.is_empty() {
        return (0..row.len()).fold(0, |best, c| if row[c] > row[best] { c } else { best });
    }
    let keep = kept(row, draw);
    let target = draw.u as f64 * keep.iter().map(|k| k.1 as f64).sum::<f64>();
    let mut acc = 0f64;
    for &(c, w) in &keep {
        acc += w as f64;
        if target < acc {
            return c;
        }
    }
    keep.last().expect("a row keeps its most likely token").0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(7919).wrapping_add(seed * 131)) % 211) as f32 * 0.04 - 4.0)
            .collect()
    }

    fn ids(kept: Vec<(usize, f32)>) -> Vec<usize> {
        kept.into_iter().map(|k| k.0).collect()
    }

    fn probs(row: &[f32], t: f32) -> Vec<f64> {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = row.iter().map(|&l| ((l / t - m / t).exp()) as f64).collect();
        let s: f64 = w.iter().sum();
        w.into_iter().map(|x| x / s).collect()
    }

    /// [`kept`]'s definition, sorting the whole row whatever top-p is.
    fn kept_by_sorting(row: &[f32], draw: &Draw) -> Vec<(usize, f32)> {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_unstable_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let top_t = row[order[0]] / draw.temperature;
        let mut keep: Vec<(usize, f32)> = order
            .iter()
            .enumerate()
            .map(|(i, &c)| (i, c, (row[c] / draw.temperature - top_t).exp()))
            .filter(|&(i, _, w)| (w >= draw.min_p && w > 0.0) || i == 0)
            .map(|(_, c, w)| (c, w))
            .collect();
        keep.sort_unstable_by_key(|k| k.0);
        keep
    }

    #[test]
    fn without_a_nucleus_no_sort_is_needed_and_nothing_changes() {
        for seed in 0..20 {
            let mut r = row(500 + seed as usize * 37, seed);
            r[17] = r.iter().copied().fold(f32::NEG_INFINITY, f32::max); // a tie for the top
            for (t, min_p) in [(1.0, 0.0), (0.7, 0.0), (1.3, 0.05), (0.2, 0.5), (1.0, 1.0)] {
                let d = Draw { temperature: t, top_p: 1.0, min_p, u: 0.5 };
                assert_eq!(kept(&r, &d), kept_by_sorting(&r, &d), "seed {seed}, T {t}, min_p {min_p}");
            }
        }
        let d = Draw { temperature: 1.0, top_p: 1.0, min_p: 0.0, u: 0.5 };
        assert_eq!(
            kept(&[f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY], &d),
            vec![(1, 1.0)],
            "masked tokens drop out"
        );
    }

    #[test]
    fn the_nucleus_is_the_fewest_likeliest_tokens_reaching_top_p() {
        let r = row(300, 3);
        let d = Draw { temperature: 0.7, top_p: 0.6, min_p: 0.0, u: 0.0 };
        let keep = ids(kept(&r, &d));
        let p = probs(&r, 0.7);
        let mass: f64 = keep.iter().map(|&c| p[c]).sum();
        let least = keep.iter().map(|&c| p[c]).fold(f64::INFINITY, f64::min);
        assert!(mass >= 0.6 - 1e-6, "kept mass {mass}");
        assert!(mass - least < 0.6, "one fewer token would still reach top_p");
        let outside = (0..r.len()).filter(|c| !keep.contains(c)).map(|c| p[c]).fold(0.0, f64::max);
        assert!(outside <= least, "a more likely token was left out");
    }

    #[test]
    fn min_p_keeps_tokens_near_the_most_likely_and_ties_go_by_id() {
        let r = [1.0f32, 3.0, 3.0, 2.9, -5.0];
        let only_top = Draw { temperature: 1.0, top_p: 1.0, min_p: 0.99, u: 0.0 };
        assert_eq!(ids(kept(&r, &only_top)), [1, 2]);
        let near = Draw { min_p: 0.5, ..only_top };
        assert_eq!(ids(kept(&r, &near)), [1, 2, 3]);
        // A nucleus that one of two equal tokens fills keeps the smaller id.
        let r = [3.0f32, 3.0, -20.0];
        let d = Draw { temperature: 1.0, top_p: 0.4, min_p: 0.0, u: 0.99 };
        assert_eq!(ids(kept(&r, &d)), [0]);
        assert_eq!(host_draw(&r, &d), 0);
    }

    #[test]
    fn draws_follow_the_kept_distribution() {
        let r = row(64, 9);
        let d = Draw { temperature: 1.3, top_p: 0.8, min_p: 0.05, u: 0.0 };
        let keep = ids(kept(&r, &d));
        let p = probs(&r, 1.3);
        let kept_mass: f64 = keep.iter().map(|&c| p[c]).sum();
        let n = 20_000;
        let mut counts = vec![0usize; r.len()];
        for i in 0..n {
            counts[host_draw(&r, &Draw { u: (i as f32 + 0.5) / n as f32, ..d })] += 1;
        }
        for c in 0..r.len() {
            let want = if keep.contains(&c) { p[c] / kept_mass * n as f64 } else { 0.0 };
            assert!(
                (counts[c] as f64 - want).abs() <= 2.0,
                "token {c}: {} draws, {want:.1} expected",
                counts[c]
            );
        }
    }
}
