//! Prompt logprobs through a real `strata serve`: EleutherAI's lm-evaluation-harness scores
//! log-likelihoods with `echo` + `logprobs` and its remote tokenizer, equal to what HF
//! transformers computes on the same fixture model (tests/python/lm_eval_loglikelihood.py,
//! tests/fixtures/lm_eval); every shape of them (the echoed prompt, vLLM's
//! `prompt_logprobs`, streamed, chat, gRPC) carries the same numbers.

use serde_json::{json, Value as Json};
use strata_proto::inference::v1 as pb;
use strata_proto::inference::v1::inference_client::InferenceClient;
use strata_tests::http::{post, request, sse_data};
use strata_tests::{fixtures_dir, ids, reference};

use super::http_api::{chat_model, serve_http};
use super::structured::python_with;

const KEY: &str = "sk-eval";

#[tokio::test(flavor = "multi_thread")]
async fn lm_evals_log_likelihoods_equal_hf_transformers() {
    let model = fixtures_dir().join("llama_gqa");
    let (_server, http) = serve_http(&model, &["--api-key", KEY]);
    let reference = fixtures_dir().join("../lm_eval/reference_llama_gqa.json");
    let args = vec![format!("http://{http}/v1"), "m".into(), KEY.into(), reference.display().to_string()];
    let stdout = python_with("lm_eval_loglikelihood.py", args).await;
    assert!(stdout.contains("2 passed"), "{stdout}");
}

/// The logprobs of a vLLM `prompt_logprobs` list (null first), with each entry's prompt
/// token checked against `prompt`.
fn listed(v: &Json, prompt: &[u32], top: usize) -> Vec<f64> {
    let list = v.as_array().unwrap_or_else(|| panic!("a list: {v}"));
    assert_eq!(list.len(), prompt.len());
    assert!(list[0].is_null(), "the first prompt token has none");
    list[1..]
        .iter()
        .zip(&prompt[1..])
        .map(|(entry, id)| {
            let e = &entry[id.to_string()];
            let rank = e["rank"].as_u64().unwrap_or(0);
            assert!(rank >= 1, "{entry}");
            let m = entry.as_object().unwrap();
            assert!(m.len() <= top + 1 && m.len() >= top.min(1), "{entry}");
            assert!(m.values().all(|x| x["decoded_token"].is_string()));
            e["logprob"].as_f64().unwrap()
        })
        .collect()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_shape_of_prompt_logprobs_carries_the_same_numbers() {
    let model = chat_model("llama_gqa");
    let r = reference(&fixtures_dir().join("llama_gqa"));
    let (server, http) = serve_http(model.path(), &[]);
    let prompt = ids(&r["prompt_ids"]);
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true,
        "echo": true, "logprobs": 2, "prompt_logprobs": 3,
    });
    let (status, v) = post(&http, "/v1/completions", None, &body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let lp = &choice["logprobs"];
    let n = prompt.len();
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n + 3, "{lp}");
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let echoed: Vec<f64> = (1..n).map(|i| lp["token_logprobs"][i].as_f64().unwrap()).collect();
    assert!((1..n + 3).all(|i| lp["top_logprobs"][i].as_object().unwrap().len() <= 2));
    let offsets: Vec<u64> =
        lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let from_list = listed(&choice["prompt_logprobs"], &prompt, 3);
    close(&echoed, &from_list);
    assert!(echoed.iter().all(|x| *x < 0.0 && x.is_finite()));

    // Streamed: the echoed prompt's event carries them, and vLLM's list once.
    let stream = json!({"stream": true, "max_tokens": 2});
    let mut streamed = body.clone();
    streamed.as_object_mut().unwrap().extend(stream.as_object().unwrap().clone());
    let (status, text) = request(&http, "POST", "/v1/completions", None, Some(&streamed)).unwrap();
    assert_eq!(status, 200, "{text}");
    let events: Vec<Json> =
        sse_data(&text).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let first = &events[0]["choices"][0];
    let head: Vec<f64> = (1..n).map(|i| first["logprobs"]["token_logprobs"][i].as_f64().unwrap()).collect();
    close(&head, &echoed);
    close(&listed(&first["prompt_logprobs"], &prompt, 3), &echoed);
    assert_eq!(events.iter().filter(|e| !e["choices"][0]["prompt_logprobs"].is_null()).count(), 1);

    // Chat: beside the choices, for the rendered prompt.
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0});
    let (status, c) = post(&http, "/v1/chat/completions", None, &chat);
    assert_eq!(status, 200, "{c}");
    let rendered = c["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(c["prompt_logprobs"].as_array().map(Vec::len), Some(rendered), "{c}");

    // gRPC: the same numbers, unary and streamed.
    let mut g = InferenceClient::connect(server.endpoint()).await.unwrap();
    let req = pb::GenerateRequest {
        model: "m".into(),
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt.clone() })),
        max_tokens: Some(2),
        prompt_logprobs: Some(1),
        ..Default::default()
    };
    let out = g.generate(req.clone()).await.unwrap().into_inner();
    let unary: Vec<f64> = out.prompt_logprobs.iter().map(|l| l.logprob as f64).collect();
    close(&unary, &echoed);
    assert!(out
        .prompt_logprobs
        .iter()
        .zip(&prompt[1..])
        .all(|(l, &t)| l.token_id == t && l.rank >= 1 && l.top.len() == 1));
    let mut s = g.generate_stream(req).await.unwrap().into_inner();
    let m = s.message().await.unwrap().unwrap();
    assert_eq!(m.prompt_logprobs.len(), n - 1, "the first message carries them");
    while let Some(m) = s.message().await.unwrap() {
        assert!(m.prompt_logprobs.is_empty());
    }

    let (status, e) =
        post(&http, "/v1/completions", None, &json!({"model": "m", "prompt": "x", "prompt_logprobs": 21}));
    assert_eq!((status, &e["error"]["param"]), (400, &json!("prompt_logprobs")), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tokenizer_info_and_tokenize_need_no_model_name_when_one_is_served() {
    let model = chat_model("llama_gqa");
    let (_server, http) = serve_http(model.path(), &["--api-key", KEY]);
    assert_eq!(request(&http, "GET", "/tokenizer_info", None, None).unwrap().0, 401, "the key guards it");
    let (status, body) = request(&http, "GET", "/tokenizer_info", Some(KEY), None).unwrap();
    let info: Json = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200, "{info}");
    assert_eq!((info["bos_token"].as_str(), info["eos_token"].as_str()), (Some("<s>"), Some("</s>")));
    assert!(info["chat_template"].as_str().is_some_and(|t| t.contains("im_start")), "{info}");
    assert_eq!(info["model_max_length"], 512);
    let (status, body) = request(&http, "GET", "/tokenizer_info?model=nope", Some(KEY), None).unwrap();
    assert_eq!(status, 404, "{body}");
    let (status, body) = request(&http, "GET", "/tokenizer_info?mdl=m", Some(KEY), None).unwrap();
    assert_eq!(status, 400, "{body}");
    let (status, t) =
        post(&http, "/tokenize", Some(KEY), &json!({"prompt": "</s>", "add_special_tokens": false}));
    assert_eq!((status, &t["tokens"]), (200, &json!([2])), "{t}");
    let (status, d) = post(&http, "/detokenize", Some(KEY), &json!({"tokens": [311, 71]}));
    assert_eq!(status, 200, "{d}");
}
