"""The bandwidth model against hand-computed times, and the CLI's --predict and --plot."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import reshard
from reshard.cli import main
from reshard.errors import PlanError
from reshard.planner.cost import ClusterModel, compare_with_measurement, predict, transfer_table

CONFIG = "examples/configs/qwen3-0.6b.json"


@pytest.fixture(scope="module")
def model():
    return reshard.ModelSpec.from_hf_config(CONFIG)


def _one_to_one(model, **kw):
    return reshard.compile(reshard.HfLayout(model=model), reshard.VllmLayout(model=model, tp=1), **kw)


def test_network_transfer_is_bytes_over_nic_plus_latency(model):
    plan = _one_to_one(model)
    nbytes = plan.accounting.total_bytes
    cluster = ClusterModel(gpus_per_node=1)  # source and destination on different nodes
    pred = predict(plan, cluster)
    assert pred.seconds == pytest.approx(nbytes / cluster.network_bandwidth + cluster.network_latency)
    assert pred.busiest.kind in ("nic out", "nic in") and pred.bytes_by_class["network"] == nbytes


def test_nvlink_and_device_copies(model):
    plan = _one_to_one(model)
    nbytes = plan.accounting.total_bytes
    cluster = ClusterModel(gpus_per_node=8)  # GPU 0 -> GPU 1, one node
    assert predict(plan, cluster).seconds == pytest.approx(nbytes / cluster.nvlink_bandwidth + cluster.nvlink_latency)
    local = _one_to_one(model, colocated=True)
    assert predict(local, cluster).seconds == pytest.approx(2 * nbytes / cluster.copy_bandwidth + cluster.copy_latency)


def test_pack_and_commit_copies(model):
    """Executors that pack wire buffers or stage a commit pay device copies: overlapped or after the wire."""
    plan = _one_to_one(model)
    b = plan.accounting.total_bytes
    cluster = ClusterModel(gpus_per_node=8, pack_copies=1, commit_copies=1)
    wire = b / cluster.nvlink_bandwidth
    receiver_copies = 2 * (b + b) / cluster.copy_bandwidth  # unpack + commit on the receiving GPU
    assert predict(plan, cluster).seconds == pytest.approx(max(wire, receiver_copies) + cluster.nvlink_latency)
    serial = predict(plan, replace(cluster, overlap_copies=False)).seconds
    assert serial == pytest.approx(wire + receiver_copies + cluster.nvlink_latency)


def test_a_gpu_fed_only_by_local_copies_stages_nothing(model):
    """Staging shadows tensors that receive bytes from another process; an all-local refit commits its local
    copies once, so a staged commit adds nothing to it (the executor's E4)."""
    local = _one_to_one(model, colocated=True)
    cluster = ClusterModel(gpus_per_node=8)
    staged = replace(cluster, commit_copies=1.0, overlap_copies=False)
    assert predict(local, staged).seconds == pytest.approx(predict(local, cluster).seconds)


def test_bidirectional_nvlink_cap(model):
    """Two GPUs that each send the other the same bytes share the bidirectional NVLink figure."""
    src = reshard.MegatronLayout(model=model, tp=2)
    dst = reshard.VllmLayout(model=model, tp=2)
    split = [t.name for t in model.tensors if t.layer == 0 and t.name.endswith("proj.weight")]  # no norms
    plan = reshard.compile(src, dst, tensors=split)
    cluster = ClusterModel(src_gpus=(0, 1), dst_gpus=(1, 0))  # destination rank r sits on the other source's GPU
    tr = transfer_table(plan)
    assert (tr["src"] == tr["dst"]).all()  # same TP: rank r sends to rank r, i.e. across the pair both ways
    pred = predict(plan, cluster)
    per_gpu = max(plan.accounting.egress_bytes)
    both = max(per_gpu / cluster.nvlink_bandwidth, 2 * per_gpu / cluster.nvlink_bidirectional)
    assert pred.seconds == pytest.approx(both + cluster.nvlink_latency)
    assert pred.busiest.kind == "nvlink both"


def test_pipelined_trees_cost_about_one_ingress(model):
    src = reshard.MegatronLayout(model=model, tp=2)
    dst = reshard.VllmLayout(model=model, tp=2, replicas=7)
    plan = reshard.compile(src, dst, fanout=2, roots=1)
    cluster = ClusterModel(gpus_per_node=2)  # every replica on its own node: relays cross the network
    seq, pipe = predict(plan, cluster), predict(plan, replace(cluster, pipelined=True))
    ingress = max(plan.accounting.ingress_bytes) / cluster.network_bandwidth
    assert pipe.seconds < seq.seconds
    fill = (seq.depth * (cluster.chunk_bytes / cluster.network_bandwidth + cluster.network_latency)
            + cluster.network_latency)
    assert ingress <= pipe.seconds <= ingress + fill + 1e-9
    assert seq.depth == plan.tree_depth == len(seq.stages) - 1


def test_compare_with_measurement_reports_error(model):
    line = compare_with_measurement(_one_to_one(model), 1.0, ClusterModel(gpus_per_node=1))
    assert "measured 1.0000 s" in line and "error" in line


def test_bad_topology_is_refused():
    with pytest.raises(PlanError, match="network_bandwidth"):
        ClusterModel(network_bandwidth=0)


def test_cli_predict_json(capsys):
    code = main(["plan", "--model", CONFIG, "--src", "megatron:tp=2,pp=2", "--dst", "vllm:tp=2,replicas=4",
                 "--fanout", "2", "--predict", "--pipelined", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_seconds"] > 0 and out["tree_depth"] >= 1 and "nic" in out["predicted_busiest"]


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    code = main(["plan", "--model", CONFIG, "--src", "megatron:tp=2", "--dst", "vllm:tp=1,replicas=3",
                 "--fanout", "2", "--roots", "1", "--plot", str(path)])
    assert code == 0 and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_colocation_map_decides_what_is_local(model):
    """Which source rank shares each destination rank's device is data: TP2 -> TP2 with the GPUs numbered the
    other way ([1, 0]) keeps the replicated norms local and sends the shards across, where rank-for-rank
    colocation copies nearly everything locally;
    the map survives a save, the cost model puts each destination on its source's GPU, and bad maps are named."""
    src, dst = reshard.MegatronLayout(model=model, tp=2), reshard.VllmLayout(model=model, tp=2)
    same = reshard.compile(src, dst, colocated=True)
    swapped = reshard.compile(src, dst, colocated=[1, 0])
    identity = reshard.compile(src, dst, colocated=[0, 1])
    replicated = sum(t.numel for t in model.tensors if t.name.endswith("norm.weight")) * model.itemsize
    a, b = same.accounting, swapped.accounting
    assert a.cross_bytes < a.total_bytes // 1000  # only the vocabulary rows the two paddings split differently
    assert identity.digest == same.digest  # an identity map is rank-for-rank colocation
    # swapped, every sharded byte that was local crosses and vice versa; the norms (on both ranks) stay local
    assert b.local_bytes == 2 * replicated + a.cross_bytes
    assert swapped.accounting.total_bytes == same.accounting.total_bytes and swapped.digest != same.digest
    again = reshard.Plan.from_dict(json.loads(json.dumps(swapped.to_dict())))
    assert again.colocation == (1, 0) and again.accounting == swapped.accounting
    cluster = ClusterModel(gpus_per_node=8)
    assert predict(swapped, cluster).bytes_by_class["device"] == b.local_bytes
    for bad, says in (([0], "1 entries for 2 destination ranks"), ([0, 2], "source rank 2, outside")):
        with pytest.raises(PlanError, match=says):
            reshard.compile(src, dst, colocated=bad)
