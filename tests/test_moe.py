"""Mixture-of-experts models (expert parallelism 1): Megatron-LM's FLOPs, the presets' published
sizes, the loader's checks, the MoE layer's kernels and the exporter's flags."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from holmes_sim.cost.gemm import Gemm
from holmes_sim.cost.moe import moe_mlp_kernels, tp_comm_factor
from holmes_sim.cost.transformer import layer_kernels, layer_s
from holmes_sim.errors import FieldError, PlanError, ScenarioError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.export.model_args import AFTER_RELEASE, architecture_args
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.moe import expected_max_normal, mlp_params
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.load import load_scenario_text
from holmes_sim.spec.presets import preset_fields
from tests.megatron_flops import megatron_transformer_flops

_TRAINING = TrainingSpec(global_batch_size=128, micro_batch_size=1)
_H100 = GPUS["h100-sxm"]
_FLAGS = json.loads((Path(__file__).parent / "export/data/megatron_lm_flags.json").read_text())


def _spec(name: str, **fields) -> ModelSpec:
    return ModelSpec(**dict(preset_fields(name), **fields))


@pytest.mark.parametrize("name,fields", [
    ("mixtral-8x7b", {}),
    ("mixtral-8x22b", {"moe_layer_freq": 2}),
    ("qwen1.5-moe-a2.7b", {}),
    ("qwen2-57b-a14b", {"moe_layer_freq": (0, 0) + (1,) * 26}),
])
def test_flops_equal_megatrons_moe_formula(name, fields):
    spec = _spec(name, **fields)
    w = build_workload(spec, _TRAINING, 1)
    want = megatron_transformer_flops(128, spec.seq_length, spec.num_layers, spec.hidden_size,
                                      spec.num_attention_heads, spec.num_query_groups,
                                      spec.ffn_hidden_size, w.vocab, True, spec.moe_layer_freq,
                                      spec.moe_router_topk, spec.moe_ffn_hidden_size,
                                      spec.moe_shared_expert_intermediate_size or 0)
    assert w.flops_formula == "megatron-core"
    assert w.model_flop_per_iteration() == pytest.approx(want, rel=1e-3)


def _active_params(w) -> float:
    """Parameters one token passes: all but the E - k experts it is not routed to."""
    m = w.moe
    expert = mlp_params(w.hidden, m.ffn, w.swiglu, w.bias)
    return w.total_params - m.moe_layers * (m.experts - m.topk) * expert


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),       # Jiang et al. 2024, section 2.1
    ("mixtral-8x22b", 141e9, 39e9),        # Mistral AI's announcement
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9),  # Qwen1.5-MoE blog
    ("qwen2-57b-a14b", 57e9, 14e9),        # Qwen2 report, Table 1
])
def test_presets_have_their_published_sizes(name, total, active):
    w = build_workload(_spec(name), _TRAINING, 1)
    assert w.total_params == pytest.approx(total, rel=0.01)
    # published active counts are rounded to 2-3 digits (and Qwen's exclude the embeddings)
    assert _active_params(w) == pytest.approx(active, rel=0.06)


def test_layer_pattern_list_loads_and_dense_layers_keep_the_dense_mlp():
    text = """name: x
clusters:
  - name: c
    nodes: [{count: 1, gpu: h100-sxm, nics: [{type: ethernet, bandwidth_gbit_per_s: 100}]}]
model: {preset: mixtral-8x7b, num_layers: 4, moe_layer_freq: [0, 1, 1, 0]}
training: {global_batch_size: 8, micro_batch_size: 1}
"""
    spec = load_scenario_text(text).model
    assert spec.moe_layer_freq == (0, 1, 1, 0)
    w = build_workload(spec, _TRAINING, 1)
    dense = build_workload(dataclasses.replace(spec, num_experts=None,
                                               moe_layer_freq=1), _TRAINING, 1)
    moe_layer = 2 * w.layer_params - dense.layer_params  # the mean of two dense, two MoE
    assert moe_layer - dense.layer_params == pytest.approx(
        8 * 4096 + 7 * mlp_params(4096, 14336, True, False), abs=1)


@pytest.mark.parametrize("fields,field,words", [
    ({"moe_router_topk": 9}, "model.moe_router_topk", "at most num_experts=8"),
    ({"moe_layer_freq": (1, 0)}, "model.moe_layer_freq", "num_layers=32"),
    ({"moe_layer_freq": 0}, "model.moe_layer_freq", "at least 1"),
    ({"moe_expert_imbalance": 5.0}, "model.moe_expert_imbalance", "= 4"),
    ({"moe_expert_capacity_factor": 1.0, "moe_router_load_balancing_type": "sinkhorn"},
     "model.moe_expert_capacity_factor", "aux_loss"),
])
def test_bad_moe_settings_name_the_field(fields, field, words):
    with pytest.raises(FieldError) as info:
        build_workload(_spec("mixtral-8x7b", **fields), _TRAINING, 1)
    assert info.value.path == field and words in str(info.value)


def _scenario(tp: int = 1, pp: int = 2, sp: bool = False, layers: int = 4) -> str:
    return f"""name: moe
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{count: 2, gpu: h100-sxm, nics: [{{type: ib, bandwidth_gbit_per_s: 400, count: 4, fabric: ib}},
          {{type: ethernet, bandwidth_gbit_per_s: 100}}]}}
