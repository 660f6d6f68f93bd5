//! admin.v1's `Build` <-> [`Build`]: what a deploy or rollout asks for, and what a status
//! reports. Clients from before `Build` send flat fields (dtype and device as text); a
//! request without `build` is read from those, and every status fills both.

use strata_common::wire::{data_type_from_pb, data_type_to_pb, device_kind_from_pb, device_kind_to_pb};
use strata_common::{Build, BuildChange, DType, DeviceKind, EngineLimits, Result};
use strata_proto::admin::v1 as pb;

pub(super) fn limits_from_pb(l: pb::SchedulerLimits) -> EngineLimits {
    EngineLimits {
        max_num_seqs: l.max_num_seqs,
        max_batched_tokens: l.max_batched_tokens,
        kv_cache_bytes: l.kv_cache_bytes,
        max_waiting: l.max_waiting,
        max_model_len: l.max_model_len,
    }
}

pub(super) fn limits_to_pb(l: &EngineLimits) -> pb::SchedulerLimits {
    pb::SchedulerLimits {
        max_num_seqs: l.max_num_seqs,
        max_batched_tokens: l.max_batched_tokens,
        kv_cache_bytes: l.kv_cache_bytes,
        max_waiting: l.max_waiting,
        max_model_len: l.max_model_len,
    }
}

pub(super) fn build_to_pb(b: &Build) -> pb::Build {
    pb::Build {
        model_dir: b.model_dir.clone(),
        dtype: data_type_to_pb(b.dtype).into(),
        device: device_kind_to_pb(b.device).into(),
        tp: b.tp,
        pp: b.pp,
        ep: b.ep,
        scheduler: Some(limits_to_pb(&b.limits)),
        chat_template: b.chat.template.clone(),
        tool_call_parser: b.chat.tool_call_parser.clone(),
        quantize: b.quantize.clone(),
    }
}

/// A request's chat field: None when empty (unchanged), Some("") for the one space that
/// asks for the model's own back.
fn chat_field(v: &str) -> Option<String> {
    match v {
        "" => None,
        " " => Some(String::new()),
        v => Some(v.to_string()),
    }
}

/// Refuses a chat template that does not compile or a tool-call format not known,
/// naming the field.
fn check_chat(change: &BuildChange) -> Result<()> {
    if let Some(t) = change.chat_template.as_ref().filter(|t| !t.is_empty()) {
        if t.len() > strata_common::build::MAX_CHAT_TEMPLATE {
            return Err(strata_common::Error::invalid(
                "chat_template",
                format!("{} bytes; at most {}", t.len(), strata_common::build::MAX_CHAT_TEMPLATE),
            ));
        }
        crate::request::chat::ChatTemplate::new(vec![("default".into(), t.clone())], Default::default())
            .map_err(|e| strata_common::Error::invalid("chat_template", e.to_string()))?;
    }
    if let Some(p) = change.tool_call_parser.as_ref().filter(|p| !p.is_empty()) {
        if crate::request::tools::ToolFormat::parse(p).is_none() {
            return Err(strata_common::Error::invalid(
                "tool_call_parser",
                format!("{p:?}: give hermes, llama3_json, mistral, deepseek_v3 or openai"),
            ));
        }
    }
    Ok(())
}

/// A request's typed `build` as a change.
fn change_from_pb(b: &pb::Build) -> Result<BuildChange> {
    Ok(BuildChange {
        model_dir: (!b.model_dir.is_empty()).then(|| b.model_dir.clone()),
        dtype: data_type_from_pb(b.dtype)?,
        device: device_kind_from_pb(b.device)?,
        tp: b.tp,
        pp: b.pp,
        ep: b.ep,
        limits: limits_from_pb(b.scheduler.unwrap_or_default()),
        chat_template: chat_field(&b.chat_template),
        tool_call_parser: chat_field(&b.tool_call_parser),
        quantize: quantize_field(&b.quantize)?,
    })
}

