//! Each sampling parameter's effect, on hand-made logits.

use super::*;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { seed: Some(7), ..Default::default() };
    f(&mut p);
    p
}

fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(p, &[]);
    (0..n).map(|_| s.sample(logits, None).0).collect()
}

const LOGITS: [f32; 6] = [1.0, 3.0, 2.5, -1.0, 0.5, 2.9];

#[test]
fn greedy_takes_the_first_maximum() {
    assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
    assert_eq!(draws(params(|_| {}), &LOGITS, 3), vec![1, 1, 1]);
}

#[test]
fn top_k_one_equals_greedy() {
    let got = draws(
        params(|p| {
            p.temperature = 5.0;
            p.top_k = 1
        }),
        &LOGITS,
        50,
    );
    assert!(got.iter().all(|&t| t == 1), "{got:?}");
}

#[test]
fn top_k_limits_the_candidates() {
    let got = draws(
        params(|p| {
            p.temperature = 10.0;
            p.top_k = 3
        }),
        &LOGITS,
        400,
    );
    assert!(got.iter().all(|t| [1, 2, 5].contains(t)), "{got:?}");
    for t in [1, 2, 5] {
        assert!(got.contains(&t), "token {t} never drawn among the top 3");
    }
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    // Probabilities after softmax: token 1 ≈ 0.37, 5 ≈ 0.33, 2 ≈ 0.22 ...
    let got = draws(
        params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.6
        }),
        &LOGITS,
        400,
    );
    assert!(got.iter().all(|t| [1, 5].contains(t)), "{got:?}");
    assert!(got.contains(&1) && got.contains(&5));
}

#[test]
fn min_p_drops_unlikely_tokens() {
    // min_p 0.7: keeps tokens with p >= 0.7 * p(token 1): tokens 1 and 5 only.
    let got = draws(
        params(|p| {
            p.temperature = 1.0;
            p.min_p = 0.7
        }),
        &LOGITS,
        400,
    );
    assert!(got.iter().all(|t| [1, 5].contains(t)), "{got:?}");
}

#[test]
fn a_seed_reproduces_and_different_seeds_differ() {
    let p = params(|p| p.temperature = 1.5);
    let a = draws(p.clone(), &LOGITS, 100);
    assert_eq!(a, draws(p.clone(), &LOGITS, 100));
    let b = draws(SamplingParams { seed: Some(8), ..p }, &LOGITS, 100);
    assert_ne!(a, b);
}

#[test]
fn draws_follow_the_tempered_softmax() {
    for t in [0.2f32, 1.0, 5.0] {
        let z: f32 = LOGITS.iter().map(|l| (l / t).exp()).sum();
        let want = (LOGITS[1] / t).exp() / z;
        let n = 4000;
        let got = draws(params(|p| p.temperature = t), &LOGITS, n).iter().filter(|&&x| x == 1).count() as f32
            / n as f32;
        assert!((got - want).abs() < 0.03, "T={t}: token 1 drawn {got}, expected {want}");
    }
}

#[test]
fn repetition_penalty_follows_hf() {
    // Prompt holds token 1 (positive logit, divided) and token 3 (negative, multiplied).
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 2.0), &[1, 3]);
    let mut l = LOGITS.to_vec();
    s.apply_penalties(&mut l);
    assert_eq!(l[1], 1.5);
    assert_eq!(l[3], -2.0);
    assert_eq!(l[5], 2.9);
    assert_eq!(s.sample(&LOGITS, None).0, 5, "the penalised token loses to the runner-up");
}

#[test]
fn presence_and_frequency_penalties_count_output_tokens() {
    let mut s = Sampler::new(
        params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25
        }),
        &[5],
    );
    assert_eq!(s.sample(&LOGITS, None).0, 1); // prompt tokens are not penalised
    let mut l = LOGITS.to_vec();
    s.apply_penalties(&mut l);
    assert_eq!(l[1], 3.0 - 0.75);
    assert_eq!(l[5], 2.9);
    assert_eq!(s.sample(&LOGITS, None).0, 5);
    s.apply_penalties(&mut l);
}

#[test]
fn logprobs_are_log_softmax_of_raw_logits() {
    let lp = logprobs(&LOGITS, 2, 3);
    let z: f64 = LOGITS.iter().map(|&l| (l as f64).exp()).sum();
    assert!((lp.logprob as f64 - (2.5 - z.ln())).abs() < 1e-5);
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 5, 2]);
    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    let mut s = Sampler::new(params(|p| p.logprobs = Some(2)), &[]);
    let (_, got) = s.sample(&LOGITS, None);
    assert_eq!(got.unwrap().top.len(), 2);
}

#[test]
fn a_resumed_sampler_continues_the_same_stream() {
    // A seeded, penalised generation split after 7 tokens and resumed elsewhere produces
    // exactly the tokens of the uninterrupted one.
    let p = params(|p| {
        p.temperature = 1.3;
        p.top_p = 0.9;
        p.frequency_penalty = 0.4;
        p.repetition_penalty = 1.2;
    });
    let prompt = [4u32, 0];
    let logits = |i: usize| -> Vec<f32> { LOGITS.iter().map(|l| l + (i % 3) as f32 * 0.1).collect() };
    let mut whole = Sampler::new(p.clone(), &prompt);
    let all: Vec<u32> = (0..20).map(|i| whole.sample(&logits(i), None).0).collect();
    let mut resumed = Sampler::resume(p, &prompt, &all[..7]);
    let rest: Vec<u32> = (7..20).map(|i| resumed.sample(&logits(i), None).0).collect();
    assert_eq!(rest, all[7..].to_vec());
}