model: {{preset: mixtral-8x7b, num_layers: {layers}, seq_length: 4096}}
training: {{global_batch_size: 32, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: {str(sp).lower()}}}
parallel: {{tensor: {tp}, pipeline: {pp}}}
policies: [megatron, holmes]
"""


@pytest.mark.parametrize("policy", ["megatron-llama", "megatron-llama-2023-08",
                                    "megatron-deepspeed"])
def test_frameworks_without_megatron_core_moe_refuse_an_moe_model(write_scenario, policy):
    """Even at expert: 1, where the forks used to simulate Megatron-Core's MoE layers; the
    refusal names the model's line, and the scenario's other policies still run."""
    text = _scenario().replace("policies: [megatron, holmes]", f"policies: [megatron, {policy}]")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("model:"))
    prepared = prepare(write_scenario(text))
    with pytest.raises(PlanError, match=rf"^{policy}: .*:{line}: model: this framework has no "
                                        "Megatron-Core mixture-of-experts layers"):
        run_policy(prepared, policy)
    assert run_policy(prepared, "megatron").result.iteration_time_s > 0


def test_moe_with_tp_needs_sequence_parallelism(write_scenario):
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(_scenario(tp=2)))
    assert "training.sequence_parallel" in str(info.value)


def test_grouped_gemm_shapes_and_capacity():
    """Dropless and balanced, the grouped GEMMs hold M k rows over E experts and their FLOPs are
    Megatron's routed-expert FLOPs; a capacity of 1 with the busiest expert at twice the mean
    drops its excess: M k / E x (1 + 7 x (8 - 2) / 7) rows."""
    w = build_workload(_spec("mixtral-8x7b", seq_length=4096), _TRAINING, 1)
    k = moe_mlp_kernels(w, 1)
    assert k.linear == (Gemm(1024, 2 * 14336, 4096, 8), Gemm(1024, 4096, 14336, 8))
    assert sum(g.flop for g in k.linear) == pytest.approx(2 * 4096 * 2 * 3 * 4096 * 14336)
    assert k.gemms == (Gemm(4096, 8, 4096),)
    capped = build_workload(_spec("mixtral-8x7b", seq_length=4096, moe_expert_imbalance=2.0,
                                  moe_expert_capacity_factor=1.0), _TRAINING, 1)
    assert capped.moe.routed_rows(4096) == 1024 + 7 * 1024 * 6 / 7
    assert moe_mlp_kernels(capped, 1).linear[0].m == 896


def _busiest_rank_rows_by_sampling(moe, tokens: int, ep: int, draws: int) -> float:
    """Mean over `draws` micro-batches of the busiest rank's rows when each of ep x tokens
    tokens picks k distinct experts uniformly at random (Megatron's forced load balancing:
    random normal logits, then top-k)."""
    rng = np.random.default_rng(7)
    picks = np.argsort(rng.random((draws, tokens * ep, moe.experts)), axis=2)[:, :, :moe.topk]
    rank = picks // (moe.experts // ep)
    counts = np.stack([(rank == r).sum(axis=(1, 2)) for r in range(ep)], axis=1)
    return float(counts.max(axis=1).mean())


@pytest.mark.parametrize("experts, topk, ep, tokens, draws", [(16, 2, 4, 256, 2000),
                                                               (64, 6, 8, 64, 2000)])
def test_random_routing_busiest_rank_matches_sampling(experts, topk, ep, tokens, draws):
    """The busiest EP rank's expected rows under random routing (order-statistic closed form)
    equal the mean of sampled micro-batches: the excess over the mean within 5%."""
    moe = dataclasses.replace(build_workload(_spec("mixtral-8x7b"), _TRAINING, 1).moe,
                              experts=experts, topk=topk)
    mean = tokens * topk
    sampled = _busiest_rank_rows_by_sampling(moe, tokens, ep, draws)
    closed = moe.rank_rows(tokens, ep)
    assert sampled > mean + 5
    assert closed - mean == pytest.approx(sampled - mean, rel=0.05)
    even = dataclasses.replace(moe, routing="even")
    assert even.rank_rows(tokens, ep) == mean


def test_random_routing_excess_is_capped_at_the_capacity():
    """A capacity factor of 1 caps every expert at its mean share, so random routing adds no
    rows; dropless, Mixtral 8x7B on EP 8 gets 8,192 + 119 rows (e_8 = 1.4236)."""
    dropless = build_workload(_spec("mixtral-8x7b", seq_length=4096), _TRAINING, 1).moe
    assert dropless.rank_rows(4096, 8) == round(8192 + 1.4236 * (32768 * 2 * 6 / 64 * 8 / 7) ** 0.5)
    capped = dataclasses.replace(dropless, capacity_factor=1.0)
    assert capped.rank_rows(4096, 8) == 8192
    assert expected_max_normal(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-9)


def test_moe_layer_costs_more_than_the_dense_mlp_of_its_flops():
    """Mixtral's MoE layer against a dense layer of FFN width k f_e (the same GEMM FLOPs): the
    router, permutations and 8 smaller GEMMs add time, each expert's weights make the backward's
    main-gradient adds 4x larger; forward within 15%."""
    training = dataclasses.replace(_TRAINING, flash_attention=True)
    moe = build_workload(_spec("mixtral-8x7b", seq_length=4096), training, 1)
    dense = build_workload(_spec("mixtral-8x7b", seq_length=4096, num_experts=None,
                                 ffn_hidden_size=2 * 14336, preset="mixtral-8x7b"), training, 1)
    assert moe.layer_forward_flop == pytest.approx(dense.layer_forward_flop, rel=1e-3)
    fwd_moe, fwd_dense = layer_s(_H100, moe, 1, False), layer_s(_H100, dense, 1, False)
    assert fwd_dense < fwd_moe < 1.15 * fwd_dense
    assert layer_s(_H100, moe, 1, True) > layer_s(_H100, dense, 1, True)


def test_tp_communication_counts_the_dispatched_rows():
    """Half a layer's TP collectives are the MLP's; Mixtral's MLP moves k = 2 times the tokens,
    Qwen1.5-MoE's 4 routed plus its shared expert's: 1.5 and 3 times a dense layer's."""
    assert tp_comm_factor(build_workload(_spec("mixtral-8x7b"), _TRAINING, 2), 2) == 1.5
    assert tp_comm_factor(build_workload(_spec("qwen1.5-moe-a2.7b"), _TRAINING, 2), 2) == 3.0


