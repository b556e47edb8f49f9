"""Rich tables for the terminal."""

from __future__ import annotations

from rich.table import Table

from holmes_sim.runner import Outcome, speedups


def results_table(title: str, outcomes: list[Outcome]) -> Table:
    """One row per policy, fastest first, with the speed-up over megatron."""
    ups = speedups(outcomes)
    table = Table(title=title, title_justify="left")
    for col, just in (("policy", "left"), ("iter s", "right"), ("TFLOP/s/GPU", "right"),
                      ("samples/s", "right"), ("MFU", "right"), ("bubble", "right"),
                      ("DP exposed s", "right"), ("PP exposed s", "right"),
                      ("layers/stage", "left"), ("mem GiB", "right"), ("speed-up", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for o in outcomes:
        r = o.result
        mem = f"{r.memory.peak_gib:.1f}" + ("" if r.memory.fits else " [red]OOM[/red]")
        up = f"{ups[r.policy]:.2f}x" if ups else "-"
        table.add_row(r.policy, f"{r.iteration_time_s:.3f}", f"{r.tflops_per_gpu:.1f}",
                      f"{r.samples_per_s:.1f}", f"{r.mfu:.1%}", f"{r.bubble_fraction:.1%}",
                      f"{r.breakdown_s['dp_exposed']:.3f}", f"{r.breakdown_s['pp_exposed']:.3f}",
                      _layers(r.layers_per_stage), mem, up)
    return table


def _layers(layers: tuple[int, ...]) -> str:
    text = "/".join(map(str, layers))
    return text if len(text) <= 24 else text[:21] + "..."
