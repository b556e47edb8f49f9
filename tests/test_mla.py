"""Multi-head latent attention (DeepSeek-V2/V3): Megatron-LM's FLOPs, Megatron-Core's layer
parameters, the GEMMs under tensor and sequence parallelism, the presets' published sizes, the
loader's checks, the exported flags and the real-run backend's refusal."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from holmes_sim.cost.transformer import layer_kernels
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.export.model_args import architecture_args
from holmes_sim.model.moe import mlp_params
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.load import load_scenario_text
from holmes_sim.spec.presets import preset_fields
from tests.megatron_flops import megatron_mla_transformer_flops

_TRAINING = TrainingSpec(global_batch_size=64, micro_batch_size=1)
_FLAGS = json.loads((Path(__file__).parent / "export/data/megatron_lm_flags.json").read_text())


def _spec(name: str, **fields) -> ModelSpec:
    return ModelSpec(**dict(preset_fields(name), **fields))


def _small(**fields) -> ModelSpec:
    """A small MLA model: h 256, 4 heads, r_kv 64, d_n 32, d_r 16, d_v 24, SwiGLU, RMSNorm."""
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512,
                seq_length=128, swiglu=True, normalization="rmsnorm", bias=False,
                position_embedding="rope", multi_latent_attention=True, kv_lora_rank=64,
                qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24)
    return ModelSpec(**dict(base, **fields))


@pytest.mark.parametrize("name, tp", [("deepseek-v2-lite", 1), ("deepseek-v3", 8)])
def test_deepseek_iteration_flops_equal_megatrons_mla_formula(name, tp):
    m = _spec(name)
    w = build_workload(m, _TRAINING, tp)
    expected = megatron_mla_transformer_flops(
        64, 4096, m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, w.vocab,
        m.moe_layer_freq, m.moe_router_topk, m.moe_ffn_hidden_size,
        m.moe_shared_expert_intermediate_size, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim,
        m.qk_pos_emb_head_dim, m.v_head_dim)
    assert w.model_flop_per_iteration() == pytest.approx(expected, rel=1e-3)
    assert w.megatron_tflops_per_gpu(1.0, 1) * 1e12 == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("q_rank", [None, 96])
def test_a_layers_gemms_run_the_flops_of_megatrons_formula(q_rank):
    """Forward, weight and data gradient of every projection, and the causal half of the score
    and context GEMMs, equal Megatron's attention term less its norm terms (r_q + r_kv)."""
    spec = _small(q_lora_rank=q_rank, num_experts=None)
    w = build_workload(spec, _TRAINING, 1)
    k = layer_kernels(w, 1)
    executed = sum(g.flop + sum(x.flop for x in g.backward()) for g in k.dense[:-2])
    executed += sum(g.flop + sum(x.flop for x in g.backward()) for g in k.attention) / 2
    one_layer = megatron_mla_transformer_flops(1, w.seq, 1, w.hidden, w.heads, w.ffn, 0, (0,), 0,
                                               0, 0, q_rank, 64, 32, 16, 24)
    mlp = 6 * w.seq * w.hidden * w.ffn * 3
    norms = 6 * w.seq * ((q_rank or 0) + 64)
    assert executed == pytest.approx(one_layer - mlp - norms, rel=1e-9)


