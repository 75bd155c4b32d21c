"""Network faults for chaos scenarios: nodes in network namespaces behind veth pairs, cut off by
dropping their packets, and a userspace relay that delays and loses what crosses it.

* :class:`Net`: one namespace per node, each joined to the host by a veth pair with a /30 of a
  private /24 that no route on the host uses yet. :meth:`Net.cut` puts the ``blackhole`` qdisc
  on both ends of the pair: every packet either side sends is dropped while both links stay up
  (no RST, no FIN, no "link down" for anyone to notice). :meth:`Net.heal` deletes it again.
  Everything made is deleted by :meth:`Net.delete`, whatever state it is in; what a run that was
  killed could not delete, the next one does (:func:`sweep_dead_runs`).
* :class:`Relay`: a TCP relay inside a node's namespace (a thread of this process that joined
  it with ``setns``), listening on the node's address, forwarding to the node over the
  namespace's loopback. The head reaches that node through it, across the veth, so a cut drops
  the head's packets to the relay as it would the node's. It passes bytes through
  until :meth:`Relay.impair` is called; then every chunk the upstream (the node) sends is held
  ``delay`` seconds, and a seeded share ``loss`` of them is "lost". This stands in for
  ``tc qdisc ... netem delay 500ms loss 5%`` on the node's interface, on kernels without
  ``sch_netem`` (and without iptables, nft or a tc classifier that could drop at random), see
  :meth:`Relay.impair` for how close it comes.

Both need root (``unavailable()`` says why not)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import os
import random
import re
import shutil
import subprocess
import threading
import time


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable() -> str | None:
    """Why this machine cannot make namespaces and drop their packets; None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces and tc qdiscs need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (iproute2) on this machine"
    probe = f"sfprobe{os.getpid()}"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()[:200]}"
    try:
        q = sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "blackhole", check=False)
        if q.returncode != 0:
            return f"no blackhole qdisc (tc qdisc add ... blackhole): {q.stderr.strip()[:200]}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no address or route on the host falls in."""
    used = sh("ip", "-4", "-o", "addr").stdout + sh("ip", "-4", "route").stdout
    nets = []
    for word in used.split():
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(word, strict=False))
    for k in range(213, 256):
        cand = ipaddress.ip_network(f"10.{k}.7.0/24")
        if not any(cand.overlaps(n) for n in nets if n.prefixlen > 0):
            return cand
    raise RuntimeError("no free 10.x.7.0/24 for the namespaces")


RUN_NAME = re.compile(r"^sfc(\d+)[nh](\d+)$")  # a run's namespace (n) or host link (h), by its pid