def test_exported_flags_exist_in_megatron_lm():
    """Every flag is in 93da800's parser (2025-12) but the shared expert's gate, which
    Megatron-LM has from core_v0.16.0 (`AFTER_RELEASE`, with its README note)."""
    w = build_workload(_spec("qwen2-57b-a14b", moe_layer_freq=(0,) + (1,) * 27,
                             moe_expert_capacity_factor=1.25), _TRAINING, 1)
    args = architecture_args(w)
    flags = [a for a in args if a.startswith("--")]
    assert all(f in _FLAGS["flags"] for f in flags if f not in AFTER_RELEASE), flags
    assert "--moe-shared-expert-gate" in flags
    i = args.index("--moe-layer-freq")
    assert args[i + 1] == "[0" + ",1" * 27 + "]"
    assert args[args.index("--num-experts") + 1] == "64"
    assert args[args.index("--moe-shared-expert-intermediate-size") + 1] == "20480"
    assert args[args.index("--moe-expert-capacity-factor") + 1] == "1.25"
    assert "--moe-grouped-gemm" in args and "alltoall" in args


@pytest.mark.parametrize("tp,pp", [(1, 2), (4, 2)])
def test_engine_and_estimate_see_the_moe_layers(write_scenario, tp, pp):
    """The engine and the analytic estimate run an MoE model; both slow down by the MoE
    layers' extra time against the same model with every layer dense."""
    text = _scenario(tp=tp, pp=pp, sp=tp > 1)
    prepared = prepare(write_scenario(text))
    dense = prepare(write_scenario(text.replace("num_layers: 4,",
                                                "num_layers: 4, moe_layer_freq: [0, 0, 0, 0],")))
    out, out_dense = run_policy(prepared, "megatron"), run_policy(dense, "megatron")
    est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
    assert out.result.iteration_time_s > 1.2 * out_dense.result.iteration_time_s
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=0.05)


