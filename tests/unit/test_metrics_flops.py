"""Peak FLOP/s table and the TORCHRIG_PEAK_FLOPS override."""

from __future__ import annotations

import pytest

from training.metrics.flops import peak_flops_for, resolve_peak_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("Tesla T4", None),
        ("cpu", None),
    ],
)
def test_table(name: str, peak: float | None) -> None:
    assert peak_flops_for(name) == peak


def test_env_overrides_and_bad_env_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHRIG_PEAK_FLOPS", raising=False)
    assert resolve_peak_flops(None) is None
    assert resolve_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    monkeypatch.setenv("TORCHRIG_PEAK_FLOPS", "5e11")
    assert resolve_peak_flops(None) == 5e11
    assert resolve_peak_flops("NVIDIA A100-SXM4-40GB") == 5e11
    monkeypatch.setenv("TORCHRIG_PEAK_FLOPS", "fast")
    assert resolve_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
