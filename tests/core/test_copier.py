"""The local copier against a plain bytes reference: every byte of every buffer, after any copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xferkit import CapabilityError, XferError, copier
from xferkit.copier import _SCAN, CPU, Copier, CpuCopier, _stride, copier_for, copy_pieces

PAD = 16  # bytes around each buffer's usable part: a write there is a bug the check sees


@dataclass
class Piece:
    src_buf: int
    src_off: int
    dst_buf: int
    dst_off: int
    length: int


@dataclass
class Scenario:
    raws: list[np.ndarray]  # whole allocations, padding included
    shifts: list[int]  # where each usable buffer starts in its allocation (odd too)
    pieces: list[Piece]

    def address(self, buf: int, off: int) -> int:
        return int(self.raws[buf].ctypes.data) + PAD + self.shifts[buf] + off

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = [self.address(p.src_buf, p.src_off) for p in self.pieces]
        dst = [self.address(p.dst_buf, p.dst_off) for p in self.pieces]
        lengths = [p.length for p in self.pieces]
        return _u64(src), _u64(dst), _u64(lengths)

    def expected(self) -> list[bytes]:
        """Plain bytes: every copy reads the memory as it was (no destination is a source)."""
        before = [bytes(r) for r in self.raws]
        after = [bytearray(b) for b in before]
        for p in self.pieces:
            s = PAD + self.shifts[p.src_buf] + p.src_off
            d = PAD + self.shifts[p.dst_buf] + p.dst_off
            after[p.dst_buf][d : d + p.length] = before[p.src_buf][s : s + p.length]
        return [bytes(a) for a in after]


def _u64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def _allocate(draw: st.DrawFn, sizes: list[int]) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shifts = [draw(st.integers(0, 15)) for _ in sizes]
    raws = [rng.integers(0, 256, 2 * PAD + 16 + n, dtype=np.uint8) for n in sizes]
    return raws, shifts


LENGTHS = st.one_of(
    st.integers(1, 300), st.sampled_from([1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 264])
)


@st.composite
def scattered(draw: st.DrawFn) -> Scenario:
    """Destinations of assorted lengths at random gaps; sources anywhere no destination is.

    The last buffer is never a destination, so every piece finds room for its source.
    """
    sizes = [*draw(st.lists(st.integers(1, 6000), min_size=1, max_size=3)), 4096]
    raws, shifts = _allocate(draw, sizes)
    # Aligned layouts reach the wide-word paths; the rest copy bytes or short words.
    unit = draw(st.sampled_from([1, 1, 2, 4, 8, 8, 16]))
    if unit > 1:
        shifts = [0] * len(sizes)
    cursor = [0] * len(sizes)
    free = [np.ones(n, dtype=bool) for n in sizes]
    dests: list[tuple[int, int, int]] = []
    # A few lengths make big groups (irregular ones too); many make the rare ones get split.
    palette = draw(
        st.one_of(
            st.lists(LENGTHS, min_size=1, max_size=4, unique=True),
            st.lists(LENGTHS, min_size=17, max_size=30, unique=True),
        )
    )
    count = draw(st.integers(1, 80))  # lists alone stay short; groups here should not
    for drawn in draw(st.lists(st.sampled_from(palette), min_size=count, max_size=count)):
        length = max(unit, drawn // unit * unit)
        buf = draw(st.integers(0, len(sizes) - 2))
        off = -(-cursor[buf] // unit) * unit + unit * draw(st.one_of(st.just(0), st.integers(0, 8)))
        if off + length > sizes[buf]:
            continue
        dests.append((buf, off, length))
        free[buf][off : off + length] = False
        cursor[buf] = off + length
    pieces = []
    for buf, off, length in dests:
        for src_buf in (draw(st.integers(0, len(sizes) - 1)), len(sizes) - 1):
            blocked = np.concatenate([[0], np.cumsum(~free[src_buf])])
            starts = np.flatnonzero(blocked[length:] - blocked[:-length] == 0)
            starts = starts[starts % unit == 0]
            if len(starts):
                src_off = int(starts[draw(st.integers(0, len(starts) - 1))])
                pieces.append(Piece(src_buf, src_off, buf, off, length))
                break
    order = draw(st.permutations(range(len(pieces))))
    return Scenario(raws, shifts, [pieces[i] for i in order])


@st.composite
def regular(draw: st.DrawFn) -> Scenario:
    """One length at constant strides (ascending, descending, or a repeated source)."""
    length = draw(LENGTHS)
    count = draw(st.integers(1, 40))
    gap = draw(st.sampled_from([0, 0, length, 3, 8]))
    dst_step = draw(st.sampled_from([1, -1])) * (length + gap)
    src_step = draw(st.sampled_from([0, length, -length, length + gap, -(length + 2 * gap)]))
    dst_size = count * (length + gap)
    src_size = (count - 1) * abs(src_step) + length
    raws, shifts = _allocate(draw, [src_size, dst_size])
    src_base = 0 if src_step >= 0 else src_size - length
    dst_base = 0 if dst_step > 0 else dst_size - length - gap
    pieces = [
        Piece(0, src_base + i * src_step, 1, dst_base + i * dst_step, length) for i in range(count)
    ]
    return Scenario(raws, shifts, pieces)


@st.composite
def pooled(draw: st.DrawFn) -> Scenario:
    """Rows of one pool packed into a staging buffer (sources may repeat) or unpacked back."""
    length = draw(LENGTHS)
    rows = draw(st.integers(1, 64))
    count = draw(st.integers(1, 80))
    unpack = draw(st.booleans())
    picks = (
        draw(st.permutations(range(rows)))[:count]  # destinations never overlap
        if unpack
        else draw(st.lists(st.integers(0, rows - 1), min_size=count, max_size=count))
    )
    layout = draw(st.sampled_from(["packed", "gaps", "shuffled"]))
    gaps = draw(st.lists(st.integers(0, 9), min_size=len(picks), max_size=len(picks)))
    starts = np.arange(len(picks)) * length
    if layout == "gaps":
        starts = starts + np.cumsum(gaps)
    elif layout == "shuffled":
        starts = starts[draw(st.permutations(range(len(picks))))]
    raws, shifts = _allocate(draw, [rows * length, int(starts.max()) + length])
    if draw(st.booleans()):
        shifts = [0, 0]  # aligned: the wide items
    pieces = [
        Piece(1, int(at), 0, row * length, length)
        if unpack
        else Piece(0, row * length, 1, int(at), length)
        for row, at in zip(picks, starts, strict=True)
    ]
    return Scenario(raws, shifts, pieces)


def _check(scenario: Scenario, using: Copier = CPU) -> None:
    expected = scenario.expected()
    using.copy(*scenario.arrays())
    for i, (raw, want) in enumerate(zip(scenario.raws, expected, strict=True)):
        got = bytes(raw)
        if got != want:
            bad = next(j for j in range(len(got)) if got[j] != want[j])
            raise AssertionError(
                f"buffer {i}: first wrong byte at {bad - PAD - scenario.shifts[i]}"
            )


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scattered())
def test_scattered_pieces_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario)


@SETTINGS
@given(regular())
def test_regular_strides_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario)


@SETTINGS
@given(pooled())
def test_pool_rows_match_the_bytes_reference(scenario: Scenario) -> None:
    _check(scenario)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(scattered(), regular(), pooled()),
    st.sampled_from([1, 24, 100, 512]),
    st.sampled_from([(16, 8, 4096), (1, 0, 16), (2, 1, 1), (3, 2, 64)]),
)
def test_small_knobs_lose_no_byte(
    scenario: Scenario, chunk: int, split: tuple[int, int, int]
) -> None:
    """Tiny chunks and split thresholds put boundaries inside the few pieces a test affords."""
    most, keep, block = split
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(copier, "_CHUNK_BYTES", chunk)
        patch.setattr(copier, "_MAX_LENGTHS", most)
        patch.setattr(copier, "_KEEP_LENGTHS", keep)
        patch.setattr(copier, "_BLOCK", block)
        _check(scenario)


def _rows(base: np.ndarray, rows: np.ndarray, length: int) -> np.ndarray:
    return int(base.ctypes.data) + rows.astype(np.uint64) * np.uint64(length)


@pytest.mark.parametrize("length", [16, 24, 256, 4100])
@pytest.mark.parametrize("pattern", ["every-other", "scattered"])
def test_pack_gathers_rows_into_contiguous_memory_and_unpack_scatters_them_back(
    length: int, pattern: str
) -> None:
    rows = 600
    rng = np.random.default_rng(0)
    picks = (
        np.arange(0, rows, 2)
        if pattern == "every-other"
        else np.sort(rng.choice(rows, rows // 2, replace=False))
    )
    pool = rng.integers(0, 256, rows * length, dtype=np.uint8)
    stage = np.zeros(len(picks) * length, dtype=np.uint8)
    nbytes = np.full(len(picks), length, dtype=np.uint64)
    pool_rows = _rows(pool, picks, length)
    stage_rows = _rows(stage, np.arange(len(picks)), length)
    assert (_stride(pool_rows, length) is None) == (pattern == "scattered")
    assert _stride(stage_rows, length) == length

    copy_pieces(pool_rows, stage_rows, nbytes)
    assert np.array_equal(stage.reshape(-1, length), pool.reshape(-1, length)[picks])

    back = np.zeros_like(pool)
    copy_pieces(stage_rows, _rows(back, picks, length), nbytes)
    want = np.zeros_like(pool).reshape(-1, length)
    want[picks] = pool.reshape(-1, length)[picks]
    assert np.array_equal(back.reshape(-1, length), want)


@pytest.mark.parametrize("shuffled", [False, True])
def test_sixteen_byte_items_keep_nan_bit_patterns(shuffled: bool) -> None:
    """16-byte pieces travel as complex128: a signalling NaN's payload must survive."""
    words = np.array(
        [0x7FF0000000000001, 0xFFF4000000000001, 0x7FF8DEAD00000000, 0x8000000000000000] * 8,
        dtype=np.uint64,
    )
    out = np.zeros_like(words)
    order = np.arange(len(words) // 2)
    if shuffled:  # a gather (np.take); in order, one strided copy (np.copyto)
        order = np.random.default_rng(1).permutation(order)
    src = int(words.ctypes.data) + order.astype(np.uint64) * np.uint64(16)
    dst = int(out.ctypes.data) + np.arange(len(order), dtype=np.uint64) * np.uint64(16)
    copy_pieces(src, dst, np.full(len(order), 16, dtype=np.uint64))
    assert np.array_equal(out.reshape(-1, 2), words.reshape(-1, 2)[order])


def test_many_distinct_long_lengths_are_copied_whole() -> None:
    """More lengths than groups: rare ones are cut into blocks, and every byte still lands."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 20_000, 80)
    src_buf = rng.integers(0, 256, int(lengths.sum()) + 64, dtype=np.uint8)
    gaps = rng.integers(0, 9, len(lengths))
    dst_buf = np.zeros(int((lengths + gaps).sum()) + 8, dtype=np.uint8)
    src_off = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 3
    dst_off = np.cumsum(gaps) + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    want = dst_buf.copy()
    for s, d, n in zip(src_off, dst_off, lengths, strict=True):
        want[d : d + n] = src_buf[s : s + n]
    src = int(src_buf.ctypes.data) + src_off.astype(np.uint64)
    dst = int(dst_buf.ctypes.data) + dst_off.astype(np.uint64)
    copy_pieces(src[::-1], dst[::-1], lengths[::-1].astype(np.uint64))
    assert np.array_equal(dst_buf, want)


def test_no_pieces_and_empty_pieces_touch_nothing() -> None:
    buf = np.arange(64, dtype=np.uint8)
    before = buf.copy()
    empty = np.zeros(0, dtype=np.uint64)
    copy_pieces(empty, empty, empty)
    addr = np.full(3, buf.ctypes.data, dtype=np.uint64)
    copy_pieces(addr + np.uint64(32), addr, np.zeros(3, dtype=np.uint64))
    assert np.array_equal(buf, before)
    # Zero-length pieces (irregular ones too) mixed with real ones are skipped, the rest copied.
    src = addr[0] + np.array([32, 40, 33, 50], np.uint64)
    dst = addr[0] + np.array([5, 7, 20, 30], np.uint64)
    copy_pieces(src, dst, np.array([0, 4, 0, 0], np.uint64))
    assert np.array_equal(buf[7:11], before[40:44])
    assert np.array_equal(buf[:7], before[:7]) and np.array_equal(buf[11:], before[11:])


def test_mismatched_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="2 sources, 1 destinations"):
        copy_pieces(np.zeros(2, np.uint64), np.zeros(1, np.uint64), np.zeros(2, np.uint64))


def test_stride_scan_finds_a_break_past_the_first_run() -> None:
    n = _SCAN + 1000
    addrs = np.arange(n, dtype=np.uint64) * np.uint64(32) + np.uint64(1 << 20)
    assert _stride(addrs, 32) == 32
    assert _stride(addrs[::-1].copy(), 32) == -32
    addrs[_SCAN + 500] += np.uint64(8)
    assert _stride(addrs, 32) is None
    assert _stride(np.full(5, 4096, np.uint64), 8) == 0
    assert _stride(np.array([4096], np.uint64), 8) == 8


def test_a_different_length_past_the_first_scan_run_is_honoured() -> None:
    """The equal-length check runs in chunks; a change after the first must still be seen."""
    count = _SCAN + 10
    src_buf = np.random.default_rng(3).integers(0, 256, 2 * count + 8, dtype=np.uint8)
    dst_buf = np.zeros_like(src_buf)
    nbytes = np.ones(count, dtype=np.uint64)
    nbytes[-1] = 3
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(2)
    copy_pieces(src_buf.ctypes.data + offsets, dst_buf.ctypes.data + offsets, nbytes)
    want = np.zeros_like(src_buf)
    want[0 : 2 * count : 2] = src_buf[0 : 2 * count : 2]
    last = 2 * (count - 1)
    want[last : last + 3] = src_buf[last : last + 3]
    assert np.array_equal(dst_buf, want)


def test_copier_for_cpu_is_the_numpy_copier() -> None:
    cpu = copier_for("cpu")
    assert cpu is CPU and isinstance(cpu, CpuCopier) and cpu.device == "cpu"
    a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    cpu.copy(*(np.array([x], np.uint64) for x in (a.ctypes.data, b.ctypes.data, 8)))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("device", ["tpu", "cuda", "", "CPU"])
def test_copier_for_an_unknown_device_names_it(device: str) -> None:
    with pytest.raises(CapabilityError, match=repr(device)) as caught:
        copier_for(device)
    assert isinstance(caught.value, XferError) and caught.value.subject == device


@pytest.mark.parametrize("whole_max", [1 << 30, 4096])
def test_a_scatter_moves_a_piece_as_one_item_only_below_numpys_item_limit(
    whole_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One item per piece is one memcpy, but numpy's void items end below 2 GiB: a longer
    piece must keep rows of 16-byte items (here the limit is lowered to 4 KiB pieces)."""
    monkeypatch.setattr(copier, "_WHOLE_MAX", whole_max)
    seen: list[int] = []
    whole = copier._Side.whole

    def spy(side: copier._Side, n: int) -> np.ndarray:
        seen.append(n)
        return whole(side, n)

    monkeypatch.setattr(copier._Side, "whole", spy)
    length, rng = 8192, np.random.default_rng(1)
    picks = rng.choice(64, 16, replace=False)
    stage = rng.integers(0, 256, 16 * length, dtype=np.uint8)
    pool = np.zeros(64 * length, dtype=np.uint8)
    copy_pieces(
        _rows(stage, np.arange(16), length),
        _rows(pool, picks, length),
        np.full(16, length, dtype=np.uint64),
    )
    assert np.array_equal(pool.reshape(-1, length)[picks], stage.reshape(-1, length))
    assert seen == ([length, length] if length <= whole_max else [])
