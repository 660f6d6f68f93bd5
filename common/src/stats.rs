//! Summaries of measured samples, one definition for every benchmark and report.

/// The `p`-th quantile (0 ≤ p ≤ 1) by nearest rank of `v`; NaN for no samples.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize]
}

/// The median of `v`; NaN for no samples.
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

/// The mean of `v`; NaN for no samples.
pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(median(&v), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 5.0);
        assert_eq!(percentile(&v, 0.9), 5.0);
        assert_eq!(mean(&v), 3.0);
        assert!(median(&[]).is_nan());
    }
}
