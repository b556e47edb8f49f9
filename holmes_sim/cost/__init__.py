"""The cost models: how long every op of a plan takes on an idle machine, and where its bytes go.

- `compute`: GPU time of layers, embedding, logits and optimizer (shape-aware default, or a
  measured profile);
- `collectives`: closed-form alpha-beta times of rings and point-to-point sends, NCCL's bus
  bandwidth definitions;
- `nccl_algorithms`: which algorithm and protocol NCCL runs a collective with (its tuning
  model: ring, tree, NVLS, NVLS-tree, PAT; LL, LL128, Simple) and what it costs;
- `transport`: which transport (NVLink, RDMA fabric, TCP) a group uses, and each member's NIC;
- `paths`: the links of the flow network and the path (and NCCL ring) of a group's transfer,
  as the engine uses them (`Path`, `Ring`);
- `link_uses`: the same paths as the analytic estimate uses them (links with weights,
  latencies and rates, without `Path` objects);
- `ops`: one price list for the engine, the analytic estimate and the policies.

Imports go one way: cost depends on cluster, plan and workload, never on sim or policies.
"""