def test_megatron_core_accepts_the_exported_moe_settings():
    """The exported MoE flags as Megatron-Core's TransformerConfig takes them (megatron-core's
    argument names; its __post_init__ checks the layer pattern, top-k and capacity)."""
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    w = build_workload(_spec("qwen1.5-moe-a2.7b", num_layers=4, moe_layer_freq=(0, 1, 1, 1),
                             moe_expert_capacity_factor=1.5), _TRAINING, 1)
    args = architecture_args(w)

    def value(flag):
        return args[args.index(flag) + 1]

    config = config_module.TransformerConfig(
        num_layers=4, hidden_size=w.hidden, num_attention_heads=w.heads, ffn_hidden_size=w.ffn,
        gated_linear_unit=True, add_bias_linear=False,
        num_moe_experts=int(value("--num-experts")), moe_router_topk=int(value("--moe-router-topk")),
        moe_ffn_hidden_size=int(value("--moe-ffn-hidden-size")),
        moe_shared_expert_intermediate_size=int(value("--moe-shared-expert-intermediate-size")),
        moe_layer_freq=json.loads(value("--moe-layer-freq")),
        moe_expert_capacity_factor=float(value("--moe-expert-capacity-factor")),
        moe_token_dispatcher_type=value("--moe-token-dispatcher-type"), moe_grouped_gemm=True)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.num_moe_experts == 60


def test_the_real_run_backend_takes_moe_and_refuses_shared_experts(tmp_path):
    """The backend runs routed experts (tests/backend/test_moe.py) but has no shared expert."""
    from holmes_sim.bundled import default_testbed
    from holmes_sim.validation.testbed_plan import check_backend

    text = default_testbed().read_text().replace("vocab_size: 512",
                                                 "vocab_size: 512\n  num_experts: 4")
    path = tmp_path / "moe.yaml"
    path.write_text(text)
    with pytest.raises(FieldError, match="model.moe_routing.*even"):
        check_backend(prepare(path))
    text = text.replace("num_experts: 4", "num_experts: 4\n  moe_routing: even")
    path.write_text(text)
    prepared = prepare(path)
    check_backend(prepared)
    assert prepared.workload.moe is not None
    shared = text.replace("num_experts: 4",
                          "num_experts: 4\n  moe_shared_expert_intermediate_size: 64")
    path.write_text(shared)
    with pytest.raises(FieldError, match="model.moe_shared_expert_intermediate_size"):
        check_backend(prepare(path))


def test_planner_runs_moe_with_tp_only_under_sequence_parallelism(write_scenario):
    """The plan search builds MoE layouts with TP > 1 only with SP (Megatron-Core refuses the
    others), and confirms its best plan by simulation."""
    from holmes_sim.search import planner

    text = _scenario(tp=2, sp=True) + ("search: {tensor: [1, 2, 4], pipeline: [1, 2], "
                                       "micro_batch_size: [1], schedule: [1f1b], top_k: 1}\n")
    prepared = prepare(write_scenario(text))
    grid = list(planner.layouts(prepared, prepared.scenario.search))
    assert any(lay.tp > 1 for lay in grid)
    assert all(lay.sequence_parallel for lay in grid if lay.tp > 1)
    result = planner.search(prepared)
    assert result.candidates and result.candidates[0].simulated


def test_memory_holds_every_experts_weights_and_optimizer_state(write_scenario):
    """TP 2 PP 2 DP 4 of a 4-layer Mixtral, 1F1B: stage 0 holds two layers with all 8 experts
    (split over TP; each rank holds the router and the two RMSNorms whole) and the embedding at
    6 + 12/4 bytes a parameter (bf16 weights, fp32 gradients, distributed optimizer over DP 4),
    plus 2 in-flight micro-batches of 2 layers' activations, each s b h (8 + 2k etp (h + 1)/h
    + 4E/h + 47) / t bytes with SP and fused attention: 8 replicated, the permuted rows and
    their probabilities gathered over expert TP (etp = t = 2), router logits 4E/h, 4 + 4k/h for
    Q, K, V and the projection, 2 k (2 f_e + f_e)/h = 42 for the experts' activations."""
    prepared = prepare(write_scenario(_scenario(tp=2, pp=2, sp=True)))
    out = run_policy(prepared, "megatron")
    w = prepared.workload
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 4096  # QKV, projection, 2 RMSNorms
    layer = attention + 8 * 4096 + 8 * 3 * 4096 * 14336  # router, 8 SwiGLU experts
    assert w.layer_params == layer
    whole = 2 * (8 * 4096 + 2 * 4096)  # two layers' router and RMSNorms
    state = ((2 * layer + w.vocab * 4096 - whole) / 2 + whole) * (6 + 12 / 4)
    per_layer = 4096 * 4096 * (8 + 2 * 2 * 2 * 4097 / 4096 + 8 * 4 / 4096 + 4 + 1 + 42) / 2
    assert w.activation_bytes_per_layer(2) == pytest.approx(per_layer, rel=1e-12)
    assert out.result.memory.per_stage_bytes[0] == pytest.approx(state + 2 * 2 * per_layer,
                                                                 rel=1e-9)


