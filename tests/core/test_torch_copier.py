"""The torch copier on host memory against the bytes reference: the code a GPU's staging runs.

Only how a tensor is made over an address differs between ``cpu`` and
``cuda:N``, so every grouping, view and index path is checked here on the
same scenarios as the numpy copier (test_copier.py). Needs the torch extra.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_copier import SETTINGS, Scenario, _check, pooled, regular, scattered

from xferkit import CapabilityError, copier
from xferkit.copier import CPU, copier_for
from xferkit.torchcopier import TorchCopier

TORCH = copier_for("cpu", using="torch")


@SETTINGS
@given(scattered())
def test_scattered_pieces_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario, TORCH)


@SETTINGS
@given(regular())
def test_regular_strides_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario, TORCH)


@SETTINGS
@given(pooled())
def test_pool_rows_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario, TORCH)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(scattered(), regular(), pooled()),
    st.sampled_from([1, 24, 100, 512]),
    st.sampled_from([(16, 8, 4096), (1, 0, 16), (2, 1, 1), (3, 2, 64)]),
)
def test_small_chunks_and_split_knobs_lose_no_byte(
    scenario: Scenario, chunk: int, split: tuple[int, int, int]
) -> None:
    most, keep, block = split
    small = TorchCopier("cpu")
    small._chunk = chunk  # chunk boundaries inside the few pieces a test affords
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copier, "_MAX_LENGTHS", most)
        patch.setattr(copier, "_KEEP_LENGTHS", keep)
        patch.setattr(copier, "_BLOCK", block)
        _check(scenario, small)


@settings(max_examples=100, deadline=None)
@given(st.one_of(scattered(), regular(), pooled()))
def test_the_torch_and_numpy_copiers_leave_the_same_bytes(scenario: Scenario) -> None:
    """Side by side on copies of one scenario's memory: no byte differs, padding included."""
    twin = Scenario([r.copy() for r in scenario.raws], scenario.shifts, scenario.pieces)
    TORCH.copy(*scenario.arrays())
    CPU.copy(*twin.arrays())
    for ours, theirs in zip(scenario.raws, twin.raws, strict=True):
        assert bytes(ours) == bytes(theirs)


@pytest.mark.parametrize("shuffled", [False, True])
def test_nan_bit_patterns_survive(shuffled: bool) -> None:
    """Items are integers: a signalling NaN's payload is copied, not canonicalized."""
    words = np.array(
        [0x7FF0000000000001, 0xFFF4000000000001, 0x7FF8DEAD00000000, 0x8000000000000000] * 8,
        dtype=np.uint64,
    )
    out = np.zeros_like(words)
    order = np.arange(len(words) // 2)
    if shuffled:  # rows gathered with index_select; in order, one strided copy
        order = np.random.default_rng(1).permutation(order)
    src = int(words.ctypes.data) + order.astype(np.uint64) * np.uint64(16)
    dst = int(out.ctypes.data) + np.arange(len(order), dtype=np.uint64) * np.uint64(16)
    TORCH.copy(src, dst, np.full(len(order), 16, dtype=np.uint64))
    assert np.array_equal(out.reshape(-1, 2), words.reshape(-1, 2)[order])


def test_a_descending_unpack_scatters_rows_in_reverse() -> None:
    """A negative stride is no strided view in torch: the rows are indexed instead."""
    rows, length = 40, 48
    stage = np.random.default_rng(4).integers(0, 256, rows * length, dtype=np.uint8)
    pool = np.zeros(2 * rows * length, dtype=np.uint8)
    src = int(stage.ctypes.data) + np.arange(rows, dtype=np.uint64) * np.uint64(length)
    back = np.arange(rows - 1, -1, -1, dtype=np.uint64) * np.uint64(2 * length)
    TORCH.copy(src, int(pool.ctypes.data) + back, np.full(rows, length, dtype=np.uint64))
    want = np.zeros_like(pool).reshape(-1, 2, length)
    want[::-1, 0] = stage.reshape(-1, length)
    assert np.array_equal(pool, want.reshape(-1))


def test_copier_for_cpu_using_torch_is_a_torch_copier_and_the_default_stays_numpy() -> None:
    assert isinstance(TORCH, TorchCopier) and TORCH.device == "cpu"
    assert copier_for("cpu") is CPU and copier_for("cpu", using="numpy") is CPU
    view = TORCH.tensor(int(np.arange(4, dtype=np.uint64).ctypes.data), 32, 8)
    assert view.dtype == torch.int64 and view.device == torch.device("cpu")


@pytest.mark.parametrize("using", ["cupy", "", 3, ["torch"], b"torch"])
def test_an_unknown_copier_is_refused_by_name(using: object) -> None:
    with pytest.raises(CapabilityError, match="using") as caught:
        copier_for("cpu", using=using)  # type: ignore[arg-type]
    assert caught.value.subject == using


def test_numpy_for_device_memory_is_refused() -> None:
    with pytest.raises(CapabilityError, match="numpy reaches host memory only") as caught:
        copier_for("cuda:1", using="numpy")
    assert caught.value.subject == "cuda:1"


def test_a_cuda_device_gets_the_torch_copier_or_a_refusal_naming_it() -> None:
    if torch.cuda.is_available():  # a GPU machine: the copier scripts/gpu_check.py drives
        assert isinstance(copier_for("cuda:0"), TorchCopier)
        return
    with pytest.raises(CapabilityError, match=r"'cuda:0'.*torch sees 0 CUDA devices") as caught:
        copier_for("cuda:0")
    assert caught.value.subject == "cuda:0"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_importing_the_core_and_its_copier_leaves_torch_unimported() -> None:
    run = _python(
        "import sys, numpy as np, xferkit, xferkit.copier, xferkit.torchcopier\n"
        "from xferkit.copier import copier_for\n"
        "a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)\n"
        "copier_for('cpu').copy(*(np.array([x], np.uint64) for x in "
        "(a.ctypes.data, b.ctypes.data, 8)))\n"
        "assert (a == b).all()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_without_torch_a_gpu_copier_is_a_capability_error_saying_to_install_it() -> None:
    run = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # what an interpreter without torch imports\n"
        "from xferkit import CapabilityError\n"
        "from xferkit.copier import copier_for\n"
        "for device, using in (('cuda:0', None), ('cpu', 'torch')):\n"
        "    try:\n"
        "        copier_for(device, using=using)\n"
        "    except CapabilityError as e:\n"
        "        print(e.subject, '|', e)\n"
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["cuda:0", "cpu"]
    assert all("torch is not installed" in line and "xferkit[torch]" in line for line in lines)


ANYTHING = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.text(max_size=3), max_size=2),
    st.sampled_from(["cpu", "cuda:0", "cuda:12", "torch", "numpy", float("nan")]),
)


@settings(max_examples=200, deadline=None)
@given(ANYTHING, ANYTHING)
def test_copier_for_with_any_arguments_gives_a_copier_or_a_capability_error(
    device: object, using: object
) -> None:
    try:
        got = copier_for(device, using=using)  # type: ignore[arg-type]
    except CapabilityError as e:
        assert e.subject in (device, using)  # containment checks identity first (nan)
        return
    assert device == "cpu" and got.device == "cpu"
    assert isinstance(got, TorchCopier) == (using == "torch")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 0, None])
def test_a_torch_copier_for_no_device_is_refused_naming_it(device: object) -> None:
    with pytest.raises(CapabilityError, match="neither 'cpu' nor 'cuda:N'") as caught:
        TorchCopier(device)  # type: ignore[arg-type]
    assert caught.value.subject == device
