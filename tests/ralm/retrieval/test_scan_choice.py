"""Which exact candidate scan ``auto`` builds: the usable low-precision scan, the faster one
on this machine when both are usable, FAISS when neither is; forced modes never fall back."""

from __future__ import annotations

import pytest

from ralm.retrieval import bf16_scan, int8_scan, scan_choice


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(scan_choice, "_auto", {})
    return monkeypatch


def _machine(mp, *, bf16_hw: bool, int8_level: int, ms: dict[str, float] | None = None):
    """A machine with or without bf16 instructions, an int8 kernel exact at ``int8_level``
    (0: nowhere), and given kernel timings. (Emulated: these CPUs are not all available here.)"""
    mp.setattr(bf16_scan, "hardware_bf16", lambda: bf16_hw)
    mp.setattr(int8_scan, "_probe_result", int8_level)
    timed: list[str] = []

    def kernel_ms(scan, dim):
        timed.append(scan)
        return (ms or {})[scan]

    mp.setattr(scan_choice, "kernel_ms", kernel_ms)
    return timed


def test_auto_times_both_kernels_and_takes_the_faster(fresh):
    timed = _machine(fresh, bf16_hw=True, int8_level=127, ms={"bf16": 9.0, "int8": 4.0})
    assert scan_choice.choose_scan("auto", 384) == "int8"
    assert scan_choice.choose_scan("auto", 384) == "int8" and timed == ["bf16", "int8"]  # timed once
    assert scan_choice.auto_timings(384) == {"bf16": 9.0, "int8": 4.0}
    _machine(fresh, bf16_hw=True, int8_level=127, ms={"bf16": 2.0, "int8": 4.0})
    assert scan_choice.choose_scan("auto", 768) == "bf16"  # per dimension


def test_auto_without_bf16_instructions_takes_int8_untimed(fresh):
    timed = _machine(fresh, bf16_hw=False, int8_level=63)
    assert scan_choice.choose_scan("auto", 384) == "int8" and timed == []
    assert scan_choice.auto_timings(384) is None


def test_auto_with_neither_takes_faiss_and_forced_modes_raise(fresh):
    _machine(fresh, bf16_hw=False, int8_level=0)
    assert scan_choice.choose_scan("auto", 384) == "faiss"
    assert scan_choice.choose_scan("faiss", 384) == "faiss"
    with pytest.raises(RuntimeError, match="not exact"):
        scan_choice.choose_scan("int8", 384)
    with pytest.raises(ValueError, match="dense_scan must be one of"):
        scan_choice.choose_scan("fp8", 384)


def test_auto_with_only_bf16_takes_bf16(fresh):
    timed = _machine(fresh, bf16_hw=True, int8_level=0)
    fresh.setattr(bf16_scan, "_probe_result", True)  # a sound bf16 kernel
    assert scan_choice.choose_scan("auto", 384) == "bf16" and timed == []


def test_kernel_timing_is_real_and_positive():
    """The timing itself, on this machine's kernels (no mock)."""
    for scan in ("int8", "bf16"):
        assert scan_choice.kernel_ms(scan, 64) > 0