/// A request's quantize field: None when empty (unchanged), "none" or "int8" otherwise.
fn quantize_field(v: &str) -> Result<Option<String>> {
    match v {
        "" => Ok(None),
        "none" | "int8" => Ok(Some(v.to_string())),
        other => {
            let shown: String = other.chars().take(32).collect();
            Err(strata_common::Error::invalid("quantize", format!("{shown:?}: give int8 or none")))
        }
    }
}

/// The flat build fields of a request from a client that predates `Build`.
pub(super) struct Flat<'a> {
    pub model_dir: &'a str,
    pub dtype: &'a str,
    pub device: &'a str,
    pub tp: u32,
    pub pp: u32,
    pub ep: u32,
    pub scheduler: Option<pb::SchedulerLimits>,
}

impl Flat<'_> {
    fn change(&self) -> Result<BuildChange> {
        let text = |t: &str| (!t.is_empty()).then(|| t.to_string());
        Ok(BuildChange {
            model_dir: text(self.model_dir),
            dtype: text(self.dtype).map(|t| DType::parse(&t)).transpose()?,
            device: text(self.device).map(|t| DeviceKind::parse(&t)).transpose()?,
            tp: self.tp,
            pp: self.pp,
            ep: self.ep,
            limits: limits_from_pb(self.scheduler.unwrap_or_default()),
            chat_template: None,
            tool_call_parser: None,
            quantize: None,
        })
    }
}

/// What a request asks to change: its `build` when it has one, else its flat fields.
/// A dtype or device this coordinator does not know is an error naming the field.
pub(super) fn requested(build: Option<&pb::Build>, flat: Flat<'_>) -> Result<BuildChange> {
    let change = match build {
        Some(b) => change_from_pb(b)?,
        None => flat.change()?,
    };
    check_chat(&change)?;
    Ok(change)
}

pub(super) fn deploy_flat(r: &pb::DeployModelRequest) -> Flat<'_> {
    Flat {
        model_dir: &r.model_dir,
        dtype: &r.dtype,
        device: &r.device,
        tp: r.tp,
        pp: r.pp,
        ep: r.ep,
        scheduler: r.scheduler,
    }
}

pub(super) fn rollout_flat(r: &pb::StartRolloutRequest) -> Flat<'_> {
    Flat {
        model_dir: &r.model_dir,
        dtype: &r.dtype,
        device: &r.device,
        tp: r.tp,
        pp: r.pp,
        // Clients from before `Build` could not change expert parallelism in a rollout.
        ep: 0,
        scheduler: r.scheduler,
    }
}

/// The build fields of a request as the audit log keeps them.
pub(super) fn describe(build: Option<&pb::Build>, flat: Flat<'_>) -> String {
    let (dtype, device) = match build {
        Some(b) => (
            pb::DataType::try_from(b.dtype).map_or("?", |d| d.as_str_name()).to_string(),
            pb::DeviceKind::try_from(b.device).map_or("?", |d| d.as_str_name()).to_string(),
        ),
        None => (flat.dtype.to_string(), flat.device.to_string()),
    };
    let (dir, tp, pp, ep) = match build {
        Some(b) => (b.model_dir.as_str(), b.tp, b.pp, b.ep),
        None => (flat.model_dir, flat.tp, flat.pp, flat.ep),
    };
    let mut out = format!("model_dir={dir} dtype={dtype} device={device} tp={tp} pp={pp} ep={ep}");
    if let Some(b) = build.filter(|b| !b.chat_template.is_empty() || !b.tool_call_parser.is_empty()) {
        // The template by size only: the log keeps what changed, not a copy of it.
        out.push_str(&format!(
            " chat_template_bytes={} tool_call_parser={}",
            b.chat_template.trim().len(),
            b.tool_call_parser.trim()
        ));
    }
    if let Some(q) = build.map(|b| b.quantize.as_str()).filter(|q| !q.is_empty()) {
        out.push_str(&format!(" quantize={q}"));
    }
    out
}

