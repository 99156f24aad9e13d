"""The benchmark picture (sppo_fx/benchmark/plot.py): matplotlib draws it with labelled
points, a legend, log axes where values span decades and readable units; a clear
SppoError names the extra to install when matplotlib is missing; `--replot` redraws
committed records."""
from __future__ import annotations

import json
import sys

import pytest

from sppo_fx.benchmark import plot
from sppo_fx.cli import main
from sppo_fx.errors import SppoError

MiB = 2**20
POINTS = [plot.Point("eager", 10.0, 4000 * MiB, True), plot.Point("compile", 8.0, 3000 * MiB, True),
          plot.Point("checkpoint", 12.0, 700 * MiB, True), plot.Point("sppo 50%", 9.0, 1600 * MiB),
          plot.Point("sppo 25%", 11.0, 1000 * MiB), plot.Point("sppo slow", 13.0, 1200 * MiB)]
# spans decades in both: 100 MiB..8 GiB and 5 s..2000 s
WIDE = [plot.Point("eager", 5.0, 8192 * MiB, True), plot.Point("sppo min", 2000.0, 100 * MiB),
        plot.Point("sppo 25%", 6.0, 2048 * MiB)]


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_every_point_is_labelled_and_the_legend_names_anchors_rows_and_front():
    pytest.importorskip("matplotlib", reason="matplotlib (the sppo_fx[plot] extra) is not installed")
    fig, ax = plot.figure(POINTS, "hand-made")
    try:
        assert sorted(_texts(ax)) == sorted(p.label for p in POINTS)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert any("anchor" in t for t in legend) and any("sppo_fx" in t for t in legend)
        assert any("Pareto" in t for t in legend)
        front_line = ax.lines[0]  # the front, joined in memory order
        assert list(front_line.get_xdata()) == [700, 1000, 1600, 3000]
        assert ax.get_title() == "hand-made"
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_axes_are_log_where_values_span_decades_and_ticks_read_in_units():
    pytest.importorskip("matplotlib", reason="matplotlib (the sppo_fx[plot] extra) is not installed")
    import matplotlib.pyplot as plt
    fig, ax = plot.figure(POINTS)
    assert (ax.get_xscale(), ax.get_yscale()) == ("linear", "linear")  # 700..4000 MiB, 8..13 s
    plt.close(fig)
    fig, ax = plot.figure(WIDE)
    try:
        assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
        fig.canvas.draw()
        xt = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        yt = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert "128 MiB" in xt and "1 GiB" in xt and "8 GiB" in xt, xt
        assert "10 s" in yt and "1000 s" in yt, yt
        assert not any("e+" in t for t in xt + yt)
    finally:
        plt.close(fig)
    assert plot._size_label(1536) == "1.5 GiB" and plot._size_label(512) == "512 MiB"
    assert plot._seconds_label(0.25) == "250 ms" and plot._seconds_label(0) == "0"


def test_picture_files_are_written_by_suffix_and_identical_on_redraw(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the sppo_fx[plot] extra) is not installed")
    png = str(tmp_path / "p.png")
    assert plot.write_picture(POINTS, png, "t") == [png, str(tmp_path / "p.svg")]
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "p.svg").read_text()
    assert "<svg" in svg and "sppo slow" in svg  # labels stay text in the SVG
    plot.write_picture(POINTS, png, "t")
    assert (tmp_path / "p.png").read_bytes() == data and (tmp_path / "p.svg").read_text() == svg
    only = str(tmp_path / "only.svg")
    assert plot.write_picture(POINTS[:2], only) == [only]
    with pytest.raises(SppoError, match="no measured rows"):
        plot.write_picture([], str(tmp_path / "none.png"))


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    # None in sys.modules makes `import matplotlib` raise ImportError, as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SppoError, match=r"pip install 'sppo_fx\[plot\]'"):
        plot.write_picture(POINTS, str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()
    # a grid with --plot stops before its first row, not after hours of running
    with pytest.raises(SppoError, match="sppo_fx"):
        plot.require_matplotlib()
    assert plot.text_plot(POINTS).count("[Pareto front]") == 4  # the terminal plot needs nothing


def _record(path, rows):
    path.write_text(json.dumps({"grid": [], "rounds": 1, "runs": [], "rows": rows, "machine": {},
                                "commit": "x", "baseline": None}))
    return str(path)


def test_replot_merges_records_first_label_wins_and_skips_failed_rows(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the sppo_fx[plot] extra) is not installed")
    a = _record(tmp_path / "a.json", [
        {"label": "eager", "step_s": 10.0, "peak_extra_bytes": 4000 * MiB, "anchor": True},
        {"label": "sppo min", "error": "timed out", "step_s": None, "peak_extra_bytes": None}])
    b = _record(tmp_path / "b.json", [
        {"label": "eager", "step_s": 99.0, "peak_extra_bytes": 4000 * MiB, "anchor": True},
        {"label": "sppo min", "step_s": 500.0, "peak_extra_bytes": 400 * MiB}])
    points = plot.points_of_records([a, b])
    assert [(p.label, p.seconds) for p in points] == [("eager", 10.0), ("sppo min", 500.0)]
    out = tmp_path / "r.png"
    assert main(["bench", "--replot", a, b, "--plot", str(out), "--title", "merged"]) == 0
    assert out.stat().st_size > 0 and (tmp_path / "r.svg").exists()
    assert "merged" in (tmp_path / "r.svg").read_text()
    capsys.readouterr()
    assert main(["bench", "--replot", a]) == 2  # nothing to draw into
    assert "--plot" in capsys.readouterr().err
