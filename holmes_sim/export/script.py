"""The launch script and README of an export: one `launch.sh` that every node runs, for upstream
Megatron-LM or the Holmes fork, and what the user must still add.

A node finds its rank by its host name in the plan's host list (`hostname -s`, `hostname -f` or
`hostname`, in any case: DNS names are case-insensitive, RFC 4343), or from `NODE_RANK` (a whole number below the node count); `MASTER_ADDR` defaults to
the first host (torchrun's rendezvous, PyTorch elastic documentation); `DRY_RUN` set to anything
but empty or 0 prints the command instead of running it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from holmes_sim.plan import Plan


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    """What launch.sh needs of one node, in rank order: its host, GPUs, Holmes device type and
    the NCCL environment under each target."""

    host: str
    gpus: int
    device_type: str
    env_megatron: dict[str, str]
    env_holmes: dict[str, str]


_FIND_RANK = '''DRY=""
if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != 0 ]]; then DRY=1; fi
if [[ -n "${NODE_RANK:-}" ]]; then
  if [[ ! "$NODE_RANK" =~ ^[0-9]{1,6}$ ]] || (( 10#$NODE_RANK >= ${#HOSTS[@]} )); then
    echo "NODE_RANK=$NODE_RANK: give this node's rank, a whole number from 0 to" \\
         "$(( ${#HOSTS[@]} - 1 )) (the plan has ${#HOSTS[@]} nodes), or unset it" >&2
    exit 2
  fi
  rank=$(( 10#$NODE_RANK ))
else
  rank=""
  for name in "$(hostname -s)" "$(hostname -f 2>/dev/null || true)" "$(hostname)"; do
    for i in "${!HOSTS[@]}"; do
      if [[ -z "$rank" && "${HOSTS[$i],,}" == "${name,,}" ]]; then rank=$i; fi
    done
  done
  if [[ -z "$rank" ]]; then
    echo "$(hostname) is not one of this plan's hosts (${HOSTS[*]}); export with --hosts FILE" \\
         "or set NODE_RANK" >&2
    exit 2
  fi
fi
MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]}}"
MASTER_PORT="${MASTER_PORT:-%d}"
'''

_RUN = '''case "$TARGET" in
  megatron) args=("${MEGATRON_ARGS[@]}"); node_env=${ENV_MEGATRON[$rank]} ;;
  holmes)
    if (( ${#HOLMES_ARGS[@]} == 0 )); then
      echo "the Holmes fork cannot run this plan (holmes_args.txt says why)" >&2; exit 2
    fi
    if [[ -z "$DRY" && ! -f config.json ]]; then
      echo "run from the Holmes fork's checkout with holmes_config.json copied there as" \\
           "config.json (its per-group NCCL settings)" >&2; exit 2
    fi
    args=("${HOLMES_ARGS[@]}" --hetero-current-device-type "${TYPES[$rank]}")
    node_env=${ENV_HOLMES[$rank]} ;;
  *) echo "usage: launch.sh [megatron|holmes] [more pretrain_gpt.py arguments]" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206  # node_env is KEY=VALUE words without spaces
cmd=(env $node_env torchrun --nnodes "${#HOSTS[@]}" --nproc-per-node "${GPUS[$rank]}"
     --node-rank "$rank" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "$SCRIPT" "${args[@]}" "$@")
if [[ -n "$DRY" ]]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
'''


def _array(name: str, words: list[str]) -> str:
    return f"{name}=({' '.join(shlex.quote(w) for w in words)})"


def _env_words(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def _with_ub_config(ub_config: str, fork: list[str]) -> list[str]:
    """Lines of launch.sh that pass `ub_config`, a file of the launch folder, by its absolute path
    as `--tp-comm-overlap-cfg` to upstream Megatron-LM and, when it runs the plan, the fork."""
    lines = [f'UB_CONFIG="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)/{ub_config}"',
             'MEGATRON_ARGS+=(--tp-comm-overlap-cfg "$UB_CONFIG")']
    if fork:
        lines.append('HOLMES_ARGS+=(--tp-comm-overlap-cfg "$UB_CONFIG")')
    return lines


def launch_script(nodes: list[NodeLaunch], margs: list[str], fork: list[str], script: str,
                  net: str, master_port: int, ub_config: str | None = None) -> str:
    """`launch.sh [megatron|holmes] [extra arguments]`, the same file on every node; `ub_config`,
    a Transformer Engine userbuffer configuration in the launch folder that both targets get as
    `--tp-comm-overlap-cfg` with its absolute path."""
    lines = [
        "#!/usr/bin/env bash",
        "# Run on every node: launch.sh [megatron|holmes] [data, tokenizer, schedule and checkpoint",
        "# arguments] (README.md). megatron: upstream Megatron-LM; holmes: the Holmes fork.",
        "# The node's rank is its host's place in HOSTS (or NODE_RANK, 0..N-1); DRY_RUN=1 (any",
        "# value but empty or 0) prints the command instead of running it.",
        "set -euo pipefail",
        'TARGET="${1:-megatron}"',
        "shift || true",
        _array("HOSTS", [n.host for n in nodes]),
        _array("GPUS", [str(n.gpus) for n in nodes]),
        _array("TYPES", [n.device_type for n in nodes]),
        f"# upstream Megatron-LM: one network for the whole job (NCCL_NET={net})",
        _array("ENV_MEGATRON", [_env_words(n.env_megatron) for n in nodes]),
        "# the Holmes fork: the world group on TCP; config.json sets each group's network",
        _array("ENV_HOLMES", [_env_words(n.env_holmes) for n in nodes]),
        _array("MEGATRON_ARGS", margs),
        _array("HOLMES_ARGS", fork),
        *(_with_ub_config(ub_config, fork) if ub_config else []),
        f"SCRIPT={shlex.quote(script)}",
        _FIND_RANK % master_port + _RUN,
    ]
    return "\n".join(lines)


_USER_ARGS = """\
| what | upstream Megatron-LM and the Holmes fork |
|---|---|
| data | `--data-path PREFIX` (a Megatron `.bin`/`.idx` prefix from `tools/preprocess_data.py`), `--split 949,50,1`; or `--mock-data` (upstream) to try the launch |
| tokenizer | the one of the vocabulary simulated (*Tokenizer* below): `--tokenizer-type` with its `--tokenizer-model` or `--vocab-file` and `--merge-file` |
| schedule | `--train-iters N` (or `--train-samples`), `--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000`, `--weight-decay 0.1`, `--clip-grad 1.0` |
| checkpoints | `--save DIR --load DIR --save-interval 1000` |
| logging | `--log-interval 10 --eval-interval 1000 --eval-iters 10` |
"""


def launch_readme(plan: Plan, hosts: list[str], net: str, holmes_why_not: str | None,
                  groups: dict[str, dict[str, str]], notes: tuple[str, ...], *,
                  tokenizer: list[str], vocabulary: str,
                  splits: dict[str, str] | None = None, job_nccl: str = "") -> str:
    """README.md of an export: files, how to start, what to add (`tokenizer`: the tokenizer
    arguments of its example; `vocabulary`: the paragraph on the vocabulary simulated and the
    tokenizer to use), what upstream cannot express (`groups`: per group class its transports
    and NCCL setting, as in nccl.json; `splits`: per group class, the nodes its RDMA groups
    share that the plan runs on two fabrics, `nccl_env.fabric_splits`; `job_nccl`: the sentence
    on the NCCL settings every node runs with, `nccl_env.job_env_text`), and `notes` on
    exported arguments some Megatron-LM releases refuse."""
    splits = splits or {}
    fork = (f"The Holmes fork cannot run this plan: {holmes_why_not}." if holmes_why_not else
            "For the Holmes fork, copy `holmes_config.json` into the fork's checkout as "
            "`config.json` and run `launch_holmes.sh` from there: it creates every group under "
            "that group's NCCL settings (`megatron/core/hetnet.py`).")
    example = ("./launch_megatron.sh --data-path /data/my-corpus_text_document --split 949,50,1 \\\n"
               f"  {shlex.join(tokenizer)} \\\n"
               "  --train-iters 10000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine "
               "--lr-warmup-iters 500 \\\n"
               "  --save ckpt --load ckpt --save-interval 1000 --log-interval 10 "
               "--eval-interval 1000 --eval-iters 10")
    return "\n".join([
        f"# Launching the {plan.policy} plan", "",
        f"Nodes in rank order: {', '.join(hosts)} (`hostfile`). On every node, in a Megatron-LM "
        "checkout with this folder copied in, run `launch_megatron.sh` (upstream Megatron-LM, "
        "`megatron_args.txt`) or `launch_holmes.sh` (the Holmes fork, `holmes_args.txt`). Each "
        "node finds its rank by its host name; if the names differ from the list above, export "
        "again with `--hosts FILE` (one host a line for each of the scenario's nodes in the "
        "scenario's order, not this one, or `HOST NODE` lines) or set `NODE_RANK` and "
        "`MASTER_ADDR` yourself. `DRY_RUN=1` prints the command a node would run.", "",
        "## Arguments you must still add", "",
        "The exported arguments fix the model shape, parallel layout, batch, precision, recompute "
        "and optimizer. Add these after the script name:", "", _USER_ARGS,
        "For example:", "", "```bash", example, "```", "",
        "## Tokenizer", "", vocabulary, "",
        "## Networks", "",
        f"NCCL picks one network per communicator, from the environment when it is created. "
        f"Upstream Megatron-LM creates all groups under one environment, so the whole job uses "
        f"`NCCL_NET={net}` (`nccl.json`, `upstream_job_wide`). Per group class:", "",
        *network_rows(groups, net, splits), "", upstream_gap(groups, net, splits), "",
        fork, "",
        "`nccl.json` lists each node's NCCL settings and the transport of every group; the "
        "device names in them are the scenario's `nics[].devices` where given (see the notes): "
        "give them there and export again, or edit the `ENV_*` lines of `launch.sh` and "
        "`holmes_config.json`." + (f" {job_nccl}" if job_nccl else ""), "",
        *(["## Notes", "", *[f"- {note}" for note in notes], ""] if notes else []),
    ])


def _under_upstream(kind: str, transports: str, net: str, splits: dict[str, str]) -> str:
    """How a group class with the plan's `transports` runs under the job-wide `net`."""
    kinds = {t.split(":", 1)[0] for t in transports.split(", ")}
    if kinds <= {"local"}:
        return "as planned (inside a node: NVLink/P2P, whatever NCCL_NET says)"
    if net == "Socket" and "rdma" in kinds:
        return "TCP (NCCL_NET=Socket on NCCL_SOCKET_IFNAME): not as planned"
    if kind in splits:
        return "one NCCL_IB_HCA for two fabrics on some nodes: not as planned"
    return "as planned"


