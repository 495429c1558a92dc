"""Offline validation of the Kubernetes manifests in k8s/.

* KubeRay objects (RayService, RayJob, RayCluster) against the openAPIV3Schema of the
  KubeRay v1.7 CRDs (../shared/kuberay-crds, or $KUBERAY_CRDS_DIR) with jsonschema, plus a
  check for unknown fields (the API server would silently prune them); their pod
  templates also as strict core PodTemplates;
* the embedded ``serveConfigV2`` with Ray's ``ServeDeploySchema`` and the app's own
  ``AppConfig``;
* core objects (Deployment, Service, PVC, Secret, ConfigMap, Namespace) with
  kubernetes-validate, strict, offline;
* the Grafana dashboard JSON and the metrics it queries;
* the generated files are up to date with their sources (serve_config.yaml, k8s/src/).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from cluster import k8s_gen

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SHARED_CRDS = ROOT.parent / "shared" / "kuberay-crds"
VENDORED_CRDS = Path(__file__).resolve().parent / "crds"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
METRICS = [
    "ralmspec_request_latency_seconds",
    "ralmspec_kb_calls_total",
    "ralmspec_cache_hit_rate",
    "ralmspec_rollbacks_total",
    "ralmspec_gamma",
    "ralmspec_verifier_batch_size",
    "ralmspec_shard_latency_seconds",
    "ralmspec_generator_batch_size",
    "ralmspec_generator_tokens_total",
    "ralmspec_generator_busy_seconds_total",
    "ralmspec_generator_host_seconds_total",
    "ralmspec_stride_decisions_total",
]
GENERATED = [
    "k8s/rayservice.yaml",
    "k8s/rayjob-eval.yaml",
    "k8s/raycluster.yaml",
    "k8s/grafana-dashboard-configmap.yaml",
]


# ------------------------------------------------------------------ helpers
def _crd_text(kind: str) -> str:
    """A CRD's YAML: $KUBERAY_CRDS_DIR, else ../shared/kuberay-crds, else the vendored gzip copy."""
    import gzip
    import os

    name = CRD_FILES[kind]
    env = os.environ.get("KUBERAY_CRDS_DIR")
    for d in ([Path(env)] if env else []) + [SHARED_CRDS]:
        if (d / name).is_file():
            return (d / name).read_text()
    vendored = VENDORED_CRDS / f"{name}.gz"
    if vendored.is_file():
        return gzip.decompress(vendored.read_bytes()).decode()
    pytest.fail(f"KubeRay CRD {name} not found: set KUBERAY_CRDS_DIR", pytrace=False)


_SCHEMAS: dict[str, dict] = {}


def crd_schema(kind: str, version: str = "v1") -> dict:
    if kind not in _SCHEMAS:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are large
        crd = yaml.load(_crd_text(kind), Loader=loader)
        (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        _SCHEMAS[kind] = v["schema"]["openAPIV3Schema"]
    return _SCHEMAS[kind]


def test_vendored_crds_match_shared():
    import gzip

    for name in CRD_FILES.values():
        assert (VENDORED_CRDS / f"{name}.gz").is_file(), f"tests/k8s/crds/{name}.gz is missing"
        if (SHARED_CRDS / name).is_file():
            assert gzip.decompress((VENDORED_CRDS / f"{name}.gz").read_bytes()) == (SHARED_CRDS / name).read_bytes()


def unknown_fields(schema: dict, obj, path: str = "") -> list[str]:
    """Fields the API server would prune: keys not declared where the schema lists properties."""
    out: list[str] = []
    if isinstance(obj, dict) and isinstance(schema, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                out += unknown_fields(props[k], v, f"{path}.{k}")
            elif isinstance(addl, dict):
                out += unknown_fields(addl, v, f"{path}.{k}")
            elif (
                props is not None and addl is not True and not (path == "" and k in ("apiVersion", "kind", "metadata"))
            ):
                out.append(f"{path}.{k}")
    elif isinstance(obj, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(obj):
            out += unknown_fields(schema["items"], v, f"{path}[{i}]")
    return out


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in load_docs(p)]


def ray_docs() -> list[tuple[str, dict]]:
    return [(n, d) for n, d in all_docs() if str(d.get("apiVersion", "")).startswith("ray.io/")]


def core_docs() -> list[tuple[str, dict]]:
    return [(n, d) for n, d in all_docs() if not str(d.get("apiVersion", "")).startswith("ray.io/")]


def cluster_spec_of(doc: dict) -> dict:
    return {
        "RayCluster": lambda d: d["spec"],
        "RayService": lambda d: d["spec"]["rayClusterConfig"],
        "RayJob": lambda d: d["spec"]["rayClusterSpec"],
    }[doc["kind"]](doc)


def groups(doc: dict) -> dict[str, dict]:
    spec = cluster_spec_of(doc)
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}}


