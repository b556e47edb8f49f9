"""Sweep plots: a numeric field's points in increasing order, and policies with the same
results each visible (their own marker and line style, and a legend note)."""

from __future__ import annotations

from holmes_sim.report import plots

FIELD = "inter_cluster_links[0].bandwidth_gbit_per_s"


def _rows(times: dict[str, list[float]], xs: list, other: list | None = None) -> list[dict]:
    rows = []
    for z in other or [None]:
        for i, x in enumerate(xs):
            for policy, ys in times.items():
                row = {FIELD: x, "policy": policy, "status": "ok", "iteration_time_s": ys[i]}
                if z is not None:
                    row["training.micro_batch_size"] = z
                rows.append(row)
    return rows


def test_a_numeric_field_is_drawn_in_increasing_order():
    rows = _rows({"megatron": [1.0, 4.0, 2.0], "holmes": [0.5, 3.0, 1.5]}, [200, 50, 100])
    fig = plots.sweep_figure(rows, [FIELD], "iteration_time_s", "iteration time (s)")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["megatron"].get_xdata()) == [50, 100, 200]
    assert list(lines["megatron"].get_ydata()) == [4.0, 2.0, 1.0]
    assert list(lines["holmes"].get_ydata()) == [3.0, 1.5, 0.5]
    plots.pyplot().close(fig)


def test_policies_with_the_same_results_are_each_visible_and_named():
    same = [1.0, 2.0, 3.0]
    rows = _rows({"holmes": same, "holmes-no-overlap": list(same), "megatron": [2.0, 3.0, 4.0]},
                 [1, 2, 4], other=[1, 2])
    fig = plots.sweep_figure(rows, [FIELD, "training.micro_batch_size"], "iteration_time_s",
                             "iteration time (s)")
    for ax in fig.axes[:2]:
        lines = ax.get_lines()
        styles = {(line.get_marker(), line.get_linestyle()) for line in lines}
        assert len(styles) == len(lines) == 3
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["holmes", "holmes-no-overlap (same as holmes)", "megatron"]
    plots.pyplot().close(fig)
