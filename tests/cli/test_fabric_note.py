"""An RDMA fabric declared in two clusters carries their RDMA traffic instead of the
inter-cluster link: `check`, `run` and `plan` say so once on standard error."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app

TWO_PODS = """name: two-pods
fabrics: [{{name: ib-a, type: ib}}, {{name: ib-b, type: ib}}]
clusters:
  - name: pod-a
    nodes:
      - {{name: a, count: 2, gpu: a100-80gb, nics: [{{type: ib, model: ib-hdr, count: 4, fabric: ib-a}},
                                             {{type: ethernet, model: eth-100g}}]}}
  - name: pod-b
    nodes:
      - {{name: b, count: 2, gpu: a100-80gb, nics: [{{type: ib, model: ib-hdr, count: 4, fabric: {fabric}}},
                                             {{type: ethernet, model: eth-100g}}]}}
inter_cluster_links:
  - {{clusters: [pod-a, pod-b], bandwidth_gbit_per_s: 1, latency_us: 1000}}
model: {{num_layers: 8, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024}}
training: {{global_batch_size: 16, micro_batch_size: 1}}
parallel: {{tensor: 8, pipeline: 2}}
policies: [megatron, holmes]
search: {{tensor: [8], pipeline: [2], micro_batch_size: [1], schedule: [1f1b], recompute: [selective],
         top_k: 1}}
"""
NOTE = ("note: fabric ib-a joins clusters pod-a and pod-b: RDMA traffic between them uses the "
        "fabric, not the inter-cluster link (declare one fabric per cluster to route it over the "
        "link)\n")


@pytest.mark.parametrize("command", [["check"], ["run", "-q"], ["plan", "-j", "1"]])
def test_a_fabric_joining_two_clusters_is_named_once_on_stderr(write_scenario, command):
    # A 1 Gb/s and a 100 Gb/s inter-cluster link gave the same results, without a word.
    path = write_scenario(TWO_PODS.format(fabric="ib-a"))
    result = CliRunner().invoke(app, [command[0], str(path), *command[1:]],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert result.stderr.count("note: fabric") == 1 and NOTE in result.stderr
    assert "note: fabric" not in result.stdout


def test_one_fabric_per_cluster_gives_no_note(write_scenario):
    path = write_scenario(TWO_PODS.format(fabric="ib-b"))
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    assert "note: fabric" not in result.output