def test_deepseek_v3_gemms_split_over_tp_as_megatron_core_builds_them():
    """The duplicated down projections (TELinear, parallel_mode duplicated) keep their width and
    run on all b s tokens, on b s / t with sequence parallelism; the up projections split their
    outputs and the output projection its input over t = 4."""
    w = build_workload(_spec("deepseek-v3"), _TRAINING, 4)
    shapes = [(g.m, g.n, g.k) for g in layer_kernels(w, 4).dense[:-2]]
    assert shapes == [(4096, 1536, 7168), (4096, 128 * 192 // 4, 1536), (4096, 576, 7168),
                      (4096, 128 * 256 // 4, 512), (4096, 7168, 128 * 128 // 4)]
    sp = build_workload(_spec("deepseek-v3"), dataclasses.replace(_TRAINING,
                                                                 sequence_parallel=True), 4)
    down = [(g.m, g.n) for g in layer_kernels(sp, 4).dense[:-2]]
    assert down[0] == (1024, 1536) and down[2] == (1024, 576) and down[1][0] == 4096
    scores, context = layer_kernels(w, 4).attention
    assert (scores.m, scores.n, scores.k, scores.batch) == (4096, 4096, 192, 32)
    assert (context.m, context.n, context.k) == (4096, 128, 4096)
    fused = build_workload(_spec("deepseek-v3"), dataclasses.replace(_TRAINING,
                                                                    flash_attention=True), 4)
    assert layer_kernels(fused, 4).flash_flop == 2 * 4096 * 4096 * (128 * 192 + 128 * 128) / 4


def test_deepseek_v2_lite_projects_queries_directly():
    w = build_workload(_spec("deepseek-v2-lite"), _TRAINING, 2)
    q, kv_down, kv_up, proj = layer_kernels(w, 2).dense[:-2]
    assert (q.n, q.k) == (16 * 192 // 2, 2048) and (kv_down.n, kv_up.k) == (576, 512)
    assert (kv_up.n, proj.k) == (16 * 256 // 2, 16 * 128 // 2)


@pytest.mark.parametrize("name, published, rel", [
    ("deepseek-v2-lite", 15.7e9, 0.005),  # arXiv 2405.04434, Appendix B
    ("deepseek-v3", 671e9, 0.005),  # arXiv 2412.19437: 671B, MTP's 14B not included
])
def test_deepseek_presets_have_their_published_size(name, published, rel):
    w = build_workload(_spec(name), _TRAINING)
    assert w.total_params == pytest.approx(published, rel=rel)


@pytest.mark.parametrize("q_rank", [None, 48])
def test_gradient_buckets_hold_every_mla_parameter_once(q_rank):
    """The bucket cut (`model.bucket_layout`) lists MLA's own linears and latent norms: on one
    GPU without TP they add up to the model's parameters; under TP the up projections split and
    the down projections and latent norms do not."""
    from holmes_sim.model.bucket_layout import chunk_params
    w = build_workload(_small(q_lora_rank=q_rank), _TRAINING)
    params = chunk_params(w, 1, 0, w.num_layers, True, True)
    assert sum(p[0] for p in params) == w.total_params
    ready = [p[1] for p in params]
    assert all(0 < r <= 1.0 for r in ready) and max(ready) == 1.0
    m, h = w.mla, w.hidden
    split = chunk_params(build_workload(_small(q_lora_rank=q_rank), _TRAINING, 2), 2, 0, 1,
                         False, False)
    sizes = [p[0] for p in split]
    assert m.kv_rank * m.kv_up_width // 2 in sizes  # kv up: column-parallel
    assert h * (m.kv_rank + m.rope_dim) in sizes  # kv down: replicated
    assert h * m.v_width // 2 in sizes  # output projection: row-parallel


def test_deepseek_v3_activates_its_published_37b_per_token():
    w = build_workload(_spec("deepseek-v3"), _TRAINING)
    m = w.moe
    idle = m.moe_layers * (m.experts - m.topk) * mlp_params(w.hidden, m.ffn, True, False)
    assert w.total_params - idle == pytest.approx(37e9, rel=0.02)


_BUILD_LAYER = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch, torch.distributed as dist
torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding asks for a device; CPU-only torch
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
import megatron.core.transformer.multi_latent_attention as mla
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
mla.TELinear = type("NoTransformerEngine", (), {})  # None without Transformer Engine
class NoCore(torch.nn.Module):  # the core attention has no parameters
    def __init__(self, *args, **kwargs):
        super().__init__()
counts = {}
for q in (None, 96):
    config = MLATransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, q_lora_rank=q,
        kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        qk_layernorm=True, use_cpu_initialization=True, rope_type="rope")
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = NoCore
    layer = build_module(spec, config=config, layer_number=1)
    counts[str(q)] = sum(p.numel() for p in layer.parameters())
print(json.dumps(counts))
"""


def test_a_layers_parameters_equal_megatron_cores_mla_layer():
    """Megatron-Core's local-spec MLA layer (`MLASelfAttention` with `--qk-layernorm`), built on
    the CPU in a child process, holds the parameters the workload counts."""
    pytest.importorskip("megatron.core.transformer.multi_latent_attention")
    port = str(29500 + sum(map(ord, __name__)) % 400)
    out = subprocess.run([sys.executable, "-c", _BUILD_LAYER, port], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    for q in (None, 96):
        w = build_workload(_small(q_lora_rank=q), _TRAINING)
        assert w.dense_layer_params == counts[str(q)]


def test_activations_and_rope_bytes_follow_the_latent_shapes():
    """Per s b h element at t = 1: norms and down-projection input 8, no dropout masks, latents
    before and after their norms 4 (r_kv)/h, the key's rotary part 2 d_r / h; Q and K 4 q / h,
    V and the projection input 4 a d_v / h; MLP 2 (f1 + f) / h; scores 2 a s / h."""
    w = build_workload(_small(hidden_dropout=0.0, attention_dropout=0.0), _TRAINING)
    s, h, a = 128, 256, 4
    q, v = a * (32 + 16), a * 24
    per_element = 8 + (4 * 64 + 2 * 16) / h + (4 * q + 4 * v) / h + 2 * (1024 + 512) / h + \
        2 * a * s / h
    assert w.activation_bytes_per_layer(1) == pytest.approx(s * h * per_element)
    mha = build_workload(ModelSpec(**dict(dataclasses.asdict(_small()), kv_lora_rank=None,
                                          qk_head_dim=None, qk_pos_emb_head_dim=None,
                                          v_head_dim=None, multi_latent_attention=False)),
                         _TRAINING)
    assert layer_kernels(w, 1).other_bytes_fwd != layer_kernels(mha, 1).other_bytes_fwd


@pytest.mark.parametrize("fields, path, words", [
    ({"num_query_groups": 2}, "model.num_query_groups", "no key/value groups"),
    ({"position_embedding": "learned"}, "model.position_embedding", "position_embedding: rope"),
    ({"multi_latent_attention": False}, "model.kv_lora_rank", "multi_latent_attention: true"),
])
def test_mla_settings_megatron_refuses_name_the_field(fields, path, words):
    with pytest.raises(FieldError) as err:
        build_workload(_small(**fields), _TRAINING)
    assert err.value.path == path and words in err.value.message


def test_mla_under_context_parallelism_or_fp8_is_refused():
    with pytest.raises(FieldError, match="context parallelism") as err:
        build_workload(_small(), _TRAINING, cp=2)
    assert err.value.path == "parallel.context"
    with pytest.raises(FieldError) as err:
        build_workload(_small(), dataclasses.replace(_TRAINING, precision="fp8"))
    assert err.value.path == "training.precision"


def test_exported_mla_flags_parse_with_megatron_lm_and_its_config():
    w = build_workload(_spec("deepseek-v3"), _TRAINING, 8)
    args = architecture_args(w)
    flags = [a for a in args if a.startswith("--")]
    assert all(f in _FLAGS["flags"] for f in flags)
    assert {"--multi-latent-attention", "--qk-layernorm"} <= set(flags)
    assert "--group-query-attention" not in flags

    def value(flag):
        return int(args[args.index(flag) + 1])

    assert [value(f) for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                               "--qk-pos-emb-head-dim", "--v-head-dim")] == [1536, 512, 128, 64, 128]
    lite = architecture_args(build_workload(_spec("deepseek-v2-lite"), _TRAINING))
    assert "--q-lora-rank" not in lite  # Megatron's default None: queries projected directly
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    config = config_module.MLATransformerConfig(
        num_layers=4, hidden_size=w.hidden, num_attention_heads=w.heads, ffn_hidden_size=w.ffn,
        q_lora_rank=value("--q-lora-rank"), kv_lora_rank=value("--kv-lora-rank"),
        qk_head_dim=value("--qk-head-dim"), qk_pos_emb_head_dim=value("--qk-pos-emb-head-dim"),
        v_head_dim=value("--v-head-dim"), qk_layernorm=True, add_bias_linear=False)
    assert config.multi_latent_attention and config.q_lora_rank == 1536


def test_the_real_run_backend_refuses_latent_attention(tmp_path):
    from holmes_sim.bundled import default_testbed
    from holmes_sim.validation.testbed_plan import check_backend

    text = default_testbed().read_text().replace(
        "vocab_size: 512", "vocab_size: 512\n  multi_latent_attention: true\n"
                           "  position_embedding: rope")
    path = tmp_path / "mla.yaml"
    path.write_text(text)
    with pytest.raises(FieldError, match="multi_latent_attention"):
        check_backend(prepare(path))


def _yaml(model: str) -> str:
    return f"""name: mla
clusters:
  - name: c
    nodes: [{{count: 1, gpu: h100-sxm, nics: [{{type: ethernet, bandwidth_gbit_per_s: 100}}]}}]
model: {model}
training: {{global_batch_size: 8, micro_batch_size: 1, sequence_parallel: true}}
parallel: {{tensor: 2}}
"""


def test_deepseek_preset_loads_with_its_dense_first_layers():
    spec = load_scenario_text(_yaml("{preset: deepseek-v3}")).model
    assert spec.moe_layer_freq == (0, 0, 0) + (1,) * 58
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.multi_latent_attention) == (1536, 512, True)
    assert build_workload(spec, _TRAINING, 2).moe.moe_layers == 58


def test_the_planner_skips_context_parallelism_for_mla():
    """`prepare.check_context`, which the planner's CP search asks, refuses CP with MLA."""
    from holmes_sim.prepare import check_context

    scenario = load_scenario_text(_yaml("{preset: deepseek-v2-lite}"))
    with pytest.raises(FieldError, match="multi-head latent") as err:
        check_context(scenario, 2, 2)
    assert err.value.path == "parallel.context" and check_context(scenario, 1, 2) == 1


def test_a_latent_rank_out_of_bounds_names_the_field():
    with pytest.raises(ScenarioError, match="model.kv_lora_rank: must be at least 1, got 0"):
        load_scenario_text(_yaml("{preset: deepseek-v2-lite, kv_lora_rank: 0}"))


def test_mla_with_query_groups_is_refused_at_its_line(write_scenario):
    path = write_scenario(_yaml("{preset: deepseek-v2-lite, num_layers: 2, num_query_groups: 4,\n"
                                "        moe_layer_freq: [0, 1]}"))
    with pytest.raises(ScenarioError, match="model.num_query_groups: multi-head latent"):
        prepare(path)
