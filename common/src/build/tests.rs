use super::*;
use crate::cluster::{decode, encode, ModelSpec};
use crate::rollout::Outcome;

/// A spec as the version before typed builds wrote it: a canary and a past revision.
const TODAYS_RECORD: &str = r#"{"name":"m","model_dir":"/models/v1","dtype":"bf16","device":"cuda",
  "weight_bytes_per_rank":1024,"tp":2,"pp":1,"ep":2,"replicas":3,
  "limits":{"max_num_seqs":8,"max_batched_tokens":0,"kv_cache_bytes":4096,"max_waiting":0},
  "generation":4,"created_ms":11,
  "rollout":{"canary":{"revision":{"generation":5,"model_dir":"/models/v2","dtype":"","device":"",
      "weight_bytes_per_rank":0,"tp":2,"pp":2,"ep":1,
      "limits":{"max_num_seqs":0,"max_batched_tokens":0,"kv_cache_bytes":0,"max_waiting":0},
      "created_ms":12},"weight_bp":1000,"replicas":1},
    "history":[{"revision":{"generation":3,"model_dir":"/models/v0","dtype":"f32","device":"cpu",
      "weight_bytes_per_rank":0,"tp":1,"pp":1,"ep":1,
      "limits":{"max_num_seqs":0,"max_batched_tokens":0,"kv_cache_bytes":0,"max_waiting":0},
      "created_ms":1},"outcome":"rolled_back","ended_ms":9}]}}"#;

#[test]
fn records_in_todays_format_load_typed_and_write_back_the_same_fields() {
    let spec: ModelSpec = decode("k", TODAYS_RECORD.as_bytes()).unwrap();
    assert_eq!(spec.build.dtype, Some(DType::BF16));
    assert_eq!(spec.build.device, Some(DeviceKind::Cuda));
    assert_eq!((spec.build.tp, spec.build.pp, spec.build.ep, spec.replicas), (2, 1, 2, 3));
    assert_eq!((spec.build.limits.max_num_seqs, spec.build.limits.kv_cache_bytes), (8, 4096));
    let canary = spec.rollout.canary.as_ref().unwrap();
    assert_eq!((canary.revision.build.dtype, canary.revision.build.device), (None, None));
    let past = &spec.rollout.history[0];
    assert_eq!(past.revision.build.dtype, Some(DType::F32));
    assert_eq!(past.outcome, Outcome::RolledBack);
    assert!(spec.validate().is_ok());
    let written: serde_json::Value = serde_json::from_slice(&encode(&spec)).unwrap();
    let original: serde_json::Value = serde_json::from_str(TODAYS_RECORD).unwrap();
    assert_eq!(written, original, "an older coordinator reads what this one writes");
}

#[test]
fn records_from_before_devices_and_ep_load_with_defaults() {
    let old = r#"{"name":"m","model_dir":"/d","tp":1,"pp":1,"replicas":1}"#;
    let spec: ModelSpec = decode("k", old.as_bytes()).unwrap();
    assert_eq!((spec.build.dtype, spec.build.device, spec.build.ep), (None, None, 1));
    assert!(spec.build.runs_on(DeviceKind::Cpu) && spec.build.runs_on(DeviceKind::Cuda));
}

#[test]
fn a_record_with_an_unknown_dtype_or_device_is_an_error_naming_it() {
    for (field, value) in [("dtype", "int4"), ("device", "tpu")] {
        let bad =
            format!(r#"{{"name":"m","model_dir":"/d","tp":1,"pp":1,"replicas":1,"{field}":"{value}"}}"#);
        let e = decode::<ModelSpec>("/s/models/m", bad.as_bytes()).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("/s/models/m"), "{e}");
    }
}

fn build() -> Build {
    Build::requested(
        BuildChange { model_dir: Some("/m".into()), ..Default::default() },
        Some(DeviceKind::Cpu),
    )
}

#[test]
fn a_requested_build_takes_defaults_for_what_it_leaves_out() {
    let b = build();
    assert_eq!((b.tp, b.pp, b.ep, b.dtype, b.device), (1, 1, 1, None, Some(DeviceKind::Cpu)));
    assert!(b.validate().is_ok());
    let cuda = Build::requested(
        BuildChange { model_dir: Some("/m".into()), device: Some(DeviceKind::Cuda), ..Default::default() },
        Some(DeviceKind::Cpu),
    );
    assert!(cuda.runs_on(DeviceKind::Cuda) && !cuda.runs_on(DeviceKind::Cpu));
    let ep_alone = Build::requested(BuildChange { ep: 4, ..Default::default() }, None);
    assert_eq!((ep_alone.tp, ep_alone.ep), (4, 4));
    assert!(Build::requested(BuildChange::default(), None)
        .validate()
        .unwrap_err()
        .to_string()
        .contains("model_dir"));
}