def kv_validate(doc: dict) -> None:
    import kubernetes_validate as kv

    try:
        kv.validate(doc, kv.latest_version(), strict=True)
    except kv.ValidationError as e:
        where = "/".join(str(p) for p in getattr(e, "path", ()) or ())
        pytest.fail(f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: {e.message} at {where}", pytrace=False)


# ------------------------------------------------------------------ the files exist
def test_expected_manifests_exist():
    names = {p.name for p in K8S.glob("*.yaml")}
    for f in [
        "rayservice.yaml",
        "rayjob-eval.yaml",
        "raycluster.yaml",
        "redis.yaml",
        "redis-secret.example.yaml",
        "namespace.yaml",
        "storage.yaml",
        "ralmspec-config.yaml",
        "grafana-dashboard-configmap.yaml",
    ]:
        assert f in names, f"k8s/{f} is missing (generated ones: run `ralmspec k8s`)"
    kinds = {d["kind"] for _, d in all_docs()}
    assert {
        "RayService",
        "RayJob",
        "RayCluster",
        "Deployment",
        "Service",
        "PersistentVolumeClaim",
        "Secret",
        "ConfigMap",
        "Namespace",
    } <= kinds


# ------------------------------------------------------------------ KubeRay objects
@pytest.mark.parametrize("name,doc", ray_docs(), ids=lambda x: x if isinstance(x, str) else x.get("kind"))
def test_ray_objects_match_crd_schema(name, doc):
    import jsonschema

    assert doc["apiVersion"] == "ray.io/v1"
    schema = crd_schema(doc["kind"])
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{name}: {'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    assert unknown_fields(schema, doc) == [], f"{name}: fields the CRD does not know (would be pruned)"
    for gname, g in groups(doc).items():  # pod templates are valid core pod specs
        kv_validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{name}-{gname}"},
                "template": g["template"],
            }
        )


def test_unknown_field_check_catches_typos():
    schema = crd_schema("RayCluster")
    doc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "x"},
        "spec": {"headGroupSpec": {"rayStartParams": {}, "templat": {}}, "workerGroupSpec": []},
    }
    assert set(unknown_fields(schema, doc)) == {".spec.headGroupSpec.templat", ".spec.workerGroupSpec"}


