"""Registration is all-or-nothing, whatever the driver does; memory kinds are checked first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from mock_pairs import buffer, manifest, mock, mock_pair

from xferkit import (
    ArgumentError,
    Backend,
    CapabilityError,
    Manifest,
    Region,
    RegistrationError,
    Status,
    Transfer,
)
from xferkit.testing.mock import STALL, Call, MockDriver


def _refusing(*counts: int) -> tuple[list[int], MockDriver]:
    """A mock refusing the registrations named by 1-based count (clear the list to stop)."""
    refuse = list(counts)

    def handler(call: Call) -> None:
        if call.op == "register" and call.count in refuse:
            raise RuntimeError(f"refused registration #{call.count}")

    return refuse, MockDriver(handler)


@pytest.mark.parametrize("at", [1, 2, 4])
def test_failed_registration_rolls_back(at: int) -> None:
    m = manifest([buffer(4096, i) for i in range(4)], "r")
    refuse, driver = _refusing(at)
    with Backend(driver) as b:
        with pytest.raises(RegistrationError) as info:
            b.register(m)
        failed = m.regions[at - 1]
        assert failed.label in str(info.value)
        assert f"#{at}" in str(info.value)  # the driver's own text is carried
        assert info.value.subject == failed.key
        assert isinstance(info.value.__cause__, RuntimeError)
        assert b.manifest is None
        # Every region that had registered is released, newest first; nothing stays held.
        assert [c.region for c in driver.of("deregister")] == list(reversed(m.regions[: at - 1]))
        assert driver.registered == set()
        refuse.clear()
        b.register(m)  # nothing half-registered stays behind
        assert b.manifest is m


def test_rollback_failure_is_attached_to_the_first_registration_error() -> None:
    m = manifest([buffer(256, 10 + i) for i in range(4)], "r")
    labels = [r.label for r in m.regions]
    refused = RuntimeError("driver: out of memory keys")
    stuck = RuntimeError("driver: region busy")

    def handler(call: Call) -> None:
        label = call.region.label if call.region is not None else None
        if call.op == "register" and label == labels[2]:
            raise refused
        if call.op == "deregister" and label == labels[0]:
            raise stuck

    with Backend(MockDriver(handler)) as b:
        with pytest.raises(RegistrationError) as info:
            b.register(m)
        err = info.value
        assert labels[2] in err.args[0] and "out of memory keys" in err.args[0]
        assert "busy" not in err.args[0]
        assert err.subject == m.regions[2].key and err.__cause__ is refused
        assert err.followups == [stuck]
        assert "region busy" in str(err)
        # Rolled back newest first, every one that had succeeded.
        assert [(c.op, c.region.label if c.region else None) for c in mock(b).calls] == [
            ("register", labels[0]),
            ("register", labels[1]),
            ("register", labels[2]),
            ("deregister", labels[1]),
            ("deregister", labels[0]),
        ]
        assert b.manifest is None
        assert mock(b).registered == {(m.regions[0].addr, m.regions[0].nbytes)}  # the stuck one


class _BatchDriver(MockDriver):
    """A driver with its own batch registration, returning what ``answer`` makes of it.

    Real engines register a list in one call (NIXL, Mooncake); how such a call
    fails is the driver's choice, so the core must cope with each shape.
    """

    def __init__(self, answer: str) -> None:
        super().__init__()
        self.answer = answer

    def register_regions(self, regions: Sequence[Region]) -> Sequence[BaseException | None]:
        if self.answer == "raise":  # registers some, then raises: which ones is unknown
            for r in regions[:2]:
                self.register_region(r)
            raise RuntimeError("engine refused kv/r2[0]")
        results: list[object] = list(super().register_regions(regions))
        if self.answer == "too many":
            results += [None, None]
        elif self.answer == "too few":  # the rest are silently missing
            del results[1:]
        else:  # "text": a driver naming its failure with a string, not an exception
            self.deregister_region(regions[1])
            results[1] = "no memory key"
        return results  # type: ignore[return-value]


def test_a_raising_batch_registration_releases_everything_it_may_have_held() -> None:
    m = manifest([buffer(256, i) for i in range(4)], "r")
    driver = _BatchDriver("raise")
    with Backend(driver) as b:
        with pytest.raises(RegistrationError, match="engine refused") as info:
            b.register(m)
        assert "raised instead of naming the failing region" in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert driver.registered == set() and b.manifest is None
        # Every region is released, newest first: the driver may hold any of them.
        assert [c.region for c in driver.of("deregister")] == list(reversed(m.regions))


def test_extra_results_from_a_batch_registration_are_ignored() -> None:
    m = manifest([buffer(64, 1)], "r")
    with Backend(_BatchDriver("too many")) as b:
        b.register(m)
        assert b.manifest is m


def test_too_few_results_from_a_batch_registration_release_everything() -> None:
    """Results missing without a failure among them: which regions are held is unknown."""
    m = manifest([buffer(64, i) for i in range(3)], "r")
    driver = _BatchDriver("too few")
    with Backend(driver) as b:
        with pytest.raises(RegistrationError, match="answered for 1 of them") as info:
            b.register(m)
        assert "3 regions" in str(info.value)
        assert b.manifest is None
        assert driver.registered == set()  # the two it never answered for are released too
        assert [c.region for c in driver.of("deregister")] == list(reversed(m.regions))


def test_a_batch_registration_answering_with_text_is_still_a_registration_error() -> None:
    m = manifest([buffer(64, i) for i in range(2)], "r")
    driver = _BatchDriver("text")
    with Backend(driver) as b:
        with pytest.raises(RegistrationError, match="no memory key") as info:
            b.register(m)
        assert m.regions[1].label in str(info.value)
        assert driver.registered == set() and b.manifest is None


def test_empty_regions_never_reach_the_driver() -> None:
    empty = np.zeros((4, 0, 3), dtype=np.float32)
    regions = [
        Region.from_array(b, pool=f"p{i}", name="x", layer=0)
        for i, b in enumerate([buffer(512, 3), buffer(256, 4)])
    ]
    regions.append(Region.from_array(empty, pool="p", name="temporal", layer=0))
    m = Manifest.build(regions)
    driver = MockDriver()
    with Backend(driver) as b:
        b.register(m)
        assert len(m.dropped) == 1
        seen = [c.region for c in driver.of("register")]
        assert len(seen) == 2 and all(r is not None and r.nbytes > 0 for r in seen)


def _gpu_region() -> Region:
    return Region(
        pool="g",
        name="kv",
        layer=3,
        addr=1 << 40,
        nbytes=64,
        slot_shape=(64,),
        itemsize=1,
        device="cuda:0",
    )


def test_undeclared_memory_kind_is_refused_before_the_driver() -> None:
    gpu = _gpu_region()
    m = Manifest.build([Region.from_array(buffer(256, 6), pool="c", name="x", layer=0), gpu])
    driver = MockDriver()  # cpu only
    with Backend(driver) as b:
        with pytest.raises(CapabilityError) as info:
            b.register(m)
        assert gpu.label in str(info.value) and "cuda:0" in str(info.value)
        assert info.value.subject == gpu.key
        assert driver.calls == [] and b.manifest is None  # not even the cpu region


def test_declared_memory_kind_is_left_to_the_driver() -> None:
    gpu = _gpu_region()
    driver = MockDriver(memory=frozenset({"cpu", "cuda"}))
    with Backend(driver) as b:
        b.register(Manifest.build([gpu]))
        assert [c.region for c in driver.of("register")] == [gpu]


def test_a_second_manifest_or_a_non_manifest_is_refused() -> None:
    m = manifest([buffer(64, 1)], "r")
    driver = MockDriver()
    with Backend(driver) as b:
        with pytest.raises(ArgumentError, match="takes a Manifest"):
            b.register([m])  # type: ignore[arg-type]
        b.register(m)
        with pytest.raises(RegistrationError, match="already registered"):
            b.register(manifest([buffer(64, 2)], "s"))
        assert len(driver.of("register")) == 1 and b.manifest is m


def test_deregister_is_idempotent_and_releases_newest_first() -> None:
    m = manifest([buffer(128, 20), buffer(64, 21)], "c")
    driver = MockDriver()
    with Backend(driver) as b:
        b.register(m)
        b.deregister()
        b.deregister()
        assert [c.region for c in driver.of("deregister")] == list(reversed(m.regions))
        assert driver.registered == set() and b.manifest is None
        b.register(m)  # and registers again
        assert b.manifest is m


def test_deregister_reports_the_first_failure_and_attaches_the_rest() -> None:
    m = manifest([buffer(64, 30 + i) for i in range(3)], "x")
    first, second = RuntimeError("first refusal"), RuntimeError("second refusal")
    refusals = {m.regions[2].label: first, m.regions[0].label: second}

    def handler(call: Call) -> None:
        label = call.region.label if call.region is not None else ""
        if call.op == "deregister" and label in refusals:
            raise refusals[label]

    driver = MockDriver(handler)
    with Backend(driver) as b:
        b.register(m)
        with pytest.raises(RegistrationError) as info:
            b.deregister()
        assert m.regions[2].label in info.value.args[0]
        assert "first refusal" in info.value.args[0]
        assert info.value.subject == m.regions[2].key
        assert [str(e) for e in info.value.followups] == [
            f"{b.name} failed to deregister region {m.regions[0].label}: second refusal"
        ]
        assert b.manifest is None
        assert len(driver.of("deregister")) == 3  # the middle one was still released
        refusals.clear()


def test_deregister_ends_transfers_before_releasing_memory() -> None:
    """A stalled write still holds the memory: it is aborted before any region goes."""
    seen: list[Status] = []
    transfers: list[Transfer] = []

    def handler(call: Call) -> str | None:
        if call.op == "post":
            return STALL
        if call.op == "deregister" and transfers:
            seen.append(transfers[0].poll())
        return None

    with mock_pair(handler) as pair:
        t = pair.a.write(pair.peer, pair.descs(2, 64)[0])
        transfers.append(t)
        assert t.poll() is Status.PENDING
        pair.a.deregister()
        assert seen == [Status.FAILED]  # already ended when the first region went
        assert t.error is not None and "deregistered" in str(t.error)
