"""Shared fixtures: small scenarios written to tmp files."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "scenarios"
TESTBED = REPO / "validation" / "testbeds" / "default.yaml"
"""The default real-run testbed."""


def default_testbed_with(tmp_path: Path, old: str, new: str) -> Path:
    """`TESTBED` with its text `old` (which it must hold) replaced by `new`, written to
    tmp_path / tb.yaml."""
    text = TESTBED.read_text()
    assert old in text
    path = tmp_path / "tb.yaml"
    path.write_text(text.replace(old, new))
    return path


def small_scenario(*, nodes_ib: int = 2, nodes_roce: int = 0, nodes_eth: int = 0, gpus: int = 8,
                   tp: int = 8, pp: int = 2, layers: int = 8, hidden: int = 1024, heads: int = 16,
                   seq: int = 1024, vocab: int = 51200, global_batch: int = 16, micro: int = 1,
                   schedule: str = "1f1b", virtual: int = 1, policies: str = "[megatron, holmes]",
                   ib_gbit: float = 200, eth_gbit: float = 100, latency_us: float | None = None,
                   tie: bool = True, extra: str = "") -> str:
    """YAML of a one-cluster scenario with IB, RoCE and Ethernet-only node groups (in that order)."""
    lat = "" if latency_us is None else f", latency_us: {latency_us}"
    eth = f"{{type: ethernet, bandwidth_gbit_per_s: {eth_gbit}{lat}}}"

    def group(name: str, count: int, rdma: str | None) -> str:
        nics = [f"{{type: {rdma}, bandwidth_gbit_per_s: {ib_gbit}, count: 1, fabric: {rdma}{lat}}}"] \
            if rdma else []
        return (f"      - {{name: {name}, count: {count}, gpu: a100-80gb, gpus_per_node: {gpus}, "
                f"nics: [{', '.join([*nics, eth])}]}}")

    groups = [group(name, count, rdma) for name, count, rdma in
              (("ib", nodes_ib, "ib"), ("roce", nodes_roce, "roce"), ("eth", nodes_eth, None)) if count]
    nodes = "\n".join(groups)
    return f"""name: small
seed: 0
fabrics:
  - {{name: ib, type: ib}}
  - {{name: roce, type: roce}}
clusters:
  - name: c
    nodes:
{nodes}
model: {{num_layers: {layers}, hidden_size: {hidden}, num_attention_heads: {heads},
        seq_length: {seq}, vocab_size: {vocab}, tie_embeddings: {str(tie).lower()}}}
training: {{global_batch_size: {global_batch}, micro_batch_size: {micro}}}
parallel: {{tensor: {tp}, pipeline: {pp}, schedule: {schedule}, virtual_stages: {virtual}}}
policies: {policies}
{extra}"""


@pytest.fixture
def write_scenario(tmp_path):
    """Write YAML text to a file in tmp_path and return its path."""
    counter = iter(range(1000))

    def write(text: str) -> Path:
        path = tmp_path / f"scenario{next(counter)}.yaml"
        path.write_text(text)
        return path

    return write


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json from the current simulator")


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")