def sweep_dead_runs() -> list[str]:
    """Delete the namespaces and host links of runs whose process is gone (a run killed with
    SIGKILL cannot delete its own); the names deleted. A link's peer goes with it."""
    names = sh("ip", "netns", "list", check=False).stdout.split()
    names += [w.split("@")[0] for w in sh("ip", "-br", "link", check=False).stdout.split()]
    gone = []
    for name in sorted(set(names)):
        m = RUN_NAME.match(name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        if name[len("sfc") + len(m.group(1))] == "h":
            sh("ip", "link", "del", name, check=False)
        else:
            sh("ip", "netns", "del", name, check=False)
        gone.append(name)
    return gone


class Net:
    """Namespaces ``sfc<pid>n<i>``, each with a veth pair ``sfc<pid>h<i>`` (host) / ``...n<i>``
    (inside); node ``i`` is ``10.K.7.(4i+2)``, its host end ``10.K.7.(4i+1)``, a /30 each. The
    pid names the run, so a later run can tell a dead run's leftovers (:func:`sweep_dead_runs`)."""

    def __init__(self) -> None:
        sweep_dead_runs()
        self.tag = f"sfc{os.getpid()}"  # at most 15 characters with the suffix (a link name's limit)
        self.subnet = free_subnet()
        self.made: list[int] = []
        self.cut_now: set[int] = set()

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def host_if(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def node_if(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def addr(self, i: int, host: bool = False) -> str:
        return str(self.subnet.network_address + 4 * i + (1 if host else 2))

    def add(self, i: int) -> str:
        """Make node ``i``'s namespace and link; its address."""
        ns, h, v = self.ns(i), self.host_if(i), self.node_if(i)
        sh("ip", "netns", "add", ns)
        self.made.append(i)
        sh("ip", "link", "add", h, "type", "veth", "peer", "name", v)
        sh("ip", "link", "set", v, "netns", ns)
        sh("ip", "addr", "add", f"{self.addr(i, True)}/30", "dev", h)
        sh("ip", "link", "set", h, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr(i)}/30", "dev", v)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", v, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return self.addr(i)

    def cut(self, i: int) -> None:
        """Drop every packet on node ``i``'s link, both ways; the links stay up."""
        sh("tc", "qdisc", "replace", "dev", self.host_if(i), "root", "blackhole")
        sh("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "replace", "dev", self.node_if(i), "root", "blackhole")
        self.cut_now.add(i)

    def heal(self, i: int) -> None:
        sh("tc", "qdisc", "del", "dev", self.host_if(i), "root", check=False)
        sh("ip", "netns", "exec", self.ns(i), "tc", "qdisc", "del", "dev", self.node_if(i), "root", check=False)
        self.cut_now.discard(i)

    def link_up(self, i: int) -> bool:
        out = sh("ip", "-br", "link", "show", self.host_if(i), check=False).stdout
        return "LOWER_UP" in out or " UP " in out

    def dropped(self, i: int) -> int:
        """Packets the host end's blackhole dropped so far (0 when none is there)."""
        out = sh("tc", "-s", "qdisc", "show", "dev", self.host_if(i), check=False).stdout
        words = out.replace(",", " ").replace("(", " ").split()
        for a, b in zip(words, words[1:]):
            if a == "dropped" and b.isdigit():
                return int(b)
        return 0

    def delete(self) -> None:
        """Delete every link and namespace made (a namespace's processes must be stopped first)."""
        for i in list(self.made):
            sh("ip", "link", "del", self.host_if(i), check=False)  # takes its peer with it
            sh("ip", "netns", "del", self.ns(i), check=False)
            self.made.remove(i)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this run still there (after delete: none)."""
        names = sh("ip", "netns", "list", check=False).stdout + sh("ip", "-br", "link", check=False).stdout
        return sorted({w.split("@")[0] for w in names.split() if w.startswith(self.tag)})


CLONE_NEWNET = 0x40000000


def join_netns(name: str) -> None:
    """Move the calling thread (only it) into network namespace ``name``: the sockets it makes
    from now on live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Relay:
    """``listen`` -> ``target``, byte for byte, in a thread with its own event loop (inside
    namespace ``ns`` when given); impaired on demand (:meth:`impair`)."""

    def __init__(self, target: tuple[str, int], seed: int, listen: tuple[str, int] = ("127.0.0.1", 0),
                 ns: str | None = None):
        self.target, self.listen, self.ns = target, listen, ns
        self.error: BaseException | None = None
        self.rng = random.Random(seed)
        self.delay = 0.0
        self.loss = 0.0
        self.rto = 0.0
        self.chunks = 0  # node -> head chunks while impaired
        self.lost = 0
        self.conns = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        ready = threading.Event()

        def main() -> None:
            try:
                if self.ns:
                    join_netns(self.ns)
                loop = asyncio.new_event_loop()
                self._server = loop.run_until_complete(asyncio.start_server(self._handle, *self.listen))
            except BaseException as e:
                self.error = e
                ready.set()
                return
            self._loop = loop
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name="chaos-relay", daemon=True)
        self._thread.start()
        ready.wait(10)
        if self.error is not None or not self.port:
            raise RuntimeError(f"the relay did not start: {self.error!r}")
        return self.port

    def impair(self, delay: float, loss: float, rto: float) -> None:
        """From now on (live connections too): each chunk the node sends reaches the head
        ``delay`` s later, in order, and a new connection is answered ``delay`` s late (the
        SYN-ACK's trip). A "lost" chunk (``loss``, seeded) is what TCP makes of a lost segment:
        it arrives one retransmission timeout (``rto``) later than it would have, and every
        chunk behind it waits too. The delay and loss are per chunk a read returned, not per
        packet; the head -> node direction is not delayed (netem on the node's egress only)."""
        self.delay, self.loss, self.rto = delay, loss, rto

    def clear(self) -> None:
        self.delay = self.loss = self.rto = 0.0

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.conns += 1
        uw = None
        try:
            # under a cut the SYN is dropped and the kernel retries for two minutes: 30 s is plenty
            ur, uw = await asyncio.wait_for(asyncio.open_connection(*self.target), 30)
            if self.delay:
                await asyncio.sleep(self.delay)
            down = asyncio.create_task(self._down(ur, cw))
            up = asyncio.create_task(self._up(cr, uw))
            # HTTP clients do not half-close: either side's end ends the connection
            await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            for t in (down, up):
                t.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            for w in (cw, uw):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _up(self, cr: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
        while True:
            data = await cr.read(65536)
            if not data:
                with contextlib.suppress(OSError):
                    uw.write_eof()
                return
            uw.write(data)
            await uw.drain()

    async def _down(self, ur: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        """Node -> head: each chunk released at its arrival + delay (+ rto if lost), in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            while True:
                data = await ur.read(65536)
                at = time.monotonic()
                if data and self.delay:
                    self.chunks += 1
                    at += self.delay
                    if self.rng.random() < self.loss:
                        self.lost += 1
                        at += self.rto
                await queue.put((at, data))
                if not data:
                    return

        reader = asyncio.create_task(read())
        try:
            release = 0.0
            while True:
                at, data = await queue.get()
                release = max(release, at)  # a lost chunk holds back the ones behind it
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    return
                cw.write(data)
                await cw.drain()
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shut() -> None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.sleep(0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None
