"""An RDMA fabric declared in two clusters carries their RDMA traffic instead of the
inter-cluster link: `check`, `run`, `plan` and `sweep` say so once on standard error."""

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


def _sweep(path, tmp_path, *sets: str):
    args = [a for s in sets for a in ("--set", s)]
    return CliRunner().invoke(app, ["sweep", str(path), *args, "-q", "-j", "2", "--out",
                                    str(tmp_path / "out")], env={"COLUMNS": "400"})


def test_a_sweep_names_a_fabric_joining_two_clusters_once_not_once_per_point(write_scenario,
                                                                              tmp_path):
    # run said it; a sweep of the very link the fabric bypasses (1 and 100 Gb/s, the same
    # figures) said nothing.
    path = write_scenario(TWO_PODS.format(fabric="ib-a"))
    result = _sweep(path, tmp_path, "inter_cluster_links[0].bandwidth_gbit_per_s=1,100")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("note: fabric") == 1 and NOTE in result.stderr


def test_a_sweep_names_the_points_a_fabric_note_is_about(write_scenario, tmp_path):
    """Only the points that prepared count: point 1 (TP 3) is infeasible, point 2 has a fabric
    per cluster."""
    path = write_scenario(TWO_PODS.format(fabric="ib-a"))
    result = _sweep(path, tmp_path, "clusters[1].nodes[0].nics[0].fabric=ib-a,ib-b",
                    "parallel.tensor=8,3")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("fabric ib-a joins") == 1
    assert NOTE.replace("note: ", "note: at point 0, ") in result.stderr


def test_sweep_notes_are_each_given_once_with_the_points_they_are_about():
    from holmes_sim.search.sweep import SweepPoint, sweep_notes

    points = [SweepPoint(i, (), "") for i in range(4)]
    assert sweep_notes(points, [("note: x",), None, ("note: x", "note: y"), ()]) == [
        "note: at points 0, 2, x", "note: at point 2, y"]
    assert sweep_notes(points, [("note: x",), None, ("note: x",), ("note: x",)]) == ["note: x"]
