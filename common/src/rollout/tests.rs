use super::*;
use crate::build::{Build, EngineLimits};
use crate::cluster::ModelSpec;
use crate::device::DeviceKind;

fn spec() -> ModelSpec {
    ModelSpec {
        name: "m".into(),
        build: Build {
            model_dir: "/models/v1".into(),
            dtype: None,
            device: Some(DeviceKind::Cpu),
            tp: 1,
            pp: 1,
            ep: 1,
            limits: EngineLimits::default(),
            chat: Default::default(),
            quantize: String::new(),
        },
        weight_bytes_per_rank: 0,
        replicas: 2,
        generation: 1,
        created_ms: 0,
        rollout: Rollout::default(),
    }
}

fn rev(dir: &str) -> Revision {
    Revision::of(Build { model_dir: dir.into(), ..spec().build }, 0)
}

#[test]
fn a_canary_gets_a_new_number_and_its_own_build_spec() {
    let mut s = spec();
    let g = s.start_canary(rev("/models/v2"), 1000, 1).unwrap();
    assert_eq!(g, 2);
    assert!(s.validate().is_ok());
    let c = s.canary_spec().unwrap();
    assert_eq!((c.build.model_dir.as_str(), c.generation, c.replicas), ("/models/v2", 2, 1));
    assert_eq!(s.build_spec(1).unwrap().build.model_dir, "/models/v1");
    assert!(s.build_spec(7).is_none());
    let e = s.start_canary(rev("/models/v3"), 1000, 1).unwrap_err().to_string();
    assert!(e.contains("revision 2 in canary"), "{e}");
    let e = s.redeploy(rev("/models/v3")).unwrap_err().to_string();
    assert!(e.contains("promote or roll it back"), "{e}");
    assert!(spec().start_canary(rev("/models/v1"), 1000, 1).is_err(), "the serving build is no canary");
    assert!(s.set_canary_weight(10_001).is_err());
    s.set_canary_weight(5000).unwrap();
    assert_eq!(s.rollout.canary.as_ref().unwrap().weight_bp, 5000);
}

#[test]
fn promote_serves_the_canary_and_keeps_the_old_revision_in_history() {
    let mut s = spec();
    s.start_canary(rev("/models/v2"), 1000, 1).unwrap();
    assert_eq!(s.promote().unwrap(), (1, 2));
    assert_eq!((s.build.model_dir.as_str(), s.generation, s.replicas), ("/models/v2", 2, 2));
    assert!(s.rollout.canary.is_none());
    assert_eq!(s.rollout.history.len(), 1);
    assert_eq!(s.rollout.history[0].outcome, Outcome::Replaced);
    assert!(s.promote().is_err(), "nothing left to promote");
    // Rolling back now returns to revision 1, under its own number.
    assert_eq!(s.rollback().unwrap(), RolledBack::Serving { from: 2, to: 1 });
    assert_eq!((s.build.model_dir.as_str(), s.generation), ("/models/v1", 1));
    assert_eq!(s.rollout.history.last().unwrap().outcome, Outcome::RolledBack);
    // Revision 2 was rolled back, not replaced: there is nothing further to return to.
    assert!(s.rollback().is_err());
    // The next revision never reuses a number.
    s.start_canary(rev("/models/v3"), 1000, 1).unwrap();
    assert_eq!(s.rollout.canary.as_ref().unwrap().revision.generation, 3);
}

#[test]
fn rolling_back_a_canary_leaves_the_serving_revision_alone() {
    let mut s = spec();
    s.start_canary(rev("/models/v2"), 1000, 1).unwrap();
    let before = s.revision();
    assert_eq!(s.rollback().unwrap(), RolledBack::Canary(2));
    assert_eq!(s.revision(), before);
    assert_eq!(s.rollout.history[0].revision.generation, 2);
}

#[test]
fn redeploys_make_revisions_only_when_the_build_changes() {
    let mut s = spec();
    s.redeploy(Revision { weight_bytes_per_rank: 5, ..rev("/models/v1") }).unwrap();
    assert_eq!((s.generation, s.weight_bytes_per_rank, s.rollout.history.len()), (1, 5, 0));
    s.redeploy(rev("/models/v2")).unwrap();
    assert_eq!((s.generation, s.rollout.history.len()), (2, 1));
    for i in 0..2 * MAX_HISTORY {
        s.redeploy(rev(&format!("/models/x{i}"))).unwrap();
    }
    assert_eq!(s.rollout.history.len(), MAX_HISTORY, "history is bounded");
}

#[test]
fn stored_rollouts_are_checked() {
    let mut s = spec();
    s.start_canary(rev("/models/v2"), 1000, 1).unwrap();
    s.rollout.canary.as_mut().unwrap().revision.build.tp = 0;
    assert!(s.validate().unwrap_err().to_string().contains("tp"));
    let mut s = spec();
    s.start_canary(rev("/models/v2"), 1000, 1).unwrap();
    s.rollout.canary.as_mut().unwrap().weight_bp = 20_000;
    assert!(s.validate().is_err());
    // Specs written before rollouts existed still read.
    let old = r#"{"name":"m","model_dir":"/d","tp":1,"pp":1,"replicas":1,"generation":3}"#;
    let s: ModelSpec = serde_json::from_str(old).unwrap();
    assert!(s.rollout.is_empty() && s.validate().is_ok());
}

#[test]
fn percentages_parse_to_basis_points() {
    assert_eq!(parse_percent("10%").unwrap(), 1000);
    assert_eq!(parse_percent("2.5").unwrap(), 250);
    assert_eq!(parse_percent("100%").unwrap(), 10_000);
    assert!(parse_percent("150%").unwrap_err().to_string().contains("canary_percent"));
    assert!(parse_percent("ten").is_err());
}
