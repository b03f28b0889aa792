"""The multi-host harness itself: namespaces made and removed, reachability, cut links,
tbf shaping, frozen and restarted processes. Assertions are on bytes and states."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xferkit.testing.hosts import Host, HostError, Hosts, Process, sweep
from xferkit.testing.hosts.ip import namespaces

PEER = str(Path(__file__).with_name("netpeer.py"))
PORT = 9000


@pytest.fixture
def box() -> Iterator[Hosts]:
    with Hosts(2) as made:
        yield made


def _sink(host: Host, seconds: float) -> Process:
    proc = host.python(PEER, "sink", host.address, str(PORT), str(seconds), stdout=subprocess.PIPE)
    assert proc.popen.stdout is not None
    assert proc.popen.stdout.readline().strip() == b"listening"
    return proc


def _received(sink: Process) -> tuple[int, float]:
    out, _ = sink.popen.communicate(timeout=30)
    got, elapsed = out.split()
    return int(got), float(elapsed)


def _connects(host: Host, to: Host, timeout: float) -> bool:
    code = (
        "import socket,sys\n"
        f"try: socket.create_connection(({to.address!r}, {PORT}), timeout={timeout})\n"
        "except OSError as e: print(type(e).__name__, e); sys.exit(1)\n"
    )
    return host.start([sys.executable, "-c", code]).popen.wait(timeout=timeout + 20) == 0


def test_namespaces_are_made_and_removed_with_their_links() -> None:
    with Hosts(3) as box:
        made = box.namespaces()
        assert set(made) <= set(namespaces())
        assert [h.address for h in box] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        ports = box[0].sh("ip", "-br", "addr", "show", "dev", "eth0")
        assert "10.77.0.1/24" in ports and "UP" in ports
        links = subprocess.run(["ip", "-n", box.switch, "-br", "link"], capture_output=True)
        assert all(f"p{i}@" in links.stdout.decode() for i in range(3))
    assert not set(made) & set(namespaces())


def test_a_killed_runs_namespaces_are_swept_at_the_next_start() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a run that no longer exists
    stale = f"xk-{dead.pid}-0-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with Hosts(1) as box:
            assert stale in box.swept
            assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
    assert stale not in sweep()  # already gone


_LEFT_OPEN = (
    "import sys, time\n"
    "from xferkit.testing.hosts import Hosts\n"
    "box = Hosts(2)\n"
    "box[0].python('-c', 'import time; time.sleep(60)')\n"
    "print(' '.join(box.namespaces()), flush=True)\n"
    "if sys.argv[1] == 'hang': time.sleep(60)\n"
)


def _left_open(how: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _LEFT_OPEN, how], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    names = proc.stdout.readline().split()
    assert len(names) == 3 and set(names) <= set(namespaces())
    return proc, names


def test_a_box_left_open_is_removed_at_interpreter_exit() -> None:
    proc, names = _left_open("exit")
    assert proc.wait(timeout=30) == 0
    assert not set(names) & set(namespaces())


def test_a_box_whose_process_was_killed_is_swept_by_the_next() -> None:
    proc, names = _left_open("hang")
    proc.kill()  # no atexit: the namespaces and the sleeper inside stay behind
    proc.wait()
    assert set(names) <= set(namespaces())
    with Hosts(1) as box:
        assert set(names) <= set(box.swept)
    assert not set(names) & set(namespaces())


def test_each_host_has_its_own_address_and_reaches_the_others_over_tcp(box: Hosts) -> None:
    a, b = box
    with pytest.raises(HostError, match="Cannot assign requested address"):
        a.sh(sys.executable, PEER, "sink", b.address, str(PORT), "1")  # not a's address
    before = a.counters()
    sink = _sink(b, 30)
    payload = 2_000_000
    assert a.sh(sys.executable, PEER, "send", b.address, str(PORT), str(payload)).strip() == "sent"
    got, _ = _received(sink)
    assert got == payload
    after = a.counters()
    assert after.tx_bytes - before.tx_bytes >= payload  # it crossed a's link


def test_a_cut_link_makes_a_connect_fail_and_mending_it_restores_it(box: Hosts) -> None:
    a, b = box
    sink = _sink(b, 30)
    b.cut()
    assert not _connects(a, b, timeout=1.0)
    b.mend()
    deadline = time.monotonic() + 15
    while not _connects(a, b, timeout=2.0):  # ARP settles again after the port comes back
        assert time.monotonic() < deadline, "no connect 15 s after mend"
    sink.kill()


def test_tbf_limits_the_bytes_that_cross_in_a_window(box: Hosts) -> None:
    a, b = box
    rate = 1_000_000  # bytes per second: tc's 8mbit
    a.limit("8mbit", burst="32kb")
    assert "tbf" in a.qdisc()
    sink = _sink(b, 1.5)
    sender = a.python(PEER, "send", b.address, str(PORT), "0", stdout=subprocess.DEVNULL)
    shaped, elapsed = _received(sink)
    sender.kill()
    ceiling = rate * elapsed * 1.25 + 200_000  # the burst, the queue tbf lets wait, headers
    assert 0 < shaped <= ceiling, (shaped, elapsed)
    a.unlimit()
    assert "tbf" not in a.qdisc()
    sink = _sink(b, 1.5)
    sender = a.python(PEER, "send", b.address, str(PORT), "0", stdout=subprocess.DEVNULL)
    free, _ = _received(sink)
    sender.kill()
    assert free > 5 * ceiling, (free, shaped)
    print(f"tbf 8mbit: {shaped} B in {elapsed:.2f} s; unshaped: {free} B")


def test_a_process_in_a_host_freezes_resumes_dies_and_restarts(box: Hosts) -> None:
    a = box[0]
    proc = a.python("-c", "import time\nwhile True: time.sleep(0.05)")
    first = proc.pid
    proc.freeze()
    assert proc.state() == "T"
    proc.resume()
    assert proc.state() != "T"
    assert proc.kill() == -9
    with pytest.raises(HostError, match="has exited"):
        proc.freeze()
    proc.restart()
    deadline = time.monotonic() + 10
    assert proc.alive() and proc.pid != first
    inside = Path(f"/run/netns/{a.name}").stat().st_ino
    while Path(f"/proc/{proc.pid}/ns/net").stat().st_ino != inside:  # ip netns exec's setns
        assert time.monotonic() < deadline, "the restarted process never entered the host"
        time.sleep(0.01)


def test_the_tests_namespace_sees_none_of_the_box(box: Hosts) -> None:
    here = socket.if_nameindex()
    assert all(not name.startswith(("p0", "p1", "br0")) for _, name in here)
