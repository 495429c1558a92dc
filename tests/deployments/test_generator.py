"""The generator deployment: presets, deployment options, and the multi-GPU (LLaMA-2-70B) path.

No GPU here: the 70B preset is checked for the options it produces, and a tiny Llama is
loaded in fp16 with ``device_map="auto"`` through the very code the replica runs
(:func:`deployments.generator.load_engine`), also inside a placement group of 4 bundles
with STRICT_PACK (CPU bundles standing in for the GPU ones).
"""

from __future__ import annotations

import pytest

from deployments.config import GeneratorDeploymentOptions, preset
from deployments.generator import GeneratorServer, claim_placement_group_gpus, generator_deployment, load_engine
from ralm.config import GeneratorConfig
from ralm.step_request import StepRequest


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    from tests.factories import tiny_causal_lm, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = tiny_tokenizer()
    tiny_causal_lm("llama", len(tok), tok.eos_token_id).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_llama2_70b_preset_options():
    gen, opts = preset("llama2-70b-4gpu")
    assert gen == {"model": "meta-llama/Llama-2-70b-hf", "device": "auto", "dtype": "float16"}
    d = opts.deployment_options()
    assert d["num_replicas"] == 1
    assert d["placement_group_strategy"] == "STRICT_PACK"
    bundles = d["placement_group_bundles"]
    assert len(bundles) == 4 and all(b["GPU"] == 1 for b in bundles)
    assert sum(b.get("GPU", 0) for b in bundles) == opts.gpus_per_replica == 4
    # the replica actor itself runs in bundle 0: its own resources must fit there
    assert d["ray_actor_options"]["num_gpus"] <= bundles[0]["GPU"]
    assert d["ray_actor_options"]["num_cpus"] <= bundles[0]["CPU"]
    assert d["ray_actor_options"]["runtime_env"]["env_vars"]["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    # Serve accepts these options as they are
    dep = generator_deployment(opts)
    assert dep.name == "Generator"
    assert dep._deployment_config.max_ongoing_requests == 64
    assert dep._replica_config.placement_group_strategy == "STRICT_PACK"
    assert dep._replica_config.placement_group_bundles == bundles
    # session affinity: the sticky router routes a request's steps by its session key
    router = dep._deployment_config.request_router_config
    assert router.get_request_router_class().__name__ == "SessionAffinityRouter"
    assert router.request_router_kwargs["max_keys"] >= opts.session_keys_per_replica


def test_other_presets_and_autoscaling():
    gen, opts = preset("gpu", model="/models/x")
    assert gen["device"] == "cuda" and gen["model"] == "/models/x" and opts.num_gpus == 1
    auto = GeneratorDeploymentOptions(autoscaling={"min_replicas": 1, "max_replicas": 4})
    d = auto.deployment_options()
    assert "num_replicas" not in d and d["autoscaling_config"]["max_replicas"] == 4
    generator_deployment(auto)  # accepted by Serve
    with pytest.raises(ValueError, match="unknown generator preset"):
        preset("llama-9000")


def test_app_config_applies_the_preset_but_explicit_settings_win():
    from deployments.app import AppConfig

    cfg = AppConfig.model_validate({"generator_preset": "llama2-70b-4gpu"}).resolved()
    assert cfg.ralm.generator.model == "meta-llama/Llama-2-70b-hf"
    assert cfg.ralm.generator.dtype == "float16" and cfg.ralm.generator.device == "auto"
    assert cfg.generator_deployment.placement_group_strategy == "STRICT_PACK"
    cfg = AppConfig.model_validate(
        {"generator_preset": "llama2-70b-4gpu", "ralm": {"generator": {"model": "/m/llama"}}}
    ).resolved()
    assert cfg.ralm.generator.model == "/m/llama" and cfg.ralm.generator.dtype == "float16"


def test_tiny_llama_loads_through_the_70b_code_path(tiny_llama_dir):
    gen_over, _ = preset("llama2-70b-4gpu", model=tiny_llama_dir)
    cfg = GeneratorConfig(**gen_over)
    assert cfg.device == "auto" and cfg.dtype == "float16"
    eng = load_engine(cfg)
    import torch

    assert eng.model.dtype == torch.float16
    assert type(eng.model).__name__ == "LlamaForCausalLM"
    ids = eng.encode_question("what does the json module do?")
    a = eng.step("Serialize obj to a JSON formatted str.", ids, 4)
    b = eng.step("Serialize obj to a JSON formatted str.", ids, 4)
    assert a.tokens == b.tokens and len(a.tokens) + a.eos >= 1


def test_replica_in_a_strict_pack_placement_group(tiny_llama_dir, fixture_corpus):
    """The replica body in bundle 0 of a 4-bundle STRICT_PACK group: probes the other bundles,
    loads the tiny Llama fp16 with device_map='auto', serves steps."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tests.actors.support import start_ray, stop_ray

    start_ray()
    try:
        pg = placement_group([{"CPU": 0.05}] * 4, strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)

        @ray.remote
        class Replica(GeneratorServer):
            def probe(self):
                return len(self._probes), self.gpu_ids

        rep = Replica.options(
            num_cpus=0.05,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
        ).remote({"model": tiny_llama_dir, "device": "auto", "dtype": "float16"}, fixture_corpus.path)
        assert ray.get(rep.probe.remote(), timeout=120) == (3, [])  # 3 other bundles probed, no GPUs here
        info = ray.get(rep.info.remote())
        assert info["dtype"] == "float16" and info["corpus_size"] == len(fixture_corpus)
        tok = ray.get(rep.tokenizer.remote())
        ids = tok("how do I copy a tree?", add_special_tokens=False)["input_ids"]
        req = StepRequest(tuple(ids), 4, doc_ids=3)
        out = ray.get(rep.step.remote(req))
        assert out.tokens == ray.get(rep.step.remote(req)).tokens
        ray.kill(rep)
        remove_placement_group(pg)
    finally:
        stop_ray()


def test_claim_outside_a_placement_group_is_a_no_op():
    assert claim_placement_group_gpus() == ([], [])
