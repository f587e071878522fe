"""Planning for several machines: the collectives' traffic (against a hand count), and doctor's checks of
what a run over several machines needs (faked interfaces and clocks)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from edgerl.doctor.multinode import Interface, Interfaces, check_backend, check_clocks, check_interface
from edgerl.plan.traffic import collective_traffic


def test_traffic_counts_each_collective_of_a_step():
    # 2 processes, 8 sequences each, micro-batch 4 (2 micro-steps), scoring 8 at once (1 pass), no critic:
    # all-gathers: rollout sync 1 + scoring 1 + update 2 x 2 = 6 of 1000 params x 2 bytes, plus the sharded
    # reference's 1 scoring pass; reduce-scatters: 2 of 1000 fp32 gradients; each process sends half.
    t = collective_traffic(trained_params=1000, compute_bytes=2, world=2, nodes=2, link_gbps=8e-6, sequences=8,
                           micro_batch=4, score_micro_batch=8, sharded_frozen=1000)
    assert t.gathered_bytes == (6 * 1000 * 2 + 1000 * 2) // 2
    assert t.reduced_bytes == 2 * 1000 * 4 // 2
    assert t.seconds == pytest.approx((t.gathered_bytes + t.reduced_bytes) * 8 / 8e3)
    assert collective_traffic(trained_params=1000, compute_bytes=2, world=1, nodes=1, link_gbps=1, sequences=8,
                              micro_batch=4, score_micro_batch=8).total_bytes == 0
    with pytest.raises(ValueError):
        collective_traffic(trained_params=1, compute_bytes=2, world=2, nodes=3, link_gbps=1, sequences=1,
                           micro_batch=1, score_micro_batch=1)


def test_recommend_for_several_machines_shows_the_traffic_and_refuses_a_batch_that_does_not_split():
    from edgerl.cli.main import app
    res = CliRunner().invoke(app, ["recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b", "--gpus", "1",
                                   "--nodes", "2", "--link-gbps", "10"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "collectives:" in res.output and "over 2 machines at 10 Gbit/s" in res.output
    bad = CliRunner().invoke(app, ["recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b", "--nodes", "3"])
    assert bad.exit_code == 2 and "does not split over 3 GPUs" in bad.output


def test_backend_check():
    assert check_backend(True, lambda: "2.21.5", lambda: True).status == "ok"
    assert check_backend(True, lambda: None, lambda: True).status == "fail"
    assert check_backend(False, lambda: None, lambda: True).status == "ok"
    assert check_backend(False, lambda: None, lambda: False).status == "fail"


def test_interface_check_names_the_one_to_set():
    lo = Interface("lo", True, 0, ("127.0.0.1",))
    eth = Interface("eth0", True, 1000, ("10.0.0.5",))
    docker = Interface("docker0", True, 0, ("172.17.0.1",))
    one = check_interface(Interfaces([lo, eth]))
    assert one.status == "ok" and "NCCL_SOCKET_IFNAME=eth0" in one.fix
    many = check_interface(Interfaces([lo, eth, docker]))
    assert many.status == "warn" and "eth0" in many.detail and "docker0" in many.detail
    named = check_interface(Interfaces([lo, eth, docker], env={"NCCL_SOCKET_IFNAME": "eth"}))
    assert named.status == "ok"
    wrong = check_interface(Interfaces([lo, eth], env={"GLOO_SOCKET_IFNAME": "enp3s0"}))
    assert wrong.status == "fail" and "GLOO_SOCKET_IFNAME=enp3s0" in wrong.detail and "eth0" in wrong.fix
    none = check_interface(Interfaces([lo]))
    assert none.status == "fail"


def test_clock_check():
    assert check_clocks(None).status == "skip"
    assert check_clocks([100.0, 100.2]).status == "ok"
    late = check_clocks([100.0, 100.1, 104.0])
    assert late.status == "warn" and "rank 2" in late.detail and "+4.0 s" in late.detail


def test_recommend_json_for_several_gpus_carries_the_traffic():
    import json
    from edgerl.cli.main import app
    res = CliRunner().invoke(app, ["recommend", "--gpu", "p40", "--model", "qwen2.5-0.5b", "--gpus", "2",
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["traffic"]["world"] == 2 and doc["traffic"]["total_bytes"] > 0 and doc["traffic"]["nodes"] == 1
