"""The GPU path, where a CUDA device exists (skipped elsewhere; CI machines have none).

What a CPU machine cannot show: the worker trains on `cuda:0` over `nccl` and says so in result.json;
NVML answers for the real device and the exporter serves its readings; a checkpoint's staging and an
in-memory replica copy CUDA shards to host memory and load them back bit-identically. The figures
(bf16 throughput, MFU, NVML against nvidia-smi, a kill-worker drill on the GPU) are in
`bench/sections/gpu.py` and docs/performance.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.fixtures.jobs import write_job
from training.contract import Result, RunFiles, read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_process_nccl_group() -> Iterator[None]:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_on_cuda() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from training.state import ModelOptimizerState, TrainerProgress

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    fully_shard(model, mesh=init_device_mesh("cuda", (1,), mesh_dim_names=("shard",)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer, {"app": ModelOptimizerState(model, optimizer), "trainer": TrainerProgress()}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        gen = torch.Generator(device="cuda").manual_seed(100 + i)
        loss = model(torch.randn(16, 64, device="cuda", generator=gen)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_nvml_reads_the_device_and_the_exporter_serves_it() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from training.metrics.gpu import GpuCollector, create_gpu_reader

    reader = create_gpu_reader()
    assert reader is not None, "NVML did not answer on a machine with CUDA"
    sample = reader.read(0)
    assert "NVIDIA" in sample.name
    assert sample.memory_total_bytes is not None and sample.memory_total_bytes > 2**30
    assert sample.utilization_ratio is not None and 0.0 <= sample.utilization_ratio <= 1.0
    registry = CollectorRegistry()
    registry.register(GpuCollector(reader, ["job", "0", "node"], [0]))
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert values["torchrig_gpu_available"] == 1.0
    assert values["torchrig_gpu_memory_total_bytes"] == sample.memory_total_bytes
    assert values["torchrig_gpu_memory_used_bytes"] > 0


def test_staging_copies_cuda_state_to_host_memory() -> None:
    from training.checkpoint.save import stage

    state = {"w": torch.randn(1024, 1024, device="cuda"), "meta": {"step": 3}}
    staged = stage(state)
    assert staged["w"].device.type == "cpu"
    assert torch.equal(staged["w"], state["w"].cpu())
    state["w"].add_(1.0)  # training goes on: the staged copy is private
    assert not torch.equal(staged["w"], state["w"].cpu())


@pytest.mark.usefixtures("one_process_nccl_group")
def test_an_fsdp_replica_of_cuda_shards_round_trips_bit_identically() -> None:
    from training.inplace.replica import load_snapshot, take_snapshot

    model, optimizer, state = _fsdp_on_cuda()
    _train(model, optimizer, 3)
    state["trainer"].step = 3
    snapshot = take_snapshot(3, state)  # host memory: no GPU memory held by the replica
    _train(model, optimizer, 2)
    reference = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}

    rebuilt, rebuilt_optimizer, rebuilt_state = _fsdp_on_cuda()
    load_snapshot(snapshot, rebuilt_state)
    assert rebuilt_state["trainer"].step == 3
    _train(rebuilt, rebuilt_optimizer, 2)
    for key, value in rebuilt.state_dict().items():
        assert value.device.type == "cuda", key
        assert torch.equal(value.full_tensor(), reference[key]), key


def _torchrig_run(spec: Path, cwd: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", str(spec), "-o", "json", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


@pytest.mark.slow
def test_a_local_run_trains_on_the_gpu_over_nccl_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    spec = write_job(
        tmp_path,
        REPO / "examples" / "tinygpt-fsdp.yaml",
        overrides=[
            "spec.resources.gpus=1",
            "spec.procsPerNode=1",
            "spec.nodes.min=1",
            "spec.nodes.max=1",
            'spec.checkpoint.stores=[{"uri": "file://./ckpt", "name": "local"}]',
            "spec.checkpoint.nodeLocal.enabled=false",
            "spec.checkpoint.every.steps=10",
            "spec.training.steps=20",
            "spec.training.evalAtEnd=false",
            "spec.metrics.logEvery=5",
            "spec.metrics.port=29720",
        ],
    )
    summary = _torchrig_run(spec, tmp_path)
    assert summary["status"] == "succeeded"
    assert summary["checkpoints"][0]["last_committed_step"] == 20
    files = RunFiles(Path(summary["run_dir"]))
    result = Result.read(files.result)
    assert result is not None
    assert (result.device, result.backend) == ("cuda:0", "nccl")
    records = read_jsonl(files.metrics)
    mfu = [r["mfu"] for r in records if r.get("mfu") is not None]
    # A device in the peak-FLOPs table (the H100s and H200s this is checked on) gets an MFU.
    name = torch.cuda.get_device_name(0)
    if any(key in name.upper() for key in ("H100", "H200", "A100")):
        assert mfu and all(0.0 < m < 1.0 for m in mfu), mfu

    # The checkpoint holds the whole state: fp32 parameters and AdamW's two moments (seen on an H100: a
    # manifest of 150 KB for a 150M-parameter FSDP model, and a restart that began again at step 0).
    from training.examples.tinygpt import task

    params = sum(p.numel() for p in task(dim=512, layers=8, heads=8, seq_len=256).build_model().parameters())
    step_dir = Path(summary["run_dir"]) / "ckpt" / "step-00000020"
    written = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    assert written >= 3 * 4 * params, (written, params)

    # Resubmitted into the same run directory: it restores step 20 onto the GPU and has nothing left to do.
    resumed = _torchrig_run(spec, tmp_path, "--run-dir", summary["run_dir"])
    assert resumed["status"] == "succeeded"
    assert [r["step"] for r in resumed["restored_from"]] == [20], resumed["restored_from"]


def test_a_profile_window_on_the_gpu_records_device_time(tmp_path: Path) -> None:
    from training.config import ProfileConfig
    from training.contract import WorkerIdentity
    from training.metrics.base import MetricsSink
    from training.profiling import create_step_profiler

    seen: list[dict[str, Any]] = []

    class Events(MetricsSink):
        def on_event(self, kind: object, **fields: Any) -> None:
            seen.append(fields)

    profiler = create_step_profiler(
        ProfileConfig(start_step=1, steps=2), WorkerIdentity(rank=0, run_dir=str(tmp_path)), Events(), cuda=True
    )
    assert profiler is not None
    a = torch.randn(2048, 2048, device="cuda")
    for step in (1, 2):
        profiler.before_step(step)
        (a @ a).sum().item()
        profiler.after_step(step)
    assert len(seen) == 1 and seen[0]["device_time_s"] > 0, seen
    assert (tmp_path / str(seen[0]["table"])).read_text().startswith("torchrig profile: rank 0")
