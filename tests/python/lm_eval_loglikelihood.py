#!/usr/bin/env python3
"""EleutherAI's lm-evaluation-harness (`lm_eval`, not written by this project) scoring
log-likelihoods through a running `strata serve --http-listen`, against the scores HF
transformers gives the same fixture model.

Its `local-completions` model sends `echo` + `logprobs` completions of token ids and reads
the echoed prompt's logprobs; its `remote` tokenizer uses the server's `/tokenizer_info`,
`/tokenize` and `/detokenize` (no model named, as with vLLM). Two local tasks
(tests/fixtures/lm_eval): multiple choice (each choice's log-likelihood after its context,
and whether it is the greedy continuation) and rolling log-likelihoods of whole documents
(perplexity). Every score must equal the reference within 1e-3 nats.

Usage:
  lm_eval_loglikelihood.py BASE_URL MODEL API_KEY REFERENCE    check a server
  lm_eval_loglikelihood.py --reference MODEL_DIR REFERENCE     write the reference with HF
                                                               transformers (torch needed)
Exits non-zero with the reason on the first failure; prints "N passed" at the end.
"""
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from checks import PASSED, check  # noqa: E402

TASKS = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "lm_eval"
TOLERANCE = 1e-3


def task_dir(into):
    """The two tasks' YAML, reading the committed documents."""
    choices = f"""task: strata_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "choices.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
    rolling = f"""task: strata_documents
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASKS / "documents.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""
    (into / "strata_choices.yaml").write_text(choices)
    (into / "strata_documents.yaml").write_text(rolling)
    return str(into)


def scores(model, model_args):
    """Per task, per document: the scores lm_eval read for each of its requests."""
    with tempfile.TemporaryDirectory() as d:
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=["strata_choices", "strata_documents"],
            task_manager=TaskManager(include_path=task_dir(pathlib.Path(d))),
            log_samples=True,
            batch_size=1,
        )
    by_task = {}
    for task, samples in out["samples"].items():
        by_task[task] = {
            str(s["doc_id"]): [list(r[0]) if isinstance(r[0], (list, tuple)) else list(r) for r in s["resps"]]
            for s in samples
        }
    return by_task


def write_reference(model_dir, path):
    # The remote tokenizer adds no BOS (lm_eval's /tokenize asks for none): neither does HF here.
    args = {"pretrained": model_dir, "dtype": "float32", "device": "cpu", "add_bos_token": False}
    got = scores("hf", args)
    lines = [
        f'  "{task}": {{\n' + ",\n".join(f'    "{d}": {json.dumps(r)}' for d, r in sorted(docs.items())) + "\n  }"
        for task, docs in sorted(got.items())
    ]
    pathlib.Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {path}")


def main():
    if sys.argv[1] == "--reference":
        return write_reference(sys.argv[2], sys.argv[3])
    base, model, key, reference = sys.argv[1:5]
    want = json.loads(pathlib.Path(reference).read_text())
    args = {
        "base_url": f"{base}/completions",
        "model": model,
        "tokenizer_backend": "remote",
        "tokenized_requests": True,
        "num_concurrent": 2,
        "max_retries": 1,
        "auth_token": key,  # the remote tokenizer's; completions read OPENAI_API_KEY
    }
    os.environ["OPENAI_API_KEY"] = key
    got = scores("local-completions", args)

    def compare(task):
        assert set(got[task]) == set(want[task]), f"{task}: documents {sorted(got[task])}"
        n = 0
        for doc, reqs in want[task].items():
            assert len(got[task][doc]) == len(reqs), f"{task} doc {doc}: {got[task][doc]}"
            for g, w in zip(got[task][doc], reqs):
                assert abs(float(g[0]) - float(w[0])) <= TOLERANCE, f"{task} doc {doc}: {g} vs HF {w}"
                if len(w) > 1:
                    assert bool(g[1]) == bool(w[1]), f"{task} doc {doc}: greedy {g} vs HF {w}"
                n += 1
        return n

    @check("multiple-choice log-likelihoods and greedy flags equal HF transformers'")
    def _():
        assert compare("strata_choices") >= 15

    @check("rolling log-likelihoods of whole documents equal HF transformers'")
    def _():
        assert compare("strata_documents") >= 3

    print(f"{len(PASSED)} passed")


if __name__ == "__main__":
    main()
