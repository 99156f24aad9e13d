"""Predicted step time of a layout (sppo_fx/solver/layout.py) and the byte counter of
bench/scale.py (sppo_fx/benchmark/calibration.py): structure only, no absolute times."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from sppo_fx.benchmark.calibration import CommCounter, _fit
from sppo_fx.solver.layout import LinkModel, attention_sites, predict_layout
from sppo_fx.solver.partition import balanced_lengths, cost_model_from_graph
from sppo_fx.solver.pipeline_chunks import ComputeModel, predict

LINK = LinkModel(latency_s=1e-4, bytes_per_s=1e9)
LINKS = dict(link_all_to_all=LINK, link_all_reduce=LINK, link_p2p=LINK)
T, B = 64, 2


@functools.lru_cache(maxsize=None)
def _llama_tiny():
    """(cost model, attention sites, parameter bytes, hidden) of llama-tiny at batch B
    (4 query heads, 2 K/V heads, head dim 8)."""
    from sppo_fx.capture import capture
    from sppo_fx.models import build
    from sppo_fx.passes import transform
    model = build("llama", "tiny")
    x = torch.randint(0, 97, (B, T))
    cap = capture(model, None, None, (x, x), {}, None, 1)
    graph, _ = transform(cap)
    params = [p.numel() * p.element_size() for p in model.parameters()]
    return cost_model_from_graph(graph, cap.seq), attention_sites(graph), params, model.config.dim


def _predict(pp=1, dp=1, sp=1, compute=ComputeModel(1e9, 0.0)):
    cost, sites, params, hidden = _llama_tiny()
    lengths = balanced_lengths(T, 4, cost)
    return predict_layout(cost, compute, lengths, pp, dp, sp, sites=sites, param_bytes=params,
                          boundary_bytes_per_token=B * hidden * 4, **LINKS), lengths


def test_attention_sites_read_the_heads_from_the_graph():
    _, sites, _, _ = _llama_tiny()
    assert len(sites) == 2  # two layers
    assert {(s.batch, s.q_heads, s.kv_heads, s.head_dim, s.dtype_bytes) for s in sites} == {(B, 4, 2, 8, 4)}


def test_single_rank_is_the_pipeline_clock_and_nothing_else():
    one, lengths = _predict()
    cost = _llama_tiny()[0]
    assert one.compute_seconds == pytest.approx(predict(cost, ComputeModel(1e9, 0.0), lengths, 1).step_seconds)
    assert one.step_seconds == one.compute_seconds
    assert not any(one.comm_bytes.values()) and not any(one.comm_calls.values())


def test_sequence_parallel_halves_compute_and_adds_all_to_alls_and_the_gradient_sum():
    one, lengths = _predict()
    two, _ = _predict(sp=2)
    _, sites, params, _ = _llama_tiny()
    assert two.compute_seconds == pytest.approx(one.compute_seconds / 2)
    # 4 all-to-alls forward (q, k, v, out) and 4 backward per site per chunk
    assert two.comm_calls["all-to-all"] == 8 * len(sites) * len(lengths)
    # per rank: its T/S tokens of q and out (4 heads) and k, v (2 heads), (S-1)/S of it leaves
    per_direction = B * (4 + 2 + 2 + 4) * T * 8 * 4 * (1 / 2) / 2
    assert two.comm_bytes["all-to-all"] == pytest.approx(2 * len(sites) * per_direction)
    assert two.comm_seconds["all-to-all"] == pytest.approx(
        two.comm_calls["all-to-all"] * LINK.latency_s + two.comm_bytes["all-to-all"] / LINK.bytes_per_s)
    # the gradients are summed over the S ranks too: 2 (n-1)/n of every parameter's bytes
    assert two.comm_bytes["all-reduce"] == pytest.approx(sum(params))
    assert two.comm_calls["all-reduce"] == len(params) and two.comm_seconds["all-reduce"] > 0
    assert two.step_seconds > two.compute_seconds and two.comm_bytes["p2p"] == 0


def test_sequence_parallel_beyond_the_kv_heads_moves_repeated_kv_heads():
    four, _ = _predict(sp=4)
    _, sites, _, _ = _llama_tiny()
    # S=4 > 2 K/V heads: k and v are repeated to 4 heads before the all-to-all
    per_direction = B * (4 + 4 + 4 + 4) * T * 8 * 4 * (3 / 4) / 4
    assert four.comm_bytes["all-to-all"] == pytest.approx(2 * len(sites) * per_direction)


def test_short_chunks_lose_efficiency_when_split():
    slow = ComputeModel(1e9, 32.0)
    one, _ = _predict(compute=slow)
    two, _ = _predict(sp=2, compute=slow)
    assert one.compute_seconds / 2 < two.compute_seconds < one.compute_seconds


def test_data_parallel_halves_compute_and_adds_only_the_gradient_all_reduce():
    one, _ = _predict()
    two, _ = _predict(dp=2)
    _, _, params, _ = _llama_tiny()
    assert two.compute_seconds == pytest.approx(one.compute_seconds / 2)
    assert two.comm_bytes["all-to-all"] == 0 and two.comm_calls["all-to-all"] == 0
    assert two.comm_bytes["all-reduce"] == pytest.approx(sum(params))
    assert two.comm_seconds["all-reduce"] == pytest.approx(len(params) * LINK.latency_s + sum(params) / 1e9)
    four, _ = _predict(dp=4)
    assert four.comm_bytes["all-reduce"] == pytest.approx(2 * 3 / 4 * sum(params))


def test_pipeline_is_the_schedule_clock_plus_boundary_transfers_on_fill_and_drain():
    two, lengths = _predict(pp=2)
    cost, _, _, hidden = _llama_tiny()
    assert two.compute_seconds == pytest.approx(predict(cost, ComputeModel(1e9, 0.0), lengths, 2).step_seconds)
    assert two.comm_bytes["p2p"] == pytest.approx(B * T * hidden * 4)
    assert two.comm_calls["p2p"] == len(lengths) and two.comm_bytes["all-reduce"] == 0
    assert two.comm_seconds["p2p"] == pytest.approx(
        LINK.seconds(lengths[0] * B * hidden * 4) + LINK.seconds(lengths[-1] * B * hidden * 4))
    # tied parameters (first and last stage): their gradients cross the boundary once per step
    tied = predict_layout(cost, ComputeModel(1e9, 0.0), lengths, 2, sites=_llama_tiny()[1], param_bytes=[],
                          boundary_bytes_per_token=B * hidden * 4, tied_param_bytes=[1000], **LINKS)
    assert tied.comm_bytes["p2p"] == pytest.approx(two.comm_bytes["p2p"] + 1000)
    assert tied.comm_calls["p2p"] == two.comm_calls["p2p"] + 1
    assert tied.comm_seconds["p2p"] == pytest.approx(two.comm_seconds["p2p"] + LINK.seconds(1000))
    one = predict_layout(cost, ComputeModel(1e9, 0.0), lengths, tied_param_bytes=[1000], **LINKS)
    assert one.comm_bytes["p2p"] == 0  # one stage: nothing to exchange


def test_link_fit_is_latency_plus_bandwidth_and_bounded_on_noise():
    link = _fit(small=1e-3, large=5e-3, sent_large=4e6)
    assert link.latency_s == 1e-3 and link.bytes_per_s == pytest.approx(1e9)
    noisy = _fit(small=6e-3, large=5e-3, sent_large=4e6)  # small slower than large: a busy machine
    assert noisy.bytes_per_s == pytest.approx(4e6 / 2.5e-3)


def test_comm_counter_counts_bytes_leaving_the_rank(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "isend", lambda t, *a, **k: calls.append("isend"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append("all_reduce"))
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: calls.append("all_to_all"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    x = torch.zeros(100)  # 400 bytes
    with CommCounter() as counter:
        dist.isend(x, 0)
        dist.all_reduce(x)
        dist.all_to_all_single(torch.empty(100), x, [50, 50], [30, 70])  # this rank keeps 70 elements
        dist.all_to_all_single(torch.empty(100), x)  # even: keeps half
    assert calls == ["isend", "all_reduce", "all_to_all", "all_to_all"]  # the real functions still ran
    assert counter.bytes == {"p2p": 400, "all-reduce": 400, "all-to-all": 30 * 4 + 50 * 4}
    assert counter.calls == {"p2p": 1, "all-reduce": 1, "all-to-all": 2}
    assert dist.isend is not None and counter.calls["p2p"] == 1
    dist.isend(x, 0)  # outside the context: not counted, the function is restored
    assert counter.calls["p2p"] == 1 and calls[-1] == "isend"