#[test]
fn a_change_replaces_only_what_it_sets_and_experts_follow_the_stage() {
    let mut limits = EngineLimits { max_num_seqs: 8, kv_cache_bytes: 1 << 20, ..Default::default() };
    let base = Build { tp: 2, ep: 2, limits: limits.clone(), dtype: Some(DType::BF16), ..build() };
    assert_eq!(base.changed(BuildChange::default()), base, "an empty change is no change");
    let wider = base.changed(BuildChange { tp: 4, ..Default::default() });
    assert_eq!((wider.tp, wider.ep, wider.dtype), (4, 4, Some(DType::BF16)));
    let dense = base.changed(BuildChange { ep: 1, ..Default::default() });
    assert_eq!((dense.tp, dense.ep), (2, 1));
    let staged = base.changed(BuildChange {
        pp: 2,
        limits: EngineLimits { max_batched_tokens: 512, ..Default::default() },
        ..Default::default()
    });
    limits.max_batched_tokens = 512;
    assert_eq!((staged.pp, staged.tp, staged.ep, &staged.limits), (2, 2, 2, &limits));
    let bad = base.changed(BuildChange { tp: 4, ep: 2, ..Default::default() });
    assert!(bad.validate().unwrap_err().to_string().contains("ep"));
}

#[test]
fn a_max_model_len_is_written_only_when_set_and_read_back() {
    let mut spec: ModelSpec = decode("k", TODAYS_RECORD.as_bytes()).unwrap();
    spec.build.limits.max_model_len = 300;
    let written = encode(&spec);
    assert!(String::from_utf8_lossy(&written).contains("\"max_model_len\":300"));
    let back: ModelSpec = decode("k", &written).unwrap();
    assert_eq!(back.build.limits.max_model_len, 300);
    let over = EngineLimits { max_model_len: 100, ..Default::default() };
    assert_eq!(spec.build.limits.overlaid(&over).max_model_len, 100, "a rollout's setting wins");
}

#[test]
fn chat_settings_are_written_only_when_set_and_read_back() {
    let mut spec: ModelSpec = decode("k", TODAYS_RECORD.as_bytes()).unwrap();
    assert!(!String::from_utf8_lossy(&encode(&spec)).contains("chat"), "unset: records as before");
    spec.build.chat = ChatOverrides { template: "{{ x }}".into(), tool_call_parser: "hermes".into() };
    let back: ModelSpec = decode("k", &encode(&spec)).unwrap();
    assert_eq!(back.build.chat, spec.build.chat);
    let big = spec.build.changed(BuildChange {
        chat_template: Some("x".repeat(MAX_CHAT_TEMPLATE + 1)),
        ..Default::default()
    });
    assert!(big.validate().unwrap_err().to_string().contains("chat_template"));
}

/// A deployment's quantization: set, kept by later changes that leave it out, cleared by
/// "none"; int8 on a CUDA deployment and unknown names are refused naming the field; a
/// record without it reads as none and is written without it.
#[test]
fn quantization_is_part_of_a_build() {
    let q = build().changed(BuildChange { quantize: Some("int8".into()), ..Default::default() });
    assert_eq!(q.quantize, "int8");
    assert!(q.validate().is_ok());
    let wider = q.changed(BuildChange { tp: 2, ..Default::default() });
    assert_eq!(wider.quantize, "int8");
    assert_eq!(
        wider.changed(BuildChange { quantize: Some("none".into()), ..Default::default() }).quantize,
        ""
    );
    let cuda = q.changed(BuildChange { device: Some(DeviceKind::Cuda), ..Default::default() });
    assert!(cuda.validate().unwrap_err().to_string().contains("quantize"));
    let odd = build().changed(BuildChange { quantize: Some("int4".into()), ..Default::default() });
    assert!(odd.validate().unwrap_err().to_string().contains("quantize"));
    let plain = serde_json::to_string(&build()).unwrap();
    assert!(!plain.contains("quantize"), "{plain}");
    let back: Build = serde_json::from_str(&plain).unwrap();
    assert_eq!(back.quantize, "");
}