/// The flat fields of a status, for clients from before `Build`.
pub(super) struct FlatStatus {
    pub model_dir: String,
    pub dtype: String,
    pub device: String,
    pub scheduler: Option<pb::SchedulerLimits>,
}

pub(super) fn flat_status(b: &Build) -> FlatStatus {
    FlatStatus {
        model_dir: b.model_dir.clone(),
        dtype: b.dtype.map_or("", DType::as_str).to_string(),
        device: b.device.map_or("", DeviceKind::as_str).to_string(),
        scheduler: Some(limits_to_pb(&b.limits)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_and_flat_requests_ask_for_the_same_build() {
        let typed = pb::Build {
            model_dir: "/m".into(),
            dtype: pb::DataType::Bf16.into(),
            device: pb::DeviceKind::Cuda.into(),
            tp: 2,
            pp: 1,
            ep: 2,
            scheduler: Some(pb::SchedulerLimits { max_num_seqs: 4, ..Default::default() }),
            ..Default::default()
        };
        let flat = pb::DeployModelRequest {
            model_dir: "/m".into(),
            dtype: "BF16".into(),
            device: "cuda".into(),
            tp: 2,
            pp: 1,
            ep: 2,
            scheduler: Some(pb::SchedulerLimits { max_num_seqs: 4, ..Default::default() }),
            ..Default::default()
        };
        let a = requested(Some(&typed), deploy_flat(&flat)).unwrap();
        let b = requested(None, deploy_flat(&flat)).unwrap();
        assert_eq!(a, b);
        let build = Build::requested(a, None);
        assert_eq!(build_to_pb(&build), typed, "a build reports what was asked");
        let f = flat_status(&build);
        assert_eq!((f.dtype.as_str(), f.device.as_str()), ("bf16", "cuda"));
    }

    #[test]
    fn unknown_dtypes_and_devices_are_errors_naming_the_field() {
        let bad = pb::Build { dtype: 9, ..Default::default() };
        let e = requested(Some(&bad), deploy_flat(&Default::default())).unwrap_err().to_string();
        assert!(e.contains("build.dtype"), "{e}");
        let bad = pb::Build { device: 9, ..Default::default() };
        let e = requested(Some(&bad), deploy_flat(&Default::default())).unwrap_err().to_string();
        assert!(e.contains("build.device"), "{e}");
        let flat = pb::DeployModelRequest { device: "tpu".into(), ..Default::default() };
        let e = requested(None, deploy_flat(&flat)).unwrap_err().to_string();
        assert!(e.contains("device"), "{e}");
        let flat = pb::DeployModelRequest { dtype: "int4".into(), ..Default::default() };
        assert!(requested(None, deploy_flat(&flat)).unwrap_err().to_string().contains("dtype"));
    }

    #[test]
    fn a_deployments_chat_settings_are_checked_kept_and_reset() {
        let ask = |template: &str, parser: &str| {
            let b = pb::Build {
                chat_template: template.into(),
                tool_call_parser: parser.into(),
                ..Default::default()
            };
            requested(Some(&b), deploy_flat(&Default::default()))
        };
        for (template, parser, field) in [
            ("{% if %}", "", "chat_template"),
            ("{{ messages }}", "xml", "tool_call_parser"),
            (&"x".repeat(strata_common::build::MAX_CHAT_TEMPLATE + 1), "", "chat_template"),
        ] {
            let e = ask(template, parser).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        let first = Build::requested(ask("{{ messages }}", "hermes").unwrap(), None);
        assert_eq!(
            (first.chat.template.as_str(), first.chat.tool_call_parser.as_str()),
            ("{{ messages }}", "hermes")
        );
        assert_eq!(build_to_pb(&first).chat_template, "{{ messages }}");
        let kept = first.changed(ask("", "").unwrap());
        assert_eq!(kept.chat, first.chat, "empty fields leave them as they were");
        let reset = first.changed(ask(" ", " ").unwrap());
        assert!(reset.chat.is_empty(), "one space goes back to the model's own");
    }
}