#[test]
fn candidates_suffice_exactly_when_the_sampler_says_so() {
    use crate::backend::host_logits::host_top;
    assert_eq!(Sampler::new(params(|_| {}), &[]).candidates_needed(), Some(0), "greedy: a pick");
    let with = |f: fn(&mut SamplingParams)| Sampler::new(params(f), &[]).candidates_needed();
    assert_eq!(with(|p| p.logprobs = Some(5)), Some(5), "greedy with top logprobs");
    assert_eq!(with(|p| (p.temperature, p.top_k) = (1.0, 10)), Some(18), "top-k, with room for ties");
    assert_eq!(with(|p| (p.temperature, p.top_p) = (1.0, 0.9)), None, "top-p alone needs the row");
    assert_eq!(with(|p| (p.temperature, p.top_k) = (1.0, 500)), None, "k beyond MAX_TOP");
    assert_eq!(with(|p| p.repetition_penalty = 1.2), None, "penalties move the logits");
    assert_eq!(with(|p| p.presence_penalty = 0.5), None);
    // Where they suffice, drawing from them is drawing from the whole row: same stream,
    // same tokens, same logprobs. Rows with ties and a flat tail.
    let vocab = 257;
    for (top_k, top_p, min_p, t) in
        [(10, 1.0, 0.0, 1.0), (40, 0.7, 0.0, 0.6), (7, 0.95, 0.1, 1.3), (64, 1.0, 0.0, 2.0)]
    {
        let p = params(|p| {
            (p.temperature, p.top_k, p.top_p, p.min_p) = (t, top_k, top_p, min_p);
            p.seed = Some(3);
            p.logprobs = Some(2);
        });
        let (mut whole, mut cands) = (Sampler::new(p.clone(), &[]), Sampler::new(p, &[]));
        let k = cands.candidates_needed().unwrap();
        for r in 0..200u32 {
            let row: Vec<f32> =
                (0..vocab).map(|i| ((i as u32 * 7919 + r * 104729) % 61) as f32 * 0.1 - 3.0).collect();
            let c = host_top(&row, 1, vocab, k, 0).remove(0);
            assert_eq!(cands.take(&c), whole.sample(&row, None), "top_k {top_k}, row {r}");
        }
    }
}

#[test]
fn host_picks_agree_with_the_sampler() {
    let row = [0.5f32, 2.0, -1.0, 2.0, 1.5];
    let p = crate::backend::host_logits::host_picks(&row, 1, 5, 0)[0];
    assert_eq!(p.token, argmax(&row));
    assert_eq!(p.token, 1, "the first of equal logits");
    let lp = logprobs(&row, p.token, 0);
    assert!((p.logprob() - lp.logprob).abs() < 1e-6);
}

#[test]
fn the_top_tokens_come_in_the_samplers_order() {
    let r = [0.5f32, 2.0, -1.0, 2.0, 1.5];
    let c = &crate::backend::host_logits::host_top(&r, 1, 5, 3, 10)[0];
    assert_eq!(c.top, [(11, 2.0), (13, 2.0), (14, 1.5)], "ties: the smaller id first");
    let lp = logprobs(&r, 1, 0);
    assert!((2.0 - c.log_z - lp.logprob).abs() < 1e-6);
    assert_eq!(
        crate::backend::host_logits::host_top(&r, 1, 5, 9, 0)[0].top.len(),
        5,
        "k beyond the row: all of it"
    );
}

#[test]
fn a_mask_reads_only_allowed_tokens_with_the_result_of_masking_the_whole_row() {
    use crate::guide::TokenMask;
    let row: Vec<f32> = (0..1000u32).map(|i| ((i * 7919) % 997) as f32 * 0.01 - 5.0).collect();
    let allowed = [3u32, 10, 500, 501, 998];
    let mask = TokenMask::from_ids(row.len(), &allowed);
    let mut masked = row.clone();
    mask.apply(&mut masked);
    let cases = [
        SamplingParams { logprobs: Some(2), ..Default::default() },
        SamplingParams { temperature: 0.9, seed: Some(4), ..Default::default() },
        SamplingParams { temperature: 1.2, top_k: 2, top_p: 0.9, seed: Some(5), ..Default::default() },
        SamplingParams { temperature: 0.8, repetition_penalty: 1.3, seed: Some(6), ..Default::default() },
    ];
    for p in cases {
        let (mut a, mut b) = (Sampler::new(p.clone(), &[500]), Sampler::new(p.clone(), &[500]));
        for step in 0..20 {
            let (ta, la) = a.sample(&row, Some(&mask));
            assert!(allowed.contains(&ta), "{p:?}: {ta}");
            // The reference: the whole row masked, drawn as an unmasked row is drawn.
            let mut reference = masked.clone();
            b.apply_penalties(&mut reference);
            let tb = if p.is_greedy() {
                argmax(&reference)
            } else {
                b.draw(
                    reference
                        .iter()
                        .enumerate()
                        .filter(|x| *x.1 > f32::NEG_INFINITY)
                        .map(|(i, &l)| (i as u32, l))
                        .collect(),
                )
            };
            b.record(tb);
            assert_eq!(ta, tb, "{p:?}, step {step}");
            if let Some(l) = la {
                assert_eq!(l.top.len(), 2, "logprobs are the raw row's");
            }
        }
    }
}
