//! `strata generate` and `strata model random` as a user runs them: the real binary,
//! its JSON contract, sampling flags, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use strata_tests::{fixtures_dir, ids, reference, strata_bin};

fn strata(args: &[&str]) -> Output {
    Command::new(strata_bin()).args(args).env("RUST_LOG", "warn").output().expect("run strata")
}

fn generate_json(args: &[&str]) -> Value {
    let mut all = vec!["generate", "--json"];
    all.extend_from_slice(args);
    let out = strata(&all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "strata {all:?} failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("stdout is not one JSON object ({e}): {:?}", String::from_utf8_lossy(&out.stdout))
    })
}

/// Runs a command expected to fail; returns its stderr after checking it did not panic.
fn failure(args: &[&str]) -> String {
    let out = strata(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "strata {args:?} should fail");
    assert!(!stderr.contains("panicked"), "strata {args:?} panicked: {stderr}");
    stderr
}

fn model(name: &str) -> String {
    fixtures_dir().join(name).to_string_lossy().to_string()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn json_contract_and_greedy_tokens() {
    let dir = fixtures_dir().join("llama_gqa");
    let r = reference(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let want = ids(&r["greedy_ids"]);
    let m = model("llama_gqa");
    let v =
        generate_json(&["--model", &m, "--prompt-ids", &csv(&prompt), "--max-tokens", "32", "--ignore-eos"]);
    assert_eq!(ids(&v["prompt_ids"]), prompt);
    assert_eq!(ids(&v["token_ids"]), want);
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["text"], r["greedy_text"]);
    assert!(v.get("logprobs").is_none(), "logprobs only when asked");

    let v = generate_json(&[
        "--model",
        &m,
        "--prompt-ids",
        &csv(&prompt),
        "--max-tokens",
        "5",
        "--logprobs",
        "3",
    ]);
    let lps = v["logprobs"].as_array().unwrap();
    let tokens = ids(&v["token_ids"]);
    assert_eq!(lps.len(), tokens.len());
    for (lp, &t) in lps.iter().zip(&tokens) {
        assert_eq!(lp["token_id"], t);
        let top = lp["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0][0], t, "greedy picks the most likely token");
        assert!((top[0][1].as_f64().unwrap() - lp["logprob"].as_f64().unwrap()).abs() < 1e-6);
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
    }
}

#[test]
fn text_prompts_use_the_models_tokenizer() {
    for name in ["llama_gqa", "qwen2_bias_tied"] {
        let r = reference(&fixtures_dir().join(name));
        let v = generate_json(&[
            "--model",
            &model(name),
            "--prompt",
            r["text_prompt"].as_str().unwrap(),
            "--max-tokens",
            "4",
        ]);
        assert_eq!(ids(&v["prompt_ids"]), ids(&r["text_prompt_ids"]), "{name}");
    }
}

#[test]
fn stop_strings_cut_the_text_exactly() {
    let m = model("llama_mha_tied");
    let base =
        generate_json(&["--model", &m, "--prompt", "Once upon a time", "--max-tokens", "24", "--ignore-eos"]);
    let text = base["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() > 12, "need some text to cut: {text:?}");
    let (start, end) = (chars[8].0, chars[11].0);
    let stop = &text[start..end];
    let cut = text.find(stop).unwrap();
    let v = generate_json(&[
        "--model",
        &m,
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--stop",
        stop,
    ]);
    assert_eq!(v["text"].as_str().unwrap(), &text[..cut], "stop {stop:?}");
    assert_eq!(v["finish_reason"], "stop");
    assert!(ids(&v["token_ids"]).len() < 24);
}

#[test]
fn stop_token_ids_and_eos_end_generation() {
    let r = reference(&fixtures_dir().join("llama_gqa"));
    let prompt = csv(&ids(&r["prompt_ids"]));
    let want = ids(&r["greedy_ids"]);
    let m = model("llama_gqa");
    let stop_id = want[4];
    let first = want.iter().position(|&t| t == stop_id).unwrap();
    let v = generate_json(&[
        "--model",
        &m,
        "--prompt-ids",
        &prompt,
        "--max-tokens",
        "32",
        "--stop-token-ids",
        &stop_id.to_string(),
    ]);
    assert_eq!(ids(&v["token_ids"]), want[..=first].to_vec());
    assert_eq!(v["finish_reason"], "stop");
    // Without --ignore-eos, the fixture's EOS (id 2) ends generation if it is produced.
    let v = generate_json(&["--model", &m, "--prompt-ids", &prompt, "--max-tokens", "32"]);
    let expect_eos = want.iter().position(|&t| t == 2);
    match expect_eos {
        Some(i) => {
            assert_eq!(ids(&v["token_ids"]), want[..=i].to_vec());
            assert_eq!(v["finish_reason"], "eos");
        }
        None => assert_eq!(v["finish_reason"], "length"),
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = model("llama_gqa");
    let args = |seed: &'static str| -> Vec<&'static str> {
        vec![
            "--prompt-ids",
            "1,5,9,13",
            "--max-tokens",
            "24",
            "--ignore-eos",
            "--temperature",
            "1.5",
            "--seed",
            seed,
        ]
    };
    let run = |seed| {
        let mut a = vec!["--model", m.as_str()];
        a.extend(args(seed));
        ids(&generate_json(&a)["token_ids"])
    };
    let a = run("11");
    assert_eq!(a, run("11"), "same seed, same tokens");
    assert_ne!(a, run("12"), "different seeds should differ over 24 tokens");
    let greedy = ids(&generate_json(&[
        "--model",
        &m,
        "--prompt-ids",
        "1,5,9,13",
        "--max-tokens",
        "24",
        "--ignore-eos",
    ])["token_ids"]);
    let top1 = ids(&generate_json(&[
        "--model",
        &m,
        "--prompt-ids",
        "1,5,9,13",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--temperature",
        "2",
        "--top-k",
        "1",
        "--seed",
        "3",
    ])["token_ids"]);
    assert_eq!(greedy, top1, "top-k 1 is greedy");
}

/// Copies a fixture into a temporary directory so a test can damage it.
fn scratch_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(fixtures_dir().join(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    (tmp, dst)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn gen_fail(dir: &Path, extra: &[&str]) -> String {
    let d = dir.to_string_lossy().to_string();
    let mut a = vec!["generate", "--json", "--model", d.as_str(), "--prompt-ids", "1,2,3"];
    a.extend_from_slice(extra);
    failure(&a)
}

#[test]
fn bad_model_files_get_clear_errors() {
    let e = gen_fail(Path::new("/nonexistent/model"), &[]);
    assert!(e.contains("/nonexistent/model"), "{e}");

    let (_t, dir) = scratch_copy("llama_gqa");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("model.safetensors"), "{e}");

    let (_t, dir) = scratch_copy("llama_gqa");
    edit_config(&dir, |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("GPT2LMHeadModel") && e.contains("config.json"), "{e}");

    let (_t, dir) = scratch_copy("llama_gqa");
    edit_config(&dir, |v| v["intermediate_size"] = serde_json::json!(96));
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("mlp.gate_proj") && e.contains("shape"), "{e}");

    let (_t, dir) = scratch_copy("llama_gqa");
    let st = dir.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&st).unwrap().set_len(len - 1000).unwrap();
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("truncated") && e.contains("model.safetensors"), "{e}");

    // A tensor stored as I32 instead of a float type.
    let (_t, dir) = scratch_copy("llama_gqa");
    let st = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let needle = "\"model.norm.weight\":{\"dtype\":\"F32\"";
    assert!(header.contains(needle), "fixture header layout changed: {header:.200}");
    let header = header.replace(needle, "\"model.norm.weight\":{\"dtype\":\"I32\"");
    bytes.splice(8..8 + n, header.into_bytes());
    std::fs::write(&st, bytes).unwrap();
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");

    let (_t, dir) = scratch_copy("llama_gqa");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("config.json"), "{e}");

    // A zero window once ran, masking every key: NaN logits, not a config error.
    let (_t, dir) = scratch_copy("mistral_window");
    edit_config(&dir, |v| v["sliding_window"] = serde_json::json!(0));
    let e = gen_fail(&dir, &[]);
    assert!(e.contains("sliding_window") && e.contains("positive"), "{e}");

    // A latent rank of 10⁹ once sized a list of row indices (8 GB) before any shape check:
    // under a 2 GiB address-space limit the process died; now the checkpoint's shape answers.
    let (_t, dir) = scratch_copy("deepseek_v3_mla");
    edit_config(&dir, |v| v["kv_lora_rank"] = serde_json::json!(1_000_000_000u64));
    let d = dir.to_string_lossy().to_string();
    let out = Command::new("sh")
        .args(["-c", "ulimit -v 2097152 && exec \"$0\" \"$@\""])
        .arg(strata_bin())
        .args(["generate", "--json", "--model", &d, "--prompt-ids", "1,2,3"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("run strata");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !e.contains("panicked") && !e.contains("memory allocation"), "{e}");
    assert!(e.contains("kv_a_proj_with_mqa") && e.contains("shape"), "{e}");
}

#[test]
fn bad_requests_get_clear_errors() {
    let (_t, dir) = scratch_copy("llama_gqa");
    edit_config(&dir, |v| v["max_position_embeddings"] = serde_json::json!(8));
    let e = gen_fail(&dir, &["--prompt-ids", "1,2,3,4,5,6,7,8,9,10"]);
    assert!(e.contains("prompt") && e.contains("context"), "{e}");

    let m = fixtures_dir().join("llama_gqa");
    let e = gen_fail(&m, &["--temperature", "-1"]);
    assert!(e.contains("temperature"), "{e}");
    let e = gen_fail(&m, &["--top-p", "0"]);
    assert!(e.contains("top_p"), "{e}");
    let e = gen_fail(&m, &["--max-tokens", "0"]);
    assert!(e.contains("max_tokens"), "{e}");
    let e = failure(&["generate", "--model", &m.to_string_lossy(), "--prompt-ids", "1,99999"]);
    assert!(e.contains("99999") && e.contains("vocabulary"), "{e}");
    let e = failure(&["generate", "--model", &m.to_string_lossy(), "--prompt", ""]);
    assert!(e.contains("prompt"), "{e}");
}

#[test]
fn random_models_load_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    // Six layers: Gemma 3's five local and one global, gpt-oss's alternating, DeepSeek's
    // dense first layer and five of experts.
    let archs = [
        ("llama", "f32"),
        ("mistral", "bf16"),
        ("qwen2", "f32"),
        ("gemma3", "bf16"),
        ("gpt-oss", "f32"),
        ("deepseek-v3", "f32"),
    ];
    for (arch, dtype) in archs {
        let out = tmp.path().join(arch);
        let o = strata(&[
            "model",
            "random",
            "--arch",
            arch,
            "--dtype",
            dtype,
            "--layers",
            "6",
            "--out",
            &out.to_string_lossy(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(out.join(f).exists(), "{arch}: {f} missing");
        }
        let v = generate_json(&[
            "--model",
            &out.to_string_lossy(),
            "--prompt",
            "Hello there",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ]);
        assert_eq!(ids(&v["token_ids"]).len(), 8, "{arch}");
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["num_hidden_layers"], 6);
    }
    let e = failure(&["model", "random", "--heads", "5", "--out", &tmp.path().join("bad").to_string_lossy()]);
    assert!(e.contains("heads"), "{e}");
}

#[test]
fn an_unusable_device_is_a_clear_error() {
    // This build or this machine cannot drive a GPU: say which, exit non-zero, no panic.
    let dir = strata_tests::fixtures_dir().join("llama_gqa");
    for device in ["cuda", "cuda:3"] {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", "1,2", "--device", device])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("--device cuda") && !err.contains("panicked"), "{err}");
        assert!(
            err.contains("features cuda") || err.contains("LD_LIBRARY_PATH") || err.contains("device"),
            "{err}"
        );
    }
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["generate", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--device", "tpu"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--device") && err.contains("cuda:N"), "{err}");
}

#[test]
fn gpu_check_runs_its_checks_on_the_cpu_backend() {
    // `strata gpu-check --device cpu` is the GPU check script's dry run: the same commands,
    // the CPU backend standing in for the device.
    let run = |args: &[&str]| {
        let out = std::process::Command::new(strata_tests::strata_bin())
            .args(["gpu-check", "--device", "cpu"])
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let ops = run(&["ops"]);
    assert!(ops.len() >= 12 && ops.iter().all(|r| r["ok"] == true), "{ops:?}");
    let dir = strata_tests::fixtures_dir().join("llama3_rope");
    let tokens = run(&["tokens", "--model", dir.to_str().unwrap()]);
    assert_eq!(tokens[0]["result"]["verdict"], "identical");
    assert_eq!(tokens[0]["matches_hf_reference"], true);
    // The communicator contract, over TCP here (over NCCL on GPUs): groups of 2 and 3.
    let comm = run(&["comm", "--max-world", "3"]);
    assert_eq!(comm.len(), 10, "{comm:?}");
    assert!(comm.iter().all(|r| r["ok"] == true && r["communicator"] == "tcp"), "{comm:?}");
    assert_eq!(comm.last().unwrap()["world"], 3);
    // Decode at batch 1 and in batches, and prefill.
    let args = ["decode", "--model", dir.to_str().unwrap(), "--tokens", "4", "--batches", "2,5"];
    let d = run(&[&args[..], &["--prefill-len", "24", "--kv-cache-mib", "16"]].concat());
    assert!(d[0]["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{d:?}");
    let batches: Vec<u64> =
        d[0]["batched_decode"].as_array().unwrap().iter().map(|b| b["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, [2, 5], "{d:?}");
    assert!(d[0]["batched_decode"][1]["tokens_per_s"].as_f64().unwrap() > 0.0, "{d:?}");
    assert!(d[0]["prefill_tokens_per_s"].as_f64().unwrap() > 0.0, "{d:?}");
    assert_eq!(d[0]["cuda_graphs"], true, "{d:?}");
    assert_eq!(d[0]["graph_steps"], 0, "the CPU backend replays no graphs: {d:?}");
    // The script's second decode: the same steps op by op (the KV cache in serve's spelling).
    let eager = [
        &args[..3],
        &[
            "--tokens",
            "3",
            "--batches",
            "2",
            "--prefill-len",
            "0",
            "--enforce-eager",
            "--kv-cache-memory",
            "16MiB",
        ],
    ]
    .concat();
    let e = run(&eager);
    assert_eq!(e[0]["cuda_graphs"], false, "{e:?}");
    assert!(e[0]["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{e:?}");
}

fn compare_json(args: &[&str]) -> Value {
    let mut all = vec!["model", "compare", "--prompts", "3", "--tokens", "8"];
    all.extend_from_slice(args);
    let out = strata(&all);
    assert!(out.status.success(), "strata {all:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// `strata model compare`: a setting compared with itself agrees on every token and
/// scores the text identically; int8 weights give a rate and a log-likelihood difference
/// that are finite, in range, and consistent with each other.
#[test]
fn model_compare_reports_agreement_and_log_likelihood() {
    let same = compare_json(&["--model", &model("llama_gqa"), "--quantize", "none"]);
    assert_eq!(same["greedy_agreement"], 1.0, "{same}");
    assert_eq!(same["identical_continuations"], 3, "{same}");
    assert_eq!(same["nll_difference_per_token"], 0.0, "{same}");
    let lp = same["reference_mean_logprob"].as_f64().unwrap();
    assert!(lp < 0.0 && lp > -(384f64.ln() * 3.0), "mean log-probability {lp}");
    let ppl = same["reference_perplexity"].as_f64().unwrap();
    assert!((ppl - (-lp).exp()).abs() < 1e-9 * ppl, "{same}");

    let int8 = compare_json(&["--model", &model("llama_gqa"), "--quantize", "int8"]);
    let rate = int8["greedy_agreement"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&rate), "{int8}");
    let diff = int8["nll_difference_per_token"].as_f64().unwrap();
    let (r, c) =
        (int8["reference_mean_logprob"].as_f64().unwrap(), int8["candidate_mean_logprob"].as_f64().unwrap());
    assert!((diff - (r - c)).abs() < 1e-12 && diff != 0.0 && diff.abs() < 0.5, "{int8}");
    assert_eq!(int8["text_tokens"], same["text_tokens"]);

    let err = failure(&["model", "compare", "--model", &model("llama_gqa"), "--quantize", "int4"]);
    assert!(err.contains("--quantize") && err.contains("int4"), "{err}");
}

#[test]
fn gpu_check_runs_the_device_collectives_contract_on_the_cpu() {
    // `strata gpu-check collectives` runs the device-collectives contract over NCCL on GPUs;
    // with `--device cpu`, over CPU tensors staged through the host and TCP.
    let out = std::process::Command::new(strata_tests::strata_bin())
        .args(["gpu-check", "--device", "cpu", "collectives", "--max-world", "3"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let worlds: std::collections::BTreeSet<u64> =
        lines.iter().map(|l| l["world"].as_u64().unwrap()).collect();
    assert_eq!(worlds.into_iter().collect::<Vec<_>>(), [1, 2, 3], "{lines:?}");
    assert!(lines.iter().all(|l| l["ok"] == true), "{lines:?}");
    let checks: Vec<&str> = lines.iter().map(|l| l["check"].as_str().unwrap()).collect();
    assert!(checks.contains(&"all_to_all, uneven counts"), "{checks:?}");
}

/// A model whose weights hold NaN: `strata generate` fails with the engine's error instead
/// of spinning for ever on a sequence the engine had given up on.
#[test]
fn nan_weights_end_generate_with_an_error() {
    let (_tmp, dir) = scratch_copy("llama_gqa");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header["model.layers.0.mlp.down_proj.weight"];
    assert_eq!(t["dtype"], "F32");
    let (start, end) =
        (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
    for v in bytes[8 + n + start..8 + n + end].chunks_exact_mut(4) {
        v.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    let mut child = Command::new(strata_bin())
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,5,9", "--max-tokens", "4"])
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("strata generate still running after 60 s on NaN weights");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(stderr.contains("non-finite"), "{stderr}");
}