def test_userbuffer_overlap_leaves_the_dispatched_rows_exposed(write_scenario):
    """With --tp-comm-overlap the MoE layers' extra all-gather and reduce-scatter of the
    dispatched rows stay exposed: Mixtral's TP time exceeds the all-dense layers' by exactly
    (1.5 - 1) x 2 x (all-gather + reduce-scatter) per layer pass, each the collective NCCL picks
    (the dispatcher's go through torch.distributed, not Transformer Engine's userbuffers)."""
    from holmes_sim.cost.nccl_algorithms import collective_time_s
    from holmes_sim.cost.ops import OpCosts

    text = _scenario(tp=4, sp=True).replace("sequence_parallel: true",
                                            "sequence_parallel: true, tp_comm_overlap: true")
    moe = prepare(write_scenario(text))
    dense = prepare(write_scenario(text.replace("num_layers: 4,",
                                                "num_layers: 4, moe_layer_freq: [0, 0, 0, 0],")))
    node = moe.cluster.nodes[0]
    topology = OpCosts(moe.cluster, moe.workload, moe.compute, 4).tp_topology(node)
    half = sum(collective_time_s(topology, k, moe.workload.tp_allreduce_bytes())
               for k in ("all-gather", "reduce-scatter"))
    for backward in (False, True):
        got = [OpCosts(p.cluster, p.workload, p.compute, 4).tp_comm_s(node, 2, backward)
               for p in (moe, dense)]
        assert got[0] - got[1] == pytest.approx(2 * 0.5 * 2 * half, rel=1e-9)  # 2 layers


def test_an_moe_gelu_with_biases_pays_the_bias_add_it_exports():
    """Launched with --no-bias-gelu-fusion (TEGroupedMLP fuses a bias only into SwiGLU), every
    MLP adds fc1's bias on its own: 2 more bytes per fc1 output element forward, 1 backward,
    for the experts' rows as for the dense MLP, which the MoE layer's extra cost then removes."""
    w = build_workload(_spec("mixtral-8x7b", swiglu=False, bias=True), _TRAINING, 1)
    fused = dataclasses.replace(w, bias_added_apart=False)
    assert w.bias_added_apart and "--no-bias-gelu-fusion" in architecture_args(w)
    assert "--no-bias-gelu-fusion" not in architecture_args(fused)
    moe = w.moe
    rows = w.micro_batch * w.tokens * moe.topk  # every token's top-k expert rows, ETP 1
    apart, joint = moe_mlp_kernels(w, 1), moe_mlp_kernels(fused, 1)
    assert apart.bytes_fwd - joint.bytes_fwd == pytest.approx(2 * rows * moe.ffn * w.dtype_bytes)
    assert apart.bytes_bwd - joint.bytes_bwd == pytest.approx(rows * moe.ffn * w.dtype_bytes)
    dense_extra = 2 * w.micro_batch * w.tokens * w.ffn * w.dtype_bytes
    gap = layer_kernels(w, 1).other_bytes_fwd - layer_kernels(fused, 1).other_bytes_fwd
    assert gap == pytest.approx(dense_extra)  # the dense MLP's, in every layer
    assert build_workload(_spec("mixtral-8x7b"), _TRAINING, 1).bias_added_apart is False


@pytest.mark.parametrize(("fields", "reads"), [
    ({}, True),  # Mixtral's aux loss at its card's 0.02
    ({"moe_aux_loss_coeff": 0.0}, False),  # Megatron-Core returns before the loss at weight 0
    ({"moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.0}, False),
    ({"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}, False),
])
def test_the_balancing_loss_is_priced_only_where_megatron_computes_it(fields, reads):
    w = build_workload(_spec("mixtral-8x7b", **fields), _TRAINING, 1)
    plain = dataclasses.replace(w, moe=dataclasses.replace(w.moe, load_balancing="none"))
    probs = 4 * w.micro_batch * w.tokens * w.moe.experts  # fp32 router probabilities
    gap = moe_mlp_kernels(w, 1).bytes_fwd - moe_mlp_kernels(plain, 1).bytes_fwd
    assert gap == pytest.approx(probs if reads else 0.0)