def test_worker_groups_gpu_and_retrieval():
    for name, doc in ray_docs():
        g = groups(doc)
        assert set(g) == {"head", "generation-gpu", "retrieval-cpu"}, name
        gpu = g["generation-gpu"]["template"]["spec"]
        (c,) = gpu["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 and c["resources"]["requests"]["nvidia.com/gpu"] == 4
        assert g["generation-gpu"]["rayStartParams"]["num-gpus"] == "4"
        assert "A100" in gpu["nodeSelector"]["nvidia.com/gpu.product"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
        ret = g["retrieval-cpu"]["template"]["spec"]
        mem = ret["containers"][0]["resources"]["requests"]["memory"]
        assert mem.endswith("Gi") and int(mem[:-2]) >= 64, "retrieval shards need high-memory nodes"
        assert "nvidia.com/gpu" not in ret["containers"][0]["resources"].get("limits", {})
        assert g["head"]["rayStartParams"]["num-cpus"] == "0"


def test_every_ray_pod_gets_redis_password_from_the_secret():
    for name, doc in ray_docs():
        for gname, g in groups(doc).items():
            for c in g["template"]["spec"]["containers"]:
                env = {e["name"]: e for e in c.get("env", [])}
                pw = env["RALMSPEC_REDIS_PASSWORD"]
                assert "value" not in pw, f"{name}/{gname}: password must come from a Secret"
                assert pw["valueFrom"]["secretKeyRef"] == {"name": "ralmspec-redis", "key": "password"}
                url = env["RALMSPEC_STATE_URL"]["value"]
                assert url.startswith("redis://ralmspec-redis.") and "@" not in url
                from cache.state import StateStoreConfig

                StateStoreConfig.from_url(url)  # no password in the URL, valid scheme


def test_rayservice_gcs_fault_tolerance_uses_the_secret():
    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayService"]
    ft = doc["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "ralmspec-redis", "key": "password"}
    assert ft["redisAddress"].startswith("redis://ralmspec-redis.")


def test_serve_config_v2_is_valid():
    from ray.serve.schema import ServeDeploySchema

    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayService"]
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve) if hasattr(
        ServeDeploySchema, "model_validate"
    ) else ServeDeploySchema.parse_obj(serve)
    assert serve["applications"], "no Serve application in serveConfigV2"
    for app in serve["applications"]:
        if app.get("import_path") == "deployments.app:build_app":
            from deployments.app import AppConfig

            AppConfig.model_validate(app.get("args") or {})  # the cluster args are valid app args


def _served_app() -> dict:
    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayService"]
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = [a for a in serve["applications"] if a.get("import_path") == "deployments.app:build_app"]
    return serve, app


def test_served_app_fits_the_gpu_group():
    """The resolved cluster config puts one 70B replica on the 4 GPUs of one generation-gpu pod
    (explicit fields in serve_config.yaml would otherwise silently beat the preset)."""
    from deployments.app import AppConfig

    serve, app = _served_app()
    assert serve["http_options"]["host"] == "0.0.0.0", "the Serve proxy must listen beyond the pod's loopback"
    cfg = AppConfig.model_validate(app["args"]).resolved()
    gen, dep = cfg.ralm.generator, cfg.generator_deployment
    assert (gen.device, gen.dtype) == ("auto", "float16")
    assert dep.gpus_per_replica == 4 and dep.placement_group_strategy == "STRICT_PACK"
    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayService"]
    gpu_pod = groups(doc)["generation-gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu_pod["nvidia.com/gpu"] >= dep.gpus_per_replica
    assert str(cfg.ralm.corpus).startswith("/data/") and str(cfg.ralm.work_dir).startswith("/data/")


def test_eval_config_matches_the_served_config():
    """ralmspec eval (k8s/ralmspec-config.yaml) evaluates what the RayService serves."""
    from ralm.config import RalmConfig

    _, app = _served_app()
    (cm,) = [d for _, d in core_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ralmspec-config"]
    ev = RalmConfig.model_validate(yaml.safe_load(cm["data"]["ralmspec.yaml"]))
    served = RalmConfig.model_validate(app["args"]["ralm"])
    assert (ev.corpus, ev.work_dir, ev.retriever.encoder) == (served.corpus, served.work_dir, served.retriever.encoder)
    assert (ev.generator.model, ev.generator.dtype) == (served.generator.model, served.generator.dtype)
    assert ev.request.generation_stride == served.request.generation_stride


def test_rayjob_runs_a_valid_eval_command():
    from cluster.eval_job import build_parser

    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayJob"]
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["ralmspec", "eval"]
    args = build_parser().parse_args(argv[2:])  # every flag exists
    assert args.job_id, "a fixed --job-id makes a retried RayJob resume instead of starting over"
    assert args.state_url is None or "@" not in args.state_url
    env_url = {e["name"]: e for e in groups(doc)["head"]["template"]["spec"]["containers"][0]["env"]}
    assert args.state_url or env_url["RALMSPEC_STATE_URL"]["value"].startswith("redis://")
    assert args.worker_gpus == 4 and doc["spec"]["backoffLimit"] >= 1
    assert doc["spec"]["shutdownAfterJobFinishes"] is True


# ------------------------------------------------------------------ core objects
@pytest.mark.parametrize("name,doc", core_docs(), ids=lambda x: x if isinstance(x, str) else x.get("kind"))
def test_core_objects_are_valid(name, doc):
    kv_validate(doc)
    assert doc["metadata"].get("namespace", "ralmspec") == "ralmspec"


def test_redis_wiring():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in core_docs()}
    dep = docs[("Deployment", "ralmspec-redis")]
    svc = docs[("Service", "ralmspec-redis")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ralmspec-redis", "key": "password"}
    assert "requirepass" in c["args"][0] and "$REDIS_PASSWORD" in c["args"][0]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in dep["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"ralmspec-redis-data"} and ("PersistentVolumeClaim", "ralmspec-redis-data") in docs
    conf = docs[("ConfigMap", "ralmspec-redis-config")]["data"]["redis.conf"]
    assert "appendonly yes" in conf and "requirepass" not in conf
    secret = docs[("Secret", "ralmspec-redis")]
    assert set(secret["stringData"]) == {"password"}
    assert secret["stringData"]["password"] == "CHANGE-ME" and "CHANGE-ME" in c["args"][0]  # placeholder refused


def _strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def test_no_literal_passwords_outside_the_example_secret():
    import re

    for name, doc in all_docs():
        if doc["kind"] == "Secret":
            continue
        for s in _strings(doc):
            assert not re.search(r"rediss?://[^/\s@]*:[^/\s@]*@", s), f"{name}: password in a Redis URL"
            assert "password=" not in s.lower(), f"{name}: password in a URL query"
            for line in s.splitlines():
                if re.search(r"\brequirepass\b", line) and "REDIS_PASSWORD" not in line:
                    assert '"%s"' in line, f"{name}: literal requirepass: {line!r}"


# ------------------------------------------------------------------ security
def pod_templates() -> list[tuple[str, dict]]:
    """Every pod template: each Ray group of every KubeRay object, and the core Deployments."""
    out = []
    for name, doc in ray_docs():
        out += [(f"{name}/{g}", grp["template"]) for g, grp in groups(doc).items()]
    for name, doc in core_docs():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((f"{name}/{doc['metadata']['name']}", doc["spec"]["template"]))
    return out


def test_every_pod_is_non_root_read_only_and_bounded():
    templates = pod_templates()
    assert len(templates) == 3 * 3 + 1  # 3 Ray objects x 3 groups, and Redis
    for where, tpl in templates:
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] != 0, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], where
            res = c["resources"]
            for key in ("cpu", "memory"):
                assert key in res["requests"] and key in res["limits"], f"{where}: {key} request and limit"
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            if where.split("/")[0].startswith("ray"):  # Ray writes its session dir under /tmp
                assert "/tmp" in mounts, where


def test_only_the_clusters_pods_reach_redis():
    (pol,) = [d for _, d in core_docs() if d["kind"] == "NetworkPolicy"]
    dep = next(d for _, d in core_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "ralmspec-redis")
    redis_labels = dep["spec"]["template"]["metadata"]["labels"]
    sel = pol["spec"]["podSelector"]["matchLabels"]
    assert all(redis_labels.get(k) == v for k, v in sel.items()) and pol["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # same namespace only: no namespaceSelector, no ipBlock
    admitted = peer["podSelector"]["matchLabels"]
    assert admitted == {"app.kubernetes.io/name": "ralmspec"}
    for where, tpl in pod_templates():  # every pod of the cluster is admitted
        assert all(tpl["metadata"]["labels"].get(k) == v for k, v in admitted.items()), where


def test_secrets_reach_pods_only_through_secret_references():
    import re

    checked = 0
    for where, tpl in pod_templates():
        for c in tpl["spec"]["containers"]:
            for e in c.get("env", []):
                secretish = re.search(r"(^|_)(PASSWORD|TOKEN|SECRET|AUTH|API_KEY)($|_)", e["name"].upper())
                if secretish:
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{where}: {e['name']}"
                    checked += 1
    assert checked == 9 * 3 + 2  # the Redis password, HF token and API key of 9 Ray pods; Redis's own two


def test_ralmspec_config_is_a_valid_ralm_config():
    from ralm.config import RalmConfig

    (cm,) = [d for _, d in core_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ralmspec-config"]
    cfg = RalmConfig.model_validate(yaml.safe_load(cm["data"]["ralmspec.yaml"]))
    assert cfg.generator.device == "auto" and str(cfg.corpus).startswith("/data/")
    for _, doc in ray_docs():  # mounted where the RayJob reads it
        spec = groups(doc)["head"]["template"]["spec"]
        assert any(v.get("configMap", {}).get("name") == "ralmspec-config" for v in spec["volumes"])
        assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "ralmspec-data" for v in spec["volumes"])


# ------------------------------------------------------------------ Grafana
def test_grafana_dashboard_queries_the_ray_prefixed_metrics():
    dash = json.loads((K8S / "grafana-dashboard.json").read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    for m in METRICS:
        assert any(f"ray_{m}" in e for e in exprs), f"no panel queries ray_{m}"
    import re

    for e in exprs:  # every metric is queried with Ray's prefix
        for name in re.findall(r"[a-z_]*ralmspec_[a-z_]+", e):
            assert name.startswith("ray_ralmspec_"), f"{name!r} lacks Ray's ray_ prefix in {e!r}"
    titles = " ".join(p["title"].lower() for p in panels)
    for word in ["latency", "kb calls", "hit rate", "rollbacks", "gamma", "batch size", "shard", "generator"]:
        assert word in titles
    cm = yaml.safe_load((K8S / "grafana-dashboard-configmap.yaml").read_text())
    assert json.loads(cm["data"]["ralmspec.json"]) == dash and cm["metadata"]["labels"]["grafana_dashboard"] == "1"


# ------------------------------------------------------------------ generated files are current
def test_generated_manifests_are_up_to_date():
    files = k8s_gen.generate(ROOT)
    assert sorted(files) == sorted(GENERATED)
    stale = [rel for rel, text in files.items() if not (ROOT / rel).is_file() or (ROOT / rel).read_text() != text]
    assert not stale, f"out of date: {stale}; run `ralmspec k8s` (python -m cluster.k8s_gen) and commit"


def test_rayservice_embeds_serve_config_yaml():
    (doc,) = [d for _, d in ray_docs() if d["kind"] == "RayService"]
    embedded = yaml.safe_load(doc["spec"]["serveConfigV2"])
    local = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    over = yaml.safe_load((K8S / "src" / "serve-overrides.yaml").read_text()) or {}
    assert embedded == k8s_gen.deep_merge(local, over)


def test_generator_on_a_synthetic_serve_config(tmp_path):
    serve = {
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [
            {
                "name": "ralmspec",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": {"retrievers": ["edr", "sr"], "default_method": "seq"},
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    files = k8s_gen.generate(ROOT, serve_config_path=path, image="example.com/ralmspec:test")
    doc = yaml.safe_load(files["k8s/rayservice.yaml"])
    assert files["k8s/rayservice.yaml"].startswith("# GENERATED")
    embedded = yaml.safe_load(doc["spec"]["serveConfigV2"])
    over = yaml.safe_load((K8S / "src" / "serve-overrides.yaml").read_text()) or {}
    assert embedded == k8s_gen.deep_merge(serve, over)
    assert "serveConfigV2: |" in files["k8s/rayservice.yaml"]  # readable literal block
    assert all(
        c["image"] == "example.com/ralmspec:test"
        for g in groups(doc).values()
        for c in g["template"]["spec"]["containers"]
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"applications": [{"name": "other"}]}))  # no import_path
    with pytest.raises(k8s_gen.K8sGenError, match="not a valid Serve deploy config"):
        k8s_gen.generate(ROOT, serve_config_path=bad)


def test_k8s_main_check_mode(tmp_path, capsys):
    import argparse
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(K8S, root / "k8s")
    serve = ROOT / "serve_config.yaml"
    (root / "serve_config.yaml").write_text(
        serve.read_text()
        if serve.is_file()
        else yaml.safe_dump(
            {"applications": [{"name": "ralmspec", "import_path": "deployments.app:build_app", "args": {}}]}
        )
    )
    ns = lambda **kw: argparse.Namespace(**{"serve_config": None, "root": root, "image": None, "check": False, **kw})  # noqa: E731
    assert k8s_gen.k8s_main(ns()) == 0
    assert k8s_gen.k8s_main(ns(check=True)) == 0
    (root / "k8s" / "src" / "rayjob-eval.yaml").write_text(
        (root / "k8s" / "src" / "rayjob-eval.yaml").read_text().replace("backoffLimit: 2", "backoffLimit: 3")
    )
    assert k8s_gen.k8s_main(ns(check=True)) == 1
    assert "k8s/rayjob-eval.yaml" in capsys.readouterr().err


def test_deep_merge():
    base = {
        "a": {"b": 1, "c": [1, 2]},
        "groups": [{"groupName": "g1", "replicas": 1, "x": {"y": 1}}, {"groupName": "g2", "replicas": 2}],
    }
    over = {"a": {"c": [3]}, "groups": [{"groupName": "g2", "replicas": 0}, {"groupName": "g3"}]}
    assert k8s_gen.deep_merge(base, over) == {
        "a": {"b": 1, "c": [3]},
        "groups": [
            {"groupName": "g1", "replicas": 1, "x": {"y": 1}},
            {"groupName": "g2", "replicas": 0},
            {"groupName": "g3"},
        ],
    }
    assert base["groups"][1]["replicas"] == 2  # inputs untouched
    apps = k8s_gen.deep_merge(
        {"applications": [{"name": "a", "args": {"x": 1, "y": 2}}]}, {"applications": [{"name": "a", "args": {"y": 3}}]}
    )
    assert apps == {"applications": [{"name": "a", "args": {"x": 1, "y": 3}}]}