def network_rows(groups: dict[str, dict[str, str]], net: str,
                 splits: dict[str, str] | None = None) -> list[str]:
    """A Markdown table: each group class, the plan's transports and NCCL setting, and how it
    runs under upstream Megatron-LM's job-wide `NCCL_NET=net` (`splits`: `launch_readme`)."""
    rows = ["| groups | plan's transports | NCCL setting the plan needs | under upstream Megatron-LM |",
            "|---|---|---|---|"]
    rows += [f"| {kind} | {g['transports']} | {g['nccl']} | "
             f"{_under_upstream(kind, g['transports'], net, splits or {})} |"
             for kind, g in groups.items()]
    return rows


def upstream_gap(groups: dict[str, dict[str, str]], net: str,
                 splits: dict[str, str] | None = None) -> str:
    """Exactly which of the plan's group transports upstream cannot express (`splits`:
    `launch_readme`)."""
    splits = splits or {}
    lost = [f"the {kind} groups on "
            + ", ".join(t for t in g["transports"].split(", ") if t.startswith("rdma:"))
            for kind, g in groups.items()
            if _under_upstream(kind, g["transports"], net, {}).endswith("not as planned")]
    if not lost and not splits:
        return ("Upstream Megatron-LM can express every group's transport of this plan; the "
                "placement comes from the node order (`hostfile`) and the layout arguments.")
    gap = [] if not lost else [
        f"What upstream Megatron-LM cannot express: RDMA for {'; '.join(lost)}. It has one "
        "NCCL_NET per job, and the plan's TCP groups (or nodes without a shared RDMA fabric) "
        "force it to Socket, so these groups run over TCP and the job runs slower than "
        "predicted for the plan; the Holmes fork sets each group's network."]
    if splits:
        by_nodes: dict[str, list[str]] = {}
        for kind, nodes in splits.items():
            by_nodes.setdefault(nodes, []).append(kind)
        where = "; ".join(f"the {', '.join(kinds)} groups of {nodes}"
                          for nodes, kinds in by_nodes.items())
        gap.append(
            f"Upstream Megatron-LM cannot run as planned {where}: the plan runs these nodes' "
            "groups on two RDMA fabrics, and in one process environment their `NCCL_IB_HCA` "
            "lists the HCAs of both. NCCL picks each GPU's HCA by locality, not by its peers' "
            "fabric, so a group may pair HCAs of two fabrics, which cannot reach each other "
            "(NCCL 2.26 and later stop with \"Attempted to connect incompatible devices\" "
            "between InfiniBand and RoCE). The Holmes fork sets each group's HCAs; under "
            "upstream, `NCCL_NET=Socket` in the `ENV_MEGATRON` lines of `launch.sh` runs every "
            "group over TCP instead.")
    return " ".join(gap)
